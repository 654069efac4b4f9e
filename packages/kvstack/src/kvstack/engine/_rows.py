"""Which block-table row each running request holds (the engine's persistent batch).

A decode step mostly keeps every request in its row, so rows move only when the scheduler's
order changes (a request admitted, preempted or finished): then the table rows are swapped, not
rewritten, and the rows that crossed a block boundary get their new blocks in one scatter.
"""

from __future__ import annotations

from kv_blocktable.block_table import BlockTables

from kvstack.engine.scheduler import SchedulerOutput

__all__ = ["BatchRows"]


class BatchRows:
    """Request id <-> row of ``tables`` for up to ``max_rows`` requests."""

    def __init__(self, tables: BlockTables, max_rows: int) -> None:
        self.tables = tables
        self.rows: list[str | None] = [None] * max_rows  # row -> request id
        self.row_of: dict[str, int] = {}

    def release(self, rid: str) -> None:
        row = self.row_of.pop(rid, None)
        if row is not None:
            self.tables.clear_row(row)
            self.rows[row] = None

    def place(self, rid: str, i: int) -> None:
        """Put request ``rid``'s row at index ``i`` (swapping out whoever is there)."""
        cur = self.row_of.get(rid)
        if cur == i:
            return
        other = self.rows[i]
        if cur is None:  # a new request: free row i, moving its holder to an empty row
            if other is not None:
                j = self.rows.index(None)
                self.tables.swap_rows(i, j)
                self.rows[j], self.row_of[other] = other, j
        else:
            self.tables.swap_rows(cur, i)
            self.rows[cur] = other
            if other is not None:
                self.row_of[other] = cur
        self.rows[i], self.row_of[rid] = rid, i

    def prepare(self, out: SchedulerOutput) -> None:
        for rid in out.preempted:
            self.release(rid)
        append_rows: list[int] = []
        append_ids: list[tuple[list[int], ...]] = []
        row_of = self.row_of
        for i, chunk in enumerate(out.chunks):
            rid = chunk.seq.kv.request_id
            if row_of.get(rid) != i:  # a decode step mostly keeps every request's row
                self.place(rid, i)
            if chunk.admitted:
                self.tables.add_row(i, chunk.new_block_ids)
            elif any(chunk.new_block_ids):
                append_rows.append(i)
                append_ids.append(chunk.new_block_ids)
        if append_rows:  # the rows that crossed a block boundary, in one scatter
            self.tables.append_rows(append_rows, append_ids)
        self.tables.commit(len(out.chunks))
