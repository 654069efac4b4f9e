"""Layer-wise streaming state of a P2P transfer: which segments of a streamed request the
producer has computed, and which segments of a consumer's in-step load have landed.

A *segment* (:mod:`kv_connectors.views`) is what one block copy moves: one layer slot of a
per-layer cache (LBNHC, LBHNC, LHBNC), or a whole cross-layer slab (BLNHC, BLHNC, BHLNC). Streaming
goes segment by segment, so with a per-layer cache layer ``i`` travels as soon as it is computed
and the consumer waits for layer ``i`` only; with a cross-layer cache the one segment is complete
only after the last layer (its blocks hold every layer side by side), so the whole slab travels
then and the consumer's first ``wait_for_layer_load`` waits for all of it. Streaming needs a
per-layer layout to overlap anything.

Producer: :class:`Produced` per streamed request. The worker marks a segment ready in
``save_kv_layer`` when the segment's last layer is computed (on CUDA with an event recorded on
the compute stream: the sender's copies wait for it on the device, never reading a page before
the kernel that writes it ran) and every segment in ``wait_for_save``. The session thread serving
a pull waits (bounded) for each segment before it sends it.

Consumer: :class:`Arriving` per load inside the step. The pull thread marks a segment landed once
its last chunk is scattered (on CUDA: an event on the wire's stream);
``wait_for_layer_load(i)`` waits for it on the host (bounded) and makes the compute stream wait
for the event. A failed pull marks every segment failed at once (the waits return, the blocks
are reported as load errors).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kv_connectors.base import ConnectorMetadata, LoadSpec, RequestLike, SaveSpec
from kv_connectors.config import KVRole, TransferMode

__all__ = ["Arriving", "LayerStreaming", "Produced"]


class _Segments:
    """Per-segment flags with an optional CUDA event each, a failure and one condition."""

    def __init__(self, num_segments: int) -> None:
        self.num_segments = num_segments
        self.events: dict[int, Any] = {}  # segment -> CUDA event or None
        self.failed: str | None = None
        self.cv = threading.Condition()

    def mark(self, segment: int, event: Any = None) -> None:
        with self.cv:
            self.events.setdefault(segment, event)
            self.cv.notify_all()

    def fail(self, reason: str) -> None:
        with self.cv:
            if self.failed is None:
                self.failed = reason
            self.cv.notify_all()

    def wait(self, segments: Iterable[int], deadline: float, what: str) -> list[Any]:
        """Block until every one of ``segments`` is marked (their events, ``None`` dropped);
        raises on failure or past ``deadline``."""
        want = list(segments)
        with self.cv:
            while True:
                if self.failed is not None:
                    raise ConnectionError(self.failed)
                if all(s in self.events for s in want):
                    return [self.events[s] for s in want if self.events[s] is not None]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what}: segments {want} not ready in time")
                self.cv.wait(min(left, 0.5))


class Produced(_Segments):
    """A request the producer streams: its held params and which segments are computed."""

    def __init__(self, num_segments: int, params: dict[str, Any]) -> None:
        super().__init__(num_segments)
        self.params = params


class Arriving(_Segments):
    """A consumer's load inside the step: which segments have landed in the local blocks."""

    def __init__(self, num_segments: int, deadline: float) -> None:
        super().__init__(num_segments)
        self.deadline = deadline


class LayerStreaming:
    """Mixin of :class:`~kv_connectors.p2p.P2pConnector` (before ``TransferConnector`` in its
    bases): the scheduler and worker calls of layer-wise streaming, on both sides."""

    # provided by TransferConnector / P2pConnector
    config: Any
    kv: Any
    _lock: threading.Lock
    _sendable: dict[str, Any]
    _saves: list[SaveSpec]
    _plans: dict[str, Any]
    _load_plans: dict[str, Any]
    _in_step: set[str]
    _clock: Any
    _release_locked: Any
    _fail_load: Any
    _streams: dict[str, Produced]
    _stream_step: set[str]
    _arriving: dict[str, Arriving]
    _step_arriving: dict[str, tuple[LoadSpec, Arriving]]

    # -- producer, scheduler side ----------------------------------------------------------------

    def stream_request(self, request: RequestLike, block_ids: Sequence[int]) -> dict[str, Any]:
        """Serve ``request`` to a consumer *while* its prompt is computed: call it in the step
        that schedules the request's last prompt tokens (its blocks allocated, ``block_ids`` its
        block table) and hand the returned params to the consumer at once. The blocks are held
        as by ``request_finished`` (which the engine still calls at the end: it returns
        ``(True, the same params)``; the blocks are freed after ``done_sending``, never before
        that call). This step's ``save_kv_layer`` / ``wait_for_save`` tell a pull which layers it
        may send."""
        rid = request.request_id
        if self.config.role is KVRole.CONSUMER:
            raise ValueError(
                f"stream_request({rid!r}): this worker's role is 'consumer'; stream from a "
                "worker with role 'producer' or 'both'"
            )
        if self.config.mode is not TransferMode.READ:
            raise ValueError(
                f"stream_request({rid!r}): P2pConfig.mode={self.config.mode.value!r} pushes "
                "finished requests; streaming serves pulls (mode='read')"
            )
        if rid in self._streams:
            raise ValueError(f"stream_request: request {rid!r} is already streamed")
        delay, params = super().request_finished(request, block_ids)  # type: ignore[misc]
        if not delay or params is None:
            raise ValueError(
                f"stream_request: request {rid!r} has nothing to serve (no full block with a "
                "hash, a consumer's own request, or no side channel: register the caches first)"
            )
        with self._lock:
            self._sendable[rid].open = True
            self._streams[rid] = Produced(len(self.kv.segments), params)
        self._saves.append(SaveSpec(rid, tuple(params["block_ids"]), ()))
        return dict(params)

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        with self._lock:
            produced = self._streams.get(rid)
            if produced is not None:  # streamed: now the engine is done with the blocks too
                held = self._sendable.get(rid)
                if held is None:
                    return False, None
                held.open = False
                now = self._clock()
                held.deadline = max(held.deadline, now + self.config.abandon_after_s)
                self._release_locked(rid, held, now)
                return True, dict(produced.params)
        return super().request_finished(request, block_ids)  # type: ignore[misc]

    # -- producer, worker side ---------------------------------------------------------------------

    def _adopt_streams(self, meta: ConnectorMetadata) -> None:
        for save in meta.saves:
            if save.request_id in self._streams:
                self._stream_step.add(save.request_id)

    def save_kv_layer(self, layer: int, meta: ConnectorMetadata) -> None:
        self._adopt_streams(meta)
        if not self._stream_step:
            return
        seg = self.kv.segment_of_layer(layer)
        s = self.kv.segments[seg]
        if layer == s.first_layer + s.num_layers - 1:  # the segment is computed: serve it
            self._mark_produced(range(seg, seg + 1))

    def wait_for_save(self) -> None:
        self._mark_produced(range(len(self.kv.segments)))  # whatever save_kv_layer did not say
        self._stream_step.clear()
        super().wait_for_save()  # type: ignore[misc]

    def _mark_produced(self, segments: range) -> None:
        event = None
        if self.kv.device.type == "cuda":  # the pages are written by kernels queued before now
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.kv.device))
        for rid in self._stream_step:
            produced = self._streams.get(rid)
            if produced is not None:
                for seg in segments:
                    produced.mark(seg, event)

    # -- consumer ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)  # type: ignore[misc]
        rid = request.request_id
        layerwise = self.config.layerwise and self.config.mode is TransferMode.READ
        # converting pulls move whole rows, asynchronously
        if tokens and layerwise and self._plans[rid][0].identity:
            self._in_step.add(rid)
            return tokens, False
        return tokens, load_async

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        self._adopt_streams(meta)
        self._step_arriving = {}
        for spec in meta.loads:
            rid = spec.request_id
            if rid in self._in_step and rid in self._load_plans and spec.block_ids:
                arriving = Arriving(len(self.kv.segments), time.monotonic() + self.config.timeout_s)
                self._arriving[rid] = arriving
                self._step_arriving[rid] = (spec, arriving)
        super().start_load_kv(meta)  # type: ignore[misc]

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer-wise loads: block (bounded) until layer ``layer``'s segment of every load of this
        step landed; on CUDA the compute stream then waits for its copies. A failed or late load
        is reported (``get_block_ids_with_load_errors``) and waited for no more."""
        if not self._step_arriving:
            return
        seg = self.kv.segment_of_layer(layer)
        for rid, (spec, arriving) in list(self._step_arriving.items()):
            try:
                events = arriving.wait([seg], arriving.deadline, f"layer-wise load of {rid}")
            except (ConnectionError, TimeoutError) as exc:
                del self._step_arriving[rid]
                self._fail_load(spec, f"layer-wise load: {exc}", async_load=False)  # locks
                continue
            if events:
                import torch

                stream = torch.cuda.current_stream(self.kv.device)
                for event in events:
                    stream.wait_event(event)

    # -- both ------------------------------------------------------------------------------------

    def _abort(self, request_id: str) -> None:
        with self._lock:
            produced = self._streams.pop(request_id, None)
            held = self._sendable.get(request_id)
            if held is not None:
                held.open = False
        if produced is not None:
            produced.fail(f"request {request_id} was aborted on the producer")
        arriving = self._arriving.get(request_id)
        if arriving is not None:
            arriving.fail(f"request {request_id} was aborted")
        super()._abort(request_id)  # type: ignore[misc]

    def _forget_streams(self) -> None:
        """Drop the state of streams whose blocks were released and of loads whose pull ended."""
        with self._lock:
            for rid in [r for r in self._streams if r not in self._sendable]:
                del self._streams[rid]
        for rid in [r for r in self._arriving if r not in self._in_step]:
            del self._arriving[rid]
