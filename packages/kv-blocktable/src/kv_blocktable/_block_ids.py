"""Checks of ``BlockTables``' inputs: positive sizes, kernel-block splits a layout can address,
and per-group manager block ids (range, pool size, int32 kernel-block expansion) — every group
checked before any row is written."""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kv_spec import KVCacheLayout

    from kv_blocktable.block_table import BlockTables

__all__ = [
    "INT32_MAX",
    "BlockIdCheck",
    "check_append_args",
    "check_group_sizes",
    "check_index_tensor",
    "check_kernel_block_split",
    "check_num_blocks",
    "int32_memoryview",
    "int32_tensor",
    "int64_tensor",
    "plan_appends",
    "plan_checked_appends",
    "plan_decode_appends",
    "plan_single_appends",
    "positive_int",
]

INT32_MAX = 2**31 - 1


def int64_tensor(values: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A fresh int64 CPU tensor of Python ints, through a C array: ``torch.tensor(list)`` walks
    the list element by element (about 30 us for 256 ints here, 5 us this way). Raises
    ``TypeError`` / ``OverflowError`` for anything but ints in the int64 range (callers that take
    other input fall back to ``torch.as_tensor`` for its error message)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)  # owns the array


def int32_tensor(values: list[int]) -> torch.Tensor:
    """:func:`int64_tensor` for ids known to fit int32 (``OverflowError`` otherwise)."""
    if not values:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(array("i", values), dtype=torch.int32)


def int32_memoryview(t: torch.Tensor) -> memoryview:
    """A flat int32 ``memoryview`` of ``t``'s memory (a contiguous int32 CPU tensor, pinned or
    not), for reading and writing single entries: ``view[i] = v`` costs ~40 ns, a torch scalar
    write or a one-element ``index_copy_`` a microsecond or more. The view does not keep ``t``
    alive: the caller holds both, and ``t`` must never be resized (a persistent buffer)."""
    if t.dtype != torch.int32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"int32_memoryview needs a contiguous int32 CPU tensor; got {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ', not contiguous'}"
        )
    raw = (ctypes.c_int32 * t.numel()).from_address(t.data_ptr())
    return memoryview(raw).cast("B").cast("i")


def check_index_tensor(owner: str, name: str, value: object) -> None:
    """``value`` is an integer tensor (positions, offsets): a list has no device, a float
    tensor would be truncated."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}: {name} is a {type(value).__name__}; pass an integer tensor")
    if value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{owner}: {name} has dtype {value.dtype}; pass int32 or int64")


def positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a positive int")
    return value


def check_group_sizes(
    owner: str,
    block_sizes: Sequence[int],
    kernel_block_sizes: Sequence[int],
    max_num_blocks_per_req: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The per-group sizes as tuples of positive ints, one of each per group, every kernel block
    size dividing its block size (a manager block is ``k`` whole kernel blocks)."""
    sizes = tuple(positive_int(owner, "block_sizes[]", b) for b in block_sizes)
    kernel = tuple(positive_int(owner, "kernel_block_sizes[]", b) for b in kernel_block_sizes)
    cols = tuple(positive_int(owner, "max_num_blocks_per_req[]", m) for m in max_num_blocks_per_req)
    if not sizes:
        raise ValueError(f"{owner}: block_sizes is empty; pass one block size per KV group")
    if (len(kernel), len(cols)) != (len(sizes), len(sizes)):
        raise ValueError(
            f"{owner}: got {len(sizes)} block_sizes, {len(kernel)} kernel_block_sizes and "
            f"{len(cols)} max_num_blocks_per_req; pass one of each per KV group"
        )
    for g, (bs, kbs) in enumerate(zip(sizes, kernel, strict=True)):
        if bs % kbs:
            raise ValueError(
                f"{owner}: group {g} kernel_block_size={kbs} does not divide block_size={bs}; "
                "a manager block must be k whole kernel blocks "
                "(kv_backends.prepare_kernel_block_sizes picks one)"
            )
    return sizes, kernel, cols


def check_num_blocks(
    owner: str, num_blocks: int | None, kernel_blocks_per_block: Sequence[int]
) -> int | None:
    """``num_blocks`` (``None``: unknown) when each group's kernel block ids fit int32."""
    if num_blocks is None:
        return None
    positive_int(owner, "num_blocks", num_blocks)
    for g, k in enumerate(kernel_blocks_per_block):
        if num_blocks * k - 1 > INT32_MAX:
            raise ValueError(
                f"{owner}: group {g} has {num_blocks} blocks x k={k} kernel blocks each, "
                "past the int32 range of kernel block tables; use a larger kernel block size"
            )
    return num_blocks


def check_kernel_block_split(group_id: int, layout: KVCacheLayout, kernel_block_size: int) -> None:
    """Refuse a kernel block size the cache cannot be addressed with.

    Kernel block ``b * k + i`` of ``kernel_block_size`` tokens is only the right memory when a
    manager block's tokens are evenly strided (block stride = ``block_size`` x token stride):
    LBNHC or LHBNC without padded pages, MLA latents included. Cross-layer orders (BLNHC, ...),
    head-major blocks (LBHNC) and padded pages break that, and a kernel block id would then point
    into another layer, head or the padding — so they raise here, with the fix, instead of
    silently mis-addressing.
    """
    n = layout.block_size
    if kernel_block_size == n:
        return
    if kernel_block_size <= 0 or n % kernel_block_size:
        raise ValueError(
            f"group {group_id}: kernel_block_size={kernel_block_size} must be a positive divisor of "
            f"the storage block_size={n}; pick one with kv_backends.prepare_kernel_block_sizes"
        )
    _, sb, _, sn, _ = layout.strides  # element strides of the logical [L, B, H, N, C] dims
    if sb != n * sn:
        padded = layout.page_bytes != layout.real_page_size_bytes
        raise ValueError(
            f"group {group_id}: cannot address {n}-token blocks as {kernel_block_size}-token kernel "
            f"blocks: block stride {sb} != block_size x token stride {n * sn} (order "
            f"{layout.order.value}{', padded pages' if padded else ''}); use LBNHC or LHBNC "
            f"without page padding, or kernel_block_size={n}"
        )


class BlockIdCheck:
    """Validates the manager block ids a row receives, one tuple entry per KV group."""

    def __init__(
        self,
        null_block: int | None,
        num_blocks: int | None,
        kernel_blocks_per_block: tuple[int, ...],
    ) -> None:
        self.null_block = null_block
        self.num_blocks = num_blocks
        self.kernel_blocks_per_block = kernel_blocks_per_block
        self.num_groups = len(kernel_blocks_per_block)
        #: The largest block id each group's table takes (pool size, int32 kernel block ids).
        self.max_ids = tuple(
            min(
                INT32_MAX if num_blocks is None else num_blocks - 1,
                (INT32_MAX - k + 1) // k,
            )
            for k in kernel_blocks_per_block
        )

    def error(self, g: int, row: int, lo: int, hi: int) -> str | None:
        """Why group ``g``'s ids for ``row`` (smallest ``lo``, largest ``hi``) are refused, if so."""
        if lo < 0:
            return (
                f"group {g} row {row}: block id {lo} is negative; block ids are >= 0 "
                f"(the null block is {self.null_block})"
            )
        if self.num_blocks is not None and hi >= self.num_blocks:
            return (
                f"group {g} row {row}: block id {hi} is >= num_blocks={self.num_blocks}; "
                "the ids must come from this cache's block pool"
            )
        k = self.kernel_blocks_per_block[g]
        if hi * k + k - 1 > INT32_MAX:  # tables are int32: never wrap silently
            return (
                f"group {g} row {row}: block id {hi} expands to kernel block "
                f"{hi * k + k - 1} (k={k}), past the int32 range of block tables"
            )
        return None

    def duplicate(self, g: int, row: int, ids: Sequence[int]) -> str | None:
        """Why ``ids`` (group ``g``'s ids for ``row``) are refused for naming a block twice
        (the null block may repeat: a sliding-window row holds it wherever blocks fell out of
        the window), if they are."""
        if len(ids) < 2 or len(set(ids)) == len(ids):
            return None
        seen: set[int] = set()
        for b in ids:
            if b in seen and b != self.null_block:
                return (
                    f"group {g} row {row}: block id {b} appears twice; a block holds one "
                    "position of one request (two positions would share one page of KV)"
                )
            seen.add(b)
        return None

    def lists(self, row: int, block_ids: object) -> list[list[int]]:
        """:meth:`tensors` as plain lists, without torch ops for lists of ints (the common case:
        ``KVCacheManager.get_block_ids`` returns them), so a decode step's appends cost
        microseconds per row."""
        if isinstance(block_ids, (tuple, list)) and len(block_ids) == self.num_groups:
            out: list[list[int]] = []
            for g, ids in enumerate(block_ids):
                if not isinstance(ids, (list, tuple)) or not all(type(b) is int for b in ids):
                    break  # tensors, numpy arrays, odd values: the general path below
                if ids:
                    lo, hi = min(ids), max(ids)
                    if lo < 0 or hi > self.max_ids[g]:
                        raise ValueError(self.error(g, row, lo, hi))
                    if len(ids) > 1 and (dup := self.duplicate(g, row, ids)):
                        raise ValueError(dup)
                out.append(list(ids))
            else:
                return out
        return [t.tolist() for t in self.tensors(row, block_ids)]

    def tensors(self, row: int, block_ids: object) -> list[torch.Tensor]:
        """Validate per-group block ids for ``row`` (all groups before any write)."""
        if not isinstance(block_ids, (tuple, list)) or len(block_ids) != self.num_groups:
            raise ValueError(
                f"block ids for row {row} must be a tuple of {self.num_groups} lists (one per KV "
                f"group, as KVCacheManager.get_block_ids returns); got {type(block_ids).__name__}"
                + (f" of {len(block_ids)}" if isinstance(block_ids, (tuple, list)) else "")
            )
        out = []
        for g, ids in enumerate(block_ids):
            if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
                raise ValueError(f"group {g} block ids are on {ids.device}; pass host ids")
            _check_integral(g, row, ids)
            try:
                t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"group {g} block ids for row {row} are not ints: {e}") from None
            if t.numel():
                err = self.error(g, row, int(t.min()), int(t.max()))
                if err is None and t.numel() > 1:
                    err = self.duplicate(g, row, t.tolist())
                if err is not None:
                    raise ValueError(err)
            out.append(t)
        return out


def _check_integral(g: int, row: int, ids: object) -> None:
    """Block ids are integers: a float or bool tensor / array, or a list holding anything but
    ints, is refused (``torch.as_tensor(..., dtype=int64)`` would truncate 2.5 to block 2)."""
    dtype = getattr(ids, "dtype", None)
    if dtype is not None:  # a tensor or a numpy array
        if isinstance(dtype, torch.dtype):
            ok = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
        else:
            ok = getattr(dtype, "kind", "") in ("i", "u")
        if not ok:
            raise TypeError(
                f"group {g} block ids for row {row} have dtype {dtype}; pass integer ids "
                "(a float id is never rounded to a block)"
            )
        return
    if isinstance(ids, (list, tuple)):
        for bad in ids:
            if type(bad) is int:
                continue
            raise TypeError(
                f"group {g} block ids for row {row} hold {bad!r} ({type(bad).__name__}); block "
                "ids are ints (a float id is never rounded to a block)"
            )
        return
    raise TypeError(
        f"group {g} block ids for row {row} are a {type(ids).__name__}; pass a list of ints "
        "(or an integer tensor)"
    )


def check_append_args(rows: Any, new_block_ids: Any) -> None:
    """``BlockTables.append_rows``' argument check: two sequences of equal length (one tuple of
    per-group ids per row)."""
    if not (type(rows) is list or isinstance(rows, Sequence)) or not (
        type(new_block_ids) is list or isinstance(new_block_ids, Sequence)
    ):  # (the exact-type test first: an ABC check costs a microsecond)
        raise TypeError(
            f"append_rows: rows ({type(rows).__name__}) and new_block_ids "
            f"({type(new_block_ids).__name__}) must be sequences, one tuple of per-group "
            "ids per row"
        )
    if len(rows) != len(new_block_ids):
        raise ValueError(
            f"append_rows: got {len(rows)} rows but {len(new_block_ids)} block-id tuples; "
            "pass one tuple (one list per KV group) per row"
        )


def plan_appends(
    rows: list[int],
    have: list[list[int]],
    lists: list[list[list[int]]],
    col: Sequence[int],
    max_blocks: Sequence[int],
    block_sizes: Sequence[int],
) -> tuple[dict[int, list[int]], list[int], list[int]]:
    """Where ``BlockTables.append_rows`` writes, checked before anything is written.

    ``rows[i]`` (holding ``have[i]`` blocks per group) gets ``lists[i]`` (ids per group); ``col``
    are the groups' column offsets in the row-major host table (``col[-1]`` its width). Returns
    ``(ends, flat, vals)``: each row's blocks per group after all its appends (a repeated row's
    appends apply in order), and the flat host-table indices and ids to scatter.
    """
    ends: dict[int, list[int]] = {}  # row -> blocks per group after its appends so far
    flat: list[int] = []
    vals: list[int] = []
    width = col[-1]
    for row, start, per_group in zip(rows, have, lists, strict=True):
        end = ends.setdefault(row, start)
        for g, ids in enumerate(per_group):
            n = end[g] + len(ids)
            if n > max_blocks[g]:
                raise ValueError(
                    f"row {row} group {g} would hold {n} blocks (block_size={block_sizes[g]}, "
                    f"{n * block_sizes[g]} tokens), more than max_num_blocks_per_req="
                    f"{max_blocks[g]}; raise max_model_len or finish the request"
                )
            c0 = row * width + col[g] + end[g]
            flat.extend(range(c0, c0 + len(ids)))
            vals.extend(ids)
            end[g] = n
    return ends, flat, vals


def plan_checked_appends(
    tables: BlockTables, rows: Sequence[int], new_block_ids: Sequence[object]
) -> tuple[list[int], list[list[list[int]]], tuple[dict[int, list[int]], list[int], list[int]]]:
    """``BlockTables.append_rows``' general path: every row and id checked (the first bad one
    named), then :func:`plan_appends` from copies of the rows' counts (it advances them, and a
    refused append must change no row). Returns ``(rows, ids as lists, plan)``."""
    rows, new_block_ids = list(rows), list(new_block_ids)
    for row in rows:
        tables._check_row("row", row)
    lists = [tables._ids.lists(row, ids) for row, ids in zip(rows, new_block_ids, strict=True)]
    have = [list(tables._row_blocks[row]) for row in rows]  # [len(rows), G]
    plan = plan_appends(
        rows, have, lists, tables._col, tables.max_num_blocks_per_req, tables.block_sizes
    )
    return rows, lists, plan


def plan_single_appends(
    rows: Sequence[object],
    new_block_ids: Sequence[object],
    row_blocks: list[list[int]],
    col: Sequence[int],
    max_blocks: Sequence[int],
    max_ids: Sequence[int],
) -> tuple[dict[int, list[int]], list[int], list[int]] | None:
    """:func:`plan_appends` for the shape of a decode step — every row an int in range, every
    entry a tuple of one list per group holding at most one int id in ``[0, max_ids[g]]``, every
    append fitting — checked in one loop; ``None`` for anything else, valid or not, which the
    general path (:meth:`BlockIdCheck.lists` + :func:`plan_appends`) then plans or names the
    error of. One id per list cannot repeat a block, so there is no duplicate check to make."""
    num_rows, groups = len(row_blocks), len(col) - 1
    width = col[-1]
    ends: dict[int, list[int]] = {}
    flat: list[int] = []
    vals: list[int] = []
    if groups == 1:  # the same loop without the inner one over groups
        max_b, max_id = max_blocks[0], max_ids[0]
        for row, ids in zip(rows, new_block_ids, strict=True):
            if type(row) is not int or not 0 <= row < num_rows:
                return None
            if type(ids) is not tuple or len(ids) != 1:
                return None
            got = ids[0]
            if type(got) is not list:
                return None
            end = ends.get(row)
            if end is None:
                end = ends[row] = [row_blocks[row][0]]
            if not got:
                continue
            if len(got) != 1:
                return None
            b, c = got[0], end[0]
            if type(b) is not int or not 0 <= b <= max_id or c >= max_b:
                return None
            flat.append(row * width + c)
            vals.append(b)
            end[0] = c + 1
        return ends, flat, vals
    for row, ids in zip(rows, new_block_ids, strict=True):
        if type(row) is not int or not 0 <= row < num_rows:
            return None
        if type(ids) is not tuple or len(ids) != groups:
            return None
        end = ends.get(row)
        if end is None:
            end = ends[row] = list(row_blocks[row])
        for g in range(groups):
            got = ids[g]
            if type(got) is not list:
                return None
            if not got:
                continue
            if len(got) != 1:
                return None
            b, c = got[0], end[g]
            if type(b) is not int or not 0 <= b <= max_ids[g] or c >= max_blocks[g]:
                return None
            flat.append(row * width + col[g] + c)
            vals.append(b)
            end[g] = c + 1
    return ends, flat, vals


def plan_decode_appends(
    rows: Sequence[object],
    new_block_ids: Sequence[object],
    row_blocks: list[list[int]],
    width: int,
    max_blocks: int,
    max_id: int,
) -> tuple[list[int], list[int], list[int]] | None:
    """:func:`plan_single_appends` for one group and rows in increasing order (what
    ``KVCacheManager.allocate_decode_slots`` hands over): ``(grown, flat, vals)``, the rows whose
    block count grows by one (group 0) and the flat host-table indices and ids to write; ``None``
    for anything else, which :func:`plan_single_appends` (then the general path) plans or names
    the error of.

    Rows in increasing order cannot repeat, so each row's end is its ``row_blocks`` entry as it
    is: no per-call map of ends (a dict lookup and a list per row in
    :func:`plan_single_appends`), and the caller advances the grown rows' counts in place."""
    num_rows = len(row_blocks)
    grown: list[int] = []
    flat: list[int] = []
    vals: list[int] = []
    last = -1
    for row, ids in zip(rows, new_block_ids, strict=True):
        # (last < row: increasing, so no row repeats; row >= 0 as last >= -1)
        if type(row) is not int or not last < row < num_rows:
            return None
        last = row
        if type(ids) is not tuple or len(ids) != 1:
            return None
        got = ids[0]
        if type(got) is not list:
            return None
        if not got:
            continue
        if len(got) != 1:
            return None
        b, c = got[0], row_blocks[row][0]
        if type(b) is not int or not 0 <= b <= max_id or c >= max_blocks:
            return None
        grown.append(row)
        flat.append(row * width + c)
        vals.append(b)
    return grown, flat, vals
