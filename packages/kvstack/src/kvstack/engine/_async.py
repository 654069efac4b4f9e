"""One step ahead: the host schedules and launches step n+1 while the device runs step n.

With ``LLMEngine(async_scheduling=...)`` a step's greedy tokens are picked on the device (``argmax``) and copied to pinned host memory without waiting; the step is
left in flight (:class:`InFlight`). The next :meth:`~kvstack.engine.LLMEngine.step` schedules
as if each sampled request already had its token (``Sequence.num_pending``), launches, and only
then reads the previous step's tokens: the host's scheduling, block-table and metadata work for
step n+1 runs while the device computes step n, and the token read is the step's one wait.

Which steps are left in flight: ``True`` (the default on CUDA) every step, eager ones too;
``"graphs"`` only those replayed from a CUDA graph, whose launch costs the host next to nothing
(an H100, Llama-3-8B shape, 64 x 1k: a decode step 9.7 ms against 11.9 ms in lockstep); ``False``
none (the CPU's default: there the "device" is the host). An eager step's host work (its
launches alone are ~15-28 ms at 32 layers) overlaps the step before it too: on an H200, one
device call, Llama-3-8B shape, each step timed on the device, ``True`` against ``"graphs"`` took
an eager 256 x 1k decode step from 0.56 to 0.76 of the memory roofline, 64 x 1k from 0.29 to
0.45, and the steps that prefill beside 256 decodes from 0.62 to 0.63 (beside 64: 0.75 both),
graphed steps unchanged (``docs/benchmarks/engine_gpu.*``). An H100 run had once timed eager steps slower this way (36
ms against 21): its steps were wall-timed across separate runs, and it is not re-measured yet.

A pending token's id is not on the host when step n+1 is built: its input row is written on the
device from step n's sampled tokens (an ``index_copy_`` before the forward, in stream order).
A request that step n finishes by its token budget is left out of step n+1 (the budget is known
ahead); one that step n finishes with a stop token has run one step too many, whose token is
dropped (its blocks go back to the pool after step n+1's kernels in stream order). The engine
resolves the step in flight first, and schedules as before, whenever a request needs its tokens
on the host between steps: non-greedy sampling, stop strings, ``keep_logits``, an external
loader, a KV connector with work (a load in flight or planned, a save, a streamed prefill,
blocks held for a transfer, or a request waiting, whose admission may start a load into blocks
the step in flight still writes), or a pool too full to schedule without preempting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.engine.scheduler import SchedulerOutput, Sequence

__all__ = ["InFlight", "TokenReader"]


@dataclass
class InFlight:
    """A launched step whose tokens have not been read."""

    out: SchedulerOutput
    sampled: list[Sequence]
    tokens: torch.Tensor  # [R] int64 on the device: the greedy token of each sampled row
    host: torch.Tensor  # [R] int64: where they land on the host (pinned on CUDA)
    event: torch.cuda.Event | None  # recorded after the copy (None on the CPU)
    row_of: dict[int, int]  # id(seq) -> its row in ``tokens``


class TokenReader:
    """Greedy tokens picked on the device and copied to the host without a wait: two pinned
    buffers take turns (a step's copy lands while the next step's is queued)."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._host = [
                torch.empty(max_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
            self._turn = 0

    def launch(
        self, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """(device tokens, host tokens, event) of ``logits`` ``[R, vocab]``'s row maxima."""
        tokens = logits.argmax(dim=-1)
        if not self.cuda:
            return tokens, tokens, None
        host = self._host[self._turn][: tokens.numel()]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return tokens, host, event

    @staticmethod
    def read(step: InFlight) -> list[int]:
        """The step's tokens (waits for its copy: the step's one device sync)."""
        if step.event is not None:
            step.event.synchronize()
        return step.host.tolist()
