"""argparse pieces every command shares: size and count types, a one-line error parser."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kvstack.units import parse_bytes, parse_count

__all__ = ["EXIT_USAGE", "DefaultsFormatter", "Parser", "bytes_arg", "count_arg"]

#: Exit status of bad input (argparse uses the same).
EXIT_USAGE = 2


def bytes_arg(text: str) -> int:
    """argparse type: a byte size such as ``40GiB``."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count_arg(name: str, minimum: int = 1) -> Callable[[str], int]:
    """argparse type: a whole number ``>= minimum`` (``32k`` allowed)."""

    def parse(text: str) -> int:
        try:
            return parse_count(text, name=name, minimum=minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name  # argparse names the type in its messages
    return parse


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, argparse.SUPPRESS)
            or "default" in text
        ):
            return action.help
        if action.default == "":
            return f"{text} (default: none)".lstrip()
        if action.default is False and action.nargs == 0:  # a flag
            return f"{text} (default: off)".lstrip()
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage dump), exit 2; help shows defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(EXIT_USAGE)
