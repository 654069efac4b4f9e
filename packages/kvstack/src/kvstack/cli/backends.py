"""``kvstack backends``: which attention backends can serve a model here, chosen per group, and why."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

from kv_spec import CATALOGUE
from rich.console import Console
from rich.table import Table

from kvstack.cli._args import count_arg
from kvstack.planning import check_tensor_parallel, resolve_model

if TYPE_CHECKING:
    from kv_backends import AttentionConfig, Platform

__all__ = ["add_parser", "cmd_backends", "parse_platform"]

# kv_backends imports torch (seconds): imported inside the command so `plan`, `--help` stay fast.


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "backends",
        help="the attention backends usable here for a model, the one chosen per group, and why",
        description="For each KV group of the model: every backend the platform knows, whether it "
        "validates, every rejection reason, the one the selector picks, and its kernel block size.",
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
    p.add_argument("--block-size", type=count_arg("--block-size"), default=16)
    p.add_argument("--tp", type=count_arg("--tp"), default=1, help="tensor-parallel size")
    p.set_defaults(func=cmd_backends)


def parse_platform(text: str) -> Platform:
    """``here``, ``cpu`` or ``sm_90``-style (modules probed on this machine)."""
    from kv_backends import Platform

    if text == "here":
        return Platform.detect()
    if text == "cpu":
        return Platform.cpu()
    m = re.fullmatch(r"sm_?(\d+)(\d)", text)
    if not m:
        raise ValueError(f"--platform={text!r} is not 'here', 'cpu' or a CUDA arch such as sm_90")
    return Platform.cuda((int(m.group(1)), int(m.group(2))))


def _group_table(
    title: str, config: AttentionConfig, platform: Platform
) -> tuple[Table, str | None]:
    from kv_backends import BACKEND_PRIORITY, backend_names, get_backend, prepare_kernel_block_sizes

    table = Table(title=title, title_justify="left")
    for col in ("backend", "here", "why"):
        table.add_column(col, overflow="fold")
    priority = BACKEND_PRIORITY[platform.name]
    chosen: str | None = None
    # Priority order first (the selector's walk), then the backends this platform never tries.
    for name in (*priority, *(n for n in backend_names() if n not in priority)):
        backend = get_backend(name)
        reasons = backend.validate(config, platform)
        if name not in priority:
            reasons = [f"not in the {platform.name} priority list", *reasons]
        if not reasons and chosen is None:
            chosen = name
            kbs = prepare_kernel_block_sizes([config.block_size], [[backend]])[0]
            notes = "; ".join(backend.selection_notes(config, platform))
            why = f"first usable in priority order {list(priority)}; kernel block {kbs}" + (
                f"; {notes}" if notes else ""
            )
            table.add_row(f"[bold green]{name}[/]", "[green]chosen[/]", why)
        elif not reasons:
            table.add_row(name, "[green]usable[/]", f"{chosen} comes first in priority order")
        else:
            table.add_row(name, "[red]rejected[/]", "; ".join(reasons))
    return table, chosen


def cmd_backends(args: argparse.Namespace, console: Console) -> int:
    from kv_backends import configs_for_model, describe_config

    platform = parse_platform(args.platform)
    models = [resolve_model(args.model)] if args.model else list(CATALOGUE.values())
    missing = []
    for model in models:
        check_tensor_parallel(model, args.tp)
        configs = configs_for_model(model, block_size=args.block_size, tensor_parallel_size=args.tp)
        console.print(
            f"\n[bold]{model.name}[/bold] on {platform.label}: {len(configs)} attention config(s)"
        )
        for key, config in configs.items():
            table, chosen = _group_table(f"{key}: {describe_config(config)}", config, platform)
            console.print(table)
            if chosen is None:
                missing.append(f"{model.name} {key}")
    if missing:
        raise ValueError(f"no backend on {platform.label} serves: {', '.join(missing)}")
    return 0
