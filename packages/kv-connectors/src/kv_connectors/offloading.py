"""``OffloadingConnector``: GPU <-> (pinned) CPU offload with a byte budget, LRU or ARC.

The CPU tier is one ``uint8 [capacity, row_bytes]`` tensor (pinned when the cache is on CUDA):
slot ``s`` holds one block's row (every registered cache, every layer slot, scales included).
``capacity = cpu_bytes // row_bytes``, so the budget is never exceeded by construction; the
eviction policy only decides *which* blocks leave. Blocks are keyed by their chained block hash,
so a later request with the same prefix hits the CPU tier (``get_num_new_matched_tokens``).

Saves are planned as a running request's blocks fill (``blocks_computed``: the blocks the steps
before this one completed) and, for what is left, when it finishes; the request's blocks stay
allocated until ``done_sending``, which waits for every save of the request. So a request that
finishes after a long prompt has only its last blocks left to copy: a queued request needing its
blocks waits for those, not for the whole prompt's (H200, Llama-3-8B shape, 4,224-token turns: a
CPU-tier hit waited 7.3 ms in the queue for the previous request's save). The worker copies each
segment as soon as ``save_kv_layer`` reports its last layer computed, the rest in
``wait_for_save``. A save of a running request's blocks may still be copying when the engine
frees them (preemption, abort): ``handle_preemptions`` makes the compute stream wait for it.
Loads start in ``start_load_kv`` and are enqueued segment by segment, :data:`LOAD_AHEAD` ahead of the layer ``wait_for_layer_load`` waits for (the rest, if any, in
``wait_for_save``); their blocks stay pinned in the tier until every segment is enqueued.

On CUDA every copy is enqueued on side streams that first wait for the compute stream;
``wait_for_layer_load`` makes the compute stream wait on the segment's event (no host sync on the
hot path). ``wait_for_save`` hands the step's saves off and returns: the request's blocks stay
allocated until ``get_finished`` reports it in ``done_sending``, which polls the saves' events,
so no step waits on a save's copy (``close`` waits for them, bounded by ``timeout_s``). On the
CPU the "GPU" cache is a CPU tensor and the same code runs with synchronous copies.

Saves and loads each have a lane (:class:`~kv_connectors._lanes.Lane`: side stream, copy stream,
staging halves; its copies take a segment of all of a request's runs of tier slots at once), so
a load never queues behind a save: PCIe moves the two directions at once, on two copy engines.
Measured before the change (H200, ``bench_multiturn.py --shape llama3-8b``, turns resending
4,224 tokens): a CPU-tier hit's time to first token was 48.7 ms against 129.8 recomputed. The
hit's step carried the previous request's save, behind which its loads queued on the one copy
stream, and then waited for that save to finish.

Why the copies run at copy-engine speed (issue 30: saves were 0.75-0.81x of one pinned ``copy_``,
loads 0.86-0.90x): block gathers (device bandwidth, on the side stream) and host copies (the copy
engine, on a second stream) are pipelined through two staging halves, so piece ``k + 1`` is
gathered while piece ``k`` crosses PCIe (before, one staging buffer on one stream serialized
them); blocks whose rows are the cache's own memory (consecutive ids of a cross-layer slab or of
one layer) are copied to and from the tier directly, without staging.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_connectors._lanes import Lane, Run, copy_on_host, order_runs
from kv_connectors._save_tracking import SaveTracker, TrackedSaves
from kv_connectors.base import (
    ConnectorCapabilities,
    ConnectorMetadata,
    KVConnector,
    LoadSpec,
    RequestLike,
    SaveSpec,
    log,
)
from kv_connectors.config import EvictionPolicy, OffloadingConfig
from kv_connectors.policies import Policy, make_policy
from kv_connectors.views import RegisteredKV

__all__ = ["OffloadStats", "OffloadingConnector"]


@dataclass
class OffloadStats:
    """Counters since construction (blocks and bytes)."""

    hit_blocks: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0
    skipped_saves: int = 0  # blocks not stored because every resident block was pinned
    bytes_saved: int = 0
    bytes_loaded: int = 0


@dataclass
class _Copies:
    """A request's blocks by runs of tier slots (:func:`~kv_connectors._lanes.order_runs`' order,
    ``staged`` of them first) and their block ids concatenated, on the caches' device."""

    runs: list[Run]
    staged: int
    ids: torch.Tensor

    @classmethod
    def of(
        cls, kv: RegisteredKV, slots: Sequence[int], block_ids: Sequence[int], lane: Lane | None
    ) -> _Copies:
        """The copies' plan, its ids uploaded on the current stream for ``lane``'s stream: they
        stay allocated until the lane's kernels that read them ran, not only until the plan is
        dropped (the caching allocator would hand the memory to the next upload on the current
        stream while a held-back load still had to read it: that load then scattered the tier's
        rows into another request's blocks, a test on the H200 found)."""
        runs, staged = order_runs(_runs(slots, block_ids))
        ids = kv.ids_tensor([b for r in runs for b in r[2]])
        if lane is not None:
            ids.record_stream(lane.stream)
        return cls(runs, staged, ids)


@dataclass
class _PendingSave:
    spec: SaveSpec
    slots: list[int]
    copies: _Copies
    segments_done: set[int] = field(default_factory=set)
    event: Any = None  # torch.cuda.Event after the last segment's copy


def _runs(slots: Sequence[int], block_ids: Sequence[int]) -> list[tuple[int, int, list[int]]]:
    """Group consecutive tier slots: ``(first slot, count, block ids)`` per run, so each run is one
    contiguous (pinned) view of the tier and one block copy per segment."""
    n = len(slots)
    if len(block_ids) != n:
        raise ValueError(f"{n} tier slots for {len(block_ids)} block ids: one slot a block")
    out: list[tuple[int, int, list[int]]] = []
    start = 0
    # (a run is cut where a slot does not follow the one before it; the runs' lists are slices:
    # a tuple rebuilt per block was most of a 256-block request's planning, ~60 us)
    for i in range(1, n + 1):
        if i == n or slots[i] != slots[i - 1] + 1:
            out.append((slots[start], i - start, list(block_ids[start:i])))
            start = i
    return out


#: load segments enqueued ahead of the one the forward waits for. ``start_load_kv`` enqueues the
#: first ``LOAD_AHEAD`` segments' copies and each ``wait_for_layer_load`` the next, so the host
#: launches the forward between them instead of after all of them (H200, Llama-3-8B shape, 32
#: layer segments: a CPU-tier hit's whole load took the host 11-26 ms to enqueue, and the
#: forward's first kernel ran only after it).
LOAD_AHEAD = 2


class OffloadingConnector(TrackedSaves, KVConnector):
    """GPU <-> pinned CPU tier; see the module docstring."""

    CAPABILITIES = ConnectorCapabilities(kind="store", load_async=False)

    def __init__(self, config: OffloadingConfig, *, block_size: int) -> None:
        if not isinstance(config, OffloadingConfig):
            raise TypeError(f"config must be an OffloadingConfig, got {type(config).__name__}")
        super().__init__(block_size=block_size)
        self.config = config
        self.stats = OffloadStats()
        self._tier: torch.Tensor | None = None  # [capacity, row_bytes] uint8
        self._policy: Policy | None = None
        self._slot_of: dict[bytes, int] = {}
        self._ready: set[bytes] = set()  # hashes whose bytes are in the tier
        self._pins: dict[bytes, int] = {}  # hash -> in-flight copies using it
        self._free: list[int] = []  # free tier slots, a min-heap (lowest first)
        self._pending: list[_PendingSave] = []
        self._tracker = SaveTracker()  # saves of running and finished requests
        self._save_lane: Lane | None = None  # CUDA caches only
        self._load_lane: Lane | None = None
        self._load_events: dict[int, Any] = {}  # segment -> event of this step's loads
        self._loads_enqueued: Any = None  # event after every load enqueued so far (CUDA)
        self._step_plans: list[tuple[LoadSpec, _Copies]] = []  # this step's loads
        self._next_load_seg = 0  # the first segment of them not enqueued yet
        self._adopted: ConnectorMetadata | None = None
        self._tier_key: tuple[str, ...] = ()

    # -- setup ---------------------------------------------------------------------------------

    def _on_register(self, kv: RegisteredKV) -> None:
        key = tuple(lay.compatibility_hash() for lay in kv.layouts)
        if self._tier is not None and key == self._tier_key:
            return  # same page format (e.g. the GPU side restarted): the tier's blocks stay valid
        self._tier_key = key
        self._slot_of.clear()
        self._ready.clear()
        self._pins.clear()
        capacity = self.config.cpu_bytes // kv.row_bytes
        if capacity < 1:
            raise ValueError(
                f"OffloadingConfig.cpu_bytes={self.config.cpu_bytes} holds no block: one block "
                f"row is {kv.row_bytes} bytes; give cpu_bytes >= {kv.row_bytes}"
            )
        pin = self.config.pin_memory and kv.device.type == "cuda"
        # Segment-major: segment i of every slot is one [capacity, seg_row] array, so a run of
        # slots of one segment is contiguous (one copy_ at copy-engine speed). [capacity * row]
        self._tier = torch.empty(capacity * kv.row_bytes, dtype=torch.uint8, pin_memory=pin)
        self._tier_seg = [
            self._tier[s.row_offset * capacity : (s.row_offset + s.row_bytes) * capacity].view(
                capacity, s.row_bytes
            )
            for s in kv.segments
        ]
        self._policy = make_policy(EvictionPolicy(self.config.policy), capacity, self._evictable)
        self._free = list(range(capacity))  # (a sorted list is a heap)
        if kv.device.type == "cuda":
            widest = max(s.row_bytes for s in kv.segments)
            # a lane per direction, each two halves: gather piece k + 1 in one while the copy
            # engine moves piece k
            quarter = self.config.staging_bytes // 4
            if quarter < widest:
                raise ValueError(
                    f"OffloadingConfig.staging_bytes={self.config.staging_bytes} holds fewer than "
                    f"four segment rows of {widest} bytes (staging is double-buffered for saves "
                    f"and for loads); give staging_bytes >= {4 * widest}"
                )
            self._save_lane = Lane.make(kv.device, quarter)
            self._load_lane = Lane.make(kv.device, quarter)
            kv.load_copy_kernels(host=False, segments=True)  # (none compiles while serving)

    @property
    def capacity_blocks(self) -> int:
        return self._policy_or_raise().capacity

    @property
    def tier(self) -> torch.Tensor:
        """The CPU tier, ``uint8 [capacity * row_bytes]``, segment-major (see ``_on_register``)."""
        if self._tier is None:
            raise RuntimeError("register_kv_caches(storages, layouts) must be called first")
        return self._tier

    def _copy(self, seg: int, copies: _Copies, *, save: bool) -> None:
        """Segment ``seg`` of a request's blocks to their tier slots (``save``) or back: on CUDA
        enqueued on the direction's lane (:class:`~kv_connectors._lanes.Lane`), on the CPU
        synchronous."""
        lane = self._save_lane if save else self._load_lane
        tier = self._tier_seg[seg]
        if lane is None:
            copy_on_host(self.kv, seg, tier, copies.runs, copies.ids, save=save)
        elif save:
            lane.save(self.kv, seg, tier, copies.runs, copies.staged, copies.ids)
        else:
            lane.load(self.kv, seg, tier, copies.runs, copies.staged, copies.ids)

    def _policy_or_raise(self) -> Policy:
        if self._policy is None:
            raise RuntimeError(
                "OffloadingConnector sizes its CPU tier from the registered layouts: call "
                "register_kv_caches before scheduling"
            )
        return self._policy

    def _evictable(self, key: object) -> bool:
        return key in self._ready and not self._pins.get(key, 0)  # type: ignore[call-overload,unused-ignore]

    def _pin(self, hashes: Iterable[bytes], delta: int) -> None:
        for h in hashes:
            n = self._pins.get(h, 0) + delta
            if n:
                self._pins[h] = n
            else:
                self._pins.pop(h, None)

    def stored_hashes(self) -> list[bytes]:
        """Hashes resident in the tier, next victim first."""
        return [h for h in self._policy_or_raise().resident() if h in self._ready]  # type: ignore[misc,unused-ignore]

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._check_computed(num_computed_tokens)
        self._policy_or_raise()
        first = num_computed_tokens // self.block_size
        hits = 0
        for h in request.block_hashes[first:]:
            if h not in self._ready:
                break
            hits += 1
        first, tokens = self._matched_blocks(num_computed_tokens, hits)
        if tokens:
            self._matched[request.request_id] = (first, hits)
        return tokens, False  # loads run inside the forward pass, layer by layer

    def _plan_load(
        self, request: RequestLike, block_ids: list[int], first: int, count: int
    ) -> LoadSpec:
        spec = super()._plan_load(request, block_ids, first, count)
        self._pin(spec.block_hashes, +1)  # no eviction between planning and copying
        return spec

    def _plan_save(self, request: RequestLike, block_ids: Sequence[int], start: int) -> None:
        """Plan the save of ``request``'s blocks from ``start`` on that the tier lacks (blocks
        before ``start`` were planned, or found stored, by an earlier call)."""
        policy = self._policy_or_raise()
        slot_of = self._slot_of
        hashes_all = request.block_hashes
        if start and len(self._free) < len(hashes_all) - start:
            # an insert will evict: the request's stored prefix is used again, so not a victim
            # (else its new blocks could evict it, leaving a hole every later lookup stops at)
            for h in hashes_all[:start]:
                if h in slot_of:
                    policy.touch(h)
        ids: list[int] = []
        hashes: list[bytes] = []
        taken: set[bytes] = set()  # hashes of this request already planned (a set: O(1) each)
        for h, b in zip(hashes_all[start:], block_ids[start:], strict=False):
            if h in slot_of:  # stored or being stored already: used again, so not a victim
                policy.touch(h)
            elif h not in taken:
                ids.append(b)
                hashes.append(h)
                taken.add(h)
        done, evicted = policy.insert_many(hashes)  # type: ignore[arg-type]
        if done < len(hashes):  # every resident block is pinned: store nothing more now
            self.stats.skipped_saves += 1
            del ids[done:], hashes[done:]
        free, ready = self._free, self._ready
        for old in evicted:  # evicted: their slots are free, their bytes gone
            heapq.heappush(free, slot_of.pop(old))  # type: ignore[call-overload]
            ready.discard(old)
        self.stats.evicted_blocks += len(evicted)
        if not ids:
            return
        # The lowest free slots, in order: a request's blocks land in runs of consecutive slots,
        # so each segment of a run is one contiguous piece of the tier and one copy.
        # (a heap, not a sort of the free list per request: ~50 us a request at 32k slots here)
        for h in hashes:
            slot_of[h] = heapq.heappop(free)
        self._pin(hashes, +1)
        self._tracker.opened(request.request_id)
        self._saves.append(SaveSpec(request.request_id, tuple(ids), tuple(hashes)))

    def _drop_load(self, spec: LoadSpec) -> None:
        self._pin(spec.block_hashes, -1)

    def _drop_save(self, spec: SaveSpec) -> None:
        policy = self._policy_or_raise()
        self._pin(spec.block_hashes, -1)
        for h in spec.block_hashes:  # reserved, never written: give the slots back
            policy.remove(h)
            heapq.heappush(self._free, self._slot_of.pop(h))
        self._close_save(spec.request_id)

    # -- worker side: loads --------------------------------------------------------------------

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        kv = self.kv
        self._adopt(meta)  # this step's saves: copied per segment by save_kv_layer / wait_for_save
        # a step whose loads were not all enqueued (no wait_for_save): they land before the next
        # step's are planned, so no load counted as loaded is left half-copied
        self._enqueue_loads(len(kv.segments))
        self._load_events.clear()
        loads = [spec for spec in meta.loads if spec.block_ids]
        if not loads:
            return
        plans = []
        for spec in loads:
            missing = [h for h in spec.block_hashes if h not in self._ready]
            if missing:  # cannot happen while pinned; kept as a guard, never wrong KV
                self._pin(spec.block_hashes, -1)
                self._fail_load(spec, f"{len(missing)} blocks left the CPU tier", async_load=False)
                continue
            slots = [self._slot_of[h] for h in spec.block_hashes]
            plans.append((spec, _Copies.of(kv, slots, spec.block_ids, self._load_lane)))
        for spec, _ in plans:
            for h in spec.block_hashes:
                self._policy_or_raise().touch(h)
            self.stats.loaded_blocks += len(spec.block_ids)
            self.stats.hit_blocks += len(spec.block_ids)
            self.stats.bytes_loaded += len(spec.block_ids) * kv.row_bytes
        self._step_plans, self._next_load_seg = plans, 0
        self._enqueue_loads(LOAD_AHEAD)

    def _enqueue_loads(self, stop: int) -> None:
        """Enqueue this step's loads of segments up to ``stop`` (exclusive) not enqueued yet."""
        kv = self.kv
        stop = min(stop, len(kv.segments))
        if not self._step_plans or self._next_load_seg >= stop:
            return
        with self._side_stream(self._load_lane, after_compute=self._next_load_seg == 0):
            for seg in range(self._next_load_seg, stop):
                for _spec, copies in self._step_plans:
                    self._copy(seg, copies, save=False)
                self._load_events[seg] = self._record(self._load_lane)
        self._next_load_seg = stop
        if stop == len(kv.segments):
            # Every segment enqueued: the loads' slots are unpinned, so a later save may evict
            # them and write the same slots; saves start after the loads enqueued before them.
            self._loads_enqueued = self._load_events[stop - 1]
            for spec, _ in self._step_plans:
                self._pin(spec.block_hashes, -1)
            self._step_plans = []

    def wait_for_layer_load(self, layer: int) -> None:
        seg = self.kv.segment_of_layer(layer)
        self._enqueue_loads(seg + 1 + LOAD_AHEAD)  # this segment and the next LOAD_AHEAD
        event = self._load_events.get(seg)
        if event is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(event)  # device-side wait only

    # -- worker side: saves --------------------------------------------------------------------

    def save_kv_layer(self, layer: int, meta: ConnectorMetadata) -> None:
        self._adopt(meta)
        kv = self.kv
        seg = kv.segment_of_layer(layer)
        s = kv.segments[seg]
        if layer == s.first_layer + s.num_layers - 1:  # the segment is complete: copy it now
            self._save_segments(range(seg, seg + 1))

    def _adopt(self, meta: ConnectorMetadata) -> None:
        if meta is self._adopted:
            return  # save_kv_layer hands the same step's metadata once per layer
        self._adopted = meta
        for spec in meta.saves:
            slots = [self._slot_of[h] for h in spec.block_hashes]
            self._pending.append(
                _PendingSave(
                    spec, slots, _Copies.of(self.kv, slots, spec.block_ids, self._save_lane)
                )
            )

    def _save_segments(self, segments: range) -> None:
        kv = self.kv
        lane = self._save_lane
        if lane is not None and self._loads_enqueued is not None:
            lane.stream.wait_event(self._loads_enqueued)  # (see start_load_kv)
        with self._side_stream(lane):
            for p in self._pending:
                if p.event is not None:
                    continue
                todo = [i for i in segments if i not in p.segments_done]
                for seg in todo:
                    self._copy(seg, p.copies, save=True)
                    p.segments_done.add(seg)
                if len(p.segments_done) == len(kv.segments):
                    p.event = self._record(lane) or True

    def wait_for_save(self, meta: ConnectorMetadata | None = None) -> None:
        """Hand the step's saves off (every segment's copy enqueued) without waiting for them:
        a save's blocks stay allocated until ``get_finished`` reports its request."""
        if meta is not None:
            self._adopt(meta)
        self._enqueue_loads(len(self.kv.segments))  # (loads no layer waited for land too)
        self._save_segments(range(len(self.kv.segments)))
        self._collect()

    def handle_preemptions(self, request_ids: Iterable[str]) -> None:
        """Saves of these requests still copying are read before the engine's next writes: the
        compute stream waits for each one's last copy (on the CPU the copies were synchronous)."""
        ids = set(request_ids)
        self._preempted(ids)
        mine = [p for p in self._pending if p.spec.request_id in ids]
        if any(p.event is None for p in mine):  # (not handed off yet: enqueue every segment)
            self._save_segments(range(len(self.kv.segments)))
        stream = None
        for p in mine:
            if p.event is not True and p.event is not None:
                stream = stream or torch.cuda.current_stream(self.kv.device)
                stream.wait_event(p.event)  # device-side wait only

    def close(self) -> None:
        """Enqueue what a step left half-done (a step closed between ``start_load_kv`` and
        ``wait_for_save`` used to wait out the whole timeout for saves never enqueued), wait
        (up to ``timeout_s``) for the saves still copying, then report them finished."""
        if self._worker.kv is not None:
            self._enqueue_loads(len(self.kv.segments))
            self._save_segments(range(len(self.kv.segments)))
        deadline = time.monotonic() + self.config.timeout_s
        while not self._collect() and time.monotonic() < deadline:
            time.sleep(1e-4)
        if self._pending:
            log.warning(
                "offload: %d saves still copying at close after %.1fs",
                len(self._pending),
                self.config.timeout_s,
            )

    def _collect(self) -> bool:
        """Finish saves whose copies completed; True when none is left."""
        left = []
        for p in self._pending:
            if p.event is None or (p.event is not True and not p.event.query()):
                left.append(p)
                continue
            self._ready.update(p.spec.block_hashes)
            self._pin(p.spec.block_hashes, -1)
            self._close_save(p.spec.request_id)
            self.stats.stored_blocks += len(p.slots)
            self.stats.bytes_saved += len(p.slots) * self.kv.row_bytes
        self._pending = left
        return not left

    def _poll(self) -> None:
        self._collect()

    # -- streams -------------------------------------------------------------------------------

    def _side_stream(self, lane: Lane | None, *, after_compute: bool = True) -> Any:
        if lane is None:
            import contextlib

            return contextlib.nullcontext()
        return lane.enter(self.kv.device, after_compute=after_compute)

    @staticmethod
    def _record(lane: Lane | None) -> Any:
        return None if lane is None else lane.record()
