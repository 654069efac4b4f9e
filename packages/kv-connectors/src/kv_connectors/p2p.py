"""``P2pConnector``: KV between two workers over ``torch.distributed`` point-to-point.

Control travels on the side channel (JSON over TCP, see :mod:`kv_connectors.transfer`); bytes travel
on a two-rank process group made per session (gloo between CPU processes, NCCL between GPUs), the
producer as rank 0 and the consumer as rank 1, rendezvous through a ``TCPStore`` the producer
hosts on its side-channel address. No global process group is touched, so a worker can talk to
several peers and a session that broke (a peer died) is simply dropped and made again.

A pull (``READ``, the default): the consumer sends ``hello`` (its layouts; the producer answers
with its live layouts and the store port, and both build the group), then ``pull`` (request id,
producer block ids, rows per chunk): one side-channel round trip a request, then bulk messages
of up to ``buffer_bytes / 2`` (:mod:`kv_connectors._p2p_wire`: double-buffered gathers and
scatters, stream-ordered on CUDA, consecutive blocks sent from and received into the cache
directly). The consumer converts the rows if the layouts differ, scatters them into its blocks,
then says ``done`` (the producer reports the request in ``done_sending``). Every socket read and
every transfer has ``timeout_s``; a peer that dies breaks the socket or the group, which ends the
load with an error (its blocks reported) well within the timeout.

On a session whose NCCL communicator is up (its first transfer made it), neither side waits for
the other before posting: the consumer asks, posts its first receive and only then reads the
answer; the producer admits the pull, posts its first send and then answers. On the H200 pair
each side's posting and the round trip cost ~0.2-0.4 ms of host time, paid once instead of one
after the other. A refused pull has a receive posted: the session is dropped and its
communicator aborted, and the load is reported failed once the session's stream ran dry (no
write into its blocks after they are handed back).

Layer-wise streaming (READ, identical layouts): the producer calls :meth:`P2pConnector.stream_request`
when it schedules a request's last prompt tokens and hands its params to the consumer at once;
its worker serves each segment as soon as ``save_kv_layer`` reports it computed. A consumer with
``P2pConfig(layerwise=True)`` loads such a request inside its forward pass
(``load_async=False``): ``wait_for_layer_load(i)`` waits for layer ``i`` only. A step's loads
from one producer are one pull (``pull`` with ``layers: true`` and a ``requests`` list),
segment-major: layer ``i`` of every request lands before layer ``i + 1`` of any (see
:mod:`kv_connectors._streaming`, and there why a cross-layer layout streams as one piece and
why a failed load's blocks never see a late write).

A push (``WRITE``): the producer connects to the consumer's side channel (``push_to``) and, in
``wait_for_save``, sends each finished request's blocks (``push``); the consumer keeps them in a
receive buffer bounded by ``receive_bytes`` (a push that does not fit is refused) and, when the
request is scheduled, converts and scatters them into its blocks. The producer frees its blocks as
soon as the push is done, whether or not the consumer has scheduled the request yet.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kv_connectors._p2p_wire import Chunk, Wire, drain_stream, plan_chunks
from kv_connectors._remote_plan import _identity
from kv_connectors._sidechannel import recv_msg, send_msg
from kv_connectors._streaming import Arriving, LayerStreaming, Produced
from kv_connectors.base import LoadSpec, log
from kv_connectors.config import P2pConfig, TransferMode, parse_address
from kv_connectors.handshake import HandshakeRefused
from kv_connectors.transfer import RemotePlan, TransferConnector
from kv_connectors.views import RegisteredKV, is_run

__all__ = ["P2pConnector"]


@dataclass
class _Staged:
    """Pushed KV waiting in the consumer's receive buffer."""

    block_ids: list[int]  # the producer's block ids, row order
    rows: torch.Tensor  # [n, producer row bytes]
    hashes: tuple[str, ...]  # the producer's compatibility hashes
    expires: float


@dataclass
class _Session:
    sock: socket.socket
    pg: Any
    hashes: tuple[str, ...]  # the producer's live compatibility hashes
    lock: threading.Lock
    wire: Wire
    identity: tuple[Any, ...] = ()  # (engine id, hashes, model fingerprint), set by the handshake


class P2pConnector(LayerStreaming, TransferConnector):
    """Producer and consumer of KV over torch.distributed point-to-point; see the module docstring."""

    transport = "p2p"

    def __init__(
        self, config: P2pConfig, *, block_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        if not isinstance(config, P2pConfig):
            raise TypeError(f"config must be a P2pConfig, got {type(config).__name__}")
        super().__init__(config, block_size=block_size, tp_rank=tp_rank, tp_size=tp_size)
        self.config: P2pConfig = config
        self._session_ids = itertools.count()
        self._store: Any = None
        self._backend = "gloo"
        self._post_before_ask = False  # set with the backend (_setup_transport)
        # push mode: producer side
        self._to_push: list[tuple[str, tuple[int, ...]]] = []
        self._pushes: dict[Future[None], str] = {}
        # push mode: consumer side, producer request id -> _Staged (or the error that ended it)
        self._staged: dict[str, _Staged | str] = {}
        self._staged_bytes = 0
        self._staged_cv = threading.Condition()
        # layer-wise streaming: producer requests streamed (request id -> computed segments) and
        # those whose SaveSpec a step's metadata carried (their segments are marked in that step)
        self._streams: dict[str, Produced] = {}
        self._stream_step: set[str] = set()
        # consumer loads inside the step: request id -> landed segments (this step's, and all
        # whose pull has not ended)
        self._arriving: dict[str, Arriving] = {}
        self._step_arriving: dict[str, tuple[LoadSpec, Arriving]] = {}

    def _setup_transport(self, kv: RegisteredKV) -> None:
        backend = self.config.backend
        if backend == "auto":
            backend = "nccl" if kv.device.type == "cuda" else "gloo"
        if backend == "nccl" and kv.device.type != "cuda":
            raise ValueError("P2pConfig.backend='nccl' needs the KV cache on a CUDA device")
        self._backend = backend
        # NCCL: a pull's first receive is posted before its answer is read, once the session's
        # communicator is up (Wire.connected: NCCL makes it at the first transfer, the receiver
        # waiting for the sender). A receive is stream-ordered (the host goes on), so the ask's
        # round trip and the producer's admission overlap its posting, and the first bytes move
        # as soon as the producer sends. A refused ask then leaves a receive posted: the session
        # is dropped, as for any failed pull, and its communicator aborted (_release_peer),
        # which ends that receive. gloo waits for the answer: its receives run on its own
        # threads, and a dropped group has no abort.
        self._post_before_ask = backend == "nccl"
        if 2 * kv.row_bytes > self.config.buffer_bytes:
            raise ValueError(
                f"P2pConfig.buffer_bytes={self.config.buffer_bytes} holds fewer than two block rows "
                f"of {kv.row_bytes} bytes (transfers are double-buffered); give buffer_bytes >= "
                f"{2 * kv.row_bytes}"
            )
        self._store = dist.TCPStore(
            self.config.host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=self._timedelta(),
        )

    def _timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.timeout_s)

    def _group(self, store: Any, session: str, rank: int) -> Any:
        prefixed = dist.PrefixStore(f"kv-p2p/{session}", store)
        if self._backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            # NCCL's watchdog acts past our own deadlines: a stuck transfer is ours to fail
            # (its loads marked failed) before its communicator is aborted, never a receive
            # that the watchdog ended without its bytes while the load still looks healthy.
            options._timeout = self._timedelta() + datetime.timedelta(seconds=60)
            return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        return dist.ProcessGroupGloo(prefixed, rank, 2, self._timedelta())

    def _buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        if self._backend == "nccl":
            return torch.empty(rows, row_bytes, dtype=torch.uint8, device=self.kv.device)
        pin = self.kv.device.type == "cuda"  # the Triton block copies read/write pinned host rows
        return torch.empty(rows, row_bytes, dtype=torch.uint8, pin_memory=pin)

    def _drain(self, deadline: float) -> None:
        """Wait for the current CUDA stream, never past ``deadline``."""
        if self.kv.device.type == "cuda":
            stream = torch.cuda.current_stream(self.kv.device)
            drain_stream(stream, deadline, self.config.timeout_s, poll_s=1e-4)

    # -- producer: one thread per session ------------------------------------------------------

    def _serve_session(self, sock: socket.socket) -> None:
        try:
            hello = self._recv_hello(sock)
            session = f"{next(self._session_ids)}-{threading.get_ident()}"
            send_msg(
                sock, {**self._hello_reply(), "store_port": self._store.port, "session": session}
            )
            sock.settimeout(self.config.timeout_s)
            pg = self._group(self._store, session, 0)
            wire = Wire(self.kv, pg, self._backend, self.config.timeout_s)
            peer_hashes = tuple(str(h) for h in hello.get("hashes", ()))
            sock.settimeout(None)  # idle between requests is fine; transfers are bounded below
            while True:
                try:
                    msg = recv_msg(sock)
                except (ConnectionError, OSError):
                    return  # the peer went away
                sock.settimeout(self.config.timeout_s)
                if msg.get("op") == "pull" and msg.get("layers") is True:
                    self._serve_layers(sock, wire, msg)  # a consumer step's layer-wise loads
                elif msg.get("op") == "pull":
                    self._send_blocks(sock, wire, msg)
                elif msg.get("op") == "push":
                    self._receive_push(sock, wire, msg, peer_hashes)
                elif msg.get("op") == "done":
                    self._mark_sent(str(msg["request_id"]))
                sock.settimeout(None)
        except Exception as exc:  # a broken session must never take the worker down
            log.warning("p2p session ended: %s: %s", type(exc).__name__, exc)

    def _send_blocks(self, sock: socket.socket, wire: Wire, msg: dict[str, Any]) -> None:
        rid = str(msg["request_id"])
        ids = msg.get("block_ids")
        try:
            chunks = self._wire_chunks(msg, len(ids) if isinstance(ids, list) else 0)
        except ValueError as exc:
            send_msg(sock, {"ok": False, "error": str(exc)})
            return
        ready = self._ready_fn(rid)
        if not (self._post_before_ask and wire.connected) or ready is not None:
            token = self._accept_pull(sock, rid, ids)  # answer first, then send
            if token is None:
                return
            answer = None
        else:
            # A connected NCCL session: the consumer asked without waiting and posts its
            # receive meanwhile, so the first send is posted before the answer goes back.
            token, error = self._admit_pull(rid, ids)
            if token is None:
                send_msg(sock, {"ok": False, "error": error})
                return
            answered = False

            def answer() -> None:
                nonlocal answered
                if not answered:
                    answered = True
                    send_msg(sock, {"ok": True, "pull": token})

        assert isinstance(ids, list)  # checked by _admit_pull
        try:  # the blocks stay pinned until the last chunk is gathered and sent (or it failed)
            wire.send(
                1, ids, chunks, ready=None if ready is None else lambda ch: ready(None),
                after_post=answer,
            )  # fmt: skip
            if answer is not None:
                answer()  # (no chunks: nothing was posted)
        finally:
            self._end_pull(rid, token)

    def _wire_chunks(self, msg: dict[str, Any], n: int) -> list[Chunk]:
        """The messages of a whole-rows ``pull`` (``chunk_rows`` blocks each; ``layers: true``
        is served by ``_serve_layers``); fields off the wire are checked, never converted."""
        layers = msg.get("layers", False)
        if layers is not False:
            raise ValueError(f"pull layers={layers!r} must be true or false")
        chunk = msg.get("chunk_rows")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_rows={chunk!r} must be an int >= 1")
        return plan_chunks(n, chunk_rows=chunk)

    def _ready_fn(self, rid: str) -> Any:
        """For a streamed request: a wait (bounded by the timeout) for each segment to be computed
        before the wire reads it; ``None`` for a finished request (every segment is)."""
        with self._lock:
            produced = self._streams.get(rid)
        if produced is None:
            return None
        deadline = time.monotonic() + self.config.timeout_s
        every = range(produced.num_segments)

        def ready(segment: int | None) -> list[Any]:
            want = every if segment is None else [segment]
            return produced.wait(want, deadline, f"streamed request {rid}")

        return ready

    # -- consumer ------------------------------------------------------------------------------

    def _hello(self) -> dict[str, Any]:
        return {"op": "hello", "hashes": self._live_hashes()}

    def _open_peer(self, host: str, sock: socket.socket, reply: dict[str, Any]) -> _Session:
        """Join the two-rank group the producer made for this session (rendezvous on its store)."""
        store = dist.TCPStore(
            host, int(reply["store_port"]), is_master=False, timeout=self._timedelta()
        )
        pg = self._group(store, str(reply["session"]), 1)
        wire = Wire(self.kv, pg, self._backend, self.config.timeout_s)
        return _Session(sock, pg, tuple(reply["hashes"]), threading.Lock(), wire)

    def _release_peer(self, sess: _Session) -> None:
        abort = getattr(sess.pg, "abort", None)  # NCCL: free a communicator that may be stuck
        if abort is not None and self._backend == "nccl":
            with contextlib.suppress(Exception):
                abort()
            # A receive may be posted on the session (a refused or broken pull): the abort ends
            # it, and the failure is reported only once its stream has run dry -- no write into
            # the load's blocks after they are handed back (bounded; a stuck one is logged).
            try:
                sess.wire.drain(time.monotonic() + min(self.config.timeout_s, 10.0))
            except TimeoutError:
                log.warning("p2p: a dropped session's stream did not drain after its abort")

    def _pull(self, spec: LoadSpec, plan: RemotePlan, asked: Any = None) -> None:
        if self.config.mode is TransferMode.WRITE:
            self._load_pushed(spec, plan)
            return
        if asked is None:
            super()._pull(spec, plan)
            return
        sess, chunk = asked  # its lock held since _ask_now
        try:
            self._pull_in(sess, spec, plan, asked=chunk)
            return
        except Exception as exc:  # mid-protocol: the session cannot serve another pull
            self._drop_peer(plan.params.host, plan.params.port, only=sess)
            if isinstance(exc, KeyError | TimeoutError | HandshakeRefused):
                raise  # refused, or the producer stalled: not a session that went stale
        finally:
            sess.lock.release()
        # The session broke under the early ask (its producer restarted on the same address,
        # say): once more on a fresh session, as _with_peer retries a stale cached one.
        super()._pull(spec, plan)

    def _ask_now(self, spec: LoadSpec, plan: RemotePlan) -> tuple[_Session, int] | None:
        """A connected NCCL session that is idle: its lock taken and the ask sent from this
        thread (``start_load_kv``'s), so the producer admits the pull and posts its send while
        the pull thread wakes (~0.2 ms on the H200 host) and posts the receive. Otherwise (no
        session yet, another pull on it, push mode, gloo) ``None``: the pull thread asks."""
        if not self._post_before_ask or self.config.mode is TransferMode.WRITE:
            return None
        params = plan.params
        with self._peers_lock:
            sess = self._peers.get((params.host, params.port))
        if not isinstance(sess, _Session):
            return None
        want = _identity(params.engine_id, params.compatibility_hashes, params.model_fingerprint)
        if not sess.wire.connected or sess.identity != want:
            return None
        try:
            chunk = self._chunk_rows(spec, plan)
        except (
            ValueError
        ):  # (bad local ids: the pull thread's load reports it; the session is fine)
            return None
        if not sess.lock.acquire(blocking=False):
            return None
        try:
            self._ask_pull(sess.sock, params, answer=False, chunk_rows=chunk)
        except Exception as exc:  # (the pull thread makes a new session)
            log.info("p2p: asking %s:%s early failed (%s)", params.host, params.port, exc)
            sess.lock.release()
            self._drop_peer(params.host, params.port, only=sess)
            return None
        return sess, chunk

    def _chunk_rows(self, spec: LoadSpec, plan: RemotePlan) -> int:
        """Blocks a message of ``spec``'s pull (both sides cut the same chunks from it)."""
        kv, src_row = self.kv, self.producer_row_bytes(plan)
        # two buffers on each side (double buffering) within buffer_bytes
        per_chunk = max(1, self.config.buffer_bytes // (2 * max(src_row, kv.row_bytes)))
        chunk = max(plan.merge, per_chunk - per_chunk % plan.merge)
        remote = plan.params.block_ids
        if plan.identity and is_run(remote) and kv.contiguous_rows(spec.block_ids) is not None:
            # Both sides move the cache's own memory (same layout, consecutive ids on each side):
            # nothing is staged, so buffer_bytes bounds nothing and one message carries the whole
            # request (the fewest host calls; raw NCCL on an H200 pair moved 1 GiB in 3.05 ms as
            # one message vs 3.19 ms as 128 MiB ones).
            chunk = len(remote)
        return chunk

    def _pull_in(
        self, sess: _Session, spec: LoadSpec, plan: RemotePlan, asked: int | None = None
    ) -> None:
        """Pull ``spec`` over ``sess`` (its lock held). ``asked``: the chunk rows of an ask
        :meth:`_ask_now` sent already."""
        params = plan.params
        kv, wire, local = self.kv, sess.wire, list(spec.block_ids)
        src_row = self.producer_row_bytes(plan)
        chunk = self._chunk_rows(spec, plan) if asked is None else asked
        remote = params.block_ids
        chunks = plan_chunks(len(remote), chunk_rows=chunk)
        # A connected NCCL session asks without waiting: the first receive is posted while the
        # producer admits the pull, and the answer read then (a refusal raises: the session is
        # dropped). A session's first pull asks and waits (module docstring).
        early = asked is not None or (self._post_before_ask and wire.connected)
        if asked is None:
            self._ask_pull(sess.sock, params, answer=not early, chunk_rows=chunk)
        conv = plan.convs[0]

        def dst(ch: Chunk) -> list[int]:  # local blocks of a chunk (chunks are whole merges)
            first = conv.num_dst_blocks(ch.start)
            return local[first : first + conv.num_dst_blocks(ch.count)]

        def direct_rows(ch: Chunk) -> torch.Tensor | None:
            return kv.contiguous_rows(dst(ch)) if plan.identity else None

        uploaded: list[torch.Tensor] = []  # the local ids on the device: one upload a pull

        def land(ch: Chunk, rows: torch.Tensor) -> None:
            if not uploaded:
                uploaded.append(kv.ids_tensor(local))
            first = conv.num_dst_blocks(ch.start)
            self._apply_rows(rows, plan, uploaded[0][first : first + conv.num_dst_blocks(ch.count)])

        def answered() -> None:  # (early: the ask's answer, once the first receive is posted)
            self._pull_answer(sess.sock)

        wire.recv(
            0, chunks, lambda ch: src_row, direct=direct_rows, land=land,
            after_post=answered if early else None,
        )  # fmt: skip
        send_msg(sess.sock, {"op": "done", "request_id": params.request_id})

    def _event(self, stream: Any) -> Any:
        """A CUDA event recorded on ``stream`` (``None``: the current stream), or ``None`` on
        the CPU (copies there are synchronous)."""
        if self.kv.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.kv.device))
        return event

    # -- push (WRITE) ---------------------------------------------------------------------------

    def request_finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        if delay and self.config.mode is TransferMode.WRITE:
            if self.config.push_to is None:
                raise ValueError("P2pConfig.mode='write' needs push_to='host:port' of the consumer")
            assert params is not None
            self._to_push.append((request.request_id, tuple(params["block_ids"])))
        return delay, params

    def close(self) -> None:
        # In-step loads still arriving fail first: closing aborts their sessions, and an abort
        # completes the landing events of receives it ends (see LayerStreaming's settle).
        for arriving in list(self._arriving.values()):
            arriving.fail("the connector was closed")
        super().close()  # (the server's close joins its sessions, the store's users)
        self._store = None  # its server thread ends now, not at interpreter exit

    def _abort(self, request_id: str) -> None:
        self._to_push = [(r, ids) for r, ids in self._to_push if r != request_id]
        super()._abort(request_id)

    def wait_for_save(self) -> None:
        """Streamed requests: every segment of this step is computed. Push mode: start pushing
        the requests finished since the last call (in the background; each is reported in
        ``done_sending`` when its push ended)."""
        super().wait_for_save()  # streamed requests: every segment is computed now
        todo, self._to_push = self._to_push, []
        for rid, ids in todo:
            fut = self._executor.submit(self._push_bound, rid, list(ids))
            with self._lock:
                self._pushes[fut] = rid

    def _push_bound(self, rid: str, ids: list[int]) -> None:
        self._bind_device()
        assert self.config.push_to is not None
        host, port = parse_address("P2pConfig", "push_to", self.config.push_to)
        token = self._start_pull(rid, ids, None)  # pinned while this push gathers its blocks
        try:
            sess = self._peer(host, port)
            with sess.lock:
                chunk = max(1, self.config.buffer_bytes // (2 * self.kv.row_bytes))
                if self.kv.contiguous_rows(ids) is not None:
                    # the blocks are the cache's own memory and the consumer receives into its
                    # receive buffer: nothing is staged on either side, so one message
                    chunk = len(ids)
                msg = {"op": "push", "request_id": rid, "block_ids": ids, "chunk_rows": chunk}
                send_msg(sess.sock, {**msg, "row_bytes": self.kv.row_bytes})
                reply = recv_msg(sess.sock)
                if not reply.get("ok"):
                    raise KeyError(f"consumer refused the push: {reply.get('error')}")
                sess.wire.send(0, ids, plan_chunks(len(ids), chunk_rows=chunk))
        except Exception:
            self._drop_peer(host, port)
            raise
        finally:
            self._end_pull(rid, token)

    def _receive_push(
        self, sock: socket.socket, wire: Wire, msg: dict[str, Any], hashes: tuple[str, ...]
    ) -> None:
        rid = str(msg["request_id"])
        ids = [int(b) for b in msg["block_ids"]]
        chunk, row = int(msg["chunk_rows"]), int(msg["row_bytes"])
        nbytes = len(ids) * row
        with self._staged_cv:
            fits = self._staged_bytes + nbytes <= self.config.receive_bytes
            if fits:
                self._staged_bytes += nbytes
        if not fits:
            reason = (
                f"push of {rid} refused: receive buffer full (receive_bytes="
                f"{self.config.receive_bytes}, {self._staged_bytes} held, {nbytes} more asked)"
            )
            with self._staged_cv:
                self._staged[rid] = reason  # the consumer's load fails now, not at its timeout
                self._staged_cv.notify_all()
            send_msg(sock, {"ok": False, "error": reason})
            return
        send_msg(sock, {"ok": True})
        rows = self._buffer(len(ids), row)  # [n, producer row bytes], counted in receive_bytes
        entry: _Staged | str
        try:
            wire.recv(  # straight into the receive buffer, chunk by chunk
                1,
                plan_chunks(len(ids), chunk_rows=chunk),
                lambda ch: row,
                direct=lambda ch: rows[ch.start : ch.start + ch.count],
                land=lambda ch, r: None,
            )
            expires = time.monotonic() + self.config.abandon_after_s
            entry = _Staged(ids, rows, hashes, expires)
        except Exception as exc:
            entry = f"push of {rid} broke: {type(exc).__name__}: {exc}"
            raise
        finally:
            with self._staged_cv:
                if isinstance(entry, str):
                    self._staged_bytes -= nbytes
                self._staged[rid] = entry
                self._staged_cv.notify_all()

    def _load_pushed(self, spec: LoadSpec, plan: RemotePlan) -> None:
        """Wait (bounded) for the pushed rows, then convert and scatter the ones planned."""
        params = plan.params
        deadline = time.monotonic() + self.config.timeout_s
        with self._staged_cv:
            while params.request_id not in self._staged:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no push of {params.request_id} within timeout_s={self.config.timeout_s}"
                    )
                self._staged_cv.wait(left)
            entry = self._staged.pop(params.request_id)
            if isinstance(entry, _Staged):
                self._staged_bytes -= entry.rows.numel()
        if isinstance(entry, str):
            raise ConnectionError(entry)
        if entry.hashes != params.compatibility_hashes:
            raise HandshakeRefused(
                f"the push came with layouts {list(entry.hashes)}, the request's params declared "
                f"{list(params.compatibility_hashes)}"
            )
        where = {b: i for i, b in enumerate(entry.block_ids)}
        missing = [b for b in params.block_ids if b not in where]
        if missing:
            raise KeyError(f"the push of {params.request_id} lacks producer blocks {missing[:8]}")
        rows = self.kv.select_rows(entry.rows, [where[b] for b in params.block_ids])
        self._apply_rows(rows, plan, spec.block_ids)
        self._drain(deadline)

    def _poll(self) -> None:
        with self._lock:
            done = [(f, rid) for f, rid in self._pushes.items() if f.done()]
            for f, _ in done:
                del self._pushes[f]
        for f, rid in done:
            if f.exception() is not None:
                log.warning("p2p push of %s failed: %s", rid, f.exception())
            self._mark_sent(rid)  # pushed or given up: either way the blocks may be freed
        now = time.monotonic()
        with self._staged_cv:
            stale = [
                r for r, e in self._staged.items() if isinstance(e, _Staged) and e.expires < now
            ]
            for r in stale:
                entry = self._staged.pop(r)
                assert isinstance(entry, _Staged)
                self._staged_bytes -= entry.rows.numel()
        super()._poll()
        self._forget_streams()
