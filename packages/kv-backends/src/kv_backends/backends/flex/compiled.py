"""FLEX_ATTENTION's compiled entry point and its Dynamo limits, scoped to our own calls.

Dynamo keeps at most ``recompile_limit`` (8) graphs per code object, and every FlexAttention user
in the process shares ``flex_attention``'s: each distinct (q/kv dtype, head sizes, score_mod
features) of a model's layers is one graph, and a hybrid model with sinks, windows and DiffKV
groups, plus fp16 and bf16 runs in one process, passes 8. With ``fullgraph=True`` the ninth is a
hard failure. The limits are raised only *while our compiled call runs* (:func:`flex_dynamo_limits`),
and put back afterwards: the rest of the process keeps the limits its owner chose.

Raising and restoring them costs ~9 us a forward on the host (four writes and two reads of
Dynamo's config module, Python code), which a forward per layer per step pays for nothing once
the graphs exist: the limits are read only when Dynamo compiles. So the impl raises them for the
first compiled forward of each kind of layer over a metadata (``FlexAttentionMetadata.
compiled_keys``); the later layers of the step call Flex as is, and should one of them miss its
graphs after all (a ``q`` of other strides, say) with the process over its own limit, the
fullgraph call raises :func:`recompile_limit_hit`'s error before compiling anything and the impl runs
it again with the limits raised (Dynamo then logs one warning about the limit).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["FLEX_RECOMPILE_LIMIT", "compiled_flex", "flex_dynamo_limits", "recompile_limit_hit"]

#: Graphs of compiled FlexAttention our calls may hold (see :func:`flex_dynamo_limits`).
FLEX_RECOMPILE_LIMIT = 64

_LIMITS = (
    ("recompile_limit", FLEX_RECOMPILE_LIMIT),
    ("accumulated_recompile_limit", 8 * FLEX_RECOMPILE_LIMIT),
)


@functools.cache
def recompile_limit_hit() -> tuple[type[BaseException], ...]:
    """What a fullgraph compiled call raises when it would compile past Dynamo's recompile
    limit (torch's name has changed across versions; an empty tuple catches nothing, and then
    every compiled forward runs inside :func:`flex_dynamo_limits`). Looked up on first use:
    importing ``torch._dynamo`` is not free."""
    import torch._dynamo.exc as exc

    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    return tuple(t for t in (getattr(exc, n, None) for n in names) if isinstance(t, type))


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
