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

Consumer: :class:`Arriving` per load inside the step. A step's loads from one producer are one
pull (one thread, one side-channel message naming every request, then one transfer):
segment-major (:func:`~kv_connectors._p2p_wire.plan_layers`), segment ``i`` of every request
before segment ``i + 1`` of any, so ``wait_for_layer_load(i)`` returns once layer ``i`` of
every request landed, while the producer computes later layers. The pull thread marks a segment
landed once its last chunk is scattered (on CUDA: an event on the wire's stream);
``wait_for_layer_load(i)`` waits for it on the host (bounded) and makes the compute stream wait
for the event. A failed pull fails every load it carries at once (the waits return, the blocks
are reported as load errors, once each); a segment that landed before the failure stays landed.

Never a late write into reported blocks: every write into a load's blocks goes through
:meth:`Arriving.land` (bytes are received into staging, never straight into the cache), which
runs it only while the load has not failed, under the lock :meth:`Arriving.fail` takes. So once
a failure is recorded (a timeout in ``wait_for_layer_load``, the producer gone, an abort) no
byte more reaches those blocks on the CPU, whatever the pull thread or gloo's threads do later;
on CUDA every landing copy was enqueued on the wire's stream before the *fence* event
:meth:`Arriving.fail` records there, and the compute stream waits for the fence before the
blocks are reported (the wire stream of a later load waits for the compute stream at its
``start_load_kv``).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kv_connectors._p2p_wire import Chunk, Wire, plan_layers
from kv_connectors._sidechannel import request, send_msg
from kv_connectors.base import ConnectorMetadata, LoadSpec, RequestLike, SaveSpec
from kv_connectors.config import KVRole, TransferMode

__all__ = ["Arriving", "LayerStreaming", "Produced"]

#: A layer-wise transfer's last wait polls its stream at most this often (``Wire.drain``): no
#: step waits for it, and each poll takes the GIL from the engine's launches.
_STREAM_DRAIN_POLL_S = 1e-3
#: How a failed layer-wise load's reason starts (its first cause follows).
_LOAD_FAILED = "layer-wise load"
#: How long past its timeout a step waits for its pull's verdict (the abort's bounded drain).
_SETTLE_GRACE_S = 15.0


class _Segments:
    """Per-segment flags with an optional CUDA event each, a failure and one condition."""

    #: a segment marked before a failure may still be waited for (Arriving: its bytes landed)
    marks_outlive_failure = False

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
                done = all(s in self.events for s in want)
                if self.failed is not None and not (done and self.marks_outlive_failure):
                    raise ConnectionError(self.failed)
                if done:
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
    """A consumer's load inside the step: which segments have landed in the local blocks, and
    the gate every write into them passes (see the module docstring)."""

    marks_outlive_failure = True

    def __init__(self, num_segments: int, deadline: float, start: Any = None) -> None:
        super().__init__(num_segments)
        self.deadline = deadline
        self.start = start  # CUDA: the compute stream at start_load_kv (landings wait for it)
        self.stream: Any = None  # CUDA: the wire stream the landing copies run on
        self.fence: Any = None  # CUDA: recorded on it at the failure, after every landing
        self.reported = False  # its blocks went to the load errors (at most once)
        # Every byte is known to be in place: the pull's receive returned (on CUDA after its
        # drain). A mark is not that on CUDA: it is recorded when the landing is enqueued, and
        # its event also completes when an aborted receive ends without the bytes.
        self.verified = False

    def attach(self, stream: Any) -> None:
        with self.cv:
            self.stream = stream

    def land(self, write: Callable[[], None]) -> bool:
        """Run ``write`` (a copy into this load's blocks) unless the load failed: ``False``."""
        with self.cv:
            if self.failed is not None:
                return False
            write()
            return True

    def mark(self, segment: int, event: Any = None) -> None:
        with self.cv:
            if self.failed is None:  # (a chunk of it may have been refused by the gate)
                super().mark(segment, event)

    def fail(self, reason: str) -> None:
        with self.cv:
            if self.failed is None and self.stream is not None:
                import torch

                self.fence = torch.cuda.Event()
                self.fence.record(self.stream)  # after every landing copy enqueued so far
            super().fail(reason)

    def verify(self) -> None:
        """The pull's receive returned: every segment's bytes are in place."""
        with self.cv:
            if self.failed is None:
                self.verified = True
            self.cv.notify_all()

    def complete(self) -> bool:
        with self.cv:
            return self.verified

    def claim_report(self) -> bool:
        """``True`` once: the caller reports the blocks (never a load whose bytes all landed)."""
        with self.cv:
            if self.reported or self.verified:
                return False
            self.reported = True
            return True

    def settle(self, deadline: float) -> str | None:
        """Block until every byte of this load landed or it failed (bounded): ``None`` when it
        landed, else why not. Landed: the pull verified it, or every segment's landing event
        completed. An event also completes when the session's abort ends a receive without its
        bytes, but the pull fails its loads before it aborts (and NCCL's own watchdog waits
        longer than the pull: ``P2pConnector._group``), so ``failed`` is set by then."""
        sleep = 2e-5  # (the engine's thread waits here with nothing else to do)
        with self.cv:
            while True:
                if self.verified:
                    return None
                if self.failed is not None:
                    return self.failed
                events = self.events
                if len(events) == self.num_segments and all(
                    e is None or e.query() for e in events.values()
                ):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return "its bytes did not land in time"
                self.cv.wait(min(left, sleep))
                sleep = min(2 * sleep, 2e-4)


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
    _executor: Any
    _futures: dict[Any, tuple[LoadSpec, ...]]
    _bind_device: Callable[[], None]
    _with_peer: Callable[[Any, Callable[[Any], None]], None]
    _admit_pull: Any
    _end_pull: Any
    _ready_fn: Callable[[str], Any]
    _event: Callable[[Any], Any]
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
        self._settle_step_loads()

    def _settle_step_loads(self) -> None:
        """The end of the step's forward: each of its in-step loads is verified or reported as a
        load error now, before the engine reads this step's errors and samples. Every layer's
        wait returned at once on CUDA (its landing was enqueued, not done), so a producer that
        died after the receives were posted shows only here (bounded by the load's timeout plus
        the abort's drain)."""
        for rid, (spec, arriving) in list(self._step_arriving.items()):
            reason = arriving.settle(arriving.deadline + _SETTLE_GRACE_S)
            if reason is not None:
                del self._step_arriving[rid]
                self._close_load(spec, arriving, f"{_LOAD_FAILED}: {reason}")

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
        """In-step loads start as one pull per producer (segment-major over the step's loads
        from it); the others (asynchronous, converting) as before."""
        self._adopt_streams(meta)
        self._step_arriving = {}
        batches: dict[tuple[Any, ...], list[tuple[LoadSpec, Any, Arriving]]] = {}
        rest: list[LoadSpec] = []
        start: Any = None  # CUDA: landings run after what the compute stream has queued
        for spec in meta.loads:
            rid = spec.request_id
            plan = self._load_plans.get(rid)
            if rid not in self._in_step or plan is None or not spec.block_ids:
                rest.append(spec)
                continue
            if start is None:  # (recorded once a step has an in-step load, not for every step)
                start = self._event(None)
            del self._load_plans[rid]
            deadline = time.monotonic() + self.config.timeout_s
            arriving = Arriving(len(self.kv.segments), deadline, start)
            self._arriving[rid] = arriving
            self._step_arriving[rid] = (spec, arriving)
            p = plan.params
            key = (p.host, p.port, p.engine_id, p.compatibility_hashes, p.model_fingerprint)
            batches.setdefault(key, []).append((spec, plan, arriving))
        super().start_load_kv(dataclasses.replace(meta, loads=tuple(rest)))  # type: ignore[misc]
        for items in batches.values():
            fut = self._executor.submit(self._pull_layers, items)
            with self._lock:
                self._futures[fut] = tuple(spec for spec, _plan, _a in items)

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer-wise loads: block (bounded) until layer ``layer``'s segment of every load of this
        step landed; on CUDA the compute stream then waits for its copies. A failed or late load
        is closed to further writes, reported once (``get_block_ids_with_load_errors``) and
        waited for no more."""
        if not self._step_arriving:
            return
        seg = self.kv.segment_of_layer(layer)
        for rid, (spec, arriving) in list(self._step_arriving.items()):
            try:
                events = arriving.wait([seg], arriving.deadline, f"layer-wise load of {rid}")
            except (ConnectionError, TimeoutError) as exc:
                del self._step_arriving[rid]
                self._close_load(spec, arriving, f"{_LOAD_FAILED}: {exc}")
                continue
            self._stream_waits(events)

    def _stream_waits(self, events: Sequence[Any]) -> None:
        if events:
            import torch

            stream = torch.cuda.current_stream(self.kv.device)
            for event in events:
                stream.wait_event(event)

    def _close_load(self, spec: LoadSpec, arriving: Arriving, reason: str) -> None:
        """No byte more into ``spec``'s blocks (the gate shut; on CUDA the compute stream waits
        for the landings enqueued before), then its blocks reported, once."""
        arriving.fail(reason)
        self._stream_waits([arriving.fence] if arriving.fence is not None else [])
        if arriving.claim_report():
            cause = arriving.failed or reason  # (the first cause: the pull's, or this one)
            if not cause.startswith(_LOAD_FAILED):
                cause = f"{_LOAD_FAILED}: {cause}"
            self._fail_load(spec, cause, async_load=False)  # locks

    def _load_ended(self, spec: LoadSpec, reason: str | None, *, async_load: bool) -> None:
        arriving = self._arriving.get(spec.request_id)
        if async_load or arriving is None:
            super()._load_ended(spec, reason, async_load=async_load)  # type: ignore[misc]
        elif reason is not None or not arriving.complete():
            self._close_load(spec, arriving, reason or "the pull ended before every layer landed")

    # -- consumer, pull thread -------------------------------------------------------------------

    def _pull_layers(self, items: list[tuple[LoadSpec, Any, Arriving]]) -> None:
        """One pull thread for a step's in-step loads from one producer."""
        self._bind_device()
        try:
            self._with_peer(items[0][1].params, lambda sess: self._pull_layers_in(sess, items))
        except BaseException as exc:
            for _spec, _plan, arriving in items:  # wait_for_layer_load returns now
                arriving.fail(f"{type(exc).__name__}: {exc}")
            raise

    def _pull_layers_in(self, sess: Any, items: list[tuple[LoadSpec, Any, Arriving]]) -> None:
        """Ask for every live load of ``items`` in one message, then receive segment-major."""
        kv, wire = self.kv, sess.wire
        live = [(spec, plan, a) for spec, plan, a in items if a.failed is None]
        if not live:
            return
        cb = max(1, self.config.buffer_bytes // 2)
        asks = [
            {"request_id": plan.params.request_id, "block_ids": list(plan.params.block_ids)}
            for _spec, plan, _a in live
        ]
        msg = {"op": "pull", "layers": True, "chunk_bytes": cb, "requests": asks}
        reply = request(sess.sock, msg)
        answers = reply.get("pulls")
        if not reply.get("ok") or not isinstance(answers, list) or len(answers) != len(live):
            raise KeyError(f"producer refused the pull: {reply.get('error', reply)}")
        taken: list[tuple[LoadSpec, Any, Arriving]] = []
        for (spec, plan, arriving), answer in zip(live, answers, strict=True):
            if isinstance(answer, dict) and answer.get("ok") is True:
                assert len(spec.block_ids) == len(plan.params.block_ids)  # identical layouts
                taken.append((spec, plan, arriving))
                arriving.attach(wire.stream)
            else:
                error = answer.get("error") if isinstance(answer, dict) else answer
                arriving.fail(f"producer refused the pull: {error}")
        if not taken:
            return
        widths = [seg.row_bytes for seg in kv.segments]
        counts = [len(spec.block_ids) for spec, _p, _a in taken]
        chunks = plan_layers(counts, segment_widths=widths, chunk_bytes=cb)
        local = [b for spec, _p, _a in taken for b in spec.block_ids]
        if wire.stream is not None and taken[0][2].start is not None:
            wire.stream.wait_event(taken[0][2].start)  # (one event: the step's start)

        uploaded: list[Any] = []  # every local id on the device: one upload a pull, sliced

        def local_ids(ch: Chunk) -> Any:
            # (on the wire's stream, before the first copy that reads them; a chunk's upload
            # each cost ~0.2-0.3 ms of the pull thread's host time on the H200 host, 16 a
            # request of a 16-layer model, the last one on the time to first token)
            if not uploaded:
                uploaded.append(kv.ids_tensor(local))
            return uploaded[0][ch.start : ch.start + ch.count]

        def land(ch: Chunk, rows: Any) -> None:
            assert ch.segment is not None
            ids = local_ids(ch)
            segs = range(ch.segment, ch.segment + 1)
            ok = taken[ch.part][2].land(lambda: kv.scatter(rows, ids, segments=segs, cols=False))
            if not ok and all(a.failed is not None for _s, _p, a in taken):  # nothing to land
                raise ConnectionError("every load of this layer-wise pull failed")

        def preload(ch: Chunk, rows: Any) -> None:  # each landing's kernel variant, once
            key = (ch.segment, ch.count == 1, ch.count % 16 == 0)  # (Triton's int classes)
            if key in kv.preloaded:
                return
            ids = local_ids(ch)
            segs = range(ch.segment or 0, (ch.segment or 0) + 1)
            kv.scatter(rows, ids, segments=segs, cols=False, load_only=True)
            kv.preloaded.add(key)

        def landed(ch: Chunk) -> None:
            assert ch.segment is not None
            taken[ch.part][2].mark(ch.segment, self._event(wire.stream))

        deadline = max(a.deadline for _s, _p, a in taken)
        # into staging only (direct=None): a late receive must never write a reported block.
        # The step waits for each layer's landing event, never for the drain: a coarse poll.
        try:
            wire.recv(0, chunks, lambda ch: widths[ch.segment or 0], direct=lambda ch: None,
                      land=land, segment_done=landed, deadline=deadline, preload=preload,
                      drain_poll_s=_STREAM_DRAIN_POLL_S)  # fmt: skip
        except BaseException as exc:
            # Failed before the session's communicator is aborted (by _with_peer, on the way
            # out): the abort ends the pending receives and completes their landing events,
            # which must never read as landed bytes (Arriving.settle).
            for _spec, _plan, arriving in taken:
                arriving.fail(f"{type(exc).__name__}: {exc}")
            raise
        for _spec, _plan, arriving in taken:
            arriving.verify()
        for _spec, plan, arriving in taken:
            if arriving.complete() and arriving.failed is None:
                send_msg(sess.sock, {"op": "done", "request_id": plan.params.request_id})

    # -- producer, session thread ----------------------------------------------------------------

    def _serve_layers(self, sock: socket.socket, wire: Wire, msg: dict[str, Any]) -> None:
        """A consumer step's layer-wise loads (``requests``: request id and producer block ids
        each, ``chunk_bytes``): each pull admitted or refused with its reason, then the admitted
        ones sent segment-major, each chunk once its segment is computed."""
        try:
            asks, cb = _layer_asks(msg)
        except ValueError as exc:
            send_msg(sock, {"ok": False, "error": str(exc)})
            return
        taken: list[tuple[str, list[int], int]] = []
        answers: list[dict[str, Any]] = []
        try:
            for rid, ids in asks:
                token, error = self._admit_pull(rid, ids)
                if token is None:
                    answers.append({"ok": False, "error": error})
                    continue
                assert isinstance(ids, list)  # checked by _admit_pull
                taken.append((rid, ids, token))
                answers.append({"ok": True, "pull": token})
            send_msg(sock, {"ok": True, "pulls": answers})
            if not taken:
                return
            widths = [seg.row_bytes for seg in self.kv.segments]
            chunks = plan_layers([len(t[1]) for t in taken], segment_widths=widths, chunk_bytes=cb)
            readies = [self._ready_fn(rid) for rid, _ids, _t in taken]

            def ready(ch: Chunk) -> Sequence[Any]:
                wait = readies[ch.part]
                return [] if wait is None else wait(ch.segment)

            ids = [b for _rid, part, _t in taken for b in part]
            # (the drain ends the pins and frees the session for its next message; the consumer
            # waits on its own landings)
            wire.send(1, ids, chunks, ready=ready, drain_poll_s=_STREAM_DRAIN_POLL_S)
        finally:  # the blocks stay pinned until the last chunk is gathered and sent (or failed)
            for rid, _ids, token in taken:
                self._end_pull(rid, token)

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
        if arriving is not None:  # no byte more into its blocks, which the engine frees
            arriving.fail(f"request {request_id} was aborted")
            self._stream_waits([arriving.fence] if arriving.fence is not None else [])
        super()._abort(request_id)  # type: ignore[misc]

    def _forget_streams(self) -> None:
        """Drop the state of streams whose blocks were released and of loads whose pull ended."""
        with self._lock:
            for rid in [r for r in self._streams if r not in self._sendable]:
                del self._streams[rid]
        for rid in [r for r in self._arriving if r not in self._in_step]:
            del self._arriving[rid]


def _layer_asks(msg: dict[str, Any]) -> tuple[list[tuple[str, object]], int]:
    """``([(request id, block ids)], chunk_bytes)`` of a layer-wise ``pull`` (checked, never
    converted; the block ids are checked per request by ``_admit_pull``)."""
    cb = msg.get("chunk_bytes")
    if isinstance(cb, bool) or not isinstance(cb, int) or cb < 1:
        raise ValueError(f"chunk_bytes={cb!r} must be an int >= 1")
    asks = msg.get("requests")
    if not isinstance(asks, list) or not asks:
        raise ValueError(f"pull requests={asks!r} must be a non-empty list")
    out: list[tuple[str, object]] = []
    for ask in asks:
        rid = ask.get("request_id") if isinstance(ask, dict) else None
        if not isinstance(rid, str):
            raise ValueError(f"pull request {ask!r} needs a request_id string")
        out.append((rid, ask.get("block_ids")))
    if len({rid for rid, _ids in out}) != len(out):
        raise ValueError(f"pull requests name a request twice: {[r for r, _ in out]}")
    return out, cb
