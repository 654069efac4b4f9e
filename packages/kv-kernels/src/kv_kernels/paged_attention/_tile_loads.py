"""Where a paged-attention KV tile's tokens live and how the kernel reads them: block ids through
the block table, token offsets, the inline per-token-head scales, and the pointer gathers of K
and V (the TMA path's boxes are built in :mod:`._kernels`, from :func:`tile_page`'s block id).

Bounds. Whatever the metadata says, no load leaves the cache or the block table: a block-table
column past ``max_blocks`` or a block id outside ``[0, num_blocks)`` is redirected inside the cache
(a zero page in boundary tiles, block 0 in the unmasked middle, whose loads stay unmasked and
vectorized), so the rows that touch it are wrong but nothing faults; with ``CHECK`` each such
read is counted in ``err_ptr[0]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["gather_tile", "inline_scale", "page_offsets", "tile_page"]


@triton.jit
def tile_page(
    t,
    bt_row_ptr,
    stride_btb,
    max_blocks,
    num_blocks,
    err_ptr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CHECK: tl.constexpr,
):
    """The block id (int32) of KV tile ``t`` when the tile lies inside one page, and whether it
    is valid; an invalid one (column past the table, id outside ``[0, num_blocks)``) becomes
    block 0, inside the cache, and ``CHECK`` counts it."""
    col = (t * TILE_N) // BLOCK_SIZE
    blk = tl.load(bt_row_ptr + col * stride_btb, mask=col < max_blocks, other=-1).to(tl.int32)
    ok = (blk >= 0) & (blk < num_blocks)
    if CHECK:
        tl.atomic_add(err_ptr, 1, mask=~ok)
    return tl.where(ok, blk, 0), ok


@triton.jit
def page_offsets(
    t,
    seq_len,
    bt_row_ptr,
    stride_btb,
    max_blocks,
    num_blocks,
    stride_kb,
    stride_kn,
    err_ptr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    CHECK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    """Token offsets ``[TILE_N]`` (int64) of KV tile ``t`` and whether each token's page is valid.

    An invalid page (column past the table, id outside ``[0, num_blocks)``) is redirected inside the
    cache (block 0 for a one-page tile; for a multi-page tile the id clamped as unsigned, so a
    negative id reads the last block) and, on boundary tiles, its tokens flagged so masked loads
    read zeros; ``CHECK`` counts them.

    ``ROW_ALIGN`` (> 1): every offset is a multiple of it (the launcher's gcd of the page and token
    strides), told to the compiler so a token row that is not 16-byte aligned (a per-token-head
    row of 128 + 128 + 8 bytes) is still read in 8-byte vectors instead of byte by byte.
    """
    kpos = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] absolute kv positions
    if BLOCK_SIZE % TILE_N == 0:
        # The tile lies inside one page: one block id, consecutive rows.
        blk, ok = tile_page(
            t, bt_row_ptr, stride_btb, max_blocks, num_blocks, err_ptr, BLOCK_SIZE, TILE_N, CHECK
        )
        blk = blk.to(tl.int64)
        row = ((t * TILE_N) % BLOCK_SIZE + tl.arange(0, TILE_N)).to(tl.int64)
        # broadcast through int32: the interpreter mistypes scalar-bool & vector-bool
        tok_ok = (tl.zeros([TILE_N], dtype=tl.int32) + ok.to(tl.int32)) != 0
        off = blk * stride_kb + row * stride_kn
        if ROW_ALIGN > 1:
            off = tl.multiple_of(off, ROW_ALIGN)
        return off, tok_ok
    # The tile spans several pages: one block id per token (cached loads of the same ids).
    # Performance (H200, decode 64 x 4k and 8 x 32k, block 16): a compare-and-select of every id
    # on the hot path cost 25% (4.20 -> 3.14 TB/s); clamping with min/max costs nothing measurable,
    # so interior tiles clamp (reads stay inside the cache; an invalid id reads some valid page,
    # counted when CHECK) and only boundary tiles (MASKED) and CHECK build the validity mask.
    col = kpos // BLOCK_SIZE
    blk = tl.load(bt_row_ptr + tl.minimum(col, max_blocks - 1) * stride_btb).to(tl.int32)
    if MASKED or CHECK:
        ok = (blk >= 0) & (blk < num_blocks) & (col < max_blocks)
        if CHECK:
            nbad = tl.sum(((kpos < seq_len) & ~ok).to(tl.int32), 0)
            tl.atomic_add(err_ptr, nbad, mask=nbad > 0)
    else:
        ok = kpos >= 0  # unused by the unmasked hot path
    # One unsigned 32-bit min clamps both ways (a negative id wraps past num_blocks - 1), and the
    # unsigned id widens to 64 bits by zero extension: the int64 min / max this replaced cost
    # five instructions a row in the sm_90 loop (and registers the prefill kernel spilled for).
    blk = tl.minimum(blk.to(tl.uint32, bitcast=True), (num_blocks - 1).to(tl.uint32))
    off = blk.to(tl.int64) * stride_kb + (kpos % BLOCK_SIZE).to(tl.int64) * stride_kn
    if ROW_ALIGN > 1:
        off = tl.multiple_of(off, ROW_ALIGN)
    return off, ok


@triton.jit
def inline_scale(
    kvs_head_ptr,
    tok_off,  # [TILE_N] int64 element offsets of the tile's tokens (1-byte cache elements)
    idx,  # first element of the scale: a float32 index (SCALE_WORDS) or a byte index
    stride_kc,
    mask,  # [TILE_N] tokens to read (others read as scale 0)
    MASKED: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
):
    """The float32 per-token-head scales ``[TILE_N]`` stored inline after the token's data.

    ``SCALE_WORDS``: the cache is also seen as float32 (every stride and the scale offset are
    multiples of 4 bytes, ``stride_kc == 1``), so a scale is one 4-byte load at ``tok_off / 4``.
    Otherwise the scale can sit at any byte offset and is assembled from its 4 little-endian
    bytes, as the write kernel stores it (a misaligned float32 load would fault).
    """
    if SCALE_WORDS:
        ptrs = kvs_head_ptr + tok_off // 4 + idx
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0.0)
        return tl.load(ptrs)
    j = tl.arange(0, 4)
    ptrs = kvs_head_ptr + tok_off[:, None] + (idx + j[None, :]).to(tl.int64) * stride_kc
    if MASKED:
        b = tl.load(ptrs, mask=mask[:, None], other=0).to(tl.int32)  # [TILE_N, 4]
    else:
        b = tl.load(ptrs).to(tl.int32)
    # the four bytes occupy disjoint bits, so their sum is their bitwise or
    bits = tl.sum(b << (j * 8)[None, :], 1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def gather_tile(
    k_head_ptr,  # the head's first K / V column (the token offsets add to them)
    v_head_ptr,
    tok_off,  # [TILE_N] int64 token offsets
    k_cols,
    k2_cols,
    v_cols,
    in_seq,  # [TILE_N] tokens inside the sequence on valid pages
    d_ok,
    dv_ok,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    D_PAD: tl.constexpr,
    D_TAIL: tl.constexpr,
    DV_PAD: tl.constexpr,
    V_FROM_K: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K (main and tail columns) and V of one KV tile by pointer gathers ``(k, k2, v)``; ``k2`` /
    ``v`` are ``k`` when there is no tail / V is K's own columns."""
    k_ptrs = k_head_ptr + tok_off[:, None] + k_cols[None, :]  # [TILE_N, D_PAD]
    v_ptrs = v_head_ptr + tok_off[:, None] + v_cols[None, :]  # [TILE_N, DV_PAD]
    k2_ptrs = k_head_ptr + tok_off[:, None] + k2_cols[None, :]  # [TILE_N, D_TAIL]
    if MASKED:
        # boundary tiles: tokens past the sequence and on invalid pages read as zeros
        k = tl.load(k_ptrs, mask=in_seq[:, None] & d_ok[None, :], other=0.0)
        k2 = k
        if D_TAIL > 0:
            k2 = tl.load(k2_ptrs, mask=in_seq[:, None], other=0.0)
        v = k
        if not V_FROM_K:
            v = tl.load(v_ptrs, mask=in_seq[:, None] & dv_ok[None, :], other=0.0)
    else:
        # the hot path keeps its unmasked, vectorized loads: an invalid page was already
        # redirected to block 0 (inside the cache) and counted by page_offsets
        if D_PAD + D_TAIL == HEAD_SIZE:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        k2 = k
        if D_TAIL > 0:
            k2 = tl.load(k2_ptrs)
        v = k
        if not V_FROM_K:
            if DV_PAD == HEAD_SIZE_V:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
    return k, k2, v
