"""TORCH_SDPA's kept decode gather (opt-in: ``make_impl(..., keep_decode_gather_bytes=N)``).

A decode step's attention on the CPU gathers every request's K/V rows into one buffer; between two
decode steps of the same requests that buffer differs only in the rows of the tokens the step
wrote and in rows whose index moved (a new block, a changed table row, a request that left or
joined). With the option on, each layer keeps its buffer (:class:`KeptGather`); the step plan
finds the rows to refresh once per step (:func:`refresh_rows`) and each layer regathers only
those (:func:`gather_kept`). The buffer's values are the full gather's bit for bit, padding rows
included, and the attention that reads it is unchanged. A layer keeps a buffer of at most the
option's bytes: a larger step gathers into the step's shared buffer as without the option, and the
layer lets its old buffer go (the kept buffers would otherwise add a float32 copy of the batch's
K/V per layer to the cache's memory).

When a partial refresh is allowed is proved, not assumed, by a :class:`CacheLedger` kept on the
cache's base tensor. Every view of one base shares its in-place version counter, so every layer
view of one storage does. The counter must have moved only by the backend's own cache writes,
and the layer's own view must have been written at most once since its last gather, with this
step's slot mapping. Anything else (a write by another op, a second write, an unknown slot
tensor) regathers in full.

What the ledger cannot see, and why the option is off by default:

- writes that bypass torch's version counter: raw pointers (NIXL, a peer's RDMA, ctypes), a
  non-torch kernel, ``cache.numpy()[...] = x``, a tensor over the same memory that is not a view
  of the cache's base;
- inference tensors (made under ``torch.inference_mode``), which keep no version counter: for
  them the option gathers in full every step.

Several tensors over one memory (kvstack's runner views the pool once per KV group, each with
its own counter) are safe as long as a block belongs to one group at a time: a group's writes
then never land in rows another group's index holds. A layer's kept buffer is its own, as large
as one full gather of its step (``rows x D`` float32), and lives as long as the impl.

A caller that turns the option on promises to report such writes with
``torch.autograd.graph.increment_version(cache)`` before the next forward; kvstack's engine does
so after each external KV load. Off the CPU the option does nothing (GPU writes go through raw
pointers, and the gather there is cheap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from kv_backends.backends.torch_sdpa_plan import _StepPlan

__all__ = [
    "CacheLedger",
    "KeptGather",
    "cache_ledger",
    "gather_kept",
    "refresh_rows",
    "view_key",
]


@dataclass(slots=True, eq=False)
class CacheLedger:
    """What the backend's own writes did to one cache base tensor (kept on it, see
    :func:`cache_ledger`): ``version`` is the base's ``_version`` after the last write the ledger
    saw, ``epoch`` counts the times it found the version moved by something else (any such
    write voids every layer's kept gather), ``writes`` maps a layer view (:func:`view_key`) to
    its count of own writes and the slot tensor of the last."""

    version: int
    epoch: int = 0
    writes: dict[tuple[object, ...], tuple[int, torch.Tensor]] = field(default_factory=dict)

    def sync(self, view: torch.Tensor) -> None:
        """Call before an own write or a gather: a version other than the recorded one means
        someone else wrote since, so the epoch moves on."""
        if view._version != self.version:
            self.epoch += 1
            self.version = view._version

    def wrote(self, view: torch.Tensor, slots: torch.Tensor) -> None:
        """Record an own write of ``slots`` into ``view`` (after it, with :meth:`sync` before)."""
        key = view_key(view)
        count = self.writes[key][0] if key in self.writes else 0
        self.writes[key] = (count + 1, slots)
        self.version = view._version


def view_key(view: torch.Tensor) -> tuple[object, ...]:
    return (view.data_ptr(), view.shape, view.stride())


def cache_ledger(view: torch.Tensor) -> CacheLedger | None:
    """The :class:`CacheLedger` of ``view``'s base tensor (the holder of the version counter
    every view of it shares), made on first use and kept as an attribute of the base, so it
    lives and dies with the cache; ``None`` for an inference tensor (no version counter)."""
    if view.is_inference():
        return None
    base = view._base if view._base is not None else view
    ledger: CacheLedger | None = getattr(base, "_kv_backends_ledger", None)
    if ledger is None:
        ledger = CacheLedger(view._version)
        base._kv_backends_ledger = ledger  # type: ignore[attr-defined]
    return ledger


@dataclass(slots=True, eq=False)
class KeptGather:
    """One layer's gathered K/V ``buffer`` ``[rows, D]`` of its last decode step: rows
    ``index`` of ``row_array``, as of ledger epoch ``epoch`` and ``writes`` own writes of the
    layer's view (see the module docstring for when a step may update it in place). ``views``:
    the decode run's per-group views of ``buffer`` with the run's layout key
    (:meth:`.torch_sdpa_decode.DecodeRun.views`), kept while the buffer is."""

    row_array: torch.Tensor
    index: torch.Tensor
    buffer: torch.Tensor
    epoch: int
    writes: int
    views: tuple[object, list[tuple[torch.Tensor, torch.Tensor]]] | None = None


def refresh_rows(
    plan: _StepPlan,
    geometry: tuple[object, ...],
    offsets: tuple[int, torch.Tensor],
    previous: torch.Tensor,
    slots: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of ``plan.kv_index[geometry]`` (a cache geometry whose row offsets are
    ``offsets``) a layer must regather over a buffer that holds rows ``previous`` (an earlier
    step's index of the same shape), where the cache changed since only in slots ``slots``
    ``[T]`` (``-1`` skipped; ``None``: nothing written): ``(positions, rows)`` int64 ``[P]``
    each, the positions in the buffer and the row-array rows they now read. Those are the
    positions whose row changed and every position reading a written slot's row (a new token,
    or a padding row over the same slot). ``None`` where more than half the rows would be
    regathered (a full gather costs less). Computed once per step and shared by the layers
    (kept in ``plan.refreshes``)."""
    key = (geometry, id(previous), id(slots))
    kept = plan.refreshes.get(key)
    if kept is None or kept[0] is not previous or kept[1] is not slots:
        index = plan.kv_index[geometry]  # [rows]
        changed = index != previous  # [rows]
        if slots is not None and slots.numel():
            # Position (kv, g, h, c, n) of a group reads slot table_rows[g, c] * N + n, and a
            # write of slot s writes K and V of every head: so mark the written slots, look up
            # each (request, block, token) of the batch (a few thousand, not one per row), and
            # spread the answer over K/V and heads, one op per group. An isin(index, written
            # rows) over every row cost more than the gather it saves.
            n = offsets[1].shape[4]  # tokens per (kernel) block: slots count in those
            num_slots = int(plan.key[1]) * n  # type: ignore[call-overload]
            marked = torch.zeros(num_slots, dtype=torch.bool, device=index.device)
            marked[slots[(slots >= 0) & (slots < num_slots)]] = True  # the rest wrote nothing
            tokens = torch.arange(n, device=index.device)
            hit = marked[(plan.table_rows * n)[:, :, None] + tokens]  # [R', width, N]
            written = torch.empty_like(changed)  # [rows]
            sizes = [offsets[1].numel() * rows.numel() for rows in plan.rows]
            views = written.split(sizes) if len(sizes) > 1 else [written]
            for view, rows, (g0, g1) in zip(views, plan.rows, plan.bounds, strict=True):
                nblk = rows.shape[1]
                view.view(2, g1 - g0, offsets[1].shape[2], nblk, n).copy_(
                    hit[None, g0:g1, None, :nblk]
                )  # [2, G, H, nblk, N]
            changed |= written
        positions = changed.nonzero().view(-1)  # [P]
        found = None
        if 2 * positions.numel() <= index.numel():
            found = (positions, index.index_select(0, positions))
        kept = plan.refreshes[key] = (previous, slots, found)
    return kept[2]  # type: ignore[return-value]


def gather_kept(
    kept: KeptGather | None,
    kv_cache: torch.Tensor,
    row_array: torch.Tensor,
    index: torch.Tensor,
    plan: _StepPlan,
    geometry: tuple[object, ...],
    offsets: tuple[int, torch.Tensor],
    slot_mapping: torch.Tensor,
    new_buffer: Callable[[], torch.Tensor],
) -> KeptGather | None:
    """A layer's gather holding rows ``index`` ``[rows]`` of ``row_array`` (views of
    ``kv_cache``, the layer's cache view): its last decode step's gather ``kept`` with only the
    changed rows regathered where the ledger proves that gives the full gather's values, else a
    full gather into its buffer (or into ``new_buffer()``). The layer keeps what this returns
    for the next step. ``slot_mapping`` is this step's (the metadata's). ``None`` for an
    inference tensor: nothing can be proved, so nothing is worth keeping."""
    ledger = cache_ledger(kv_cache)
    if ledger is None:
        return None
    ledger.sync(kv_cache)  # a write since the last own one: the epoch moves on
    writes, slots = ledger.writes.get(view_key(kv_cache), (0, None))
    refresh = None
    if (
        kept is not None
        and kept.row_array is row_array
        and kept.epoch == ledger.epoch
        and kept.index.shape == index.shape
    ):
        if writes == kept.writes:  # nothing written to this view since the last gather
            refresh = refresh_rows(plan, geometry, offsets, kept.index, None)
        elif writes == kept.writes + 1 and slots is slot_mapping:
            # one write since, of this step's slots
            refresh = refresh_rows(plan, geometry, offsets, kept.index, slots)
    if refresh is None or kept is None:
        same = kept is not None and kept.buffer.shape[0] == index.numel()
        buffer = kept.buffer if same else new_buffer()  # type: ignore[union-attr]
        torch.index_select(row_array, 0, index, out=buffer)
    else:
        buffer = kept.buffer
        positions, rows = refresh
        if positions.numel():
            buffer.index_copy_(0, positions, row_array.index_select(0, rows))
    views = kept.views if kept is not None and kept.buffer is buffer else None
    return KeptGather(row_array, index, buffer, ledger.epoch, writes, views)
