"""``TransferConnector``: the base of connectors that move KV from a producer worker to a consumer
worker over a transport (P2P over torch.distributed, NIXL over UCX): producer bookkeeping, the
consumer's handshake planning, asynchronous loads on worker threads, and the failure model. A new
transport subclasses it and implements the session (``_setup_transport``, ``_serve_session``) and
the pull (``_open_peer``, ``_pull_in``, ``_release_peer``).

Roles (``config.role``): a ``producer`` serves its finished requests and never loads, a ``consumer``
loads and never serves, ``both`` (the default) serves every finished request that it did not load
from a producer.

Producer (prefill): ``request_finished`` keeps the request's blocks (``delay_free=True``) and
returns :class:`KVTransferParams` naming its side channel, block ids and layouts. A consumer pulls
them; when it says it is done the request is reported in ``done_sending``. A consumer that never
comes is given up on after ``abandon_after_s`` (then the blocks are reported sent and freed).
A pull that *started* pins the blocks until it ends, whatever ``abandon_after_s`` says: a request
is reported in ``done_sending`` only once no pull of it is in flight (P2P: the producer's sends
ended; NIXL: the consumer's completion notification arrived, or the READ lease it was granted
expired — a consumer never reports success for a READ that completes after its lease). A pull
asked for after ``abandon_after_s`` is refused (a load error on the consumer).

Consumer (decode): a request carrying producer params (``request.kv_transfer_params`` or
:meth:`TransferConnector.add_remote_request`) is planned against the local layouts
(:func:`~kv_connectors.handshake.plan_conversion`); a refusal means zero matched tokens (the engine
computes the prompt) and its reason is kept in ``load_error_reasons``; so does a producer whose
``model_fingerprint`` differs from this worker's. Peers are cached per producer address; when the
worker behind an address changes (another engine id, layouts or model fingerprint than a request's
params declare, e.g. a producer restarted with another layout) the cached session is dropped and
made again once before the request is refused. Loads run on worker threads
(``load_async=True``); each ends in ``done_recving``, with its blocks in
``get_block_ids_with_load_errors()`` when it failed (dead peer, refused live handshake, timeout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import socket
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import torch

from kv_connectors._holding import Held, ProducerHolds
from kv_connectors._remote_plan import Planner, RemotePlan, _identity, _Peer
from kv_connectors._sidechannel import (
    SideChannelServer,
    StaleSession,
    connect,
    recv_msg,
    request,
    send_msg,
)
from kv_connectors.base import (
    ConnectorCapabilities,
    KVConnector,
    LoadSpec,
    RequestLike,
    log,
    transfer_params_of,
)
from kv_connectors.config import (
    KVRole,
    NixlConfig,
    P2pConfig,
    check_ids,
    check_int,
    check_str,
    check_timeout,
)
from kv_connectors.handshake import (
    HandshakeRefused,
    KVTransferParams,
    convert_rows,
)
from kv_connectors.views import RegisteredKV

__all__ = ["RemotePlan", "TransferConnector"]


class TransferConnector(ProducerHolds, KVConnector):
    """Base of the producer -> consumer transports (P2P, NIXL); subclasses serve sessions and
    pull bytes (see the module docstring)."""

    transport: ClassVar[str] = ""
    CAPABILITIES = ConnectorCapabilities(
        kind="transfer", load_async=True, converts_layouts=True, faults=("peer_gone",)
    )

    def __init__(
        self, config: P2pConfig | NixlConfig, *, block_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(block_size=block_size)
        check_int(type(self).__name__, "tp_size", tp_size, minimum=1)
        check_int(type(self).__name__, "tp_rank", tp_rank, minimum=0, maximum=tp_size - 1)
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._lock = threading.Lock()
        self._clock: Callable[[], float] = time.monotonic  # deadlines and leases (tests move it)
        self._sendable: dict[str, Held] = {}
        self._pull_ids = itertools.count(1)
        self._remote: dict[str, KVTransferParams] = {}
        self._plans: dict[str, tuple[RemotePlan, int]] = {}  # id -> (plan, first local block)
        self._load_plans: dict[str, RemotePlan] = {}
        self._consumed: set[str] = set()  # requests loaded from a producer (never served on)
        self._in_step: set[str] = set()  # loads inside the forward pass: no done_recving
        # each pull's loads (a P2P layer-wise pull carries a step's loads from one producer)
        self._futures: dict[Future[None], tuple[LoadSpec, ...]] = {}
        self._asked: set[Future[None]] = set()  # pulls whose ask left already (never cancelled)
        self._executor = ThreadPoolExecutor(
            max_workers=4, thread_name_prefix=f"kv-{self.transport}"
        )
        self._server: SideChannelServer | None = None
        # consumer: one cached peer per producer side channel (host, port)
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._peers_lock = threading.Lock()
        self._bound = threading.local()  # the device each thread is set to (_bind_device)
        self._planner: Planner | None = None  # _plan's, for the registered caches

    def _on_register(self, kv: RegisteredKV) -> None:
        if self._server is None:
            self._setup_transport(kv)
            self._server = SideChannelServer(
                self.config.host, self.config.port, self._serve_bound, name=f"kv-{self.transport}"
            )

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of this worker's side channel (after ``register_kv_caches``)."""
        if self._server is None:
            raise RuntimeError("register_kv_caches must be called first")
        return self._server.host, self._server.port

    def _bind_device(self) -> None:
        # The current CUDA device is per thread: session and pull threads start on device 0.
        # Set once per thread (the pool's threads live on): the cache's device is fixed at
        # registration, and nothing here sets another.
        if self.kv.device.type == "cuda" and getattr(self._bound, "device", None) != self.kv.device:
            torch.cuda.set_device(self.kv.device)
            self._bound.device = self.kv.device

    def _serve_bound(self, sock: Any) -> None:
        self._bind_device()
        self._serve_session(sock)

    def _pull_bound(self, spec: LoadSpec, plan: RemotePlan, asked: Any = None) -> None:
        self._bind_device()
        self._pull(spec, plan, asked)

    @abstractmethod
    def _setup_transport(self, kv: RegisteredKV) -> None: ...

    @abstractmethod
    def _serve_session(self, sock: Any) -> None: ...

    @abstractmethod
    def _open_peer(self, host: str, sock: socket.socket, reply: dict[str, Any]) -> Any:
        """Set up the transport for a producer that answered ``hello`` with ``reply`` (``ok``)."""

    @abstractmethod
    def _release_peer(self, peer: Any) -> None:
        """Free a dropped peer's transport resources (its socket is already closed)."""

    @abstractmethod
    def _pull_in(self, peer: Any, spec: LoadSpec, plan: RemotePlan) -> None:
        """Move the planned blocks from ``peer`` (its lock held, its live layouts checked)."""

    # -- scheduler side ------------------------------------------------------------------------

    def add_remote_request(
        self, request_id: str, params: KVTransferParams | dict[str, Any]
    ) -> None:
        """Attach a producer's params to a request (for requests that cannot carry them)."""
        check_str("add_remote_request", "request_id", request_id, what="the engine's request id")
        if not isinstance(params, KVTransferParams | dict):
            raise TypeError(
                f"add_remote_request: params is a {type(params).__name__}; give the "
                "KVTransferParams (or its dict) the producer's request_finished returned"
            )
        self._remote[request_id] = (
            params if isinstance(params, KVTransferParams) else KVTransferParams.from_dict(params)
        )

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._check_computed(num_computed_tokens)
        rid = request.request_id
        params = self._remote.get(rid) or transfer_params_of(request)
        if params is None or self.config.role is KVRole.PRODUCER:
            return 0, False
        try:
            plan = self._plan(params)
        except HandshakeRefused as exc:
            self._worker.error_reasons[rid] = f"handshake refused: {exc.reason}"
            log.warning("request %s: %s", rid, self._worker.error_reasons[rid])
            return 0, False
        n_dst = plan.convs[0].num_dst_blocks(len(params.block_ids))
        first = num_computed_tokens // self.block_size
        if num_computed_tokens % self.block_size or first % plan.split or first >= n_dst:
            return 0, False  # nothing whole left to load (a ragged start is recomputed)
        remote_first = first * plan.merge // plan.split
        remote_count = (n_dst - first) * plan.merge // plan.split
        sliced = params.sliced(remote_first, remote_first + remote_count)
        plan = dataclasses.replace(plan, params=sliced)
        self._plans[rid] = (plan, first)
        self._matched[rid] = (first, n_dst - first)
        return (n_dst - first) * self.block_size, True

    def _plan(self, params: KVTransferParams) -> RemotePlan:
        """The plan of loading ``params`` here, or ``HandshakeRefused`` (:class:`Planner`)."""
        kv = self.kv
        if self._planner is None or self._planner.kv is not kv:
            self._planner = Planner(
                kv, self.transport, self.config.model_fingerprint, (self.tp_rank, self.tp_size)
            )
        return self._planner.plan(params)

    def _plan_load(
        self, request: RequestLike, block_ids: list[int], first: int, count: int
    ) -> LoadSpec:
        plan, _first = self._plans.pop(request.request_id)
        self._remote.pop(request.request_id, None)
        if (count * plan.merge) % plan.split:
            raise ValueError(
                f"request {request.request_id}: {count} blocks do not cover whole producer blocks "
                f"({plan.split} local blocks per producer block); accept all matched tokens or "
                "a multiple of that"
            )
        # the engine may take less
        plan = dataclasses.replace(
            plan, params=plan.params.sliced(0, count * plan.merge // plan.split)
        )
        self._load_plans[request.request_id] = plan
        self._consumed.add(request.request_id)
        return LoadSpec(
            request.request_id, tuple(block_ids[first : first + count]), (), params=plan.params
        )

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._plans.pop(rid, None)
        consumed = rid in self._consumed or self._remote.pop(rid, None) is not None
        self._consumed.discard(rid)
        if consumed or transfer_params_of(request) is not None:
            return False, None  # a consumer's request: nothing to serve
        if self.config.role is KVRole.CONSUMER:
            return False, None
        n = min(len(request.block_hashes), len(block_ids))
        if n == 0 or self._server is None:
            return False, None
        ids = tuple(block_ids[:n])
        check_ids("request_finished", "block_ids", ids)
        with self._lock:
            self._sendable[rid] = Held(ids, self._clock() + self.config.abandon_after_s)
            self._due_by(self._sendable[rid].deadline)
        params = KVTransferParams.for_layouts(
            self.kv.layouts,
            request_id=rid,
            engine_id=self.config.engine_id,
            transport=self.transport,
            host=self._server.host,
            port=self._server.port,
            block_ids=ids,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            model_fingerprint=self.config.model_fingerprint,
        )
        return True, params.to_dict()

    def _drop_load(self, spec: LoadSpec) -> None:
        self._load_plans.pop(spec.request_id, None)
        self._consumed.discard(spec.request_id)
        with self._lock:
            self._worker.done_recving.add(spec.request_id)  # the engine waits for it

    def _abort(self, request_id: str) -> None:
        """Consumer: a pull not yet started is cancelled (reported failed in ``done_recving``);
        one under way ends as it would. Producer: a held request is released as soon as no pull
        of it is in flight (its blocks are never freed under a pull)."""
        self._plans.pop(request_id, None)
        self._remote.pop(request_id, None)
        if self._load_plans.pop(request_id, None) is not None:  # planned, not started: see base
            self._consumed.discard(request_id)
            with self._lock:
                self._worker.done_recving.add(request_id)
        with self._lock:
            for fut, specs in self._futures.items():
                # Only one not yet running is cancelled (_poll reports it), and not one whose
                # ask already left (_ask_now): the producer serves it and the session's lock
                # waits for its pull thread, so it runs and ends as one under way would.
                if [s.request_id for s in specs] == [request_id] and fut not in self._asked:
                    fut.cancel()
            held = self._sendable.get(request_id)
            if held is not None:
                held.deadline = float("-inf")  # abandoned now: freed once no pull is in flight
                self._due_by(held.deadline)
                self._release_locked(request_id, held, self._clock())

    # -- producer side (session threads) --------------------------------------------------------

    def _live_hashes(self) -> list[str]:
        return [lay.compatibility_hash() for lay in self.kv.layouts]

    @staticmethod
    def _recv_hello(sock: socket.socket) -> dict[str, Any]:
        hello = recv_msg(sock)
        if hello.get("op") != "hello":
            raise ConnectionError(f"expected hello, got {hello.get('op')!r}")
        return hello

    def _accept_pull(
        self, sock: socket.socket, rid: str, ids: object, lease_s: float | None = None
    ) -> int | None:
        """Answer a consumer's ``pull``: ``ok`` (with the pull's token and lease) if the blocks are
        held for it, else the reason. Returns the token of the pull now pinning the blocks (end it
        with :meth:`_end_pull`), or ``None`` when refused. ``ids`` come off the wire: a list of
        ints in the cache's range, checked (never converted)."""
        token, error = self._admit_pull(rid, ids, lease_s)
        if token is None:
            send_msg(sock, {"ok": False, "error": error})
            return None
        reply: dict[str, Any] = {"ok": True, "pull": token}
        if lease_s is not None:
            reply["lease_s"] = lease_s
        try:
            send_msg(sock, reply)
        except BaseException:
            self._end_pull(rid, token)
            raise
        return token

    def _admit_pull(
        self, rid: str, ids: object, lease_s: float | None = None
    ) -> tuple[int | None, str]:
        """``(token, "")`` of a pull of ``ids`` (off the wire: checked, never converted) now
        pinning the blocks, or ``(None, the reason)`` it is refused."""
        try:
            if not isinstance(ids, list):
                raise ValueError(f"pull block_ids={ids!r} is not a list of block ids")
            self.kv.check_block_ids(ids, what="pull block_ids")
            return self._start_pull(rid, ids, lease_s), ""
        except (KeyError, ValueError) as exc:
            return None, str(exc)

    def _hello_reply(self) -> dict[str, Any]:
        """What every producer says about itself in its ``hello`` answer."""
        return {
            "ok": True,
            "hashes": self._live_hashes(),
            "engine_id": self.config.engine_id,
            "model_fingerprint": self.config.model_fingerprint,
        }

    # -- consumer side (pull threads) -----------------------------------------------------------

    def _hello(self) -> dict[str, Any]:
        return {"op": "hello"}

    def _peer(self, host: str, port: int) -> Any:
        """The cached peer for ``(host, port)``, or a new one after a ``hello`` handshake."""
        key = (host, port)
        with self._peers_lock:
            peer = self._peers.get(key)
        if peer is not None:
            return peer
        sock = connect(host, port, self.config.timeout_s)
        try:
            send_msg(sock, self._hello())
            reply = recv_msg(sock)
            if not reply.get("ok"):
                raise HandshakeRefused(str(reply.get("error")))
            peer = self._open_peer(host, sock, reply)
            peer.identity = _identity(
                str(reply.get("engine_id")),
                [str(h) for h in reply.get("hashes", ())],
                reply.get("model_fingerprint"),
            )
        except BaseException:
            sock.close()
            raise
        with self._peers_lock:
            self._peers[key] = peer
        return peer

    def _drop_peer(self, host: str, port: int, only: Any = None) -> None:
        """Forget the peer of ``(host, port)`` (if ``only`` is given: only if it is that one)."""
        with self._peers_lock:
            peer = self._peers.get((host, port))
            if peer is None or (only is not None and peer is not only):
                return
            del self._peers[(host, port)]
        with contextlib.suppress(OSError):
            peer.sock.close()
        self._release_peer(peer)

    def _pull(self, spec: LoadSpec, plan: RemotePlan, asked: Any = None) -> None:
        """Load ``spec`` (a pull thread). ``asked``: what :meth:`_ask_now` returned for it."""
        self._with_peer(plan.params, lambda peer: self._pull_in(peer, spec, plan))

    def _ask_now(self, spec: LoadSpec, plan: RemotePlan) -> Any:
        """On ``start_load_kv``'s thread, before the pull thread starts: ask the producer now
        where the transport can (its answer, or ``None``: the pull thread asks)."""
        return None

    def _with_peer(self, params: KVTransferParams, work: Callable[[Any], None]) -> None:
        """Run ``work(peer)`` on the peer of ``params``'s address (its lock held, its live
        identity the one the params name; a peer that broke is dropped)."""
        want = _identity(params.engine_id, params.compatibility_hashes, params.model_fingerprint)
        for attempt in range(2):
            with self._peers_lock:
                cached = (params.host, params.port) in self._peers
            try:
                peer = self._peer(params.host, params.port)
                with peer.lock:
                    if peer.identity != want:
                        if cached and not attempt:
                            # Another worker now answers on this address (a restart with
                            # another layout, engine or model): make a fresh session, once.
                            self._drop_peer(params.host, params.port, only=peer)
                            continue
                        engine, hashes, fingerprint = peer.identity
                        raise HandshakeRefused(
                            f"producer {params.host}:{params.port} now serves layouts "
                            f"{list(hashes)} (engine {engine!r}, model {fingerprint!r}), the "
                            f"request's params declared {list(params.compatibility_hashes)} "
                            f"(engine {params.engine_id!r}, model {params.model_fingerprint!r})"
                        )
                    work(peer)
                return
            except HandshakeRefused:
                raise
            except StaleSession:
                self._drop_peer(params.host, params.port)
                if not cached or attempt:
                    raise
                # the producer restarted since this peer was made: one retry with a fresh one
            except Exception:
                self._drop_peer(params.host, params.port)  # the next request makes a new one
                raise

    def _ask_pull(
        self, sock: socket.socket, params: KVTransferParams, *, answer: bool = True, **extra: Any
    ) -> tuple[list[int], dict[str, Any]]:
        """Ask the producer to serve ``params.block_ids``: ``(ids, its reply)`` (a refusal
        raises). ``answer=False``: only ask (the reply is ``{}``); read it later with
        :meth:`_pull_answer`."""
        ids = list(params.block_ids)
        msg = {"op": "pull", "request_id": params.request_id, "block_ids": ids, **extra}
        if not answer:
            try:
                send_msg(sock, msg)
            except (ConnectionError, OSError) as exc:  # (as request() says it)
                raise StaleSession(f"side channel closed: {exc}") from exc
            return ids, {}
        return ids, self._pull_answer(sock, request(sock, msg))

    @staticmethod
    def _pull_answer(sock: socket.socket, reply: dict[str, Any] | None = None) -> dict[str, Any]:
        """The producer's answer to a pull (read off ``sock`` when not given); a refusal raises."""
        if reply is None:
            try:
                reply = recv_msg(sock)
            except TimeoutError:
                raise
            except (ConnectionError, OSError) as exc:
                raise StaleSession(f"side channel closed: {exc}") from exc
        if not reply.get("ok"):
            raise KeyError(f"producer refused the pull: {reply.get('error')}")
        return reply

    # -- worker side ---------------------------------------------------------------------------

    def start_load_kv(self, meta: Any) -> None:
        for spec in meta.loads:
            plan = self._load_plans.pop(spec.request_id, None)
            if plan is None or not spec.block_ids:
                continue
            asked = self._ask_now(spec, plan)
            fut = self._executor.submit(self._pull_bound, spec, plan, asked)
            with self._lock:
                self._futures[fut] = (spec,)
                if asked is not None:
                    self._asked.add(fut)

    def wait_for_save(self) -> None:
        """Producers serve from the live blocks (kept by ``delay_free``): nothing to flush."""

    def wait_for_loads(self, timeout_s: float | None = None) -> None:
        """Block until every started load ended (bounded: ``timeout_s``, default the config's
        ``timeout_s`` plus a margin)."""
        if timeout_s is None:
            timeout_s = self.config.timeout_s * 2 + 5
        timeout_s = check_timeout("wait_for_loads", "timeout_s", timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = [f for f in self._futures if not f.done()]
            if not pending or time.monotonic() > deadline:
                return
            time.sleep(0.005)

    def _poll(self) -> None:
        with self._lock:
            done = [(f, s) for f, s in self._futures.items() if f.done()]
            for f, _ in done:
                del self._futures[f]
                self._asked.discard(f)
            self._expire_locked()
        for f, specs in done:
            reason: str | None = None
            if f.cancelled():  # abort_request: never loaded, so never reported as loaded
                reason = "the request was aborted before its pull started"
            elif (exc := f.exception()) is not None:
                reason = f"{type(exc).__name__}: {exc}"
            for spec in specs:
                is_async = spec.request_id not in self._in_step
                self._in_step.discard(spec.request_id)
                self._load_ended(spec, reason, async_load=is_async)

    def _load_ended(self, spec: LoadSpec, reason: str | None, *, async_load: bool) -> None:
        """The pull of ``spec`` ended (``reason``: why it failed, ``None``: it succeeded)."""
        if reason is not None:
            self._fail_load(spec, reason, async_load=async_load)
        elif async_load:
            with self._lock:
                self._worker.done_recving.add(spec.request_id)

    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        self._poll()
        with self._lock:
            out = (self._worker.done_sending, self._worker.done_recving)
            self._worker.done_sending, self._worker.done_recving = set(), set()
        return out

    def _fail_load(self, spec: LoadSpec, reason: str, *, async_load: bool) -> None:
        with self._lock:
            super()._fail_load(spec, reason, async_load=async_load)

    # -- bytes ---------------------------------------------------------------------------------

    def _apply_rows(
        self, src_rows: torch.Tensor, plan: RemotePlan, block_ids: Sequence[int] | torch.Tensor
    ) -> None:
        """Convert producer rows (``[n, producer row bytes]``) and write them to local blocks
        (``block_ids``: a list, or ids already on the cache's device, checked when uploaded)."""
        kv = self.kv
        ids = block_ids if isinstance(block_ids, torch.Tensor) else kv.ids_tensor(block_ids)
        if plan.identity:
            kv.scatter(src_rows, ids)
            return
        m = plan.convs[0].num_dst_blocks(src_rows.shape[0])
        if src_rows.device.type == "cpu":
            dst = kv.new_rows(m, pin=True).zero_()  # pinned: the block copies read it directly
        else:
            dst = torch.zeros(m, kv.row_bytes, dtype=torch.uint8, device=src_rows.device)
        offset = 0
        for ci, conv in enumerate(plan.convs):
            width = conv.src.num_layers * conv.src.page_bytes
            part = convert_rows(src_rows[:, offset : offset + width], conv)
            dst[:, kv.cache_row_slice(ci)] = part
            offset += width
        kv.scatter(dst, ids)

    def producer_row_bytes(self, plan: RemotePlan) -> int:
        return sum(c.src.num_layers * c.src.page_bytes for c in plan.convs)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._peers_lock:
            keys = list(self._peers)
        for host, port in keys:
            self._drop_peer(host, port)
