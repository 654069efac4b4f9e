"""Profiles of engine steps: :func:`profile_steps` runs ``step`` ``n`` times under
``torch.profiler`` (CPU and CUDA activities), each call inside a ``record_function`` range,
exports the Chrome trace and reads it back with :mod:`_trace_analysis` (what the figures mean:
GPU busy fraction, host time, syncs a step and where they come from, the GPU's idle gaps, top
kernels); :func:`host_hotspots` says where a step's host time goes under ``cProfile``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _trace_analysis import GPU_CATS, RANGE, SYNC_CALLS, sites, summarize

#: The figures of every profiled step kept beside a ``keep=`` profile's.
ALL_STEPS_FIELDS = (
    "profiled_steps", "profiled_labels", "wall_ms_per_step", "gpu_busy_fraction",
    "host_ms_per_step", "syncs_per_step", "blocking_syncs_per_step", "kernels_per_step",
    "device_ms_per_step", "gpu_gaps",
)  # fmt: skip
__all__ = [
    "GPU_CATS", "RANGE", "SYNC_CALLS", "host_hotspots", "profile_steps", "summarize", "sync_sites",
]  # fmt: skip


def profile_steps(
    step: Callable[[], Any], n: int, device: str = "cuda", label: Callable[[], str] | None = None,
    keep: str | None = None, with_stack: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Run ``step`` ``n`` times under the profiler and :func:`summarize` the trace.

    ``label()``, called after each step, names it (e.g. ``"mixed"`` / ``"decode"``); ``keep``:
    only the steps of that label count. ``with_stack``: record Python stacks and return only
    ``syncs_by_site`` (:func:`_trace_analysis.sites`): the tracer slows the host down, so the
    other figures come from a profile without it."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    labels: list[str] | None = [] if label is not None else None
    with profile(activities=acts, with_stack=with_stack) as prof, _gc_ranges():
        for _ in range(n):
            with record_function(RANGE):
                step()
            if labels is not None and label is not None:
                labels.append(label())
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    if with_stack:
        try:
            return sites(trace, labels, keep)
        except Exception as e:  # the other figures do not need it: said in the record, run kept
            return {"syncs_by_site": None, "syncs_by_site_error": f"{type(e).__name__}: {e}"}
    if keep is not None and labels is not None and keep not in labels:
        # (a load that never reached its kind of step: the whole window's figures, said so)
        return {**summarize(trace, labels), "kept_error": f"no profiled step was {keep!r}"}
    out = summarize(trace, labels, keep)
    if keep is not None:  # beside the kept steps' figures, the whole window's
        every = summarize(trace, labels)
        out["all_steps_profile"] = {k: every[k] for k in ALL_STEPS_FIELDS}
    return out


@contextlib.contextmanager
def _gc_ranges() -> Iterator[None]:
    """Each garbage collection inside the block as a ``record_function`` range named
    ``gc gen<N>`` in the profile: a stall whose host time no torch op explains (the H200's
    mixed steps had 5-6 ms gaps between two launches with only ``aten::t`` in them) then names
    the collection, among the host events between the launches."""
    from torch.profiler import record_function

    open_: list[Any] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            rf = record_function(f"gc gen{info['generation']}")
            rf.__enter__()
            open_.append(rf)
        elif open_:
            open_.pop().__exit__(None, None, None)

    gc.callbacks.append(on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(on_gc)
        while open_:
            open_.pop().__exit__(None, None, None)


def sync_sites(
    step: Callable[[], Any], n: int, device: str, label: Callable[[], str] | None = None,
    keep: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """:func:`profile_steps` with Python stacks: ``syncs_by_site``."""
    return profile_steps(step, n, device, label, keep, with_stack=True)


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
