"""Triton block copies: one launch moves every (row, layer slot, chunk) of a gather, scatter or
copy-on-write, between any two places a GPU kernel can address (device memory, or pinned host
memory through unified virtual addressing).

Performance notes. A program copies one span (up to 32 KiB) of one chunk of one page: it loads the
whole span first (16 x 16-byte vectors per thread at 4 warps) and then stores it, so each thread
keeps 256 bytes in flight, which is what hides PCIe latency when one side is pinned host memory and
HBM latency otherwise. Bytes move as uint8 with ``tl.multiple_of`` hints: the host proves every base
address, stride and size a multiple of ``ALIGN`` (16 when the layout allows it), which lets Triton
emit 16-byte vector accesses for any dtype. Offsets are int64 (program ids and block ids are widened
before they meet a stride).

Per-layer storages (L-outer orders) are separate allocations: their bases reach the kernel as a
small int64 table of byte offsets from layer 0's base. The table is built once per distinct set of
layer addresses and kept on the device (:func:`_layer_table`): a steady-state call does no
host-to-device copy and no synchronization, and once a first call has built it, a CUDA graph can
capture the copy. The key is the tuple of layer base addresses itself, so a different storage or
layout (other addresses) gets its own table and can never read a stale one. A cross-layer slab
needs no table.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from kv_kernels._launch import FastLauncher, align_bits, int_class

if TYPE_CHECKING:
    from kv_kernels.block_copy.api import PageGeometry

__all__ = ["copy_blocks_triton", "gather_blocks_triton", "scatter_blocks_triton"]

# Bytes per program and warps per program (one per 4 KiB of span, at most _MAX_WARPS). Swept on an
# H200 (256 blocks x 32 layers x 64 KiB pages, gather vs torch.index_select of the same bytes):
# per-layer LBNHC 0.45x at 16 KiB / 4 warps, 0.81x at 8 KiB / 4, 0.83x at 32 KiB / 4; cross-layer
# BLNHC 0.96-0.98x at every setting. 32 KiB / 4 warps: 256 bytes in flight per thread.
_MAX_SPAN = 32768
_MAX_WARPS = 4


@triton.jit
def _copy_pages_kernel(
    src_ptr,  # uint8 base of the source
    dst_ptr,  # uint8 base of the destination
    src_layer_ptr,  # int64 [L] byte offset of each layer slot from src_ptr (SRC_TABLE)
    dst_layer_ptr,  # int64 [L] (DST_TABLE)
    src_ids_ptr,  # int64 [n] source block ids (SRC_IDS); else row i is row i
    dst_ids_ptr,  # int64 [n] destination block ids (DST_IDS)
    src_layer_stride,  # bytes between layer slots (when no table)
    dst_layer_stride,
    src_row_stride,  # bytes between blocks (cache side) or rows (buffer side)
    dst_row_stride,
    src_chunk_stride,  # bytes between the chunks of one page
    dst_chunk_stride,
    src_rows,  # bound of source ids: ids outside [0, src_rows) are not copied
    dst_rows,
    num_chunks,
    chunk_bytes,
    err_ptr,  # int32 [1]: ids out of range are counted here (CHECK)
    SRC_TABLE: tl.constexpr,
    DST_TABLE: tl.constexpr,
    SRC_IDS: tl.constexpr,
    DST_IDS: tl.constexpr,
    ALIGN: tl.constexpr,
    SPAN: tl.constexpr,
    CHECK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    layer_chunk = tl.program_id(1)
    part = tl.program_id(2).to(tl.int64)
    layer = (layer_chunk // num_chunks).to(tl.int64)
    chunk = (layer_chunk % num_chunks).to(tl.int64)

    if SRC_IDS:
        src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    else:
        src_row = i
    if DST_IDS:
        dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    else:
        dst_row = i
    if SRC_TABLE:
        src_layer = tl.load(src_layer_ptr + layer)
    else:
        src_layer = layer * src_layer_stride
    if DST_TABLE:
        dst_layer = tl.load(dst_layer_ptr + layer)
    else:
        dst_layer = layer * dst_layer_stride
    ok = (src_row >= 0) & (src_row < src_rows) & (dst_row >= 0) & (dst_row < dst_rows)
    if CHECK:
        # skipped rows are counted once per row (first layer chunk, first span)
        tl.atomic_add(err_ptr, 1, mask=(layer_chunk == 0) & (part == 0) & ~ok)

    start = part * SPAN
    src_off = src_layer + src_row * src_row_stride + chunk * src_chunk_stride + start
    dst_off = dst_layer + dst_row * dst_row_stride + chunk * dst_chunk_stride + start
    src_off = tl.multiple_of(src_off, ALIGN)
    dst_off = tl.multiple_of(dst_off, ALIGN)
    offs = tl.arange(0, SPAN)
    # tl.where, not `ok & ...`: the interpreter mistypes a scalar-bool & vector-bool
    mask = tl.where(ok, offs < chunk_bytes - start, False)
    data = tl.load(src_ptr + src_off + offs, mask=mask)
    tl.store(dst_ptr + dst_off + offs, data, mask=mask)


#: Launches of the copy kernel, bound per specialization after the first (~100 us of Triton's
#: host path a call on an H200 host, paid per chunk of every transfer on each side).
_COPY = FastLauncher(_copy_pages_kernel)


class _Side:
    """One side of a copy: a uint8 base tensor and how (row, layer, chunk) address it."""

    def __init__(
        self,
        base: torch.Tensor,
        layer_table: torch.Tensor | None,
        layer_stride: int,
        ids: torch.Tensor | None,
        row_stride: int,
        chunk_stride: int,
        rows: int,
        addresses: list[int],
    ) -> None:
        self.base = base
        self.layer_table = layer_table
        self.layer_stride = layer_stride
        self.ids = ids
        self.row_stride = row_stride
        self.chunk_stride = chunk_stride
        self.rows = rows
        self.addresses = addresses  # every base address the side touches, for the alignment proof


def _cache_side(geo: PageGeometry, ids: torch.Tensor) -> _Side:
    base = geo.layer_bytes[0]
    device = base.device
    ids = ids.to(device=device, dtype=torch.int64, non_blocking=True)
    addresses = [t.data_ptr() for t in geo.layer_bytes]
    if geo.layer_stride is not None:
        return _Side(
            base,
            None,
            geo.layer_stride,
            ids,
            geo.block_stride,
            geo.chunk_stride,
            geo.num_blocks,
            addresses,
        )
    table = _layer_table(device, tuple(addresses))
    return _Side(base, table, 0, ids, geo.block_stride, geo.chunk_stride, geo.num_blocks, addresses)


_TABLES_KEPT = 64  # distinct storages whose tables stay on the device (a few hundred bytes each)
_TABLES: OrderedDict[tuple[str, int | None, tuple[int, ...]], torch.Tensor] = OrderedDict()


def _layer_table(device: torch.device, addresses: tuple[int, ...]) -> torch.Tensor:
    """int64 ``[L]`` byte offsets of each layer base from the first, on ``device``: built once per
    distinct address tuple (the one host-to-device copy), then reused from a small LRU."""
    key = (device.type, device.index, addresses)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "block copies over a per-layer cache (L-outer order) need its layer-address table on "
            "the device before CUDA-graph capture; run one copy over this storage before capturing "
            "(the table is then cached), or use a cross-layer (B-outer) layout"
        )
    offsets = [a - addresses[0] for a in addresses]
    table = torch.tensor(offsets, dtype=torch.int64, device=device)
    _TABLES[key] = table
    if len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return table


def _buffer_side(buffer: torch.Tensor, geo: PageGeometry) -> _Side:
    return _Side(
        buffer,
        None,
        geo.page_bytes,
        None,
        buffer.stride(0),
        geo.chunk_bytes,
        buffer.shape[0],
        [buffer.data_ptr()],
    )


def _launch(
    src: _Side,
    dst: _Side,
    geo: PageGeometry,
    num_rows: int,
    error_flag: torch.Tensor | None = None,  # int32 [1]
    load_only: bool = False,
) -> None:
    if num_rows == 0:
        return
    _COPY(*_launch_call(src, dst, geo, num_rows, error_flag, load_only))


def _launch_call(
    src: _Side,
    dst: _Side,
    geo: PageGeometry,
    num_rows: int,
    error_flag: torch.Tensor | None,
    load_only: bool,
) -> tuple[Any, tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:
    """``(key, grid, args, kwargs)`` of one copy: :class:`~kv_kernels._launch.FastLauncher`'s
    key holds every value Triton specializes the call on (each pointer's dtype and 16-byte
    alignment, each integer's class, the constexprs and warps), so a bound launch of an equal
    key is the same variant (``tests/test_block_copy_launch.py`` holds it against a model of
    Triton's binder)."""
    align = 16
    for v in (
        *src.addresses,
        *dst.addresses,
        src.layer_stride,
        dst.layer_stride,
        src.row_stride,
        dst.row_stride,
        src.chunk_stride,
        dst.chunk_stride,
        geo.chunk_bytes,
    ):
        align = math.gcd(align, v)
    span = min(_MAX_SPAN, triton.next_power_of_2(geo.chunk_bytes))
    span = max(span, 16)
    num_warps = max(1, min(_MAX_WARPS, span // 4096))
    # load_only: an empty grid, so Triton builds and loads this call's variant and launches nothing
    grid = (
        0 if load_only else num_rows,
        geo.num_layers * geo.num_chunks,
        triton.cdiv(geo.chunk_bytes, span),
    )
    dummy = src.ids if src.ids is not None else dst.ids
    assert dummy is not None
    ptrs = (
        src.base,
        dst.base,
        src.layer_table if src.layer_table is not None else dummy,
        dst.layer_table if dst.layer_table is not None else dummy,
        src.ids if src.ids is not None else dummy,
        dst.ids if dst.ids is not None else dummy,
    )
    flag = error_flag if error_flag is not None else dummy
    ints = (
        src.layer_stride,
        dst.layer_stride,
        src.row_stride,
        dst.row_stride,
        src.chunk_stride,
        dst.chunk_stride,
        src.rows,
        dst.rows,
        geo.num_chunks,
        geo.chunk_bytes,
    )
    consts = {
        "SRC_TABLE": src.layer_table is not None,
        "DST_TABLE": dst.layer_table is not None,
        "SRC_IDS": src.ids is not None,
        "DST_IDS": dst.ids is not None,
        "ALIGN": align,
        "SPAN": span,
        "CHECK": error_flag is not None,
    }
    key = (
        align_bits(*ptrs, flag),
        tuple(t.dtype for t in (*ptrs, flag)),
        tuple(int_class(v) for v in ints),
        tuple(consts.values()),
        num_warps,
    )
    return key, grid, (*ptrs, *ints, flag), {**consts, "num_warps": num_warps}


def gather_blocks_triton(
    geo: PageGeometry,
    block_ids: torch.Tensor,
    out: torch.Tensor,
    error_flag: torch.Tensor | None = None,
    load_only: bool = False,
) -> None:
    """Cache pages of ``block_ids`` -> ``out`` rows (one launch)."""
    src, dst = _cache_side(geo, block_ids), _buffer_side(out, geo)
    _launch(src, dst, geo, block_ids.numel(), error_flag, load_only)


def scatter_blocks_triton(
    buffer: torch.Tensor,
    geo: PageGeometry,
    block_ids: torch.Tensor,
    error_flag: torch.Tensor | None = None,
    load_only: bool = False,
) -> None:
    """``buffer`` rows -> cache pages of ``block_ids`` (one launch)."""
    src, dst = _buffer_side(buffer, geo), _cache_side(geo, block_ids)
    _launch(src, dst, geo, block_ids.numel(), error_flag, load_only)


def copy_blocks_triton(
    geo: PageGeometry,
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
    error_flag: torch.Tensor | None = None,
) -> None:
    """Cache pages of ``src_block_ids`` -> cache pages of ``dst_block_ids`` (one launch)."""
    src = _cache_side(geo, src_block_ids)
    dst = _Side(
        src.base,
        src.layer_table,
        src.layer_stride,
        dst_block_ids.to(device=src.base.device, dtype=torch.int64, non_blocking=True),
        src.row_stride,
        src.chunk_stride,
        src.rows,
        src.addresses,
    )
    _launch(src, dst, geo, src_block_ids.numel(), error_flag)
