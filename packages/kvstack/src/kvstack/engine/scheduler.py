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

The scheduler never touches tensors; it imports no torch, so its tests run without a model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kv_blocktable import KVCacheManager, Request

if TYPE_CHECKING:
    from kvstack.engine.sampling import SamplingParams

__all__ = [
    "FinishReason",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "Status",
]


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop (or EOS) token was generated


@dataclass(eq=False)
class Sequence:
    """One request as the engine tracks it. ``kv`` (kv-blocktable's ``Request``) holds every
    token, prompt then outputs, and the chained block hashes the prefix cache matches on."""

    kv: Request
    params: SamplingParams
    prompt_len: int
    stop_ids: frozenset[int] = frozenset()
    #: Tokens whose K/V is in the cache (or scheduled this step): the manager's count.
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    #: Prompt tokens served from the prefix cache at first admission (resumes not counted).
    num_cached_prompt_tokens: int = 0
    #: The request's sampler state (a ``torch.Generator`` or None); the scheduler never reads it.
    generator: Any = None
    #: Prompt tokens whose K/V a connector loads at first admission (disaggregated prefill):
    #: they get fresh blocks and count as computed; the engine fills them before the forward.
    num_external_tokens: int = 0
    #: Keep the blocks after finishing (a prefill worker serving them to a decode worker) until
    #: :meth:`Scheduler.release`.
    hold_blocks: bool = False
    _admitted_once: bool = field(default=False, repr=False)

    @property
    def request_id(self) -> str:
        return self.kv.request_id

    @property
    def num_tokens(self) -> int:
        return self.kv.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.kv.token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.kv.token_ids[self.prompt_len :]


@dataclass(frozen=True)
class ScheduledChunk:
    """``seq`` computes tokens ``[start, start + num_new_tokens)`` this step.

    ``admitted``: the request (re)entered the cache this step; its block-table row must be
    written whole (``KVCacheManager.get_block_ids``). Otherwise ``new_block_ids`` (per group) are
    the blocks to append to its row.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    admitted: bool
    new_block_ids: tuple[list[int], ...]

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk feeds the request's last known token (so a new one is sampled)."""
        return self.end == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    """Counters since the scheduler was built."""

    num_steps: int = 0
    num_preemptions: int = 0
    #: Prefix-cache lookups at admission (resumes included): tokens asked for and tokens hit.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    #: Resumes after preemption and the tokens they got back from the cache.
    num_resumes: int = 0
    resume_hit_tokens: int = 0
    max_usage: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )


class Scheduler:
    """Decides each step's batch; see the module docstring for the policy."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
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
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while True:
                new = self.kv.allocate_slots(seq.kv, n)
                if new is not None:
                    break
                victim = self.running.pop()  # the most recently admitted goes first
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            if new is None:  # seq preempted itself: nothing left to free
                break
            chunks.append(
                ScheduledChunk(seq, seq.num_computed_tokens, n, False, new.get_block_ids())
            )
            seq.num_computed_tokens += n
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(budget, chunks)
        if not chunks and self.has_unfinished and not self.running:
            seq = self.waiting[0]
            raise RuntimeError(
                f"request {seq.request_id!r} ({seq.num_tokens} tokens) cannot be admitted into an "
                f"empty pool of {self.kv.kv_cache_config.num_blocks} blocks; give the cache more "
                "memory or shorten the request"
            )
        self.stats.num_steps += 1
        self.stats.max_usage = max(self.stats.max_usage, self.kv.usage)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            external = bool(seq.num_external_tokens) and not seq._admitted_once
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

    def _preempt(self, seq: Sequence) -> None:
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
        if seq.hold_blocks:
            self.held[seq.request_id] = seq
        else:
            self.kv.free(seq.kv)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop request ``request_id`` wherever it is -- waiting, running, or finished and holding
        its blocks -- and free its blocks; the request, or None when the scheduler has none of
        that id (a finished request that holds no blocks is the engine's alone)."""
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
        Returns the requests that finished (their blocks are freed)."""
        finished: list[Sequence] = []
        for seq, token in sampled:
            seq.kv.append_token_ids(token)
            if token in seq.stop_ids:
                seq.finish_reason = FinishReason.STOP
            elif seq.kv.num_tokens - seq.prompt_len >= seq.params.max_new_tokens:
                seq.finish_reason = FinishReason.LENGTH
            else:
                continue
            seq.status = Status.FINISHED
            if seq.hold_blocks:
                self.held[seq.request_id] = seq
            else:
                self.kv.free(seq.kv)
            finished.append(seq)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
        return finished
