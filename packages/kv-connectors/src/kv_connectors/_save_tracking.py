"""Per-request save accounting for a store that saves a running request's blocks as they fill
(``blocks_computed``) and the rest at ``request_finished``: which blocks each running request
has shown the store, how many of its saves are still open, and which finished requests wait for
theirs (their ``done_sending``, after the last one). :class:`~kv_connectors.OffloadingConnector`
and :class:`~kv_connectors.FilesystemConnector` keep one each."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SaveTracker"]


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
