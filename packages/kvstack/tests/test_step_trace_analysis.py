"""``benchmarks/_trace_analysis.py`` (issue 32's profile figures) on synthetic Chrome-trace events:
the GPU's idle split into launch gaps and gaps between steps, the steps' own kernels by
correlation, syncs that blocked versus returned at once, and the Python site of each sync.

The planted traps: ops handed over out of time order, an op nested in a longer one (the next
gap runs from the longer one's end), gaps of 9 and 10.5 us either side of the 10 us threshold, a
step boundary whose gap is filled by another stream, and a Python frame of another thread that
holds a sync call's time."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_trace_analysis", BENCH / "_trace_analysis.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ta = _load()


def window(ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": ta.RANGE, "ts": ts, "dur": dur, "tid": 1}


def runtime(name: str, ts: float, dur: float, corr: int, tid: int = 1,
            cat: str = "cuda_runtime") -> dict[str, Any]:  # fmt: skip
    args = {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": args}  # fmt: skip


def op(name: str, ts: float, end: float, corr: int, stream: int = 7,
       cat: str = "kernel") -> dict[str, Any]:  # fmt: skip
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": end - ts, "tid": stream,
            "args": {"stream": stream, "correlation": corr}}  # fmt: skip


def two_steps() -> list[dict[str, Any]]:
    """Step 0's host window [0, 1000] launches corr 1-3, step 1's [1000, 2000] corr 4-7 (5 by
    a driver call); their device ops run on stream 7, and a copy on stream 9 spans the boundary
    between them."""
    launches = [runtime("cudaLaunchKernel", 10.0 * c, 2, c) for c in (1, 2, 3)]
    launches += [runtime("cudaLaunchKernel", 1000 + 10.0 * c, 2, c) for c in (4, 6, 7)]
    # Triton and cuBLAS launch through the driver API (kineto's cuda_driver category)
    launches.append(runtime("cuLaunchKernelEx", 1050, 2, 5, cat="cuda_driver"))
    ops = [
        op("f", 703, 710, 6),  # gap 3 after e: small, inside step 1
        op("e", 610.5, 700, 5),  # gap 10.5 after d: large (>= 10 us), inside step 1
        op("d", 530, 600, 4),  # gap 30 after c: step 1 starts here (between steps)
        op("c", 409, 500, 3),  # gap 9 after a's end (400), not b's (200): small
        op("b", 150, 200, 2, cat="gpu_memcpy"),  # nested in a
        op("a", 100, 400, 1),  # the first op: no gap before it
        op("g", 400, 530, 7, stream=9, cat="gpu_memcpy"),  # fills c..d on another stream
    ]
    return [window(0, 1000), window(1000, 1000), *launches, *ops]


def test_gap_split_orders_ops_and_splits_at_the_threshold() -> None:
    events = two_steps()
    windows = ta.step_windows(events)
    step_of = ta.launch_steps(events, windows)
    assert step_of == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    ops = ta.device_ops(events)
    assert ta.compute_stream(ops) == 7
    stream7 = [o for o in ops if o.stream == 7]
    g = ta.gap_split(stream7, step_of)
    assert g.small_us == pytest.approx(9 + 3) and g.small_count == 2
    assert g.large_us == pytest.approx(30 + 10.5) and g.large_count == 2
    assert g.between_us == pytest.approx(30) and g.between_count == 1
    assert g.stall_us == pytest.approx(10.5) and g.stall_count == 1  # e's, inside step 1
    assert g.stall_sites == {("d", "e"): [pytest.approx(10.5), 1]}  # d ended last before e
    rec = ta.gaps_record(g, 2, 7)
    assert rec["stalls_by_neighbours"] == [
        {"after": "d", "before": "e", "ms_per_step": pytest.approx(10.5e-3 / 2), "per_step": 0.5}
    ]
    # step 0: from its first op (100) to its last end (500); step 1: from 500 to 710
    assert g.device_us == pytest.approx(400 + 210) and g.steps == 2 and g.ops == 6
    # the same ops in time order but the gap taken from the predecessor's end would call c's
    # gap 209 us (large) and hide that step 0 ran back to back
    naive = [b.ts - a.end for a, b in zip(sorted(stream7), sorted(stream7)[1:], strict=False)]
    assert max(naive) == pytest.approx(209)
    # only step 1: the gap before its first op is still charged to it
    g1 = ta.gap_split(stream7, step_of, keep={1})
    assert (g1.small_us, g1.large_us, g1.between_us) == pytest.approx((3, 40.5, 30))
    assert g1.device_us == pytest.approx(210) and g1.ops == 3
    # every stream together: g hides the boundary (the gap the issue asks about)
    assert ta.gap_split(ops, step_of).between_us == 0


def test_summarize_keeps_the_labelled_steps_own_kernels() -> None:
    trace = {"traceEvents": two_steps()}
    every = ta.summarize(trace)
    assert every["profiled_steps"] == 2 and every["kernels_per_step"] == pytest.approx(2.5)
    gaps = every["gpu_gaps"]
    assert gaps["stream"] == 7
    assert gaps["between_steps_ms_per_step"] == pytest.approx(0.030 / 2)
    assert gaps["small_fraction"] == pytest.approx(12 / 610)
    assert gaps["large_fraction"] == pytest.approx(40.5 / 610)
    # by place: 30 between the steps, 10.5 stalled inside step 1, 9 + 3 of launch gaps
    assert gaps["stalls_in_step_fraction"] == pytest.approx(10.5 / 610)
    assert gaps["launch_gaps_in_step_ms_per_step"] == pytest.approx(0.012 / 2)
    mixed = ta.summarize(trace, labels=["decode", "mixed"], keep="mixed")
    assert mixed["profiled_steps"] == 1 and mixed["profiled_labels"] == {"decode": 1, "mixed": 1}
    assert [k["name"] for k in mixed["top_kernels"]] == ["e", "d", "f"]  # by time; not a, c
    assert mixed["device_ms_per_step"] == pytest.approx(0.210)
    assert mixed["gpu_busy_fraction"] == pytest.approx(1 - 43.5 / 210)
    assert mixed["kernels_per_step"] == 3 and mixed["launches_per_step"] == 4
    with pytest.raises(ValueError, match="no profiled step is labelled 'prefill'"):
        ta.summarize(trace, labels=["decode", "mixed"], keep="prefill")
    with pytest.raises(ValueError, match="1 labels for 2 profiled steps"):
        ta.summarize(trace, labels=["mixed"], keep="mixed")


def frame(name: str, ts: float, dur: float, pid: int, parent: int | None = None,
          call_from: str = "", tid: int = 1) -> dict[str, Any]:  # fmt: skip
    args: dict[str, Any] = {"Python id": pid, "CallFrom": call_from}
    if parent is not None:
        args["Python parent id"] = parent
    return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": args}  # fmt: skip


def sync_step() -> list[dict[str, Any]]:
    """One step whose host calls, under Python frames: a blocking copy to pageable memory and a
    stream sync that returns at once (tolist, in the engine's resolve), an event sync that waits
    (under torch's own Python frame), a host-to-device copy (no sync) and a short pageable
    device-to-host copy straight from the step."""
    return [
        window(0, 1000),
        frame("kvstack/engine/engine.py(368): step", 10, 900, 1),
        frame(
            "kvstack/engine/_async.py(80): resolve", 20, 500, 2, 1, "kvstack/engine/engine.py:445"
        ),
        frame(
            "<built-in method tolist of Tensor object at 0x7f00>",
            30,
            300,
            3,
            2,
            "kvstack/engine/_async.py:88",
        ),
        frame(
            "torch/cuda/streams.py(200): synchronize",
            600,
            100,
            4,
            1,
            "kvstack/engine/engine.py:450",
        ),
        # another thread's frame over the copy's time: not the copy's caller
        frame("kvstack/engine/_staging.py(5): worker", 35, 400, 9, tid=2),
        runtime("cudaMemcpyAsync", 40, 250, 100),
        op("Memcpy DtoH (Device -> Pageable)", 280, 285, 100, cat="gpu_memcpy"),
        runtime("cudaStreamSynchronize", 300, 3, 101),
        runtime("cudaEventSynchronize", 610, 50, 102),
        runtime("cudaMemcpyAsync", 700, 8, 103),
        op("Memcpy HtoD (Pinned -> Device)", 705, 706, 103, cat="gpu_memcpy"),
        runtime("cudaMemcpyAsync", 720, 12, 104),
        op("Memcpy DtoH (Device -> Pageable)", 725, 726, 104, cat="gpu_memcpy"),
        # a pinned copy whose call took long (the driver's queue, a profiler): asynchronous, no
        # sync by the current rule, a sync by the earlier rule's duration alone
        runtime("cudaMemcpyAsync", 740, 30, 105),
        op("Memcpy HtoD (Pinned -> Device)", 775, 776, 105, cat="gpu_memcpy"),
    ]


def test_syncs_blocked_or_not_and_their_sites() -> None:
    trace = {"traceEvents": sync_step()}
    s = ta.summarize(trace)
    # the earlier rule: sync calls + copies over 20 us
    assert s["syncs_per_step"] == 4
    assert s["syncs_by_call"] == {
        "cudaMemcpyAsync (> 20 us)": 2, "cudaStreamSynchronize": 1, "cudaEventSynchronize": 1,
    }  # fmt: skip
    # the current rule adds the short pageable copy; 2 of the 4 waited
    assert s["sync_calls_per_step"] == 4 and s["blocking_syncs_per_step"] == 2
    assert s["syncs_detail"]["cudaStreamSynchronize"]["blocking_per_step"] == 0
    assert s["syncs_detail"]["cudaMemcpyAsync (DtoH pageable)"] == pytest.approx(
        {"per_step": 2, "blocking_per_step": 1, "ms_per_step": 0.262}
    )
    sites = ta.sites(trace)["syncs_by_site"]
    assert list(sites) == [  # by time
        "kvstack/engine/_async.py:88:resolve <- Tensor.tolist",
        "kvstack/engine/engine.py:450:step <- streams.py:synchronize",
        "kvstack/engine/engine.py:368:step",  # called from the step itself: its def line
    ]
    tolist = sites["kvstack/engine/_async.py:88:resolve <- Tensor.tolist"]
    assert (tolist["per_step"], tolist["blocking_per_step"]) == (2, 1)
    assert tolist["calls"] == ["cudaMemcpyAsync (DtoH pageable)", "cudaStreamSynchronize"]
    assert sites["kvstack/engine/engine.py:368:step"]["blocking_per_step"] == 0


def test_a_step_without_device_ops_reports_no_fractions() -> None:
    """The CPU smoke run: windows and host time, no device figures (``None``, not NaN)."""
    s = ta.summarize({"traceEvents": [window(0, 500), window(600, 500)]})
    assert s["host_ms_per_step"] == pytest.approx(0.5) and s["gpu_busy_fraction"] == 0
    assert s["gpu_gaps"]["between_steps_fraction"] is None and s["kernels_per_step"] == 0
    assert ta.sites({"traceEvents": [window(0, 500)]})["syncs_by_site"] == {}


def test_a_pageable_host_to_device_copy_is_a_sync_a_pinned_one_never() -> None:
    """CUDA serializes a copy from pageable memory with the stream (the host waits for the
    kernels queued before it); a pinned one is asynchronous however long its call took."""
    events = [
        window(0, 1000),
        runtime("cudaMemcpyAsync", 10, 40, 200),
        op("Memcpy HtoD (Pageable -> Device)", 45, 46, 200, cat="gpu_memcpy"),
        runtime("cudaMemcpyAsync", 100, 40, 201),
        op("Memcpy HtoD (Pinned -> Device)", 145, 146, 201, cat="gpu_memcpy"),
        runtime("cudaMemcpyAsync", 200, 40, 202),
        op("Memcpy DtoD (Device -> Device)", 245, 246, 202, cat="gpu_memcpy"),
    ]
    s = ta.summarize({"traceEvents": events})
    assert s["sync_calls_per_step"] == 1 and s["blocking_syncs_per_step"] == 1
    assert list(s["syncs_detail"]) == ["cudaMemcpyAsync (HtoD pageable)"]


def test_stall_hosts_says_whether_the_host_was_late_and_what_it_ran() -> None:
    """A stall after op d (ends 600) before op e (starts 610.5): e's launch at 1050 is long after
    d ended, so the host was late (450 us); between d's launch (ends 1042) and e's the host ran
    one aten op holding a nested one, and an op on another thread. Planted: the same stall with
    e launched before d ended reads as in time (a device-side wait), not the host's."""
    events = two_steps()
    events += [
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 1043, "dur": 5, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 1044, "dur": 2, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1045, "dur": 3, "tid": 2},
    ]
    windows = ta.step_windows(events)
    ops = [o for o in ta.device_ops(events) if o.stream == 7]
    g = ta.gap_split(ops, ta.launch_steps(events, windows))
    assert [(gap, a.name, b.name) for gap, a, b in g.stalls] == [(pytest.approx(10.5), "d", "e")]
    (rec,) = ta.stall_hosts(events, g.stalls)
    assert rec["late_us"] == pytest.approx(1050 - 600)
    assert rec["launched_by"] == "cuLaunchKernelEx"
    assert rec["between_launches_us"] == pytest.approx(1050 - 1042)
    assert rec["host_between"] == [{"name": "aten::copy_", "us": pytest.approx(5)}]
    early = [
        dict(e, ts=590.0) if e.get("cat") == "cuda_driver" and e["args"]["correlation"] == 5
        else e
        for e in events
    ]  # fmt: skip
    (rec,) = ta.stall_hosts(early, g.stalls)
    assert rec["late_us"] == pytest.approx(-10)
    assert ta.summarize({"traceEvents": events})["stall_hosts"][0]["late_us"] == pytest.approx(450)


def test_a_stall_names_the_python_frames_the_host_was_in() -> None:
    """With Python stacks, the stall before op e (its launch 8 us after d's) says which frames
    held at least half of those 8 us, outermost first: a frame of 7 us and one nested in it of 5,
    not one of 1 us nor the 5 us frame of another thread. ``sites`` (the stack profile) reports
    the same stall with its chain."""

    def frame(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur,
                "tid": tid}  # fmt: skip

    events = [
        *two_steps(),
        frame("kvstack/engine/runner.py(10): outer", 1042.5, 7),
        frame("kv_kernels/_fast.py(3): inner", 1043, 5),
        frame("kv_kernels/_fast.py(9): tiny", 1048.5, 1),
        frame("other.py(1): elsewhere", 1043, 5, tid=2),
    ]
    windows = ta.step_windows(events)
    ops = [o for o in ta.device_ops(events) if o.stream == 7]
    g = ta.gap_split(ops, ta.launch_steps(events, windows))
    (rec,) = ta.stall_hosts(events, g.stalls)
    assert rec["host_chain"] == [
        {"name": "kvstack/engine/runner.py(10): outer", "us": pytest.approx(7)},
        {"name": "kv_kernels/_fast.py(3): inner", "us": pytest.approx(5)},
    ]
    (via_sites,) = ta.sites({"traceEvents": events})["stall_frames"]
    assert via_sites["host_chain"] == rec["host_chain"]


def test_profiled_steps_name_their_garbage_collections(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection inside a profiled step is a ``gc gen<N>`` host range of the trace, so a
    stall between two launches that no torch op explains names it (``stall_hosts``' host
    events); outside the block, collections leave no range and no callback behind."""
    import gc
    import sys

    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    monkeypatch.delitem(sys.modules, "_trace_analysis", raising=False)
    import _step_trace

    callbacks = list(gc.callbacks)
    with profile(activities=[ProfilerActivity.CPU]) as prof, _step_trace._gc_ranges():
        gc.collect()
    gc.collect()
    assert gc.callbacks == callbacks
    names = [e.name for e in prof.events()]
    assert names.count("gc gen2") == 1
