"""``kvstack backends``: which attention backends can serve a model here, chosen per group, and why."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import TYPE_CHECKING, Any

from kv_spec import CATALOGUE
from rich.console import Console
from rich.table import Table

from kvstack.cli._args import count_arg
from kvstack.planning import check_tensor_parallel, resolve_arch, resolve_model

if TYPE_CHECKING:
    from kv_backends import AttentionConfig, Platform

__all__ = [
    "COMPUTE_CAPABILITIES",
    "EXIT_NOT_SERVED",
    "OPTIONAL_MODULES",
    "add_parser",
    "cmd_backends",
    "parse_installed",
    "parse_platform",
]

# kv_backends imports torch (seconds): imported inside the command so `plan`, `--help` stay fast.

#: Every CUDA compute capability NVIDIA has shipped (sm_50 Maxwell to sm_121 DGX Spark).
COMPUTE_CAPABILITIES: tuple[tuple[int, int], ...] = (
    (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5),
    (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1),
)  # fmt: skip
#: Optional modules the backends probe for (``--installed``), with short aliases.
OPTIONAL_MODULES: dict[str, str] = {
    "fa2": "flash_attn_2_cuda",
    "fa3": "flash_attn_interface",
    "fa4": "flash_attn.cute",
}
#: Exit status when a model the user named has a KV group no backend serves on the platform.
EXIT_NOT_SERVED = 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "backends",
        help="the attention backends usable here for a model, the one chosen per group, and why",
        description="For each KV group of the model: every backend the platform knows, whether it "
        "validates, every rejection reason, the one the selector picks, and its kernel block size. "
        "With no MODEL, every catalogue model and a summary of which groups are served (exit 0); "
        f"a named MODEL that a group of cannot be served exits {EXIT_NOT_SERVED}.",
    )
    p.add_argument(
        "model",
        nargs="?",
        help="catalogue name, config.json or checkpoint dir (default: every catalogue model)",
    )
    p.add_argument(
        "--platform",
        default="here",
        help="'here' (detect), 'cpu', or a CUDA arch such as sm_90 / sm_100",
    )
    p.add_argument(
        "--installed",
        type=parse_installed,
        default=None,
        metavar="MODULES",
        help="comma-separated optional modules to assume installed on the platform instead of "
        f"probing this machine's ({', '.join(f'{a}={m}' for a, m in OPTIONAL_MODULES.items())}; "
        "'' for none); default: probe this machine, which says little about another --platform",
    )
    p.add_argument(
        "--block-size", type=count_arg("--block-size"), default=16, help="tokens per KV block"
    )
    p.add_argument("--tp", type=count_arg("--tp"), default=1, help="tensor-parallel size")
    p.add_argument("--json", action="store_true", help="print the choices as JSON (for scripts)")
    p.set_defaults(func=cmd_backends)


def parse_installed(text: str) -> frozenset[str]:
    """argparse type of ``--installed``: module names or their aliases (fa2/fa3/fa4)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = set(OPTIONAL_MODULES.values())
    bad = [n for n in names if n not in known and n not in OPTIONAL_MODULES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--installed={text!r}: {', '.join(map(repr, bad))} is not a module the backends "
            f"probe; give any of {', '.join(sorted(known))} (or fa2, fa3, fa4), comma-separated"
        )
    return frozenset(OPTIONAL_MODULES.get(n, n) for n in names)


def parse_platform(text: str, installed: frozenset[str] | None = None) -> Platform:
    """``here``, ``cpu`` or ``sm_90``-style (``installed``: modules assumed there, else probed)."""
    from kv_backends import Platform

    if text == "here":
        here = Platform.detect()
        return here if installed is None else here.with_installed(installed)
    if text == "cpu":
        return Platform.cpu(installed)
    m = re.fullmatch(r"sm_?(\d+?)(\d)a?", text)
    if not m:
        raise ValueError(f"--platform={text!r} is not 'here', 'cpu' or a CUDA arch such as sm_90")
    cc = (int(m.group(1)), int(m.group(2)))
    if cc not in COMPUTE_CAPABILITIES:
        known = ", ".join(f"sm_{a}{b}" for a, b in COMPUTE_CAPABILITIES)
        raise ValueError(
            f"--platform={text!r} is not a CUDA compute capability (from sm_50 to sm_121: {known})"
        )
    return Platform.cuda(cc, installed)


def _group_rows(
    config: AttentionConfig, platform: Platform
) -> tuple[list[dict[str, Any]], str | None, int | None]:
    """One row per backend (name, status, why), the chosen backend and its kernel block size."""
    from kv_backends import BACKEND_PRIORITY, backend_names, get_backend, prepare_kernel_block_sizes

    priority = BACKEND_PRIORITY[platform.name]
    rows: list[dict[str, Any]] = []
    chosen: str | None = None
    kbs: int | None = None
    # Priority order first (the selector's walk), then the backends this platform never tries.
    for name in (*priority, *(n for n in backend_names() if n not in priority)):
        backend = get_backend(name)
        reasons = list(backend.validate(config, platform))
        if name not in priority:
            reasons = [f"not in the {platform.name} priority list", *reasons]
        if not reasons and chosen is None:
            chosen = name
            kbs = prepare_kernel_block_sizes([config.block_size], [[backend]])[0]
            notes = list(backend.selection_notes(config, platform))
            why = [
                f"first usable in priority order {list(priority)}",
                f"kernel block {kbs}",
                *notes,
            ]
            rows.append({"backend": name, "status": "chosen", "reasons": why})
        elif not reasons:
            why = [f"{chosen} comes first in priority order"]
            rows.append({"backend": name, "status": "usable", "reasons": why})
        else:
            rows.append({"backend": name, "status": "rejected", "reasons": reasons})
    return rows, chosen, kbs


_STYLE = {
    "chosen": "[green]chosen[/]",
    "usable": "[green]usable[/]",
    "rejected": "[red]rejected[/]",
}


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("backend", "here", "why"):
        table.add_column(col, overflow="fold")
    for r in rows:
        name = f"[bold green]{r['backend']}[/]" if r["status"] == "chosen" else r["backend"]
        table.add_row(name, _STYLE[r["status"]], "; ".join(r["reasons"]))
    return table


def cmd_backends(args: argparse.Namespace, console: Console) -> int:
    from kv_backends import configs_for_model, describe_config

    platform = parse_platform(args.platform, args.installed)
    named = args.model is not None
    models = [resolve_model(args.model)] if named else list(CATALOGUE.values())
    if named:
        check_tensor_parallel(models[0], args.tp)
    report: list[dict[str, Any]] = []
    for model in models:
        if not named:
            try:
                check_tensor_parallel(model, args.tp)
            except ValueError as e:  # listing everything: say so for this model, go on
                report.append({"model": model.name, "skipped": str(e), "groups": []})
                continue
        configs = configs_for_model(model, block_size=args.block_size, tensor_parallel_size=args.tp)
        arch = resolve_arch(args.model) if named else None
        if arch is not None and arch.attn_softcap:
            # a ModelConfig has no softcap; the engine passes its checkpoint's (Gemma-2) to the
            # selector, so a backend without it is rejected here as there
            configs = {
                k: dataclasses.replace(c, softcap=arch.attn_softcap) for k, c in configs.items()
            }
        groups = []
        for key, config in configs.items():
            rows, chosen, kbs = _group_rows(config, platform)
            groups.append(
                {
                    "group": key,
                    "config": describe_config(config),
                    "chosen": chosen,
                    "kernel_block_size": kbs,
                    "backends": rows,
                }
            )
        report.append({"model": model.name, "groups": groups})
    unserved = [
        f"{m['model']} {g['group']}" for m in report for g in m["groups"] if not g["chosen"]
    ]
    if args.json:
        print(json.dumps({"platform": platform.label, "models": report}, indent=2))
    else:
        _print(console, platform, report, summary=not named)
    if named and unserved:
        sys.stderr.write(
            f"kvstack backends: no backend on {platform.label} serves {', '.join(unserved)}; "
            "see the rejection reasons above (another --platform, or --installed for the "
            "packages it would have)\n"
        )
        return EXIT_NOT_SERVED
    return 0


def _print(
    console: Console, platform: Platform, report: list[dict[str, Any]], summary: bool
) -> None:
    installed = (
        "probed on this machine"
        if platform.installed is None
        else f"assumed installed: {', '.join(sorted(platform.installed)) or 'none'}"
    )
    for m in report:
        if "skipped" in m:
            console.print(f"\n[bold]{m['model']}[/bold]: skipped ({m['skipped']})")
            continue
        console.print(
            f"\n[bold]{m['model']}[/bold] on {platform.label} ({installed}): "
            f"{len(m['groups'])} attention config(s)"
        )
        for g in m["groups"]:
            console.print(_table(f"{g['group']}: {g['config']}", g["backends"]))
    if not summary:
        return
    table = Table(title=f"summary: the backend per KV group on {platform.label}")
    for col in ("model", "group", "backend"):
        table.add_column(col, overflow="fold")
    for m in report:
        if "skipped" in m:
            table.add_row(m["model"], "-", f"[yellow]skipped: {m['skipped']}[/]")
        for g in m["groups"]:
            chosen = g["chosen"]
            table.add_row(
                m["model"],
                g["group"],
                f"{chosen} (kernel block {g['kernel_block_size']})"
                if chosen
                else f"[red]none serves it on {platform.label}[/] (reasons above)",
            )
    console.print()
    console.print(table)
