"""The engine's TORCH_SDPA on the CPU: each layer keeps its decode gather between steps.

kv-backends' TORCH_SDPA is the reference: every forward gathers what it reads from the cache as it
is, and keeps nothing between calls. On the CPU that gather is a large part of a small model's
decode step, and between two decode steps of the same requests the gathered buffer differs only
in the rows of the tokens the step wrote and in rows whose index moved (a new block, a changed
table row, a request that left or joined). :class:`KeptGatherSDPAImpl` (the reference impl with
:meth:`~kv_backends.backends.torch_sdpa.TorchSDPAImpl.decode_gather` overridden) keeps each
layer's buffer (:class:`KeptGather`); the rows to refresh are found once per step and shared by
the engine's layers (:func:`refresh_rows`, through :class:`KeptGatherSteps`) and each layer
regathers only those (:func:`gather_kept`). The buffer's values are the full gather's bit for bit,
padding rows included, and the attention that reads it is the reference's. A layer keeps a buffer
of at most ``keep_decode_gather_bytes``: a larger step gathers into the step's shared buffer as
the reference does, and the layer lets its old buffer go (the kept buffers would otherwise add a
float32 copy of the batch's K/V per layer to the cache's memory).

When a partial refresh is allowed is proved, not assumed, by a :class:`CacheLedger` kept on the
cache's base tensor. Every view of one base shares its in-place version counter, so every layer
view of one storage does. The counter must have moved only by the impl's own cache writes, and
the layer's own view must have been written at most once since its last gather, with this step's
slot mapping. Anything else (a write by another op, a second write, an unknown slot tensor)
regathers in full.

What the ledger cannot see, and why only an engine that reports such writes may use this impl:

- writes that bypass torch's version counter: raw pointers (NIXL, a peer's RDMA, ctypes), a
  non-torch kernel, ``cache.numpy()[...] = x``, a tensor over the same memory that is not a view
  of the cache's base;
- inference tensors (made under ``torch.inference_mode``), which keep no version counter: for
  them the impl gathers in full every step.

Several tensors over one memory (the runner views the pool once per KV group, each with its own
counter) are safe as long as a block belongs to one group at a time: a group's writes then never
land in rows another group's index holds. A layer's kept buffer is its own, as large as one full
gather of its step (``rows x D`` float32), and lives as long as the impl.

The engine reports such writes with ``torch.autograd.graph.increment_version(cache)`` before the
next forward (:meth:`kvstack.engine.runner.ModelRunner.note_external_writes`, after each external
KV load). Off the CPU the impl is the reference (GPU writes go through raw pointers, and the
gather there is cheap); :class:`EngineImpls` picks it for TORCH_SDPA on the CPU only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kv_backends import AttentionBackend, AttentionConfig, AttentionImpl, AttentionMetadata
from kv_backends.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from kv_backends.backends.torch_sdpa_decode import DecodeRun, KVViews
    from kv_backends.backends.torch_sdpa_plan import _StepPlan
    from kv_spec import KVCacheLayout

__all__ = [
    "CacheLedger",
    "EngineImpls",
    "KeptGather",
    "KeptGatherSDPAImpl",
    "KeptGatherSteps",
    "cache_ledger",
    "gather_kept",
    "kept_gather_budget",
    "refresh_rows",
    "view_key",
]

#: per (geometry, previous index, slots): ``(previous, slots, refresh rows or None)``
Refreshes = dict[tuple[object, ...], tuple[object, ...]]


@dataclass(slots=True, eq=False)
class CacheLedger:
    """What the impl's own writes did to one cache base tensor (kept on it, see
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
    ledger: CacheLedger | None = getattr(base, "_kvstack_kept_ledger", None)
    if ledger is None:
        ledger = CacheLedger(view._version)
        base._kvstack_kept_ledger = ledger  # type: ignore[attr-defined]
    return ledger


@dataclass(slots=True, eq=False)
class KeptGather:
    """One layer's gathered K/V ``buffer`` ``[rows, D]`` of its last decode step: rows
    ``index`` of ``row_array``, as of ledger epoch ``epoch`` and ``writes`` own writes of the
    layer's view (see the module docstring for when a step may update it in place). ``views``:
    the decode run's per-group views of ``buffer`` with the run's layout key
    (:meth:`~kv_backends.backends.torch_sdpa_decode.DecodeRun.views`), kept while the buffer is."""

    row_array: torch.Tensor
    index: torch.Tensor
    buffer: torch.Tensor
    epoch: int
    writes: int
    views: tuple[object, KVViews] | None = None


class KeptGatherSteps:
    """What the kept impls of one engine share within a step: per step plan (every layer of a
    KV group reads one plan a step), the :func:`refresh_rows` answers the first layer found.
    Weakly keyed, so a step's answers go with its plan."""

    def __init__(self) -> None:
        self._by_plan: weakref.WeakKeyDictionary[_StepPlan, Refreshes] = weakref.WeakKeyDictionary()

    def refreshes(self, plan: _StepPlan) -> Refreshes:
        """The answers kept for ``plan`` (a new, empty dict on its first layer)."""
        found = self._by_plan.get(plan)
        if found is None:
            found = self._by_plan[plan] = {}
        return found


def refresh_rows(
    plan: _StepPlan,
    geometry: tuple[object, ...],
    offsets: tuple[int, torch.Tensor],
    previous: torch.Tensor,
    slots: torch.Tensor | None,
    known: Refreshes,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of ``plan.kv_index[geometry]`` (a cache geometry whose row offsets are
    ``offsets``) a layer must regather over a buffer that holds rows ``previous`` (an earlier
    step's index of the same shape), where the cache changed since only in slots ``slots``
    ``[T]`` (``-1`` skipped; ``None``: nothing written): ``(positions, rows)`` int64 ``[P]``
    each, the positions in the buffer and the row-array rows they now read. Those are the
    positions whose row changed and every position reading a written slot's row (a new token,
    or a padding row over the same slot). ``None`` where more than half the rows would be
    regathered (a full gather costs less). Computed once per step and shared by the layers
    (kept in ``known``, :meth:`KeptGatherSteps.refreshes` of ``plan``)."""
    key = (geometry, id(previous), id(slots))
    kept = known.get(key)
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
        kept = known[key] = (previous, slots, found)
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
    known: Refreshes,
) -> KeptGather | None:
    """A layer's gather holding rows ``index`` ``[rows]`` of ``row_array`` (views of
    ``kv_cache``, the layer's cache view): its last decode step's gather ``kept`` with only the
    changed rows regathered where the ledger proves that gives the full gather's values, else a
    full gather into its buffer (or into ``new_buffer()``). The layer keeps what this returns
    for the next step. ``slot_mapping`` is this step's (the metadata's); ``known`` the step's
    shared :func:`refresh_rows` answers. ``None`` for an inference tensor: nothing can be
    proved, so nothing is worth keeping."""
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
            refresh = refresh_rows(plan, geometry, offsets, kept.index, None, known)
        elif writes == kept.writes + 1 and slots is slot_mapping:
            # one write since, of this step's slots
            refresh = refresh_rows(plan, geometry, offsets, kept.index, slots, known)
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


class KeptGatherSDPAImpl(TorchSDPAImpl):
    """TORCH_SDPA's impl whose layer keeps its decode step's gathered K/V on the CPU, when that
    buffer takes at most ``keep_decode_gather_bytes`` bytes (an int > 0), and regathers only the
    rows that changed by the next decode step (see the module docstring; every output is the
    reference's bit for bit). The caller must report cache writes that bypass torch's version
    counter with ``torch.autograd.graph.increment_version``. ``steps``: the
    :class:`KeptGatherSteps` the engine's layers share (a new one when not given, so the layer
    finds its refresh rows alone). MLA layers keep nothing (the reference's latent path)."""

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        keep_decode_gather_bytes: int,
        steps: KeptGatherSteps | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, layout, **kw)
        limit = keep_decode_gather_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise TypeError(
                f"KeptGatherSDPAImpl keep_decode_gather_bytes={limit!r} must be an int > 0: the "
                "largest decode gather (bytes) a layer keeps between steps on the CPU (for none, "
                "use kv-backends' TorchSDPAImpl)"
            )
        #: the budget of this layer's kept gather; 0 on MLA layers (they keep none)
        self.keep_decode_gather_bytes = 0 if self.kv_lora_rank is not None else limit
        self.steps = KeptGatherSteps() if steps is None else steps
        #: this layer's decode gather of its last step, when kept
        self.kept_gather: KeptGather | None = None

    def do_kv_cache_update(
        self,
        layer: object,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """The reference's write, seen by the ledger, so the layer's next gather knows which
        slots it touched."""
        keeps = self.keep_decode_gather_bytes and kv_cache.device.type == "cpu"
        ledger = cache_ledger(kv_cache) if keeps else None
        if ledger is not None:
            ledger.sync(kv_cache)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if ledger is not None:
            ledger.wrote(kv_cache, slot_mapping)

    def decode_gather(
        self,
        kv_cache: torch.Tensor,
        row_array: torch.Tensor,
        plan: _StepPlan,
        geometry: tuple[object, ...],
        offsets: tuple[int, torch.Tensor],
        metadata: AttentionMetadata,
        run: DecodeRun,
    ) -> tuple[torch.Tensor, KVViews | None]:
        """The layer's kept gather, refreshed (:func:`gather_kept`), with its views kept beside
        it; the reference's shared gather over the budget, off the CPU, or where nothing can be
        proved (an inference tensor)."""
        if not self.keep_decode_gather_bytes or kv_cache.device.type != "cpu":
            return super().decode_gather(
                kv_cache, row_array, plan, geometry, offsets, metadata, run
            )
        index = plan.kv_index[geometry]  # [rows]
        kept = None  # over the budget, or nothing provable: keep nothing
        if index.numel() * self.head_size * 4 <= self.keep_decode_gather_bytes:
            kept = gather_kept(
                self.kept_gather, kv_cache, row_array, index, plan, geometry, offsets,
                metadata.slot_mapping, run.new_buffer, self.steps.refreshes(plan),
            )  # fmt: skip
        self.kept_gather = kept
        if kept is None:
            return super().decode_gather(
                kv_cache, row_array, plan, geometry, offsets, metadata, run
            )
        if kept.views is None or kept.views[0] != run.view_key:
            kept.views = (run.view_key, run.views(kept.buffer))
        return kept.buffer, kept.views[1]


class _KeptGatherSDPABackend(TorchSDPABackend):
    """TORCH_SDPA (same name, capabilities and validation) making :class:`KeptGatherSDPAImpl`:
    what :class:`EngineImpls` builds through, so the kept impl is checked as ``make_impl``
    checks the reference's. Not registered: the selector only knows the reference."""

    # (mypy holds type[] to the base's constructor; this one also needs the budget, which
    # EngineImpls always passes)
    impl_cls = KeptGatherSDPAImpl  # type: ignore[assignment]


def kept_gather_budget(kv_cache_bytes: int, num_layers: int) -> int:
    """Each layer's ``keep_decode_gather_bytes``: a quarter of the KV cache's bytes over all
    layers, at least 1 MiB a layer, so the kept float32 copies never double the memory the
    engine planned."""
    return max(kv_cache_bytes // (4 * max(num_layers, 1)), 2**20)


class EngineImpls:
    """How the engine makes each layer's impl: :class:`KeptGatherSDPAImpl` where the selector
    picked TORCH_SDPA and the cache is on the CPU (the engine reports external writes, so the
    kept gathers are safe; every layer shares one :class:`KeptGatherSteps`), each budgeted by
    :func:`kept_gather_budget`; elsewhere ``backend.make_impl`` with the backend's own
    ``engine_impl_options`` for a cache of ``kv_cache_bytes`` over ``num_layers`` layers."""

    def __init__(self, *, device: torch.device | str, kv_cache_bytes: int, num_layers: int) -> None:
        self.device = torch.device(device)
        self.kv_cache_bytes = kv_cache_bytes
        self.num_layers = num_layers
        self.steps = KeptGatherSteps()

    def make_impl(
        self,
        backend: type[AttentionBackend],
        config: AttentionConfig,
        layout: KVCacheLayout,
        **kw: Any,
    ) -> AttentionImpl:
        """One layer's impl (``kw``: ``make_impl``'s per-layer arguments)."""
        if backend is TorchSDPABackend and self.device.type == "cpu":
            return _KeptGatherSDPABackend.make_impl(
                config, layout,
                keep_decode_gather_bytes=kept_gather_budget(self.kv_cache_bytes, self.num_layers),
                steps=self.steps, **kw,
            )  # fmt: skip
        options = backend.engine_impl_options(
            device=self.device, kv_cache_bytes=self.kv_cache_bytes, num_layers=self.num_layers
        )
        return backend.make_impl(config, layout, **options, **kw)
