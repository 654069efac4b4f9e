"""Where a transfer's host time goes: timestamps around named methods (a diagnostic, issue 30).

:func:`wrap` replaces ``owner.attr`` (a class's method or a module's function) by a wrapper
that records ``"attr >"`` and ``"attr <"`` with ``time.time()`` (one clock for the processes
of a host) and the thread's name into :data:`EVENTS`; :func:`install_transfer` wraps the P2P
connector's host path -- side-channel messages, the wire's sends, receives, copies, waits and
drains, the pull and its ask, and ``start_load_kv``; with NIXL installed, its connector's
reads and the agent's transfer calls too. :func:`timeline` merges
the events of several processes into lines of milliseconds from the first. Used by
``benchmarks/trace_p2p.py`` and kvstack's ``bench_disagg.py --trace``; wrappers cost a few
microseconds each and stay in place for the process's life.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["EVENTS", "install_transfer", "mark", "timeline", "wrap"]

#: ``(time.time(), thread name, event)`` in the order they happened.
EVENTS: list[tuple[float, str, str]] = []


def mark(name: str) -> None:
    """Record ``name`` now, on this thread."""
    EVENTS.append((time.time(), threading.current_thread().name[:14], name))


def wrap(owner: Any, attr: str) -> None:
    """Record entry and exit of ``owner.attr`` from now on (once: a wrapped one is left)."""
    original = getattr(owner, attr)
    if getattr(original, "_host_traced", False):
        return

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        mark(f"{attr} >")
        try:
            return original(*args, **kwargs)
        finally:
            mark(f"{attr} <")

    traced._host_traced = True  # type: ignore[attr-defined]
    setattr(owner, attr, traced)


def install_transfer() -> None:
    """Wrap the P2P connector's host path (module docstring)."""
    from kv_connectors import _p2p_wire, p2p, transfer

    for owner, names in (
        (_p2p_wire.Wire, ("send", "recv", "wait", "drain", "_gather")),
        (p2p.P2pConnector, ("_send_blocks", "_apply_rows")),
        (
            transfer.TransferConnector,
            ("_accept_pull", "_ask_pull", "_pull_bound", "start_load_kv"),
        ),
    ):
        for name in names:
            wrap(owner, name)
    for module in (p2p, transfer):
        for name in ("send_msg", "recv_msg"):
            if hasattr(module, name):
                wrap(module, name)
    try:  # NIXL's pull and the agent calls it makes (not the state polls: every 100 us)
        from nixl._api import nixl_agent

        from kv_connectors import nixl
    except ImportError:
        return
    for name in ("_reads", "_wait_read", "_serve_pull", "_open_peer", "_prep_staging"):
        wrap(nixl.NixlConnector, name)
    for name in ("initialize_xfer", "make_prepped_xfer", "transfer", "prep_xfer_dlist"):
        wrap(nixl_agent, name)


def timeline(
    sides: Sequence[tuple[str, Iterable[tuple[float, str, str]]]], since: float | None = None
) -> list[str]:
    """Lines ``ms side thread event`` of every side's events (from ``since``, default the
    earliest), merged in time order."""
    merged = sorted(
        (t, side, thread, event)
        for side, events in sides
        for t, thread, event in events
        if since is None or t >= since
    )
    if not merged:
        return []
    t0 = merged[0][0] if since is None else since
    return [f"{(t - t0) * 1e3:9.3f}  {side:8s} {th:14s} {ev}" for t, side, th, ev in merged]
