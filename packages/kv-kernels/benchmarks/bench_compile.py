"""The cold start: how long a model's kernel variants take to build, and what cuts it.

For each catalogue model, every distinct attention layer kind (heads, window, sinks) gets a cache
of its layout and :func:`kv_kernels.warmup.warm_paged_ops` builds the variants a serving step
launches (the write, the mixed step, a prompt, decode at batch 1 and 4 with split KV). Each phase
runs in a fresh process, so only the on-disk Triton cache carries over:

- ``cold``: an empty cache directory, built one after another (what a first request paid before);
- ``disk``: a new process over the cache ``cold`` filled (every later start on the machine);
- ``parallel``: an empty cache directory, ``--jobs`` child processes building first.

The value is seconds (lower is better); ``ratio`` is the cold build's time over the phase's.
CUDA only. ``python bench_compile.py --out DIR [--jobs 8] [--models Llama-3-8B,MiMo-V2-Flash]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _provenance import provenance  # this folder's copy

MODELS = ("Llama-3-8B", "MiMo-V2-Flash")


def _layer_kinds(model: str) -> list[dict]:
    """The model's distinct attention layers: heads, window, sinks (one cache each)."""
    from kv_spec import get_model

    m = get_model(model)
    kinds = {}
    for i, spec in enumerate(m.kv_specs(block_size=16).values()):
        window = getattr(spec, "sliding_window", None)
        key = (spec.num_kv_heads, spec.head_size, spec.v_size, window, m.layer_has_sinks(i))
        kinds[key] = dict(
            num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, head_size_v=spec.v_size,
            window=window, sinks=m.layer_has_sinks(i), num_q_heads=m.num_q_heads,
            dtype=spec.dtype,
        )  # fmt: skip
    return list(kinds.values())


def _phase(models: list[str], jobs: int) -> dict:
    """One process's builds (the cache directory is the environment's)."""
    import torch
    from kv_kernels.cache import allocate_kv_cache, layer_view
    from kv_kernels.warmup import warm_paged_ops
    from kv_spec import KVCacheLayout, LayoutOrder

    out: dict[str, object] = {}
    t_all = time.perf_counter()
    for model in models:
        for k in _layer_kinds(model):
            layout = KVCacheLayout(
                order=LayoutOrder.LBNHC, num_layers=2, num_blocks=4096, num_kv_heads=k["num_kv_heads"],
                block_size=16, head_size=k["head_size"], head_size_v=k["head_size_v"],
                dtype=k["dtype"],
            )  # fmt: skip
            kv = layer_view(allocate_kv_cache(layout, "cuda"), layout, 1)
            kw: dict = {}
            if k["window"]:
                kw["sliding_window"] = k["window"]
            if k["sinks"]:
                kw["sinks"] = torch.zeros(k["num_q_heads"], device="cuda")
            name = f"{model} kv{k['num_kv_heads']} {k['head_size']}/{k['head_size_v']}" + (
                f" window {k['window']}" if k["window"] else ""
            )
            t0 = time.perf_counter()
            calls = warm_paged_ops(kv, layout, num_q_heads=k["num_q_heads"], jobs=jobs, **kw)
            out[name] = {"s": time.perf_counter() - t0, "calls": calls}
    out["_total_s"] = time.perf_counter() - t_all
    return out


def _spawn(models: list[str], jobs: int, cache: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    cmd = [sys.executable, __file__, "--phase", "--models", ",".join(models), "--jobs", str(jobs)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"phase failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    data["_wall_s"] = wall
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for bench_compile.json (default: none)")
    ap.add_argument("--jobs", type=int, default=8, help="child processes of the parallel phase")
    ap.add_argument("--models", default=",".join(MODELS), help="catalogue models, comma-separated")
    ap.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    if args.phase:
        print(json.dumps(_phase(models, args.jobs)))
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_compile needs a CUDA GPU (the CPU builds nothing: the interpreter)")
    device = torch.cuda.get_device_name()
    records = []
    with tempfile.TemporaryDirectory() as cold_dir, tempfile.TemporaryDirectory() as par_dir:
        phases = {
            "cold": _spawn(models, 1, cold_dir),
            "disk": _spawn(models, 1, cold_dir),
            f"parallel x{args.jobs}": _spawn(models, args.jobs, par_dir),
        }
    cold = phases["cold"]["_total_s"]
    for phase, data in phases.items():
        rec = {
            "bench": "compile", "case": ", ".join(models), "impl": phase,
            "ms": data["_total_s"] * 1e3, "metric": "seconds", "value": data["_total_s"],
            "process_wall_s": data["_wall_s"], "baseline": "cold",
            "baseline_value": cold, "ratio": cold / data["_total_s"], "device": device,
            "groups": {k: v for k, v in data.items() if not k.startswith("_")},
            **provenance("torch", "triton"),
        }  # fmt: skip
        records.append(rec)
        print(json.dumps(rec), flush=True)
    print("\n| phase | seconds (builds) | process wall s | x faster than cold |\n|---|---|---|---|")
    for r in records:
        print(f"| {r['impl']} | {r['value']:.1f} | {r['process_wall_s']:.1f} | {r['ratio']:.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compile.json"), "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
