"""The ``kvstack`` command line: ``demo``, ``generate``, ``plan``, ``backends``, ``bench``, ``models``.

Every command has ``--help``. Bad input (an unknown model, a size such as ``abc``, ``-1`` or
``1e400``, a tensor-parallel size that does not split the heads) prints one ``error:`` line on
stderr and exits 2, never a traceback (set ``KVSTACK_DEBUG=1`` to see one). A plan that cannot
serve one request exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from kvstack.cli import backends, bench, demo_cmd, generate, plan
from kvstack.cli._args import EXIT_USAGE, Parser

__all__ = ["DISTRIBUTIONS", "build_parser", "main", "versions"]

#: The packages of the stack, top to bottom, as ``kvstack --version`` lists them.
DISTRIBUTIONS = (
    "kvstack",
    "kv-connectors",
    "kv-blocktable",
    "kv-backends",
    "kv-kernels",
    "kv-spec",
)


def versions() -> str:
    """Each package's installed version, one per line (and where a checkout is imported from)."""
    from importlib.metadata import PackageNotFoundError, version

    from kvstack._hints import workspace_root

    lines = []
    for dist in DISTRIBUTIONS:
        try:
            lines.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            lines.append(f"{dist} not installed")
    root = workspace_root()
    if root is not None:
        lines.append(f"(from the workspace checkout at {root})")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
            help="print each package's version and exit",
        )  # fmt: skip

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvstack",
        description="The paged KV-cache layer of LLM inference: plan caches, pick attention "
        "backends, run a small reference engine over the whole stack.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    demo_cmd.add_parser(sub)
    generate.add_parser(sub)
    plan.add_parsers(sub)
    backends.add_parser(sub)
    bench.add_parser(sub)
    return parser


def _console() -> Console:
    console = Console()
    # pipes and CI logs: don't fold tables to 80 columns
    return console if console.is_terminal else Console(width=160)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = _console()
    try:
        return int(args.func(args, console))
    except KeyboardInterrupt:
        sys.stderr.write("kvstack: interrupted\n")
        return 130
    except Exception as e:
        if os.environ.get("KVSTACK_DEBUG"):
            raise
        first, *rest = str(e).strip().splitlines() or [type(e).__name__]
        msg = first if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {first}"
        sys.stderr.write(f"kvstack {args.command}: error: {msg}\n")
        # Selector errors carry one rejection per line: worth keeping, indented under the error.
        for line in rest:
            sys.stderr.write(f"  {line.strip()}\n")
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
