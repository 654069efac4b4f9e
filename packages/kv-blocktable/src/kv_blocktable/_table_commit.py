"""Committing :class:`~kv_blocktable.block_table.BlockTables`' host rows to the device (the
``torch`` extra), and the record of what changed since the last commit (rows marked by
``_touch``, appended entries written by ``_write_entries`` and recorded by ``_appended``, the
wait for a staged copy before the host buffer is written): :meth:`~TableCommit.commit` copies rows ``[0, num_reqs)`` of every group in one
staged copy — on a CPU device only the rows (or, with one unexpanded group, only the appended
entries) written since the last commit — and expands manager blocks to kernel blocks into each
group's kernel table; :meth:`~TableCommit._require_committed` is the check the step's metadata
runs against it. A base class of ``BlockTables``, split out of ``block_table.py`` by job: rows
are edited there, copied to the device here (a method of a base class costs a call what a method
of ``BlockTables`` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from kv_kernels.slot_mapping import compute_slot_mapping, expand_block_table

from kv_blocktable._block_ids import int32_tensor, int64_tensor

__all__ = ["UNRECORDED", "TableCommit", "wait_event"]

#: ``_copy_event`` of a commit whose copy has no event yet: the step's metadata, built next on
#: the same stream, records one event after its own copies, which covers the commit's too (one
#: record a step instead of two: ~10 us of host time each on the H200 machine's host)
UNRECORDED: Any = object()

# Up to this many pending entries are committed one by one through the memoryviews.
_ENTRY_COPIES = 128
# Up to this many appended entries are written through the memoryview one by one (~40 ns each);
# more take one index_copy_ (a few us to build its index and value tensors, ~15 ns an entry).
_ENTRY_WRITES = 128


def wait_event(event: Any) -> None:
    """Wait for a CUDA event's work — asking first whether it ran: a staging copy waited on a
    step later has long run, and ``query`` answers where ``synchronize`` cost 9-16 us of call
    time with nothing to wait for (the engine's H200 profile, same pattern)."""
    if not event.query():
        event.synchronize()


class TableCommit:
    """The host → device commit of the tables :class:`BlockTables` keeps."""

    # Set by BlockTables (declared here for the type checker).
    max_num_reqs: int
    block_sizes: tuple[int, ...]
    kernel_block_sizes: tuple[int, ...]
    impl: str
    _col: tuple[int, ...]
    _pinned: bool
    _host: torch.Tensor
    _dev: torch.Tensor
    _host_flat: torch.Tensor
    _dev_flat: torch.Tensor
    _host_mv: memoryview
    _dev_mv: memoryview | None
    _kernel: tuple[torch.Tensor, ...]
    _track_rows: bool
    _dirty: set[int]
    _pending: list[int]
    _copy_event: Any
    _committed: int | None
    _track_entries: bool
    device: torch.device
    _slots: tuple[torch.Tensor, ...]

    if TYPE_CHECKING:  # BlockTables' own, which the commit reads

        @property
        def kernel_blocks_per_block(self) -> tuple[int, ...]: ...

    def _wait_staged(self) -> None:
        # A non-blocking copy from pinned memory reads the host buffer when the stream gets to
        # it; writing the buffer before then would change what the previous step copies.
        if self._copy_event is not None:
            if self._copy_event is UNRECORDED:  # (no metadata built since the commit)
                self._copy_event = self._record_event()
            wait_event(self._copy_event)
            self._copy_event = None

    def _record_step_event(self) -> Any:
        """The event after a step's staged copies, which also covers the commit's before them
        (:data:`UNRECORDED`)."""
        event = self._record_event()
        if self._copy_event is UNRECORDED:
            self._copy_event = event
        return event

    def _record_event(self) -> Any:
        """A CUDA event recorded on the current stream of the tables' device, where the copies
        just issued run. (The device index is the tables' own: ``torch.cuda.current_stream()``
        without one looks the current device up first, several us of Python a call.)"""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._dev.device.index))
        return event

    def _touch(self, *rows: int) -> None:
        """``rows`` of the host table changed: the device copy is stale until the next commit."""
        if self._track_rows:
            self._dirty.update(rows)
        self._committed = None

    def _write_entries(self, flat: list[int], vals: list[int]) -> None:
        """Host-table entries ``flat`` (flat indices, distinct) get block ids ``vals`` (checked)."""
        self._wait_staged()
        if len(flat) <= _ENTRY_WRITES:  # a decode step's few ids: one by one
            mv = self._host_mv
            for i, b in zip(flat, vals, strict=True):
                mv[i] = b
        else:
            # int64_tensor: torch.tensor(list) costs ~0.1 us per element; ids fit in int32
            # (BlockIdCheck), so the cast is exact.
            self._host_flat.index_copy_(0, int64_tensor(flat), int32_tensor(vals))

    def _appended(self, flat: list[int], rows: list[int]) -> None:
        """Entries ``flat`` of ``rows`` were appended: the commit copies them (or the rows)."""
        if self._track_entries:
            self._pending.extend(flat)  # commit copies these entries, not whole rows
            self._committed = None
        else:
            self._touch(*rows)

    def commit(self, num_reqs: int) -> None:
        """Copy rows ``[0, num_reqs)`` of every group to the device (one copy) and expand them to
        kernel blocks. Call after the step's row changes, before building its metadata."""
        if (
            isinstance(num_reqs, bool)
            or not isinstance(num_reqs, int)
            or not 0 <= num_reqs <= self.max_num_reqs
        ):
            raise ValueError(f"num_reqs={num_reqs!r} must be an int in [0, {self.max_num_reqs}]")
        n = num_reqs
        if self._track_rows:
            self._commit_rows(n)
        else:
            self._dev[:n].copy_(self._host[:n], non_blocking=self._pinned)
            if self._pinned:
                self._copy_event = UNRECORDED
            self._expand(slice(0, n), self._dev[:n])
        self._committed = n

    def _commit_entries(self, n: int) -> None:
        """Copy the appended host entries of rows ``[0, n)`` (the rest stay pending). Runs before
        the dirty rows' copy: an entry of a row also marked dirty is copied again with its row,
        so the host table is what the device gets either way."""
        pending, limit = self._pending, n * self._col[-1]
        if max(pending) < limit:
            todo, self._pending = pending, []
        else:
            todo = [i for i in pending if i < limit]
            self._pending = [i for i in pending if i >= limit]
        if len(todo) <= _ENTRY_COPIES and self._dev_mv is not None:
            # A decode step's few entries, one by one through memoryviews (~60 ns each; the
            # tensor copy below costs ~5 us whatever the count).
            host, dev = self._host_mv, self._dev_mv
            for i in todo:
                dev[i] = host[i]
        elif todo:
            idx = int64_tensor(todo)
            self._dev_flat.index_copy_(0, idx, self._host_flat.index_select(0, idx))

    def _commit_rows(self, n: int) -> None:
        # Host tables: rows outside ``_dirty`` already match the host, so copy only the changed
        # rows below n (rows at or past n stay marked until a commit covers them).
        if self._pending:
            self._commit_entries(n)
        rows = sorted(r for r in self._dirty if r < n)
        if not rows:
            return
        self._dirty.difference_update(rows)
        if len(rows) * 4 >= n:  # most of the batch: slices beat gathers
            self._dev[:n].copy_(self._host[:n])
            self._expand(slice(0, n), self._dev[:n])
        else:
            idx = torch.tensor(rows)
            committed = self._host[idx]  # [len(rows), sum M_g]
            self._dev[idx] = committed
            self._expand(idx, committed)

    def warmup(self) -> None:
        """Build the kernels a step launches on these tables before the first request: the
        expansion to kernel blocks and the slot mapping (Triton on CUDA; nothing to build for
        the torch reference). Each is a compile of ~0.1 s, which otherwise lands in the first
        request's step. Writes nothing a step reads: the slot mapping runs over zero requests
        into the first slot of each group's buffer (``-1``, padding), the expansion into a new
        tensor."""
        if not (self.impl == "triton" or (self.impl == "auto" and self.device.type == "cuda")):
            return
        qsl = torch.zeros(1, dtype=torch.int32, device=self.device)  # zero requests
        pos = torch.empty(0, dtype=torch.int64, device=self.device)
        for g, k in enumerate(self.kernel_blocks_per_block):
            row = self._dev[:1, self._col[g] : self._col[g + 1]]
            if k > 1:
                expand_block_table(
                    row, self.block_sizes[g], self.kernel_block_sizes[g], impl=self.impl
                )
            compute_slot_mapping(
                row[:0], pos, qsl, self.block_sizes[g], self.kernel_block_sizes[g],
                num_slots=1, impl=self.impl, out=self._slots[g][:1],
            )  # fmt: skip

    def _expand(self, rows: slice | torch.Tensor, committed: torch.Tensor) -> None:
        """Write the kernel tables' ``rows`` from their committed manager ids ``committed``."""
        for g, k in enumerate(self.kernel_blocks_per_block):
            if self._kernel[g] is self._dev:
                continue  # aliases the committed table
            manager = committed[:, self._col[g] : self._col[g + 1]]  # [rows, M_g]
            if k > 1:
                manager = expand_block_table(
                    manager, self.block_sizes[g], self.kernel_block_sizes[g], impl=self.impl
                )  # [rows, M_g * k]
            self._kernel[g][rows] = manager

    def _require_committed(self, num_reqs: int, what: str) -> None:
        if self._committed is None:
            raise ValueError(
                f"{what}: rows changed since the last commit (or none happened); call "
                "commit(num_reqs) after the step's row changes"
            )
        if num_reqs > self._committed:
            raise ValueError(
                f"{what}: the batch has {num_reqs} requests but only {self._committed} rows were "
                f"committed; call commit({num_reqs})"
            )
