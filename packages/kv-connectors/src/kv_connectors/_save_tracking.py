"""Per-request save accounting for a store that saves a running request's blocks as they fill
(``blocks_computed``) and the rest at ``request_finished``: which blocks each running request
has shown the store, how many of its saves are still open, and which finished requests wait for
theirs (their ``done_sending``, after the last one). :class:`~kv_connectors.OffloadingConnector`
and :class:`~kv_connectors.FilesystemConnector` keep one each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SaveTracker", "TrackedSaves"]


@dataclass
class SaveTracker:
    """See the module docstring. Request ids only; the store keeps what its saves hold."""

    #: running request -> its blocks already seen (planned, or found stored)
    progress: dict[str, int] = field(default_factory=dict)
    #: request -> its saves planned and not yet landed or dropped
    open: dict[str, int] = field(default_factory=dict)
    #: finished requests whose saves are still open
    finished: set[str] = field(default_factory=set)

    def new_blocks(self, request_id: str, num_blocks: int) -> int | None:
        """``blocks_computed`` of a request with ``num_blocks`` complete blocks: the first one
        not seen yet (and they are seen now), or None when none is new."""
        start = self.progress.get(request_id, 0)
        if num_blocks <= start:
            return None
        self.progress[request_id] = num_blocks
        return start

    def finishing(self, request_id: str) -> int:
        """``request_finished``: the first block not seen while the request ran (it runs no more)."""
        return self.progress.pop(request_id, 0)

    def opened(self, request_id: str) -> None:
        """A save of ``request_id`` was planned."""
        self.open[request_id] = self.open.get(request_id, 0) + 1

    def keep(self, request_id: str) -> bool:
        """After ``request_finished`` planned its saves: whether the request's blocks must stay
        (``delay_free``: a save is open); it is reported by :meth:`closed` after the last."""
        if not self.open.get(request_id):
            return False
        self.finished.add(request_id)
        return True

    def closed(self, request_id: str) -> bool:
        """One save of ``request_id`` landed or was dropped: True when the request finished and
        that was its last open save (report it in ``done_sending``)."""
        left = self.open[request_id] - 1
        if left:
            self.open[request_id] = left
            return False
        del self.open[request_id]
        if request_id in self.finished:
            self.finished.discard(request_id)
            return True
        return False

    def is_open(self, request_id: str) -> bool:
        return bool(self.open.get(request_id))

    def forget(self, request_id: str) -> None:
        """The request was preempted or aborted: what it showed the store is forgotten (a resumed
        request shows its blocks again, and a block the store could not take then is retried)."""
        self.progress.pop(request_id, None)


class TrackedSaves:
    """The contract's save calls of a store over one :class:`SaveTracker` (mixed in before
    :class:`~kv_connectors.KVConnector`): ``blocks_computed`` and ``request_finished`` plan the
    blocks the request has not shown yet through the store's ``_plan_save(request, block_ids,
    start)`` (which calls ``self._tracker.opened`` for each save it plans), and each save's
    landing or drop goes through :meth:`_close_save`."""

    _tracker: SaveTracker
    _worker: Any  # (KVConnector's worker state: done_sending)
    _drop_planned_saves: Callable[[str], bool]  # (KVConnector's, after this class in the MRO)

    def _plan_save(self, request: Any, block_ids: Sequence[int], start: int) -> None:
        raise NotImplementedError

    def blocks_computed(self, request: Any, block_ids: Sequence[int]) -> None:
        start = self._tracker.new_blocks(request.request_id, len(request.block_hashes))
        if start is not None:
            self._plan_save(request, block_ids, start)

    def request_finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._plan_save(request, block_ids, self._tracker.finishing(rid))
        return self._tracker.keep(rid), None

    def _saves_open(self, request_id: str) -> bool:
        return self._tracker.is_open(request_id)

    def _close_save(self, request_id: str) -> None:
        """One save of ``request_id`` landed or was dropped (a finished request whose last it
        was goes to ``done_sending``)."""
        if self._tracker.closed(request_id):
            self._worker.done_sending.add(request_id)

    def _abort(self, request_id: str) -> None:
        self._tracker.forget(request_id)

    def _preempted(self, request_ids: set[str]) -> None:
        """``handle_preemptions``' bookkeeping: each request's blocks are forgotten (a resumed
        request shows them again) and its saves planned but not handed off are dropped (they
        would read the freed blocks after the engine's next writes)."""
        for rid in request_ids:
            self._tracker.forget(rid)
            self._drop_planned_saves(rid)
