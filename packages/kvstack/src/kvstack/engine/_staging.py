"""Host→device staging of a step's token ids and sampled rows: one asynchronous copy a step.

A CPU tensor handed to ``.to("cuda")`` is pageable memory, and CUDA serializes such a copy with
the stream: the host waits for every kernel queued before it (a device sync in all but name,
two of them a step when the ids and the sampled rows went that way). :class:`StepStager` writes
both into a pinned buffer and copies it with ``non_blocking=True``; two buffers take turns, and
a buffer is written again only after the copy that last read it has run (an event per buffer),
so the host may run a step ahead of the device.
"""

from __future__ import annotations

import torch
from kv_blocktable._block_ids import int64_tensor

__all__ = ["StepStager"]


class StepStager:
    """Stage a step's int64 lists on ``device``: ``ids`` (``[T]``), ``rows`` (``[R]``) and, one
    step ahead (:mod:`kvstack.engine._async`), the positions of pending tokens in ``ids`` and
    their rows in the previous step's tokens."""

    def __init__(self, device: torch.device, max_tokens: int, max_rows: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.size = max_tokens + 3 * max_rows
        if self.cuda:
            self._host = [
                torch.empty(self.size, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
            self._dev = [torch.empty(self.size, dtype=torch.int64, device=device) for _ in range(2)]
            self._done: list[torch.cuda.Event | None] = [None, None]
            self._turn = 0

    def stage(self, *lists: list[int]) -> list[torch.Tensor]:
        """Device tensors of ``lists`` (views of a staging buffer: valid until the step after
        next stages; on the CPU, fresh tensors)."""
        if not self.cuda:
            return [int64_tensor(x) for x in lists]
        total = sum(len(x) for x in lists)
        if total > self.size:
            raise ValueError(
                f"a step's {total} staged ids (tokens, sampled rows, pending tokens) exceed the "
                f"staging buffer of {self.size} entries (max_num_batched_tokens + 3 x max_num_seqs)"
            )
        i = self._turn
        self._turn ^= 1
        done = self._done[i]
        if done is not None and not done.query():
            # (the copy two steps back: long since run in practice, so the query answers and
            # the host makes no blocking call)
            done.synchronize()
        host, dev = self._host[i], self._dev[i]
        views, at = [], 0
        for x in lists:
            if x:
                host[at : at + len(x)] = int64_tensor(x)
            views.append(dev[at : at + len(x)])
            at += len(x)
        dev[:at].copy_(host[:at], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._done[i] = ev
        return views
