"""The backends. Each module holds one backend class with one literal ``CAPABILITIES``."""

from __future__ import annotations

__all__: list[str] = []
