"""``kvstack bench``: run the packages' benchmark scripts; each writes JSON, markdown and a PNG."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["SUITES", "add_parser", "cmd_bench", "find_root"]

#: Suite name -> package folder whose ``benchmarks/bench_*.py`` it runs.
SUITES = {
    "kernels": "kv-kernels",
    "backends": "kv-backends",
    "blocktable": "kv-blocktable",
    "connectors": "kv-connectors",
    "engine": "kvstack",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="run package benchmarks (writes docs/benchmarks/*.json, .md, .png)",
        description="Runs packages/<pkg>/benchmarks/bench_*.py --out DIR for each suite, in this "
        "process's Python. --args passes extra arguments to every script. Needs a source "
        "checkout (benchmarks are not in the wheels).",
    )
    p.add_argument(
        "suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)} (default: all)"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output dir (default: <checkout>/docs/benchmarks)"
    )
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


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    root = args.root.resolve() if args.root else find_root(Path.cwd().resolve())
    out = (args.out or root / "docs" / "benchmarks").resolve()
    extra = shlex.split(args.args)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown benchmark suite(s) {unknown}; choose from {list(SUITES)}")
    scripts: list[Path] = []
    for suite in args.suites or list(SUITES):
        folder = root / "packages" / SUITES[suite] / "benchmarks"
        found = sorted(folder.glob("bench_*.py"))
        if not found:
            raise ValueError(f"suite {suite!r} has no benchmarks: no bench_*.py in {folder}")
        scripts += found
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for script in scripts:
        console.print(
            f"[bold]running[/bold] {script.relative_to(root)} --out {out} {' '.join(extra)}"
        )
        res = subprocess.run([sys.executable, str(script), "--out", str(out), *extra], check=False)
        if res.returncode:
            failed.append(f"{script.name} (exit {res.returncode})")
    if failed:
        raise RuntimeError(f"benchmarks failed: {', '.join(failed)}")
    console.print(f"[green]done[/green]: results under {out}")
    return 0
