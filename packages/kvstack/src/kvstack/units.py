"""Sizes as people write them on a command line: ``40GiB``, ``512MiB``, ``1.5e9``, ``32k``."""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["MAX_BYTES", "format_bytes", "parse_bytes", "parse_count"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: Byte sizes above this are typos, not memory budgets (2^60 = 1 EiB; int64 offsets stay exact).
MAX_BYTES = 2**60

# A non-negative decimal with an optional exponent; the sign is matched so "-1" gets its own error.
_NUMBER = re.compile(r"\s*([+-]?)([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """``"40GiB"`` -> 42949672960.

    Raises ``ValueError`` naming the text and the fix for anything that is not a whole, positive,
    finite number of bytes up to :data:`MAX_BYTES` (``abc``, ``-1``, ``0``, ``1e400``, ``0.5b``).
    """
    m = _NUMBER.fullmatch(text)
    unit = m.group(3).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a byte size; write e.g. 40GiB, 512MiB or 1e9 "
            f"(units: {'/'.join(k for k in _UNITS if k)})"
        )
    if m.group(1) == "-":
        raise ValueError(f"byte size {text!r} is negative; give a positive size such as 40GiB")
    # Decimal, not float: sizes past 2^53 bytes stay exact, and 1e400 is big rather than inf.
    value = Decimal(m.group(2)) * _UNITS[unit]
    if value > MAX_BYTES:
        raise ValueError(
            f"byte size {text!r} is larger than {format_bytes(MAX_BYTES)}; give a real memory size"
        )
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    if value <= 0:
        raise ValueError(f"byte size {text!r} is zero; give a positive size such as 40GiB")
    return int(value)


def parse_count(text: str, *, name: str = "value", minimum: int = 1) -> int:
    """A whole number such as ``32768`` or ``32k`` (k = 1024) that is at least ``minimum``."""
    m = re.fullmatch(r"\s*([+-]?[0-9]+)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"{name}={text!r} is not a whole number; write e.g. 32768 or 32k")
    value = int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]
    if value < minimum:
        raise ValueError(f"{name}={text!r} must be at least {minimum}")
    if value > 2**62:
        raise ValueError(f"{name}={text!r} is beyond 2^62; give a realistic number")
    return value


def format_bytes(n: float) -> str:
    """``65536`` -> ``"64.00 KiB"`` (binary units, two decimals)."""
    for unit, size in (
        ("EiB", 2**60),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
