"""What :class:`~kvstack.engine.engine.LLMEngine` returns: one :class:`TokenEvent` per generated
token, one :class:`Completion` per finished request, and :class:`EngineStats` for a run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.engine.connector_driver import KVConnectorStats
from kvstack.engine.scheduler import FinishReason, SchedulerStats, Sequence

__all__ = ["Completion", "EngineStats", "TokenEvent", "token_events"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request (``finished``: it was the request's last)."""

    request_id: str
    index: int
    token_id: int
    finished: bool
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class RequestMetrics:
    """When a request passed each stage, in ``time.perf_counter()`` seconds (vLLM's
    ``RequestMetrics``): added, first scheduled (admitted into a step: its prefix hit, local or
    from a connector, counted), its first output token known on the host, finished. ``None``:
    not reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from ``add_request`` to the step that first scheduled it (waiting for a
        batch slot or for blocks, e.g. ones a connector's save still holds)."""
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.arrival_time


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
    #: The output decoded by the engine's tokenizer (None without one), cut before a stop
    #: string (``SamplingParams.stop``) as vLLM does; ``prompt_text`` is the prompt given as text
    #: (or rendered by :meth:`LLMEngine.chat`), None for a prompt given as token ids.
    text: str | None = None
    prompt_text: str | None = None
    #: What the engine's KV connector returned when the request finished (a producer's transfer
    #: params: give them to a decode engine's ``add_request(kv_transfer_params=...)``).
    kv_transfer_params: dict[str, Any] | None = None
    #: When the request passed each stage (queued, first token, finished).
    metrics: RequestMetrics | None = None


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
    #: Seconds the engine's start took, by stage: ``load`` (weights), ``plan`` (KV plan and
    #: allocation, backends), ``graphs`` (CUDA-graph capture), ``compile`` (kernels built ahead
    #: of the first request: ``LLMEngine(warmup=True)``).
    startup_seconds: dict[str, float] = field(default_factory=dict)
    #: The KV connector's loads, failures and save errors (None: the engine has no connector).
    kv_connector: KVConnectorStats | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_seconds if self.wall_seconds else 0.0


def token_events(pairs: Iterable[tuple[Sequence, int]]) -> list[TokenEvent]:
    """One event per (request, its token just appended): the token's index among its outputs."""
    return [
        TokenEvent(
            s.request_id,
            s.num_tokens - s.prompt_len - 1,
            t,
            s.finish_reason is not None,
            s.finish_reason,
        )
        for s, t in pairs
    ]
