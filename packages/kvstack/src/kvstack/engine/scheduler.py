"""Continuous batching over kv-blocktable's ``KVCacheManager``: who runs this step, and how much.

One step's plan, in the spirit of vLLM v1's scheduler (no separate prefill and decode phases; every
request just has ``num_tokens - num_computed_tokens`` tokens to catch up on):

1. Running requests first, in admission order: each gets ``min(tokens left, budget)`` new tokens
   (a decode is 1 token, an unfinished prompt a chunk: *chunked prefill* under
   ``max_num_batched_tokens``). When the pool cannot give a request its slots, the most recently
   admitted running request is *preempted*: its blocks are freed (they stay in the prefix cache
   until evicted) and it goes back to the front of the queue, to resume later from a prefix hit.
2. Then, if nothing was preempted, waiting requests in arrival order: a prefix-cache lookup
   (``get_computed_blocks``: shared prompts hit) and slots for the rest of the prompt, chunked to
   the budget left, while the pool, the budget and ``max_num_seqs`` allow.

With a KV connector (:class:`SchedulerConnector`, vLLM v1's order): after the local hit, the
connector says how many more tokens it can supply (whole blocks, at least one token left to
compute); they get fresh slots in the same allocation. Loaded *inside* the step (a CPU tier), the
request runs now from past them; loaded *asynchronously* (a remote producer), it leaves the batch
(:attr:`Scheduler.loading`) and joins the running requests when :meth:`Scheduler.kv_loaded` says
the bytes landed (or from the first block that failed: those are recomputed). Until a load is
verified its blocks are not entered into the prefix cache (the manager is told only the local hit;
:meth:`Scheduler.kv_loaded` / :meth:`Scheduler.rewind` set the count the next allocation reports).
A finished request whose blocks the connector still reads stays in :attr:`Scheduler.sending` until
:meth:`Scheduler.kv_sent`.

The scheduler never touches tensors; it imports no torch, so its tests run without a model.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from kv_blocktable import KVCacheManager, append_decode_tokens

from kvstack.engine._sequence import (
    FinishReason,
    ScheduledChunk,
    SchedulerOutput,
    SchedulerStats,
    Sequence,
    Status,
)

__all__ = [
    "FinishReason",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConnector",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "Status",
]


class SchedulerConnector(Protocol):
    """What the scheduler asks a KV connector (:mod:`kvstack.engine.connector_driver` speaks the
    ``kv_connectors`` contract behind it)."""

    block_size: int
    #: The scheduler driving it (set by :class:`Scheduler`).
    scheduler: Scheduler | None

    def match(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the connector supplies, and whether asynchronously."""
        ...

    def allocated(
        self, seq: Sequence, block_ids: list[int], num_external_tokens: int, load_async: bool
    ) -> None:
        """``seq`` got ``block_ids`` (its whole table); ``num_external_tokens`` are to be loaded."""
        ...

    def finished(self, seq: Sequence) -> bool:
        """``seq`` finished: True keeps its blocks until :meth:`Scheduler.kv_sent`."""
        ...


class Scheduler:
    """Decides each step's batch; see the module docstring for the policy."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        connector: SchedulerConnector | None = None,
    ) -> None:
        for name, v in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Scheduler: {name}={v!r} must be an int >= 1")
        self.kv = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        #: Finished requests whose blocks are kept (``hold_blocks``) until :meth:`release`.
        self.held: dict[str, Sequence] = {}
        self.connector = connector
        if connector is not None:
            connector.scheduler = self
        #: Requests waiting for a connector's asynchronous load (blocks held, not in the batch).
        self.loading: dict[str, Sequence] = {}
        #: Finished requests whose blocks the connector still reads (freed by :meth:`kv_sent`).
        self.sending: dict[str, Sequence] = {}
        #: Aborted while loading: freed when the load ends (a transfer may still write them).
        self.aborted_loading: dict[str, Sequence] = {}
        # Running requests whose count the manager was not told yet (loaded or rewound), and
        # requests that join the batch without a block-table row (after an asynchronous load).
        self._resync: set[str] = set()
        self._new_row: set[str] = set()
        self.stats = SchedulerStats()

    # -- queue ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if not 0 <= seq.num_external_tokens < seq.num_tokens:
            raise ValueError(
                f"request {seq.request_id!r}: num_external_tokens={seq.num_external_tokens} must be "
                f"in [0, {seq.num_tokens}) (at least the last token is computed here)"
            )
        total = seq.prompt_len + seq.params.max_new_tokens
        if seq.prompt_len < 1:
            raise ValueError(
                f"request {seq.request_id!r} has an empty prompt; give at least one token"
            )
        if total > self.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r}: {seq.prompt_len} prompt + "
                f"{seq.params.max_new_tokens} new tokens = {total} exceeds max_model_len="
                f"{self.max_model_len}; shorten the prompt or max_new_tokens"
            )
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def has_pending_kv(self) -> bool:
        """Whether a connector still loads into or reads from some request's blocks."""
        return bool(self.loading or self.sending or self.aborted_loading)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, *, ahead: bool = False) -> SchedulerOutput:
        """The next step's chunks. ``ahead``: the previous step's tokens are still on the device
        (``Sequence.num_pending``; :mod:`kvstack.engine._async`): requests those tokens finish by
        their budget are left out, and nothing is preempted (the step stops at the first request
        the pool cannot serve, and admits no one; the engine then reads the tokens and schedules
        again)."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        seqs = self.running
        if ahead:
            seqs = [
                s
                for s in seqs
                if not s.num_pending
                or s.num_tokens + s.num_pending - s.prompt_len < s.params.max_new_tokens
            ]
        i = self._schedule_decodes(budget, chunks, seqs)
        budget -= i
        stalled = False
        while i < len(seqs) and budget > 0:
            seq = seqs[i]
            n = min(seq.num_tokens + seq.num_pending - seq.num_computed_tokens, budget)
            rid = seq.request_id
            while True:
                if rid in self._resync:
                    new = self.kv.allocate_slots(
                        seq.kv, n, num_computed_tokens=seq.num_computed_tokens
                    )
                else:
                    new = self.kv.allocate_slots(seq.kv, n)
                if new is not None or ahead:
                    break
                victim = self.running.pop()  # the most recently admitted goes first
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            if new is None:  # seq preempted itself (or, ahead, the pool is full)
                stalled = True
                break
            self._resync.discard(rid)
            if rid in self._new_row:  # joins after an asynchronous load: its whole row
                self._new_row.discard(rid)
                chunk = ScheduledChunk(
                    seq, seq.num_computed_tokens, n, True, self.kv.get_block_ids(seq.kv)
                )
            else:
                chunk = ScheduledChunk(seq, seq.num_computed_tokens, n, False, new.get_block_ids())
            chunks.append(chunk)
            seq.num_computed_tokens += n
            budget -= n
            i += 1
        if not preempted and not stalled:
            budget = self._admit(budget, chunks)
        if not chunks and self.has_unfinished and not self.running and not self.has_pending_kv:
            seq = self.waiting[0]
            raise RuntimeError(
                f"request {seq.request_id!r} ({seq.num_tokens} tokens) cannot be admitted into an "
                f"empty pool of {self.kv.kv_cache_config.num_blocks} blocks; give the cache more "
                "memory or shorten the request"
            )
        self.stats.num_steps += 1
        self.stats.max_usage = max(self.stats.max_usage, self.kv.usage)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _schedule_decodes(
        self, budget: int, chunks: list[ScheduledChunk], seqs: list[Sequence]
    ) -> int:
        """The leading run of running requests that each compute one token (a decode step's
        whole batch) in one ``KVCacheManager.allocate_decode_slots`` call -- the same blocks as
        an ``allocate_slots`` call per request, at a fraction of the host time; returns how many
        it scheduled. It stops at the first request the pool cannot serve, which the per-request
        loop then takes (preempting as it does)."""
        run: list[Sequence] = []
        for seq in seqs:
            rid = seq.request_id
            if (
                len(run) == budget
                or seq.num_tokens + seq.num_pending - seq.num_computed_tokens != 1
                or rid in self._resync
                or rid in self._new_row
            ):
                break
            run.append(seq)
        if len(run) < 2:
            return 0
        got = self.kv.allocate_decode_slots([s.kv for s in run])
        fresh = dict(zip(got.rows, got.new_block_ids, strict=True))
        groups = len(self.kv.kv_cache_config.groups)
        for k in range(got.num_scheduled):
            seq = run[k]
            ids = fresh[k] if k in fresh else tuple([] for _ in range(groups))
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1, False, ids))
            seq.num_computed_tokens += 1
        return got.num_scheduled

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            external = bool(seq.num_external_tokens) and not seq._admitted_once
            if self.connector is not None and not external:
                admitted = self._admit_with_connector(seq, budget, chunks)
                if admitted is None:
                    break  # the pool is full: wait for running requests to finish
                budget -= admitted
                continue
            if external:
                # Loaded from elsewhere: all of it at once (a chunk boundary inside would leave
                # tokens neither loaded nor computed).
                hit_blocks, hit = None, seq.num_external_tokens
                n = seq.num_tokens - hit
                if n > budget:
                    break
            else:
                found, hit = self.kv.get_computed_blocks(seq.kv)
                hit_blocks = found if hit else None
                n = min(seq.num_tokens - hit, budget)
            new = self.kv.allocate_slots(seq.kv, n, hit, hit_blocks)
            if new is None:
                break  # the pool is full: wait for running requests to finish
            self.waiting.popleft()
            self._count_hit(seq, 0 if external else hit)
            seq.status = Status.RUNNING
            seq.num_computed_tokens = hit + n
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, hit, n, True, self.kv.get_block_ids(seq.kv)))
            budget -= n
        return budget

    def _admit_with_connector(
        self, seq: Sequence, budget: int, chunks: list[ScheduledChunk]
    ) -> int | None:
        """Admit ``seq`` past its local hit and the connector's tokens; the tokens it computes
        this step, or None when the pool cannot hold it now."""
        assert self.connector is not None
        found, hit = self.kv.get_computed_blocks(seq.kv)
        hit_blocks = found if hit else None
        ext, load_async = self.connector.match(seq, hit)
        bs = self.connector.block_size
        # whole blocks, leaving at least the last token to compute (its logits are sampled)
        ext = max(0, min(ext, (seq.num_tokens - 1) // bs * bs - hit))
        n = 0 if ext and load_async else min(seq.num_tokens - hit - ext, budget)
        if ext:  # slots for the loaded tokens, counted computed only once the load is verified
            new = self.kv.allocate_slots(seq.kv, 0, hit, hit_blocks, num_lookahead_tokens=ext + n)
        else:
            new = self.kv.allocate_slots(seq.kv, n, hit, hit_blocks)
        if new is None:
            return None
        self.waiting.popleft()
        first = not seq._admitted_once
        self._count_hit(seq, hit)
        self.stats.external_hit_tokens += ext
        if first:
            seq.num_external_hit_tokens = ext
        rid = seq.request_id
        block_ids = self.kv.get_block_ids(seq.kv)
        self.connector.allocated(seq, list(block_ids[0]), ext, load_async)
        if ext and load_async:
            self.stats.num_async_loads += 1
            seq.status = Status.LOADING
            seq.num_computed_tokens = hit
            self.loading[rid] = seq
            return 0
        if ext:
            self._resync.add(rid)
        seq.status = Status.RUNNING
        seq.num_computed_tokens = hit + ext + n
        self.running.append(seq)
        chunks.append(ScheduledChunk(seq, hit + ext, n, True, block_ids))
        return n

    def kv_loaded(self, request_id: str, num_computed_tokens: int) -> None:
        """A connector's asynchronous load of ``request_id`` ended: its first
        ``num_computed_tokens`` tokens are in the cache (the rest, failed blocks included, are
        computed); it joins the running requests at the next step."""
        seq = self.aborted_loading.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq.kv)  # the transfer that might write its blocks has ended
            return
        seq = self.loading.pop(request_id)
        seq.status = Status.RUNNING
        seq.num_computed_tokens = num_computed_tokens
        self.running.append(seq)
        self._resync.add(request_id)
        self._new_row.add(request_id)

    def rewind(self, seq: Sequence, num_computed_tokens: int) -> None:
        """A load inside this step failed: ``seq`` recomputes from ``num_computed_tokens``."""
        seq.num_computed_tokens = num_computed_tokens
        self._resync.add(seq.request_id)

    def kv_sent(self, request_id: str) -> None:
        """The connector no longer reads finished request ``request_id``'s blocks: free them."""
        seq = self.sending.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq.kv)

    def _count_hit(self, seq: Sequence, hit: int) -> None:
        s = self.stats
        s.prefix_query_tokens += seq.num_tokens
        s.prefix_hit_tokens += hit
        if seq._admitted_once:
            s.num_resumes += 1
            s.resume_hit_tokens += hit
        else:
            seq.num_cached_prompt_tokens = hit
            seq._admitted_once = True
            seq.first_scheduled_time = time.perf_counter()

    def _release(self, seq: Sequence) -> None:
        """A finished ``seq``'s blocks: held (``hold_blocks``), kept for the connector, or freed."""
        rid = seq.request_id
        self._resync.discard(rid)
        self._new_row.discard(rid)
        if seq.hold_blocks:
            self.held[rid] = seq
        elif self.connector is not None and self.connector.finished(seq):
            self.sending[rid] = seq
        else:
            self.kv.free(seq.kv)

    def _preempt(self, seq: Sequence) -> None:
        self._resync.discard(seq.request_id)
        self._new_row.discard(seq.request_id)
        self.kv.free(seq.kv)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish ``seq`` now with ``reason`` (the engine found a stop string in its text): off
        the running list, its blocks freed (or held, with ``hold_blocks``). A request that
        already finished (this step, by length) only takes the new reason."""
        if seq.status is Status.FINISHED:
            seq.finish_reason = reason
            return
        if seq.status is not Status.RUNNING:
            raise ValueError(
                f"request {seq.request_id!r} is {seq.status.value}; only a running request can "
                "be finished"
            )
        self.running.remove(seq)  # Sequence compares by identity (eq=False)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        self._release(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop request ``request_id`` wherever it is -- waiting, running, or finished and holding
        its blocks -- and free its blocks; the request, or None when the scheduler has none of
        that id (a finished request that holds no blocks is the engine's alone). A request a
        connector loads into or reads from keeps its blocks until the connector reports it
        (:meth:`kv_loaded`, :meth:`kv_sent`)."""
        self._resync.discard(request_id)
        self._new_row.discard(request_id)
        if request_id in self.sending:
            return self.sending[request_id]
        if request_id in self.loading:
            loading = self.aborted_loading[request_id] = self.loading.pop(request_id)
            return loading
        seq = self.held.pop(request_id, None)
        if seq is None:
            seq = next((s for s in self.running if s.request_id == request_id), None)
            if seq is not None:
                self.running.remove(seq)
        if seq is None:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
            if seq is None:
                return None
            self.waiting.remove(seq)  # a waiting request holds no blocks (preemption freed them)
            return seq
        self.kv.free(seq.kv)
        return seq

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished ``hold_blocks`` request (its consumer has them)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            raise ValueError(
                f"request {request_id!r} holds no blocks after finishing (held: {sorted(self.held)})"
            )
        self.kv.free(seq.kv)

    # -- after the forward pass ----------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled: Iterable[tuple[Sequence, int]]
    ) -> list[Sequence]:
        """Append each sampled token; finish requests that hit a stop token or their length.
        Returns the requests that finished (their blocks are freed). One batched append, then
        the finish rules (per sequence); on an error, the pairs before it were both, as before."""
        pairs: list[tuple[Sequence, int]] = []
        try:
            pairs.extend(sampled)
        finally:  # (a strict zip that runs short gives its pairs before it raises)
            try:  # the same tokens, hashes and errors as an append_token_ids call per sequence
                append_decode_tokens([s.kv for s, _ in pairs], [t for _, t in pairs])
            except Exception:  # it stopped at the first id append_token_ids refuses
                ok = (type(t) is int and -(2**63) <= t < 2**63 for _, t in pairs)
                self._finish_sampled(pairs[: next((i for i, g in enumerate(ok) if not g), 0)])
                raise
            finished = self._finish_sampled(pairs)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
        return finished

    def _finish_sampled(self, pairs: list[tuple[Sequence, int]]) -> list[Sequence]:
        finished: list[Sequence] = []
        now = time.perf_counter()
        for seq, token in pairs:
            outputs = seq.kv.num_tokens - seq.prompt_len
            if outputs == 1:
                seq.first_token_time = now
            if token in seq.stop_ids:
                seq.finish_reason = FinishReason.STOP
            elif outputs >= seq.params.max_new_tokens:
                seq.finish_reason = FinishReason.LENGTH
            else:
                continue
            seq.status = Status.FINISHED
            seq.finished_time = now
            self._release(seq)
            finished.append(seq)
        return finished
