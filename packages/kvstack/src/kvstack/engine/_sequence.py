"""One request as the engine tracks it (:class:`Sequence`, its :class:`Status`), a step's plan
of them (:class:`ScheduledChunk`, :class:`SchedulerOutput`) and the scheduler's counters: the
data :mod:`kvstack.engine.scheduler` works on (it re-exports every name), without its policy.
No torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kv_blocktable import Request

if TYPE_CHECKING:
    from kvstack.engine.sampling import SamplingParams

__all__ = [
    "FinishReason",
    "ScheduledChunk",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "Status",
]


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # waiting for a connector's asynchronous load; not in the batch
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
    #: A producer's transfer params (``kv_connectors.KVTransferParams`` or its dict): the
    #: engine's connector loads the prompt's KV from it at first admission.
    kv_transfer_params: Any = None
    #: Prompt tokens a KV connector supplied at first admission (CPU tier, disk, a producer).
    num_external_hit_tokens: int = 0
    #: What the connector's ``request_finished`` returned for it (a producer's transfer params).
    kv_transfer_params_out: dict[str, Any] | None = None
    #: Tokens sampled on the device whose ids the host has not read yet (an engine one step
    #: ahead, :mod:`kvstack.engine._async`): scheduled as if known.
    num_pending: int = 0
    #: ``time.perf_counter()`` when the request was added, first scheduled, got its first
    #: output token on the host, finished (``Completion.metrics``).
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
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
    #: Tokens a KV connector supplied at admission (past the local hit), and how many of those
    #: admissions waited for an asynchronous load.
    external_hit_tokens: int = 0
    num_async_loads: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )
