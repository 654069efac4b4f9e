"""The Gluon kernel of the sm_90 paged prefill (its launcher, scope and ahead-of-time spec:
:mod:`._sm90_prefill`): warp-specialized, warpgroup MMAs issued asynchronously, so softmax and
tensor-core work overlap, the schedule FlashAttention-3 writes:

- a producer warpgroup gathers K and V pages token by token (``cp.async``, 16 bytes a thread,
  whatever the page size) into rings of ``NBUF`` slots, and signals each slot's mbarrier when
  its copies land (``full``); it waits on the slot's ``empty`` barrier before reusing it. Where
  pages hold whole tiles (page sizes a multiple of ``TILE_N``), the tiles wholly inside the
  sequence come by TMA instead, a box each for K (its tail) and V (H100, same process, page
  128: head 128 505 against 475 TFLOP/s gathered, DiffKV 540 against 494, the mixed step 527
  against 492); the last, partial tile is still gathered, its rows past the sequence
  zero-filled;
- two consumer warpgroups of 64 query rows each (the q tile: ``128 / group`` tokens of one KV
  head's ``group`` query heads) run, per KV tile ``i``: issue ``S = Q K_i^T`` and
  ``O += P_(i-1) V_(i-1)`` together, wait for ``S`` only, do tile ``i``'s softmax while ``P.V``
  runs, then wait for it and release both slots. No CTA barrier: each consumer runs on its own
  schedule, so one's softmax overlaps the other's MMAs;
- the softmax scale sits inside ``exp2``'s FMA (``2^(s c - m c)``, raw-logit maxima), and the
  tiles every row sees in full run a loop without masks.

DiffKV's 192-wide K: its last 64 columns in a tile of their own, a second MMA into the same
logits (no padding to 256).

Bounds: block-table columns past ``max_blocks`` read the last column, block ids are clamped into
``[0, num_blocks)`` (unsigned, as in :mod:`._tile_loads`), and tokens past the sequence are not
read (``cp.async`` zero-fills them; TMA boxes hold only tokens inside it, and the descriptor's
shape is the cache's), so no read leaves the cache whatever the metadata says.

Version notes: triton 3.9 renamed ``async_copy_global_to_shared`` to ``async_load`` (both for
``cp.async`` and TMA: :mod:`._gluon_compat`). Triton 3.6's alignment analysis asserts on the
gathers when they are unrolled at the top level with constant tile indices (the producer's
runtime loop avoids that) and when the program returns early (the kernel has no early return: a
program with nothing to do runs zero tiles and stores nothing).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kv_kernels.paged_attention._gluon_compat import async_load, tma_load

__all__ = ["sm90_prefill_kernel"]


@gluon.constexpr_function
def _rows_layout(width, main, warps):
    """A tile ``[rows, width]`` of 16-bit values laid out as a ``main``-wide tile's 16-byte
    vectors are (8 values a thread, ``main / 8`` threads a row, so a warp's copy covers whole
    rows): any ``width`` gives the same rows to the same threads, so the row offsets computed
    for one serve all (a 64-wide tail of a 128-wide head moves 8 bytes a thread).

    (Four threads a row, ``width / 4`` values each, halved the producer's address work but
    split each warp's copy into 16-byte pieces 64 bytes apart: an H100 probe read 376 TFLOP/s at
    page 16 where this layout reads 449 in a bench run; docs/benchmarks/kernels.md.)"""
    per_row = main // 8
    return gl.BlockedLayout([1, width // per_row], [32 // per_row, per_row], [warps, 1], [1, 0])


@gluon.jit
def _block_of(bt_row_ptr, col, num_blocks, max_blocks):
    """The cache block (uint32) in block-table column ``col`` (a scalar or a tensor), inside the
    cache whatever the table says: columns past ``max_blocks`` read the last one, ids are clamped
    into ``[0, num_blocks)`` as unsigned (so ``-1`` lands on the last block)."""
    blk = gl.load(bt_row_ptr + gl.minimum(col, max_blocks - 1)).to(gl.uint32, bitcast=True)
    return gl.minimum(blk, (num_blocks - 1).to(gl.uint32))


@gluon.jit
def _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb, stride_kn,
               BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, LAYOUT: gl.constexpr):  # fmt: skip
    """Element offsets ``[TILE_N]`` (int64) of KV tile ``t``'s token rows through the block table,
    and which rows are in the sequence."""
    rows = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LAYOUT))
    kpos = t * TILE_N + rows
    blk = _block_of(bt_row_ptr, kpos // BLOCK_SIZE, num_blocks, max_blocks)
    off = blk.to(gl.int64) * stride_kb + (kpos % BLOCK_SIZE).to(gl.int64) * stride_kn
    return off, kpos < seq_len


@gluon.jit
def _gather(smem, ptr, off, ok, WIDTH: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async of the rows ``off`` (columns ``[0, WIDTH)`` from ``ptr``) into ``smem``; rows not
    ``ok`` are zero-filled, not read."""
    off = gl.convert_layout(off, gl.SliceLayout(1, LAYOUT))  # (the same rows: no data moves)
    ok = gl.convert_layout(ok, gl.SliceLayout(1, LAYOUT))
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LAYOUT))
    async_load(smem, ptr + off[:, None] + cols[None, :], mask=ok[:, None] & (cols < WIDTH)[None, :])


@gluon.jit
def _tma_tile(desc, desc2, smem, smem2, full, blk, kvh, n0, COL: gl.constexpr,
              D_TAIL: gl.constexpr, P_WARPS: gl.constexpr):  # fmt: skip
    """One whole KV tile inside one page by TMA (a box ``[1, 1, TILE_N, width]`` of the cache
    ``[B, H, N, C]`` at block ``blk``, head ``kvh``, token ``n0``, column ``COL``; a split head's
    tail in ``smem2`` from ``desc2``): one thread issues the copies and expects their bytes, and
    arrives for the other producer threads, whose ``cp.async`` arrivals the barrier counts on
    gathered tiles."""
    tile_n: gl.constexpr = smem.shape[0]
    width: gl.constexpr = smem.shape[1]
    nbytes: gl.constexpr = smem.dtype.primitive_bitwidth // 8
    if D_TAIL > 0:
        mbarrier.expect(full, tile_n * (width + D_TAIL) * nbytes)
    else:
        mbarrier.expect(full, tile_n * width * nbytes)
    tma_load(desc, [blk, kvh, n0, COL], full, smem.reshape([1, 1, tile_n, width]))
    if D_TAIL > 0:
        tma_load(desc2, [blk, kvh, n0, COL + width], full, smem2.reshape([1, 1, tile_n, D_TAIL]))
    mbarrier.arrive(full, count=32 * P_WARPS - 1)


@gluon.jit
def _producer(k_smem, k2_smem, v_smem, k_full, v_full, k_empty, v_empty, k_head_ptr,
              v_head_ptr, bt_row_ptr, n_tiles, seq_len, num_blocks, max_blocks, stride_kb,
              stride_kn, kv_desc, tail_desc, kvh, BLOCK_SIZE: gl.constexpr,
              TILE_N: gl.constexpr, D_MAIN: gl.constexpr, D_TAIL: gl.constexpr,
              HEAD_V: gl.constexpr, NBUF: gl.constexpr, P_WARPS: gl.constexpr,
              K_START: gl.constexpr, V_START: gl.constexpr, USE_TMA: gl.constexpr):  # fmt: skip
    main_l: gl.constexpr = _rows_layout(D_MAIN, D_MAIN, P_WARPS)
    v_l: gl.constexpr = _rows_layout(HEAD_V, D_MAIN, P_WARPS)
    t_whole = seq_len // TILE_N  # tiles wholly inside the sequence
    if USE_TMA:
        # pages of whole tiles: the tiles wholly inside the sequence by TMA, one box each for K
        # (and its tail) and V; the last, partial tile is gathered (its rows past the sequence
        # zero-filled: a page's stale rows there could hold nan, and 0 * nan is nan in P.V)
        gl.static_assert(HEAD_V == D_MAIN, "V's tiles come through K's descriptor")
        for i in range(gl.minimum(t_whole, n_tiles)):
            s = i % NBUF
            ph = ((i // NBUF) & 1) ^ 1  # the previous use of the slot
            col = (i * TILE_N) // BLOCK_SIZE
            blk = _block_of(bt_row_ptr, col, num_blocks, max_blocks).to(gl.int32)
            n0 = (i * TILE_N) % BLOCK_SIZE
            mbarrier.wait(k_empty.index(s), ph, pred=i >= NBUF)
            _tma_tile(kv_desc, tail_desc, k_smem.index(s), k2_smem.index(s), k_full.index(s), blk,
                      kvh, n0, K_START, D_TAIL, P_WARPS)  # fmt: skip
            mbarrier.wait(v_empty.index(s), ph, pred=i >= NBUF)
            _tma_tile(kv_desc, kv_desc, v_smem.index(s), v_smem.index(s), v_full.index(s), blk,
                      kvh, n0, V_START, 0, P_WARPS)  # fmt: skip
        t_lo = gl.minimum(t_whole, n_tiles)
    else:
        t_lo = 0
    for i in range(t_lo, n_tiles):
        s = i % NBUF
        ph = ((i // NBUF) & 1) ^ 1  # the previous use of the slot
        # one walk through the block table serves K, K's tail and V (sm_90 build, head 128, page
        # 16: the producer's loop 516 -> 446 instructions a tile against a walk per copy)
        off, ok = _tile_rows(bt_row_ptr, i, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, TILE_N, main_l)  # fmt: skip
        mbarrier.wait(k_empty.index(s), ph, pred=i >= NBUF)
        _gather(k_smem.index(s), k_head_ptr, off, ok, D_MAIN, main_l)
        if D_TAIL > 0:
            # a split head (DiffKV 192 = 128 + 64): K's last columns in their own tile
            _gather(k2_smem.index(s), k_head_ptr + D_MAIN, off, ok, D_TAIL,
                    _rows_layout(D_TAIL, D_MAIN, P_WARPS))  # fmt: skip
        async_copy.mbarrier_arrive(k_full.index(s), increment_count=False)
        mbarrier.wait(v_empty.index(s), ph, pred=i >= NBUF)
        _gather(v_smem.index(s), v_head_ptr, off, ok, HEAD_V, v_l)
        async_copy.mbarrier_arrive(v_full.index(s), increment_count=False)


@gluon.jit
def _qk(q_wg, q2_wg, k_slot, k2_slot, s_zero, D_TAIL: gl.constexpr, ASYNC: gl.constexpr):
    """``S = q.K^T`` of one KV slot, with a split head's tail columns as a second MMA into the
    same accumulator (asynchronous: the token to wait on)."""
    s = warpgroup_mma(q_wg, k_slot.permute((1, 0)), s_zero, use_acc=False, is_async=ASYNC)
    if D_TAIL > 0:
        s = warpgroup_mma(q2_wg, k2_slot.permute((1, 0)), s, is_async=ASYNC)
    return s


@gluon.jit
def _softmax(s, m_i, l_i, i, seq_len, q_pos, kcols, qk_scale_log2,
             TILE_N: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
             P_LAYOUT: gl.constexpr, DTYPE: gl.constexpr):  # fmt: skip
    """Online softmax of raw logits ``s`` (tile ``i``): ``p = 2^(s c - m c)`` in one FMA an
    element (``c`` the scale in log2 units, > 0; ``m`` the running maximum of raw logits)."""
    if MASKED:
        kpos = i * TILE_N + kcols
        if CAUSAL:
            # (a stored row has q_pos < seq_len, so this also hides the tail past the sequence;
            # rows past the query, never stored, may see zero-filled keys)
            vis = kpos[None, :] <= q_pos[:, None]
        else:
            vis = (kpos < seq_len)[None, :]
        s = gl.where(vis, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    if MASKED:
        # a row that has seen nothing keeps m = -inf: exp2 against 0 keeps its weights at 0
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale_log2
    else:
        m_use = m_new * qk_scale_log2
    alpha = gl.exp2(m_i * qk_scale_log2 - m_use)
    p32 = gl.exp2(s * qk_scale_log2 - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p32, 1)
    return gl.convert_layout(p32.to(DTYPE), P_LAYOUT), m_new, l_i, alpha


@gluon.jit
def _step(q_wg, q2_wg, k_smem, k2_smem, v_smem, k_full, v_full, k_empty, v_empty, i, s_zero, p,
          m_i, l_i, acc, seq_len, q_pos, kcols, qk_scale_log2, TILE_N: gl.constexpr,
          NBUF: gl.constexpr, D_TAIL: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
          O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, DTYPE: gl.constexpr):  # fmt: skip
    """Tile ``i``'s q.K and tile ``i - 1``'s P.V issued together; the softmax of tile ``i`` runs
    while P.V does; each slot is released as soon as its MMA is done."""
    s = i % NBUF
    sp = (i - 1) % NBUF  # tile i - 1's slot
    mbarrier.wait(k_full.index(s), (i // NBUF) & 1)
    mbarrier.wait(v_full.index(sp), ((i - 1) // NBUF) & 1)
    s_tok = _qk(q_wg, q2_wg, k_smem.index(s), k2_smem.index(s), s_zero, D_TAIL, True)
    acc_tok = warpgroup_mma(p, v_smem.index(sp), acc, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(s), count=1)
    p_new, m_i, l_i, alpha = _softmax(sc, m_i, l_i, i, seq_len, q_pos, kcols, qk_scale_log2,
                                      TILE_N, CAUSAL, MASKED, P_LAYOUT, DTYPE)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    mbarrier.arrive(v_empty.index(sp), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    return p_new, m_i, l_i, acc


@gluon.jit
def _consumer(q_smem, q2_smem, k_smem, k2_smem, v_smem, k_full, v_full, k_empty, v_empty, wg,
              n_tiles, t_full, seq_len, ctx, q_tile, q_start, q_len, kvh, qk_scale_log2,
              out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
              HEAD_V: gl.constexpr, D_TAIL: gl.constexpr, GROUP: gl.constexpr,
              BLOCK_Q: gl.constexpr, TILE_N: gl.constexpr, NBUF: gl.constexpr,
              CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    WG_M: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_V, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_wg = q_smem.index(wg)
    q2_wg = q2_smem.index(wg)
    rows = wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
    q_pos = ctx + q_tile * BLOCK_Q + rows // GROUP
    kcols = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([WG_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([WG_M, HEAD_V], gl.float32, layout=o_layout)
    s_zero = gl.zeros([WG_M, TILE_N], gl.float32, layout=s_layout)
    p = gl.zeros([WG_M, TILE_N], dtype, layout=p_layout)
    # tile 0 alone (no P.V yet: an MMA of P = 0 over an unwritten V slot would still read it,
    # and 0 * nan is nan), then each tile's q.K beside the previous tile's P.V
    if n_tiles > 0:
        mbarrier.wait(k_full.index(0), 0)
        sc = _qk(q_wg, q2_wg, k_smem.index(0), k2_smem.index(0), s_zero, D_TAIL, False)
        mbarrier.arrive(k_empty.index(0), count=1)
        p, m_i, l_i, _alpha = _softmax(sc, m_i, l_i, 0, seq_len, q_pos, kcols, qk_scale_log2,
                                      TILE_N, CAUSAL, True, p_layout, dtype)  # fmt: skip
    # the tiles every row sees in full, then the causal diagonal / sequence tail (masked)
    t_mid = gl.maximum(gl.minimum(t_full, n_tiles), 1)
    for i in range(1, t_mid):
        p, m_i, l_i, acc = _step(q_wg, q2_wg, k_smem, k2_smem, v_smem, k_full, v_full, k_empty,
                                 v_empty, i, s_zero, p, m_i, l_i, acc, seq_len, q_pos, kcols,
                                 qk_scale_log2, TILE_N, NBUF, D_TAIL, CAUSAL, False, o_layout,
                                 p_layout, dtype)  # fmt: skip
    for i in range(t_mid, n_tiles):
        p, m_i, l_i, acc = _step(q_wg, q2_wg, k_smem, k2_smem, v_smem, k_full, v_full, k_empty,
                                 v_empty, i, s_zero, p, m_i, l_i, acc, seq_len, q_pos, kcols,
                                 qk_scale_log2, TILE_N, NBUF, D_TAIL, CAUSAL, True, o_layout,
                                 p_layout, dtype)  # fmt: skip
    if n_tiles > 0:
        sl = (n_tiles - 1) % NBUF
        mbarrier.wait(v_full.index(sl), ((n_tiles - 1) // NBUF) & 1)
        acc = warpgroup_mma(p, v_smem.index(sl), acc)
        mbarrier.arrive(v_empty.index(sl), count=1)

    has = l_i > 0.0
    l_div = gl.where(has, l_i, 1.0)
    o = acc / gl.convert_layout(l_div, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_V, layout=gl.SliceLayout(0, o_layout))
    o_tok = q_tile * BLOCK_Q + o_rows // GROUP
    o_ptrs = (
        out_ptr
        + (q_start + o_tok).to(gl.int64)[:, None] * stride_ot
        + (kvh * GROUP + o_rows % GROUP).to(gl.int64)[:, None] * stride_oh
        + o_cols[None, :]
    )
    gl.store(o_ptrs, o.to(dtype), mask=(o_tok < q_len)[:, None] & (o_cols < HEAD_V)[None, :])
    if WRITE_LSE:
        lse = gl.where(
            has, (m_i * qk_scale_log2 + gl.log2(l_div)) * 0.6931471805599453, float("-inf")
        )
        l_tok = q_tile * BLOCK_Q + rows // GROUP
        lse_ptrs = (
            lse_ptr
            + (q_start + l_tok).to(gl.int64) * stride_lt
            + (kvh * GROUP + rows % GROUP).to(gl.int64) * stride_lh
        )
        gl.store(lse_ptrs, lse, mask=l_tok < q_len)


@gluon.jit
def _stage_q(q_smem, q_ptr, stride_qt, stride_qh, q_start, q_tile, q_len, kvh,
             COL0: gl.constexpr, WIDTH: gl.constexpr, GROUP: gl.constexpr,
             BLOCK_Q: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The q tile's columns ``[COL0, COL0 + WIDTH)`` of its 128 rows (token, head) into the two
    consumers' halves of ``q_smem``; rows past the query read zeros."""
    layout: gl.constexpr = _rows_layout(WIDTH, WIDTH, num_warps)
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    for h in gl.static_range(2):
        rows = h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        tok = q_tile * BLOCK_Q + rows // GROUP
        ptrs = (
            q_ptr
            + (q_start + tok).to(gl.int64)[:, None] * stride_qt
            + (kvh * GROUP + rows % GROUP).to(gl.int64)[:, None] * stride_qh
            + (COL0 + cols)[None, :]
        )
        ok = (tok < q_len)[:, None] & (cols < WIDTH)[None, :]
        q_smem.index(h).store(gl.load(ptrs, mask=ok, other=0.0))


# (num_blocks is a bound, never a constexpr: Triton specializes an int equal to 1 into one,
# and the kernel casts it; a one-block cache -- a small workspace -- failed to compile)
@gluon.jit(do_not_specialize=["num_blocks", "seq_lo"])
def sm90_prefill_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kb, stride_kh, stride_kn,
    bt_ptr, stride_bts,
    seq_lens_ptr, qsl_ptr,
    out_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt, stride_lh,
    num_seqs, num_blocks, max_blocks, qk_scale_log2,
    q_len_min, q_len_max, seq_lo, kv_desc, tail_desc,
    D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, HEAD_V: gl.constexpr,
    K_START: gl.constexpr, V_START: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr,
    BLOCK_Q: gl.constexpr, TILE_N: gl.constexpr, NBUF: gl.constexpr,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr,
    P_WARPS: gl.constexpr, C_REGS: gl.constexpr, P_REGS: gl.constexpr, num_warps: gl.constexpr,
    USE_TMA: gl.constexpr = False,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    WG_M: gl.constexpr = 64
    # q (and a split head's tail) per consumer: [2, 64, width]; K, K's tail, V: rings of NBUF
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_M, D_MAIN], dtype)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, D_MAIN], dtype)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HEAD_V], dtype)

    n_h = gl.num_programs(1)
    n_q = gl.num_programs(0).to(gl.int64)
    lin = n_q * n_h - 1 - (gl.program_id(0) + n_q * gl.program_id(1))
    pid_q = (lin // n_h).to(gl.int32)
    kvh = (lin % n_h).to(gl.int32)
    # (sequences below seq_lo are not this launch's: its tiles start at theirs, as in
    # _kernels._find_seq)
    pid_q += gl.load(qsl_ptr + seq_lo).to(gl.int32) // BLOCK_Q + seq_lo
    lo = gl.to_tensor(seq_lo)
    hi = gl.to_tensor(num_seqs)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = gl.load(qsl_ptr + mid).to(gl.int32) // BLOCK_Q + mid <= pid_q
        lo = gl.where(go_right, mid, lo)
        hi = gl.where(go_right, hi, mid)
    seq = lo
    q_start = gl.load(qsl_ptr + seq).to(gl.int32)
    q_tile = pid_q - (q_start // BLOCK_Q + seq)
    q_len = gl.load(qsl_ptr + seq + 1).to(gl.int32) - q_start
    mine = (q_len >= q_len_min) & (q_len <= q_len_max) & (q_tile * BLOCK_Q < q_len)
    q_len = gl.where(mine, q_len, 0)
    seq_len = gl.load(seq_lens_ptr + seq).to(gl.int32)
    ctx = seq_len - q_len

    q_smem = gl.allocate_shared_memory(dtype, [2, WG_M, D_MAIN], q_sl)
    _stage_q(q_smem, q_ptr, stride_qt, stride_qh, q_start, q_tile, q_len, kvh, 0, D_MAIN, GROUP,
             BLOCK_Q, num_warps)  # fmt: skip
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, TILE_N, D_MAIN], k_sl)
    if D_TAIL > 0:
        q2_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_M, D_TAIL], dtype)
        k2_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, D_TAIL], dtype)
        q2_smem = gl.allocate_shared_memory(dtype, [2, WG_M, D_TAIL], q2_sl)
        _stage_q(q2_smem, q_ptr, stride_qt, stride_qh, q_start, q_tile, q_len, kvh, D_MAIN,
                 D_TAIL, GROUP, BLOCK_Q, num_warps)  # fmt: skip
        k2_smem = gl.allocate_shared_memory(dtype, [NBUF, TILE_N, D_TAIL], k2_sl)
    else:
        q2_smem = q_smem  # (unread without a tail)
        k2_smem = k_smem
    v_smem = gl.allocate_shared_memory(dtype, [NBUF, TILE_N, HEAD_V], v_sl)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    k_full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], bar_layout)
    v_full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], bar_layout)
    for b in gl.static_range(NBUF):
        mbarrier.init(k_full.index(b), count=32 * P_WARPS)
        mbarrier.init(v_full.index(b), count=32 * P_WARPS)
        mbarrier.init(k_empty.index(b), count=2)
        mbarrier.init(v_empty.index(b), count=2)
    fence_async_shared()

    first_q = q_tile * BLOCK_Q
    last_q = gl.minimum(first_q + BLOCK_Q, q_len) - 1
    if CAUSAL:
        kv_hi = gl.minimum(seq_len, ctx + last_q + 1)
        full_hi = gl.minimum(seq_len, ctx + first_q + 1)
    else:
        kv_hi = seq_len
        full_hi = seq_len
    n_tiles = gl.where(mine, gl.cdiv(kv_hi, TILE_N), 0)
    t_full = full_hi // TILE_N
    head_ptr = kv_ptr + kvh.to(gl.int64) * stride_kh
    bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bts

    gl.warp_specialize(
        [
            (_consumer, (q_smem, q2_smem, k_smem, k2_smem, v_smem, k_full, v_full, k_empty,
                         v_empty, 0, n_tiles, t_full, seq_len, ctx, q_tile, q_start, q_len, kvh,
                         qk_scale_log2, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                         stride_lh, HEAD_V, D_TAIL, GROUP, BLOCK_Q, TILE_N, NBUF, CAUSAL,
                         WRITE_LSE)),
            (_consumer, (q_smem, q2_smem, k_smem, k2_smem, v_smem, k_full, v_full, k_empty,
                         v_empty, 1, n_tiles, t_full, seq_len, ctx, q_tile, q_start, q_len, kvh,
                         qk_scale_log2, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                         stride_lh, HEAD_V, D_TAIL, GROUP, BLOCK_Q, TILE_N, NBUF, CAUSAL,
                         WRITE_LSE)),
            (_producer, (k_smem, k2_smem, v_smem, k_full, v_full, k_empty, v_empty,
                         head_ptr + K_START, head_ptr + V_START, bt_row_ptr, n_tiles, seq_len,
                         num_blocks, max_blocks, stride_kb, stride_kn, kv_desc, tail_desc,
                         kvh, BLOCK_SIZE, TILE_N, D_MAIN, D_TAIL, HEAD_V, NBUF, P_WARPS,
                         K_START, V_START, USE_TMA)),
        ],
        [4, P_WARPS],
        [C_REGS, P_REGS],
    )  # fmt: skip
