"""Host time of one call of each hot kernel (issue 32: a Triton launch <= 20 us of host time),
with the bound-launcher fast path (``kv_kernels._launch``; the call caches of
``kv_kernels._call_cache`` and, for attention, ``paged_attention._fast`` with its calls bound per
shape class, ``paged_attention._bound``) against the plain path (``kernel[grid]`` and the full
checks every call), in the same process, at Llama-3-8B's decode shape (32 q / 8 kv heads of 128, bf16, block
16, context 1024; hidden 4096, MLP 14336) for batches of 1, 64 and 256 tokens:

- ``paged_attention``: the public call with ``impl="triton"``, ``out=`` given (what
  kv-backends' ``bench_host.py`` times as the direct kernel call); batch 1 splits KV, so it is
  two launches (attention + merge);
- ``reshape_and_cache``, ``rms_norm`` (with the residual; ``rms_norm_inplace``: the engine's
  form, writing over ``x`` and the residual), ``silu_and_mul``,
  ``rotary_embedding``, ``rope_and_cache``: one launch each.

``host_us``: the best of 3 medians of ``perf_counter`` time of one call over ``--iters``
back-to-back calls (the device drained before; the GPU does not bound it: every call here takes
well under the host time on the device, except attention at batch 256, whose queue the host
never waits on).
``plain_us``: the same with ``KV_KERNELS_FAST_LAUNCH`` off and the call caches bypassed;
records with ``batch`` ``"new"`` (:func:`new_class_us`): each op's first call at a token count
not seen before, the median over :data:`NEW_CLASSES` (a mixed step's count is new each step);
``bound``: whether the fast calls went through a bound launcher. Writes ``DIR/launch.json``
(records with provenance) and prints one JSON line per record::

    export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd: -)
    python3 packages/kv-kernels/benchmarks/bench_launch.py --out /tmp/bench [--quick]

Without a GPU, ``--stub-cuda [--out DIR] [--baseline OLD/launch_stub.json]`` times the same calls
with fake-cuda tensors and no-op launchers (``kv_kernels.testing_launch``): two versions of the
host path compared on one CPU (run it once with the old sources on ``PYTHONPATH``, then with
``--baseline`` on the new), never a GPU host's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _provenance import provenance  # this folder's provenance helper
from kv_kernels import _call_cache, _launch, reshape_and_cache
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.fused import rms_norm, rope_and_cache, rotary_embedding, silu_and_mul
from kv_kernels.paged_attention import paged_attention
from kv_spec import KVCacheLayout, LayoutOrder

HQ, HKV, D, BLOCK, CONTEXT, HIDDEN, MLP = 32, 8, 128, 16, 1024, 4096, 14336


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _host_us(fn: Callable[[], Any], iters: int) -> float:
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    _sync()
    return statistics.median(times)


def _best_us(fn: Callable[[], Any], iters: int) -> float:
    """The best of 3 medians of :func:`_host_us`: a median of back-to-back calls still moves by
    several microseconds between runs on a shared host (another process's time slice, the
    clock's ramp), and the launch path's own cost is the floor under them."""
    return min(_host_us(fn, iters) for _ in range(3))


def _cases(batch: int, stub: bool = False) -> dict[str, Callable[[], Any]]:
    """The calls at ``batch``; ``stub``: CPU tensors seen as ``cuda:0`` (``_stub_cuda``)."""
    dev, bf = ("cpu" if stub else "cuda"), torch.bfloat16
    pages = CONTEXT // BLOCK
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=batch * pages + 1, num_kv_heads=HKV,
        block_size=BLOCK, head_size=D, head_size_v=D, dtype="bfloat16",
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, dev, zero=True), layout, 0)
    table = torch.randperm(batch * pages, device=dev).to(torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), CONTEXT, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    qkv = torch.randn(batch, (HQ + 2 * HKV) * D, dtype=bf, device=dev)
    q = qkv[:, : HQ * D].view(batch, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(batch, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(batch, HKV, D)
    q_dense = q.contiguous()
    out = torch.empty_like(q_dense)
    slots = torch.randperm(batch * pages * BLOCK, device=dev)[:batch]
    positions = torch.randint(0, 4096, (batch,), device=dev)
    cos_sin = torch.randn(4096, D, device=dev)
    x = torch.randn(batch, HIDDEN, dtype=bf, device=dev)
    res = torch.randn(batch, HIDDEN, dtype=bf, device=dev)
    w = torch.randn(HIDDEN, dtype=bf, device=dev)
    gate_up = torch.randn(batch, 2 * MLP, dtype=bf, device=dev)
    if stub:
        from kv_kernels.testing_launch import fake_cuda

        kv, table, seq_lens, qsl, q, k, v, q_dense, out, slots, positions, cos_sin = map(
            fake_cuda, (kv, table, seq_lens, qsl, q, k, v, q_dense, out, slots, positions, cos_sin)
        )
        x, res, w, gate_up = map(fake_cuda, (x, res, w, gate_up))
    return {
        "paged_attention": lambda: paged_attention(
            q_dense, kv, layout, table, seq_lens, qsl, 1, max_seq_len=CONTEXT, out=out
        ),
        "reshape_and_cache": lambda: reshape_and_cache(k, v, kv, slots, layout),
        "rms_norm": lambda: rms_norm(x, w, 1e-6, residual=res),
        # the engine's form (kvstack's fused RMSNorm): y over x, h over the residual, nothing
        # allocated; the overlap rules on out / residual_out run every call
        "rms_norm_inplace": lambda: rms_norm(x, w, 1e-6, residual=res, out=x, residual_out=res),
        "silu_and_mul": lambda: silu_and_mul(gate_up),
        "rotary_embedding": lambda: rotary_embedding(positions, q, k, cos_sin),
        "rope_and_cache": lambda: rope_and_cache(positions, q, k, v, cos_sin, kv, slots, layout),
    }


#: token counts a step may take one after another (a mixed step's decodes grow by one), each a
#: shape class not seen before; warmed first: one of each count's divisibility by 16 (Triton
#: specializes on it, so a first count of each may compile)
NEW_CLASSES = tuple(range(65, 73))
_WARM_CLASSES = (63, 80)


def new_class_us(stub: bool) -> dict[str, float]:
    """Host µs of each op's first call at a token count not seen before (median over
    :data:`NEW_CLASSES`): what a step with a new token count pays at its first layer, where the
    checks, the plan and the bound launch are made anew (the layers after it hit)."""
    times: dict[str, list[float]] = {}
    for batch in (*_WARM_CLASSES, *NEW_CLASSES):
        for op, fn in _cases(batch, stub=stub).items():
            _sync()
            t0 = time.perf_counter()
            fn()
            us = (time.perf_counter() - t0) * 1e6
            if batch in NEW_CLASSES:
                times.setdefault(op, []).append(us)
    return {op: statistics.median(v) for op, v in times.items()}


def _measure(op: str, fn: Callable[[], Any], iters: int) -> dict[str, Any]:
    launchers = _launch.reset_all()
    fn()
    fn()  # (the first binds)
    fast_us = _best_us(fn, iters)
    bound = sum(launcher.hits for launcher in launchers) > 0
    # plain: Triton's kernel[grid], the full checks and plan every call (the call caches off)
    _launch.ENABLED = _call_cache.ENABLED = False
    try:
        fn()
        plain_us = _best_us(fn, iters)
    finally:
        _launch.ENABLED = _call_cache.ENABLED = True
    return {"fast_us": fast_us, "plain_us": plain_us, "speedup": plain_us / fast_us, "bound": bound}


def write_md(path: str, data: dict[str, Any]) -> None:
    """The table of a ``launch.json`` (``data``) as markdown at ``path``."""
    lines = [
        "# Triton launch host cost (kv-kernels)",
        "",
        f"Written by `packages/kv-kernels/benchmarks/bench_launch.py` on {data['device']} (torch "
        f"{data['torch']}, triton {data['triton']}): µs of host time per call, the best of 3 "
        f"medians of {data['iters']} back-to-back calls. `fast`: the bound launcher (and, for "
        "paged_attention, the call cache), the api checks included; `plain`: `kernel[grid]` "
        "with every check. Goal: a launch <= 20 µs.",
        "",
        "| op | batch | fast µs | plain µs | speedup |",
        "|---|---|---|---|---|",
    ]
    for r in data["records"]:
        if r["batch"] != "new":
            lines.append(
                f"| {r['op']} | {r['batch']} | {r['fast_us']:.1f} | {r['plain_us']:.1f} | "
                f"{r['speedup']:.2f}x |"
            )
    fresh = [r for r in data["records"] if r["batch"] == "new"]
    if fresh:
        lines += [
            "",
            "The first call at a token count not seen before (the median over "
            f"{len(NEW_CLASSES)} counts, {NEW_CLASSES[0]}-{NEW_CLASSES[-1]}): what a step with a "
            "new token count, e.g. a mixed step, pays at its first layer.",
            "",
            "| op | µs |",
            "|---|---|",
            *(f"| {r['op']} | {r['value']:.1f} |" for r in fresh),
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for launch.json")
    ap.add_argument("--render", default=None, help="only write FILE.json's table as FILE.md")
    ap.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument(
        "--stub-cuda", action="store_true",
        help="no GPU: CPU tensors seen as cuda:0, launches stubbed (kv_kernels.testing_launch); "
        "fast path only; with --out, DIR/launch_stub.json and .md",
    )  # fmt: skip
    ap.add_argument("--baseline", default=None, help="--stub-cuda: an earlier launch_stub.json")
    ap.add_argument("--label", default=None, help="--stub-cuda: what sources these are (recorded)")
    args = ap.parse_args()
    if args.stub_cuda:
        _stub_main(200 if args.quick else args.iters, args.out, args.baseline, args.label)
        return
    if args.render:
        with open(args.render) as f:
            write_md(args.render.removesuffix(".json") + ".md", json.load(f))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_launch.py measures CUDA launches: run it on a GPU machine")
    iters = 200 if args.quick else args.iters
    meta = {
        **provenance("torch", "triton"),
        "device": torch.cuda.get_device_name(),
        "iters": iters,
        "shape": {"hq": HQ, "hkv": HKV, "head": D, "block": BLOCK, "context": CONTEXT},
    }
    records = []
    for batch in (1, 64, 256):
        for op, fn in _cases(batch).items():
            rec = {"op": op, "batch": batch, "metric": "host_us", **_measure(op, fn, iters)}
            rec["value"] = rec["fast_us"]
            records.append(rec)
            print(json.dumps(rec), flush=True)
    for op, us in new_class_us(stub=False).items():
        rec = {"op": op, "batch": "new", "metric": "new_class_host_us", "value": us}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "launch.json"), "w") as f:
            json.dump({**meta, "records": records}, f, indent=1)
        write_md(os.path.join(args.out, "launch.md"), {**meta, "records": records})


def _stub_main(
    iters: int, out_dir: str | None, baseline: str | None, label: str | None = None
) -> None:
    """Host us per call of the CUDA path on this machine, the launches stubbed (one JSON line
    per op and batch; with ``out_dir``, ``launch_stub.json`` and ``.md`` there): to compare two
    versions of the host path where no GPU is at hand. ``baseline``: an earlier
    ``launch_stub.json`` (e.g. of another checkout's sources on ``PYTHONPATH``), shown beside."""
    import platform

    import kv_kernels
    from kv_kernels.testing_launch import stubbed_cuda

    before = {}
    if baseline:
        with open(baseline) as f:
            before = {(r["op"], r["batch"]): r["value"] for r in json.load(f)["records"]}
    records = []
    with stubbed_cuda():
        for batch in (1, 64, 256):
            for op, fn in _cases(batch, stub=True).items():
                launchers = _launch.reset_all()
                fn()
                fn()  # (the first binds)
                us = _best_us(fn, iters)
                bound = sum(launcher.hits for launcher in launchers) > 0
                rec: dict[str, Any] = {"op": op, "batch": batch, "metric": "stub_host_us",
                                       "value": round(us, 2), "bound": bound}  # fmt: skip
                if (op, batch) in before:
                    rec["baseline_us"] = before[(op, batch)]
                records.append(rec)
                print(json.dumps(rec), flush=True)
        for op, us in new_class_us(stub=True).items():
            rec = {"op": op, "batch": "new", "metric": "stub_new_class_host_us",
                   "value": round(us, 2), "bound": None}  # fmt: skip
            if (op, "new") in before:
                rec["baseline_us"] = before[(op, "new")]
            records.append(rec)
            print(json.dumps(rec), flush=True)
    if out_dir:
        meta = {
            **provenance("torch", "triton"),
            "benchmark": "kv-kernels launch host cost, CUDA path stubbed on the CPU",
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "sources": os.path.dirname(kv_kernels.__file__),
            "label": label,
            "baseline": baseline,
            "iters": iters,
        }
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "launch_stub.json"), "w") as f:
            json.dump({**meta, "records": records}, f, indent=1)
        _write_stub_md(os.path.join(out_dir, "launch_stub.md"), {**meta, "records": records})


def _write_stub_md(path: str, data: dict[str, Any]) -> None:
    """The table of a ``launch_stub.json`` (``data``) as markdown at ``path``."""
    has_base = any("baseline_us" in r for r in data["records"])
    lines = [
        "# Triton launch host cost, CUDA path stubbed on the CPU (kv-kernels)",
        "",
        f"Written by `packages/kv-kernels/benchmarks/bench_launch.py --stub-cuda` on "
        f"{data['cpu_count']} CPU cores ({data['cpu']}, torch {data['torch']}, triton "
        f"{data['triton']}), sources `{data['sources']}`"
        + (f" ({data['label']})" if data.get("label") else "")
        + ": µs of host time per call, the best of "
        f"3 medians of {data['iters']} back-to-back calls, fake-cuda tensors and no-op launchers "
        "(kv_kernels.testing_launch: no driver, no allocator, no C launcher; a fake-cuda "
        "tensor's attribute reads cost more than a real one's). A comparison of two versions "
        "of the host path on one machine, not a GPU host's time (`launch_h200.md`). Batch "
        "`new`: the first call at a token count not seen before, the median over "
        f"{len(NEW_CLASSES)} counts (one call, not a median of many)."
        + (f" Baseline: `{data['baseline']}`." if has_base else ""),
        "",
        "| op | batch | " + ("baseline µs | " if has_base else "") + "µs | bound |",
        "|---|---|" + ("---|" if has_base else "") + "---|---|",
    ]
    for r in data["records"]:
        base = (
            f"{r['baseline_us']:.1f} | " if "baseline_us" in r else ("n/a | " if has_base else "")
        )
        lines.append(f"| {r['op']} | {r['batch']} | {base}{r['value']:.1f} | {r['bound']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
