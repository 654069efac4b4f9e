"""``kvstack demo``: the end-to-end tour (see :mod:`kvstack.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstack.cli._args import bytes_arg

__all__ = ["add_parser", "cmd_demo"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="serve a small random-weight model over the whole stack and check it against a reference",
        description="Plans KV caches, serves a batch of requests with shared prefixes through the "
        "reference engine (continuous batching, prefix caching, paged attention), compares the "
        "tokens with a dense reference, and hands a request from a prefill to a decode process.",
    )
    p.add_argument(
        "--memory",
        type=bytes_arg,
        default="40GiB",
        help="KV bytes per GPU for the planning table",
    )
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the demo's model to DIR (new or empty) and keep it, for kvstack generate DIR "
        "(default: a temporary directory, deleted at the end)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    keep = args.keep
    if keep is not None and keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        raise ValueError(
            f"--keep={str(keep)!r} exists and is not an empty directory; give a new or "
            "empty directory (the demo writes config.json and model.safetensors there)"
        )
    from kvstack import demo

    return demo.run(console, memory=args.memory, keep=args.keep)
