"""The producer's side of a disaggregated transfer: which finished requests it holds for
consumers, and which pulls pin them (see :mod:`kv_connectors.transfer`).

A held request is reported in ``done_sending`` (its blocks may be freed) only when no pull of it is
in flight and either a consumer confirmed a complete pull or no pull started within
``abandon_after_s``. A pull ends when the transport says so (P2P: the producer's sends ended) or,
for a pull with a lease (NIXL READs, which the producer cannot watch), when the consumer's
notification arrives or the lease ends; a consumer never reports success for a READ that ends
after its lease, so blocks freed at a lease's end never reach the engine as loaded KV.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_connectors.base import log

__all__ = ["Held", "ProducerHolds"]


@dataclass
class Held:
    """A finished request a producer keeps for consumers."""

    block_ids: tuple[int, ...]
    deadline: float  # a pull must start by then, else the request is abandoned
    # pull token -> its lease's end (inf: the pull ends only when the transport says so)
    pulls: dict[int, float] = dataclasses.field(default_factory=dict)
    sent: bool = False  # a consumer confirmed a complete pull
    # streamed (P2P stream_request): the engine has not finished the request, so its blocks are
    # still its own; never released before request_finished, whatever a consumer said
    open: bool = False


class ProducerHolds:
    """Mixin of :class:`~kv_connectors.transfer.TransferConnector`: the held requests and their pulls,
    under the connector's ``_lock`` (which also guards ``done_sending``)."""

    _lock: threading.Lock
    _sendable: dict[str, Held]
    _pull_ids: itertools.count[int]
    _clock: Callable[[], float]
    _worker: Any
    config: Any
    # The earliest abandon deadline or lease end of any held request: a poll before it has
    # nothing to expire and skips the scan (``get_finished`` runs every engine step, on the
    # thread whose GIL the transfer threads wait for; issue 30).
    _hold_due: float = float("inf")  # nothing held, nothing due

    def _due_by(self, t: float) -> None:
        """A deadline or lease end at ``t`` now exists (lock held): the next poll after it scans."""
        self._hold_due = min(self._hold_due, t)

    def _start_pull(self, request_id: str, block_ids: Sequence[int], lease_s: float | None) -> int:
        """Pin a held request for one pull; returns the pull's token. ``lease_s``: the pull ends by
        itself after that long (NIXL: a READ the consumer may no longer report as success);
        ``None``: it ends only at :meth:`_end_pull` (P2P: this worker's own sends)."""
        with self._lock:
            held = self._sendable.get(request_id)
            if held is None or held.sent:
                raise KeyError(
                    f"request {request_id!r} is not held for sending (expired or unknown)"
                )
            now = self._clock()
            if held.deadline < now:
                raise KeyError(
                    f"request {request_id!r} is not held for sending: no pull started within "
                    f"abandon_after_s={self.config.abandon_after_s}"
                )
            if not set(block_ids) <= set(held.block_ids):
                raise KeyError(f"request {request_id!r}: blocks asked for are not the request's")
            token = next(self._pull_ids)
            held.pulls[token] = float("inf") if lease_s is None else now + lease_s
            self._due_by(held.pulls[token])
            return token

    def _release_locked(self, request_id: str, held: Held, now: float) -> None:
        """Report ``request_id`` sent once nothing reads its blocks and it is done or abandoned."""
        if held.pulls or held.open or not (held.sent or held.deadline < now):
            return
        del self._sendable[request_id]
        self._worker.done_sending.add(request_id)
        if not held.sent:
            log.warning(
                "request %s: no consumer completed a pull in time; freeing its blocks", request_id
            )

    def _end_pull(self, request_id: str, token: int, *, completed: bool = False) -> None:
        """Pull ``token`` of ``request_id`` ended (``completed``: the consumer has the bytes)."""
        with self._lock:
            held = self._sendable.get(request_id)
            if held is None:
                return
            held.pulls.pop(token, None)
            held.sent = held.sent or completed
            self._release_locked(request_id, held, self._clock())

    def _mark_sent(self, request_id: str, token: int | None = None) -> None:
        """A consumer has the request's bytes (its ``done``): free the blocks once no pull is in
        flight."""
        with self._lock:
            held = self._sendable.get(request_id)
            if held is None:
                return
            if token is not None:
                held.pulls.pop(token, None)
            held.sent = True
            self._release_locked(request_id, held, self._clock())

    def _expire_locked(self) -> None:
        """Drop pulls whose lease ended and release what nothing reads any more (lock held).
        Every other release happens where its cause does (a pull's end, a consumer's ``done``, an
        abort), so only time passing needs a scan: none before the earliest deadline."""
        now = self._clock()
        if now < self._hold_due:
            return
        due = float("inf")
        for rid, held in list(self._sendable.items()):
            for token, lease_end in list(held.pulls.items()):
                if lease_end < now:  # the consumer may no longer report this READ a success
                    del held.pulls[token]
                    log.warning("request %s: pull %d outlived its lease", rid, token)
                else:
                    due = min(due, lease_end)
            self._release_locked(rid, held, now)
            if rid in self._sendable:
                due = min(due, held.deadline)
        self._hold_due = due
