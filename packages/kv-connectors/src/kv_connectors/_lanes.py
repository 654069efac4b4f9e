"""The CPU tier's copies (:class:`~kv_connectors.offloading.OffloadingConnector`): one segment of
a request's blocks to or from its tier slots, in as few kernel launches and copies as the blocks
allow.

A request's blocks sit in *runs* of consecutive tier slots (:data:`Run`): each save takes the
lowest free slots, so a history stored over several turns spans a run per turn. On CUDA each
direction has a :class:`Lane` (side stream, copy stream, two staging halves):

- a run whose block ids are consecutive and whose segment lies back to back in the cache is one
  copy between the cache's own memory and the tier (no staging);
- the other runs of the segment share the staging halves: per piece, one block gather (save) or
  scatter (load) over every run's ids in it, and one host copy per run part.

Why pieces over runs, not per run (issue 30): a CPU-tier hit on a 4k-token history (H200,
Llama-3-8B shape, 32 layer segments, 3-4 runs) spent 11-26 ms of host time enqueueing its load,
one scatter launch per run and segment, before the step's forward could launch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_connectors.views import RegisteredKV, is_run

__all__ = ["Lane", "Run", "order_runs"]

#: ``(first tier slot, count, block ids on the host)``: blocks in consecutive tier slots
Run = tuple[int, int, list[int]]


def order_runs(runs: Sequence[Run]) -> tuple[list[Run], int]:
    """``runs`` with those whose block ids are consecutive last, and how many come before them:
    where a segment copies such runs directly, the staged ones are a prefix, so their ids are one
    slice of the ids concatenated in this order."""
    staged = [r for r in runs if not is_run(r[2])]
    return staged + [r for r in runs if is_run(r[2])], len(staged)


def _event_on(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


@dataclass
class Lane:
    """One direction of a CUDA cache's copies (saves: cache -> tier; loads: tier -> cache): a
    side stream for the block gathers / scatters, a copy stream for the copy engine, two staging
    halves (a piece gathered into one while the copy engine moves the other) and, per half, the
    event after which both streams are done with it."""

    stream: Any
    copy_stream: Any
    staging: list[torch.Tensor]
    slot_free: list[Any] = field(default_factory=lambda: [None, None])
    pieces: int = 0

    @classmethod
    def make(cls, device: torch.device, half: int) -> Lane:
        return cls(
            torch.cuda.Stream(device=device),
            torch.cuda.Stream(device=device),
            [torch.empty(half, dtype=torch.uint8, device=device) for _ in range(2)],
        )

    def enter(self, device: torch.device, *, after_compute: bool = True) -> Any:
        """The side stream as the current one, started (``after_compute``) after everything
        already queued on the compute stream: the blocks a save reads are computed, those a
        load writes are free. A step's later load segments skip that wait: nothing the step
        queued since its first reads the blocks they write before waiting for them."""
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(self.stream)

    def record(self) -> Any:
        """An event after everything queued on the lane (its host copies included)."""
        self.stream.wait_stream(self.copy_stream)
        return _event_on(self.stream)

    def _pieces(self, width: int, n: int) -> Iterator[tuple[slice, int, torch.Tensor]]:
        """``n`` rows of ``width`` bytes in pieces that fit a staging half: per piece, its slice
        of the ``n`` rows, the half and its view ``[piece rows, width]``, once both streams are
        done with what that half held before.

        The pieces are even (264 rows in halves of 256: 132 + 132, not 256 + 8): a segment in
        two pieces would otherwise put every segment's large piece in the same half, each
        waiting for the previous one's copy and scatter, so no copy overlapped a scatter (a
        4,224-token CPU-tier hit on the H200 took 69 ms where 3,168 tokens took 37)."""
        cap = self.staging[0].numel() // width
        step = -(-n // -(-n // cap)) if n else cap  # ceil(n / number of pieces)
        for a in range(0, n, step):
            b = min(n, a + step)
            half = self.pieces % 2
            self.pieces += 1
            free = self.slot_free[half]
            if free is not None:
                self.stream.wait_event(free)
                self.copy_stream.wait_event(free)
            yield slice(a, b), half, self.staging[half][: (b - a) * width].view(b - a, width)

    def _direct(
        self, kv: RegisteredKV, seg: int, runs: Sequence[Run], staged: int
    ) -> tuple[list[tuple[Run, torch.Tensor]], int]:
        """The runs copied straight from / into the cache's memory (with its view) and how many
        runs go through staging: every run, unless the segment's rows lie back to back."""
        direct = []
        for run in runs[staged:]:
            view = kv.contiguous_rows(run[2], seg)
            if view is None:  # (a segment-wide property: no run of it is direct)
                return [], len(runs)
            direct.append((run, view))
        return direct, staged

    def save(
        self, kv: RegisteredKV, seg: int, tier: torch.Tensor, runs: Sequence[Run], staged: int,
        ids: torch.Tensor,
    ) -> None:  # fmt: skip
        """Segment ``seg`` of the blocks of ``runs`` (:func:`order_runs`' order, ``staged`` of
        them first; ``ids``: their block ids concatenated, on the device) -> their slots of
        ``tier`` (the segment's ``[capacity, width]`` view). Enqueued on this lane."""
        direct, staged = self._direct(kv, seg, runs, staged)
        if direct:
            self.copy_stream.wait_stream(self.stream)  # after the compute that wrote them
            with torch.cuda.stream(self.copy_stream):
                for (slot, n, _), view in direct:
                    tier[slot : slot + n].copy_(view, non_blocking=True)
        parts = runs[:staged]
        total = sum(r[1] for r in parts)
        for rows, half, stage in self._pieces(kv.segments[seg].row_bytes, total):
            kv.gather(ids[rows], stage, segments=range(seg, seg + 1), cols=False)
            self.copy_stream.wait_event(_event_on(self.stream))
            with torch.cuda.stream(self.copy_stream):
                for a, b, slot in _spans(parts, rows):
                    tier[slot : slot + b - a].copy_(stage[a:b], non_blocking=True)
            self.slot_free[half] = _event_on(self.copy_stream)

    def load(
        self, kv: RegisteredKV, seg: int, tier: torch.Tensor, runs: Sequence[Run], staged: int,
        ids: torch.Tensor,
    ) -> None:  # fmt: skip
        """The inverse of :meth:`save`: the runs' tier slots -> segment ``seg`` of their
        blocks."""
        direct, staged = self._direct(kv, seg, runs, staged)
        if direct:
            self.copy_stream.wait_stream(self.stream)  # after the compute that read the blocks
            with torch.cuda.stream(self.copy_stream):
                for (slot, n, _), view in direct:
                    view.copy_(tier[slot : slot + n], non_blocking=True)
        parts = runs[:staged]
        total = sum(r[1] for r in parts)
        for rows, half, stage in self._pieces(kv.segments[seg].row_bytes, total):
            with torch.cuda.stream(self.copy_stream):
                for a, b, slot in _spans(parts, rows):
                    stage[a:b].copy_(tier[slot : slot + b - a], non_blocking=True)
            self.stream.wait_event(_event_on(self.copy_stream))
            kv.scatter(stage, ids[rows], segments=range(seg, seg + 1), cols=False)
            self.slot_free[half] = _event_on(self.stream)


def _spans(parts: Sequence[Run], rows: slice) -> Iterator[tuple[int, int, int]]:
    """The runs' pieces inside ``rows`` of their concatenation: ``(a, b, slot)`` per piece, rows
    ``[a, b)`` of the staging view (0 at ``rows.start``) and the tier slot of row ``a``."""
    start = 0
    for slot, n, _ in parts:
        lo, hi = max(start, rows.start), min(start + n, rows.stop)
        if lo < hi:
            yield lo - rows.start, hi - rows.start, slot + lo - start
        start += n
        if start >= rows.stop:
            return


def copy_on_host(
    kv: RegisteredKV, seg: int, tier: torch.Tensor, runs: Sequence[Run], ids: torch.Tensor,
    *, save: bool,
) -> None:  # fmt: skip
    """A CPU cache's copies (synchronous): per run, gathered straight into its tier slots
    (``save``) or scattered from them."""
    start = 0
    for slot, n, _ in runs:
        rows, block = tier[slot : slot + n], ids[start : start + n]
        if save:
            kv.gather(block, rows, segments=range(seg, seg + 1), cols=False)
        else:
            kv.scatter(rows, block, segments=range(seg, seg + 1), cols=False)
        start += n
