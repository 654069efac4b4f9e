"""MLA decode for Hopper (sm_90) at few query heads (16, 32: DeepSeek-V3's 128 heads under
tensor parallelism 8 and 4), with the latent's tokens as the warpgroup MMA's M.

Why a second MLA kernel. :mod:`._sm90_mla` puts 64 query heads on the MMA's M, the smallest M a
warpgroup MMA has: at 16 heads three quarters of every MMA would be padding (FlashMLA pads the
same way and reads at 0.85 of the copy there, the Triton kernel at 0.81). Here a program takes
every head of one sequence (its split) and turns both products around, so the heads are N (16
or 32) and nothing is padded:

- ``S^T = K q^T``: A the tile's latent rows ``[64 tokens, 576]`` straight from the ring (K-major,
  as :mod:`._sm90_mla`'s ``q K^T`` reads them as B), B q's ``[576, heads]`` from shared memory;
- the online softmax runs down the columns: each head's maximum over the tile's 64 tokens (a
  reduction across the warpgroup's four warps), the row sums kept per token and head and summed
  once at the end;
- ``O^T += V^T P^T``: A the same ring slot read transposed (``[512, 64 tokens]``: V is the
  latent's first 512 columns), B ``P^T`` ``[64 tokens, heads]`` through shared memory; the
  accumulator ``[512, heads]`` float32 is 64 registers a thread at 16 heads.

At 16 heads a tile's MMAs are ~2.2 MFLOP against 74 KB of latent (bf16): ~730 cycles of tensor
work against ~5,000 cycles of the tile's share of HBM, so the kernel is a copy with a little
arithmetic, as decode should be. The producer and the ring are :mod:`._sm90_mla`'s (``cp.async``
of 16-bit latents; an fp8 e4m3 latent widened into the same ring by :mod:`._sm90_mla_fp8`), one
consumer warpgroup, one program an SM (the ring's two 72 KiB slots), splits to fill the card.

Measured on the H200 (16 heads, 64 x 4k): the 16-bit latent reads at 0.92-0.93 of the copy
(1.03-1.05x FlashMLA); the fp8 one at 0.49-0.50 of its bytes' copy, where the consumer's MMAs and
softmax alone take ~0.05 of the 0.069 ms. Two consumer warpgroups on alternate tiles were slower
(0.075 ms; bf16 0.063 against 0.061): the bound is what they share, the MMAs' A operands read from
shared memory (at N = 16 each MMA reads 2 KiB for 32 KFLOP), so the next step is operands loaded
into registers, not more warpgroups.

Bounds and masks: the producer's (block-table columns and block ids clamped, rows past the
sequence zero-filled and not read); their logits are masked here too.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from kv_kernels._launch import FastLauncher
from kv_kernels.paged_attention._gluon_compat import barrier
from kv_kernels.paged_attention._sm90_mla_ring import (
    D_NOPE,
    D_ROPE,
    TILE_N,
    allocate_ring,
    producer,
    program_tiles,
)

__all__ = ["NARROW_HEADS", "sm90_mla_narrow_kernel"]

#: the query head counts this kernel serves (the MMA's N). 8 heads would build (an MMA's N can be
#: any multiple of 8), but there the Triton kernel's decode config packs two query tokens a
#: program (16 rows), so its decode class is not one token a sequence (``block_q`` 2), which this
#: kernel serves
NARROW_HEADS = (16, 32)


@gluon.constexpr_function
def _acc_layout(heads):
    """A ``[rows, heads]`` warpgroup-MMA accumulator of the consumer's four warps (``S^T``: 64
    token rows; ``O^T``: 512 latent rows, eight MMAs down M)."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, heads, 16]
    )


@gluon.jit
def _consumer(qn_smem, qr_smem, kvn_smem, kr_smem, p_smem, full, empty, t_lo, n_tiles, seq_len,
              qk_scale_log2, HEADS: gl.constexpr, NBUF_: gl.constexpr):  # fmt: skip
    """Every head over the program's tiles: ``(acc^T [512, heads], m [heads], l [heads])``, the
    maxima of raw logits. A slot is released once its ``P V`` is done in every warp."""
    dtype: gl.constexpr = qn_smem.dtype
    lay: gl.constexpr = _acc_layout(HEADS)
    rows = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, lay))
    m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, lay))
    l_part = gl.zeros([TILE_N, HEADS], gl.float32, layout=lay)
    acc = gl.zeros([D_NOPE, HEADS], gl.float32, layout=lay)
    s_zero = gl.zeros([TILE_N, HEADS], gl.float32, layout=lay)
    for i in range(n_tiles):
        s = i % NBUF_
        mbarrier.wait(full.index(s), (i // NBUF_) & 1)
        kv = kvn_smem.index(s)
        st = warpgroup_mma(kv, qn_smem.permute((1, 0)), s_zero, use_acc=False)
        st = warpgroup_mma(kr_smem.index(s), qr_smem.permute((1, 0)), st)
        kpos = (t_lo + i) * TILE_N + rows
        st = gl.where((kpos < seq_len)[:, None], st, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(st, 0))
        # a head that has seen nothing keeps m = -inf: exp2 against 0 keeps its weights at 0
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale_log2
        alpha = gl.exp2(m_i * qk_scale_log2 - m_use)
        p32 = gl.exp2(st * qk_scale_log2 - m_use[None, :])
        l_part = l_part * alpha[None, :] + p32
        m_i = m_new
        acc = acc * alpha[None, :]
        p_smem.store(p32.to(dtype))
        fence_async_shared()
        barrier()  # every warp's part of P^T stored
        acc = warpgroup_mma(kv.permute((1, 0)), p_smem, acc)
        barrier()  # every warp's P^T V^T done: the slot and P^T are free
        mbarrier.arrive(empty.index(s), count=1)
    return acc, m_i, gl.sum(l_part, 0)


# (num_blocks is a bound, never a constexpr: see _sm90_mla.sm90_mla_kernel; the signature is that
# kernel's, so one argument tuple serves both launches and program axis 0 is always 1 here)
@gluon.jit(do_not_specialize=["num_blocks"])
def sm90_mla_narrow_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kb, stride_kn,
    bt_ptr, stride_bts,
    seq_lens_ptr, qsl_ptr,
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, k_scale_val, v_scale_val,
    out_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt, stride_lh,
    part_out_ptr, part_lse_ptr,
    num_q_heads, num_blocks, max_blocks, qk_scale_log2,
    BLOCK_SIZE: gl.constexpr, KV_SCALE: gl.constexpr, SPLIT: gl.constexpr,
    WRITE_LSE: gl.constexpr, NBUF_: gl.constexpr, P_WARPS: gl.constexpr, P_REGS_: gl.constexpr,
    HEADS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(num_warps == 4, "one consumer warpgroup")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    seq = gl.program_id(1)
    split = gl.program_id(2)
    num_splits = gl.num_programs(2)
    q_start, mine, seq_len, t_lo, n_tiles, qk_scale_log2, v_deq = program_tiles(
        qsl_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, qk_scale_log2,
        KV_SCALE,
    )  # fmt: skip

    # ---- q: every head's nope and rope columns into shared memory (the MMAs' B) --------------
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rq = gl.arange(0, HEADS, layout=gl.SliceLayout(1, q_l))
    q_rows = q_start.to(gl.int64) * stride_qt + rq.to(gl.int64) * stride_qh
    q_in = mine & (rq >= 0)
    cn = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, q_l))
    cr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, q_l))
    qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, D_NOPE], dtype)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, D_ROPE], dtype)
    qn_smem = gl.allocate_shared_memory(
        dtype, [HEADS, D_NOPE], qn_sl,
        gl.load(q_ptr + q_rows[:, None] + cn[None, :], mask=q_in[:, None], other=0.0),
    )  # fmt: skip
    qr_smem = gl.allocate_shared_memory(
        dtype, [HEADS, D_ROPE], qr_sl,
        gl.load(q_ptr + q_rows[:, None] + (D_NOPE + cr)[None, :], mask=q_in[:, None], other=0.0),
    )  # fmt: skip

    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HEADS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [TILE_N, HEADS], p_sl)
    kvn_smem, kr_smem, full, empty = allocate_ring(dtype, NBUF_, P_WARPS)

    bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bts
    acc, m_i, l_i = gl.warp_specialize(
        [
            (_consumer, (qn_smem, qr_smem, kvn_smem, kr_smem, p_smem, full, empty, t_lo,
                         n_tiles, seq_len, qk_scale_log2, HEADS, NBUF_)),
            (producer, (kvn_smem, kr_smem, full, empty, kv_ptr, bt_row_ptr, t_lo, n_tiles,
                        seq_len, num_blocks, max_blocks, stride_kb, stride_kn, BLOCK_SIZE,
                        NBUF_, P_WARPS, True)),
        ],
        [P_WARPS],
        [P_REGS_],
    )  # fmt: skip

    # ---- epilogue: normalize, store O (= acc^T) and the LSE per head -------------------------
    lay: gl.constexpr = acc.type.layout
    has = l_i > 0.0
    l_div = gl.where(has, l_i, 1.0)
    if KV_SCALE > 0:
        o = acc * (v_deq / l_div)[None, :]
    else:
        o = acc / l_div[None, :]
    lse = gl.where(has, (m_i * qk_scale_log2 + gl.log2(l_div)) * 0.6931471805599453, float("-inf"))
    d = gl.arange(0, D_NOPE, layout=gl.SliceLayout(1, lay))
    head = gl.arange(0, HEADS, layout=gl.SliceLayout(0, lay))
    ok = mine & (head >= 0)
    tok = q_start.to(gl.int64)
    if SPLIT:
        part = (tok * num_q_heads + head) * num_splits + split
        gl.store(part_lse_ptr + part, lse, mask=ok)
        gl.store(part_out_ptr + part[None, :] * D_NOPE + d[:, None], o, mask=ok[None, :])
    else:
        o_ptrs = out_ptr + (tok * stride_ot + head.to(gl.int64) * stride_oh)[None, :] + d[:, None]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=ok[None, :])
        if WRITE_LSE:
            gl.store(lse_ptr + tok * stride_lt + head.to(gl.int64) * stride_lh, lse, mask=ok)


#: bound launches (kv_kernels._launch)
FAST_NARROW = FastLauncher(sm90_mla_narrow_kernel)
