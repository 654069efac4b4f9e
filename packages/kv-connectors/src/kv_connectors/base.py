"""The connector contract: a scheduler side and a worker side, modelled on what engines speak.

Scheduler side (decides, never touches KV):

- ``get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)``: how many
  tokens past the locally computed prefix the connector can supply (whole blocks), and whether they
  arrive asynchronously (the engine then waits for the request in ``get_finished``'s
  ``done_recving`` before scheduling it) or inside the forward pass (layer by layer);
- ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the engine allocated the
  request's blocks (``block_ids``: its whole block table so far, in order) — plan the load;
- ``build_connector_meta() -> ConnectorMetadata``: everything planned since the last call, for the
  worker side;
- ``blocks_computed(request, block_ids)`` (optional): a running request has more complete blocks
  than when last told (``request.block_hashes``: all of them, computed by the steps before this
  one); called before ``build_connector_meta``, so a store may save them in this step rather than
  all at ``request_finished`` (vLLM's offloading connector stores as blocks fill, the same way);
- ``request_finished(request, block_ids) -> (delay_free, kv_transfer_params)``: the request is done;
  ``delay_free=True`` asks the engine to keep its blocks until ``done_sending`` reports it (every
  save of the request, the ones ``blocks_computed`` started included);
- ``abort_request(request_id)``: the engine dropped the request: what was planned for it and not
  started is dropped, what is under way ends as it would; the engine keeps the request's blocks
  until the connector reports it (``done_recving`` for a load it waits for, ``done_sending`` for
  blocks it held back with ``delay_free``).

Worker side (moves KV): ``register_kv_caches(storages, layouts)``, ``start_load_kv(meta)``,
``wait_for_layer_load(layer)``, ``save_kv_layer(layer, meta)``, ``wait_for_save()``,
``get_finished(finished_req_ids) -> (done_sending, done_recving)``,
``get_block_ids_with_load_errors()``, ``get_request_ids_with_save_errors()``, and
``handle_preemptions(request_ids)`` (optional, vLLM's name): the engine freed running requests'
blocks (preempted or aborted) and is about to write them: a save of theirs still copying must
read them first.

Errors reach the engine through the contract, never only a log line: a failed load through
``get_block_ids_with_load_errors`` (the engine recomputes those blocks); a failed save through
``get_request_ids_with_save_errors`` (requests whose KV a connector could not store: a later
request finds no hit for them; ``done_sending`` only ever meant "the blocks may be freed").

Block ids here are the ids of the registered caches' blocks; the engine's scheduler block size must
equal the layout's ``block_size`` (expand manager blocks to kernel blocks before calling in).
Requests are read through two attributes: ``request_id`` and ``block_hashes`` (kv-blocktable's
chained hashes of the request's full blocks); producer-side parameters arrive as the optional
attribute ``kv_transfer_params`` (a :class:`~kv_connectors.handshake.KVTransferParams` or its dict).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kv_kernels import KVCacheStorage
from kv_spec import KVCacheLayout

from kv_connectors.config import check_int, check_str
from kv_connectors.handshake import KVTransferParams
from kv_connectors.views import RegisteredKV

__all__ = [
    "FAULTS",
    "ConnectorCapabilities",
    "ConnectorMetadata",
    "KVConnector",
    "LoadSpec",
    "RequestLike",
    "SaveSpec",
    "transfer_params_of",
]

log = logging.getLogger("kv_connectors")


class RequestLike(Protocol):
    """What a connector reads from a request (kv-blocktable's ``Request`` has both)."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...


def transfer_params_of(request: object) -> KVTransferParams | None:
    """The producer's :class:`KVTransferParams` a request carries, if any."""
    params = getattr(request, "kv_transfer_params", None)
    if params is None or isinstance(params, KVTransferParams):
        return params
    if isinstance(params, dict):
        return KVTransferParams.from_dict(params)
    raise TypeError(
        f"request.kv_transfer_params must be KVTransferParams, a dict or None, got {type(params)}"
    )


@dataclass(frozen=True)
class LoadSpec:
    """Load ``block_hashes[i]`` (or the producer's block ``params.block_ids[i]``) into local block
    ``block_ids[i]``."""

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...] = ()
    params: KVTransferParams | None = None


@dataclass(frozen=True)
class SaveSpec:
    """Save local block ``block_ids[i]`` under ``block_hashes[i]``."""

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the scheduler side hands the worker side for one engine step."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


#: The failure-model faults a connector may declare (``ConnectorCapabilities.faults``); the
#: contract suite (``tests/test_contract.py``) injects each one a connector declares.
FAULTS: dict[str, str] = {
    "corrupt_block": "a stored block's bytes were damaged: that block is a load error, never KV",
    "peer_gone": "the producer went away before the pull: a load error within the timeout",
}


@dataclass(frozen=True)
class ConnectorCapabilities:
    """What a connector declares, as data (read by the contract suite and by engines).

    ``kind``: ``"store"`` (saves finished requests' blocks under their block hashes, loads them
    back for a later request with the same prefix) or ``"transfer"`` (a producer's
    ``request_finished`` returns params a consumer loads from). ``load_async``: loads end in
    ``done_recving`` (else inside the step, layer by layer). ``converts_layouts``: a load may
    target another physical order, block size (exact merge / split) and TP head split than the
    source's (the handshake plans it); a store loads only into the layout it saved from.
    ``faults``: the :data:`FAULTS` it handles.
    """

    kind: str
    load_async: bool
    converts_layouts: bool = False
    faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("store", "transfer"):
            raise ValueError(
                f"ConnectorCapabilities.kind={self.kind!r}: give 'store' or 'transfer'"
            )
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise ValueError(
                f"ConnectorCapabilities.faults {unknown} are not in FAULTS {sorted(FAULTS)}"
            )


@dataclass
class _WorkerState:
    kv: RegisteredKV | None = None
    load_errors: set[int] = field(default_factory=set)
    error_reasons: dict[str, str] = field(default_factory=dict)
    done_sending: set[str] = field(default_factory=set)
    done_recving: set[str] = field(default_factory=set)
    save_errors: dict[str, str] = field(default_factory=dict)
    save_lock: threading.Lock = field(default_factory=threading.Lock)


class KVConnector(ABC):
    """Base of every connector: the bookkeeping both sides share; subclasses move the bytes.

    ``block_size`` is the engine's block size in tokens (what ``num_computed_tokens`` and block
    hashes count in). Each concrete connector declares :attr:`CAPABILITIES`.
    """

    CAPABILITIES: ClassVar[ConnectorCapabilities]

    @property
    def capabilities(self) -> ConnectorCapabilities:
        """What this connector declares (its class's :attr:`CAPABILITIES`)."""
        return type(self).CAPABILITIES

    def __init__(self, *, block_size: int) -> None:
        check_int(type(self).__name__, "block_size", block_size, minimum=1)
        self.block_size = block_size
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._matched: dict[str, tuple[int, int]] = {}  # request id -> (first block, num blocks)
        self._worker = _WorkerState()

    # -- scheduler side ------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` this connector can load, and whether asynchronously."""

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Plan the load of the blocks matched for ``request`` (no-op when nothing matched)."""
        check_int("update_state_after_alloc", "num_external_tokens", num_external_tokens, minimum=0)
        first, count = self._matched.pop(request.request_id, (0, 0))
        if num_external_tokens <= 0 or count == 0:
            return
        want = num_external_tokens // self.block_size
        if want > count:
            raise ValueError(
                f"request {request.request_id}: num_external_tokens={num_external_tokens} exceeds "
                f"the {count * self.block_size} tokens matched"
            )
        if len(block_ids) < first + want:
            raise ValueError(
                f"request {request.request_id}: {len(block_ids)} block ids allocated, but the load "
                f"needs blocks [{first}, {first + want})"
            )
        self._loads.append(self._plan_load(request, list(block_ids), first, want))

    def _plan_load(
        self, request: RequestLike, block_ids: list[int], first: int, count: int
    ) -> LoadSpec:
        hashes = tuple(request.block_hashes[first : first + count])
        return LoadSpec(request.request_id, tuple(block_ids[first : first + count]), hashes)

    def build_connector_meta(self) -> ConnectorMetadata:
        """Everything planned since the last call."""
        meta = ConnectorMetadata(tuple(self._loads), tuple(self._saves))
        self._loads.clear()
        self._saves.clear()
        return meta

    def blocks_computed(self, request: RequestLike, block_ids: Sequence[int]) -> None:  # noqa: B027
        """Running ``request``'s complete blocks grew: ``request.block_hashes`` are all of them
        (every slot computed by the steps before this one), ``block_ids`` its block table (at
        least as long). The engine calls it before this step's ``build_connector_meta``; a store
        may plan saves of the blocks it has not seen. Default: nothing (saves wait for
        :meth:`request_finished`)."""

    @abstractmethod
    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a finished request."""

    def abort_request(self, request_id: str) -> None:
        """The engine dropped ``request_id`` (a client went away): forget its match, drop its
        planned loads and saves not yet handed to the worker side (a dropped save is reported in
        ``done_sending`` at once, a dropped asynchronous load in ``done_recving``, so the engine
        frees the blocks it kept for them). A transfer already under way ends as it would and is
        reported then: the engine must keep the request's blocks until that report. Unknown ids
        are ignored (an abort races with the request finishing)."""
        check_str(
            f"{type(self).__name__}.abort_request", "request_id", request_id, what="a request id"
        )
        self._matched.pop(request_id, None)
        for spec in [s for s in self._loads if s.request_id == request_id]:
            self._loads.remove(spec)
            self._drop_load(spec)
        if self._drop_planned_saves(request_id) and not self._saves_open(request_id):
            self._worker.done_sending.add(request_id)
        self._abort(request_id)

    def _drop_planned_saves(self, request_id: str) -> bool:
        """Drop ``request_id``'s saves planned and not yet handed to the worker side (their
        blocks are leaving the request: a save built later would read whatever is written there
        next); whether there were any."""
        dropped = [s for s in self._saves if s.request_id == request_id]
        for save in dropped:
            self._saves.remove(save)
            self._drop_save(save)
        return bool(dropped)

    def _saves_open(self, request_id: str) -> bool:
        """Subclass hook: whether a save of ``request_id`` handed to the worker side is still
        copying (its ``done_sending`` then waits for that save)."""
        return False

    def _drop_load(self, spec: LoadSpec) -> None:  # noqa: B027 - optional hook
        """Subclass hook: undo what planning ``spec`` reserved (pins, plans)."""

    def _drop_save(self, spec: SaveSpec) -> None:  # noqa: B027 - optional hook
        """Subclass hook: undo what planning ``spec`` reserved (tier slots, in-progress marks)."""

    def _abort(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Subclass hook: end ``request_id``'s transfers past planning (held blocks, pulls)."""

    def _check_computed(self, num_computed_tokens: object) -> None:
        """``get_num_new_matched_tokens``'s ``num_computed_tokens``: an int >= 0."""
        check_int(
            f"{type(self).__name__}.get_num_new_matched_tokens",
            "num_computed_tokens",
            num_computed_tokens,
            minimum=0,
        )

    def _matched_blocks(self, num_computed_tokens: int, hits: int) -> tuple[int, int]:
        """``(first block, tokens)`` for ``hits`` consecutive matched blocks from the first block
        not yet computed."""
        first = num_computed_tokens // self.block_size
        tokens = (first + hits) * self.block_size - num_computed_tokens
        return first, max(tokens, 0) if hits else 0

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(
        self,
        storages: KVCacheStorage | Sequence[KVCacheStorage],
        layouts: KVCacheLayout | Sequence[KVCacheLayout],
    ) -> None:
        """Register the worker's caches: one ``(storage, layout)`` or a list of them (KV-cache
        groups sharing one block-id space). Storages are what ``kv_kernels.allocate_kv_cache``
        returned: a list of per-layer tensors (``L``-outer orders) or one cross-layer slab."""
        kv = RegisteredKV(storages, layouts)
        sizes = {lay.block_size for lay in kv.layouts}
        if sizes != {self.block_size}:
            raise ValueError(
                f"registered layouts have block_size {sorted(sizes)} but the connector counts "
                f"blocks of {self.block_size} tokens; expand manager blocks to kernel blocks or "
                "build the connector with the layout's block_size"
            )
        self._worker.kv = kv
        self._on_register(kv)

    def _on_register(self, kv: RegisteredKV) -> None:  # noqa: B027 - optional hook
        """Subclass hook: prepare per-cache state (buffers, descriptors) once."""

    @property
    def kv(self) -> RegisteredKV:
        if self._worker.kv is None:
            raise RuntimeError("register_kv_caches(storages, layouts) must be called first")
        return self._worker.kv

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Start every load in ``meta`` (returns without waiting for the bytes)."""

    def wait_for_layer_load(self, layer: int) -> None:  # noqa: B027 - loads may be whole-block
        """Block until layer slot ``layer`` of every load started this step is in place."""

    def save_kv_layer(self, layer: int, meta: ConnectorMetadata) -> None:  # noqa: B027
        """Layer slot ``layer`` is computed: the connector may start saving it."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until the saves of this step are handed off (a failure is reported by
        :meth:`get_request_ids_with_save_errors`)."""

    def handle_preemptions(self, request_ids: Iterable[str]) -> None:  # noqa: B027
        """The engine freed these running requests' blocks (preempted or aborted) and will write
        them next: return once no save of theirs can read the blocks after those writes (on CUDA
        a wait of the compute stream on the saves' events; no host sync). Default: nothing (a
        connector that saves only finished requests' blocks, which the engine keeps)."""

    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` since the last call. ``finished_req_ids`` are requests
        the engine finished this step (connectors that keep per-request state drop it)."""
        self._poll()
        sending, recving = self._worker.done_sending, self._worker.done_recving
        self._worker.done_sending, self._worker.done_recving = set(), set()
        return sending, recving

    def _poll(self) -> None:  # noqa: B027 - optional hook
        """Subclass hook: collect finished asynchronous transfers."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose load failed since the last call: the engine recomputes them."""
        out, self._worker.load_errors = self._worker.load_errors, set()
        return out

    @property
    def load_error_reasons(self) -> dict[str, str]:
        """Request id -> why its last load failed (kept for diagnostics; newest wins)."""
        return dict(self._worker.error_reasons)

    def get_request_ids_with_save_errors(self) -> set[str]:
        """Requests whose save failed since the last call (their KV is not stored; nothing to
        undo: the engine may log or count them). Reasons: :attr:`save_error_reasons`."""
        with self._worker.save_lock:
            out = set(self._worker.save_errors)
            self._worker.save_errors.clear()
        return out

    @property
    def save_error_reasons(self) -> dict[str, str]:
        """Request id -> why its save failed, for the failures not yet collected."""
        with self._worker.save_lock:
            return dict(self._worker.save_errors)

    def _fail_save(self, request_id: str, reason: str) -> None:
        log.warning("kv save for request %s failed: %s", request_id, reason)
        with self._worker.save_lock:
            self._worker.save_errors[request_id] = reason

    def _fail_load(self, spec: LoadSpec, reason: str, *, async_load: bool) -> None:
        log.warning("kv load for request %s failed: %s", spec.request_id, reason)
        self._worker.load_errors.update(spec.block_ids)
        self._worker.error_reasons[spec.request_id] = reason
        if async_load:
            self._worker.done_recving.add(spec.request_id)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release transports and threads (idempotent)."""

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
