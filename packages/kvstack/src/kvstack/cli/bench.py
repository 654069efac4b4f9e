"""``kvstack bench``: run the packages' benchmark scripts; each writes JSON, markdown and a PNG.

Results go to a fresh temp folder unless ``--out`` names one, so a run never replaces the
committed ``docs/benchmarks`` results by accident (``--out docs/benchmarks`` does, on purpose).
A suite that cannot run here (the CUDA-only ones on a machine without a GPU, the engine without
transformers) is refused before anything starts, with the one thing to add; when no suite is
named, those are skipped with that line and the rest run.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstack._hints import install_hint

__all__ = ["NEEDS", "SUITES", "add_parser", "cmd_bench", "find_root", "unmet_needs"]

#: Suite name -> package folder whose ``benchmarks/bench_*.py`` it runs, or ``folder:script``
#: for one script of it (kvstack's engine, disaggregated prefill, multi-turn and collector
#: benchmarks are suites of their own).
SUITES = {
    "kernels": "kv-kernels",
    "backends": "kv-backends",
    "blocktable": "kv-blocktable",
    "connectors": "kv-connectors",
    "engine": "kvstack:bench_engine",
    "disagg": "kvstack:bench_disagg",
    "multiturn": "kvstack:bench_multiturn",
    "gc": "kvstack:bench_gc",
}

#: What a suite needs beyond the default environment: ``"cuda"`` (a CUDA GPU), or a module
#: name -> how to add it. Optional extras a script can do without (matplotlib for the PNGs,
#: xxhash, NIXL, a vLLM interpreter) are not here: the scripts skip those parts and say so.
NEEDS: dict[str, dict[str, str]] = {
    "kernels": {"cuda": "run it on a machine with a CUDA GPU (the kernels are timed on one)"},
    "backends": {"cuda": "run it on a machine with a CUDA GPU (the backends are timed on one)"},
    "engine": {"transformers": "add it: " + install_hint("hf", "kvstack bench engine")},
}

_OUT_HELP = (
    "folder for the results (default: a fresh temp folder, printed at the start; pass "
    "--out docs/benchmarks to replace the committed results)"
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="run package benchmarks (writes *.json, .md, .png into a temp folder or --out)",
        description="Runs packages/<pkg>/benchmarks/bench_*.py --out DIR for each suite, in this "
        "process's Python. Results go to a fresh temp folder (printed) unless --out names one; "
        "--out docs/benchmarks replaces the committed results. kernels and backends need a CUDA "
        "GPU, engine needs transformers (the hf group): named suites that cannot run here are "
        "refused before anything starts; with no suite named they are skipped, each with one "
        "line. --args passes extra arguments to every script. Needs a source checkout "
        "(benchmarks are not in the wheels).",
    )
    p.add_argument(
        "suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)} (default: all)"
    )
    p.add_argument("--out", type=Path, default=None, help=_OUT_HELP)
    p.add_argument(
        "--root", type=Path, default=None, help="the kvstack checkout (default: found from the cwd)"
    )
    p.add_argument(
        "--args", default="", help="extra arguments for every script, e.g. --args='--quick'"
    )
    p.set_defaults(func=cmd_bench)


def find_root(start: Path) -> Path:
    """The checkout holding ``packages/kvstack``: ``start`` or one of its parents."""
    for d in (start, *start.parents):
        if (d / "packages" / "kvstack").is_dir():
            return d
    raise ValueError(
        f"no kvstack checkout at or above {start} (looked for packages/kvstack); run from the "
        "repository or pass --root"
    )


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def unmet_needs(
    suite: str,
    *,
    has_cuda: Callable[[], bool] = _has_cuda,
    has_module: Callable[[str], bool] = _has_module,
) -> str | None:
    """Why ``suite`` cannot run in this environment, with what to add (None: it can)."""
    for need, fix in NEEDS.get(suite, {}).items():
        if need == "cuda":
            if not has_cuda():
                return f"suite {suite!r} needs a CUDA GPU (torch sees none here): {fix}"
        elif not has_module(need):
            return f"suite {suite!r} needs {need}, which is not installed: {fix}"
    return None


def cmd_bench(
    args: argparse.Namespace,
    console: Console,
    *,
    unmet: Callable[[str], str | None] = unmet_needs,
) -> int:
    root = args.root.resolve() if args.root else find_root(Path.cwd().resolve())
    extra = shlex.split(args.args)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown benchmark suite(s) {unknown}; choose from {list(SUITES)}")
    suites: Sequence[str] = args.suites or list(SUITES)
    reasons = {s: why for s in suites if (why := unmet(s)) is not None}
    if reasons and args.suites:  # asked for by name: refuse before starting anything
        raise ValueError("; ".join(reasons.values()))
    for why in reasons.values():
        console.print(f"[yellow]skipping[/yellow]: {why}")
    scripts: list[Path] = []
    for suite in suites:
        if suite in reasons:
            continue
        package, _, only = SUITES[suite].partition(":")
        folder = root / "packages" / package / "benchmarks"
        found = sorted(folder.glob(f"{only}.py" if only else "bench_*.py"))
        if not found:
            raise ValueError(f"suite {suite!r} has no benchmarks: no bench_*.py in {folder}")
        scripts += found
    if not scripts:
        raise ValueError("no benchmark suite can run here (see the lines above)")
    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix="kvstack-bench-")).resolve()
        console.print(
            f"results go to {out} (a fresh temp folder; --out docs/benchmarks replaces the "
            "committed results)"
        )
    else:
        out = args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
    before = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    failed = []
    for script in scripts:
        console.print(
            f"[bold]running[/bold] {script.relative_to(root)} --out {out} {' '.join(extra)}"
        )
        res = subprocess.run([sys.executable, str(script), "--out", str(out), *extra], check=False)
        if res.returncode:
            failed.append(f"{script.name} (exit {res.returncode})")
    written = sorted(
        p.name for p in out.iterdir() if p.is_file() and before.get(p) != p.stat().st_mtime_ns
    )
    if failed:
        raise RuntimeError(f"benchmarks failed: {', '.join(failed)}")
    console.print(
        f"[green]done[/green]: wrote {', '.join(written) if written else 'nothing'} under {out}"
    )
    return 0
