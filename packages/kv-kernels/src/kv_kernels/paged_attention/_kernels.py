"""The ``@triton.jit`` bodies of paged attention; KV tile addressing and loads live in
:mod:`._tile_loads`, launchers in :mod:`.triton`, tile shapes in :mod:`._tiles`, ahead-of-time
specs in :mod:`._aot`.

Work split. A program owns one tile of a sequence's query tokens and one kv head, and computes all
``G = Hq / H`` query heads of that kv head together: its ``BLOCK_M`` rows are ``BLOCK_Q`` tokens x
``G`` heads (row ``m`` is token ``m // G``, head ``m % G``), so a decode step of a GQA model still
feeds the tensor cores a 16-row tile and every K/V byte is read once per kv head, not once per
q head. The program walks the sequence's KV in ``TILE_N``-token tiles read through the block
table (64-bit offsets: ``block_id * stride_B`` easily passes 2^31 elements on a large cache), with
an online softmax in base 2. Tiles entirely outside the causal / sliding-window range are never
visited; tiles entirely inside it run without the mask arithmetic.

Bounds. Whatever the metadata says, no load leaves the cache or the block table (how:
:mod:`._tile_loads`, which reads the KV tiles); the program adds the number of redirected reads (and of sequences with
``q_len > seq_len``) to the int32 ``err_ptr[0]`` when ``CHECK`` is on, so a caller can test one
flag instead of syncing every step.

Prefill tiles by TMA (``TMA``, sm_90): where a KV tile lies inside one page of 16-bit values
(pages of 64+ tokens) and the head fills its tile, the unmasked middle tiles are read as one
``[1, TILE_N, 1, D]`` box of the cache viewed ``[B, N, H, C]`` per operand, which the copy
engine writes into shared memory asynchronously; boundary tiles keep the masked pointer gathers
(rows past a sequence may hold anything, and must read as zeros). Prefill programs start with the
heaviest q tiles (the grid runs in reverse), so the light ones fill the last wave.

Head shapes. A head that is a power of two plus a power-of-two tail >= 16 (DiffKV 192 = 128 + 64,
MLA 576 = 512 + 64) is read as two column tiles, ``D_PAD`` and ``D_TAIL``, and q.k is the sum of
two dots: no padding to the next power of two. ``V_FROM_K`` (MLA, absorbed): V is the first
``HEAD_SIZE_V = D_PAD`` columns of the latent tile just read for K, so each page is read once. A
GQA group too large for one accumulator (MLA's 128 heads x 512) is cut into ``HEAD_CHUNKS``
programs of ``HEADS_PER_PROG`` heads each (grid axis 1 is kv head x chunk).

Quantized pages. fp8 per tensor (``KV_SCALE`` 1, 2): the scale is folded into the q.k scale and
the output. Per token and head (``KV_SCALE`` 3, int8 / fp8 with float32 scales inline after each
row's data, ``reshape_and_cache``'s layout): the tile is upcast exactly and the scales multiply the
logit columns (K) and the probability columns before P.V (V), so no dequantized copy of the tile
is made; the scales are read as float32 words when the cache's strides allow, else byte by byte.
``KV_UPCAST`` (decode over 1-byte pages with 16-bit queries, :mod:`._upcast`): the tiles are
upcast in their load layout by packed PTX, q.K runs as an fp16 MMA with every query row scaled
by its own power of two (undone on the logits), and with per-tensor scales P.V too, its P
carried as ``p * 2^15`` (l carries the factor; the LSE takes it out); per-token-head pages keep
P.V in the query dtype (``p * s_v`` may leave fp16's range). ``K_DIRECT`` / ``V_DIRECT`` (with
``KV_UPCAST``): K / V skip the fp16 copy in shared memory, read as bytes in the MMA operand's
layout and upcast in registers (V with its columns renamed, put back after the KV loop; why and
how in :mod:`._upcast`).

Split KV (flash-decoding). With ``num_splits = S > 1`` the third grid axis cuts each program's KV
tile range into ``S`` contiguous chunks; each writes a normalized partial output and its LSE, and
:func:`._merge.merge_splits_kernel` merges them by log-sum-exp in a fixed order. The chunk bounds depend
only on the sequence and ``S``, so a fixed ``num_splits`` gives bit-identical results regardless of
the batch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kv_kernels.paged_attention._tile_loads import (
    gather_tile,
    inline_scale,
    page_offsets,
    tile_page,
)
from kv_kernels.paged_attention._upcast import f16_rows, restore_columns, upcast_tile, v_operand

__all__ = ["paged_attention_kernel"]


@triton.jit
def _tanh(x):
    # tanh through exp: portable across Triton versions and the interpreter; saturates to +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _find_seq(qsl_ptr, seq_lo, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest ``s >= seq_lo`` with ``qsl[s] // BLOCK_Q + s <= pid``: the sequence whose q tiles
    hold ``pid``.

    ``qsl[s] // BLOCK_Q + s`` bounds the number of tiles of sequences ``< s`` from above (each
    sequence gets ``ceil(q_len / BLOCK_Q)`` tiles, at most one more than its share of the floor),
    so the grid ``T // BLOCK_Q + num_seqs`` covers every tile without a host sync; a launch that
    leaves out the sequences below ``seq_lo`` starts ``pid`` at ``qsl[seq_lo] // BLOCK_Q + seq_lo``
    (:func:`._launch_args.prefill_grid_q`).
    """
    lo = tl.full([], 0, tl.int32) + seq_lo
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
    acc,  # [M, DV_PAD] f32 (columns renamed by v_operand with V_DIRECT)
    l_i,  # [M] f32
    m_i,  # [M] f32 (log2 units)
    q,  # [M, D_PAD]
    q2,  # [M, D_TAIL] the tail columns of q (unused, any tensor, when D_TAIL == 0)
    t_begin,
    t_end,  # KV tile range [t_begin, t_end)
    bt_row_ptr,
    stride_btb,
    max_blocks,
    num_blocks,
    kv_head_ptr,
    kvs_head_ptr,  # the same head's memory as float32 words or bytes (inline scales)
    k_desc,
    v_desc,  # TMA descriptors of K / V over [B, N, H, C] (unused unless TMA)
    kvh,
    stride_kb,
    stride_kn,
    stride_kc,
    ks_idx,
    vs_idx,  # where K's / V's inline scale starts (see inline_scale)
    stride_ssn,  # SCALE_PLANE: the plane's token stride (bytes)
    seq_len,
    q_pos,  # [M]
    slopes,  # [M]
    qk_scale,
    softcap,
    window,
    err_ptr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    D_PAD: tl.constexpr,
    D_TAIL: tl.constexpr,
    DV_PAD: tl.constexpr,
    V_FROM_K: tl.constexpr,
    K_START: tl.constexpr,
    V_START: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    FOLD_LOG2: tl.constexpr,
    INLINE_SCALES: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    SCALE_PLANE: tl.constexpr,  # the scales in each page's plane (kv-spec), not in the rows
    DOT_IEEE: tl.constexpr,
    CHECK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    TMA: tl.constexpr,
    KV_UPCAST: tl.constexpr,
    PTX: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    K_DIRECT: tl.constexpr,
    V_DIRECT: tl.constexpr,
):
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_ok = offs_d < HEAD_SIZE
    dv_ok = offs_dv < HEAD_SIZE_V
    # Column offsets from each operand's first column: compile-time ranges (times the unit
    # stride Triton specializes), so the loop holds no offset vectors (the prefill kernel's
    # 128 x 128 accumulator leaves no registers for them: runtime column vectors spilled
    # inside the loop). K's and V's first columns are compile-time too, so V's addresses are
    # K's plus an immediate offset instead of a second set of 64-bit registers (sm_90 prefill
    # loop at page 16: 778 -> 744 instructions a tile).
    k_head_ptr = kv_head_ptr + K_START * stride_kc
    v_head_ptr = kv_head_ptr + V_START * stride_kc
    k_cols = offs_d * stride_kc  # [D_PAD]
    v_cols = offs_dv * stride_kc  # [DV_PAD]
    # Split head (D_TAIL > 0): K is read as a D_PAD-wide main tile and a D_TAIL-wide tail tile and
    # q.k is the sum of two dots, so a 192 head costs 128 + 64 columns of work, not 256.
    k2_cols = (D_PAD + tl.arange(0, D_TAIL if D_TAIL > 0 else 16)) * stride_kc
    for t in range(t_begin, t_end):
        kpos = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        if TMA and not MASKED:
            # A full tile inside one page (BLOCK_SIZE % TILE_N == 0, 16-bit pages, no tail):
            # one TMA box per operand, copied into shared memory asynchronously (pipelined by
            # the compiler), where the MMA reads it. Boundary tiles keep the masked gathers:
            # the rows past the sequence may hold anything (nan), which must read as zeros.
            blk, _ = tile_page(
                t, bt_row_ptr, stride_btb, max_blocks, num_blocks, err_ptr, BLOCK_SIZE, TILE_N,
                CHECK,
            )  # fmt: skip
            n0 = (t * TILE_N) % BLOCK_SIZE
            k = k_desc.load([blk, n0, kvh, 0]).reshape(TILE_N, D_PAD)
            v = v_desc.load([blk, n0, kvh, 0]).reshape(TILE_N, DV_PAD)
            k2 = k  # (no tail with TMA)
            tok_off = kpos.to(tl.int64)  # (no inline scales with TMA)
            in_seq = kpos < seq_len
        else:
            tok_off, tok_ok = page_offsets(
                t, seq_len, bt_row_ptr, stride_btb, max_blocks, num_blocks, stride_kb, stride_kn,
                err_ptr, BLOCK_SIZE, TILE_N, MASKED, CHECK, ROW_ALIGN,
            )  # fmt: skip
            in_seq = tok_ok & (kpos < seq_len)
            k, k2, v = gather_tile(
                k_head_ptr, v_head_ptr, tok_off, k_cols, k2_cols, v_cols, in_seq, d_ok, dv_ok,
                HEAD_SIZE, HEAD_SIZE_V, D_PAD, D_TAIL, DV_PAD, V_FROM_K, MASKED,
            )  # fmt: skip
        # fp8 / int8 pages are upcast to 16 bits right after the load (exact: int8 and fp8
        # values are representable in 16 bits); a per-tensor scale is folded into qk_scale /
        # the output, a per-token-head scale into the logits and the probabilities below.
        # KV_UPCAST (1-byte pages, 16-bit queries): K to fp16 for an fp16 q.K (q is fp16 rows,
        # see f16_rows) and V to PV_DTYPE, in the load's layout (see _upcast), so the MMA
        # operands come from 16-bit tiles, or (K_DIRECT / V_DIRECT) in the MMA operand's layout,
        # read as bytes; otherwise both to the query dtype.
        if V_FROM_K:
            # MLA: V is the first HEAD_SIZE_V (= D_PAD) columns of the latent, the tile just read
            v = k
        k = upcast_tile(k, q.dtype, PTX and KV_UPCAST, K_DIRECT)
        if KV_UPCAST:
            if V_FROM_K and q.dtype == PV_DTYPE:
                v = k
            elif V_DIRECT:
                v = upcast_tile(v_operand(v, TILE_N, DV_PAD), PV_DTYPE, PTX, True)
            else:
                v = upcast_tile(v, PV_DTYPE, PTX)
        elif V_FROM_K:
            v = k
        else:
            v = v.to(q.dtype)
        if D_TAIL > 0:
            k2 = upcast_tile(k2, q.dtype, PTX and KV_UPCAST, K_DIRECT)
        if DOT_IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            if D_TAIL > 0:
                s = tl.dot(q2, tl.trans(k2), s, input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [M, TILE_N] f32
            if D_TAIL > 0:
                s = tl.dot(q2, tl.trans(k2), s)
        if KV_UPCAST:
            s = s * qk_scale[:, None]  # (per row: each q row has its own power-of-two scale)
        else:
            s = s * qk_scale
        if INLINE_SCALES:
            # Dequantize per token and head without touching the tile: q.(k * s_k) = (q.k) s_k,
            # and p.(v * s_v) = (p s_v).v, so the scales scale logit columns and P columns.
            s_off = tok_off
            if SCALE_PLANE:  # the tile's rows of the page's [H, N, scales] plane
                s_off, _ = page_offsets(
                    t, seq_len, bt_row_ptr, stride_btb, max_blocks, num_blocks, stride_kb,
                    stride_ssn, err_ptr, BLOCK_SIZE, TILE_N, MASKED, False, 4,
                )  # fmt: skip
            k_sc = inline_scale(kvs_head_ptr, s_off, ks_idx, stride_kc, in_seq, MASKED, SCALE_WORDS)
            v_sc = inline_scale(kvs_head_ptr, s_off, vs_idx, stride_kc, in_seq, MASKED, SCALE_WORDS)
            s = s * k_sc[None, :]
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
                if not CAUSAL:
                    vis = vis & (kpos[None, :] < q_pos[:, None] + window)  # |p - k| < w
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet keeps m = -inf; exp2 against 0 keeps it at zero
            # weight instead of nan (and makes fully-masked tiles exact no-ops: alpha = 1, p = 0).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        if KV_UPCAST and not INLINE_SCALES:
            # fp16 P: p * 2^15 (<= 32768) keeps probabilities down to 2^-39 of the row's maximum
            # out of fp16's subnormals; l carries the same factor, so acc / l is unchanged (the
            # LSE takes it out)
            p = tl.exp2(s - (m_use - 15.0)[:, None])
        else:
            p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if INLINE_SCALES:
            p = p * v_sc[None, :]
        if DOT_IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _tile_bounds(
    ctx,
    first_q,
    last_q,
    seq_len,
    window,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """KV tiles ``[t_lo, t_hi)`` seen by some row of a q tile and ``[tf_lo, tf_hi)`` seen by
    every row (no mask needed there)."""
    if CAUSAL:
        hi = tl.minimum(seq_len, ctx + last_q + 1)
        hi_full = tl.minimum(seq_len, ctx + first_q + 1)
    elif USE_WINDOW:
        hi = tl.minimum(seq_len, ctx + last_q + window)
        hi_full = tl.minimum(seq_len, ctx + first_q + window)
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
    return t_lo, t_hi, tf_lo, tf_hi


@triton.jit
def _add_sink(o, lse, sinks_ptr, head):
    """Fold the per-head sink logit into the denominator: rescale ``o`` and grow ``lse``."""
    sink = tl.load(sinks_ptr + head)
    m = tl.maximum(lse, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    lse_tot = m + tl.log(tl.exp(lse - m) + tl.exp(sink - m))
    return o * tl.exp(lse - lse_tot)[:, None], lse_tot


# (num_blocks is a bound, never a constexpr: Triton specializes an int equal to 1 into one,
# and the kernel casts it; a one-block cache -- a small workspace -- failed to compile)
@triton.jit(do_not_specialize=["num_blocks", "seq_lo"])
def paged_attention_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,  # [T, Hq, D]
    kv_ptr, stride_kb, stride_kh, stride_kn, stride_kc,  # [B, H, N, C] layer view
    kvs_ptr,  # the cache as float32 words (SCALE_WORDS) or bytes: inline scales (KV_SCALE == 3)
    k_desc, v_desc,  # TMA descriptors of K / V over [B, N, H, C], boxes [1, TILE_N, 1, D] (TMA)
    bt_ptr, stride_bts, stride_btb,  # [num_seqs, max_blocks]
    seq_lens_ptr, qsl_ptr,  # [num_seqs], [num_seqs + 1]
    sinks_ptr, alibi_ptr,  # [Hq] f32 each (dummies when unused)
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, k_scale_val, v_scale_val,
    out_ptr, stride_ot, stride_oh, stride_od,  # [T, Hq, Dv]
    lse_ptr, stride_lt, stride_lh,  # [T, Hq] f32
    part_out_ptr, part_lse_ptr,  # [T, Hq, S, DV_PAD] / [T, Hq, S] f32, contiguous
    err_ptr,  # [1] int32 error counter (CHECK)
    num_seqs, num_q_heads, num_blocks, max_blocks,
    ks_idx, vs_idx, stride_ssh, stride_ssn,  # inline scales: start; rows' head / token strides
    scale, softcap, window,
    q_len_min, q_len_max,  # this launch's query-length class
    seq_lo,  # tiled launches: the first sequence they hold (_find_seq); the decode class: the
    # api's num_decodes, which CHECK holds to one query token each
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    D_TAIL: tl.constexpr, V_FROM_K: tl.constexpr, K_START: tl.constexpr, V_START: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    SEQ_PER_PROGRAM: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr, FOLD_LOG2: tl.constexpr,
    KV_SCALE: tl.constexpr, SCALE_WORDS: tl.constexpr, SCALE_PLANE: tl.constexpr,
    SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_IEEE: tl.constexpr, CHECK: tl.constexpr, ROW_ALIGN: tl.constexpr, TMA: tl.constexpr,
    KV_UPCAST: tl.constexpr, PTX: tl.constexpr, K_DIRECT: tl.constexpr, V_DIRECT: tl.constexpr,
):  # fmt: skip
    pid_q = tl.program_id(0)
    pid_h = tl.program_id(1)
    if not SEQ_PER_PROGRAM:
        # Heaviest tiles first: the last q tiles of a causal sequence see the most KV, and the
        # GPU starts programs in grid order (axis 0 fastest), so the programs are renumbered
        # heads-fastest and from the last tile: every head's heavy tiles of a sequence start
        # together, ahead of its light ones. Axis 0 fastest with the tiles on it ran one head's
        # whole batch after another, so the last head's heaviest tiles of the first sequence
        # started in the last wave and the GPU idled behind them (H100, 4 x 4096 causal, page
        # 16: 368 -> 387-400 TFLOP/s, graph-timed, beside a scratch kernel that read 422 / 418
        # in both runs). The order does not change any result.
        n_h = tl.num_programs(1)
        n_q = tl.num_programs(0).to(tl.int64)
        lin = n_q * n_h - 1 - (pid_q + n_q * pid_h)  # (64-bit: the grid's product)
        pid_q = (lin // n_h).to(tl.int32)
        pid_h = (lin % n_h).to(tl.int32)
    # axis 1: kv head x chunk of its query heads (HEAD_CHUNKS > 1 only when GROUP > BLOCK_M,
    # e.g. MLA's 128 heads over one latent: the accumulator of all of them would not fit)
    kvh = pid_h // HEAD_CHUNKS
    chunk = pid_h % HEAD_CHUNKS
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if SEQ_PER_PROGRAM:
        seq = pid_q
        q_tile = 0
    else:
        pid_q += tl.load(qsl_ptr + seq_lo).to(tl.int32) // BLOCK_Q + seq_lo
        seq = _find_seq(qsl_ptr, seq_lo, num_seqs, pid_q, BLOCK_Q)
        q_tile = pid_q - (tl.load(qsl_ptr + seq).to(tl.int32) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    if CHECK and SEQ_PER_PROGRAM:
        # a sequence promised as a leading decode (below num_decodes) that is not one: the
        # prefill launch leaves it out of its grid, so its rows would go unwritten. Counted
        # once per sequence, before the class test returns.
        bad = (seq < seq_lo) & (q_len != 1) & (pid_h == 0) & (split == 0)
        tl.atomic_add(err_ptr, 1, mask=bad)
    if (q_len < q_len_min) | (q_len > q_len_max) | (q_tile * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - q_len  # absolute position of this sequence's first query token
    if CHECK and (CAUSAL or USE_WINDOW or USE_ALIBI):
        # q_len > seq_len has no positions for its first rows where a mask or a bias reads
        # positions: counted once per sequence (a position-free call -- non-causal, no window,
        # no ALiBi: a cascade's shared-prefix pass -- is valid with more queries than keys).
        first = (q_tile == 0) & (pid_h == 0) & (split == 0)
        tl.atomic_add(err_ptr, 1, mask=first & (ctx < 0))

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    r_tok = offs_m // HEADS_PER_PROG
    head_in_group = chunk * HEADS_PER_PROG + offs_m % HEADS_PER_PROG
    head = kvh * GROUP + head_in_group  # [M] q head of each row
    q_local = q_tile * BLOCK_Q + r_tok
    row_ok = (r_tok < BLOCK_Q) & (q_local < q_len) & (head_in_group < GROUP)
    q_pos = ctx + q_local  # [M]
    tok = (q_start + q_local).to(tl.int64)  # [M] row of q / out
    q_ptrs = (
        q_ptr
        + tok[:, None] * stride_qt
        + head[:, None].to(tl.int64) * stride_qh
        + offs_d[None, :] * stride_qd
    )
    # (row masks only where the head fills its tile: no per-column predicate to build)
    if D_PAD + D_TAIL == HEAD_SIZE:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_SIZE), other=0.0)
    if D_TAIL > 0:
        offs_t = D_PAD + tl.arange(0, D_TAIL)
        q2_ptrs = (
            q_ptr
            + tok[:, None] * stride_qt
            + head[:, None].to(tl.int64) * stride_qh
            + offs_t[None, :] * stride_qd
        )
        q2 = tl.load(q2_ptrs, mask=row_ok[:, None], other=0.0)  # [M, D_TAIL]
    else:
        q2 = q
    if KV_UPCAST:
        # fp16 q.K over 1-byte pages: each row scaled by a power of two (q_unscale undoes it)
        q, q2, q_unscale = f16_rows(q, q2, D_TAIL)
        if KV_SCALE == 3:
            pv_dtype = q_ptr.dtype.element_ty  # p * s_v may leave fp16's range
        else:
            pv_dtype = tl.float16
    else:
        q_unscale = 1.0
        pv_dtype = q_ptr.dtype.element_ty

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
    if KV_UPCAST:
        qk_scale = qk_scale * q_unscale  # [M]
    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + head)
    else:
        slopes = tl.zeros([BLOCK_M], dtype=tl.float32)

    first_q = q_tile * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    t_lo, t_hi, tf_lo, tf_hi = _tile_bounds(
        ctx, first_q, last_q, seq_len, window, CAUSAL, USE_WINDOW, TILE_N
    )
    # This program's share of the tiles: chunk `split` of `num_splits` contiguous chunks.
    per_split = tl.cdiv(t_hi - t_lo, num_splits)
    s_lo = tl.minimum(t_lo + split * per_split, t_hi)
    s_hi = tl.minimum(s_lo + per_split, t_hi)

    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    head_off = kvh.to(tl.int64) * stride_kh
    if ROW_ALIGN > 1:
        head_off = tl.multiple_of(head_off, ROW_ALIGN)
    kv_head_ptr = kv_ptr + head_off
    # (stride_ssh is stride_kh for scales in the rows, the plane's head stride otherwise)
    if SCALE_WORDS:
        kvs_head_ptr = kvs_ptr + kvh.to(tl.int64) * (stride_ssh // 4)
    else:
        kvs_head_ptr = kvs_ptr + kvh.to(tl.int64) * stride_ssh
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bts
    # Three phases: the window's lower edge (masked), the fully visible middle (no mask), the
    # causal diagonal / tail (masked).
    for phase in tl.static_range(3):
        if phase == 0:
            p_lo = tl.maximum(t_lo, s_lo)
            p_hi = tl.minimum(tf_lo, s_hi)
        elif phase == 1:
            p_lo = tl.maximum(tf_lo, s_lo)
            p_hi = tl.minimum(tf_hi, s_hi)
        else:
            p_lo = tl.maximum(tf_hi, s_lo)
            p_hi = tl.minimum(t_hi, s_hi)
        # (without a window the lower edge is empty: not compiling its loop saves registers)
        if phase != 0 or USE_WINDOW:
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q, q2, p_lo, p_hi,
                bt_row_ptr, stride_btb, max_blocks, num_blocks,
                kv_head_ptr, kvs_head_ptr, k_desc, v_desc, kvh, stride_kb, stride_kn, stride_kc,
                ks_idx, vs_idx, stride_ssn, seq_len, q_pos, slopes, qk_scale, softcap, window,
                err_ptr,
                HEAD_SIZE, HEAD_SIZE_V, D_PAD, D_TAIL, DV_PAD, V_FROM_K, K_START, V_START,
                BLOCK_SIZE, TILE_N,
                phase != 1, CAUSAL, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, FOLD_LOG2,
                KV_SCALE == 3, SCALE_WORDS, SCALE_PLANE, DOT_IEEE, CHECK, ROW_ALIGN, TMA,
                KV_UPCAST, PTX, pv_dtype, K_DIRECT, V_DIRECT,
            )  # fmt: skip
    if V_DIRECT:
        acc = restore_columns(acc, BLOCK_M, DV_PAD)  # (the loops accumulate renamed columns)

    if KV_UPCAST and KV_SCALE != 3:
        m_i = m_i - 15.0  # l carries 2^15 (fp16 P, see _attend_tiles)
    has = l_i > 0.0
    l_div = tl.where(has, l_i, 1.0)
    o = acc / l_div[:, None]  # rows that saw nothing have acc = 0
    lse = tl.where(has, (m_i + tl.log2(l_div)) * 0.6931471805599453, float("-inf"))  # natural log
    if KV_SCALE == 1 or KV_SCALE == 2:
        o = o * v_deq
    if SPLIT:
        part = (tok * num_q_heads + head) * num_splits + split  # [M] int64
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * DV_PAD + offs_dv[None, :], o, mask=row_ok[:, None])
    else:
        # Rows from scalars and thread-index ranges, not the per-row token / head / mask tensors
        # of the q load: shared with these stores, those stayed live across the KV loops, and
        # the prefill kernel spilled inside its loop for them (sm_90 build: 400 -> 160 bytes).
        tok0 = q_start + q_tile * BLOCK_Q  # the tile's first token and q head
        head0 = kvh * GROUP + chunk * HEADS_PER_PROG
        h_in = offs_m % HEADS_PER_PROG
        rows = (r_tok < tl.minimum(q_len - q_tile * BLOCK_Q, BLOCK_Q)) & (
            h_in < GROUP - chunk * HEADS_PER_PROG
        )
        if USE_SINKS:
            o, lse = _add_sink(o, lse, sinks_ptr, head0 + h_in)
        o_ptrs = (
            out_ptr
            + (tok0.to(tl.int64) * stride_ot + head0.to(tl.int64) * stride_oh)
            + (r_tok.to(tl.int64) * stride_ot + h_in.to(tl.int64) * stride_oh)[:, None]
            + offs_dv[None, :] * stride_od
        )
        if DV_PAD == HEAD_SIZE_V:
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=rows[:, None])
        else:
            o_mask = rows[:, None] & (offs_dv[None, :] < HEAD_SIZE_V)
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        if WRITE_LSE:
            lse_ptrs = (
                lse_ptr
                + (tok0.to(tl.int64) * stride_lt + head0.to(tl.int64) * stride_lh)
                + r_tok.to(tl.int64) * stride_lt
                + h_in.to(tl.int64) * stride_lh
            )
            tl.store(lse_ptrs, lse, mask=rows)
