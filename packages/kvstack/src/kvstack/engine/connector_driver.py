"""The engine's side of the KV connector contract (``kv_connectors.KVConnector``), in vLLM v1's order.

One :class:`KVConnectorDriver` per engine plays both of the contract's callers:

- *scheduler side* (:class:`~kvstack.engine.scheduler.SchedulerConnector`): at admission, after
  the local prefix hit, ``get_num_new_matched_tokens`` (external hits counted before allocation),
  then ``update_state_after_alloc`` with the request's blocks; at the end ``request_finished``
  (``delay_free``: the blocks stay until ``done_sending``) or ``abort_request``;
- *scheduler side*, every step, before the metadata: ``blocks_computed`` for each scheduled
  request with more complete blocks than when last told (what the steps before this one computed:
  a store saves them while the request runs, little is left for ``request_finished``), and
  ``handle_preemptions`` for requests whose blocks the scheduler freed this step or since the last
  (preempted, aborted): their saves still copying are read before this step writes the blocks;
- *worker side*, every step: ``build_connector_meta`` → ``start_load_kv``, then per layer
  ``wait_for_layer_load`` before attention and ``save_kv_layer`` after it
  (:class:`~kvstack.engine.runner.KVLayerHooks`), ``wait_for_save`` after the forward, and
  ``get_finished`` / ``get_block_ids_with_load_errors`` / ``get_request_ids_with_save_errors``.

Layer-wise disaggregated prefill (P2P): a producer engine's :meth:`KVConnectorDriver.stream`
(``LLMEngine.stream_kv``) calls the connector's ``stream_request`` in the step that schedules the
request's last prompt tokens, before ``build_connector_meta`` (so that step's ``save_kv_layer``
tells a pull which layers are computed), and hands the params to the caller before the forward
pass runs. A consumer engine needs nothing new: a ``P2pConfig(layerwise=True)`` connector answers
``load_async=False``, so the scheduler admits the request with the loaded tokens counted computed
and ``before_attention`` waits for each layer.

Failures never lose a request and never pass wrong KV as loaded: a request whose load failed
recomputes from its first failed block (an in-step load: its token of this step is dropped and the
step is redone from there; an asynchronous load: it joins the batch from there). Counters are in
:class:`KVConnectorStats` (``LLMEngine.stats().kv_connector``).

The connector's blocks are the scheduler's: it is registered with the runner's cache and layout,
whose ``block_size`` is the manager's. One full-attention KV-cache group only: the contract carries
one block list per request (a hybrid model's groups hold one block per group per position), and a
sliding-window or chunked-local group drops blocks (null entries a store must never save).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kv_connectors import ConnectorMetadata, KVConnector
from kv_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec

from kvstack.engine.scheduler import ScheduledChunk, Scheduler, Status
from kvstack.engine.scheduler import Sequence as Seq

if TYPE_CHECKING:
    from kvstack.engine.runner import ModelRunner

__all__ = ["KVConnectorDriver", "KVConnectorStats", "model_fingerprint"]

log = logging.getLogger("kvstack.engine")


def model_fingerprint(model_dir: str | Path) -> str:
    """A digest naming a checkpoint's model, for a connector config's ``model_fingerprint``: its
    ``config.json`` (parsed, so formatting does not count) and every weight's name, shape and
    dtype from the safetensors headers (the bytes are not read: a checkpoint of many GB is
    fingerprinted in milliseconds). Two checkpoints with the same architecture but other weight
    shapes or dtypes differ; two fine-tunes of one base with the same shapes do not -- give those
    their own fingerprint (e.g. a content hash) where they share a store."""
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"model_fingerprint: {str(root)!r} has no config.json; give a checkpoint")
    h = hashlib.sha256()
    h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name in sorted(header):
            entry = header[name]
            h.update(f"\n{name}:{entry['dtype']}:{entry['shape']}".encode())
    return f"sha256:{h.hexdigest()[:32]}"


@dataclass
class KVConnectorStats:
    """What the engine's connector did since the engine started."""

    #: Tokens (and blocks) loaded from the connector and verified (a CPU tier hit, a disk hit, a
    #: producer's prefill); tokens of failed blocks are not counted.
    loaded_tokens: int = 0
    loaded_blocks: int = 0
    #: Loads that failed (some blocks): the request recomputed from its first failed block.
    num_load_failures: int = 0
    failed_blocks: int = 0
    #: Requests whose KV a connector could not store (reported by the contract; nothing to undo).
    num_save_errors: int = 0
    #: Requests a producer streamed layer by layer (``LLMEngine.stream_kv``).
    num_streamed: int = 0
    #: Request id -> why its last load or save failed (the connector's reasons, newest kept).
    reasons: dict[str, str] = field(default_factory=dict)
    #: Host seconds in the connector's worker side: planning and enqueueing loads
    #: (``build_connector_meta``, ``start_load_kv``, ``wait_for_layer_load``) and saves
    #: (``save_kv_layer``, ``wait_for_save``). Spent inside the step, between its launches: a
    #: step whose forward is bound by the host's launches is longer by about this much.
    load_host_s: float = 0.0
    save_host_s: float = 0.0


@dataclass
class _RequestView:
    """What a connector reads of a request (``kv_connectors.RequestLike``)."""

    request_id: str
    block_hashes: list[bytes]
    kv_transfer_params: Any = None


@dataclass
class _Load:
    seq: Seq
    hit: int  # tokens computed before the load (the local prefix hit)
    block_ids: list[int]  # the blocks loaded, in token order


class KVConnectorDriver:
    """Drives ``connector`` for one engine (see the module docstring)."""

    def __init__(self, connector: KVConnector, runner: ModelRunner) -> None:
        if not isinstance(connector, KVConnector):
            raise TypeError(
                f"kv_connector is a {type(connector).__name__}; give a kv_connectors.KVConnector "
                "(OffloadingConnector, FilesystemConnector, P2pConnector, NixlConnector or a "
                "MultiConnector of them)"
            )
        groups = runner.kv_cache_config.groups
        if len(groups) != 1:
            raise ValueError(
                f"kv_connector needs a model with one KV-cache group; {runner.arch.architecture} "
                f"has {len(groups)} (e.g. full and sliding-window layers): the connector contract "
                "carries one block list per request. Serve it without a connector"
            )
        spec = groups[0].spec
        if isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
            # Such a group frees the blocks no future query reads (their table entries become
            # the null block): a store would save the null block's bytes under a real hash, and
            # a load could land in it.
            raise ValueError(
                f"kv_connector needs full-attention KV; {runner.arch.architecture}'s layers keep "
                f"a {type(spec).__name__} (blocks outside the window are dropped). Serve it "
                "without a connector"
            )
        layout = runner.layouts[0]
        if connector.block_size != layout.block_size:
            raise ValueError(
                f"kv_connector.block_size={connector.block_size} but the engine's blocks hold "
                f"{layout.block_size} tokens; build the connector with block_size="
                f"{layout.block_size}"
            )
        connector.register_kv_caches(runner.kv_caches[0], layout)
        self.connector = connector
        self.runner = runner
        self.block_size = layout.block_size
        self.stats = KVConnectorStats()
        self.scheduler: Scheduler | None = None  # set by the Scheduler it is given to
        self._meta: ConnectorMetadata | None = None
        self._step_loads: dict[str, _Load] = {}  # loaded inside this step's forward
        self._async_loads: dict[str, _Load] = {}  # loaded behind the steps
        self._bad: set[int] = set()  # blocks with load errors not yet matched to a request
        self._held_back = False  # request_finished kept blocks this step
        self._refused: dict[str, str] = {}  # loads the connector refused at allocation: why
        #: requests to stream once their last prompt tokens are scheduled -> who gets the params
        self._streams: dict[str, Callable[[str, dict[str, Any]], None]] = {}
        #: running request -> complete blocks the connector was told of (``blocks_computed``)
        self._told: dict[str, int] = {}
        self._tells = type(connector).blocks_computed is not KVConnector.blocks_computed

    def _view(self, seq: Seq, with_params: bool) -> _RequestView:
        params = seq.kv_transfer_params if with_params else None
        return _RequestView(seq.request_id, seq.kv.block_hashes, params)

    # -- scheduler side ------------------------------------------------------------------------

    def match(self, seq: Seq, num_computed_tokens: int) -> tuple[int, bool]:
        if seq.kv.block_hasher is None:  # (prefix caching off: the connector still keys by hash)
            assert self.scheduler is not None
            seq.kv.bind_hasher(self.scheduler.kv.hasher)
        # A producer's params load the prompt once; a resume after preemption recomputes it.
        view = self._view(seq, not seq._admitted_once)
        return self.connector.get_num_new_matched_tokens(view, num_computed_tokens)

    def allocated(
        self, seq: Seq, block_ids: list[int], num_external_tokens: int, load_async: bool
    ) -> None:
        rid = seq.request_id
        try:
            self.connector.update_state_after_alloc(
                self._view(seq, True), block_ids, num_external_tokens
            )
        except ValueError as exc:
            # The connector cannot load the tokens the scheduler took (e.g. fewer than a whole
            # producer block when the engine left the prompt's last token to compute): nothing
            # loads; the request recomputes them, through the failed-load path.
            self._refused[rid] = f"update_state_after_alloc refused the load: {exc}"
        if num_external_tokens:
            assert self.scheduler is not None
            # the manager counts only the local hit until the load is verified
            hit = self.scheduler.kv.num_computed_tokens(rid)
            first = hit // self.block_size
            ids = block_ids[first : first + num_external_tokens // self.block_size]
            load = _Load(seq, hit, ids)
            if rid in self._refused:
                self._bad.update(ids)
            (self._async_loads if load_async else self._step_loads)[rid] = load

    def finished(self, seq: Seq) -> bool:
        assert self.scheduler is not None
        block_ids = list(self.scheduler.kv.get_block_ids(seq.kv)[0])
        # Only blocks whose every slot was computed: the last sampled token was never fed, so a
        # block it completed holds one slot of junk (a store keyed by its hash would serve it).
        view = self._view(seq, True)
        view.block_hashes = view.block_hashes[: seq.num_computed_tokens // self.block_size]
        self._told.pop(seq.request_id, None)
        delay, params = self.connector.request_finished(view, block_ids)
        seq.kv_transfer_params_out = params
        self._held_back |= delay
        return delay

    def abort(self, request_id: str) -> None:
        """The engine dropped ``request_id``: end its transfers (its blocks stay with the
        scheduler until the connector reports them)."""
        self._streams.pop(request_id, None)
        self._told.pop(request_id, None)
        self.connector.abort_request(request_id)
        # (a running request's blocks are free now: a save of them still copying reads first)
        self.connector.handle_preemptions((request_id,))

    # -- layer-wise streaming (producer) -------------------------------------------------------

    def stream(self, seq: Seq, on_params: Callable[[str, dict[str, Any]], None]) -> None:
        """Serve waiting ``seq``'s prompt KV while it is computed (``LLMEngine.stream_kv``): in
        the step that schedules its last prompt tokens, ``stream_request(request, block_ids)``
        (every full prompt block: all of them are computed by the end of that step) and then
        ``on_params(request_id, params)``, before the forward pass. The request must finish after
        its prefill (``max_new_tokens=1``, as vLLM's prefill workers run it); the connector keeps
        its blocks until the engine's ``request_finished`` and the consumer's pull both ended."""
        rid = seq.request_id
        if not callable(getattr(self.connector, "stream_request", None)):
            raise TypeError(
                f"stream_kv({rid!r}): the engine's {type(self.connector).__name__} cannot stream "
                "layer by layer; give the engine a P2pConnector (mode='read', role 'producer' or "
                "'both')"
            )
        if not callable(on_params):
            raise TypeError(
                f"stream_kv({rid!r}): on_params={on_params!r} is not callable; give a function "
                "(request_id, params) that hands the params to the decode engine"
            )
        why = None
        if seq.params.max_new_tokens != 1:
            why = (
                f"its SamplingParams.max_new_tokens={seq.params.max_new_tokens}; a streamed "
                "prefill finishes after its first token: give max_new_tokens=1"
            )
        elif seq.prompt_len < self.block_size:
            why = (
                f"its prompt of {seq.prompt_len} tokens has no full block of {self.block_size} "
                "to stream; compute it on the decode engine"
            )
        elif seq.status is not Status.WAITING or seq._admitted_once:
            why = "it was already scheduled; call stream_kv right after add_request"
        elif seq.kv_transfer_params is not None:
            why = "it loads KV from a producer itself (kv_transfer_params); stream from a producer"
        elif rid in self._streams:
            why = "it is already streamed"
        if why is not None:
            raise ValueError(f"stream_kv({rid!r}): {why}")
        self._streams[rid] = on_params

    def _stream_scheduled(self, chunks: Sequence[ScheduledChunk]) -> None:
        for c in chunks:
            rid = c.seq.request_id
            if rid not in self._streams or c.end < c.seq.prompt_len:
                continue
            on_params = self._streams.pop(rid)
            assert self.scheduler is not None
            block_ids = list(self.scheduler.kv.get_block_ids(c.seq.kv)[0])
            view = _RequestView(rid, c.seq.kv.block_hashes[: c.seq.prompt_len // self.block_size])
            params = self.connector.stream_request(view, block_ids)  # type: ignore[attr-defined]
            self.stats.num_streamed += 1
            on_params(rid, params)

    # -- worker side ---------------------------------------------------------------------------

    def start_step(
        self, chunks: Sequence[ScheduledChunk] = (), preempted: Sequence[str] = ()
    ) -> None:
        """This step's metadata to the worker side; loads start (in-step ones finish by layer).
        First the requests ``preempted`` this step (their blocks freed: saves of them still
        copying read them before this step's writes), then the blocks ``chunks``' requests
        completed in the steps before (``blocks_computed``); requests to stream whose last
        prompt tokens are scheduled are streamed, so their saves are in this step's metadata."""
        t0 = time.perf_counter()
        if preempted:
            for rid in preempted:
                self._told.pop(rid, None)
            self.connector.handle_preemptions(preempted)
        if self._tells:
            self._tell_computed(chunks)
        self.stats.save_host_s += time.perf_counter() - t0
        if self._streams:
            self._stream_scheduled(chunks)
        t0 = time.perf_counter()
        self._meta = self.connector.build_connector_meta()
        self.connector.start_load_kv(self._meta)
        self.stats.load_host_s += time.perf_counter() - t0
        if self._meta.loads:  # (NIXL and sockets write past torch's version counters)
            self.runner.note_external_writes()

    def _tell_computed(self, chunks: Sequence[ScheduledChunk]) -> None:
        """``blocks_computed`` for each request of ``chunks`` whose blocks completed before this
        step (``start``: tokens in the cache before it) outnumber those told. A request loading
        in this step is left for the next: its loaded tokens count only once verified."""
        told, bs = self._told, self.block_size
        for c in chunks:
            seq = c.seq
            rid = seq.request_id
            done = min(c.start // bs, len(seq.kv.block_hashes))
            if done <= told.get(rid, 0) or rid in self._step_loads:
                continue
            told[rid] = done
            assert self.scheduler is not None
            block_ids = self.scheduler.kv.get_block_ids(seq.kv)[0]
            view = _RequestView(rid, seq.kv.block_hashes[:done])
            self.connector.blocks_computed(view, list(block_ids[:done]))

    def hand_off_saves(self) -> None:
        """A step left in flight (:mod:`kvstack.engine._async`): its saves handed off, as
        :meth:`end_forward` does after a step the host waits for (the copies follow the step's
        writes on the device either way)."""
        if self._meta is not None and self._meta.saves:
            t0 = time.perf_counter()
            self.connector.wait_for_save()
            self.stats.save_host_s += time.perf_counter() - t0

    def before_attention(self, layer_slot: int) -> None:
        if self._step_loads:  # (only a load inside this step has layers to wait for)
            t0 = time.perf_counter()
            self.connector.wait_for_layer_load(layer_slot)
            self.stats.load_host_s += time.perf_counter() - t0

    def after_attention(self, layer_slot: int) -> None:
        assert self._meta is not None
        t0 = time.perf_counter()
        self.connector.save_kv_layer(layer_slot, self._meta)
        self.stats.save_host_s += time.perf_counter() - t0

    def before_replay(self) -> None:
        if not self._step_loads:  # a decode step beside a quiet connector: nothing to wait for
            return
        t0 = time.perf_counter()
        for slot in range(self.connector.kv.num_layers):
            self.connector.wait_for_layer_load(slot)
        self.stats.load_host_s += time.perf_counter() - t0

    def end_forward(self) -> dict[str, int]:
        """After this step's forward (or in its place, a step with no batch): saves handed off;
        the requests whose in-step load failed, each with the tokens it keeps (before its first
        failed block)."""
        t0 = time.perf_counter()
        self.connector.wait_for_save()
        self.stats.save_host_s += time.perf_counter() - t0
        self._take_load_errors()
        loads, self._step_loads = self._step_loads, {}
        failed: dict[str, int] = {}
        for rid, load in loads.items():
            good = self._settle(rid, load)
            if good < len(load.block_ids):
                failed[rid] = load.hit + good * self.block_size
        return failed

    def _take_load_errors(self) -> None:
        """The connector's failed blocks, kept where a load not yet settled holds them: a report
        of a load already settled (a layer-wise pull reports at the failed layer, then again when
        its thread ends) would fail a later load into the same, reused, blocks."""
        errors = self.connector.get_block_ids_with_load_errors()
        loads = [*self._step_loads.values(), *self._async_loads.values()]
        self._bad |= errors & {b for load in loads for b in load.block_ids}

    def recompute(
        self,
        failed: dict[str, int],
        chunks: Sequence[ScheduledChunk],
        logits: Any,
        sampled: list[Seq],
    ) -> tuple[Any, list[Seq]]:
        """Requests of this step whose in-step load failed (``failed``: id -> tokens kept) are
        rewound to recompute from there; their sampled rows (from wrong KV) are dropped. Returns
        the ``(logits, sampled)`` to sample."""
        assert self.scheduler is not None
        for c in chunks:
            if c.seq.request_id in failed:
                self.scheduler.rewind(c.seq, failed[c.seq.request_id])
        keep = [i for i, s in enumerate(sampled) if s.request_id not in failed]
        return logits[keep], [sampled[i] for i in keep]

    def quiet(self) -> bool:
        """No load of this engine's in flight, planned for the current step or left to report
        (in the step or behind it), no streamed prefill, no kept blocks, no error to match. Only
        then may the engine leave a step in flight (:mod:`kvstack.engine._async`): nothing waits
        for the step's end (in-step loads settled, landed loads joining the batch). The step's
        saves do not count: :meth:`hand_off_saves` hands them off as the step is left."""
        meta = self._meta
        return not (
            self._step_loads
            or self._async_loads
            or self._streams
            or self._held_back
            or self._refused
            or self._bad
            or (meta is not None and meta.loads)
        )

    def snapshot(self) -> KVConnectorStats:
        """A copy of :attr:`stats` (what ``LLMEngine.stats()`` returns)."""
        return dataclasses.replace(self.stats, reasons=dict(self.stats.reasons))

    def idle_step(self, finished_req_ids: Iterable[str] = ()) -> None:
        """A step with no batch: saves handed off, finished transfers collected
        (``finished_req_ids``: requests the step left in flight before it finished)."""
        self.end_forward()
        self.poll(finished_req_ids)
        assert self.scheduler is not None
        if self.scheduler.loading:
            time.sleep(1e-3)  # nothing to compute: leave the core to the transfer threads

    def _settle(self, rid: str, load: _Load) -> int:
        """Blocks of ``load`` before its first failed one; counts it."""
        good = next(
            (i for i, b in enumerate(load.block_ids) if b in self._bad), len(load.block_ids)
        )
        self._bad.difference_update(load.block_ids)
        s = self.stats
        s.loaded_blocks += good
        s.loaded_tokens += good * self.block_size
        if good < len(load.block_ids):
            s.num_load_failures += 1
            s.failed_blocks += len(load.block_ids) - good
            refused = self._refused.pop(rid, None)
            reason = refused or self.connector.load_error_reasons.get(rid, "load error")
            s.reasons[rid] = reason
            log.warning(
                "request %s: KV load failed (%s); recomputing %d blocks",
                rid,
                reason,
                len(load.block_ids) - good,
            )
        return good

    def poll(self, finished_req_ids: Iterable[str]) -> None:
        """Collect what the connector finished: landed loads join the batch, sent blocks are
        freed, save errors are counted."""
        self._meta = None
        self._collect(finished_req_ids)
        if self._held_back:
            # Saves of requests that finished this step run now, not at the next step: an idle
            # engine would otherwise keep their blocks (and their request ids) indefinitely.
            self._held_back = False
            self.start_step()
            self.connector.wait_for_save()
            self._meta = None
            self._collect(())

    def _collect(self, finished_req_ids: Iterable[str]) -> None:
        sched = self.scheduler
        assert sched is not None
        sending, recving = self.connector.get_finished(finished_req_ids)
        self._take_load_errors()
        # (an asynchronous load refused at allocation never reaches done_recving: it ends here)
        recving |= {rid for rid in self._refused if rid in self._async_loads}
        for rid in recving:
            load = self._async_loads.pop(rid, None)
            if load is None:
                continue
            if rid in sched.aborted_loading:  # dropped by the engine: nothing to count or keep
                self._bad.difference_update(load.block_ids)
                self._refused.pop(rid, None)
                sched.kv_loaded(rid, load.hit)  # (frees its blocks: the transfer has ended)
                continue
            good = self._settle(rid, load)
            sched.kv_loaded(rid, load.hit + good * self.block_size)
        if recving:
            self.runner.note_external_writes()
        for rid in sending:
            sched.kv_sent(rid)
        reasons = self.connector.save_error_reasons  # (collecting the ids clears them)
        errors = self.connector.get_request_ids_with_save_errors()
        if errors:
            self.stats.num_save_errors += len(errors)
            for rid in errors:
                self.stats.reasons[rid] = reasons.get(rid, "save error")

    def close(self) -> None:
        self.connector.close()
