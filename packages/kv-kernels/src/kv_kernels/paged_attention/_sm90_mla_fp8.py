"""The fp8 producer of the sm_90 Gluon MLA decode (:mod:`._sm90_mla`): an e4m3 latent with one
per-tensor scale (vLLM's ``fp8_e4m3`` latent cache for DeepSeek-V3) widened into the same 16-bit
ring that the 16-bit latent's ``cp.async`` fills, so the consumer and its warpgroup MMAs are the
16-bit kernel's.

Why not ``cp.async``. The MMAs read the query's dtype and shared memory is full (q 64 KiB, the
ring 2 x 72 KiB, P 8 KiB: 216 of 227 KiB), so there is no room for an fp8 staging ring that a
second pass would widen. The producer warpgroup loads each tile's bytes into registers
(``ld.global``, 8 bytes a thread of each 64-byte row piece, 8 threads a row), widens them exactly
(every e4m3 value is a bf16 and an fp16 number; :data:`_E4M3_BF16`, :data:`_E4M3_F16`), stores
them into the ring slot, fences the stores for the async proxy and arrives on the slot's ``full``
barrier once for all its threads (count ``32 * P_WARPS``, the ``cp.async`` path's).

The schedule (:func:`producer_fp8`): a tile is nine pieces of 64 bytes a row (eight of the
latent's nope columns, one of its rope columns) with two in flight (the store of piece ``j``
follows the load of piece ``j + 2``), and at each tile's start the next tile's rows go into L2
(``cp.async.bulk.prefetch.L2``, one 576-byte row a thread of the 8 sharing it: no registers, no
completion), so the loads in flight wait for L2, not HBM. Registers decide the shape. A tensor
of bytes carried around the tile loop is a register a byte (Triton keeps each element apart in a
loop's carried values): 128-byte pieces carried into the next tile spilled ~2.7 KB a thread at
88 producer registers (sm_90 build, triton 3.9). Within an iteration the loads' words reach the
widening whole. sm_90 build, triton 3.9, bf16 q, page 64, spills inside each loop a tile (STL /
LDL): two pieces of 64 bytes in flight, producer at 56 registers: producer 0 / 1, consumer (224)
5 / 12; one piece in flight at 40 (the consumer keeps the 16-bit kernel's 232): producer 4 / 11,
consumer 1 / 2; two at 40: 9 / 15 and 1 / 2; 128-byte pieces, two in flight, at 56: producer
18 / 28. :data:`._sm90_mla_ring.P_REGS_FP8` and :data:`AHEAD` hold the choice; neither is measured on
a GPU yet (the aim: the 16-bit latent's 434 TFLOP/s at 128 heads on an H200, where the Triton
kernel reads 95 over the fp8 latent; the first A/B to run is one piece at 40 registers).

Bounds: as the ``cp.async`` gather (:mod:`._sm90_prefill_kernel`'s ``_tile_rows``): block-table
columns and block ids clamped, so no read (nor prefetch: whole rows of the cache, 16-byte
aligned, which :func:`._sm90_mla.sm90_mla_eligible` requires of an fp8 cache's strides) leaves
the cache; rows past the sequence (and every row of a tile past the split) are masked, not read,
and stored as zeros (the consumer masks their logits too: a page's stale rows could hold nan,
and ``0 * nan`` is nan in ``P V``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from kv_kernels.paged_attention._gluon_compat import barrier
from kv_kernels.paged_attention._sm90_prefill_kernel import _tile_rows

__all__ = ["producer_fp8", "producer_fp8_whole"]

#: bytes of a row piece (8 threads of 8 bytes: the rope columns are one piece)
PIECE = gl.constexpr(64)
#: pieces in flight while one is widened and stored (module notes)
AHEAD = gl.constexpr(2)
#: tiles :func:`producer_fp8_whole` prefetches into L2 ahead of the one it loads
WHOLE_AHEAD = gl.constexpr(2)

#: Four e4m3 bytes (a word) as four bf16 values (two words), exactly: each byte beside a copy
#: of its sign byte (PRMT's sign replication), shifted 4 bits up and masked, is the bf16 whose
#: bits are the byte's sign, exponent and mantissa in place, i.e. the value times 2^-120 (an
#: e4m3 subnormal a bf16 one); a bf16 multiply by 2^120 (0x7B80) restores it. 2 PRMT, 2 SHL,
#: 2 LOP, 2 HMUL2 a word. (An e4m3 nan becomes 480, not nan: rows past a sequence are not read.)
_E4M3_BF16 = gl.constexpr(
    "{ .reg .b32 a, b, k; prmt.b32 a, $2, 0, 0x9180; prmt.b32 b, $2, 0, 0xB3A2; "
    "shl.b32 a, a, 4; shl.b32 b, b, 4; and.b32 a, a, 0x87F087F0; and.b32 b, b, 0x87F087F0; "
    "mov.b32 k, 0x7B807B80; mul.rn.bf16x2 $0, a, k; mul.rn.bf16x2 $1, b, k; }"
)
#: Four e4m3 bytes as four fp16 values: the hardware's pair conversion, twice.
_E4M3_F16 = gl.constexpr(
    "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }"
)


@gluon.constexpr_function
def _bytes_layout(width, warps):
    """A ``[tokens, width]`` tile of latent bytes, 8 threads a row (``width / 8`` bytes each: 16
    of a 128-byte piece, 8 of the rope's 64): every width gives the same rows to the same
    threads, so one tile's row offsets serve all its pieces."""
    return gl.BlockedLayout([1, width // 8], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def _widen(x, DTYPE: gl.constexpr):
    """An e4m3 tile as ``DTYPE`` (bf16 / fp16), exactly, four bytes at a time
    (:data:`_E4M3_BF16`, :data:`_E4M3_F16`)."""
    b = x.to(gl.uint8, bitcast=True)
    if DTYPE.is_bf16():
        y = gl.inline_asm_elementwise(_E4M3_BF16, "=r,=r,r", [b], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)  # fmt: skip
    else:
        y = gl.inline_asm_elementwise(_E4M3_F16, "=r,=r,r", [b], dtype=gl.float16,
                                      is_pure=True, pack=4)  # fmt: skip
    return y


@gluon.jit
def _load(head_ptr, off, ok, COL: gl.constexpr, WIDTH: gl.constexpr, LAYOUT: gl.constexpr):
    """Bytes ``[COL, COL + WIDTH)`` of the rows ``off`` (int64 offsets from ``head_ptr``) into
    registers; rows not ``ok`` are not read and come back as zeros."""
    off = gl.convert_layout(off, gl.SliceLayout(1, LAYOUT))  # (the same rows: no data moves)
    ok = gl.convert_layout(ok, gl.SliceLayout(1, LAYOUT))
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LAYOUT))
    ptrs = head_ptr + COL + off[:, None] + cols[None, :]
    return gl.load(ptrs, mask=ok[:, None] & (cols < WIDTH)[None, :], other=0.0)


#: an L2 prefetch of one latent row (576 bytes), issued where the mask word is nonzero
_PREFETCH_ROW = gl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
    "@p cp.async.bulk.prefetch.L2.global [$1], 576; mov.b32 $0, 0; }"
)


@gluon.jit
def _prefetch(head_ptr, off, ok, P_WARPS: gl.constexpr):
    """Tile rows ``off`` (those ``ok``) into L2, one bulk prefetch a row from one thread of the
    8 that share it: no registers held, no completion to wait for."""
    one: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [P_WARPS, 1], [1, 0])
    off = gl.convert_layout(off, gl.SliceLayout(1, one))  # (the same rows: no data moves)
    ok = gl.convert_layout(ok, gl.SliceLayout(1, one))
    lane = gl.arange(0, 8, layout=gl.SliceLayout(0, one))
    ptrs = head_ptr + off[:, None] + lane[None, :] * 0
    go = (ok[:, None] & (lane == 0)[None, :]).to(gl.int32)
    gl.inline_asm_elementwise(_PREFETCH_ROW, "=r,l,r", [ptrs, go], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def producer_fp8(kvn_smem, kr_smem, full, empty, head_ptr, bt_row_ptr, t_lo, n_tiles, seq_len,
                 num_blocks, max_blocks, stride_kb, stride_kn, BLOCK_SIZE: gl.constexpr,
                 NBUF_: gl.constexpr, P_WARPS: gl.constexpr, TILE_N: gl.constexpr,
                 D_NOPE: gl.constexpr, D_ROPE: gl.constexpr):  # fmt: skip
    """Tiles ``t_lo + [0, n_tiles)`` of the fp8 latent into the 16-bit ring (module notes): the
    slot's ``empty`` barrier waited for before its first store, its ``full`` one arrived on once
    every thread's stores are fenced."""
    gl.static_assert(D_ROPE == PIECE, "the rope columns are one piece")
    NOPE_PIECES: gl.constexpr = D_NOPE // PIECE
    lay: gl.constexpr = _bytes_layout(PIECE, P_WARPS)
    dtype: gl.constexpr = kvn_smem.dtype
    off, ok = _tile_rows(bt_row_ptr, t_lo, seq_len, num_blocks, max_blocks, stride_kb,
                         stride_kn, BLOCK_SIZE, TILE_N, lay)  # fmt: skip
    _prefetch(head_ptr, off, ok & (n_tiles > 0), P_WARPS)
    for i in range(n_tiles):
        s = i % NBUF_
        ph = ((i // NBUF_) & 1) ^ 1  # the previous use of the slot
        off, ok = _tile_rows(bt_row_ptr, t_lo + i, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, TILE_N, lay)  # fmt: skip
        x = _load(head_ptr, off, ok, 0, PIECE, lay)
        if AHEAD > 1:
            y = _load(head_ptr, off, ok, PIECE, PIECE, lay)
        # the next tile into L2 while this one goes through registers
        off_n, ok_n = _tile_rows(bt_row_ptr, t_lo + i + 1, seq_len, num_blocks, max_blocks,
                                 stride_kb, stride_kn, BLOCK_SIZE, TILE_N, lay)  # fmt: skip
        _prefetch(head_ptr, off_n, ok_n & (i + 1 < n_tiles), P_WARPS)
        mbarrier.wait(empty.index(s), ph, pred=i >= NBUF_)
        slot = kvn_smem.index(s)
        # pieces 0-7 are the nope columns, piece 8 the rope columns
        if AHEAD > 1:
            for j in gl.static_range(NOPE_PIECES - 1):
                z = _load(head_ptr, off, ok, (j + 2) * PIECE, PIECE, lay)
                slot.slice(j * PIECE, PIECE, dim=1).store(_widen(x, dtype))
                x = y
                y = z
            slot.slice(D_NOPE - PIECE, PIECE, dim=1).store(_widen(x, dtype))
            x = y
        else:
            for j in gl.static_range(NOPE_PIECES):
                y = _load(head_ptr, off, ok, (j + 1) * PIECE, PIECE, lay)
                slot.slice(j * PIECE, PIECE, dim=1).store(_widen(x, dtype))
                x = y
        kr_smem.index(s).store(_widen(x, dtype))
        fence_async_shared()  # (each thread's stores, before the MMAs' async-proxy reads)
        barrier()  # every producer thread's stores fenced: one arrival stands for all
        mbarrier.arrive(full.index(s), count=32 * P_WARPS)


@gluon.jit
def producer_fp8_whole(kvn_smem, kr_smem, full, empty, head_ptr, bt_row_ptr, t_lo, n_tiles,
                       seq_len, num_blocks, max_blocks, stride_kb, stride_kn,
                       BLOCK_SIZE: gl.constexpr, NBUF_: gl.constexpr, P_WARPS: gl.constexpr,
                       TILE_N: gl.constexpr, D_NOPE: gl.constexpr,
                       D_ROPE: gl.constexpr):  # fmt: skip
    """:func:`producer_fp8` for a kernel that leaves the producer registers (the narrow MLA
    kernel, :mod:`._sm90_mla_narrow`: one consumer warpgroup of 16-32 heads): a tile's whole
    288 bytes a thread are loaded at once (two 256-byte halves of the nope columns and the rope
    piece), so a tile's loads wait for one L2 round trip, not nine pieces' two at a time; the
    rows of the tile :data:`WHOLE_AHEAD` ahead go into L2 meanwhile, so HBM streams while the
    tile is widened and stored.

    Each thread holds 8-byte pieces (:func:`_bytes_layout` of a 64-byte piece, repeated across
    a half's columns), so 8 threads' widened stores fill one 128-byte row of a swizzle atom. A
    layout of 32 bytes a thread (two 16-byte loads a half row) puts threads of a warp 8 KiB
    apart, on the same banks. Measured on the H200 (16 heads, 64 x 4k, 2 splits, graph-timed,
    a probe of this kernel with its loads or its MMAs cut out): widening and storing alone took
    0.040 ms with 32 bytes a thread and 0.015 with 8; the kernel 0.093 and 0.069 (the 16-bit
    latent: 0.074). What bounds it now is the consumer: its MMAs and softmax alone take ~0.05
    ms (the MMAs' N of 16 makes each read its 2 KiB A from shared memory for 32 KFLOP)."""
    gl.static_assert(D_ROPE == PIECE, "the rope columns are one piece")
    HALF: gl.constexpr = D_NOPE // 2
    lay: gl.constexpr = _bytes_layout(PIECE, P_WARPS)
    rope_l: gl.constexpr = lay
    dtype: gl.constexpr = kvn_smem.dtype
    for j in gl.static_range(WHOLE_AHEAD):
        off, ok = _tile_rows(bt_row_ptr, t_lo + j, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, TILE_N, lay)  # fmt: skip
        _prefetch(head_ptr, off, ok & (j < n_tiles), P_WARPS)
    for i in range(n_tiles):
        s = i % NBUF_
        ph = ((i // NBUF_) & 1) ^ 1  # the previous use of the slot
        off, ok = _tile_rows(bt_row_ptr, t_lo + i, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, TILE_N, lay)  # fmt: skip
        a = _load(head_ptr, off, ok, 0, HALF, lay)
        b = _load(head_ptr, off, ok, HALF, HALF, lay)
        r = _load(head_ptr, off, ok, D_NOPE, PIECE, rope_l)
        ahead = i + WHOLE_AHEAD
        off_n, ok_n = _tile_rows(bt_row_ptr, t_lo + ahead, seq_len, num_blocks, max_blocks,
                                 stride_kb, stride_kn, BLOCK_SIZE, TILE_N, lay)  # fmt: skip
        _prefetch(head_ptr, off_n, ok_n & (ahead < n_tiles), P_WARPS)
        mbarrier.wait(empty.index(s), ph, pred=i >= NBUF_)
        slot = kvn_smem.index(s)
        slot.slice(0, HALF, dim=1).store(_widen(a, dtype))
        slot.slice(HALF, HALF, dim=1).store(_widen(b, dtype))
        kr_smem.index(s).store(_widen(r, dtype))
        fence_async_shared()  # (each thread's stores, before the MMAs' async-proxy reads)
        barrier()  # every producer thread's stores fenced: one arrival stands for all
        mbarrier.arrive(full.index(s), count=32 * P_WARPS)
