"""``LLMEngine``: the scheduler, the block tables and the model runner, stepped together.

Per step: the :class:`~kvstack.engine.scheduler.Scheduler` picks the batch (running requests'
decodes and prefill chunks, newly admitted prompts with their prefix hits, preemptions);
kv-blocktable's ``BlockTables`` gets the rows (requests keep a row while they run; the batch's
requests are swapped into rows ``[0, R)``), expands them to kernel blocks and builds one
``CommonAttentionMetadata`` per KV group; the :class:`~kvstack.engine.runner.ModelRunner` runs the
forward pass over the paged cache; rows whose request fed its last known token are sampled.

Use it three ways::

    engine = LLMEngine("path/to/checkpoint", kv_cache_memory=256 * 2**20)
    engine.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_new_tokens=8))  # -> completions
    for event in engine.stream(prompts, params): ...  # one TokenEvent per generated token
    engine.add_request("a", [1, 2, 3], params); engine.step()  # requests arriving over time
    engine.abort_request("a")  # gone: blocks freed, out of the batch

Prompts may be text when the checkpoint has a tokenizer (:mod:`kvstack.engine.tokenizer`):
``engine.generate(["hello"])`` returns completions with ``text``; ``SamplingParams(stop=[...])``
ends a request at a stop string; ``engine.chat(messages)`` applies the chat template.
"""

from __future__ import annotations

import inspect
import itertools
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from kv_blocktable import KVCacheManager, Request
from kv_blocktable.block_table import BlockTables

from kvstack.engine._async import InFlight, TokenReader
from kvstack.engine._device import on_built_device as _on_built_device
from kvstack.engine._device import on_device
from kvstack.engine._gc import freeze_startup_heap
from kvstack.engine._generate import Prompt, RunsPrompts
from kvstack.engine._inputs import (
    check_engine_flags,
    check_token_ids,
)
from kvstack.engine._rows import BatchRows
from kvstack.engine._staging import StepStager
from kvstack.engine._text import TextSide
from kvstack.engine.connector_driver import KVConnectorDriver
from kvstack.engine.outputs import (
    Completion,
    EngineStats,
    RequestMetrics,
    TokenEvent,
    token_events,
)
from kvstack.engine.runner import ModelRunner
from kvstack.engine.sampling import SamplingParams, check_keywords, make_generator, sample
from kvstack.engine.scheduler import Scheduler, Status
from kvstack.engine.scheduler import Sequence as Seq
from kvstack.engine.tokenizer import TextTokenizer

__all__ = ["Completion", "EngineStats", "LLMEngine", "Prompt", "TokenEvent"]

#: The engine's own options (the rest go to :class:`ModelRunner`).
_ENGINE_OPTIONS = (
    "runner", "max_num_seqs", "enable_prefix_caching", "keep_logits", "tokenizer", "warmup",
    "kv_connector", "async_scheduling", "freeze_gc",
)  # fmt: skip
#: ModelRunner's options an engine passes on (``max_num_seqs`` is the engine's own).
_RUNNER_OPTIONS = tuple(
    name
    for name, p in inspect.signature(ModelRunner.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "max_num_seqs"
)


class LLMEngine(RunsPrompts, TextSide):
    """Continuous batching over one :class:`ModelRunner` (see the module docstring).

    ``runner`` may be given instead of ``model_dir`` (tests share one runner between engines
    only one at a time: the cache contents belong to the engine using it). Other keyword options
    go to :class:`ModelRunner` (a misspelt one is a ``TypeError`` naming the closest option and
    listing every valid one). ``max_num_batched_tokens`` is the per-step token budget (chunked
    prefill); ``max_num_seqs`` caps running requests (and the block-table rows).

    ``tokenizer``: for text prompts, stop strings and decoded outputs -- ``None`` (default) reads
    the checkpoint directory's tokenizer when first needed (:mod:`kvstack.engine.tokenizer`), a
    path reads that directory's, or give a transformers / ``tokenizers`` tokenizer object.

    ``warmup`` (default on): on a GPU, build the kernels every step launches before the first
    request (``ModelRunner.warm_kernels``; seconds in ``stats().startup_seconds["compile"]``),
    so no request waits for a compile (later starts load them from Triton's disk cache), and
    capture every decode size's CUDA graph (``DecodeGraphs.capture_all``; seconds in
    ``startup_seconds["graphs"]``).

    ``kv_connector``: a ``kv_connectors.KVConnector`` driven through its contract
    (:mod:`kvstack.engine.connector_driver`); the caller builds (engine's block size) and closes it.

    ``freeze_gc`` (default on): once started, collect and ``gc.freeze()`` the heap, so the cyclic
    collector's oldest-generation passes (stop-the-world, tens of ms) no longer walk the model
    and the engine's state inside steps (:mod:`kvstack.engine._gc`; the collection before it in
    ``startup_seconds["gc_freeze"]``). Process-wide; it ends when the last engine that froze is
    freed.
    """

    @_on_built_device
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        runner: ModelRunner | None = None,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        keep_logits: bool = False,
        tokenizer: str | Path | Any | None = None,
        warmup: bool = True,
        kv_connector: Any = None,
        async_scheduling: bool | str | None = None,
        freeze_gc: bool = True,
        **runner_kwargs: Any,
    ) -> None:
        check_keywords("LLMEngine", runner_kwargs, _ENGINE_OPTIONS + _RUNNER_OPTIONS)
        if (model_dir is None) == (runner is None):
            raise ValueError("give LLMEngine a model_dir or a runner (exactly one)")
        check_engine_flags(
            max_num_seqs, enable_prefix_caching, keep_logits, tokenizer, warmup, freeze_gc
        )
        if runner is None:
            assert model_dir is not None
            runner = ModelRunner(model_dir, max_num_seqs=max_num_seqs, **runner_kwargs)
        elif runner_kwargs:
            raise ValueError(
                f"runner given: {sorted(runner_kwargs)} would be ignored; set them on the runner"
            )
        self.runner = runner
        cfg = runner.kv_cache_config
        self.kv = KVCacheManager(cfg, enable_prefix_caching=enable_prefix_caching)
        self.connector = None if kv_connector is None else KVConnectorDriver(kv_connector, runner)
        runner.kv_layer_hooks = self.connector
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=runner.max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=runner.max_model_len,
            connector=self.connector,  # (which it tells who drives it)
        )
        self.tables = BlockTables.from_config(
            cfg,
            runner.kernel_block_sizes,
            max_num_reqs=max_num_seqs,
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=runner.max_num_batched_tokens,
            device=runner.device,
            # pinned staging: the tables' copies are asynchronous (a pageable one syncs)
            pin_memory=runner.device.type == "cuda",
        )
        self._stager = StepStager(runner.device, runner.max_num_batched_tokens, max_num_seqs)
        if not (
            async_scheduling is None
            or isinstance(async_scheduling, bool)
            or (isinstance(async_scheduling, str) and async_scheduling == "graphs")
        ):
            raise TypeError(
                f"async_scheduling={async_scheduling!r} must be None, True, False or 'graphs'"
            )
        #: One step ahead (:mod:`kvstack.engine._async`): ``True`` (the default on CUDA) after
        #: every step, ``"graphs"`` after steps replayed from a CUDA graph, ``False`` never.
        self.async_scheduling: bool | str = (
            runner.device.type == "cuda" if async_scheduling is None else async_scheduling
        )
        self._reader = TokenReader(runner.device, max_num_seqs)
        self._inflight: InFlight | None = None
        #: Live requests whose tokens the host needs between steps (sampling, stop strings).
        self._needs_sync: set[str] = set()
        self._dropped = 0  # tokens of steps run past a request's stop token (or abort)
        self._ahead = 0  # steps scheduled one ahead
        if warmup:  # (the kernels a step launches, built now rather than in the first requests)
            runner.warm_kernels(self.tables.kernel_table)
            t0 = time.perf_counter()
            self.tables.warmup()  # (the slot mapping and the block expansion)
            runner.startup_seconds["compile"] += time.perf_counter() - t0
            if runner.graphs is not None:  # every decode size captured now, not in a request
                t0 = time.perf_counter()
                runner.graphs.capture_all(
                    [self.tables.kernel_table(g).shape[1] for g in range(runner.num_groups)]
                )
                runner.startup_seconds["graphs"] = (
                    runner.startup_seconds.get("graphs", 0.0) + time.perf_counter() - t0
                )
        self.eos_token_ids = frozenset(runner.arch.eos_token_ids)
        self._rows = BatchRows(self.tables, max_num_seqs)  # request id <-> block-table row
        self._seqs: dict[str, Seq] = {}
        self.keep_logits = keep_logits
        self.external_loader: Callable[[str, tuple[list[int], ...], int], None] | None = None
        #: Called with a request id when :meth:`abort_request` drops that request, before its
        #: blocks go back to the pool: whoever drives a connector for the engine ends the
        #: request's transfers there (a producer stops serving a held request's blocks).
        self.abort_listener: Callable[[str], None] | None = None
        self._logits: dict[str, list[torch.Tensor]] = {}
        #: Request id -> its prompt text (requests given text); -> the output text's length
        #: (requests a stop string finished).
        self._prompt_text: dict[str, str] = {}
        self._text_cut: dict[str, int] = {}
        self._tokenizer_arg = tokenizer
        self._tokenizer: TextTokenizer | None = None
        self._tokenizer_read = False
        self._ids = itertools.count()
        self._generated = 0
        self._computed = 0
        self._model_s = 0.0
        self._wall_s = 0.0
        if self.connector is not None:  # (see _unhook)
            weakref.finalize(self, _unhook, runner, self.connector)
        if freeze_gc:  # (last: everything startup built is in the frozen heap)
            t0 = time.perf_counter()
            freeze_startup_heap(self)
            runner.startup_seconds["gc_freeze"] = time.perf_counter() - t0

    # -- requests ------------------------------------------------------------------------------

    def _prompt_ids(self, rid: str, prompt: object) -> list[int]:
        """``prompt`` (text or token ids) as checked token ids."""
        if isinstance(prompt, str):
            tok = self._require_tokenizer(f"request {rid!r}: the text prompt {prompt[:40]!r}")
            return tok.encode(prompt)
        return check_token_ids(rid, prompt, self.runner.arch.vocab_size)

    @property
    def device(self) -> torch.device:
        """The device the engine runs on (its runner's); its entry points make it current."""
        return self.runner.device

    @on_device
    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        hold_blocks: bool = False,
        num_external_tokens: int = 0,
        kv_transfer_params: Any = None,
    ) -> str:
        """Queue a request; it joins the batch at the next :meth:`step` the pool allows.

        ``prompt``: token ids (ints in ``[0, vocab_size)``, checked, never rounded), or text
        encoded by the engine's :attr:`tokenizer` (special tokens added as the tokenizer's
        post-processor says). ``params`` defaults to ``SamplingParams()``.

        Disaggregated serving: ``hold_blocks`` keeps a finished request's blocks (read them with
        :meth:`block_ids`, free them with :meth:`release`) so a connector can serve them;
        ``num_external_tokens`` marks the first tokens as loaded from elsewhere: at admission
        they get blocks and :attr:`external_loader` ``(request_id, block_ids_per_group,
        num_tokens)`` must fill them before it returns (the engine then moves the caches'
        version counters, :meth:`~kvstack.engine.runner.ModelRunner.note_external_writes`, so
        TORCH_SDPA's kept decode gathers see the new bytes). ``kv_transfer_params``: a producer's
        (:attr:`Completion.kv_transfer_params`), loaded by the ``kv_connector``.
        """
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(
                f"request_id={request_id!r} is a {type(request_id).__name__}; give a str (or "
                "None for a generated one)"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs or rid in self.scheduler.sending:
            raise ValueError(f"request id {rid!r} is already in the engine; ids must be unique")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params is a {type(params).__name__}; pass a SamplingParams")
        if not isinstance(hold_blocks, bool):
            raise TypeError(
                f"request {rid!r}: hold_blocks={hold_blocks!r} is a {type(hold_blocks).__name__}; "
                "give True or False"
            )
        if isinstance(num_external_tokens, bool) or not isinstance(num_external_tokens, int):
            raise TypeError(
                f"request {rid!r}: num_external_tokens={num_external_tokens!r} is a "
                f"{type(num_external_tokens).__name__}; give an int >= 0"
            )
        ids = self._prompt_ids(rid, prompt)
        vocab = self.runner.arch.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(
                f"request {rid!r}: SamplingParams.stop_token_ids {bad[:5]} are outside the "
                f"vocabulary [0, {vocab}); give ids below {vocab}"
            )
        if params.stop:
            self._require_tokenizer(f"request {rid!r}: SamplingParams.stop={list(params.stop)!r}")
        stop = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.eos_token_ids)
        )
        seq = Seq(
            Request(rid, ids),
            params,
            prompt_len=len(ids),
            stop_ids=frozenset(stop),
            generator=make_generator(params, self.runner.device),
            num_external_tokens=num_external_tokens,
            hold_blocks=hold_blocks,
            kv_transfer_params=kv_transfer_params,
        )
        if kv_transfer_params is not None and self.connector is None:
            raise ValueError(f"request {rid!r}: kv_transfer_params given, but no kv_connector")
        if num_external_tokens and self.external_loader is None:
            raise ValueError(f"request {rid!r} has external tokens but no external_loader is set")
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        if not params.greedy or params.stop:  # its tokens are needed on the host each step
            self._needs_sync.add(rid)
        if isinstance(prompt, str):
            self._prompt_text[rid] = prompt
        return rid

    @on_device
    def abort_request(self, request_id: str | Iterable[str]) -> list[str]:
        """Drop requests wherever they are (vLLM's ``abort_request``): waiting, running (its
        blocks go back to the pool and it leaves the batch), or finished (a ``hold_blocks``
        request's blocks are freed, an unread :meth:`completion` is discarded). Before a
        request's blocks are freed, :attr:`abort_listener` (if set) is called with its id, so a
        connector can end its transfers first; the engine's ``kv_connector`` gets
        ``abort_request`` (also for a finished request whose blocks it still holds), and blocks a
        transfer may still touch are freed when it reports them. Returns the ids dropped.

        Ids the engine does not have are ignored, as vLLM does: an abort races with the
        request finishing (a client that disconnects as its last token arrives), and the caller
        cannot tell the two apart; the returned list says which ids were found.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for r in ids:
            if not isinstance(r, str):
                raise TypeError(f"abort_request: request id {r!r} is a {type(r).__name__}, not str")
        dropped = []
        for rid in ids:
            sending = rid in self.scheduler.sending  # (also once its completion was read)
            if rid not in self._seqs and not sending:
                continue
            seq = self._seqs.get(rid)
            live = seq is not None and (seq.finish_reason is None or rid in self.scheduler.held)
            if live and self.abort_listener is not None:  # it has blocks a transfer may use
                self.abort_listener(rid)
            if self.connector is not None and (live or sending):
                self.connector.abort(rid)  # its blocks stay until the connector lets go
            self.scheduler.abort(rid)  # frees its blocks (None: finished, holding none)
            self._forget(rid)
            dropped.append(rid)
        return dropped

    def _forget(self, rid: str) -> None:
        self._needs_sync.discard(rid)
        self._rows.release(rid)
        self._seqs.pop(rid, None)
        self._logits.pop(rid, None)
        self._prompt_text.pop(rid, None)
        self._text_cut.pop(rid, None)

    @on_device
    def stream_kv(self, request_id: str, on_params: Callable[[str, dict[str, Any]], None]) -> None:
        """Disaggregated prefill, layer by layer: in the step that schedules waiting request
        ``request_id``'s last prompt tokens, ``on_params(request_id, params)`` runs before the
        forward pass; hand ``params`` to the decode engine at once (it loads layer by layer inside
        its step while this one computes). Details: ``KVConnectorDriver.stream``."""
        seq = self._seqs.get(request_id) if isinstance(request_id, str) else None
        if self.connector is None or seq is None:
            why = "the engine has no kv_connector" if self.connector is None else "no such request"
            raise ValueError(f"stream_kv({request_id!r}): {why}; add it to a producer engine")
        self.connector.stream(seq, on_params)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids per KV group of a running or held request (0 where a window dropped one)."""
        return self.kv.get_block_ids(request_id)

    @on_device
    def release(self, request_id: str) -> None:
        """Free a finished ``hold_blocks`` request's blocks."""
        self.scheduler.release(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    # -- stepping ------------------------------------------------------------------------------

    def _ahead_ok(self) -> bool:
        """Whether a step may be left in flight (:mod:`kvstack.engine._async`). With a KV
        connector only while it is quiet and no request waits (an admission may start a load,
        which must follow the in-flight step's writes into blocks it frees) or is held for a
        transfer: a disaggregated decode engine decodes one step ahead between its loads."""
        conn, sched = self.connector, self.scheduler
        return bool(
            self.async_scheduling
            and not self._needs_sync
            and not self.keep_logits
            and self.external_loader is None
            and (
                conn is None
                or (conn.quiet() and not (sched.waiting or sched.loading or sched.sending))
            )
        )

    @on_device
    def step(self) -> list[TokenEvent]:
        """Schedule, run the model once, sample; the tokens generated this step. One step ahead
        (``async_scheduling``) the step is launched and left in flight, and the tokens returned
        are the previous step's (:mod:`kvstack.engine._async`)."""
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        events: list[TokenEvent] = []
        if prev is not None and not self._ahead_ok():
            events, prev = self._resolve(prev), None
        out = self.scheduler.schedule(ahead=prev is not None)
        self._ahead += prev is not None
        conn = self.connector
        if conn is not None:
            conn.start_step(out.chunks, out.preempted)  # (a streamed prefill's params, too)
        if not out.chunks:
            for rid in out.preempted:
                self._rows.release(rid)
            ended: list[Seq] = []
            if prev is not None:  # (first: the requests it finishes hand their saves off now)
                events += self._resolve(prev, ended)
            if conn is not None:
                conn.idle_step(s.request_id for s in ended)
            return events
        self._rows.prepare(out)
        # One pass over the chunks builds every host list (no per-chunk tensors). The positions
        # come from the tables, which derive them from the same lengths for the metadata.
        qlens: list[int] = []
        seq_lens: list[int] = []
        ids: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Seq] = []
        pending_at: list[int] = []  # rows of ids whose token is still on the device (ahead)
        pending_src: list[int] = []  # ... and its row among the previous step's tokens
        for c in out.chunks:
            start, n = c.start, c.num_new_tokens
            end = start + n
            qlens.append(n)
            seq_lens.append(end)
            tokens = c.seq.kv.token_ids
            if n == 1:  # a decode
                if start < len(tokens):
                    ids.append(tokens[start])
                else:  # the previous step's token, not read yet: filled in on the device
                    assert prev is not None
                    pending_at.append(len(ids))
                    pending_src.append(prev.row_of[id(c.seq)])
                    ids.append(0)
            else:
                ids += tokens[start:end]
            if end >= len(tokens):  # fed its last known (or pending) token: sample a new one
                sample_rows.append(len(ids) - 1)
                sampled.append(c.seq)
        metadata = self.tables.build_common_metadata(len(qlens), qlens, seq_lens)
        positions = self.tables.positions  # [T]
        for c in out.chunks:
            if c.admitted and c.seq.num_external_tokens and c.seq.num_preemptions == 0:
                assert self.external_loader is not None
                self.external_loader(c.seq.request_id, c.new_block_ids, c.start)
                self.runner.note_external_writes()  # (a connector writes past torch's ops)
        t1 = time.perf_counter()
        # Trusted: the metadata comes from build_common_metadata (lengths and rows checked on
        # the host) and ids, positions and sample rows from the same chunks.
        ids_t, rows, at_t, src_t = self._stager.stage(ids, sample_rows, pending_at, pending_src)
        if pending_at:
            assert prev is not None
            ids_t.index_copy_(0, at_t, prev.tokens.index_select(0, src_t))
        graphs = self.runner.graphs
        replays = graphs.num_replays if graphs is not None else 0
        logits = self.runner.execute_trusted(ids_t, positions, metadata, rows)  # [R_sampled, vocab]
        self._model_s += time.perf_counter() - t1
        self._computed += len(ids)
        replayed = graphs is not None and graphs.num_replays != replays
        if self._ahead_ok() and (replayed or self.async_scheduling is True):
            # leave it in flight; read the previous step's tokens meanwhile
            dev, host, event = self._reader.launch(logits)
            for s in sampled:
                s.num_pending += 1
            row_of = {id(s): r for r, s in enumerate(sampled)}
            self._inflight = InFlight(out, sampled, dev, host, event, row_of)
            done: list[Seq] = []
            if prev is not None:
                events += self._resolve(prev, done)
            if conn is not None:  # (quiet: its saves to hand off, the finished to tell it)
                conn.hand_off_saves()
                conn.poll(s.request_id for s in done)
            self._wall_s += time.perf_counter() - t0
            return events
        if prev is not None:  # (a request that needs its tokens on the host joined this step)
            events += self._resolve(prev)
        if conn is not None and (failed := conn.end_forward()):  # an in-step load failed
            logits, sampled = conn.recompute(failed, out.chunks, logits, sampled)
        tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
        if self.keep_logits:
            for s, row in zip(sampled, logits.float().cpu(), strict=True):
                self._logits.setdefault(s.request_id, []).append(row)
        finished = self.scheduler.update(out, zip(sampled, tokens, strict=True))
        for s in sampled:
            if s.params.stop and s.request_id not in self._text_cut and self._stop_string(s):
                finished.append(s)
        self._finished(finished)
        if conn is not None:
            conn.poll(s.request_id for s in finished)
        self._wall_s += time.perf_counter() - t0
        return events + self._events(zip(sampled, tokens, strict=True))

    def _resolve(self, step: InFlight, done: list[Seq] | None = None) -> list[TokenEvent]:
        """Read an in-flight step's tokens and apply them (the scheduler's update). A request
        that finished, or was aborted, while the step ran gets no token from it. ``done``
        collects the requests the tokens finished."""
        tokens = TokenReader.read(step)
        live: list[tuple[Seq, int]] = []
        seqs = self._seqs
        for s, t in zip(step.sampled, tokens, strict=True):
            s.num_pending -= 1
            if s.status is Status.RUNNING and seqs.get(s.request_id) is s:
                live.append((s, t))
            else:  # finished (a stop token the step before) or aborted while it ran
                self._dropped += 1
        finished = self.scheduler.update(step.out, live)
        self._finished(finished)
        if done is not None:
            done += finished
        return self._events(live)

    def _finished(self, finished: list[Seq]) -> None:
        for s in finished:
            self._rows.release(s.request_id)
            self._needs_sync.discard(s.request_id)

    def _events(self, pairs: Iterable[tuple[Seq, int]]) -> list[TokenEvent]:
        events = token_events(pairs)
        self._generated += len(events)
        return events

    def completion(self, request_id: str) -> Completion:
        """The finished request ``request_id`` (forgotten by the engine once read)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.finish_reason is None:
            raise ValueError(f"request {request_id!r} is not a finished request of this engine")
        del self._seqs[request_id]
        rows = self._logits.pop(request_id, None)
        tok = self.tokenizer
        text = None if tok is None else tok.decode(seq.output_token_ids)
        cut = self._text_cut.pop(request_id, None)
        if text is not None and cut is not None:
            text = text[:cut]
        return Completion(
            request_id,
            tuple(seq.token_ids[: seq.prompt_len]),
            tuple(seq.output_token_ids),
            seq.finish_reason,
            seq.num_cached_prompt_tokens,
            seq.num_preemptions,
            torch.stack(rows) if rows else None,
            text,
            self._prompt_text.pop(request_id, None),
            seq.kv_transfer_params_out,
            RequestMetrics(
                seq.arrival_time,
                seq.first_scheduled_time,
                seq.first_token_time,
                seq.finished_time,
            ),
        )

    def stats(self) -> EngineStats:
        cfg = self.runner.kv_cache_config
        return EngineStats(
            self.scheduler.stats,
            self._generated,
            self._computed,
            self._model_s,
            self._wall_s,
            cfg.total_bytes,
            dict(self.runner.startup_seconds),
            None if self.connector is None else self.connector.snapshot(),
        )


def _unhook(runner: ModelRunner, driver: KVConnectorDriver) -> None:
    """A freed engine's connector driver let go of: the runner and the scheduler hold the
    driver, which holds them, so without this the runner (weights and KV cache) outlives the
    engine until a full collection, and while another engine keeps the heap frozen
    (``freeze_gc``), until that one is freed too."""
    if runner.kv_layer_hooks is driver:
        runner.kv_layer_hooks = None
    driver.scheduler = None
