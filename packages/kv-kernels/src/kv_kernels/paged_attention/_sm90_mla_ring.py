"""The latent ring of the sm_90 Gluon MLA decode kernels (:mod:`._sm90_mla`, 64 / 128 heads;
:mod:`._sm90_mla_narrow`, 16 and 32 heads): its shape and the producer warpgroup that fills it.

A slot holds one tile of ``TILE_N`` tokens of the latent in the query's 16-bit dtype, the 512
"nope" columns (which are V too) and the 64 rope columns in two shared-memory tiles; each slot's
``full`` mbarrier (count ``32 * P_WARPS``) signals its copies, its ``empty`` one (count 1) the
consumer's release. 16-bit latents arrive by ``cp.async`` (16 bytes a thread, any page size),
fp8 e4m3 ones through registers, widened exactly (:mod:`._sm90_mla_fp8`).

Bounds: as :mod:`._sm90_prefill_kernel`'s gather (block-table columns and block ids clamped, rows
past the sequence zero-filled by ``cp.async`` or masked loads, not read).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from kv_kernels.paged_attention._sm90_decode_kernel import _decode_class, _split_tiles
from kv_kernels.paged_attention._sm90_mla_fp8 import producer_fp8, producer_fp8_whole
from kv_kernels.paged_attention._sm90_prefill_kernel import _gather, _tile_rows

__all__ = [
    "D_NOPE",
    "D_ROPE",
    "NBUF",
    "P_REGS",
    "P_REGS_FP8",
    "P_REGS_FP8_WHOLE",
    "TILE_N",
    "allocate_ring",
    "producer",
    "program_tiles",
]

#: the latent's nope (= V) and rope widths
D_NOPE = gl.constexpr(512)
D_ROPE = gl.constexpr(64)
#: tokens a KV tile and ring slots (72 KiB a slot at 16 bits: two beside the 64-head kernel's q
#: of 64 KiB and its P of 8 KiB fill 216 of sm_90's 227 KiB)
TILE_N = gl.constexpr(64)
NBUF = 2
#: the producer's registers after ``setmaxnreg`` (the consumer takes the rest)
P_REGS = 40
#: the fp8 producer's (:mod:`._sm90_mla_fp8`: its loads in flight and the piece it widens live in
#: registers). In the 64-head kernel the consumer gets ``(504 - P) / 2`` rounded down to 8 (the
#: launch's 168 registers a thread x 3 warpgroups, as Triton splits them): 224 here, where the
#: 16-bit kernel's 40 leave it 232 (sm_90 build, triton 3.9: at 224 it spills 5 / 12 words a tile
#: inside its loop, at 232 1 / 2; the producer at 56 spills none there, at 40 with one piece in
#: flight 4 / 11).
P_REGS_FP8 = 56
#: the whole-tile fp8 producer's (:func:`._sm90_mla_fp8.producer_fp8_whole`, in the narrow kernel
#: whose one consumer warpgroup needs at most 256): a tile's 72 words of bytes and a half's
#: widened 64 live at once
P_REGS_FP8_WHOLE = 152


@gluon.constexpr_function
def _copy_layout(warps):
    """A ``[tokens, columns]`` copy of 16-bit values, 8 a thread (16 bytes), 8 threads a 128-byte
    row piece: a warp's copy covers 4 whole 128-byte pieces of 4 rows."""
    return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def producer(kvn_smem, kr_smem, full, empty, head_ptr, bt_row_ptr, t_lo, n_tiles, seq_len,
             num_blocks, max_blocks, stride_kb, stride_kn, BLOCK_SIZE: gl.constexpr,
             NBUF_: gl.constexpr, P_WARPS: gl.constexpr, WHOLE: gl.constexpr = False):  # fmt: skip
    """Tiles ``t_lo + [0, n_tiles)`` into the ring: 16-bit latents by ``cp.async``, fp8 ones
    through registers, widened to the ring's dtype (:func:`._sm90_mla_fp8.producer_fp8`, two
    64-byte pieces a row in flight; with ``WHOLE``, :func:`._sm90_mla_fp8.producer_fp8_whole`:
    the tile's every byte, for a kernel that leaves the producer the registers)."""
    if head_ptr.dtype.element_ty.is_fp8() and WHOLE:
        producer_fp8_whole(kvn_smem, kr_smem, full, empty, head_ptr, bt_row_ptr, t_lo, n_tiles,
                           seq_len, num_blocks, max_blocks, stride_kb, stride_kn, BLOCK_SIZE,
                           NBUF_, P_WARPS, TILE_N, D_NOPE, D_ROPE)  # fmt: skip
    elif head_ptr.dtype.element_ty.is_fp8():
        producer_fp8(kvn_smem, kr_smem, full, empty, head_ptr, bt_row_ptr, t_lo, n_tiles,
                     seq_len, num_blocks, max_blocks, stride_kb, stride_kn, BLOCK_SIZE, NBUF_,
                     P_WARPS, TILE_N, D_NOPE, D_ROPE)  # fmt: skip
    else:
        lay: gl.constexpr = _copy_layout(P_WARPS)
        for i in range(n_tiles):
            s = i % NBUF_
            ph = ((i // NBUF_) & 1) ^ 1  # the previous use of the slot
            off, ok = _tile_rows(bt_row_ptr, t_lo + i, seq_len, num_blocks, max_blocks,
                                 stride_kb, stride_kn, BLOCK_SIZE, TILE_N, lay)  # fmt: skip
            mbarrier.wait(empty.index(s), ph, pred=i >= NBUF_)
            _gather(kvn_smem.index(s), head_ptr, off, ok, D_NOPE, lay)
            _gather(kr_smem.index(s), head_ptr + D_NOPE, off, ok, D_ROPE, lay)
            async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def program_tiles(qsl_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val,
                  qk_scale_log2, KV_SCALE: gl.constexpr):  # fmt: skip
    """A decode program's sequence (program axis 1) and split (axis 2): ``(q_start, mine,
    seq_len, t_lo, n_tiles, qk_scale_log2, v_deq)``. The decode class is one query token (longer
    queries: the prefill launch). An fp8 latent's per-tensor scale (one latent head: element 0)
    is a float (``KV_SCALE`` 1) or read on the device (2); V's is the same row's (the launcher
    passes k_scale as v_scale). K's goes into the logits' scale, V's multiplies the output once
    in the epilogue (``v_deq``)."""
    q_start, _q_len, mine, seq_len = _decode_class(qsl_ptr, seq_lens_ptr, gl.program_id(1), 1)
    _t_hi, t_lo, t_end = _split_tiles(seq_len, mine, TILE_N)
    if KV_SCALE == 1:
        qk_scale_log2 = qk_scale_log2 * k_scale_val
        v_deq = v_scale_val
    elif KV_SCALE == 2:
        qk_scale_log2 = qk_scale_log2 * gl.load(k_scale_ptr)
        v_deq = gl.load(v_scale_ptr)
    else:
        v_deq = 1.0
    return q_start, mine, seq_len, t_lo, t_end - t_lo, qk_scale_log2, v_deq


@gluon.jit
def allocate_ring(dtype: gl.constexpr, NBUF_: gl.constexpr, P_WARPS: gl.constexpr):
    """The ring's ``NBUF_`` slots of nope and rope columns and their ``full`` / ``empty``
    barriers, initialized and fenced: ``(kvn_smem, kr_smem, full, empty)``."""
    kvn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, D_NOPE], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, D_ROPE], dtype)
    kvn_smem = gl.allocate_shared_memory(dtype, [NBUF_, TILE_N, D_NOPE], kvn_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [NBUF_, TILE_N, D_ROPE], kr_sl)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    full = gl.allocate_shared_memory(gl.int64, [NBUF_, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [NBUF_, 1], bar_layout)
    for b in gl.static_range(NBUF_):
        mbarrier.init(full.index(b), count=32 * P_WARPS)
        mbarrier.init(empty.index(b), count=1)
    fence_async_shared()
    return kvn_smem, kr_smem, full, empty
