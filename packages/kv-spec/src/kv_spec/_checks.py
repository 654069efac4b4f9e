"""Shared argument checks: every error names the field, the value and what would be valid."""

from __future__ import annotations

__all__ = ["check_bool", "check_int", "check_positive_int"]


def check_int(owner: str, field: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not bool) ``>= minimum``; raise ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{owner}.{field}={value!r} must be an int >= {minimum}; got {type(value).__name__}"
        )
    if value < minimum:
        raise ValueError(f"{owner}.{field}={value} must be >= {minimum}")
    return value


def check_positive_int(owner: str, field: str, value: object) -> int:
    return check_int(owner, field, value, minimum=1)


def check_bool(owner: str, field: str, value: object) -> bool:
    """Return ``value`` if it is a real ``bool``; raise ``ValueError`` otherwise (``1 == True``
    but serializes as ``1``, so two processes would disagree on a hash; ``"no"`` is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(
            f"{owner}.{field}={value!r} must be a bool (True or False), got {type(value).__name__}"
        )
    return value
