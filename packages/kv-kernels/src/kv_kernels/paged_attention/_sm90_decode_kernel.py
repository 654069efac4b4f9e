"""The Gluon body of the sm_90 paged decode over 1-byte pages (:mod:`._sm90_decode` says when
it runs and launches it): K and V go from global memory by ``cp.async`` into a small
shared-memory ring, each lane copying exactly the bytes it later reads, and from there straight
into tensor-core operand registers; q stays in registers for the whole KV loop.

Why. The Triton kernel decodes 16-bit pages at the copy limit, but over fp8 pages it moves about
the same TB/s on an H100 and an H200 (0.74-0.77 of the H200's copy): bound by instructions. Its
sm_90 loop spends ~530 instructions a warp on a 64-token tile, of which q's operand reloaded
from shared memory every tile (Triton's choice) and the 8-bit tiles' passes through shared
memory are a large part. Here (sm_90 build, triton 3.6, one warp, a 32-token tile of K and V:
~650 instructions for 8 KiB, where the Triton kernel's four warps issue ~2,100 for 16 KiB):

- one warp a program, ``mma.sync`` m16n8k16 (fp16 in, fp32 out); the 16 rows are
  ``16 / group`` query tokens x ``group`` heads of one KV head, as in the Triton decode;
- q is loaded once as fp16, each row scaled by a power of two (``f16_rows``' rule), and stays in
  A-operand registers;
- K's head dimension is *renamed* (:func:`_rename_k`: a reshape and permute, no data moves; the
  layout conversions are asserted trivial at compile time) so that the ``VEC``-byte pieces a
  lane copies are exactly the k values it holds in the B operand ``K^T``, and four lanes of a
  copy instruction cover ``4 VEC`` contiguous bytes of a row; q is renamed the same way once;
- V's columns are renamed (:func:`_rename_v`) so the output columns a lane accumulates are its
  own pieces of each token row; the accumulator is renamed back once, after the loop;
- bytes become fp16 in registers: e4m3 / e5m2 by the hardware's pair conversions, int8 by
  ``_upcast``'s byte-permute trick (exact: fp16 holds every int8 and fp8 value);
- P goes from the accumulator to P.V's A operand in registers (the layouts coincide), as
  ``p * 2^15`` in fp16 (l carries the factor); the accumulator is rescaled only on tiles where
  some row's maximum moved (a uniform branch: one warp);
- per-token-head pages (``SCALE_START``): each row's two float32 scales ride the same ring (one
  a lane, read by others after a barrier), copied from the row's end or, with kv-spec's
  ``scale_plane``, from the page's plane (``stride_ssh`` / ``stride_ssn``: the scales' own head
  and token strides); K's multiply the logits' columns; V's multiply P's
  columns divided by ``r``, the largest V scale seen so far, which keeps P in ``[0, 2^15]``
  whatever the scales (``r`` growing rescales the accumulator with the softmax's ``alpha``; the
  epilogue multiplies by the final ``r``).

Bounds: block-table columns past ``max_blocks`` read the last column, block ids are clamped into
``[0, num_blocks)`` (unsigned), rows past the sequence are zero-filled by ``cp.async``, not
read: no read leaves the cache whatever the metadata says.

Version notes: triton 3.9 renamed ``async_copy_global_to_shared`` to ``async_load`` and
``thread_barrier`` to ``barrier`` (:mod:`._gluon_compat`); its alignment analysis loses the
divisibility of a select between two page bases (so two-page tiles choose theirs
arithmetically).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kv_kernels.paged_attention._gluon_compat import async_load, barrier
from kv_kernels.paged_attention._sm90_prefill_kernel import _block_of
from kv_kernels.paged_attention._upcast import _I8_ASM

__all__ = ["HEAD", "ROWS", "TILE_N", "sm90_decode_kernel"]

#: tokens a KV tile, query rows a program (the MMA's M), head size served
TILE_N = gl.constexpr(32)
ROWS = gl.constexpr(16)
HEAD = gl.constexpr(128)


@gluon.constexpr_function
def _piece(row_align):
    """Bytes a copy moves: 16, or ``row_align`` (8) for rows only that aligned (per-token-head
    pages' 264-byte rows); ``row_align`` 1 means every stride is a multiple of 16."""
    return 16 if row_align == 1 else row_align


@gluon.constexpr_function
def _k_layout(vec):
    """A ``[32 tokens, 128 bytes]`` K tile read in ``vec``-byte pieces (16, or 8 for the 8-byte
    aligned rows of per-token-head pages): lane ``4 g + c`` holds tokens ``g + 8 j`` and, of
    each, the ``vec``-byte pieces at ``vec c + 4 vec i``; the four lanes ``c`` of one copy
    instruction cover ``4 vec`` contiguous bytes of a row (whole sectors)."""
    v = vec.bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(v)]
        + [[8, 0], [16, 0]]
        + [[0, 4 * vec << j] for j in range(5 - v)],
        lane_bases=[[0, vec], [0, 2 * vec], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[TILE_N, HEAD],
    )


@gluon.constexpr_function
def _v_layout(vec):
    """A ``[32 tokens, 128 bytes]`` V tile read in ``vec``-byte pieces: lane ``4 g + c`` holds
    tokens ``2 c + {0, 1, 8, 9, 16, 17, 24, 25}`` and, of each, the pieces at ``vec g + 8 vec
    i``; the eight lanes ``g`` of one copy instruction cover ``8 vec`` contiguous bytes."""
    v = vec.bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(v)]
        + [[0, 8 * vec << j] for j in range(4 - v)]
        + [[1, 0], [8, 0], [16, 0]],
        lane_bases=[[2, 0], [4, 0], [0, vec], [0, 2 * vec], [0, 4 * vec]],
        warp_bases=[],
        block_bases=[],
        shape=[TILE_N, HEAD],
    )


@gluon.jit
def _rename_k(x, ROWS_: gl.constexpr, VEC: gl.constexpr):
    """Head column ``p = 4 VEC h + VEC c + 2 r + e`` (``h`` the pieces' high bits, ``c`` the
    lane, ``r`` / ``e`` the bytes in a piece) becomes ``32 h + 8 r + 2 c + e``: the order in
    which the MMA's operand registers hold k (:func:`_k_layout`). Applied to K's tile and to q,
    so q.k is unchanged."""
    x = x.reshape([ROWS_, HEAD // (4 * VEC), 4, VEC // 2, 2]).permute([0, 1, 3, 2, 4])
    return x.reshape([ROWS_, HEAD])


@gluon.jit
def _rename_v(x, ROWS_: gl.constexpr, VEC: gl.constexpr):
    """V column ``p = 8 VEC h + VEC g + r`` becomes ``8 (VEC h + r) + g``: a lane's pieces
    become the columns it accumulates (:func:`_v_layout`); :func:`_unrename_v` is the inverse."""
    x = x.reshape([ROWS_, HEAD // (8 * VEC), 8, VEC]).permute([0, 1, 3, 2])
    return x.reshape([ROWS_, HEAD])


@gluon.jit
def _unrename_v(x, ROWS_: gl.constexpr, VEC: gl.constexpr):
    x = x.reshape([ROWS_, HEAD // (8 * VEC), VEC, 8]).permute([0, 1, 3, 2])
    return x.reshape([ROWS_, HEAD])


@gluon.jit
def _page_base(bt_row_ptr, col, num_blocks, max_blocks, stride_kb):
    """Element offset (int64) of the page in block-table column ``col``: columns past the table
    read its last, block ids are clamped into ``[0, num_blocks)`` (unsigned: -1 too)."""
    return _block_of(bt_row_ptr, col, num_blocks, max_blocks).to(gl.int64) * stride_kb


@gluon.jit
def _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb, stride_kn,
               BLOCK_SIZE: gl.constexpr, ROW_ALIGN: gl.constexpr,
               ROW_LAYOUT: gl.constexpr):  # fmt: skip
    """Element offsets ``[TILE_N]`` (int64) of tile ``t``'s token rows through the block table
    (one block id a tile when a page holds whole tiles), and which rows are in the sequence.
    ``ROW_ALIGN``: the alignment the host proved of every row (per-token-head rows of 264 bytes
    are 8-byte aligned; see ``kv_kernels._common.row_align``), 1 when the strides show it."""
    rows = gl.arange(0, TILE_N, layout=ROW_LAYOUT)
    kpos = t * TILE_N + rows
    if BLOCK_SIZE % TILE_N == 0:
        # one page: a scalar base, plus the rows' offsets (loop-invariant)
        base = (
            _page_base(bt_row_ptr, (t * TILE_N) // BLOCK_SIZE, num_blocks, max_blocks, stride_kb)
            + ((t * TILE_N) % BLOCK_SIZE).to(gl.int64) * stride_kn
        )
        off = base + rows.to(gl.int64) * stride_kn
    elif TILE_N == 2 * BLOCK_SIZE:
        # two pages: two scalar bases, one chosen a row
        b0 = _page_base(bt_row_ptr, 2 * t, num_blocks, max_blocks, stride_kb)
        b1 = _page_base(bt_row_ptr, 2 * t + 1, num_blocks, max_blocks, stride_kb)
        # (arithmetic, not a select: triton 3.9's alignment analysis loses a select's)
        second = (rows >= BLOCK_SIZE).to(gl.int64)
        off = b0 + second * (b1 - b0) + (rows % BLOCK_SIZE).to(gl.int64) * stride_kn
    else:
        blk = _block_of(bt_row_ptr, kpos // BLOCK_SIZE, num_blocks, max_blocks)
        off = blk.to(gl.int64) * stride_kb + (kpos % BLOCK_SIZE).to(gl.int64) * stride_kn
    if ROW_ALIGN > 1:
        off = gl.multiple_of(off, ROW_ALIGN)
    return off, kpos < seq_len


@gluon.jit
def _decode_class(qsl_ptr, seq_lens_ptr, seq, BLOCK_Q: gl.constexpr):
    """``(q_start, q_len, mine, seq_len)`` of sequence ``seq``: ``mine`` says it is in the decode
    class (``1 <= q_len <= BLOCK_Q``; longer queries go to the prefill launch)."""
    q_start = gl.load(qsl_ptr + seq).to(gl.int32)
    q_len = gl.load(qsl_ptr + seq + 1).to(gl.int32) - q_start
    seq_len = gl.load(seq_lens_ptr + seq).to(gl.int32)
    return q_start, q_len, (q_len >= 1) & (q_len <= BLOCK_Q), seq_len


@gluon.jit
def _split_tiles(seq_len, mine, TILE: gl.constexpr):
    """``(t_hi, lo, hi)``: the sequence's ``TILE``-token tiles (none outside the decode class)
    and this program's split of them, ``[lo, hi)`` (the split is program axis 2)."""
    t_hi = gl.where(mine, gl.cdiv(seq_len, TILE), 0)
    per_split = gl.cdiv(t_hi, gl.num_programs(2))
    lo = gl.minimum(gl.program_id(2) * per_split, t_hi)
    return t_hi, lo, gl.minimum(lo + per_split, t_hi)


@gluon.jit
def _issue(ring, slot, t, live, head_ptr, s_head_ptr, bt_row_ptr, seq_len, num_blocks,
           max_blocks, stride_kb, stride_kn, stride_ssn, K_START: gl.constexpr,
           V_START: gl.constexpr,
           SCALE_START: gl.constexpr, BLOCK_SIZE: gl.constexpr,
           ROW_ALIGN: gl.constexpr):  # fmt: skip
    """cp.async of tile ``t``'s K and V (and with ``SCALE_START``, each row's two float32 scales,
    from ``s_head_ptr + SCALE_START`` with token stride ``stride_ssn``: inline in the rows, or
    in the page's scale plane) into ring slot ``slot``, committed as one group (an empty one when
    not ``live``).
    Rows past the sequence are zero-filled, not read. Each lane copies the bytes it later reads
    (the operand layouts), in ``VEC``-byte pieces."""
    k_smem, v_smem, ks_smem, vs_smem = ring
    VEC: gl.constexpr = _piece(ROW_ALIGN)
    kl: gl.constexpr = _k_layout(VEC)
    vl: gl.constexpr = _v_layout(VEC)
    k_off, k_ok = _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, ROW_ALIGN, gl.SliceLayout(1, kl))  # fmt: skip
    v_off, v_ok = _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, ROW_ALIGN, gl.SliceLayout(1, vl))  # fmt: skip
    kc = gl.arange(0, HEAD, layout=gl.SliceLayout(0, kl))
    vc = gl.arange(0, HEAD, layout=gl.SliceLayout(0, vl))
    async_load(k_smem.index(slot), head_ptr + K_START + k_off[:, None] + kc[None, :],
                mask=(k_ok & live)[:, None] & (kc < HEAD)[None, :])  # fmt: skip
    async_load(v_smem.index(slot), head_ptr + V_START + v_off[:, None] + vc[None, :],
                mask=(v_ok & live)[:, None] & (vc < HEAD)[None, :])  # fmt: skip
    if SCALE_START > 0:
        # one float32 a lane (a layout without repeats: every scale is copied once)
        sl: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        s_off, s_ok = _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb,
                                 stride_ssn, BLOCK_SIZE, ROW_ALIGN, sl)  # fmt: skip
        s_ptr = (s_head_ptr + SCALE_START + s_off).to(gl.pointer_type(gl.float32))
        async_load(ks_smem.index(slot), s_ptr, mask=s_ok & live)
        async_load(vs_smem.index(slot), s_ptr + 1, mask=s_ok & live)
    async_copy.commit_group()


@gluon.jit
def _to_f16(x):
    """A 1-byte tile as fp16, exactly: fp8 by the hardware's pair conversions; int8 four bytes
    at a time through the fp16 whose bits are ``0x64uu`` (``_upcast``'s ``_I8_ASM``: two byte
    permutes and two packed subtractions per word, not a conversion instruction a value)."""
    if x.dtype.is_int8():
        return gl.inline_asm_elementwise(_I8_ASM, "=r,=r,r", [x], dtype=gl.float16,
                                         is_pure=True, pack=4)  # fmt: skip
    return x.to(gl.float16)


@gluon.jit
def _attend(q_op, acc, m_i, l_i, r_i, k, v, ks, vs, t, row_scale, q_pos,
            VEC: gl.constexpr, INLINE: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """One 32-token tile: ``S = q K^T``, the online softmax (log2 domain, ``row_scale`` the
    softmax scale x log2(e) x a per-tensor K scale / q's row scale), ``acc += P V`` (renamed
    columns).

    ``INLINE`` (per-token-head scales ``ks``, ``vs`` ``[TILE_N]``): the logits' columns are
    multiplied by ``ks``, and P's columns by ``vs / r`` before the fp16 P.V, where ``r`` is the
    largest V scale seen so far: ``p * vs / r`` stays in ``[0, 2^15]`` whatever the scales, and
    when ``r`` grows the accumulator is rescaled by ``r_old / r_new`` with the softmax's
    ``alpha`` (the epilogue multiplies by the final ``r``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kt = _rename_k(_to_f16(k), TILE_N, VEC).permute([1, 0])
    kt = gl.convert_layout(kt, b_op, assert_trivial=True)
    s = mma_v2(q_op, kt, gl.zeros([ROWS, TILE_N], gl.float32, mma))
    x = s * row_scale[:, None]
    if INLINE:
        x = x * ks[None, :]
    if MASKED:
        kpos = t * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, mma))
        x = gl.where(kpos[None, :] <= q_pos[:, None], x, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(x, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    # fp16 P carried as p * 2^15 (<= 32768): probabilities down to 2^-39 of the row's maximum
    p = gl.exp2(x - (m_use - 15.0)[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    if INLINE:
        r_new = gl.maximum(r_i, gl.max(vs, 0))
        inv = 1.0 / r_new  # (one division a tile; the epilogue multiplies by the final r)
        p = p * (vs * inv)[None, :]
        alpha = alpha * (r_i * inv)
        r_i = r_new
    if gl.min(alpha, 0) != 1.0:  # (one warp: a uniform branch; most tiles keep every max)
        acc = acc * alpha[:, None]
    p_op = gl.convert_layout(p.to(gl.float16), a_op, assert_trivial=True)
    vv = gl.convert_layout(_rename_v(_to_f16(v), TILE_N, VEC), b_op, assert_trivial=True)
    acc = mma_v2(p_op, vv, acc)
    return acc, m_new, l_i, r_i


@gluon.jit
def _tiles(q_op, acc, m_i, l_i, r_i, ring, lo, hi, s_lo, s_hi, head_ptr, s_head_ptr, bt_row_ptr,
           seq_len, num_blocks, max_blocks, stride_kb, stride_kn, stride_ssn, row_scale, q_pos,
           K_START: gl.constexpr, V_START: gl.constexpr, SCALE_START: gl.constexpr,
           BLOCK_SIZE: gl.constexpr, ROW_ALIGN: gl.constexpr, NBUF_: gl.constexpr,
           MASKED: gl.constexpr):  # fmt: skip
    """Tiles ``[lo, hi)`` of the split ``[s_lo, s_hi)``: tile ``t`` sits in ring slot
    ``(t - s_lo) % NBUF`` and tile ``t + NBUF - 1`` is issued before ``t`` is read."""
    VEC: gl.constexpr = _piece(ROW_ALIGN)
    kl: gl.constexpr = _k_layout(VEC)
    vl: gl.constexpr = _v_layout(VEC)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    k_smem, v_smem, ks_smem, vs_smem = ring
    for t in range(lo, hi):
        ahead = t + NBUF_ - 1
        _issue(ring, (ahead - s_lo) % NBUF_, ahead, ahead < s_hi, head_ptr, s_head_ptr,
               bt_row_ptr, seq_len, num_blocks, max_blocks, stride_kb, stride_kn, stride_ssn,
               K_START, V_START, SCALE_START, BLOCK_SIZE, ROW_ALIGN)  # fmt: skip
        async_copy.wait_group(NBUF_ - 1)  # tile t's group has landed
        slot = (t - s_lo) % NBUF_
        k = k_smem.index(slot).load(kl)  # (each lane reads back the bytes it copied)
        v = v_smem.index(slot).load(vl)
        if SCALE_START > 0:
            barrier()  # (the scales were copied one a lane, and are read by others)
            ks = ks_smem.index(slot).load(gl.SliceLayout(0, mma))
            vs = vs_smem.index(slot).load(gl.SliceLayout(0, mma))
        else:
            ks = 1.0
            vs = 1.0
        acc, m_i, l_i, r_i = _attend(q_op, acc, m_i, l_i, r_i, k, v, ks, vs, t, row_scale, q_pos,
                                     VEC, SCALE_START > 0, MASKED)  # fmt: skip
    return acc, m_i, l_i, r_i


# (num_blocks is a bound, never a constexpr: Triton specializes an int equal to 1 into one,
# and the kernel casts it; a one-block cache -- a small workspace -- failed to compile)
@gluon.jit(do_not_specialize=["num_blocks"])
def sm90_decode_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kb, stride_kh, stride_kn,
    stride_ssh, stride_ssn,  # per-token-head scales: head / token strides (inline: the rows')
    bt_ptr, stride_bts,
    seq_lens_ptr, qsl_ptr,
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, k_scale_val, v_scale_val,
    out_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt, stride_lh,
    part_out_ptr, part_lse_ptr,
    num_q_heads, num_blocks, max_blocks, qk_scale_log2,
    K_START: gl.constexpr, V_START: gl.constexpr, SCALE_START: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, ROW_ALIGN: gl.constexpr, GROUP: gl.constexpr,
    KV_SCALE: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
    NBUF_: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    BLOCK_Q: gl.constexpr = ROWS // GROUP
    VEC: gl.constexpr = _piece(ROW_ALIGN)

    seq = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    num_splits = gl.num_programs(2)
    q_start, q_len, mine, seq_len = _decode_class(qsl_ptr, seq_lens_ptr, seq, BLOCK_Q)
    ctx = seq_len - q_len

    # ---- q: [16 rows = (token, head), 128], fp16 scaled by a power of two a row, renamed ----
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_l))
    cq = gl.arange(0, HEAD, layout=gl.SliceLayout(0, q_l))
    q_rows = (q_start + rq // GROUP).to(gl.int64) * stride_qt + (kvh * GROUP + rq % GROUP).to(
        gl.int64
    ) * stride_qh
    q_in = mine & (rq // GROUP < q_len)
    q = gl.load(q_ptr + q_rows[:, None] + cq[None, :], mask=q_in[:, None], other=0.0)
    q = q.to(gl.float32)
    a = gl.max(gl.abs(q), 1)
    e = (a.to(gl.int32, bitcast=True) >> 23) & 0xFF  # a in [2^(e-127), 2^(e-126))
    e = gl.minimum(gl.maximum(e, 15), 254)
    up = ((268 - e) << 23).to(gl.float32, bitcast=True)  # 2^(141 - e): max |q| in [2^14, 2^15)
    q16 = (q * up[:, None]).to(gl.float16)
    q_op = gl.convert_layout(_rename_k(q16, ROWS, VEC), a_op)
    down = gl.convert_layout(((e - 14) << 23).to(gl.float32, bitcast=True), row_l)

    if KV_SCALE == 1:
        k_deq = k_scale_val
        v_deq = v_scale_val
    elif KV_SCALE == 2:
        k_deq = gl.load(k_scale_ptr + kvh * stride_ks)
        v_deq = gl.load(v_scale_ptr + kvh * stride_vs)
    else:
        k_deq = 1.0
        v_deq = 1.0
    row_scale = down * (qk_scale_log2 * k_deq)

    rows = gl.arange(0, ROWS, layout=row_l)
    r_tok = rows // GROUP
    q_pos = ctx + r_tok
    # tiles: [0, t_hi) seen by some row, [0, t_full) by every row; this program's split of them
    t_hi, s_lo, s_hi = _split_tiles(seq_len, mine, TILE_N)
    if CAUSAL:
        t_full = gl.minimum(gl.maximum(ctx + 1, 0) // TILE_N, t_hi)
    else:
        t_full = gl.minimum(seq_len // TILE_N, t_hi)
        q_pos = q_pos * 0 + (seq_len - 1)

    head_ptr = kv_ptr + kvh.to(gl.int64) * stride_kh
    if ROW_ALIGN > 1:
        head_ptr = gl.multiple_of(head_ptr, ROW_ALIGN)
    bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bts
    s_head_ptr = kv_ptr + kvh.to(gl.int64) * stride_ssh
    if ROW_ALIGN > 1:
        s_head_ptr = gl.multiple_of(s_head_ptr, ROW_ALIGN)
    acc = gl.zeros([ROWS, HEAD], gl.float32, mma)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([ROWS], gl.float32, row_l)
    r_i = gl.to_tensor(1.1754943508222875e-38)  # the largest V scale seen (inline scales)
    # the ring: K and V tiles (16-byte chunks swizzled by row: conflict-free reads), and with
    # inline scales each row's two float32 scales
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    scale_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty
    SCALE_ROWS: gl.constexpr = TILE_N if SCALE_START > 0 else 1
    ring = (
        gl.allocate_shared_memory(kv_dtype, [NBUF_, TILE_N, HEAD], ring_l),
        gl.allocate_shared_memory(kv_dtype, [NBUF_, TILE_N, HEAD], ring_l),
        gl.allocate_shared_memory(gl.float32, [NBUF_, SCALE_ROWS], scale_l),
        gl.allocate_shared_memory(gl.float32, [NBUF_, SCALE_ROWS], scale_l),
    )
    for i in gl.static_range(NBUF_ - 1):
        _issue(ring, i, s_lo + i, s_lo + i < s_hi, head_ptr, s_head_ptr, bt_row_ptr, seq_len,
               num_blocks, max_blocks, stride_kb, stride_kn, stride_ssn, K_START, V_START,
               SCALE_START, BLOCK_SIZE, ROW_ALIGN)  # fmt: skip
    mid = gl.maximum(gl.minimum(s_hi, t_full), s_lo)
    acc, m_i, l_i, r_i = _tiles(q_op, acc, m_i, l_i, r_i, ring, s_lo, mid, s_lo, s_hi, head_ptr,
                                s_head_ptr, bt_row_ptr, seq_len, num_blocks, max_blocks,
                                stride_kb, stride_kn, stride_ssn, row_scale, q_pos, K_START,
                                V_START, SCALE_START, BLOCK_SIZE, ROW_ALIGN, NBUF_,
                                False)  # fmt: skip
    acc, m_i, l_i, r_i = _tiles(q_op, acc, m_i, l_i, r_i, ring, mid, s_hi, s_lo, s_hi, head_ptr,
                                s_head_ptr, bt_row_ptr, seq_len, num_blocks, max_blocks,
                                stride_kb, stride_kn, stride_ssn, row_scale, q_pos, K_START,
                                V_START, SCALE_START, BLOCK_SIZE, ROW_ALIGN, NBUF_,
                                True)  # fmt: skip
    async_copy.wait_group(0)  # (the empty groups issued past the split)
    if SCALE_START > 0:
        v_deq = v_deq * r_i

    # ---- epilogue: normalize, V's scale, columns back in V's order, store -------------------
    has = l_i > 0.0
    l_div = gl.where(has, l_i, 1.0)
    o = acc * (v_deq / l_div)[:, None]
    lse = gl.where(has, (m_i - 15.0 + gl.log2(l_div)) * 0.6931471805599453, float("-inf"))
    o = _unrename_v(o, ROWS, VEC)
    o_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    o = gl.convert_layout(o, o_l)
    ro = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_l))
    co = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_l))
    tok = (q_start + ro // GROUP).to(gl.int64)
    head = kvh * GROUP + ro % GROUP
    ok = mine & (ro // GROUP < q_len)
    lse = gl.convert_layout(lse, gl.SliceLayout(1, o_l))
    if SPLIT:
        part = (tok * num_q_heads + head) * num_splits + split
        gl.store(part_lse_ptr + part, lse, mask=ok)
        gl.store(part_out_ptr + part[:, None] * HEAD + co[None, :], o, mask=ok[:, None])
    else:
        o_ptrs = out_ptr + (tok * stride_ot + head.to(gl.int64) * stride_oh)[:, None] + co[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=ok[:, None])
        if WRITE_LSE:
            gl.store(lse_ptr + tok * stride_lt + head.to(gl.int64) * stride_lh, lse, mask=ok)
