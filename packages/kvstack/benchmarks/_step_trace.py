"""What a profile of engine steps says: GPU busy fraction, host time, syncs per step.

:func:`profile_steps` runs ``step`` ``n`` times under ``torch.profiler`` (CPU and CUDA
activities), each call inside a ``record_function`` range, exports the Chrome trace and reads it
back: kineto puts host and device events on one clock, so a step's window (its range on the
host) can be intersected with the device's kernel and copy intervals.

- ``gpu_busy_fraction``: the union of device intervals (kernels, copies, memsets) inside the
  steps' windows over the windows' total length.
- ``host_ms_per_step``: a step's wall time less the time the host spent blocked in a
  synchronizing CUDA runtime call (stream / device / event synchronize, blocking copies).
- ``syncs_per_step``: how many such calls a step makes.
- ``top_kernels``: the device kernels by total time over the profiled steps.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RANGE = "kvstack_bench_step"
#: Runtime calls that block the host until the device catches up.
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # (the synchronous copy; cudaMemcpyAsync to pageable memory also blocks)
)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """The figures of one exported trace (module docstring); times in ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    windows = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        # (kineto mirrors the range on the GPU's timeline as a gpu_user_annotation: skip it)
        if e.get("name") == RANGE and e.get("cat") == "user_annotation" and "dur" in e
    )
    if not windows:
        raise ValueError(f"the trace holds no {RANGE!r} ranges: was the step run inside one?")

    def inside(ts: float, end: float) -> list[tuple[float, float]]:
        out = []
        for a, b in windows:
            lo, hi = max(a, ts), min(b, end)
            if hi > lo:
                out.append((lo, hi))
        return out

    gpu: list[tuple[float, float]] = []
    kernels: Counter[str] = Counter()
    kernel_calls: Counter[str] = Counter()
    syncs: Counter[str] = Counter()
    sync_ms = 0.0
    for e in events:
        cat, ts, dur = e.get("cat", ""), e.get("ts", 0.0), e.get("dur", 0.0)
        if cat in GPU_CATS:
            gpu += inside(ts, ts + dur)
            if cat == "kernel":
                kernels[e["name"][:80]] += dur
                kernel_calls[e["name"][:80]] += 1
        elif cat == "cuda_runtime" and e.get("name") in SYNC_CALLS:
            if inside(ts, ts + dur):
                syncs[e["name"]] += 1
                sync_ms += sum(b - a for a, b in inside(ts, ts + dur)) / 1e3
        elif cat == "cuda_runtime" and e.get("name") == "cudaMemcpyAsync":
            args = e.get("args", {})
            # a device-to-host copy into pageable memory returns only once the data is there
            if inside(ts, ts + dur) and dur > 20 and "kind" not in args:
                syncs["cudaMemcpyAsync (> 20 us)"] += 1
                sync_ms += dur / 1e3
    n = len(windows)
    wall = sum(b - a for a, b in windows) / 1e3
    launches = sum(
        1
        for e in events
        if e.get("cat") == "cuda_runtime"
        and e.get("name")
        in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
        and inside(e["ts"], e["ts"] + e.get("dur", 0.0))
    )
    return {
        "profiled_steps": n,
        "wall_ms_per_step": wall / n,
        "gpu_busy_fraction": _union_ms(gpu) / wall if wall else 0.0,
        "host_ms_per_step": (wall - sync_ms) / n,
        "sync_ms_per_step": sync_ms / n,
        "syncs_per_step": sum(syncs.values()) / n,
        "syncs_by_call": {k: v / n for k, v in syncs.items()},
        "launches_per_step": launches / n,
        "top_kernels": [
            {"name": k, "ms_per_step": v / 1e3 / n, "calls_per_step": kernel_calls[k] / n}
            for k, v in kernels.most_common(12)
        ],
    }


def profile_steps(step: Callable[[], Any], n: int, device: str = "cuda") -> dict[str, Any]:
    """Run ``step`` ``n`` times under the profiler and :func:`summarize` the trace."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=acts) as prof:
        for _ in range(n):
            with record_function(RANGE):
                step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return summarize(json.loads(path.read_text()))


def host_hotspots(step: Callable[[], Any], n: int, top: int = 15) -> list[dict[str, Any]]:
    """Where a step's host time goes: ``n`` steps under ``cProfile``, the ``top`` functions by
    their own time (ms a step; cProfile's own overhead inflates every figure alike, so read them
    as shares). The device is drained after the steps, so a wait shows up as the sync call's."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "self_ms_per_step": tottime * 1e3 / n,
            "cum_ms_per_step": cumtime * 1e3 / n,
            "calls_per_step": calls / n,
        }
        for (file, line, name), (_cc, calls, tottime, cumtime, _callers) in rows
    ]
