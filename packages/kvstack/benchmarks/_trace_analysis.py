"""What a profile of engine steps says, read from the exported Chrome trace's event list (pure
functions: a test feeds them synthetic events; :mod:`_step_trace` takes the profiles).

Kineto puts host and device events on one clock. A step's *window* is its ``record_function``
range on the host; a device op (kernel, copy, memset) belongs to the step whose window holds the
runtime or driver call that launched it (``args.correlation`` ties the two; a graph replay's
kernels carry their ``cudaGraphLaunch``'s; Triton's and cuBLAS's launches are driver calls), so a
step left in flight is still charged its own kernels.

- ``gpu_busy_fraction`` (all steps): the union of device intervals inside the windows over the
  windows' length. With ``keep`` (some steps only, e.g. the mixed ones) the windows no longer
  tile the device's timeline, so it is 1 - idle / device time of the kept steps (below).
- device time of a step (``device_ms_per_step``): on the compute stream (the one with the most
  device time), from the end of whatever ran before its first op to the end of its last op.
- gaps (``gpu_gaps``): on the compute stream, in start order, the idle time before each of a
  step's ops since the latest end so far (an op nested in a longer one leaves no gap): ``small``
  below ``SMALL_GAP_US`` (launch boundaries inside a graph or an eager run), ``large`` at or
  above it (host stalls); ``between_steps`` the gaps whose op starts a step (its previous op
  belonged to another step or to none): the issue's "GPU idle between steps", of any size. The
  same idle time split by place: ``between_steps`` + ``stalls_in_step`` (large gaps inside a
  step: e.g. its input copies ran, then the device waited for the host to launch its graph) +
  ``launch_gaps_in_step`` (small gaps inside a step).
- syncs: runtime calls that make the host wait for the device: ``SYNC_CALLS`` and copies from
  or into pageable host memory (a ``cudaMemcpyAsync`` whose device copy names ``Pageable``; one
  whose device copy is not in the trace counts when it took over ``MEMCPY_SYNC_US``; a pinned
  or device-to-device copy never: it is asynchronous, however long the call took). ``syncs_per_step`` / ``syncs_by_call`` keep the earlier
  rule (``SYNC_CALLS`` plus copies over ``MEMCPY_SYNC_US``). A sync *blocked* when the call took
  over ``BLOCKED_US`` (a copy: over ``MEMCPY_SYNC_US``, its own transfer takes a few us); an
  event that has already completed returns at once and is no wait: ``blocking_syncs_per_step``
  is the figure to hold against the goal of one a step (the sampled tokens).
- ``syncs_by_site``: with a Python stack in the trace (``with_stack=True``: ``python_function``
  events), each sync's innermost frame in kvstack / ``kv_*`` code, the line it called out from
  and the innermost frame (``kvstack/engine/_async.py:88:resolve <- Tensor.tolist``). The line
  is the next frame's ``CallFrom``; where the call left our frame without one (an operator such
  as ``x * 2`` dispatches with no Python frame of its own) it is the function's first line.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

RANGE = "kvstack_bench_step"
#: Runtime calls that block the host until the device catches up.
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # (the synchronous copy; cudaMemcpyAsync to pageable memory also blocks)
)
#: Driver-API twins of ``SYNC_CALLS`` (the current rule counts them too).
DRIVER_SYNC_CALLS = ("cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Host API calls: the runtime's, and the driver's (Triton and cuBLAS launch kernels through
#: ``cuLaunchKernel(Ex)``, which kineto files under ``cuda_driver``).
API_CATS = ("cuda_runtime", "cuda_driver")
LAUNCHES = (
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
)  # fmt: skip
MEMCPY_SYNC_US = 20.0
BLOCKED_US = 5.0
SMALL_GAP_US = 10.0
#: A frame of our code: a path in a kvstack / kv_* package (the trace names files relative to
#: their sys.path entry, or in full), not a benchmark script.
OURS = re.compile(r"(?:^|/)((?:kvstack|kv_[a-z]+)/(?:[^/]+/)*[^/]+\.py)$")


class Op(NamedTuple):
    """A device op: start / end in us, its stream and the correlation id of its launch."""

    ts: float
    end: float
    stream: int
    corr: int | None
    cat: str
    name: str


class Sync(NamedTuple):
    name: str  # the runtime call ("cudaMemcpyAsync (DtoH pageable)" for a copy)
    ts: float
    dur: float
    tid: Any
    step: int  # its window's index
    blocked: bool


def complete_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def step_windows(events: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """The steps' host ranges, in time order (kineto mirrors a range on the GPU's timeline as a
    ``gpu_user_annotation``: only the host's count)."""
    return sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("name") == RANGE and e.get("cat") == "user_annotation" and "dur" in e
    )


def _window_of(starts: Sequence[float], windows: Sequence[tuple[float, float]], ts: float) -> int:
    """The index of the window holding time ``ts``, or -1."""
    i = bisect.bisect_right(starts, ts) - 1
    return i if i >= 0 and ts <= windows[i][1] else -1


def _union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def device_ops(events: Iterable[dict[str, Any]]) -> list[Op]:
    out = []
    for e in events:
        if e.get("cat") in GPU_CATS and "dur" in e:
            args = e.get("args", {})
            corr = args.get("correlation")
            out.append(
                Op(
                    float(e["ts"]),
                    float(e["ts"]) + float(e["dur"]),
                    int(args.get("stream", e.get("tid", 0)) or 0),
                    int(corr) if corr is not None else None,
                    e["cat"],
                    e.get("name", ""),
                )
            )
    return out


def launch_steps(
    events: Iterable[dict[str, Any]], windows: Sequence[tuple[float, float]]
) -> dict[int, int]:
    """correlation id -> the window (step index) of the runtime call that launched it."""
    starts = [a for a, _ in windows]
    out = {}
    for e in events:
        if e.get("cat") not in API_CATS:
            continue
        corr = e.get("args", {}).get("correlation")
        if corr is None:
            continue
        w = _window_of(starts, windows, e["ts"])
        if w >= 0:
            out[int(corr)] = w
    return out


def compute_stream(ops: Iterable[Op]) -> int | None:
    busy: dict[int, float] = defaultdict(float)
    for o in ops:
        busy[o.stream] += o.end - o.ts
    return max(busy, key=lambda k: busy[k]) if busy else None


class Gaps(NamedTuple):
    """Idle time (us) on one stream before the ops of the kept steps (module docstring)."""

    steps: int  # kept steps with an op on the stream
    device_us: float  # their device time: sum of (last end - the end before their first op)
    ops: int
    small_us: float
    small_count: int
    large_us: float
    large_count: int
    between_us: float  # gaps before an op that starts a step (any size)
    between_count: int
    stall_us: float  # large gaps inside a step
    stall_count: int
    #: (the op that ended last before the stall, the op after it) -> [us, count]: where the
    #: stalls are (a kernel's name, or a copy's)
    stall_sites: dict[tuple[str, str], list[float]]
    #: every stall: (us, the op that ended last before it, the op after it)
    stalls: list[tuple[float, Op, Op]]


def gap_split(
    ops: Iterable[Op], step_of: dict[int, int], keep: set[int] | None = None,
    small_us: float = SMALL_GAP_US,
) -> Gaps:  # fmt: skip
    """Gaps before each op of a kept step (``keep=None``: every step with an op) on one stream's
    ``ops`` (any order: sorted here by start; an op's gap runs from the latest end so far, not
    from its predecessor's end, so an op nested in a longer one hides no idle time)."""
    seq = sorted(ops, key=lambda o: (o.ts, o.end))
    end: float | None = None
    end_step: int | None = None  # the step of the op that reached ``end``
    end_name = ""  # ... and its name
    sites: dict[tuple[str, str], list[float]] = {}
    stalls: list[tuple[float, Op, Op]] = []
    end_op: Op | None = None
    start_ref: dict[int, float] = {}  # a kept step's device time starts here ...
    last_end: dict[int, float] = {}  # ... and ends here
    n_ops = small_n = large_n = between_n = stall_n = 0
    small = large = between = stall = 0.0
    for o in seq:
        s = step_of.get(o.corr) if o.corr is not None else None
        kept = s is not None and (keep is None or s in keep)
        if kept:
            assert s is not None
            n_ops += 1
            if s not in start_ref:
                start_ref[s] = o.ts if end is None else min(end, o.ts)
            last_end[s] = max(last_end.get(s, o.end), o.end)
            gap = o.ts - end if end is not None else 0.0
            if gap > 0:
                if gap < small_us:
                    small, small_n = small + gap, small_n + 1
                else:
                    large, large_n = large + gap, large_n + 1
                if end_step != s:
                    between, between_n = between + gap, between_n + 1
                elif gap >= small_us:
                    stall, stall_n = stall + gap, stall_n + 1
                    site = sites.setdefault((end_name[:60], o.name[:60]), [0.0, 0])
                    site[0] += gap
                    site[1] += 1
                    assert end_op is not None
                    stalls.append((gap, end_op, o))
        if end is None or o.end > end:
            end, end_step, end_name, end_op = o.end, s, o.name, o
    device = sum(last_end[s] - start_ref[s] for s in last_end)
    return Gaps(
        len(last_end), device, n_ops, small, small_n, large, large_n, between, between_n, stall,
        stall_n, sites, stalls,
    )  # fmt: skip


#: Host events that say what the host was doing (kineto's categories): aten ops, our ranges,
#: Python frames (with a stack), runtime and driver calls.
HOST_CATS = ("cpu_op", "user_annotation", "python_function", *API_CATS)


def stall_hosts(
    events: Sequence[dict[str, Any]], stalls: Sequence[tuple[float, Op, Op]], top: int = 4
) -> list[dict[str, Any]]:
    """What the host did around the ``top`` longest stalls: ``late_us``, when the host launched
    the op after the stall against when the op before it ended (> 0: the host was late, the
    stall is the host's; <= 0: the op was queued in time and the device waited on something
    else), ``between_launches_us``, the host time from the end of the op-before's launch call to
    the op-after's, and the longest host events of the launching thread wholly inside that
    interval (outermost first, names cut at 60 characters). An op whose launch is not in the
    trace has ``late_us`` ``None``."""
    launch: dict[int, dict[str, Any]] = {}
    for e in events:
        corr = e.get("args", {}).get("correlation")
        if e.get("cat") in API_CATS and corr is not None:
            launch[int(corr)] = e
    host = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("tid"), e)
        for e in events
        if e.get("cat") in HOST_CATS
    )
    out = []
    for gap, a, b in sorted(stalls, key=lambda st: -st[0])[:top]:
        la = launch.get(a.corr) if a.corr is not None else None
        lb = launch.get(b.corr) if b.corr is not None else None
        rec: dict[str, Any] = {
            "stall_us": gap, "after": a.name[:60], "before": b.name[:60], "late_us": None,
            "between_launches_us": None, "launched_by": None, "host_between": [],
        }  # fmt: skip
        if lb is not None:
            rec["late_us"] = float(lb["ts"]) - a.end
            rec["launched_by"] = lb.get("name")
        if la is not None and lb is not None:
            lo, hi = float(la["ts"]) + float(la.get("dur", 0.0)), float(lb["ts"])
            rec["between_launches_us"] = hi - lo
            inside = [h for h in host if h[2] == lb.get("tid") and lo <= h[0] and h[1] <= hi]
            outer, reach = [], float("-inf")
            for h in inside:  # sorted by start: drop the events nested in an earlier one
                if h[0] >= reach:
                    outer.append(h)
                    reach = h[1]
            outer.sort(key=lambda h: h[0] - h[1])
            rec["host_between"] = [
                {"name": str(h[3].get("name", ""))[:60], "us": h[1] - h[0]} for h in outer[:5]
            ]
            # the events inside that hold at least half the interval, outermost first: with
            # Python stacks, the chain of frames the host was in while the device waited
            rec["host_chain"] = [
                {"name": str(h[3].get("name", ""))[:90], "us": h[1] - h[0]}
                for h in sorted(inside, key=lambda h: h[0] - h[1])
                if h[1] - h[0] >= 0.5 * (hi - lo)
            ][:8]
        out.append(rec)
    return out


def gaps_record(g: Gaps, n: int, stream: int | None) -> dict[str, Any]:
    """``gap_split``'s figures as ms a step (``n`` steps) and fractions of the device time
    (``None`` without device ops: a CPU run)."""

    def frac(us: float) -> float | None:
        return us / g.device_us if g.device_us else None

    launch = g.small_us + g.large_us - g.between_us - g.stall_us  # small gaps inside a step

    out: dict[str, Any] = {
        "stream": stream,
        "small_gap_us": SMALL_GAP_US,
        "device_ms_per_step": g.device_us / 1e3 / n,
        "ops_per_step": g.ops / n,
    }
    for place, us, count in (
        ("small", g.small_us, g.small_count),
        ("large", g.large_us, g.large_count),
        ("between_steps", g.between_us, g.between_count),
        ("stalls_in_step", g.stall_us, g.stall_count),
    ):
        out[f"{place}_ms_per_step"] = us / 1e3 / n
        out[f"{place}_per_step"] = count / n
        out[f"{place}_fraction"] = frac(us)
    top = sorted(g.stall_sites.items(), key=lambda kv: -kv[1][0])[:4]
    out["stalls_by_neighbours"] = [
        {"after": a, "before": b, "ms_per_step": us / 1e3 / n, "per_step": count / n}
        for (a, b), (us, count) in top
    ]
    out["launch_gaps_in_step_ms_per_step"] = launch / 1e3 / n
    out["launch_gaps_in_step_fraction"] = frac(launch)
    out["idle_fraction"] = frac(g.small_us + g.large_us)
    return out


def classify_syncs(
    events: Sequence[dict[str, Any]], windows: Sequence[tuple[float, float]]
) -> tuple[list[Sync], list[Sync]]:
    """(syncs by the earlier rule, syncs by the current rule) among the runtime calls that start
    inside a window (module docstring)."""
    copies = {
        int(e["args"]["correlation"]): e.get("name", "")
        for e in events
        if e.get("cat") == "gpu_memcpy" and "correlation" in e.get("args", {})
    }
    starts = [a for a, _ in windows]
    old, new = [], []
    for e in events:
        if e.get("cat") not in API_CATS:
            continue
        name, ts, dur = e.get("name", ""), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        w = _window_of(starts, windows, ts)
        if w < 0:
            continue
        if name in SYNC_CALLS or name in DRIVER_SYNC_CALLS:
            s = Sync(name, ts, dur, e.get("tid"), w, dur > BLOCKED_US)
            new.append(s)
            if name in SYNC_CALLS:
                old.append(s)
        elif name == "cudaMemcpyAsync":
            args = e.get("args", {})
            copy = copies.get(int(args["correlation"]), "") if "correlation" in args else ""
            pageable = "Pageable" in copy
            long = dur > MEMCPY_SYNC_US
            if long and "kind" not in args:
                old.append(Sync(f"{name} (> 20 us)", ts, dur, e.get("tid"), w, True))
            # A copy whose device side is known and touches no pageable memory (pinned host
            # <-> device, device <-> device) is asynchronous: however long the call, it waited
            # for no kernel. Unknown: the duration decides, as before.
            if pageable or (long and not copy):
                side = "DtoH" if "DtoH" in copy else "HtoD"
                label = f"{name} ({side} pageable)" if pageable else f"{name} (> 20 us)"
                new.append(Sync(label, ts, dur, e.get("tid"), w, long))
    return old, new


_BUILTIN = re.compile(r"<built-in (?:method|function) (\w+)(?: of (?:\w+\.)*(\w+) object)?")
_FRAME = re.compile(r"^(.*)\((\d+)\): (.*)$")


def _leaf(name: str) -> str:
    m = _BUILTIN.match(name)
    if m:
        return f"{m.group(2)}.{m.group(1)}" if m.group(2) else m.group(1)
    m = _FRAME.match(name)
    return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(3)}" if m else name[:60]


class _Stacks:
    """The Python frames of a trace (``python_function`` events), per thread, by start."""

    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        self.by_id: dict[Any, dict[str, Any]] = {}
        for e in events:
            if e.get("cat") == "python_function" and "dur" in e:
                by_tid[e.get("tid")].append(e)
                pid = e.get("args", {}).get("Python id")
                if pid is not None:
                    self.by_id[pid] = e
        self.frames = {t: sorted(v, key=lambda e: e["ts"]) for t, v in by_tid.items()}
        self.starts = {t: [e["ts"] for e in v] for t, v in self.frames.items()}

    def innermost(self, tid: Any, ts: float, end: float) -> dict[str, Any] | None:
        """The frame of thread ``tid`` that holds [ts, end] and started last (frames nest, so
        the first holder found walking back from ``ts`` is the innermost)."""
        frames = self.frames.get(tid)
        if not frames:
            return None
        for i in range(bisect.bisect_right(self.starts[tid], ts) - 1, -1, -1):
            f = frames[i]
            if f["ts"] + f["dur"] >= end:
                return f
        return None

    def site(self, tid: Any, ts: float, end: float) -> str:
        """``path:line:function <- leaf``: the innermost frame of ours above the call, the line
        it called out from (the next frame's ``CallFrom``) and the innermost frame's name."""
        f = self.innermost(tid, ts, end)
        if f is None:
            return "? (no Python frame)"
        leaf = _leaf(f["name"])
        child: dict[str, Any] | None = None
        while f is not None:
            m = _FRAME.match(f["name"])
            ours = OURS.search(m.group(1)) if m else None
            if m and ours and "/benchmarks/" not in m.group(1):
                line = m.group(2)
                call = (child or {}).get("args", {}).get("CallFrom", "")
                if call.rpartition(":")[0].endswith(ours.group(1)):
                    line = call.rpartition(":")[2]
                at = f"{ours.group(1)}:{line}:{m.group(3)}"
                return at if child is None else f"{at} <- {leaf}"
            parent = f.get("args", {}).get("Python parent id")
            child, f = f, self.by_id.get(parent) if parent is not None else None
        return f"? (outside kvstack) <- {leaf}"


def by_site(events: Sequence[dict[str, Any]], syncs: Iterable[Sync], n: int) -> dict[str, Any]:
    """{site: {per_step, blocking_per_step, ms_per_step, calls}} over ``n`` steps, the sites
    with the most time first."""
    stacks = _Stacks(events)
    rows: dict[str, dict[str, Any]] = {}
    for s in syncs:
        site = stacks.site(s.tid, s.ts, s.ts + s.dur)
        r = rows.setdefault(
            site, {"per_step": 0.0, "blocking_per_step": 0.0, "ms_per_step": 0.0, "calls": []}
        )
        r["per_step"] += 1 / n
        r["blocking_per_step"] += s.blocked / n
        r["ms_per_step"] += s.dur / 1e3 / n
        if s.name not in r["calls"]:
            r["calls"].append(s.name)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms_per_step"]))


def _by_call(syncs: Iterable[Sync], n: int) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    for s in syncs:
        r = rows.setdefault(s.name, {"per_step": 0.0, "blocking_per_step": 0.0, "ms_per_step": 0.0})
        r["per_step"] += 1 / n
        r["blocking_per_step"] += s.blocked / n
        r["ms_per_step"] += s.dur / 1e3 / n
    return rows


def _top(ops: Iterable[Op], n: int, top: int = 12) -> list[dict[str, Any]]:
    total: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    for o in ops:
        if o.cat == "kernel":
            total[o.name[:80]] += o.end - o.ts
            calls[o.name[:80]] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return [
        {"name": k, "ms_per_step": v / 1e3 / n, "calls_per_step": calls[k] / n} for k, v in ranked
    ]


def summarize(
    trace: dict[str, Any], labels: Sequence[str] | None = None, keep: str | None = None
) -> dict[str, Any]:
    """The figures of one exported trace (module docstring); times in ms, counts a step.
    ``labels``: one a step, in order; ``keep``: only the steps of that label count."""
    events = complete_events(trace)
    windows = step_windows(events)
    if not windows:
        raise ValueError(f"the trace holds no {RANGE!r} ranges: was the step run inside one?")
    if labels is not None and len(labels) != len(windows):
        raise ValueError(f"{len(labels)} labels for {len(windows)} profiled steps")
    kept = set(range(len(windows)))
    if keep is not None:
        assert labels is not None, "keep= needs labels="
        kept = {i for i, lab in enumerate(labels) if lab == keep}
        if not kept:
            raise ValueError(
                f"no profiled step is labelled {keep!r} (labels: {sorted(set(labels))})"
            )
    win = [w for i, w in enumerate(windows) if i in kept]
    starts = [a for a, _ in windows]
    n = len(win)
    wall = sum(b - a for a, b in win) / 1e3

    def overlap(ts: float, end: float) -> list[tuple[float, float]]:
        out = []
        for a, b in win:
            lo, hi = max(a, ts), min(b, end)
            if hi > lo:
                out.append((lo, hi))
        return out

    ops = device_ops(events)
    step_of = launch_steps(events, windows)
    mine = [o for o in ops if o.corr is not None and step_of.get(o.corr, -1) in kept]
    stream = compute_stream(mine)
    gaps = gap_split([o for o in ops if o.stream == stream], step_of, kept)
    old, new = classify_syncs(events, windows)
    old = [s for s in old if s.step in kept]
    new = [s for s in new if s.step in kept]
    sync_ms = sum(sum(b - a for a, b in overlap(s.ts, s.ts + s.dur)) for s in old) / 1e3
    launches = sum(
        1
        for e in events
        if e.get("cat") in API_CATS
        and e.get("name") in LAUNCHES
        and _window_of(starts, windows, e["ts"]) in kept
    )
    if keep is None:  # every step: the windows tile the timeline (the earlier figures)
        busy = _union_ms(x for o in ops for x in overlap(o.ts, o.end)) / wall if wall else 0.0
        top = _top(ops, n)
    else:  # some steps: their own ops, by correlation
        idle = gaps.small_us + gaps.large_us
        busy = 1 - idle / gaps.device_us if gaps.device_us else 0.0
        top = _top(mine, n)
    return {
        "profiled_steps": n,
        "profiled_labels": dict(Counter(labels)) if labels is not None else None,
        "kept_label": keep,
        "wall_ms_per_step": wall / n,
        "gpu_busy_fraction": busy,
        "host_ms_per_step": (wall - sync_ms) / n,
        "sync_ms_per_step": sync_ms / n,
        "syncs_per_step": len(old) / n,
        "syncs_by_call": {k: v / n for k, v in Counter(s.name for s in old).items()},
        "sync_calls_per_step": len(new) / n,
        "blocking_syncs_per_step": sum(s.blocked for s in new) / n,
        "syncs_detail": _by_call(new, n),
        "sync_thresholds_us": {"blocked": BLOCKED_US, "memcpy": MEMCPY_SYNC_US},
        "launches_per_step": launches / n,
        "kernels_per_step": sum(o.cat == "kernel" for o in mine) / n,
        # device ops inside the windows' span that no window's call launched (a large figure
        # means the correlation ids did not tie launches to ops: read the window figures then)
        "unattributed_ops_per_step": sum(
            o.corr not in step_of and windows[0][0] <= o.ts <= windows[-1][1] for o in ops
        )
        / n,
        "device_ms_per_step": gaps.device_us / 1e3 / n,
        "gpu_gaps": gaps_record(gaps, n, stream),
        "stall_hosts": stall_hosts(events, gaps.stalls),
        "top_kernels": top,
    }


def sites(trace: dict[str, Any], labels: Sequence[str] | None = None,
          keep: str | None = None) -> dict[str, Any]:  # fmt: skip
    """``syncs_by_site`` of a trace taken with Python stacks (the current sync rule)."""
    events = complete_events(trace)
    windows = step_windows(events)
    if labels is not None and len(labels) != len(windows):
        raise ValueError(f"{len(labels)} labels for {len(windows)} profiled steps")
    kept = {i for i in range(len(windows)) if keep is None or (labels and labels[i] == keep)}
    _, new = classify_syncs(events, windows)
    new = [s for s in new if s.step in kept]
    n = max(len(kept), 1)
    ops = device_ops(events)
    step_of = launch_steps(events, windows)
    stream = compute_stream(o for o in ops if o.corr is not None and step_of.get(o.corr) in kept)
    gaps = gap_split([o for o in ops if o.stream == stream], step_of, kept)
    return {
        # the longest stalls again, with the Python frames the host was in (host_chain)
        "stall_frames": stall_hosts(events, gaps.stalls),
        "syncs_by_site": by_site(events, new, n),
        "syncs_by_site_steps": len(kept),
        "stack_profile_blocking_syncs_per_step": sum(s.blocked for s in new) / n,
    }
