"""The ``@triton.jit`` bodies of the attention-state merges: the split-KV merge of
:func:`._kernels.paged_attention_kernel`'s partials, and the two-state merge of
``merge_attn_states`` (cascade / shared prefix)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_splits_kernel", "merge_two_kernel"]


@triton.jit
def _token_seq(qsl_ptr, num_seqs, tok):
    """Largest ``s < num_seqs`` with ``qsl[s] <= tok``: the sequence of query row ``tok`` (for
    ``tok < qsl[num_seqs]``; an empty sequence before it shares its start and loses the tie).
    (:func:`._kernels._find_seq` searches q tiles, ``qsl[s] // BLOCK_Q + s``, not rows.)"""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(qsl_ptr + mid).to(tl.int64) <= tok
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


# Counts are not specialized: a count of 1 or a multiple of 16 would otherwise build its own
# variant (a decode batch of 1, 16 splits), which a warmup cannot foresee; they only bound loops.
# DECODE_ONLY (a mixed batch whose decode class split KV and whose prefill class did not): only
# rows of sequences with q_len <= q_len_max are merged; longer sequences' rows were written to
# ``out`` by their own unsplit launch and have no partials, so their programs return.
@triton.jit(do_not_specialize=["num_seqs", "num_q_heads", "num_splits", "q_len_max"])
def merge_splits_kernel(
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
    q_len_max,  # DECODE_ONLY: the longest query of the split (decode) class
    HEAD_SIZE_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_seqs):
        return  # CUDA-graph padding rows: nothing wrote their partials
    if DECODE_ONLY:
        seq = _token_seq(qsl_ptr, num_seqs, tok)
        q_len = tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)
        if q_len > q_len_max:
            return  # a prefill-class row: its unsplit launch wrote out (and lse)
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
def merge_two_kernel(
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
