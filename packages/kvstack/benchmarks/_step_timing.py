"""The step benchmark's clocks (:mod:`_step_bench`): the device-to-device copy bandwidth and the
dense matmul peak its rooflines divide by, measured in the same process, and the timed steps
(each step's device time between CUDA events on a GPU, wall time on the CPU, and the time
Python's garbage collector ran inside each)."""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from typing import Any

import torch

__all__ = ["copy_bandwidth", "gc_summary", "matmul_peak", "model_dtype", "sync", "timed_steps"]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth, bytes/s counted read + write (the memory roofline)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    del a, b
    return 2 * nbytes / best


def model_dtype(device: str) -> torch.dtype:
    """The dtype the benchmark serves the model in: bf16 on a GPU, float32 on the CPU (whose
    bf16 matmuls can run ~100x slower than its float32 ones where it lacks bf16 units)."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def matmul_peak(device: str, n: int = 8192) -> float:
    """Dense matmul FLOP/s measured here in the served dtype (:func:`model_dtype`): the compute
    roofline of prefill-heavy steps. (On a CPU without bf16 units a bf16 peak read 0.8 GFLOP/s
    against float32 steps, and the CPU smoke shape's fractions came out at 10-50.)"""
    dtype = model_dtype(device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


class _GcClock:
    """Milliseconds Python's garbage collector ran while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.ms, self._start = 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._start) * 1e3


def gc_summary(gc_ms: list[float]) -> dict[str, float]:
    """``gc_ms_per_step`` (mean) and ``gc_max_ms`` of the timed steps' collections."""
    return {"gc_ms_per_step": statistics.fmean(gc_ms), "gc_max_ms": max(gc_ms)} if gc_ms else {}


def timed_steps(
    engine: Any, n: int, before: Any = None, gc_ms: list[float] | None = None
) -> list[float]:
    """Seconds of ``n`` steps run back to back (the device drained before and after): the sum is
    the run's time. On a GPU each step's time is the device's, from the end of the step before
    to the end of its own (CUDA events recorded after each call's launches), so a step the
    engine leaves in flight (``async_scheduling``), which finishes inside the next call, is
    still charged its own time, and the device's idle waiting for the host is charged to the
    step that waited. On the CPU the steps are wall times between the calls. ``before(k)`` runs
    before step k (requests arriving); on the CPU, when it returns true, the device is drained
    first and the wait counted to step k - 1, so that step k's time is its own (on the GPU the
    events split the steps already)."""
    device = str(engine.runner.device)
    cuda = device.startswith("cuda")
    # The bench's own garbage is collected before the clock starts: torch.profiler's events of
    # the phase profiled before this one refer to each other (parent / children), so they wait
    # for a cyclic pass, and the first oldest-generation pass inside the timed steps paid for
    # them (H200, Llama-3-8B shape, freeze_gc on: 50 ms at most, 3.2 ms a mixed step at 64
    # requests). A pause that remains is the engine's own.
    gc.collect()
    clock = _GcClock()
    gc.callbacks.append(clock)  # (gc_ms: each step's share of the collector's time)
    events: list[Any] = []

    def mark() -> None:
        if cuda:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()

    try:
        sync(device)
        stamps = [time.perf_counter()]
        mark()
        for k in range(n):
            arrived = before is not None and before(k)  # (on the GPU too: only no drain)
            # (on the GPU the events already split the steps: no drain, which would stop a
            # step in flight from overlapping the next one's host work, as no server does)
            if arrived and not cuda:
                sync(device)
                stamps[-1] = time.perf_counter()
            was = clock.ms
            engine.step()
            stamps.append(time.perf_counter())
            mark()
            if gc_ms is not None:
                gc_ms.append(clock.ms - was)
        sync(device)
    finally:
        gc.callbacks.remove(clock)
    if cuda:
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]
    times = [b - a for a, b in itertools.pairwise(stamps)]
    times[-1] += time.perf_counter() - stamps[-1]
    return times
