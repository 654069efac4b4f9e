"""TORCH_SDPA's decode-only step, as few ops as its arithmetic allows.

A decode-only step (every request one query row) on a float32 row-array cache with no sinks,
softcap, ALiBi or K/V scales runs, per layer, the ops of the general path and nothing else: one
row gather of every group's K/V, one query gather, ``baddbmm`` / ``softmax`` / ``bmm`` per group
and one gather that puts the outputs back in row order. The buffers those ops write and the
per-group views over them are made once per step (:class:`DecodeRun`, kept on the step plan) and
shared by the step's layers: a layer overwrites them only after the previous layer's output was
copied out (the output is always a fresh tensor), so no layer sees another's values. On a small
model's decode step the views, shape checks and temporaries cost more host time than the
arithmetic; the values are those of the general path bit for bit (the same kernels on the same
shapes; ``test_torch_sdpa_batched.py`` compares the two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kv_backends.backends._torch_masks import PaddedMask
    from kv_backends.backends.torch_sdpa_plan import _StepPlan

__all__ = ["DecodeRun", "KVViews"]

#: per group, the ``[G*H, D, Sb]`` K^T and ``[G*H, Sb, D]`` V views of a gather buffer
KVViews = list[tuple[torch.Tensor, torch.Tensor]]


class DecodeRun:
    """One decode-only step's buffers and per-group views for layers of one cache geometry and
    one mask rule (``masks``, one per group, from the plan's :meth:`masks_for`).

    A gather buffer ``[rows, D]`` holds each group's K rows then its V rows (the plan's flat row
    index order): the one shared by the step's layers, or one a subclass's
    :meth:`~.torch_sdpa.TorchSDPAImpl.decode_gather` returns;
    ``q_dec`` / ``o_dec`` ``[R, Hq, D]`` the queries and outputs in group order,
    ``logits`` one ``[G*H, rep, Sb]`` buffer per group; ``inverse`` ``[R]`` maps each query row
    to its place in group order (the inverse of the plan's ``decode_rows``)."""

    def __init__(
        self,
        plan: _StepPlan,
        num_index_rows: int,
        masks: list[PaddedMask],
        num_kv_heads: int,
        q_per_kv: int,
        head_size: int,
        device: torch.device,
    ) -> None:
        h, rep, d = num_kv_heads, q_per_kv, head_size
        rows = plan.decode_rows  # [R] query row of each request, in group order
        r = rows.numel()
        f32 = torch.float32
        self.num_index_rows, self.head_size, self.device = num_index_rows, d, device
        self._shared: torch.Tensor | None = None  # the layers' common buffer, made on demand
        self.q_dec = torch.empty(r, h * rep, d, dtype=f32, device=device)
        self.o_dec = torch.empty(r, h * rep, d, dtype=f32, device=device)
        self.rows = rows
        self.inverse = torch.empty_like(rows)
        self.inverse[rows] = torch.arange(r, device=device)
        # per group: (additive mask, q, logits, out, K/V start, G*H, Sb); the K^T and V views
        # depend on the gather buffer (:meth:`views`)
        self.groups: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]
        ]
        self.groups = []
        start = 0
        for group, (g0, g1), mask in zip(plan.groups, plan.bounds, masks, strict=True):
            gh, sb = (g1 - g0) * h, group.seq_len
            logits = torch.empty(gh, rep, sb, dtype=f32, device=device)
            q = self.q_dec[g0:g1].view(gh, rep, d)
            out = self.o_dec[g0:g1].view(gh, rep, d)
            self.groups.append((mask.additive, q, logits, out, start, gh, sb))
            start += 2 * gh * sb
        if start != num_index_rows:
            raise AssertionError(f"decode run covers {start} index rows of {num_index_rows}")
        # per buffer (by id, the buffer kept beside its views): each group's (K^T, V)
        self._views: dict[int, tuple[torch.Tensor, KVViews]] = {}
        # what those views depend on besides the buffer: a caller that keeps a buffer of its own
        # between steps may keep its views too while this stays the same
        self.view_key = (d, tuple((start, gh, sb) for *_, start, gh, sb in self.groups))

    def shared_buffer(self) -> torch.Tensor:
        """``[rows, D]``: the buffer layers that keep no gather of their own share."""
        if self._shared is None:
            self._shared = self.new_buffer()
        return self._shared

    def new_buffer(self) -> torch.Tensor:
        """An uninitialised ``[rows, D]`` float32 gather buffer of this run's shape."""
        return torch.empty(
            self.num_index_rows, self.head_size, dtype=torch.float32, device=self.device
        )

    def views(self, gathered: torch.Tensor) -> KVViews:
        """Per group, the ``[G*H, D, Sb]`` K^T and ``[G*H, Sb, D]`` V views of ``gathered``
        (made once per buffer per step; they depend on ``gathered`` and :attr:`view_key` only)."""
        made = self._views.get(id(gathered))
        if made is None or made[0] is not gathered:
            d = self.head_size
            kv = []
            for *_, start, gh, sb in self.groups:
                n = gh * sb
                k = gathered[start : start + n].view(gh, sb, d)
                v = gathered[start + n : start + 2 * n].view(gh, sb, d)
                kv.append((k.transpose(1, 2), v))
            made = self._views[id(gathered)] = (gathered, kv)
        return made[1]

    def attend(
        self,
        gathered: torch.Tensor,
        q: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
        views: KVViews | None = None,
    ) -> torch.Tensor:
        """Attention of ``q`` ``[R, Hq, D]`` (float32, every row a decode query) over the K/V
        rows in ``gathered`` ``[rows, D]`` (the plan's flat row index order, filled by the
        caller); returns ``[R, Hq, D]`` in query row order (``out`` when given, else a new
        tensor). ``views``: :meth:`views` of ``gathered`` where the caller kept them."""
        torch.index_select(q, 0, self.rows, out=self.q_dec)
        for (additive, qg, logits, o, *_), (kt, v) in zip(
            self.groups, self.views(gathered) if views is None else views, strict=True
        ):
            # scale * (q . k) + (0 or -inf), the softmax in place, then the weighted values:
            # the general path's _attend_explicit on the same shapes, without its temporaries.
            torch.baddbmm(additive, qg, kt, alpha=scale, out=logits)
            torch.softmax(logits, dim=-1, out=logits)
            torch.bmm(logits, v, out=o)
        if out is None:
            return self.o_dec.index_select(0, self.inverse)
        return torch.index_select(self.o_dec, 0, self.inverse, out=out)
