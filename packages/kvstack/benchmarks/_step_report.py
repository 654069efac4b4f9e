"""``bench_engine.py --shape``: run :mod:`_step_bench` and write ``engine_gpu.json`` / ``.md`` /
``.png`` (one entry per device and layer count, merged into what the file already holds)."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch
from _provenance import provenance
from _step_bench import SHAPES, bench_shape


def _cases(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in spec.split(","):
        b, _, c = part.strip().partition("x")
        if not (b.isdigit() and c.isdigit()):
            raise SystemExit(f"--cases: {part!r} is not BATCHxCONTEXT (e.g. 64x1024)")
        out.append((int(b), int(c)))
    return out


def main_shape(args: argparse.Namespace) -> None:
    if args.shape not in SHAPES:
        raise SystemExit(f"--shape {args.shape!r}: known shapes are {sorted(SHAPES)}")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: no GPU here (the CPU runs only --shape llama-tiny --quick)"
        )
    if not cuda and not (args.quick and args.shape == "llama-tiny"):
        raise SystemExit(
            "--shape measures against a GPU's memory roofline: give --device cuda (on the CPU "
            "only the smoke test runs: --shape llama-tiny --quick)"
        )
    cases = [(8, 256)] if args.quick else _cases(args.cases)
    records, info = bench_shape(
        args.shape, args.layers, cases, args.device, not args.no_mixed, args.backend
    )
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        **provenance("torch", "triton"),
        "quick": args.quick,
        **info,
    }
    write(args.out, records, meta)


def write(out_dir: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "engine_gpu.json"
    runs: dict[str, Any] = {}
    if path.is_file():
        runs = json.loads(path.read_text()).get("runs", {})
    key = f"{meta['device']} / {meta['shape']} / {meta['layers']} layers"
    # a run of other cases adds to the entry (cases measured again are replaced)
    new = {(r["batch"], r["context"], r["phase"]) for r in records}
    kept = [
        r
        for r in runs.get(key, {}).get("records", [])
        if (r["batch"], r["context"], r["phase"]) not in new
    ]
    records = sorted(kept + records, key=lambda r: (r["batch"], r["context"]))
    runs[key] = {"meta": meta, "records": records}
    path.write_text(json.dumps({"runs": runs}, indent=2))
    lines = [
        "# The engine's step against the memory roofline",
        "",
        "Written by `packages/kvstack/benchmarks/bench_engine.py --shape` (random weights, "
        "bf16, the backend each run names: TRITON, or TRITON_MLA for MLA shapes, unless `--backend` "
        "said otherwise; 64 new tokens a request). roofline = (weight bytes + KV bytes "
        "read) / device-to-device copy bandwidth, or FLOPs / the dense bf16 matmul peak where "
        "larger (prefill, mixed), both measured in the same process; fraction = roofline / step "
        "time (the run's sum of rooflines over its sum of step times). GPU busy, host ms and "
        "syncs come from a profile of 8 steps the script takes itself.",
        "",
    ]
    for key, run in sorted(runs.items()):
        m = run["meta"]
        lines += [
            f"## {key}",
            "",
            f"backend {m.get('backend') or 'picked by the engine'}, torch {m['torch']}, copy {m['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
            f"{m['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, commit {m.get('git_commit', '?')}"
            + (" (quick run)" if m.get("quick") else ""),
            "",
            "| batch x context | phase | ms / step | roofline ms | fraction | GPU busy | host ms / step | syncs / step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in run["records"]:
            busy = f"{r['gpu_busy_fraction']:.2f}" if "gpu_busy_fraction" in r else "—"
            host = f"{r['host_ms_per_step']:.2f}" if "host_ms_per_step" in r else "—"
            syncs = f"{r['syncs_per_step']:.1f}" if "syncs_per_step" in r else "—"
            lines.append(
                f"| {r['batch']} x {r['context']} | {r['phase']} | {r['ms_per_step']:.2f} | "
                f"{r['roofline_ms']:.2f} | {r['value']:.2f} | {busy} | {host} | {syncs} |"
            )
        lines.append("")
    (out_dir / "engine_gpu.md").write_text("\n".join(lines))
    _plot(out_dir / "engine_gpu.png", runs)


def _plot(path: Path, runs: dict[str, Any]) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"matplotlib is not installed: no {path.name} (the JSON and the table are written)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.8), squeeze=False)
    for ax, (key, run) in zip(axes[0], sorted(runs.items()), strict=True):
        recs = run["records"]
        labels = [f"{r['batch']}x{r['context']}\n{r['phase']}" for r in recs]
        ax.bar(range(len(recs)), [r["value"] for r in recs])
        ax.axhline(0.85, ls="--", c="k", lw=0.8, label="decode goal 0.85")
        ax.axhline(0.6, ls=":", c="k", lw=0.8, label="mixed goal 0.6")
        ax.set_xticks(range(len(recs)), labels, fontsize=6, rotation=60)
        ax.set_ylabel("fraction of the roofline")
        ax.set_title(key, fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merge(paths: list[Path], out_dir: Path) -> None:
    """Fold the runs of ``engine_gpu.json`` files written on several machines (each device
    machine writes its own) into ``out_dir``'s, through :func:`write`; a record without its
    own bandwidth and peak takes its run's."""
    for path in paths:
        for run in json.loads(path.read_text())["runs"].values():
            meta = run["meta"]
            recs = [
                {
                    "copy_bytes_per_s": meta["copy_bytes_per_s"],
                    "matmul_flops_per_s": meta["matmul_flops_per_s"],
                    **r,
                }
                for r in run["records"]
            ]
            write(out_dir, recs, meta)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="merge engine_gpu.json files into --out's")
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    merge(args.files, args.out)
