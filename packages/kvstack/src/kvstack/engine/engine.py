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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kv_blocktable import KVCacheManager, Request
from kv_blocktable.block_table import BlockTables, int64_tensor

from kvstack.engine.runner import ModelRunner
from kvstack.engine.sampling import SamplingParams, make_generator, sample
from kvstack.engine.scheduler import FinishReason, Scheduler, SchedulerOutput, SchedulerStats
from kvstack.engine.scheduler import Sequence as Seq

__all__ = ["Completion", "EngineStats", "LLMEngine", "TokenEvent"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request (``finished``: it was the request's last)."""

    request_id: str
    index: int
    token_id: int
    finished: bool
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_cached_prompt_tokens: int
    num_preemptions: int
    #: float32 ``[len(token_ids), vocab]``: the logits each token was sampled from (only with
    #: ``LLMEngine(keep_logits=True)``; tests hold them to a reference).
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class EngineStats:
    """What the engine did, for people and benchmarks."""

    scheduler: SchedulerStats
    num_generated_tokens: int
    num_computed_tokens: int
    model_seconds: float
    wall_seconds: float
    #: Bytes of the planned KV pool (scheduler.max_usage is the largest fraction held at once).
    kv_pool_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_seconds if self.wall_seconds else 0.0


class LLMEngine:
    """Continuous batching over one :class:`ModelRunner` (see the module docstring).

    ``runner`` may be given instead of ``model_dir`` (tests share one runner between engines
    only one at a time: the cache contents belong to the engine using it). Other arguments go to
    :class:`ModelRunner`. ``max_num_batched_tokens`` is the per-step token budget (chunked
    prefill); ``max_num_seqs`` caps running requests (and the block-table rows).
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        runner: ModelRunner | None = None,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        keep_logits: bool = False,
        **runner_kwargs: Any,
    ) -> None:
        if (model_dir is None) == (runner is None):
            raise ValueError("give LLMEngine a model_dir or a runner (exactly one)")
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
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=runner.max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=runner.max_model_len,
        )
        self.tables = BlockTables.from_config(
            cfg,
            runner.kernel_block_sizes,
            max_num_reqs=max_num_seqs,
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=runner.max_num_batched_tokens,
            device=runner.device,
        )
        self.eos_token_ids = frozenset(runner.arch.eos_token_ids)
        self._rows: list[str | None] = [None] * max_num_seqs  # row -> request id
        self._row_of: dict[str, int] = {}
        self._seqs: dict[str, Seq] = {}
        self.keep_logits = keep_logits
        self.external_loader: Callable[[str, tuple[list[int], ...], int], None] | None = None
        self._logits: dict[str, list[torch.Tensor]] = {}
        self._ids = itertools.count()
        self._generated = 0
        self._computed = 0
        self._model_s = 0.0
        self._wall_s = 0.0

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        hold_blocks: bool = False,
        num_external_tokens: int = 0,
    ) -> str:
        """Queue a request; it joins the batch at the next :meth:`step` the pool allows.

        Disaggregated serving: ``hold_blocks`` keeps a finished request's blocks (read them with
        :meth:`block_ids`, free them with :meth:`release`) so a connector can serve them;
        ``num_external_tokens`` marks the first tokens as loaded from elsewhere: at admission
        they get blocks and :attr:`external_loader` ``(request_id, block_ids_per_group,
        num_tokens)`` must fill them before it returns (the engine then moves the caches'
        version counters, :meth:`~kvstack.engine.runner.ModelRunner.note_external_writes`, so
        TORCH_SDPA's kept decode gathers see the new bytes).
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in the engine; ids must be unique")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params is a {type(params).__name__}; pass a SamplingParams")
        vocab = self.runner.arch.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(
                f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        stop = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.eos_token_ids)
        )
        seq = Seq(
            Request(rid, [int(t) for t in prompt_token_ids]),
            params,
            prompt_len=len(prompt_token_ids),
            stop_ids=frozenset(stop),
            generator=make_generator(params, self.runner.device),
            num_external_tokens=num_external_tokens,
            hold_blocks=hold_blocks,
        )
        if num_external_tokens and self.external_loader is None:
            raise ValueError(f"request {rid!r} has external tokens but no external_loader is set")
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        return rid

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids per KV group of a running or held request (0 where a window dropped one)."""
        return self.kv.get_block_ids(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished ``hold_blocks`` request's blocks."""
        self.scheduler.release(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- rows ----------------------------------------------------------------------------------

    def _release_row(self, rid: str) -> None:
        row = self._row_of.pop(rid, None)
        if row is not None:
            self.tables.clear_row(row)
            self._rows[row] = None

    def _place(self, rid: str, i: int) -> None:
        """Put request ``rid``'s row at index ``i`` (swapping out whoever is there)."""
        cur = self._row_of.get(rid)
        if cur == i:
            return
        other = self._rows[i]
        if cur is None:  # a new request: free row i, moving its holder to an empty row
            if other is not None:
                j = self._rows.index(None)
                self.tables.swap_rows(i, j)
                self._rows[j], self._row_of[other] = other, j
        else:
            self.tables.swap_rows(cur, i)
            self._rows[cur] = other
            if other is not None:
                self._row_of[other] = cur
        self._rows[i], self._row_of[rid] = rid, i

    def _prepare_rows(self, out: SchedulerOutput) -> None:
        for rid in out.preempted:
            self._release_row(rid)
        append_rows: list[int] = []
        append_ids: list[tuple[list[int], ...]] = []
        row_of = self._row_of
        for i, chunk in enumerate(out.chunks):
            rid = chunk.seq.kv.request_id
            if row_of.get(rid) != i:  # a decode step mostly keeps every request's row
                self._place(rid, i)
            if chunk.admitted:
                self.tables.add_row(i, chunk.new_block_ids)
            elif any(chunk.new_block_ids):
                append_rows.append(i)
                append_ids.append(chunk.new_block_ids)
        if append_rows:  # the rows that crossed a block boundary, in one scatter
            self.tables.append_rows(append_rows, append_ids)
        self.tables.commit(len(out.chunks))

    # -- stepping ------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Schedule, run the model once, sample; the tokens generated this step."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.chunks:
            for rid in out.preempted:
                self._release_row(rid)
            return []
        self._prepare_rows(out)
        # One pass over the chunks builds every host list (no per-chunk tensors). The positions
        # come from the tables, which derive them from the same lengths for the metadata.
        qlens: list[int] = []
        seq_lens: list[int] = []
        ids: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Seq] = []
        for c in out.chunks:
            start, n = c.start, c.num_new_tokens
            end = start + n
            qlens.append(n)
            seq_lens.append(end)
            tokens = c.seq.kv.token_ids
            if n == 1:  # a decode
                ids.append(tokens[start])
            else:
                ids += tokens[start:end]
            if end == len(tokens):  # fed its last known token: sample a new one
                sample_rows.append(len(ids) - 1)
                sampled.append(c.seq)
        metadata = self.tables.build_common_metadata(len(qlens), qlens, seq_lens)
        positions = self.tables.positions  # [T]
        rows = int64_tensor(sample_rows)
        for c in out.chunks:
            if c.admitted and c.seq.num_external_tokens and c.seq.num_preemptions == 0:
                assert self.external_loader is not None
                self.external_loader(c.seq.request_id, c.new_block_ids, c.start)
                self.runner.note_external_writes()  # (a connector writes past torch's ops)
        t1 = time.perf_counter()
        # Trusted: the metadata comes from build_common_metadata (lengths and rows checked on
        # the host) and ids, positions and sample rows from the same chunks.
        logits = self.runner.execute_trusted(
            int64_tensor(ids), positions, metadata, rows
        )  # [R_sampled, vocab]
        self._model_s += time.perf_counter() - t1
        tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
        if self.keep_logits:
            for s, row in zip(sampled, logits.float().cpu(), strict=True):
                self._logits.setdefault(s.request_id, []).append(row)
        finished = self.scheduler.update(out, zip(sampled, tokens, strict=True))
        for s in finished:
            self._release_row(s.request_id)
        self._generated += len(tokens)
        self._computed += len(ids)
        self._wall_s += time.perf_counter() - t0
        return [
            TokenEvent(
                s.request_id,
                s.num_tokens - s.prompt_len - 1,
                t,
                s.finish_reason is not None,
                s.finish_reason,
            )
            for s, t in zip(sampled, tokens, strict=True)
        ]

    def completion(self, request_id: str) -> Completion:
        """The finished request ``request_id`` (forgotten by the engine once read)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.finish_reason is None:
            raise ValueError(f"request {request_id!r} is not a finished request of this engine")
        del self._seqs[request_id]
        rows = self._logits.pop(request_id, None)
        return Completion(
            request_id,
            tuple(seq.token_ids[: seq.prompt_len]),
            tuple(seq.output_token_ids),
            seq.finish_reason,
            seq.num_cached_prompt_tokens,
            seq.num_preemptions,
            torch.stack(rows) if rows else None,
        )

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> Iterator[TokenEvent]:
        """Add ``prompts`` (ids ``"0"``, ``"1"``, ...) and yield each token as it is generated."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(str(i), p, sp)
        while self.has_unfinished:
            yield from self.step()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Run ``prompts`` to completion; one :class:`Completion` per prompt, in order."""
        for _ in self.stream(prompts, params):
            pass
        return [self.completion(str(i)) for i in range(len(prompts))]

    def stats(self) -> EngineStats:
        cfg = self.runner.kv_cache_config
        return EngineStats(
            self.scheduler.stats,
            self._generated,
            self._computed,
            self._model_s,
            self._wall_s,
            cfg.total_bytes,
        )
