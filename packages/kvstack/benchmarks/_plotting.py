"""What the benchmark reports share to draw their plots: matplotlib's pyplot on the file backend,
or ``None`` where matplotlib is not installed (the JSON and the tables are written anyway)."""

from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the ``Agg`` backend (no display), or ``None``."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
