"""FLEX_ATTENTION's compiled entry point and its Dynamo limits, scoped to our own calls.

Dynamo keeps at most ``recompile_limit`` (8) graphs per code object, and every FlexAttention user
in the process shares ``flex_attention``'s: each distinct (q/kv dtype, head sizes, score_mod
features) of a model's layers is one graph, and a hybrid model with sinks, windows and DiffKV
groups, plus fp16 and bf16 runs in one process, passes 8. With ``fullgraph=True`` the ninth is a
hard failure. The limits are raised only *while our compiled call runs* (:func:`flex_dynamo_limits`),
and put back afterwards: the rest of the process keeps the limits its owner chose.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["FLEX_RECOMPILE_LIMIT", "compiled_flex", "flex_dynamo_limits"]

#: Graphs of compiled FlexAttention our calls may hold (see :func:`flex_dynamo_limits`).
FLEX_RECOMPILE_LIMIT = 64

_LIMITS = (
    ("recompile_limit", FLEX_RECOMPILE_LIMIT),
    ("accumulated_recompile_limit", 8 * FLEX_RECOMPILE_LIMIT),
)


@contextmanager
def flex_dynamo_limits() -> Iterator[None]:
    """Raise Dynamo's recompile limits to at least :data:`FLEX_RECOMPILE_LIMIT` for the duration
    of the block (never lower them), then restore the previous values.

    Cheap on the hot path: when the process already allows enough graphs nothing is written.
    Not thread-safe with respect to other code changing the same limits concurrently (Dynamo's
    config is process-global by torch's design).
    """
    cfg = torch._dynamo.config
    saved: list[tuple[str, Any]] = []
    for name, floor in _LIMITS:
        current = getattr(cfg, name, None)
        if current is not None and current < floor:
            saved.append((name, current))
            setattr(cfg, name, floor)
    try:
        yield
    finally:
        for name, value in saved:
            setattr(cfg, name, value)


@functools.cache
def compiled_flex(static: bool = False) -> Any:
    """``torch.compile``'d ``flex_attention``, one per process and mode (a memo, not configuration).

    ``static=True``: one graph per shape (``dynamic=False``). Used on the CPU, where inductor's C++
    Flex template fails to compile dynamic-shape graphs with a sliding-window mask (torch 2.15:
    undeclared ``cur_kvSplitSize``), which every second batch shape would hit. Otherwise torch marks
    shapes dynamic after the first recompile, so batches of different sizes share a graph.

    Call it inside :func:`flex_dynamo_limits`.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True, dynamic=False if static else None)
