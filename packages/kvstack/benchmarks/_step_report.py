"""``bench_engine.py --shape``: run :mod:`_step_bench` and write ``engine_gpu.json`` / ``.md`` /
``.png`` (one entry per device and layer count, merged into what the file already holds)."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from _plotting import pyplot
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


def async_option(value: str | None) -> bool | str | None:
    """``--async-scheduling``'s value as ``LLMEngine(async_scheduling=)`` takes it."""
    return {None: None, "graphs": "graphs", "true": True, "false": False}[value]


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
        args.shape,
        args.layers,
        cases,
        args.device,
        not args.no_mixed,
        args.backend,
        args.kv_cache_dtype,
        async_option(args.async_scheduling),
    )
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        **provenance("torch", "triton"),
        "quick": args.quick,
        # the kernels' switches set for this run (KV_KERNELS_SM90_MLA=0: the Triton MLA kernel
        # where the Gluon one would serve): a run with any has its own entry
        "kernel_switches": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith("KV_KERNELS_")
        },
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
    if meta.get("kv_cache_dtype", "auto") != "auto":  # (its own table: other KV bytes)
        key += f" / KV {meta['kv_cache_dtype']}"
    for name, value in meta.get("kernel_switches", {}).items():
        key += f" / {name}={value}"
    if meta.get("async_scheduling") is not None:  # (the engine's default is None: not named)
        key += f" / async_scheduling={meta['async_scheduling']}"
    # a run of other cases adds to the entry (cases measured again are replaced)
    new = {(r["batch"], r["context"], r["phase"]) for r in records}
    old = runs.get(key, {})
    kept = [
        _sourced(r, old.get("meta", {}))
        for r in old.get("records", [])
        if (r["batch"], r["context"], r["phase"]) not in new
    ]
    records = sorted(
        kept + [_sourced(r, meta) for r in records], key=lambda r: (r["batch"], r["context"])
    )
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
        "time (the run's sum of rooflines over its sum of step times; on a GPU a step's time is "
        "the device's, between CUDA events recorded after each step's launches, so a step left "
        "in flight is charged its own). GPU busy, host ms and "
        "syncs come from a profile of 8 steps the script takes itself (the mixed row: of 12 "
        "steps, only the 3 that prefill kept, each charged the kernels it launched). Syncs: "
        "calls that wait for the device (stream / event / device synchronize, copies to "
        "pageable memory); blocking: those that took over 5 us (a copy: over 20 us), an event "
        "already complete is no wait. GPU idle on the compute stream, as ms a step and a "
        "fraction of the steps' device time, split by place: between steps (the gap before a "
        "step's first op), stalls in a step (gaps of 10 us or more between its ops: the host "
        "late to launch), launch gaps (under 10 us, between a step's ops). Where each sync is called comes from a profile of 4 "
        "steps with Python stacks, under the table.",
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
            "| batch x context | phase | ms / step | roofline ms | fraction | GPU busy | host ms / step | syncs / step | blocking syncs / step | idle between steps | stalls in step | launch gaps | kernels / step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in run["records"]:
            gaps = r.get("gpu_gaps") or {}
            lines.append(
                f"| {r['batch']} x {r['context']} | {r['phase']} | {r['ms_per_step']:.2f} | "
                f"{r['roofline_ms']:.2f} | {r['value']:.2f} | {_f(r, 'gpu_busy_fraction')} | "
                f"{_f(r, 'host_ms_per_step')} | {_f(r, 'syncs_per_step', 1)} | "
                f"{_f(r, 'blocking_syncs_per_step', 1)} | "
                f"{_ms_frac(gaps, 'between_steps')} | {_ms_frac(gaps, 'stalls_in_step')} | "
                f"{_ms_frac(gaps, 'launch_gaps_in_step')} | "
                f"{_f(r, 'kernels_per_step', 0)} |"
            )
        lines += ["", *_other_sources(run["records"], m), *_notes(run["records"])]
    (out_dir / "engine_gpu.md").write_text("\n".join(lines))
    _plot(out_dir / "engine_gpu.png", runs)


def _sourced(r: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """``r`` with the sources it was measured at (its run's ``source_sha1`` and commit), kept
    on the record: a later run of other cases replaces the entry's meta, not these."""
    if "source_sha1" in r:
        return r
    return {**r, "source_sha1": meta.get("source_sha1"), "git_commit": meta.get("git_commit")}


def _other_sources(records: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """A line naming the rows measured at other sources than the run's header says."""
    other = [r for r in records if r.get("source_sha1") != meta.get("source_sha1")]
    if not other:
        return []
    rows = ", ".join(
        f"{r['batch']} x {r['context']} {r['phase']} ({r.get('git_commit') or '?'}, "
        f"source_sha1 {r.get('source_sha1') or '?'})"
        for r in other
    )
    return [f"- Measured at other sources than the header's (an earlier run): {rows}"]


def _f(r: dict[str, Any], key: str, digits: int = 2) -> str:
    v = r.get(key)
    return "—" if v is None or v != v else f"{v:.{digits}f}"  # (v != v: nan)


def _ms_frac(gaps: dict[str, Any], kind: str) -> str:
    """``0.12 ms (3%)``: a gap kind's ms a step and its share of the device time."""
    ms, frac = gaps.get(f"{kind}_ms_per_step"), gaps.get(f"{kind}_fraction")
    if ms is None or frac is None or frac != frac:
        return "—"
    return f"{ms:.2f} ms ({frac:.0%})"


def _notes(records: list[dict[str, Any]]) -> list[str]:
    """Under a run's table: each record's sync sites (calls a step, blocking ones, ms) and the
    mixed steps' composition."""
    out: list[str] = []
    phased = [r for r in records if r.get("phase_roofline_ms")]
    if phased:
        out.append(
            "- Phase by phase (the weights' matmuls at max(bytes, FLOPs) plus attention at "
            "max(bytes, FLOPs)), over the median step: "
            + "; ".join(
                f"{r['batch']} x {r['context']} {r['phase']} {r['phase_roofline_ms']:.2f} ms, "
                f"{r['phase_fraction']:.2f}"
                for r in phased
            )
        )
    for r in records:
        every = r.get("all_steps")
        if r["phase"] == "mixed" and every:  # (the table's row: the steps that prefill alone)
            # (its phase-by-phase figure is left out: taken over the median step, a decode step
            # of the load, it does not describe the load)
            out.append(
                f"- {r['batch']} x {r['context']} mixed, the whole load (its decode steps between "
                f"arrivals too, {every['steps']} steps): {every['ms_per_step']:.2f} ms a step, "
                f"fraction {every['value']:.2f}"
            )
    for r in records:
        where = f"{r['batch']} x {r['context']} {r['phase']}"
        sites = r.get("syncs_by_site")
        if sites:
            out.append(f"- {where}, syncs by site (calls / blocking / ms a step):")
            out += [
                f"  - `{site}`: {v['per_step']:.2f} / {v['blocking_per_step']:.2f} / "
                f"{v['ms_per_step']:.3f} ({', '.join(v['calls'])})"
                for site, v in list(sites.items())[:6]
            ]
        for st in (r.get("stall_hosts") or [])[:2]:
            late = st["late_us"]
            says = (
                "launch not in the trace"
                if late is None
                else f"host late by {late:.0f} us"
                if late > 0
                else "launched in time"
            )
            busy = ", ".join(f"{h['name']} {h['us']:.0f} us" for h in st["host_between"][:3])
            gap = st["between_launches_us"]
            out.append(
                f"- {where}, a stall of {st['stall_us']:.0f} us after `{st['after'][:40]}`, "
                f"before `{st['before'][:40]}`: {says}"
                + (f"; {gap:.0f} us between their launches ({busy})" if gap is not None else "")
            )
        for st in (r.get("stall_frames") or [])[:1]:  # (the stack profile's longest stall)
            chain = " > ".join(f"{h['name']} {h['us']:.0f} us" for h in st.get("host_chain", []))
            if chain:
                out.append(
                    f"- {where}, with Python stacks, a stall of {st['stall_us']:.0f} us before "
                    f"`{st['before'][:40]}`: the host was in {chain}"
                )
        for key in ("syncs_by_site_error", "kept_error"):
            if r.get(key):
                out.append(f"- {where}: {key} {r[key]}")
        if r.get("gc_max_ms", 0) >= 0.5:  # (Python's collector inside the timed steps)
            out.append(
                f"- {where}: garbage collection inside the timed steps, "
                f"{r['gc_ms_per_step']:.2f} ms a step on average, {r['gc_max_ms']:.1f} ms at most"
            )
        comp = r.get("composition")
        if comp:
            c = comp[len(comp) // 2]
            out.append(
                f"- {where}: {len(comp)} mixed steps timed, e.g. {c['decode_rows']} decode rows + "
                f"{c['prefill_tokens']} prefill tokens in {c['prefill_rows']} rows, "
                f"{c['kv_tokens']} KV tokens read, roofline {c['roofline_ms']:.2f} ms, "
                f"took {c['ms']:.2f} ms"
            )
        every = r.get("all_steps_profile")
        if every:
            out.append(
                f"- {where}, the whole profiled window ({every['profiled_labels']}): GPU busy "
                f"{_f(every, 'gpu_busy_fraction')}, device ms / step "
                f"{_f(every, 'device_ms_per_step')}, blocking syncs / step "
                f"{_f(every, 'blocking_syncs_per_step', 1)}"
            )
    return [*out, ""] if out else []


def _plot(path: Path, runs: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no {path.name} (the JSON and the table are written)")
        return

    # (three runs a row: one row of eight panels was unreadable at any size)
    ncols = min(3, len(runs))
    nrows = -(-len(runs) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(runs) :]:
        ax.set_visible(False)
    for ax, (key, run) in zip(axes.flat, sorted(runs.items()), strict=False):
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
