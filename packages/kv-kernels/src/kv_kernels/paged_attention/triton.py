"""Unified Triton paged-attention kernel (prefill, chunked prefill and decode in one batch).

Work split. A program owns one tile of a sequence's query tokens and one kv head, and computes all
``G = Hq / H`` query heads of that kv head together: its ``BLOCK_M`` rows are ``BLOCK_Q`` tokens x
``G`` heads (row ``m`` is token ``m // G``, head ``m % G``), so a decode step of a GQA model still
feeds the tensor cores a 16-row tile and every K/V byte is read once per kv head, not once per
q head. The program walks the sequence's KV in ``TILE_N``-token tiles read through the block
table (64-bit offsets: ``block_id * stride_B`` easily passes 2^31 elements on a large cache), with
an online softmax in base 2. Tiles entirely outside the causal / sliding-window range are never
visited; tiles entirely inside it run without the mask arithmetic.

Two launches, one per query-length class. Sequences with ``q_len <= BLOCK_Q(decode)`` (decode,
short speculative steps) run with a small-M "decode" config, one program per sequence (no search);
longer ones run with a large-M "prefill" config whose programs find their sequence by a binary
search over ``query_start_loc``. The class of a sequence depends only on its own ``q_len``, so a
sequence is computed by the same tile shapes whatever else is in the batch.

Split KV (flash-decoding). With ``num_splits = S > 1`` the third grid axis cuts each program's KV
tile range into ``S`` contiguous chunks; each writes a normalized partial output and its LSE, and a
second small kernel merges them by log-sum-exp in a fixed order. The chunk bounds depend only on the
sequence and ``S``, so a fixed ``num_splits`` gives bit-identical results regardless of the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

__all__ = [
    "AotSpec",
    "AttentionConfig",
    "aot_specs",
    "merge_attn_states_triton",
    "paged_attention_triton",
    "pick_num_splits",
    "select_config",
]

#: Shared memory we let one program's pipeline buffers take (bytes): the sm_90 / sm_80 limits
#: (227 KiB / 163 KiB per block) less room for the Q tile, P and the compiler's scratch.
_SMEM_BUDGET = {90: 160 * 1024, 80: 112 * 1024}


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh through exp: portable across Triton versions and the interpreter; saturates to +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``qsl[s] // BLOCK_Q + s <= pid``: the sequence whose q tiles hold ``pid``.

    ``qsl[s] // BLOCK_Q + s`` bounds the number of tiles of sequences ``< s`` from above (each
    sequence gets ``ceil(q_len / BLOCK_Q)`` tiles, at most one more than its share of the floor),
    so the grid ``T // BLOCK_Q + num_seqs`` covers every tile without a host sync.
    """
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        go_right = start <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,  # [M, DV_PAD] f32, [M] f32, [M] f32 (log2 units), [M, D_PAD]
    t_begin,
    t_end,  # KV tile range [t_begin, t_end)
    bt_row_ptr,
    stride_btb,
    kv_head_ptr,
    stride_kb,
    stride_kn,
    stride_kc,
    k_start,
    v_start,
    seq_len,
    q_pos,
    slopes,
    qk_scale,
    softcap,
    window,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    FOLD_LOG2: tl.constexpr,
    DOT_IEEE: tl.constexpr,
):
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_ok = offs_d < HEAD_SIZE
    dv_ok = offs_dv < HEAD_SIZE_V
    k_cols = (k_start + offs_d) * stride_kc  # [D_PAD]
    v_cols = (v_start + offs_dv) * stride_kc  # [DV_PAD]
    for t in range(t_begin, t_end):
        kpos = t * TILE_N + offs_n  # [TILE_N] absolute kv positions
        if BLOCK_SIZE % TILE_N == 0:
            # The tile lies inside one page: one block id, consecutive rows.
            blk = tl.load(bt_row_ptr + ((t * TILE_N) // BLOCK_SIZE) * stride_btb).to(tl.int64)
            row = ((t * TILE_N) % BLOCK_SIZE + offs_n).to(tl.int64)
            tok_off = blk * stride_kb + row * stride_kn  # [TILE_N] int64
        else:
            # The tile spans several pages: one block id per token (cached loads of the same ids).
            if MASKED:
                blk = tl.load(
                    bt_row_ptr + (kpos // BLOCK_SIZE) * stride_btb, mask=kpos < seq_len, other=0
                )
            else:
                blk = tl.load(bt_row_ptr + (kpos // BLOCK_SIZE) * stride_btb)
            tok_off = blk.to(tl.int64) * stride_kb + (kpos % BLOCK_SIZE).to(tl.int64) * stride_kn
        k_ptrs = kv_head_ptr + tok_off[:, None] + k_cols[None, :]  # [TILE_N, D_PAD]
        v_ptrs = kv_head_ptr + tok_off[:, None] + v_cols[None, :]  # [TILE_N, DV_PAD]
        if MASKED:
            in_seq = kpos < seq_len
            k = tl.load(k_ptrs, mask=in_seq[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_seq[:, None] & dv_ok[None, :], other=0.0)
        else:
            if D_PAD == HEAD_SIZE:
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            if DV_PAD == HEAD_SIZE_V:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        # fp8 pages are upcast to the query dtype right after the load (their scale is folded
        # into qk_scale / the output); for 16-bit caches this is a no-op.
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if DOT_IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [M, TILE_N] f32
        s = s * qk_scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if USE_ALIBI:
            s = s + slopes[:, None] * (kpos[None, :] - q_pos[:, None]).to(tl.float32)
        if not FOLD_LOG2:
            s = s * 1.4426950408889634
        if MASKED:
            vis = kpos[None, :] < seq_len
            if CAUSAL:
                vis = vis & (kpos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                vis = vis & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet keeps m = -inf; exp2 against 0 keeps it at zero
            # weight instead of nan (and makes fully-masked tiles exact no-ops: alpha = 1, p = 0).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DOT_IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    stride_qd,  # [T, Hq, D]
    kv_ptr,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kc,  # [B, H, N, C] layer view
    bt_ptr,
    stride_bts,
    stride_btb,  # [num_seqs, max_blocks]
    seq_lens_ptr,
    qsl_ptr,  # [num_seqs], [num_seqs + 1]
    sinks_ptr,
    alibi_ptr,  # [Hq] f32 each (dummies when unused)
    k_scale_ptr,
    v_scale_ptr,
    stride_ks,
    stride_vs,
    k_scale_val,
    v_scale_val,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,  # [T, Hq, Dv]
    lse_ptr,
    stride_lt,
    stride_lh,  # [T, Hq] f32
    part_out_ptr,
    part_lse_ptr,  # [T, Hq, S, DV_PAD] / [T, Hq, S] f32, contiguous
    num_seqs,
    num_q_heads,
    k_start,
    v_start,
    scale,
    softcap,
    window,
    q_len_min,
    q_len_max,  # this launch's query-length class
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SEQ_PER_PROGRAM: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    FOLD_LOG2: tl.constexpr,
    KV_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_IEEE: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if SEQ_PER_PROGRAM:
        seq = pid_q
        q_tile = 0
    else:
        seq = _find_seq(qsl_ptr, num_seqs, pid_q, BLOCK_Q)
        q_tile = pid_q - (tl.load(qsl_ptr + seq).to(tl.int32) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    if (q_len < q_len_min) | (q_len > q_len_max) | (q_tile * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - q_len  # absolute position of this sequence's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    r_tok = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP  # [M] q head of each row
    q_local = q_tile * BLOCK_Q + r_tok
    row_ok = (r_tok < BLOCK_Q) & (q_local < q_len)
    q_pos = ctx + q_local  # [M]
    tok = (q_start + q_local).to(tl.int64)  # [M] row of q / out
    q_ptrs = (
        q_ptr
        + tok[:, None] * stride_qt
        + head[:, None].to(tl.int64) * stride_qh
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_SIZE), other=0.0)

    if KV_SCALE == 1:
        k_deq = k_scale_val
        v_deq = v_scale_val
    elif KV_SCALE == 2:
        k_deq = tl.load(k_scale_ptr + kvh * stride_ks)
        v_deq = tl.load(v_scale_ptr + kvh * stride_vs)
    else:
        k_deq = 1.0
        v_deq = 1.0
    qk_scale = scale * k_deq
    if FOLD_LOG2:
        qk_scale = qk_scale * 1.4426950408889634
    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + head)
    else:
        slopes = tl.zeros([BLOCK_M], dtype=tl.float32)

    # KV range of the tile's rows: [lo, hi) seen by some row; [lo_full, hi_full) seen by every row.
    first_q = q_tile * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    if CAUSAL:
        hi = tl.minimum(seq_len, ctx + last_q + 1)
        hi_full = tl.minimum(seq_len, ctx + first_q + 1)
    else:
        hi = seq_len
        hi_full = seq_len
    if USE_WINDOW:
        lo = tl.maximum(ctx + first_q - window + 1, 0)
        lo_full = tl.maximum(ctx + last_q - window + 1, 0)
    else:
        lo = seq_len * 0
        lo_full = seq_len * 0
    t_lo = lo // TILE_N
    t_hi = tl.maximum(tl.cdiv(tl.maximum(hi, 0), TILE_N), t_lo)
    tf_lo = tl.minimum(tl.maximum(tl.cdiv(lo_full, TILE_N), t_lo), t_hi)
    tf_hi = tl.minimum(tl.maximum(tl.maximum(hi_full, 0) // TILE_N, tf_lo), t_hi)
    # This program's share of the tiles: chunk `split` of `num_splits` contiguous chunks.
    per_split = tl.cdiv(t_hi - t_lo, num_splits)
    s_lo = tl.minimum(t_lo + split * per_split, t_hi)
    s_hi = tl.minimum(s_lo + per_split, t_hi)

    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    kv_head_ptr = kv_ptr + kvh.to(tl.int64) * stride_kh
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bts
    # window's lower edge (masked), the fully visible middle (no mask), the causal diagonal / tail (masked)
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        tl.maximum(t_lo, s_lo),
        tl.minimum(tf_lo, s_hi),
        bt_row_ptr,
        stride_btb,
        kv_head_ptr,
        stride_kb,
        stride_kn,
        stride_kc,
        k_start,
        v_start,
        seq_len,
        q_pos,
        slopes,
        qk_scale,
        softcap,
        window,
        HEAD_SIZE,
        HEAD_SIZE_V,
        D_PAD,
        DV_PAD,
        BLOCK_SIZE,
        TILE_N,
        True,
        CAUSAL,
        USE_WINDOW,
        USE_SOFTCAP,
        USE_ALIBI,
        FOLD_LOG2,
        DOT_IEEE,
    )
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        tl.maximum(tf_lo, s_lo),
        tl.minimum(tf_hi, s_hi),
        bt_row_ptr,
        stride_btb,
        kv_head_ptr,
        stride_kb,
        stride_kn,
        stride_kc,
        k_start,
        v_start,
        seq_len,
        q_pos,
        slopes,
        qk_scale,
        softcap,
        window,
        HEAD_SIZE,
        HEAD_SIZE_V,
        D_PAD,
        DV_PAD,
        BLOCK_SIZE,
        TILE_N,
        False,
        CAUSAL,
        USE_WINDOW,
        USE_SOFTCAP,
        USE_ALIBI,
        FOLD_LOG2,
        DOT_IEEE,
    )
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        tl.maximum(tf_hi, s_lo),
        tl.minimum(t_hi, s_hi),
        bt_row_ptr,
        stride_btb,
        kv_head_ptr,
        stride_kb,
        stride_kn,
        stride_kc,
        k_start,
        v_start,
        seq_len,
        q_pos,
        slopes,
        qk_scale,
        softcap,
        window,
        HEAD_SIZE,
        HEAD_SIZE_V,
        D_PAD,
        DV_PAD,
        BLOCK_SIZE,
        TILE_N,
        True,
        CAUSAL,
        USE_WINDOW,
        USE_SOFTCAP,
        USE_ALIBI,
        FOLD_LOG2,
        DOT_IEEE,
    )

    has = l_i > 0.0
    l_div = tl.where(has, l_i, 1.0)
    o = acc / l_div[:, None]  # rows that saw nothing have acc = 0
    lse = tl.where(has, (m_i + tl.log2(l_div)) * 0.6931471805599453, float("-inf"))  # natural log
    if KV_SCALE != 0:
        o = o * v_deq
    if SPLIT:
        part = (tok * num_q_heads + head) * num_splits + split  # [M] int64
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * DV_PAD + offs_dv[None, :], o, mask=row_ok[:, None])
    else:
        if USE_SINKS:
            sink = tl.load(sinks_ptr + head)
            m = tl.maximum(lse, sink)
            m = tl.where(m == float("-inf"), 0.0, m)
            lse_tot = m + tl.log(tl.exp(lse - m) + tl.exp(sink - m))
            o = o * tl.exp(lse - lse_tot)[:, None]
            lse = lse_tot
        o_ptrs = (
            out_ptr
            + tok[:, None] * stride_ot
            + head[:, None].to(tl.int64) * stride_oh
            + offs_dv[None, :] * stride_od
        )
        tl.store(
            o_ptrs,
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_SIZE_V),
        )
        if WRITE_LSE:
            tl.store(lse_ptr + tok * stride_lt + head.to(tl.int64) * stride_lh, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,  # [T, Hq, S, DV_PAD] / [T, Hq, S] f32, contiguous
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,  # [T, Hq, Dv]
    lse_ptr,
    stride_lt,
    stride_lh,  # [T, Hq] f32
    sinks_ptr,
    qsl_ptr,
    num_seqs,
    num_q_heads,
    num_splits,
    HEAD_SIZE_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_seqs):
        return  # CUDA-graph padding rows: nothing wrote their partials
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, DV_PAD)
    s_ok = offs_s < num_splits
    base = (tok * num_q_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))  # [S_PAD]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # [S_PAD]; empty splits (lse = -inf) weigh 0
    tot = tl.sum(w, 0)
    o = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * DV_PAD + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    o = tl.sum(o * w[:, None], 0) / tl.where(tot > 0.0, tot, 1.0)  # [DV_PAD]
    lse_tot = tl.where(tot > 0.0, m + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf"))
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head)
        mm = tl.maximum(lse_tot, sink)
        mm = tl.where(mm == float("-inf"), 0.0, mm)
        with_sink = mm + tl.log(tl.exp(lse_tot - mm) + tl.exp(sink - mm))
        o = o * tl.exp(lse_tot - with_sink)
        lse_tot = with_sink
    o_ptrs = out_ptr + tok * stride_ot + head.to(tl.int64) * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE_V)
    if WRITE_LSE:
        tl.store(lse_ptr + tok * stride_lt + head.to(tl.int64) * stride_lh, lse_tot)


@triton.jit
def _merge_two_kernel(
    a_ptr,
    stride_at,
    stride_ah,
    stride_ad,
    lse_a_ptr,
    stride_lat,
    stride_lah,
    b_ptr,
    stride_bt,
    stride_bh,
    stride_bd,
    lse_b_ptr,
    stride_lbt,
    stride_lbh,
    o_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    lse_o_ptr,  # out [T, Hq, Dv], lse [T, Hq] contiguous
    num_q_heads,
    HEAD_SIZE_V: tl.constexpr,
    DV_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, DV_PAD)
    d_ok = offs_d < HEAD_SIZE_V
    la = tl.load(lse_a_ptr + tok * stride_lat + head * stride_lah)
    lb = tl.load(lse_b_ptr + tok * stride_lbt + head * stride_lbh)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    tot = wa + wb
    inv = tl.where(tot > 0.0, 1.0 / tl.where(tot > 0.0, tot, 1.0), 0.0)
    a = tl.load(
        a_ptr + tok * stride_at + head * stride_ah + offs_d * stride_ad, mask=d_ok, other=0.0
    ).to(tl.float32)
    b = tl.load(
        b_ptr + tok * stride_bt + head * stride_bh + offs_d * stride_bd, mask=d_ok, other=0.0
    ).to(tl.float32)
    o = a * (wa * inv) + b * (wb * inv)
    tl.store(
        o_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(o_ptr.dtype.element_ty),
        mask=d_ok,
    )
    lse = tl.where(tot > 0.0, m + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf"))
    tl.store(lse_o_ptr + tok * num_q_heads + head, lse)


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shapes of one launch class (``"decode"`` or ``"prefill"``)."""

    block_m: int  # query rows per program: block_q tokens x group heads (padded to a power of 2)
    block_q: int  # query tokens per program
    tile_n: int  # KV tokens per inner step
    num_warps: int
    num_stages: int


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def select_config(
    kind: str,
    *,
    head_size: int,
    head_size_v: int,
    group: int,
    block_size: int,
    elem_bytes: int = 2,
    arch: int = 90,
) -> AttentionConfig:
    """Tile shapes for ``kind`` that fit the arch's shared memory.

    A function of static properties only (head sizes, GQA group, kernel block size, dtype, arch),
    never of the batch: that is what keeps a fixed ``num_splits`` batch-invariant.

    Decode is bandwidth-bound: 16 rows (the smallest tensor-core tile; a decode step of a GQA
    group of 4 fills 4 of them, speculative steps of up to 4 tokens fill all) and deep
    pipelines of KV tiles. Prefill is compute-bound: 128 rows (64 past head size 128) so each
    KV tile feeds two warpgroups' MMAs.
    """
    d_pad, dv_pad = _pow2(head_size), _pow2(head_size_v)
    budget = _SMEM_BUDGET.get(arch, _SMEM_BUDGET[80])
    row_bytes = (d_pad + dv_pad) * max(elem_bytes, 2)  # one KV token of K and V in shared memory
    if kind == "decode":
        block_m = max(16, _pow2(group))
        # H100, head 128, bf16: every tile_n in 32..128 and 2..4 stages read within 1% of each
        # other (2.85-2.94 TB/s of a 3.0 TB/s copy): bandwidth comes from occupancy and splits.
        tile_n = 64 if d_pad + dv_pad <= 256 else 32
        num_warps = 4
        num_stages = 4
    elif kind == "prefill":
        block_m = 128 if max(d_pad, dv_pad) <= 128 else 64
        block_m = max(block_m, _pow2(group))
        tile_n = 64
        # Measured on an H100 (4 x 4096 causal, head 128, block 16, tile_n 64): one warpgroup
        # over the 128 rows with 3 stages gave 326 TFLOP/s; 8 warps gave 315 / 293 / 293 with
        # 2 / 3 / 4 stages; 64 rows gave 287.
        num_warps = 4
        num_stages = 3
    else:
        raise ValueError(f"config kind={kind!r} must be 'decode' or 'prefill'")
    if elem_bytes == 1:
        # fp8 pages are upcast to 16 bits before the MMA: a second copy of each tile.
        row_bytes += (d_pad + dv_pad) * 2
    while num_stages > 2 and num_stages * tile_n * row_bytes > budget:
        num_stages -= 1
    while tile_n > 16 and num_stages * tile_n * row_bytes > budget:
        tile_n //= 2
    return AttentionConfig(block_m, block_m // group, tile_n, num_warps, num_stages)


def pick_num_splits(
    *, num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_n: int, num_sms: int
) -> int:
    """KV split count for a decode batch: enough programs for ~2 waves of the GPU, while each
    split keeps at least 8 KV tiles (fewer and the merge and the prologue dominate)."""
    programs = max(1, num_seqs * num_kv_heads)
    tiles = -(-max(max_seq_len, 1) // tile_n)
    splits = 1
    while splits < 64 and programs * splits < 2 * num_sms and tiles >= 16 * splits:
        splits *= 2
    return splits


@functools.lru_cache(maxsize=16)
def _device_info(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major * 10 + props.minor, props.multi_processor_count


def _arch_and_sms(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 90, 132  # interpreter: pretend to be an H100 so the configs match the GPU's
    arch, sms = _device_info(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    return (90 if arch >= 90 else 80), sms


def _check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and type(_paged_attention_kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            "kv_kernels.paged_attention.triton was imported without TRITON_INTERPRET=1, so its kernels "
            "cannot run on CPU tensors; set TRITON_INTERPRET=1 before the first import"
        )


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [B, H, N, C]
    *,
    k_range: tuple[int, int],
    v_range: tuple[int, int],
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    return_lse: bool,
    out: torch.Tensor,
    max_query_len: int,
    max_seq_len: int | None,
    block_size: int,
    num_splits: int | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch the unified kernel (and the split merge); inputs validated by the api."""
    _check_runnable(q.device)
    num_tokens, num_q_heads, head_size = q.shape
    _, num_kv_heads, _, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    head_size_v = v_range[1] - v_range[0]
    lse = (
        torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
        if return_lse
        else None
    )
    num_seqs = block_table.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return (out, lse) if lse is not None else out
    arch, num_sms = _arch_and_sms(q.device)
    elem = kv_cache.element_size()
    cfg_dec = select_config(
        "decode",
        head_size=head_size,
        head_size_v=head_size_v,
        group=group,
        block_size=block_size,
        elem_bytes=elem,
        arch=arch,
    )
    cfg_pre = select_config(
        "prefill",
        head_size=head_size,
        head_size_v=head_size_v,
        group=group,
        block_size=block_size,
        elem_bytes=elem,
        arch=arch,
    )
    run_prefill = max_query_len > cfg_dec.block_q
    if num_splits is None:
        if run_prefill:
            num_splits = 1  # prefill tiles fill the GPU on their own
        else:
            bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
            num_splits = pick_num_splits(
                num_seqs=num_seqs,
                num_kv_heads=num_kv_heads,
                max_seq_len=bound,
                tile_n=cfg_dec.tile_n,
                num_sms=num_sms,
            )
    split = num_splits > 1
    dv_pad = _pow2(head_size_v)
    if split:
        part_out = torch.empty(
            (num_tokens, num_q_heads, num_splits, dv_pad), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # never touched
    # fp8 dequant scales: two floats ride as scalar arguments; if either is a tensor (per tensor
    # or per kv head) both are read from memory (a float partner becomes a 1-element tensor).
    ks_ptr = vs_ptr = q
    ks_stride = vs_stride = 0
    ks_val = vs_val = 1.0
    if k_scale is None:
        kv_scale_mode = 0
    elif isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        kv_scale_mode = 2
        ks_ptr, vs_ptr = (
            x
            if isinstance(x, torch.Tensor)
            else torch.full((1,), float(x), dtype=torch.float32, device=q.device)  # type: ignore[arg-type]
            for x in (k_scale, v_scale)
        )
        ks_stride = 0 if ks_ptr.numel() == 1 else 1
        vs_stride = 0 if vs_ptr.numel() == 1 else 1
    else:
        kv_scale_mode = 1
        ks_val, vs_val = float(k_scale), float(v_scale)  # type: ignore[arg-type]
    lse_t = lse if lse is not None else out
    common: dict[str, Any] = dict(
        HEAD_SIZE=head_size,
        HEAD_SIZE_V=head_size_v,
        D_PAD=_pow2(head_size),
        DV_PAD=dv_pad,
        BLOCK_SIZE=block_size,
        GROUP=group,
        CAUSAL=causal,
        USE_WINDOW=sliding_window is not None,
        USE_SINKS=sinks is not None,
        USE_SOFTCAP=softcap > 0,
        USE_ALIBI=alibi_slopes is not None,
        FOLD_LOG2=not (softcap > 0 or alibi_slopes is not None),
        KV_SCALE=kv_scale_mode,
        SPLIT=split,
        WRITE_LSE=return_lse,
        DOT_IEEE=q.dtype == torch.float32,
    )
    args = (
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv_cache,
        *kv_cache.stride(),
        block_table,
        block_table.stride(0),
        block_table.stride(1),
        seq_lens,
        query_start_loc,
        sinks if sinks is not None else q,
        alibi_slopes if alibi_slopes is not None else q,
        ks_ptr,
        vs_ptr,
        ks_stride,
        vs_stride,
        ks_val,
        vs_val,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse_t,
        lse_t.stride(0),
        lse_t.stride(1),
        part_out,
        part_lse,
        num_seqs,
        num_q_heads,
        k_range[0],
        v_range[0],
        scale,
        float(softcap),
        int(sliding_window or 0),
    )
    # decode class: q_len in [1, block_q(decode)], one program per sequence
    _paged_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        *args,
        1,
        cfg_dec.block_q,
        BLOCK_M=cfg_dec.block_m,
        BLOCK_Q=cfg_dec.block_q,
        TILE_N=cfg_dec.tile_n,
        SEQ_PER_PROGRAM=True,
        **common,
        num_warps=cfg_dec.num_warps,
        num_stages=cfg_dec.num_stages,
    )
    if run_prefill:
        grid_q = num_tokens // cfg_pre.block_q + num_seqs
        _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
            *args,
            cfg_dec.block_q + 1,
            2**31 - 1,
            BLOCK_M=cfg_pre.block_m,
            BLOCK_Q=cfg_pre.block_q,
            TILE_N=cfg_pre.tile_n,
            SEQ_PER_PROGRAM=False,
            **common,
            num_warps=cfg_pre.num_warps,
            num_stages=cfg_pre.num_stages,
        )
    if split:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse_t,
            lse_t.stride(0),
            lse_t.stride(1),
            sinks if sinks is not None else q,
            query_start_loc,
            num_seqs,
            num_q_heads,
            num_splits,
            HEAD_SIZE_V=head_size_v,
            DV_PAD=dv_pad,
            S_PAD=_pow2(num_splits),
            USE_SINKS=sinks is not None,
            WRITE_LSE=return_lse,
            num_warps=4 if dv_pad * _pow2(num_splits) >= 2048 else 2,
        )
    return (out, lse) if lse is not None else out


def merge_attn_states_triton(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (validated by the api) in one launch over ``(T, Hq)``."""
    _check_runnable(out_a.device)
    num_tokens, num_q_heads, head_size_v = out_a.shape
    out = torch.empty(
        (num_tokens, num_q_heads, head_size_v), dtype=out_a.dtype, device=out_a.device
    )
    lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=out_a.device)
    if num_tokens == 0 or num_q_heads == 0:
        return out, lse
    _merge_two_kernel[(num_tokens, num_q_heads)](
        out_a,
        *out_a.stride(),
        lse_a,
        *lse_a.stride(),
        out_b,
        *out_b.stride(),
        lse_b,
        *lse_b.stride(),
        out,
        *out.stride(),
        lse,
        num_q_heads,
        HEAD_SIZE_V=head_size_v,
        DV_PAD=_pow2(head_size_v),
        num_warps=1 if head_size_v <= 128 else 2,
    )
    return out, lse


# ----------------------------------------------------------------------------------------------
# ahead-of-time compile specs (CI compiles every kernel for sm_90 / sm_80 with no GPU)
# ----------------------------------------------------------------------------------------------


class AotSpec(NamedTuple):
    """One kernel variant to compile ahead of time."""

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    aligned: tuple[str, ...]


_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}


def aot_specs(
    *,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_size: int,
    head_size_v: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    arch: int,
) -> list[AotSpec]:
    """Every kernel variant the launcher would run on such a cache, with the launcher's own
    configs (so CI compiles what runs). Strides of the cache are ``i64`` (the large-cache case);
    ``aligned`` names the arguments Triton would see as multiples of 16 at launch."""
    qt, ct = _TRITON_TYPES[q_dtype], _TRITON_TYPES[cache_dtype]
    group = num_q_heads // num_kv_heads
    elem = torch.empty((), dtype=cache_dtype).element_size()
    fp8 = elem == 1
    i32, i64 = "i32", "i64"
    sig = {
        "q_ptr": f"*{qt}",
        "stride_qt": i32,
        "stride_qh": i32,
        "stride_qd": i32,
        "kv_ptr": f"*{ct}",
        "stride_kb": i64,
        "stride_kh": i64,
        "stride_kn": i64,
        "stride_kc": i64,
        "bt_ptr": "*i32",
        "stride_bts": i32,
        "stride_btb": i32,
        "seq_lens_ptr": "*i32",
        "qsl_ptr": "*i32",
        "sinks_ptr": "*fp32",
        "alibi_ptr": "*fp32",
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        "stride_ks": i32,
        "stride_vs": i32,
        "k_scale_val": "fp32",
        "v_scale_val": "fp32",
        "out_ptr": f"*{qt}",
        "stride_ot": i32,
        "stride_oh": i32,
        "stride_od": i32,
        "lse_ptr": "*fp32",
        "stride_lt": i32,
        "stride_lh": i32,
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "num_seqs": i32,
        "num_q_heads": i32,
        "k_start": i32,
        "v_start": i32,
        "scale": "fp32",
        "softcap": "fp32",
        "window": i32,
        "q_len_min": i32,
        "q_len_max": i32,
    }
    # Arguments Triton sees as multiples of 16 at launch (aligned pointers, page strides).
    aligned = (
        *tuple(n for n, t in sig.items() if t.startswith("*")),
        "stride_qt",
        "stride_qh",
        "stride_kb",
        "stride_kh",
        "stride_kn",
        "stride_bts",
        "stride_ot",
        "stride_oh",
        "v_start",
    )
    specs: list[AotSpec] = []
    for kind in ("decode", "prefill"):
        cfg = select_config(
            kind,
            head_size=head_size,
            head_size_v=head_size_v,
            group=group,
            block_size=block_size,
            elem_bytes=elem,
            arch=arch,
        )
        for split in (False, True):
            if kind == "prefill" and split:
                continue
            consts = dict(
                HEAD_SIZE=head_size,
                HEAD_SIZE_V=head_size_v,
                D_PAD=_pow2(head_size),
                DV_PAD=_pow2(head_size_v),
                BLOCK_SIZE=block_size,
                GROUP=group,
                BLOCK_M=cfg.block_m,
                BLOCK_Q=cfg.block_q,
                TILE_N=cfg.tile_n,
                SEQ_PER_PROGRAM=kind == "decode",
                CAUSAL=True,
                USE_WINDOW=kind == "prefill",
                USE_SINKS=not split,
                USE_SOFTCAP=kind == "prefill",
                USE_ALIBI=False,
                FOLD_LOG2=kind != "prefill",
                KV_SCALE=2 if fp8 else 0,
                SPLIT=split,
                WRITE_LSE=True,
                DOT_IEEE=q_dtype == torch.float32,
            )
            # Unit strides are specialized to constants at launch (Triton does so for ints == 1);
            # the AOT build does the same so it compiles the vectorized code that runs.
            consts.update(stride_qd=1, stride_kc=1, stride_btb=1, stride_od=1)
            full_sig = {**sig, **dict.fromkeys(consts, "constexpr")}
            specs.append(
                AotSpec(
                    f"attn_{kind}{'_split' if split else ''}",
                    _paged_attention_kernel,
                    full_sig,
                    consts,
                    cfg.num_warps,
                    cfg.num_stages,
                    aligned,
                )
            )
    dv_pad = _pow2(head_size_v)
    merge_sig = {
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "out_ptr": f"*{qt}",
        "stride_ot": i32,
        "stride_oh": i32,
        "stride_od": i32,
        "lse_ptr": "*fp32",
        "stride_lt": i32,
        "stride_lh": i32,
        "sinks_ptr": "*fp32",
        "qsl_ptr": "*i32",
        "num_seqs": i32,
        "num_q_heads": i32,
        "num_splits": i32,
    }
    merge_consts = dict(
        HEAD_SIZE_V=head_size_v, DV_PAD=dv_pad, S_PAD=16, USE_SINKS=True, WRITE_LSE=True
    )
    specs.append(
        AotSpec(
            "merge_splits",
            _merge_splits_kernel,
            {**merge_sig, **dict.fromkeys(merge_consts, "constexpr")},
            merge_consts,
            4,
            1,
            tuple(n for n, t in merge_sig.items() if t.startswith("*")),
        )
    )
    two_sig = {
        "a_ptr": f"*{qt}",
        "stride_at": i32,
        "stride_ah": i32,
        "stride_ad": i32,
        "lse_a_ptr": "*fp32",
        "stride_lat": i32,
        "stride_lah": i32,
        "b_ptr": f"*{qt}",
        "stride_bt": i32,
        "stride_bh": i32,
        "stride_bd": i32,
        "lse_b_ptr": "*fp32",
        "stride_lbt": i32,
        "stride_lbh": i32,
        "o_ptr": f"*{qt}",
        "stride_ot": i32,
        "stride_oh": i32,
        "stride_od": i32,
        "lse_o_ptr": "*fp32",
        "num_q_heads": i32,
    }
    two_consts = dict(HEAD_SIZE_V=head_size_v, DV_PAD=dv_pad)
    specs.append(
        AotSpec(
            "merge_two",
            _merge_two_kernel,
            {**two_sig, **dict.fromkeys(two_consts, "constexpr")},
            two_consts,
            1,
            1,
            tuple(n for n, t in two_sig.items() if t.startswith("*")),
        )
    )
    return specs
