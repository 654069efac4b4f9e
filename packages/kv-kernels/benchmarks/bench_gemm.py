"""The skinny GEMM (``kv_kernels.gemm.skinny_linear``) against cuBLAS on the decode step's
projections, in one process on a CUDA GPU (issue 32).

Cases: ``y[M, N] = x[M, K] @ W[N, K]^T`` (``nn.Linear``, no bias, bf16) for the shapes of
``_gemm_sweep.SHAPES`` (Llama-3-8B's qkv, o_proj, gate_up, down, lm_head; DeepSeek-V3's and
MiMo-7B's) at ``M`` in {1, 16, 64, 128, 256}, three implementations each:

- ``cublas``: ``torch.nn.functional.linear`` (torch's default BLAS choice);
- ``cublaslt``: the same under ``torch.backends.cuda.preferred_blas_library("cublaslt")``
  (restored after);
- ``skinny``: ``skinny_linear`` with its table config (``config`` in the record).

Metric: weight bytes ``N * K * 2`` over GPU time, TB/s, and ``of_copy``: that against a
device-to-device copy of 1 GiB measured first in this process (read + written bytes; the roof
a kernel reading HBM is held to). ``total_of_copy`` also counts x and y. ``ratio``: cuBLAS's
time over this impl's. Time: the calls captured back to back in one CUDA graph and replayed
between CUDA events (``_gemm_sweep.graph_us``), each call reading another of several weight
copies that together pass 3x the L2 (50 MB would flatter o_proj's 33 MB). Every output is
checked against an fp32 oracle: the kernel's max error must be within 2x cuBLAS's + 1e-3
(``parity`` in the record; a failure makes the script exit 1 after writing its files).

``--sweep`` also times every config of ``_gemm_sweep.sweep_grid`` per (shape, M) and writes the
best per (M bucket, N, K) (least summed time over the bucket's M values) to
``gemm_sweep.json`` and as a dict literal to paste into ``kv_kernels.gemm.configs.TABLE``.
``--shapes`` picks shapes by fnmatch patterns; ``--ms`` the token counts. ``--smoke``
(``--quick``) runs tiny shapes under the Triton interpreter on the CPU (checks the script; the
numbers mean nothing). Writes ``DIR/gemm.json`` (records), ``DIR/gemm.md``::

    python3 packages/kv-kernels/benchmarks/bench_gemm.py --out $OUT [--sweep]

Budget (H200): the default run < 2 minutes, ``--sweep`` < 5 (configs compiled in parallel).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

if {"--smoke", "--quick"} & set(sys.argv):
    # before the first import of the Triton kernels: the interpreter decides at definition time
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_sweep import SHAPES, Shape, default_workers, graph_us, precompile, sweep_grid
from _records import _versions  # this folder's record fields
from kv_kernels.gemm import GemmConfig, pick_config, skinny_linear
from kv_kernels.gemm.configs import m_bucket

MS = (1, 16, 64, 128, 256)
SMOKE_SHAPES = (Shape("smoke.a", 72, 96), Shape("smoke.b", 40, 200))
SMOKE_MS = (1, 5, 17)


class Bench:
    def __init__(self, device: str, smoke: bool) -> None:
        self.device, self.smoke = device, smoke
        self.dtype = torch.float16 if smoke else torch.bfloat16  # (the interpreter's bf16 is wrong)
        self.name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
        self.copy = self._copy_tbps()
        self.l2 = 50 * 2**20
        if device == "cuda":
            self.l2 = max(self.l2, getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0))
        self.records: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.sweep: list[dict[str, Any]] = []

    def _copy_tbps(self) -> float:
        if self.device != "cuda":
            return float("nan")
        from _timing import copy_limit

        return copy_limit(self.device)

    def time_us(self, calls: list[Callable[[], Any]], wbytes: int, *, replays: int = 5) -> float:
        if self.device != "cuda":
            calls[0]()
            t0 = time.perf_counter()
            calls[0]()
            return (time.perf_counter() - t0) * 1e6
        est = wbytes / (self.copy * 1e12) * 1e6  # us at the copy's rate
        return graph_us(calls, target_us=600.0, est_us=est, replays=replays)

    def record(self, shape: Shape, m: int, impl: str, us: float, base_us: float | None,
               **extra: Any) -> dict[str, Any]:  # fmt: skip
        b = self.dtype.itemsize
        wbytes = shape.n * shape.k * b
        total = wbytes + m * (shape.n + shape.k) * b
        value = wbytes / us / 1e6  # TB/s
        rec = {
            "bench": "gemm", "case": f"{shape.name} M={m}", "impl": impl, "ms": us / 1e3,
            "metric": "TB/s", "value": value, "baseline": "cublas" if base_us else None,
            "baseline_value": wbytes / base_us / 1e6 if base_us else None,
            "ratio": base_us / us if base_us else None, "device": self.name,
            "shape": shape.name, "M": m, "N": shape.n, "K": shape.k, "us": us,
            "of_copy": value / self.copy, "total_of_copy": total / us / 1e6 / self.copy,
            "copy_tbps": self.copy, **_versions(), **extra,
        }  # fmt: skip
        self.records.append(rec)
        print(
            json.dumps({k: rec[k] for k in ("case", "impl", "us", "of_copy", "ratio")}), flush=True
        )
        return rec

    def _checker(
        self, case: str, oracle: torch.Tensor, err_blas: float
    ) -> Callable[[torch.Tensor, str], tuple[bool, float]]:
        """``check(y, what) -> (ok, max error)`` against the fp32 ``oracle``: ok when within 2x
        cuBLAS's error + 1e-3 (a failure is listed and fails the run)."""

        def check(y: torch.Tensor, what: str) -> tuple[bool, float]:
            err = (y.float() - oracle).abs().max().item()
            ok = err <= 2 * err_blas + 1e-3
            if not ok and what != "cublaslt":  # (cublasLt's own error is reported, not ours)
                self.failures.append(
                    f"{case} {what}: max error {err:.3g} > 2 * cuBLAS's {err_blas:.3g} + 1e-3"
                )
            return ok, err

        return check

    def run_shape(self, shape: Shape, ms: tuple[int, ...], sweep: bool) -> None:
        dev, dt = self.device, self.dtype
        g = torch.Generator(device=dev).manual_seed(0)
        wbytes = shape.n * shape.k * dt.itemsize
        copies = 1 if self.smoke else max(1, -(-3 * self.l2 // wbytes))
        w0 = (torch.randn(shape.n, shape.k, generator=g, device=dev) * shape.k**-0.5).to(dt)
        ws = [w0] + [w0.clone() for _ in range(copies - 1)]
        for m in ms:
            x = torch.randn(m, shape.k, generator=g, device=dev).to(dt)
            oracle = x.float() @ w0.float().T
            y_blas = F.linear(x, w0)
            err_blas = (y_blas.float() - oracle).abs().max().item()

            check = self._checker(f"{shape.name} M={m}", oracle, err_blas)
            blas_us = self.time_us([partial(F.linear, x, w) for w in ws], wbytes)
            self.record(shape, m, "cublas", blas_us, None, err=err_blas)
            if dev == "cuda":
                prev = torch.backends.cuda.preferred_blas_library()
                try:
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    ok, err = check(F.linear(x, w0), "cublaslt")
                    lt_us = self.time_us([partial(F.linear, x, w) for w in ws], wbytes)
                finally:
                    torch.backends.cuda.preferred_blas_library(prev)
                self.record(shape, m, "cublaslt", lt_us, blas_us, err=err, parity=ok)
            cfg = pick_config(m, shape.n, shape.k, dt.itemsize)
            out = torch.empty(m, shape.n, dtype=dt, device=dev)
            ok, err = check(skinny_linear(x, w0), f"skinny {tuple(cfg)}")
            sk_us = self.time_us([partial(skinny_linear, x, w, out=out) for w in ws], wbytes)
            self.record(shape, m, "skinny", sk_us, blas_us, err=err, parity=ok, config=list(cfg))
            if sweep:
                self.sweep_case(shape, m, x, ws, out, check, blas_us)
        del ws, w0
        if dev == "cuda":
            torch.cuda.empty_cache()

    def sweep_case(self, shape: Shape, m: int, x: torch.Tensor, ws: list[torch.Tensor],
                   out: torch.Tensor, check: Callable[[torch.Tensor, str], tuple[bool, float]],
                   blas_us: float) -> None:  # fmt: skip
        wbytes = shape.n * shape.k * self.dtype.itemsize
        grid = sweep_grid(m, shape.n, shape.k)
        for cfg in grid[:2] if self.smoke else grid:  # (the interpreter is slow: two configs)
            try:
                ok, err = check(skinny_linear(x, ws[0], config=cfg), f"sweep {tuple(cfg)}")
                us = self.time_us(
                    [partial(skinny_linear, x, w, out=out, config=cfg) for w in ws], wbytes,
                    replays=3,
                )  # fmt: skip
            except Exception as e:  # (a config that does not build: skipped, reported)
                print(f"sweep {shape.name} M={m} {tuple(cfg)}: {type(e).__name__}: {e}"[:300])
                continue
            self.sweep.append({
                "shape": shape.name, "M": m, "N": shape.n, "K": shape.k, "config": list(cfg),
                "us": us, "of_copy": wbytes / us / 1e6 / self.copy, "vs_cublas": blas_us / us,
                "parity": ok, "err": err,
            })  # fmt: skip

    def best_table(self) -> dict[tuple[int, int, int], tuple[GemmConfig, float, int]]:
        """Per (M bucket, N, K): ``(config, summed us, number of M values)`` of the config of
        least summed time over the bucket's M values (a parity failure counts as infinite)."""
        sums: dict[tuple[int, int, int], dict[tuple[int, ...], list[float]]] = {}
        for r in self.sweep:
            key = (m_bucket(r["M"]), r["N"], r["K"])
            times = sums.setdefault(key, {}).setdefault(tuple(r["config"]), [])
            times.append(r["us"] if r["parity"] else float("inf"))
        best = {}
        for key, by_cfg in sums.items():
            n_ms = max(len(v) for v in by_cfg.values())
            full = {c: sum(v) for c, v in by_cfg.items() if len(v) == n_ms}
            cfg, us = min(full.items(), key=lambda kv: kv[1])
            best[key] = (GemmConfig(*cfg), us, n_ms)
        return best


def write(bench: Bench, out_dir: str, sweep: bool) -> None:
    with open(os.path.join(out_dir, "gemm.json"), "w") as f:
        json.dump(bench.records, f, indent=1)
    lines = [
        f"# skinny GEMM vs cuBLAS — {bench.name}, copy {bench.copy:.3g} TB/s, "
        f"{str(bench.dtype).removeprefix('torch.')}, weight-bytes "
        "bandwidth as a fraction of the copy\n",
        "| shape | M | N | K | cuBLAS us (of copy) | cublasLt us (of copy) | skinny us (of copy) "
        "| skinny vs cuBLAS | config | parity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["shape"], r["M"], r["impl"]): r for r in bench.records}
    for shape, m in dict.fromkeys((r["shape"], r["M"]) for r in bench.records):
        cells = []
        for impl in ("cublas", "cublaslt", "skinny"):
            r = by.get((shape, m, impl))
            cells.append("—" if r is None else f"{r['us']:.1f} ({r['of_copy']:.2f})")
        sk = by[(shape, m, "skinny")]
        lines.append(
            f"| {shape} | {m} | {sk['N']} | {sk['K']} | {' | '.join(cells)} | "
            f"{sk['ratio']:.2f}x | {tuple(sk['config'])} | {'ok' if sk['parity'] else 'FAIL'} |"
        )
    if sweep:
        best = bench.best_table()
        lit = "TABLE: dict[tuple[int, int, int], GemmConfig] = {\n" + "".join(
            f"    {key}: GemmConfig{tuple(cfg)},  # {us / n:.1f} us avg over {n} M\n"
            for key, (cfg, us, n) in sorted(best.items())
        ) + "}\n"  # fmt: skip
        print("\n# paste into kv_kernels/gemm/configs.py:\n" + lit)
        lines += ["\n## sweep: best config per (M bucket, N, K)\n", "```python", lit, "```"]
        with open(os.path.join(out_dir, "gemm_sweep.json"), "w") as f:
            json.dump({
                "device": bench.name, "copy_tbps": bench.copy, "results": bench.sweep,
                "best": {str(k): [list(c), us / n] for k, (c, us, n) in best.items()},
                "table_literal": lit, **_versions(),
            }, f, indent=1)  # fmt: skip
    if bench.failures:
        lines += ["\n## parity failures\n", *(f"- {f}" for f in bench.failures)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "gemm.md"), "w") as f:
        f.write(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for gemm.json / gemm.md")
    ap.add_argument("--sweep", action="store_true", help="time the config grid; print the best")
    ap.add_argument("--shapes", default="*", help="fnmatch patterns, comma-separated")
    ap.add_argument(
        "--ms", default=None, help="token counts, comma-separated (default 1,16,64,128,256)"
    )
    ap.add_argument(
        "--workers", type=int, default=0, help="compile processes (0: cores - 1, <= 16)"
    )
    ap.add_argument("--smoke", "--quick", action="store_true", help="tiny shapes, interpreter, CPU")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a CUDA GPU (or --smoke for the CPU check)")
    t0 = time.perf_counter()
    pats = args.shapes.split(",")
    shapes = [s for s in (SMOKE_SHAPES if args.smoke else SHAPES)
              if any(fnmatch.fnmatch(s.name, p) for p in pats)]  # fmt: skip
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (SMOKE_MS if args.smoke else MS)
    bench = Bench("cpu" if args.smoke else "cuda", args.smoke)
    print(json.dumps({"copy": "torch copy_", "TB/s": bench.copy, "device": bench.name}), flush=True)
    if not args.smoke:
        cases = [(m, s.n, s.k, pick_config(m, s.n, s.k)) for s in shapes for m in ms]
        if args.sweep:
            cases += [(m, s.n, s.k, c) for s in shapes for m in ms for c in sweep_grid(m, s.n, s.k)]
        failed = precompile(cases, args.workers or default_workers())
        print(f"precompiled in {time.perf_counter() - t0:.1f} s; {len(failed)} failed", flush=True)
        for f in failed:
            print("  compile failed:", f)
    for shape in shapes:
        bench.run_shape(shape, ms, args.sweep)
        print(f"[{time.perf_counter() - t0:.0f} s] {shape.name} done", flush=True)
    write(bench, args.out, args.sweep)
    print(f"total {time.perf_counter() - t0:.1f} s")
    if bench.failures:
        raise SystemExit(f"{len(bench.failures)} parity failures (listed in gemm.md)")


if __name__ == "__main__":
    main()
