"""Paged decode over 1-byte (fp8) pages in Gluon: K and V go from global memory straight into
tensor-core operand registers, with no shared-memory copy and no reload of q.

Why a second decode kernel. The Triton kernel decodes 16-bit pages at the copy limit, but over
fp8 pages it moves about the same TB/s on an H100 and an H200 (0.74-0.76 of the H200's copy):
it is bound by instructions, not memory. Its sm_90 loop spends ~530 instructions a warp on a
64-token tile, of which the q operand's reload from shared memory each tile (Triton's choice)
and the 8-bit tiles' passes through shared memory are a large part. Gluon states the layouts:

- one warp a program, ``mma.sync`` (m16n8k16, fp16 in, fp32 out); the 16 rows are
  ``16 / group`` query tokens x ``group`` heads of one KV head, as in the Triton kernel's decode;
- q is loaded once, as fp16 scaled by a power of two a row (``f16_rows``' rule), and stays in
  operand registers for the whole KV loop;
- each 32-token tile of K is read by 16-byte loads, 32 bytes of a token row a thread, and the
  head dimension is *renamed* so those 32 bytes are exactly the k values the thread holds in the
  MMA's B operand (``K^T``): a reshape and permute of the tile (no data moves; the layouts are
  checked trivial at compile time), with q renamed the same way once. The bytes become fp16 in
  place (``cvt.rn.f16x2.e4m3x2`` on pairs);
- V's columns are renamed so that the 16 output columns a thread accumulates are 16 adjacent
  bytes of a token row: one 16-byte load per token, and the accumulator is renamed back once,
  after the loop;
- P goes from the accumulator to the A operand of P.V in registers (the two layouts coincide),
  carried as ``p * 2^15`` in fp16 (as the Triton kernel's fp16 P.V; l carries the factor);
- KV splits (flash-decoding) give the parallelism: programs are one warp, so the split count
  aims at ``PROGRAMS_PER_SM`` programs an SM, and the partial outputs go through the same merge
  as the Triton kernel's.

Scope (:func:`sm90_decode_eligible`): the decode class of a launch (``q_len <= 16 / group``)
with 16-bit queries over an fp8 cache (e4m3 or e5m2), no scale or a per-tensor / per-KV-head
scale, heads 128 / 128, GQA groups 1-16, a positive softmax scale, causal or not, splits, LSE.
ALiBi, soft-cap, windows, sinks, per-token-head scales, metadata checks, MLA and other head
sizes stay with the Triton kernel. Gluon has no interpreter: the CPU suite compiles this kernel
for sm_90 and checks its PTX; the GPU suite checks it against the reference.

Bounds: block-table columns past ``max_blocks`` read the last column, block ids are clamped into
``[0, num_blocks)`` (unsigned), tokens past the sequence are not read (masked loads), so no read
leaves the cache whatever the metadata says.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

__all__ = [
    "aot_case",
    "launch_sm90_decode",
    "pick_decode_splits",
    "sm90_decode_eligible",
    "sm90_decode_kernel",
]

#: tokens a KV tile, query rows a program (the MMA's M), head size served
TILE_N = gl.constexpr(32)
ROWS = gl.constexpr(16)
HEAD = gl.constexpr(128)
#: programs (one warp each) an SM the split count aims at (sm_90 build: ~150 registers a thread)
PROGRAMS_PER_SM = 12
#: tiles in flight: a ring of NBUF shared-memory slots filled by cp.async (0: plain loads into
#: registers, each tile waited for where it is used)
NBUF = 2

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.constexpr_function
def _k_layout():
    """A ``[32 tokens, 128 bytes]`` K tile: lane ``4 g + c`` holds the 32 bytes ``[32 c, 32 c +
    32)`` of tokens ``g + 8 j``; registers run along the bytes (two 16-byte loads a token)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0], [16, 0]],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[TILE_N, HEAD],
    )


@gluon.constexpr_function
def _v_layout():
    """A ``[32 tokens, 128 bytes]`` V tile: lane ``4 g + c`` holds the 16 bytes ``[16 g, 16 g +
    16)`` of tokens ``2 c + {0, 1, 8, 9, 16, 17, 24, 25}`` (one 16-byte load a token)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]],
        warp_bases=[],
        block_bases=[],
        shape=[TILE_N, HEAD],
    )


@gluon.jit
def _rename_k(x, ROWS_: gl.constexpr):
    """Head column ``p = 32 c + 2 r + e`` becomes ``8 r + 2 c + e``: the order in which the MMA's
    operand registers hold k. Applied to K's tile and to q, so q.k is unchanged."""
    x = x.reshape([ROWS_, 4, 16, 2]).permute([0, 2, 1, 3])
    return x.reshape([ROWS_, HEAD])


@gluon.jit
def _rename_v(x, ROWS_: gl.constexpr):
    """V column ``p = 16 a + b`` becomes ``8 b + a`` (a thread's 16 bytes become the 16
    columns it accumulates); :func:`_unrename_v` is its inverse."""
    return x.reshape([ROWS_, 8, 16]).permute([0, 2, 1]).reshape([ROWS_, HEAD])


@gluon.jit
def _unrename_v(x, ROWS_: gl.constexpr):
    return x.reshape([ROWS_, 16, 8]).permute([0, 2, 1]).reshape([ROWS_, HEAD])


@gluon.jit
def _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb, stride_kn,
               BLOCK_SIZE: gl.constexpr, LAYOUT: gl.constexpr):  # fmt: skip
    """Element offsets ``[TILE_N]`` (int64) of tile ``t``'s token rows through the block table
    (one block id a tile when a page holds whole tiles), and which rows are in the sequence."""
    rows = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LAYOUT))
    kpos = t * TILE_N + rows
    if BLOCK_SIZE % TILE_N == 0:
        col = gl.minimum((t * TILE_N) // BLOCK_SIZE, max_blocks - 1)
    else:
        col = gl.minimum(kpos // BLOCK_SIZE, max_blocks - 1)
    blk = gl.load(bt_row_ptr + col).to(gl.uint32, bitcast=True)
    blk = gl.minimum(blk, (num_blocks - 1).to(gl.uint32))
    off = blk.to(gl.int64) * stride_kb + (kpos % BLOCK_SIZE).to(gl.int64) * stride_kn
    return off, kpos < seq_len


@gluon.jit
def _tile_ptrs(t, live, k_ptr, v_ptr, bt_row_ptr, seq_len, num_blocks, max_blocks, stride_kb,
               stride_kn, BLOCK_SIZE: gl.constexpr):  # fmt: skip
    """Pointers and row masks ``[TILE_N, HEAD]`` of tile ``t``'s K and V in their load layouts
    (rows past the sequence, or every row when not ``live``, are masked off)."""
    kl: gl.constexpr = _k_layout()
    vl: gl.constexpr = _v_layout()
    k_off, k_ok = _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, kl)  # fmt: skip
    v_off, v_ok = _tile_rows(bt_row_ptr, t, seq_len, num_blocks, max_blocks, stride_kb,
                             stride_kn, BLOCK_SIZE, vl)  # fmt: skip
    kc = gl.arange(0, HEAD, layout=gl.SliceLayout(0, kl))
    vc = gl.arange(0, HEAD, layout=gl.SliceLayout(0, vl))
    k_mask = (k_ok & live)[:, None] & (kc < HEAD)[None, :]
    v_mask = (v_ok & live)[:, None] & (vc < HEAD)[None, :]
    return (
        k_ptr + k_off[:, None] + kc[None, :],
        k_mask,
        v_ptr + v_off[:, None] + vc[None, :],
        v_mask,
    )


@gluon.jit
def _issue(k_smem, v_smem, slot, t, live, k_ptr, v_ptr, bt_row_ptr, seq_len, num_blocks,
           max_blocks, stride_kb, stride_kn, BLOCK_SIZE: gl.constexpr):  # fmt: skip
    """cp.async of tile ``t`` into ring slot ``slot`` (rows masked off are zero-filled, not
    read), committed as one group (an empty one when not ``live``)."""
    kp, km, vp, vm = _tile_ptrs(t, live, k_ptr, v_ptr, bt_row_ptr, seq_len, num_blocks,
                                max_blocks, stride_kb, stride_kn, BLOCK_SIZE)  # fmt: skip
    _async_load(k_smem.index(slot), kp, mask=km)
    _async_load(v_smem.index(slot), vp, mask=vm)
    async_copy.commit_group()


@gluon.jit
def _load(t, k_ptr, v_ptr, bt_row_ptr, seq_len, num_blocks, max_blocks, stride_kb, stride_kn,
          BLOCK_SIZE: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """Tile ``t``'s K and V bytes by plain loads (``NBUF = 0``)."""
    kp, km, vp, vm = _tile_ptrs(t, True, k_ptr, v_ptr, bt_row_ptr, seq_len, num_blocks,
                                max_blocks, stride_kb, stride_kn, BLOCK_SIZE)  # fmt: skip
    if MASKED:
        k = gl.load(kp, mask=km, other=0.0)
        v = gl.load(vp, mask=vm, other=0.0)
    else:  # (every row of a fully visible tile is in the sequence)
        k = gl.load(kp)
        v = gl.load(vp)
    return k, v


@gluon.jit
def _attend(q_op, acc, m_i, l_i, k, v, t, row_scale, q_pos, MASKED: gl.constexpr):
    """One 32-token tile: ``S = q K^T``, the online softmax (log2 domain, ``row_scale`` the
    softmax scale x log2(e) x the K scale / q's row scale), ``acc += P V`` (renamed columns)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kt = _rename_k(k.to(gl.float16), TILE_N).permute([1, 0])
    kt = gl.convert_layout(kt, b_op, assert_trivial=True)
    s = mma_v2(q_op, kt, gl.zeros([ROWS, TILE_N], gl.float32, mma))
    x = s * row_scale[:, None]
    if MASKED:
        kpos = t * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, mma))
        x = gl.where(kpos[None, :] <= q_pos[:, None], x, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(x, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    # fp16 P carried as p * 2^15 (<= 32768): probabilities down to 2^-39 of the row's maximum
    p = gl.exp2(x - (m_use - 15.0)[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * alpha[:, None]
    p_op = gl.convert_layout(p.to(gl.float16), a_op, assert_trivial=True)
    vv = gl.convert_layout(_rename_v(v.to(gl.float16), TILE_N), b_op, assert_trivial=True)
    acc = mma_v2(p_op, vv, acc)
    return acc, m_new, l_i


@gluon.jit
def _tiles(q_op, acc, m_i, l_i, k_smem, v_smem, lo, hi, s_lo, s_hi, k_ptr, v_ptr, bt_row_ptr,
           seq_len, num_blocks, max_blocks, stride_kb, stride_kn, row_scale, q_pos,
           BLOCK_SIZE: gl.constexpr, NBUF_: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """Tiles ``[lo, hi)`` of the split ``[s_lo, s_hi)``; with a ring, tile ``t`` sits in slot
    ``(t - s_lo) % NBUF`` and tile ``t + NBUF - 1`` is issued before ``t`` is read."""
    kl: gl.constexpr = _k_layout()
    vl: gl.constexpr = _v_layout()
    for t in range(lo, hi):
        if NBUF_ > 0:
            ahead = t + NBUF_ - 1
            _issue(k_smem, v_smem, (ahead - s_lo) % NBUF_, ahead, ahead < s_hi, k_ptr, v_ptr,
                   bt_row_ptr, seq_len, num_blocks, max_blocks, stride_kb, stride_kn,
                   BLOCK_SIZE)  # fmt: skip
            async_copy.wait_group(NBUF_ - 1)  # tile t's group has landed
            slot = (t - s_lo) % NBUF_
            k = k_smem.index(slot).load(kl)  # (each thread reads back the bytes it copied)
            v = v_smem.index(slot).load(vl)
        else:
            k, v = _load(t, k_ptr, v_ptr, bt_row_ptr, seq_len, num_blocks, max_blocks,
                         stride_kb, stride_kn, BLOCK_SIZE, MASKED)  # fmt: skip
        acc, m_i, l_i = _attend(q_op, acc, m_i, l_i, k, v, t, row_scale, q_pos, MASKED)
    return acc, m_i, l_i


@gluon.jit
def sm90_decode_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kb, stride_kh, stride_kn,
    bt_ptr, stride_bts,
    seq_lens_ptr, qsl_ptr,
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, k_scale_val, v_scale_val,
    out_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt, stride_lh,
    part_out_ptr, part_lse_ptr,
    num_q_heads, num_blocks, max_blocks, qk_scale_log2,
    K_START: gl.constexpr, V_START: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    GROUP: gl.constexpr, KV_SCALE: gl.constexpr, CAUSAL: gl.constexpr,
    SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr, NBUF_: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    BLOCK_Q: gl.constexpr = ROWS // GROUP

    seq = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    num_splits = gl.num_programs(2)
    q_start = gl.load(qsl_ptr + seq).to(gl.int32)
    q_len = gl.load(qsl_ptr + seq + 1).to(gl.int32) - q_start
    mine = (q_len >= 1) & (q_len <= BLOCK_Q)  # the decode class (longer ones: the prefill launch)
    seq_len = gl.load(seq_lens_ptr + seq).to(gl.int32)
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
    q_op = gl.convert_layout(_rename_k(q16, ROWS), a_op)
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
    t_hi = gl.where(mine, gl.cdiv(seq_len, TILE_N), 0)
    if CAUSAL:
        t_full = gl.minimum(gl.maximum(ctx + 1, 0) // TILE_N, t_hi)
    else:
        t_full = gl.minimum(seq_len // TILE_N, t_hi)
        q_pos = q_pos * 0 + (seq_len - 1)
    per_split = gl.cdiv(t_hi, num_splits)
    s_lo = gl.minimum(split * per_split, t_hi)
    s_hi = gl.minimum(s_lo + per_split, t_hi)

    head_ptr = kv_ptr + kvh.to(gl.int64) * stride_kh
    k_ptr = head_ptr + K_START
    v_ptr = head_ptr + V_START
    bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bts
    acc = gl.zeros([ROWS, HEAD], gl.float32, mma)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([ROWS], gl.float32, row_l)
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty
    SLOTS: gl.constexpr = NBUF_ if NBUF_ > 0 else 1  # (unused without a ring)
    k_smem = gl.allocate_shared_memory(kv_dtype, [SLOTS, TILE_N, HEAD], ring_l)
    v_smem = gl.allocate_shared_memory(kv_dtype, [SLOTS, TILE_N, HEAD], ring_l)
    if NBUF_ > 0:
        for i in gl.static_range(NBUF_ - 1):
            _issue(k_smem, v_smem, i, s_lo + i, s_lo + i < s_hi, k_ptr, v_ptr, bt_row_ptr,
                   seq_len, num_blocks, max_blocks, stride_kb, stride_kn, BLOCK_SIZE)  # fmt: skip
    mid = gl.maximum(gl.minimum(s_hi, t_full), s_lo)
    acc, m_i, l_i = _tiles(q_op, acc, m_i, l_i, k_smem, v_smem, s_lo, mid, s_lo, s_hi, k_ptr,
                           v_ptr, bt_row_ptr, seq_len, num_blocks, max_blocks, stride_kb,
                           stride_kn, row_scale, q_pos, BLOCK_SIZE, NBUF_, False)  # fmt: skip
    acc, m_i, l_i = _tiles(q_op, acc, m_i, l_i, k_smem, v_smem, mid, s_hi, s_lo, s_hi, k_ptr,
                           v_ptr, bt_row_ptr, seq_len, num_blocks, max_blocks, stride_kb,
                           stride_kn, row_scale, q_pos, BLOCK_SIZE, NBUF_, True)  # fmt: skip
    if NBUF_ > 0:
        async_copy.wait_group(0)  # (the empty groups issued past the split)

    # ---- epilogue: normalize, V's scale, columns back in V's order, store -------------------
    has = l_i > 0.0
    l_div = gl.where(has, l_i, 1.0)
    o = acc * (v_deq / l_div)[:, None]
    lse = gl.where(has, (m_i - 15.0 + gl.log2(l_div)) * 0.6931471805599453, float("-inf"))
    o = _unrename_v(o, ROWS)
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


#: the features the Gluon decode does not implement (the Triton kernel serves them)
_UNSERVED = ("sliding_window", "sinks", "softcap", "alibi", "check", "v_from_k", "scale_words")


def sm90_decode_eligible(
    *,
    arch: int,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_size: int,
    head_size_v: int,
    group: int,
    block_q: int,
    scale: float,
    compiled: bool,
    features: dict[str, Any],
    unit_strides: bool = True,
) -> bool:
    """Whether :func:`launch_sm90_decode` serves a launch's decode class (else the Triton kernel).

    ``block_q``: the decode class's query tokens a sequence (the Triton decode config's; this
    kernel's 16 rows must hold them: ``block_q * group == 16``). ``compiled``: kernels run
    compiled (Gluon has no interpreter). ``unit_strides``: q, the cache, the output and the
    block table have contiguous last dimensions. ``KV_KERNELS_SM90_DECODE=0`` in the environment
    turns the kernel off (the Triton kernel then serves every decode), e.g. to compare the two."""
    return (
        compiled
        and arch == 90
        and os.environ.get("KV_KERNELS_SM90_DECODE", "1") != "0"
        and q_dtype in (torch.bfloat16, torch.float16)
        and cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and head_size == head_size_v == HEAD.value
        and group in (1, 2, 4, 8, 16)
        and block_q * group == ROWS.value
        and scale > 0
        and features.get("kv_scale_mode", 0) in (0, 1, 2)
        and unit_strides
        and not any(features.get(k) for k in _UNSERVED)
    )


def pick_decode_splits(*, num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits for a decode batch: the most (a power of two, at most 64) whose one-warp
    programs still fit one wave of ``PROGRAMS_PER_SM`` an SM, each split keeping at least 8
    tiles of 32 tokens. (H200, fp8 per tensor: 64 x 4k reads 3.96 TB/s at 2 splits, one wave of
    1,024 programs, and 3.26 at 4; 8 x 32k 4.01 at 16 and 3.30 at 32.)"""
    programs = max(1, num_seqs * num_kv_heads)
    tiles = -(-max(max_seq_len, 1) // TILE_N.value)
    slots = PROGRAMS_PER_SM * num_sms
    splits = 1
    while splits < 64 and programs * splits * 2 <= slots and tiles >= 16 * splits:
        splits *= 2
    return splits


def launch_sm90_decode(
    q: torch.Tensor,  # [T, Hq, 128], unit column stride
    kv_cache: torch.Tensor,  # [B, H, N, C] fp8, unit column stride
    *,
    k_start: int,
    v_start: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    block_size: int,
    kv_scale_mode: int,
    scale_args: tuple[Any, ...],  # (k_ptr, v_ptr, k_stride, v_stride, k_val, v_val)
    out: torch.Tensor,  # [T, Hq, 128]
    lse: torch.Tensor | None,  # [T, Hq] f32
    part_out: torch.Tensor,  # [T, Hq, S, 128] f32 (``out`` when S = 1)
    part_lse: torch.Tensor,  # [T, Hq, S] f32
    num_splits: int,
) -> None:
    """The decode class of a launch over an fp8 cache on sm_90 (inputs validated by the api;
    eligibility by :func:`sm90_decode_eligible`; the caller merges the splits)."""
    num_q_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[1]
    for name, t in (("q", q), ("kv_cache", kv_cache), ("out", out), ("block_table", block_table)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}.stride(-1)={t.stride(-1)}: the sm_90 decode kernel reads rows of unit "
                f"stride; pass {name} with a contiguous last dimension"
            )
    lse_t = lse if lse is not None else out
    grid = (block_table.shape[0], num_kv_heads, num_splits)
    sm90_decode_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table, block_table.stride(0), seq_lens, query_start_loc,
        *scale_args,
        out, out.stride(0), out.stride(1),
        lse_t, lse_t.stride(0), lse_t.stride(1),
        part_out, part_lse,
        num_q_heads, kv_cache.shape[0], block_table.shape[1], scale * 1.4426950408889634,
        K_START=k_start, V_START=v_start, BLOCK_SIZE=block_size,
        GROUP=num_q_heads // num_kv_heads, KV_SCALE=kv_scale_mode, CAUSAL=causal,
        SPLIT=num_splits > 1, WRITE_LSE=lse is not None, NBUF_=NBUF, num_warps=1,
    )  # fmt: skip


def aot_case(
    *,
    dtype: str = "bf16",
    cache: str = "fp8e4nv",
    group: int = 4,
    block_size: int = 16,
    causal: bool = True,
    kv_scale: int = 1,
    split: bool = False,
    write_lse: bool = False,
    nbuf: int = NBUF,
) -> dict[str, Any]:
    """The kernel as :func:`launch_sm90_decode` launches it, for an ahead-of-time sm_90 build
    (``kv_kernels.aot.aot_compile`` keywords, as :func:`._sm90_prefill.aot_case`)."""
    pointers = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{cache}", "bt_ptr": "*i32",
                "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "k_scale_ptr": "*fp32",
                "v_scale_ptr": "*fp32", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}  # fmt: skip
    sig = {}
    for name in sm90_decode_kernel.arg_names:
        sig[name] = pointers.get(name, "i64" if name.startswith("stride_") else "i32")
    for name in ("qk_scale_log2", "k_scale_val", "v_scale_val"):
        sig[name] = "fp32"
    constexprs = dict(
        K_START=0, V_START=HEAD.value, BLOCK_SIZE=block_size, GROUP=group, KV_SCALE=kv_scale,
        CAUSAL=causal, SPLIT=split, WRITE_LSE=write_lse, NBUF_=nbuf, num_warps=1,
    )  # fmt: skip
    for name in constexprs:
        sig[name] = "constexpr"
    aligned = [n for n, t in sig.items() if t.startswith("*")]
    aligned += ["stride_qt", "stride_qh", "stride_kb", "stride_kh", "stride_kn", "stride_ot",
                "stride_oh"]  # fmt: skip
    return {
        "module": __name__,
        "kernel": "sm90_decode_kernel",
        "signature": sig,
        "constexprs": constexprs,
        "arch": 90,
        "num_warps": 1,
        "divisible_by_16": aligned,
    }
