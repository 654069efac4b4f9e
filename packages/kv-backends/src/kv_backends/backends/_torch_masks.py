"""Which keys each query row of a padded attention group sees (split from
:mod:`~kv_backends.backends._torch_ops`): :class:`PaddedMask`, built per group by
:func:`padded_mask` or for every decode group of a step at once by :func:`decode_masks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kv_backends.backends._torch_ops import PaddedGroup

__all__ = ["PaddedMask", "decode_masks", "padded_mask"]


@dataclass(frozen=True)
class PaddedMask:
    """Which keys each padded query row of a group sees, with the rows' and keys' positions.
    :attr:`additive` is the same mask as a ``0 / -inf`` term laid out like the grouped-query
    logits (``[G * H, rep * Lb, Sb]``, ``rep = Hq // H``) so ``baddbmm`` applies it with the
    scale; it is made on first use, since only the explicit softmax reads it (a prefill group's
    SDPA call takes ``allowed``, and its additive term would be megabytes per step)."""

    allowed: torch.Tensor  # [G, Lb, Sb] bool
    q_pos: torch.Tensor  # [G, Lb] int64
    kv_pos: torch.Tensor  # [Sb] int64
    num_kv_heads: int  # H
    q_per_kv: int  # rep
    #: :attr:`additive` when the caller made it (:func:`decode_masks`, batch-wide).
    additive_term: torch.Tensor | None = field(default=None, compare=False, repr=False)
    #: every real row ``i`` sees exactly keys ``0..i`` (a causal prefill of whole prompts, no
    #: cached context, no window): SDPA's own top-left causal mask then equals :attr:`allowed` on
    #: the real rows, and needs no mask tensor (pad rows differ: they are dropped)
    top_left_causal: bool = False

    @cached_property
    def sdpa_bias(self) -> torch.Tensor:
        """``[G, 1, Lb, Sb]`` float32, ``0`` where ``allowed``, else ``-inf``: the float mask
        SDPA would make of the boolean one on every call, made once and shared by the layers
        that reuse this mask (the same values, so the same attention bits)."""
        bias = torch.zeros(self.allowed.shape, device=self.allowed.device)
        return bias.masked_fill_(~self.allowed, float("-inf"))[:, None]

    @cached_property
    def additive(self) -> torch.Tensor:
        """``[G * H, rep * Lb, Sb]`` float32, ``0`` where ``allowed``, else ``-inf`` (or a view
        that broadcasts to it)."""
        if self.additive_term is not None:
            return self.additive_term
        g, lb, sb = self.allowed.shape
        h, rep = self.num_kv_heads, self.q_per_kv
        additive = torch.full(self.allowed.shape, float("-inf"), device=self.allowed.device)
        additive.masked_fill_(self.allowed, 0.0)  # [G, Lb, Sb]
        return additive[:, None, None].expand(g, h, rep, lb, sb).reshape(g * h, rep * lb, sb)


def padded_mask(
    group: PaddedGroup,
    causal: bool,
    sliding_window: int | None,
    num_kv_heads: int,
    q_per_kv: int,
    *,
    whole_prompts: bool = False,
) -> PaddedMask:
    """The group's mask under the layer's rules (the same for every layer with the same rules and
    head counts, so callers may reuse it). Pad rows see key 0 only, so no row is all ``-inf``.
    ``whole_prompts``: the caller knows (on the host) that every request's query is its whole
    context (``q_len == seq_len``), so a causal mask without a window is
    :attr:`PaddedMask.top_left_causal`."""
    lb, sb, device = group.query_len, group.seq_len, group.seq_lens.device
    s = group.seq_lens[:, None]  # [G, 1]
    if lb == 1:  # a decode group: every query length is 1
        q_pos = s - 1  # [G, 1]
    else:
        q_pos = s - group.q_lens[:, None] + torch.arange(lb, device=device)[None, :]  # [G, Lb]
    kv_pos = torch.arange(sb, device=device)  # [Sb]
    allowed = kv_pos[None, None, :] < s[:, :, None]  # [G, 1, Sb]: the context
    if causal and lb > 1:  # a decode row sits at s - 1: causal adds nothing to the context rule
        allowed = allowed & (kv_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        # As attend_one_request: the window counts the query itself, both sides when non-causal.
        allowed = allowed & ((q_pos[:, :, None] - kv_pos[None, None, :]).abs() < sliding_window)
    allowed = allowed.expand(-1, lb, -1)
    if lb > 1:
        pad = ~group.q_valid[:, :, None] & (kv_pos == 0)[None, None, :]  # [G, Lb, Sb]
        allowed = (allowed & group.q_valid[:, :, None]) | pad
    top_left = whole_prompts and causal and sliding_window is None and lb > 1
    return PaddedMask(allowed, q_pos, kv_pos, num_kv_heads, q_per_kv, top_left_causal=top_left)


def decode_masks(
    seq_lens: torch.Tensor,
    groups: list[tuple[int, int]],
    sliding_window: int | None,
    num_kv_heads: int,
    q_per_kv: int,
) -> list[PaddedMask]:
    """:func:`padded_mask` of decode groups (``Lb = 1``; causal or not, a decode row at
    ``s - 1`` sees the context ``kv_pos < s``, and a window bounds it), from batch-wide tensors:
    a fixed handful of ops per step where each group took a handful. ``seq_lens`` ``[R_dec]``
    int64 holds the groups' requests in group order; ``groups`` gives each group's ``(G, Sb)``.
    Each :attr:`PaddedMask.additive` is a ``[G * H, 1, Sb]`` view of one ``[R_dec, H, Sb_max]``
    tensor that ``baddbmm`` broadcasts over the ``rep`` query heads of a KV head: it copies its
    input into the result before the product, so the logits are bitwise those of the
    materialized ``[G * H, rep, Sb]`` term (test_torch_sdpa_batched.py checks it)."""
    device = seq_lens.device
    kv_pos = torch.arange(max(sb for _, sb in groups), device=device)  # [Sb_max]
    s = seq_lens[:, None, None]  # [R_dec, 1, 1]
    q_pos = s - 1  # [R_dec, 1, 1]
    allowed = kv_pos < s  # [R_dec, 1, Sb_max]: the context
    if sliding_window is not None:
        allowed &= (q_pos - kv_pos).abs() < sliding_window
    h = num_kv_heads
    additive = torch.where(allowed.expand(-1, h, -1), 0.0, float("-inf"))  # [R_dec, H, Sb_max]
    masks, g0 = [], 0
    for g, sb in groups:
        rows = slice(g0, g0 + g)
        term = additive[rows, :, :sb].view(g * h, 1, sb)
        mask = PaddedMask(allowed[rows, :, :sb], q_pos[rows, 0], kv_pos[:sb], h, q_per_kv, term)
        masks.append(mask)
        g0 += g
    return masks
