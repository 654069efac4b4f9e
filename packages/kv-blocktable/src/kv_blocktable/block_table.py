"""Per-request block tables on the worker: one int32 table per KV-cache group (the ``torch`` extra).

A :class:`BlockTables` holds, for every KV group of a model, a table of *manager* block ids with
one persistent row per batch slot. The scheduler's :class:`~kv_blocktable.KVCacheManager` hands out
block ids; the worker mirrors them here with :meth:`~BlockTables.add_row` /
:meth:`~BlockTables.append_row` (:meth:`~BlockTables.append_rows` for a whole step's new blocks
in one scatter) and keeps rows in batch order with :meth:`~BlockTables.move_row` /
:meth:`~BlockTables.swap_rows` (condensing after finished requests, reordering decodes first) —
rows persist across steps, so a step only writes what changed.

Each step then:

1. :meth:`~BlockTables.commit` copies the first ``num_reqs`` rows of every group to the device in
   **one** staged copy (the groups' tables are column ranges of one pinned host buffer, so the
   rows of all groups are one contiguous range), and expands manager blocks to kernel blocks
   (``b * k + i``, kv-kernels' ``expand_block_table``) into a persistent int32 table per group;
2. :meth:`~BlockTables.build_common_metadata` turns the step's query and sequence lengths into one
   :class:`kv_backends.CommonAttentionMetadata` per group (shared ``query_start_loc`` /
   ``seq_lens``, each with its kernel block table and slot mapping), which any kv-backends builder
   takes as is.

Unused table columns hold ``-1`` (kv-kernels' padding value), so a token outside its row's blocks
gets slot ``-1``, never another request's page; the host check in
:meth:`~BlockTables.build_common_metadata` refuses such a batch before it reaches a kernel.

Buffers are persistent: the tensors of one step's metadata are views that the next
:meth:`~BlockTables.commit` / :meth:`~BlockTables.build_common_metadata` overwrites (the vLLM
contract; CUDA graphs need the fixed addresses). Exports for other kernel families are in
:mod:`kv_blocktable.attn_metadata`: FlashInfer-style CSR pages and FlexAttention's physical →
logical block map.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from kv_kernels.slot_mapping import compute_slot_mapping
from kv_spec._checks import check_bool

from kv_blocktable import attn_metadata as _md
from kv_blocktable._block_ids import (
    BlockIdCheck,
    check_append_args,
    check_group_sizes,
    check_index_tensor,
    check_kernel_block_split,
    check_num_blocks,
    int32_memoryview,
    int64_tensor,
    plan_checked_appends,
    plan_decode_appends,
    plan_single_appends,
    positive_int,
)
from kv_blocktable._host_decode import HostDecode
from kv_blocktable._table_commit import TableCommit, wait_event
from kv_blocktable._table_exports import StepExports
from kv_blocktable.attn_metadata import KeyWindow
from kv_blocktable.pool import NULL_BLOCK_ID

if TYPE_CHECKING:
    from kv_backends import CommonAttentionMetadata
    from kv_spec import KVCacheConfig

__all__ = ["BlockTables", "KeyWindow", "check_kernel_block_split", "int64_tensor"]

_IMPLS = ("auto", "reference", "triton")
# Per group: flat table index of each row's column 0, kernel table rows, slot buffer entries.
_DecodeViews = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


class BlockTables(TableCommit, StepExports):
    """The block tables of one model: one int32 table per KV group, persistent rows.

    Args:
        block_sizes: manager block size of each group (``KVCacheConfig.groups[g].spec.block_size``).
        kernel_block_sizes: the page size each group's kernels address (a divisor of the block
            size; see :func:`kv_backends.prepare_kernel_block_sizes`).
        max_num_reqs: rows (batch slots).
        max_num_blocks_per_req: columns of each group's manager table.
        device: where the tables the kernels read live.
        pin_memory: stage host→device copies from pinned memory (asynchronous copies on CUDA).
        max_num_batched_tokens: tokens per step; sizes the slot-mapping buffers (the longest
            padded length a CUDA graph may capture).
        num_blocks: blocks in the cache when known; block ids are then checked against it and
            :meth:`flex_physical_to_logical` is available.
        null_block: the pool's null block id (``0``): a sliding-window row holds it where blocks
            fell out of the window; no new token may be written to it, and exports never map it
            to a position.
        key_windows: per group, the :class:`KeyWindow` of sliding-window / chunked-local groups
            (``None``: full attention). :meth:`flex_physical_to_logical` skips blocks before a
            request's window, whose ids the row may still hold after the pool reused them.
        impl: kv-kernels implementation for the expansion and slot mapping (``"auto"``: Triton
            on CUDA, the torch reference on the CPU).
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        kernel_block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_blocks_per_req: Sequence[int],
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        max_num_batched_tokens: int,
        num_blocks: int | None = None,
        null_block: int | None = NULL_BLOCK_ID,
        key_windows: Sequence[KeyWindow | None] | None = None,
        impl: str = "auto",
    ) -> None:
        owner = "BlockTables"
        self.block_sizes, self.kernel_block_sizes, self.max_num_blocks_per_req = check_group_sizes(
            owner, block_sizes, kernel_block_sizes, max_num_blocks_per_req
        )
        self.max_num_reqs = positive_int(owner, "max_num_reqs", max_num_reqs)
        self.max_num_batched_tokens = positive_int(
            owner, "max_num_batched_tokens", max_num_batched_tokens
        )
        self.num_blocks = check_num_blocks(owner, num_blocks, self.kernel_blocks_per_block)
        if null_block is not None and (
            isinstance(null_block, bool) or not isinstance(null_block, int) or null_block < 0
        ):
            raise ValueError(f"{owner}: null_block={null_block!r} must be an int >= 0 or None")
        self.null_block = null_block
        num_groups = self.num_groups
        windows = tuple(key_windows) if key_windows is not None else (None,) * num_groups
        if len(windows) != num_groups or not all(
            w is None or isinstance(w, KeyWindow) for w in windows
        ):
            raise ValueError(
                f"{owner}: key_windows must hold {num_groups} KeyWindow-or-None entries (one per "
                f"KV group); got {key_windows!r}"
            )
        self.key_windows: tuple[KeyWindow | None, ...] = windows
        if impl not in _IMPLS:
            raise ValueError(f"{owner}: impl={impl!r} is not one of {_IMPLS}")
        self.impl = impl
        self._ids = BlockIdCheck(null_block, num_blocks, self.kernel_blocks_per_block)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{owner}: device={device!r} is not a torch device: {e}") from None
        self.pin_memory = check_bool(owner, "pin_memory", pin_memory)
        self._alloc_buffers()

    def _alloc_buffers(self) -> None:
        # The groups' manager tables are column ranges of one row-major buffer, so rows
        # [0, num_reqs) of every group are one contiguous range: one copy per commit, and a move or
        # swap of a row is one op for all groups.
        cols = [0]
        for m in self.max_num_blocks_per_req:
            cols.append(cols[-1] + m)
        self._col = tuple(cols)
        shape = (self.max_num_reqs, cols[-1])
        # Pinned staging only pays (and only works) for copies to a CUDA device.
        pin = self._pinned = self.pin_memory and self.device.type == "cuda"
        self._host = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)  # [R, sum M_g]
        self._dev = torch.full(shape, -1, dtype=torch.int32, device=self.device)  # [R, sum M_g]
        # Blocks in each row, per group (host only: the scheduler side is the truth). Lists, not
        # a tensor: each step reads them all and writes a few, cheaper than torch ops on [R, G].
        self._row_blocks = [[0] * self.num_groups for _ in range(self.max_num_reqs)]
        if self.num_groups == 1 and self.kernel_blocks_per_block == (1,):
            # One group whose kernel blocks are its manager blocks: the committed table is the
            # kernel table (same shape, contiguous), so commit skips a copy of every row.
            self._kernel: tuple[torch.Tensor, ...] = (self._dev,)
        else:
            self._kernel = tuple(  # per group [R, M_g * k_g] kernel block ids, -1 past a row's end
                torch.full((self.max_num_reqs, m * k), -1, dtype=torch.int32, device=self.device)
                for m, k in zip(
                    self.max_num_blocks_per_req, self.kernel_blocks_per_block, strict=True
                )
            )
        # Host tables: rows written since they were last committed. A commit copies (and
        # expands) only those; a decode step changes the few rows that crossed a block boundary.
        # CUDA tables copy rows [0, num_reqs) in one asynchronous copy instead (no host work to
        # save), so nothing is tracked there.
        self._track_rows = self.device.type == "cpu"
        self._dirty: set[int] = set()
        # Appends change a few entries of a row: with one group whose kernel table is the
        # committed table (nothing to expand), commit copies just those flat host indices (a
        # decode step's new blocks, one per row that crossed a block boundary) instead of rows.
        self._track_entries = self._track_rows and self._kernel[0] is self._dev
        self._pending: list[int] = []
        self._slots = tuple(  # per group [max_num_batched_tokens] int64, -1 = padding
            torch.full((self.max_num_batched_tokens,), -1, dtype=torch.int64, device=self.device)
            for _ in range(self.num_groups)
        )
        self._step = _md.StepBuffers(
            self.max_num_reqs, self.max_num_batched_tokens, self.device, pin
        )
        # CUDA events of the last non-blocking copy out of each pinned buffer (tables, step).
        self._copy_event: Any = None
        self._step_event: Any = None
        self._views: dict[tuple[int, int], _DecodeViews] = {}  # see _decode_views
        # Flat views of the tables, for the decode lookup and the entry commit; memoryviews
        # write (and on a CPU device commit) a decode step's few appended entries one by one.
        self._host_flat = self._host.view(-1)
        self._dev_flat = self._dev.view(-1)
        self._host_mv = int32_memoryview(self._host_flat)
        self._dev_mv = int32_memoryview(self._dev_flat) if self.device.type == "cpu" else None
        self._committed: int | None = None  # num_reqs of the last commit; None = stale
        self._host_decode = HostDecode.of(self)  # a decode on host tables, built in place
        self._last_step: _md.StepInputs | None = None
        self._positions: torch.Tensor | None = None

    @classmethod
    def from_config(
        cls,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: Sequence[int] | None = None,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        impl: str = "auto",
    ) -> BlockTables:
        """Block tables for a planned cache: one group per ``kv_cache_config.groups`` entry, in order.

        ``kernel_block_sizes`` defaults to each group's block size. A kernel block size below the
        block size is checked against the group's layout (:func:`check_kernel_block_split`):
        cross-layer orders, head-major blocks and padded pages are refused with the reason. MLA
        groups store one latent per token, which splits like any NHD page.
        """
        from kv_spec import KVCacheConfig

        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(
                f"BlockTables.from_config: kv_cache_config is a {type(kv_cache_config).__name__}; "
                "pass the kv_spec.KVCacheConfig that kv_spec.plan_kv_cache returns"
            )
        positive_int("BlockTables.from_config", "max_model_len", max_model_len)
        groups = kv_cache_config.groups
        block_sizes = [g.spec.block_size for g in groups]
        kbs = list(block_sizes if kernel_block_sizes is None else kernel_block_sizes)
        if len(kbs) != len(groups):
            raise ValueError(
                f"BlockTables.from_config: got {len(kbs)} kernel_block_sizes for "
                f"{len(groups)} KV groups; pass one per group in KVCacheConfig.groups order"
            )
        for g, size in enumerate(kbs):
            check_kernel_block_split(g, kv_cache_config.layout(g), size)
        return cls(
            block_sizes,
            kbs,
            max_num_reqs,
            # A sliding-window row keeps every column up to max_model_len (out-of-window blocks
            # become the null block), so every group needs the full length.
            [-(-max_model_len // b) for b in block_sizes],
            device=device,
            pin_memory=pin_memory,
            max_num_batched_tokens=max_num_batched_tokens,
            num_blocks=kv_cache_config.num_blocks,
            key_windows=[KeyWindow.of_spec(g.spec) for g in groups],
            impl=impl,
        )

    # -- shape facts -------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    @property
    def kernel_blocks_per_block(self) -> tuple[int, ...]:
        """``k`` per group: manager block ``b`` is kernel blocks ``b * k .. b * k + k - 1``."""
        return tuple(
            b // kb for b, kb in zip(self.block_sizes, self.kernel_block_sizes, strict=True)
        )

    def num_blocks_of_row(self, row: int) -> tuple[int, ...]:
        """Manager blocks held by ``row`` in each group."""
        self._check_row("row", row)
        return tuple(self._row_blocks[row])

    def host_table(self, group: int) -> torch.Tensor:
        """Group ``group``'s manager table on the host, ``[max_num_reqs, max_blocks]`` int32
        (a view: read it, change it only through the row methods)."""
        self._check_group(group)
        return self._host[:, self._col[group] : self._col[group + 1]]

    def device_table(self, group: int) -> torch.Tensor:
        """Group ``group``'s committed manager table on the device (a view)."""
        self._check_group(group)
        return self._dev[:, self._col[group] : self._col[group + 1]]

    def kernel_table(self, group: int) -> torch.Tensor:
        """Group ``group``'s committed kernel block table, ``[max_num_reqs, max_blocks * k]`` int32."""
        self._check_group(group)
        return self._kernel[group]

    # -- checks ------------------------------------------------------------------------------

    def _check_row(self, name: str, row: object) -> int:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.max_num_reqs:
            raise ValueError(
                f"{name}={row!r} is not a row in [0, max_num_reqs={self.max_num_reqs}); "
                "raise max_num_reqs or condense the batch"
            )
        return row

    def _check_group(self, group: object) -> int:
        if (
            isinstance(group, bool)
            or not isinstance(group, int)
            or not 0 <= group < self.num_groups
        ):
            raise ValueError(f"group={group!r} is not in [0, {self.num_groups}) (one per KV group)")
        return group

    # -- rows --------------------------------------------------------------------------------

    def _write(self, row: int, ids: list[torch.Tensor], *, start: Sequence[int]) -> None:
        for g, t in enumerate(ids):
            end = start[g] + t.numel()
            if end > self.max_num_blocks_per_req[g]:
                raise ValueError(
                    f"row {row} group {g} would hold {end} blocks (block_size="
                    f"{self.block_sizes[g]}, {end * self.block_sizes[g]} tokens), more than "
                    f"max_num_blocks_per_req={self.max_num_blocks_per_req[g]}; raise max_model_len "
                    "or finish the request"
                )
        self._wait_staged()
        for g, t in enumerate(ids):
            c0 = self._col[g] + start[g]
            self._host[row, c0 : c0 + t.numel()] = t.to(torch.int32)
            self._row_blocks[row][g] = start[g] + t.numel()
        self._touch(row)

    def add_row(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Give ``row`` these manager block ids per group (replacing what it held)."""
        self._check_row("row", row)
        ids = self._ids.tensors(row, block_ids)
        self._write(row, ids, start=[0] * self.num_groups)
        self._wait_staged()
        for g in range(self.num_groups):  # the rest of the row is padding again
            c0 = self._col[g] + self._row_blocks[row][g]
            self._host[row, c0 : self._col[g + 1]] = -1

    def append_row(self, row: int, new_block_ids: tuple[list[int], ...]) -> None:
        """Append newly allocated manager block ids per group to ``row``."""
        self.append_rows([row], [new_block_ids])

    def append_rows(
        self, rows: Sequence[int], new_block_ids: Sequence[tuple[list[int], ...]]
    ) -> None:
        """:meth:`append_row` for many rows at once: ``rows[i]`` gets ``new_block_ids[i]``.

        Everything is checked before anything is written (a bad row or id changes no row), then
        all ids land in the host table with one scatter: a decode step appends to the few rows
        that crossed a block boundary in one call instead of a few torch ops per row. A row may
        appear more than once; its appends apply in order.
        """
        check_append_args(rows, new_block_ids)
        if not rows:
            return
        if len(self._col) == 2:
            # One group, a decode step's appends in row order (allocate_decode_slots' rows):
            # one checked loop, and the grown rows' counts advanced in place.
            decode = plan_decode_appends(
                rows,
                new_block_ids,
                self._row_blocks,
                self._col[1],
                self.max_num_blocks_per_req[0],
                self._ids.max_ids[0],
            )
            if decode is not None:
                grown, flat, vals = decode
                self._write_entries(flat, vals)
                rb = self._row_blocks
                for row in grown:
                    rb[row][0] += 1
                self._appended(flat, grown)
                return
        # A decode step's appends (at most one id per group and row) in one checked loop; any
        # other shape, or anything the loop would refuse, takes the general checks.
        planned = plan_single_appends(
            rows,
            new_block_ids,
            self._row_blocks,
            self._col,
            self.max_num_blocks_per_req,
            self._ids.max_ids,
        )
        written: Sequence[Sequence[Sequence[int]]] = new_block_ids
        if planned is None:
            rows, written, planned = plan_checked_appends(self, rows, new_block_ids)
        ends, flat, vals = planned
        if len(ends) == 1 and len(rows) == 1:  # append_row: slices, cheaper than a scatter
            self._wait_staged()
            ((row, end),) = ends.items()
            for g, ids in enumerate(written[0]):  # lists of ints, checked
                if ids:
                    c1 = self._col[g] + end[g]
                    self._host[row, c1 - len(ids) : c1] = torch.tensor(ids, dtype=torch.int32)
        else:
            self._write_entries(flat, vals)
        for row, end in ends.items():
            self._row_blocks[row] = end
        self._appended(flat, list(ends))

    def clear_row(self, row: int) -> None:
        """Empty ``row`` (its request finished or was preempted)."""
        self._check_row("row", row)
        self._wait_staged()
        self._host[row] = -1
        self._row_blocks[row] = [0] * self.num_groups
        self._touch(row)

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` to ``dst`` (every group); ``src`` is left as it was."""
        self._check_row("src", src)
        self._check_row("dst", dst)
        self._wait_staged()
        self._host[dst] = self._host[src]
        self._row_blocks[dst] = list(self._row_blocks[src])
        self._touch(dst)

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (every group)."""
        self._check_row("a", a)
        self._check_row("b", b)
        self._wait_staged()
        idx = torch.tensor([a, b])
        self._host[idx] = self._host[idx.flip(0)]
        rb = self._row_blocks
        rb[a], rb[b] = rb[b], rb[a]
        self._touch(a, b)

    # -- per step ----------------------------------------------------------------------------

    def _decode_views(self, num_reqs: int, padded: int) -> _DecodeViews:
        """What a decode step of ``num_reqs`` requests padded to ``padded`` tokens reads and
        writes, made once per size (views of the persistent buffers stay valid): per group the
        ``[R]`` int64 flat table index of each row's column 0 (``row * width + first column``),
        the kernel table's first ``R`` rows and the slot buffer's first ``padded`` entries."""
        got = self._views.get((num_reqs, padded))
        if got is None:
            if len(self._views) >= 1024:  # many paddings: keep the cache bounded
                self._views.clear()
            rows = torch.arange(num_reqs) * self._col[-1]
            got = self._views[(num_reqs, padded)] = (
                tuple(rows + c for c in self._col[:-1]),
                tuple(k[:num_reqs] for k in self._kernel),
                tuple(out[:padded] for out in self._slots),
            )
        return got

    def compute_slot_mapping(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        *,
        num_slots: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Slots of the step's tokens, one int64 ``[num_slots]`` view per group (``-1`` padding).

        ``query_start_loc`` ``[R + 1]`` and ``positions`` ``[T]`` are device tensors (rows
        ``[0, R)`` must be committed). ``num_slots`` (default ``T``, at most
        ``max_num_batched_tokens``) is the padded length a CUDA graph captured. The views are
        persistent buffers, overwritten by the next call.
        """
        check_index_tensor("compute_slot_mapping", "query_start_loc", query_start_loc)
        check_index_tensor("compute_slot_mapping", "positions", positions)
        num_tokens = positions.numel()
        length = num_tokens if num_slots is None else num_slots
        if isinstance(length, bool) or not isinstance(length, int):
            raise ValueError(f"num_slots={num_slots!r} must be an int")
        if not num_tokens <= length <= self.max_num_batched_tokens:
            raise ValueError(
                f"num_slots={length} must be in [{num_tokens} tokens, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}]; raise max_num_batched_tokens or split the step"
            )
        self._require_committed(query_start_loc.numel() - 1, "compute_slot_mapping")
        num_reqs = query_start_loc.numel() - 1
        return tuple(
            compute_slot_mapping(
                self._dev[:num_reqs, self._col[g] : self._col[g + 1]],
                positions,
                query_start_loc,
                self.block_sizes[g],
                self.kernel_block_sizes[g],
                num_slots=length,
                impl=self.impl,
                out=self._slots[g][:length],
            )  # [length] int64, written in place
            for g in range(self.num_groups)
        )

    def build_common_metadata(
        self,
        num_reqs: int,
        query_lens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        *,
        pad_tokens_to: int | None = None,
    ) -> tuple[CommonAttentionMetadata, ...]:
        """One :class:`kv_backends.CommonAttentionMetadata` per group for the step's batch.

        Request ``r`` (row ``r``) has ``query_lens[r]`` new tokens at positions
        ``seq_lens[r] - query_lens[r] .. seq_lens[r] - 1``. The lengths are host values (lists,
        numpy or CPU tensors: checking them costs no device sync); ``pad_tokens_to`` pads the
        slot mappings with ``-1`` to a captured length. The groups share ``query_start_loc`` and
        ``seq_lens`` (and their host copies); each has its own kernel block table and slots.
        """
        if type(num_reqs) is not int or num_reqs < 0:
            raise ValueError(f"build_common_metadata: num_reqs={num_reqs!r} must be an int >= 0")
        self._require_committed(num_reqs, "build_common_metadata")
        if self._host_decode is not None:
            if self._step_event is not None:  # staged (CUDA): the staging buffers are reused
                wait_event(self._step_event)
                self._step_event = None
            built = self._host_decode.build(num_reqs, query_lens, seq_lens, pad_tokens_to)
            if built is not None:
                self._last_step, mds, self._positions = built
                if self._pinned:
                    self._step_event = self._record_step_event()
                return mds
        step = _md.StepInputs.from_lengths(
            num_reqs,
            query_lens,
            seq_lens,
            pad_tokens_to=pad_tokens_to,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        # Host tables with the reference slot mapping: the slots come from the same host lookup
        # as the null-block check (host_slot_mappings), one pass instead of two.
        host_slots = self._track_rows and self.impl != "triton"
        # A pure decode checks coverage and the null block with one lookup per group (the
        # committed table on the CPU, which the slots then read; the host table on a GPU).
        views = self._decode_views(num_reqs, step.padded_tokens) if step.pure_decode else None
        blocks = (
            None
            if views is None
            else _md.decode_blocks(
                step,
                self._dev_flat if host_slots else self._host_flat,
                views[0],
                self.block_sizes,
                self.max_num_blocks_per_req,
                self.null_block,
            )
        )
        if blocks is None:  # not a decode, or one the lookup refused: the checks name the error
            _md.check_rows_cover(
                step, self._row_blocks[:num_reqs], self.block_sizes, self.max_num_blocks_per_req
            )
            if self.null_block is not None and not host_slots:
                for g in range(self.num_groups):
                    _md.check_new_tokens_not_null(
                        step, self.host_table(g), self.block_sizes[g], self.null_block, g
                    )
        if self._step_event is not None:  # the step's staging buffers are reused: same rule
            wait_event(self._step_event)
        qsl, seq, pos = self._step.stage(step)
        if self._pinned:
            self._step_event = self._record_step_event()
        if host_slots and blocks is not None:
            assert views is not None
            slots = _md.decode_slot_mappings(step, blocks, self.block_sizes, views[2])
        elif host_slots:
            slots = _md.host_slot_mappings(
                step, self._dev, self._col, self.block_sizes, self.null_block, self._slots
            )
        else:
            slots = self.compute_slot_mapping(qsl, pos, num_slots=step.padded_tokens)
        self._last_step = step
        self._positions = pos
        kernel = views[1] if views is not None else [k[:num_reqs] for k in self._kernel]
        return tuple(
            _md.make_common(step, qsl, seq, kernel[g], slots[g]) for g in range(self.num_groups)
        )
