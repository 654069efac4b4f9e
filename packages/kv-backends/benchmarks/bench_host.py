"""Host cost of the backends: CPU microseconds per metadata build and per ``forward``, beside the
direct kernel call, eager and under CUDA graphs (CUDA only).

What is measured, per backend and decode batch size (1, 64, 256 requests of ``--seq-len`` keys,
Llama-3-8B per-rank heads: 32 q / 8 KV heads of 128, bf16, 16-token blocks):

- ``build_us``: host time of ``builder.build(common)`` (once per step per KV group).
- ``forward_us``: host time of ``impl.forward(...)`` (once per layer per step), median over
  ``--iters`` calls issued back to back. The GPU runs behind; the count stays far below the
  launch queue's depth, so a call's host time is not stretched by waiting for the device.
- ``kernel_us``: host time of the kernel the backend wraps, called directly with the same inputs
  (the baseline); ``overhead_us``: the median of ``forward - kernel`` over pairs of calls made
  one after the other (goal: <= 5 us). Paired, since two medians taken a few hundred calls
  apart differ by more than the overhead when the launch queue fills differently (the
  record before the pairing read 5.07 / 5.33 / 1.3 us at batch 1 / 64 / 256).
- ``replay_us``: host time of ``graph.replay()`` of a captured ``forward`` (backends that declare
  CUDA-graph support).
- ``graph_device_us`` / ``kernel_device_us``: device time per step of the replayed graph and of
  the direct kernel (CUDA events over ``--iters`` back-to-back calls);
  ``graph_ratio = kernel_device_us / graph_device_us`` (goal: >= 0.95).

``--cpu`` (no GPU needed): TRITON's forward on the CPU with kv-kernels' ``paged_attention``
replaced by a stub of the same signature that does nothing, against that stub called directly:
what the backend's Python costs per call beyond the kernel's own host path (the GPU host runs
the same Python, ~2x slower). Prints the records and writes ``backends_host_cpu.json`` under
``--out``; build_us is the real builder's.

Usage (on the GPU machine)::

    python packages/kv-backends/benchmarks/bench_host.py [--out docs/benchmarks] [--quick]
    python packages/kv-backends/benchmarks/bench_host.py --cpu --out /tmp/host   # any machine

Writes ``backends_host.json`` (one record per backend x batch), ``backends_host.md`` (a table)
and ``backends_host.png`` (host us per forward vs kernel, per batch size) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _direct import direct_flash_attn, direct_paged_attention
from _provenance import provenance

HEADS_Q, HEADS_KV, HEAD = 32, 8, 128
BACKENDS = ("TRITON", "FLASH_ATTN", "FLEX_ATTENTION", "TORCH_SDPA")


def _host_us(fn: Callable[[], Any], iters: int) -> float:
    """Median host microseconds of ``fn`` over ``iters`` calls (device drained before)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _paired_us(
    fn: Callable[[], Any], base: Callable[[], Any], iters: int, block: int = 1
) -> tuple[float, float, float]:
    """Median host microseconds of ``fn`` and of ``base`` and the median of their difference,
    over ``iters`` pairs of ``block`` calls each, ``fn``'s then ``base``'s (device drained
    before): a pair's two halves meet the same launch-queue depth and CPU state."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    a, b, d = [], [], []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        for _ in range(block):
            fn()
        t1 = clock()
        for _ in range(block):
            base()
        t2 = clock()
        a.append((t1 - t0) * 1e6 / block)
        b.append((t2 - t1) * 1e6 / block)
        d.append(a[-1] - b[-1])
    sync()
    return statistics.median(a), statistics.median(b), statistics.median(d)


def _device_us(fn: Callable[[], Any], iters: int) -> float:
    """Device microseconds per call of ``fn`` over ``iters`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _direct(name: str, b: Any, md: Any, impl: Any, out: torch.Tensor) -> Callable[[], Any] | None:
    """The wrapped kernel called by hand with the backend's own inputs (None: no single kernel)."""
    if name == "TRITON":
        return direct_paged_attention(b, md, out, scale=impl.scale)
    if name == "FLASH_ATTN" and getattr(impl, "version", None) == 4:
        return direct_flash_attn(b, md, impl)
    return None


def _graph(impl: Any, b: Any, md: Any, out: torch.Tensor) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            impl.forward(None, b.q, b.kv_cache, md, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, b.q, b.kv_cache, md, out=out)
    return graph


def _decode_batch(batch: int, seq_len: int, device: str) -> Any:
    """A decode step of ``batch`` requests of ``seq_len`` tokens at the benchmark's head shape
    (no values written: the host path is what is timed)."""
    from kv_backends.testing import make_paged_batch

    return make_paged_batch(
        query_lens=[1] * batch, seq_lens=[seq_len] * batch, num_q_heads=HEADS_Q,
        num_kv_heads=HEADS_KV, head_size=HEAD, dtype="bfloat16", device=device, fill=False,
        make_kv=False,
    )  # fmt: skip


def _case(name: str, batch: int, seq_len: int, iters: int) -> dict[str, Any] | None:
    from kv_backends import Platform, get_backend
    from kv_backends.capabilities import CUDAGRAPH_NEVER

    b = _decode_batch(batch, seq_len, "cuda")
    b.kv_cache.normal_()
    backend = get_backend(name)
    reasons = backend.validate(b.config, Platform.detect())
    if reasons:
        print(f"skip {name} batch {batch}: {'; '.join(reasons)}", file=sys.stderr)
        return None
    builder = backend.make_builder(b.config, b.layout, device="cuda")
    impl = backend.make_impl(b.config, b.layout, device="cuda")
    md = builder.build(b.common)
    out = torch.empty(batch, HEADS_Q, HEAD, dtype=b.q.dtype, device="cuda")
    impl.forward(None, b.q, b.kv_cache, md, out=out)  # warm-up / JIT / compile
    rec: dict[str, Any] = {"backend": name, "batch": batch, "seq_len": seq_len}
    rec["build_us"] = _host_us(lambda: builder.build(b.common), iters)
    rec["forward_us"] = _host_us(lambda: impl.forward(None, b.q, b.kv_cache, md, out=out), iters)
    direct = _direct(name, b, md, impl, out)
    if direct is not None:
        direct()
        rec["kernel_us"] = _host_us(direct, iters)

        def fwd() -> None:
            impl.forward(None, b.q, b.kv_cache, md, out=out)

        rec["overhead_us"] = _paired_us(fwd, direct, iters)[2]
        rec["kernel_device_us"] = _device_us(direct, iters)
    if backend.CAPABILITIES.cudagraph_support != CUDAGRAPH_NEVER:
        graph = _graph(impl, b, md, out)
        rec["replay_us"] = _host_us(graph.replay, iters)
        rec["graph_device_us"] = _device_us(graph.replay, iters)
        if "kernel_device_us" in rec:
            rec["graph_ratio"] = rec["kernel_device_us"] / rec["graph_device_us"]
    return rec


def _stub_paged_attention() -> Callable[..., None]:
    """A function with ``kv_kernels.paged_attention``'s signature that does nothing: the CPU
    harness's kernel (binding the same arguments costs what the real call's binding costs)."""
    import inspect

    from kv_kernels.paged_attention import paged_attention

    parts: list[str] = []
    for p in inspect.signature(paged_attention).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        parts.append(p.name if p.default is p.empty else f"{p.name}=None")
    ns: dict[str, Any] = {}
    exec(f"def paged_attention({', '.join(parts)}):\n    return None\n", ns)
    stub: Callable[..., None] = ns["paged_attention"]
    return stub


def _cpu_case(batch: int, seq_len: int, rounds: int) -> dict[str, Any]:
    """TRITON's forward on the CPU over the stub kernel (``--cpu``, see the module docstring):
    medians over ``rounds`` pairs of 1000-call blocks, forward's and the direct stub call's."""
    from kv_backends import get_backend

    b = _decode_batch(batch, seq_len, "cpu")
    backend = get_backend("TRITON")
    builder = backend.make_builder(b.config, b.layout, device="cpu")
    impl = backend.make_impl(b.config, b.layout, device="cpu")
    md = builder.build(b.common)
    out = torch.empty(batch, HEADS_Q, HEAD, dtype=b.q.dtype)
    direct = direct_paged_attention(b, md, out, scale=impl.scale)

    def fwd() -> None:
        impl.forward(None, b.q, b.kv_cache, md, out=out)

    fwd()
    forward_us, kernel_us, overhead_us = _paired_us(fwd, direct, rounds, block=1000)
    t0 = time.perf_counter()
    for _ in range(200):
        builder.build(b.common)
    build_us = (time.perf_counter() - t0) / 200 * 1e6
    return {
        "backend": "TRITON",
        "batch": batch,
        "seq_len": seq_len,
        "build_us": build_us,
        "forward_us": forward_us,
        "kernel_us": kernel_us,
        "overhead_us": overhead_us,
        "kernel": "stub (CPU)",
    }


def _main_cpu(args: argparse.Namespace) -> int:
    import kv_kernels.paged_attention  # noqa: F401  (the package module, patched below)

    mod: Any = sys.modules["kv_kernels.paged_attention"]
    real = mod.paged_attention
    mod.paged_attention = _stub_paged_attention()
    try:
        records = [
            _cpu_case(batch, args.seq_len, 9 if args.quick else 41) for batch in (1, 64, 256)
        ]
    finally:
        mod.paged_attention = real
    for rec in records:
        print(json.dumps(rec))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backends_host_cpu.json").write_text(
        json.dumps({"device": "cpu", **provenance("torch"), "records": records}, indent=1) + "\n"
    )
    print(f"wrote {args.out}/backends_host_cpu.json")
    return 0


def _markdown(records: list[dict[str, Any]], device: str) -> str:
    cols = [
        ("backend", "backend"),
        ("batch", "batch"),
        ("build_us", "build µs"),
        ("forward_us", "forward µs"),
        ("kernel_us", "kernel µs"),
        ("overhead_us", "overhead µs"),
        ("replay_us", "replay µs"),
        ("graph_device_us", "graph device µs"),
        ("kernel_device_us", "kernel device µs"),
        ("graph_ratio", "kernel/graph"),
    ]
    lines = [
        "# Backend host cost",
        "",
        f"Device: {device}. Decode, {HEADS_Q} q / {HEADS_KV} KV heads of {HEAD}, bf16, 16-token "
        "blocks. Host µs are medians of back-to-back calls; written by "
        "`packages/kv-backends/benchmarks/bench_host.py`. Goals: overhead ≤ 5 µs, kernel/graph ≥ 0.95.",
        "",
        "| " + " | ".join(label for _, label in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in records:
        cells = []
        for key, _ in cols:
            v = r.get(key)
            cells.append("—" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r["backend"] for r in records):
        rs = [r for r in records if r["backend"] == name]
        ax.plot(
            [r["batch"] for r in rs], [r["forward_us"] for r in rs], "o-", label=f"{name} forward"
        )
        if any("kernel_us" in r for r in rs):
            ks = [r for r in rs if "kernel_us" in r]
            ax.plot(
                [r["batch"] for r in ks],
                [r["kernel_us"] for r in ks],
                "x--",
                label=f"{name} kernel",
            )
        if any("replay_us" in r for r in rs):
            gs = [r for r in rs if "replay_us" in r]
            ax.plot(
                [r["batch"] for r in gs], [r["replay_us"] for r in gs], "s:", label=f"{name} replay"
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("host µs per call")
    ax.set_title("Host cost per forward vs direct kernel call")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--quick", action="store_true", help="fewer iterations, batch 1 and 64")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS))
    parser.add_argument(
        "--cpu", action="store_true", help="TRITON's forward over a stub kernel on the CPU"
    )
    args = parser.parse_args(argv)
    if args.cpu:
        return _main_cpu(args)
    if not torch.cuda.is_available():
        print("bench_host.py needs a CUDA GPU", file=sys.stderr)
        return 2
    iters = 20 if args.quick else 200
    batches = (1, 64) if args.quick else (1, 64, 256)
    records = []
    for name in args.backends:
        for batch in batches:
            try:
                rec = _case(name, batch, args.seq_len, iters)
            except Exception as e:  # one backend failing must not lose the others' numbers
                print(f"{name} batch {batch} failed: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            if rec is not None:
                print(json.dumps(rec))
                records.append(rec)
    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backends_host.json").write_text(
        json.dumps(
            {"device": device, **provenance("torch", "triton"), "records": records}, indent=1
        )
        + "\n"
    )
    (args.out / "backends_host.md").write_text(_markdown(records, device))
    if records:
        _plot(records, args.out / "backends_host.png")
    print(f"wrote {args.out}/backends_host.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
