"""Triton cache write: one program per (``BLOCK_T`` tokens, chunk of ``BLOCK_H`` heads); the
``BLOCK_T * BLOCK_H`` head rows of K and of V move as ``[ROW_SPLIT, rows, head_size / ROW_SPLIT]``
tiles (``ROW_SPLIT = 1``: plain ``[rows, head_size]``).

Performance notes. The op is a pure scatter of ``T * H * (head_size + head_size_v)`` elements, so
an unquantized write is bound by HBM bandwidth: every thread issues 16-byte vector loads/stores (the
row dim has stride 1, which Triton specializes, and strides divisible by 16 give it the alignment),
and ``num_warps`` is sized so that each thread holds one to two 16-byte vectors per tensor. The slots
are read once per row; K/V loads do not wait for them (padding tokens, ``slot < 0``, are read but not
written: they are rare, and a load that depends on the slot would add one full memory latency to
every program). All cache offsets are int64: token indices and slots are int64 before they meet a
stride, so caches past 2**31 elements are addressed correctly.

Quantized writes were bound by instruction issue, not by bandwidth (H200, 64k tokens x 8 heads x
128: int8 per-token-head at 0.52-0.60 of the copy; its sm_90 SASS ran ~28 instructions per
element, about 10 of them the IEEE ``div.rn.f32`` sequence -- a reciprocal, four FMAs, a range check
and a branch per element -- and ~5 the per-row absmax/scale work paid per 8 elements). So:

- the quotient ``x / s`` is computed as ``q = x * y; q += (x - q * s) * y`` with ``y = 1 / s``
  correctly rounded once per row (Markstein's theorem: with ``y = RN(1/s)`` and the remainder
  exact through an FMA, ``q`` is ``RN(x / s)``, the bits ``div_rn`` gives) -- 3 instructions per
  element instead of ~9. The theorem needs no overflow or underflow: the program takes this path
  only when every row scale of its tile lies in ``[2**-64, 2**64]`` (a per-program check; otherwise
  it runs ``div_rn`` exactly as before; per-token-head rows qualify by ``absmax`` in
  ``[2**-40, 2**60]`` or 0), per-tensor inputs are first clamped to ``+-2 * qmax * s``
  (any value past it saturates either way, and inf/NaN clamp as before), and the remainder is
  formed as ``q * s - x`` so a ``-0.0`` input stays ``-0.0``. A remainder can still underflow when
  ``|x| < 2**-100``; then ``|x / s| < 2**-36`` and both results quantize to the same (signed) zero.
- the per-token-head scale ``absmax / qmax`` goes the same way through the constant
  ``RN(1 / qmax)`` (equal to ``div_rn`` on the whole fast range: checked exhaustively over a
  binade for 127, 448 and 57344).
- ``ROW_SPLIT = 2`` gives a thread two vectors of the same row, so the row's absmax shuffle,
  scale and reciprocal are paid per 16 elements instead of per 8; ``BLOCK_T`` tokens per program
  spread the program's fixed cost (slots, offsets, the range check) over more bytes.
- int8 values are read off the float's low byte after adding ``1.5 * 2**23`` (no float-to-int
  conversion and mask per element); compiled, the floor and that add are one add rounding down
  (libdevice ``add_rd``), and on the fast path only the lower clamp is left (``|x / s| <= qmax``
  there up to an ulp; the lower one maps NaN, which absmax skips, to ``-qmax``), for fp8 rows too.
- negations are ``x * -1.0``: Triton's unary minus is ``0 - x``, an instruction an element that
  ptxas cannot fold into the FMA (``0 - (+0.0)`` is ``+0.0``), and which turned an input ``-0.0``
  into ``+0.0`` on the fast path. That was why fp8 per-token-head bytes differed from torch's on
  the hard-values test (int8 has no ``-0``): with true negations every quantized mode takes the
  fast path and matches bit for bit.
- the two inline float32 scales of a row (K's, then V's) are one 8-byte store when the host proves
  the scale area 8-byte aligned (``SCALE_WORD``; 4: one 4-byte store per scale; 1: byte by byte, the
  old path, for scale areas at odd offsets).

Per-token-head quantization reduces each head row to its absmax in registers (the row is already
there: a shuffle reduction inside a warp), and writes the quantized row and the scales. Every
quotient is IEEE round-to-nearest (``div_rn`` or the exact reciprocal path above), so the GPU agrees
bit for bit with torch (sm_90 builds, straight-line instructions a thread per element it converts:
int8 per-token-head 16.8, fp8 per-token-head 14.6, fp8 per-tensor 13.75; 23.0 / 29.4 (``div_rn``) /
15.75 before the true negations, the round-down add and the 2-warp per-token-head config).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from kv_spec import KVCacheLayout, KVQuantMode
from triton.language.extra import libdevice

from kv_kernels._common import row_align, triton_interpreting
from kv_kernels._launch import FastLauncher, align_bits
from kv_kernels.cache import scale_geometry

__all__ = ["WriteConfig", "launch_config", "reshape_and_cache_triton"]

# Quant codes the kernel specializes on.
_QUANT_NONE, _QUANT_FP8_TENSOR, _QUANT_INT8_TOKEN_HEAD, _QUANT_FP8_TOKEN_HEAD = 0, 1, 2, 3
_QUANT_CODE = {
    KVQuantMode.NONE: _QUANT_NONE,
    KVQuantMode.FP8_PER_TENSOR: _QUANT_FP8_TENSOR,
    KVQuantMode.INT8_PER_TOKEN_HEAD: _QUANT_INT8_TOKEN_HEAD,
    KVQuantMode.FP8_PER_TOKEN_HEAD: _QUANT_FP8_TOKEN_HEAD,
}

# Elements one program moves per tensor (K or V); more per program means fewer, longer programs,
# fewer means more parallelism for small T. 2048 keeps ~4 KiB (bf16) of each in flight.
_MAX_TILE = 2048
# Quantized writes: elements per tensor per program (BLOCK_T tokens x BLOCK_H heads x head size)
# and per thread; see launch_config.
_QUANT_TILE = 2048
#: elements a thread converts a tensor: per tensor 16; per token and head 32 (H200, 64k tokens x 8
#: heads x 128, `bench_reshape_and_cache.py --tune`: 2 tokens a program over 2 warps read 0.89 /
#: 0.91 of the copy for int8 / fp8 rows where 4 warps read 0.81 / 0.88: the row's absmax
#: shuffles, scale and reciprocal spread over twice the elements)
_QUANT_PER_THREAD = {"tensor": 16, "token_head": 32}


@triton.jit
def _quantize(
    x, s, QUANT: tl.constexpr, QMAX: tl.constexpr, FAST: tl.constexpr, ROUND_DOWN: tl.constexpr
):
    """``clamp(x / s)`` in float32, before the cast (int8: ``clamp(floor(x / s + 0.5))`` as int8).

    ``x`` ``[ROW_SPLIT, R, D / ROW_SPLIT]`` float32, ``s`` ``[R]`` the row scales. ``FAST``: the
    quotient through the row's correctly rounded reciprocal and one FMA correction (bitwise
    ``div_rn``; the caller checked the scales' range, see the module notes), else ``div_rn``.
    ``ROUND_DOWN`` (compiled only: libdevice): int8's floor and magic add as one round-down add.
    """
    s3 = s[None, :, None]
    if FAST:
        if QUANT == 1:
            # |x| > 2 * qmax * s saturates either way; clamping first keeps x * y finite (and
            # maps inf/NaN where the clamp below maps their quotients: +-qmax, NaN to -qmax)
            bound = ((2.0 * QMAX) * s)[None, :, None]
            x = tl.minimum(tl.maximum(x, -bound), bound)
        y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[None, :, None]
        q = x * y
        # Negations as `* -1.0`, which LLVM makes an `fneg` and ptxas an FMA operand's sign: a
        # unary minus is `0 - x`, one more instruction an element, and `0 - (+0.0)` is +0.0, so
        # an input -0.0 left this path as +0.0. With true negations: r = q * s - x exactly
        # (+0.0 for x = +-0.0) and q - r * y keeps x's zero sign.
        r = tl.fma(q, s3, x * -1.0)
        q = tl.fma(r * -1.0, y, q)
    else:
        q = tl.math.div_rn(x, s3)
    if QUANT == 2:
        # clamp(floor(q + 0.5), -127, 127) with the clamp first (the same value for every q, NaN
        # included: -127), then the integer read off the float's low byte (exact below 2**22):
        # one add instead of a float-to-int conversion and a mask per element
        if FAST and ROUND_DOWN:
            # On the fast path |x| <= absmax and s = RN(absmax / 127), so q <= 127 * (1 + 2**-23)
            # and the upper clamp never binds; the lower one stays (it maps NaN, which absmax
            # skips, to -127). floor(t) + 1.5 * 2**23 is t + 1.5 * 2**23 rounded down, exactly.
            t = tl.maximum(q + 0.5, -QMAX + 0.5)
            q = libdevice.add_rd(t, 12582912.0)
        else:
            q = tl.floor(tl.minimum(tl.maximum(q + 0.5, -QMAX + 0.5), QMAX + 0.5))
            q = q + 12582912.0  # 1.5 * 2**23
        q = q.to(tl.int32, bitcast=True).to(tl.int8)
    elif FAST and QUANT == 3:
        # per token and head, fast: |q| <= qmax * (1 + 2**-23) (as for int8), which rounds to
        # qmax in e4m3 and e5m2, so only the lower clamp (NaN to -qmax) is left
        q = tl.maximum(q, -QMAX)
    else:
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    return q


@triton.jit
def _quantize_rn(
    k, v, ks, vs, k_amax, v_amax, QUANT: tl.constexpr, QMAX: tl.constexpr, HAS_V: tl.constexpr
):
    """The IEEE-division path: per-token-head scales ``div_rn(absmax, qmax)`` (given scales
    kept), quotients ``div_rn``; returns ``(kq, vq, ks, vs)`` (``vq``, ``vs`` are ``kq``, ``ks``
    without V)."""
    if QUANT >= 2:
        ks = tl.where(k_amax > 0, tl.math.div_rn(k_amax, QMAX), 1.0)
    kq = _quantize(k, ks, QUANT, QMAX, False, False)
    vq = kq
    if HAS_V:
        if QUANT >= 2:
            vs = tl.where(v_amax > 0, tl.math.div_rn(v_amax, QMAX), 1.0)
        vq = _quantize(v, vs, QUANT, QMAX, False, False)
    return kq, vq, ks, vs


@triton.jit
def _row_scale(amax, QMAX: tl.constexpr, QMAX_RCP: tl.constexpr):
    """``(absmax / qmax or 1.0 for a zero row, in fast range)`` per row: the quotient by the
    constant through ``QMAX_RCP = RN(1 / qmax)`` and one FMA correction, which equals ``div_rn``
    for every ``amax`` in the fast range (checked exhaustively over a binade for 127, 448, 57344;
    powers of two scale exactly); rows outside it make the program take the ``div_rn`` path."""
    s = amax * QMAX_RCP
    r = tl.fma(s, QMAX, -amax)
    s = tl.fma(-r, QMAX_RCP, s)
    fast = (amax == 0) | ((amax >= 9.094947017729282e-13) & (amax <= 1.152921504606847e18))
    return tl.where(amax > 0, s, 1.0), fast  # 2**-40 <= amax <= 2**60: s in [2**-57, 2**60]


# The token and slot counts are not specialized (a batch of 1 token or of a multiple of 16 would
# build its own variant, which a warmup cannot foresee); they only bound the grid's programs.
@triton.jit(do_not_specialize=["num_tokens", "num_slots"])
def _reshape_and_cache_kernel(
    key_ptr,  # [T', H, HEAD_SIZE]
    value_ptr,  # [T', H, HEAD_SIZE_V] (unused when not HAS_V)
    cache_ptr,  # [B, H, N, C] in the cache dtype
    cache_bytes_ptr,  # the same memory as uint8 (1-byte caches; inline scales go through it)
    slot_ptr,  # [T] int64
    k_scale_ptr,  # float32, 1 or H elements (FP8_PER_TENSOR)
    v_scale_ptr,
    num_tokens,  # T
    num_slots,  # B * N: slots at or past it are never written (checked on the host for CPU tensors)
    key_st,
    key_sh,
    key_sd,
    value_st,
    value_sh,
    value_sd,
    cache_sb,
    cache_sh,
    cache_sn,
    cache_sc,
    k_scale_sh,  # 0: one scale for every head, 1: per head
    v_scale_sh,
    scale_sh,  # SCALE_PLANE: byte strides of the scale plane's heads and tokens (see kv-spec)
    scale_sn,
    err_ptr,  # int32 [1]: slots past the cache are counted here (CHECK)
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    V_OFFSET: tl.constexpr,  # first C element of V
    SCALE_OFFSET: tl.constexpr,  # first C element of the inline scales (plane: its page offset)
    HAS_V: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    QMAX_RCP: tl.constexpr,  # RN(1 / QMAX) as a float32 value (per-token-head)
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    ROW_SPLIT: tl.constexpr,  # a row is tiled as [ROW_SPLIT, row / ROW_SPLIT] (see launch_config)
    CHECK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # see kv_kernels._common.row_align
    SCALE_WORD: tl.constexpr,  # bytes per scale store: 8 (K and V scales), 4 or 1 (see launcher)
    ROUND_DOWN: tl.constexpr = False,  # compiled builds: int8's rounding by libdevice (see _quantize)
    SCALE_PLANE: tl.constexpr = False,  # the scales sit in each page's plane, not in the rows
):
    R: tl.constexpr = BLOCK_T * BLOCK_H
    # row i of the tile is head (i % BLOCK_H) of token (i // BLOCK_H)
    rows = tl.arange(0, R)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + (rows // BLOCK_H)  # [R] int64
    heads = tl.program_id(1) * BLOCK_H + rows % BLOCK_H  # [R]
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1)  # [R] int64
    live = (slot >= 0) & (slot < num_slots)
    if CHECK:
        # a slot past the cache is never written; counted once per token (its first head row)
        # (tl.where rather than `&`: the interpreter mistypes a scalar-bool & vector-bool)
        first = tl.where(tl.program_id(1) == 0, rows % BLOCK_H == 0, False)
        tl.atomic_add(err_ptr + rows * 0, 1, mask=(slot >= num_slots) & first)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    head_in = (tok_ok & (heads < NUM_HEADS))[None, :, None]  # rows that exist in key/value
    row_ok = live & (heads < NUM_HEADS)  # rows that are written
    heads64 = heads.to(tl.int64)
    # int64 offset of (block, head, offset, 0) for each row of the tile
    row = block * cache_sb + offset * cache_sn + heads64 * cache_sh  # [R]
    if ROW_ALIGN > 1:
        # rows whose strides Triton cannot see as 16-aligned (per-token-head: 2 * 128 + 8 bytes)
        # are still written in ROW_ALIGN-element vectors, not byte by byte
        row = tl.multiple_of(row, ROW_ALIGN)
    row3 = row[None, :, None]
    k_row = (tok * key_st + heads64 * key_sh)[None, :, None]

    # Tiles are [SPLIT, R, BLOCK / SPLIT]: element (c, i, e) is column c * BLOCK / SPLIT + e of row
    # i. Loads are masked by shape only, not by the slot, so they issue without waiting for the
    # slot load; stores carry the slot mask.
    SPLIT_K: tl.constexpr = ROW_SPLIT if ROW_SPLIT < BLOCK_D else BLOCK_D
    dk = (
        tl.arange(0, SPLIT_K)[:, None, None] * (BLOCK_D // SPLIT_K)
        + tl.arange(0, BLOCK_D // SPLIT_K)[None, None, :]
    )  # [SPLIT_K, 1, BLOCK_D / SPLIT_K]
    k_in = head_in & (dk < HEAD_SIZE)
    k_mask = row_ok[None, :, None] & (dk < HEAD_SIZE)
    k_src = key_ptr + k_row + dk * key_sd
    k_dst = cache_ptr + row3 + dk.to(tl.int64) * cache_sc
    if HAS_V:
        SPLIT_V: tl.constexpr = ROW_SPLIT if ROW_SPLIT < BLOCK_DV else BLOCK_DV
        dv = (
            tl.arange(0, SPLIT_V)[:, None, None] * (BLOCK_DV // SPLIT_V)
            + tl.arange(0, BLOCK_DV // SPLIT_V)[None, None, :]
        )
        v_in = head_in & (dv < HEAD_SIZE_V)
        v_mask = row_ok[None, :, None] & (dv < HEAD_SIZE_V)
        v_src = value_ptr + (tok * value_st + heads64 * value_sh)[None, :, None] + dv * value_sd
        v_dst = cache_ptr + row3 + (V_OFFSET + dv).to(tl.int64) * cache_sc

    if QUANT == 0:
        k = tl.load(k_src, mask=k_in, other=0.0)
        tl.store(k_dst, k.to(cache_ptr.dtype.element_ty), mask=k_mask)
        if HAS_V:
            v = tl.load(v_src, mask=v_in, other=0.0)
            tl.store(v_dst, v.to(cache_ptr.dtype.element_ty), mask=v_mask)
    else:
        k = tl.load(k_src, mask=k_in, other=0.0).to(tl.float32)
        v = k  # (no V: unused stand-ins, so every path has the same names)
        if HAS_V:
            v = tl.load(v_src, mask=v_in, other=0.0).to(tl.float32)
        # ---- row scales: given (per tensor / head) or absmax / qmax (per token-head) ----------
        if QUANT == 1:
            ks = tl.load(k_scale_ptr + heads * k_scale_sh, mask=heads < NUM_HEADS, other=1.0)
            ok = (ks >= 5.421010862427522e-20) & (ks <= 1.8446744073709552e19)  # 2**+-64
            vs = ks
            if HAS_V:
                vs = tl.load(v_scale_ptr + heads * v_scale_sh, mask=heads < NUM_HEADS, other=1.0)
                ok = ok & (vs >= 5.421010862427522e-20) & (vs <= 1.8446744073709552e19)
            k_amax = ks  # (given scales: no absmax)
            v_amax = vs
        else:
            k_amax = tl.max(tl.max(tl.abs(k), axis=2), axis=0)  # [R]
            ks, ok = _row_scale(k_amax, QMAX, QMAX_RCP)
            v_amax = k_amax
            vs = ks
            if HAS_V:
                v_amax = tl.max(tl.max(tl.abs(v), axis=2), axis=0)
                vs, v_ok = _row_scale(v_amax, QMAX, QMAX_RCP)
                ok = ok & v_ok
        # ---- the reciprocal path when every scale of the tile is in range (NaN is not) --------
        if tl.min(ok.to(tl.int32), axis=0) > 0:
            kq = _quantize(k, ks, QUANT, QMAX, True, ROUND_DOWN)
            if HAS_V:
                vq = _quantize(v, vs, QUANT, QMAX, True, ROUND_DOWN)
        else:
            kq, vq, ks, vs = _quantize_rn(k, v, ks, vs, k_amax, v_amax, QUANT, QMAX, HAS_V)
        tl.store(k_dst, kq.to(cache_ptr.dtype.element_ty), mask=k_mask)
        if HAS_V:
            tl.store(v_dst, vq.to(cache_ptr.dtype.element_ty), mask=v_mask)

        # ---- inline float32 scales: K's 4 bytes, then V's (little-endian, as torch lays them) ---
        if QUANT >= 2:
            # the word paths' scale area is contiguous (C stride 1, checked by the launcher)
            s_row = row
            if SCALE_PLANE:  # (block, head, token) of the page's [H, N, scales] plane
                s_row = block * cache_sb + heads64 * scale_sh + offset * scale_sn
                s_row = tl.multiple_of(s_row, 8 if HAS_V else 4)  # (the token stride: the scales)
            s_base = cache_bytes_ptr + s_row + SCALE_OFFSET  # [R]
            k_bits = ks.to(tl.uint32, bitcast=True)
            if SCALE_WORD == 8:
                # both scales in one aligned 8-byte store (the launcher proved the alignment)
                v_bits = vs.to(tl.uint32, bitcast=True)
                word = k_bits.to(tl.uint64) | (v_bits.to(tl.uint64) << 32)
                tl.store(s_base.to(tl.pointer_type(tl.uint64)), word, mask=row_ok)
            elif SCALE_WORD == 4:
                tl.store(s_base.to(tl.pointer_type(tl.uint32)), k_bits, mask=row_ok)
                if HAS_V:
                    v_bits = vs.to(tl.uint32, bitcast=True)
                    tl.store((s_base + 4).to(tl.pointer_type(tl.uint32)), v_bits, mask=row_ok)
            else:
                NUM_SCALE_BYTES: tl.constexpr = 8 if HAS_V else 4
                j = tl.arange(0, NUM_SCALE_BYTES)  # byte index within the scale area
                kb = k_bits.to(tl.int32, bitcast=True)
                if HAS_V:
                    vb = vs.to(tl.int32, bitcast=True)
                    bits = tl.where((j < 4)[None, :], kb[:, None], vb[:, None])
                else:
                    bits = tl.broadcast_to(kb[:, None], (R, NUM_SCALE_BYTES))
                byte = (bits >> ((j % 4) * 8)[None, :]) & 0xFF  # [R, NUM_SCALE_BYTES]
                s_off = (SCALE_OFFSET + j[None, :]).to(tl.int64) * cache_sc
                tl.store(
                    cache_bytes_ptr + s_row[:, None] + s_off,
                    byte.to(tl.uint8),
                    mask=row_ok[:, None],
                )


class WriteConfig(NamedTuple):
    """Launch parameters of the write kernel (``launch_config`` picks them; benchmarks sweep them)."""

    block_t: int  # tokens per program
    block_h: int  # heads per program (power of two)
    block_d: int  # K row tile (next power of two of head_size)
    block_dv: int  # V row tile
    num_warps: int
    row_split: int = 1  # a row is tiled [row_split, row / row_split]: chunks one thread holds


def launch_config(layout: KVCacheLayout, element_bytes: int) -> WriteConfig:
    """The :class:`WriteConfig` for ``layout``'s head sizes and cache element bytes.

    Unquantized: one token per program, ``BLOCK_H`` whole rows up to :data:`_MAX_TILE` elements,
    ``num_warps`` giving each thread one to two 16-byte vectors of the widest tile (4 warps for 8
    heads x 128 of bf16). Quantized (bound by instruction issue, see the module notes): ``BLOCK_T``
    tokens so that a program converts :data:`_QUANT_TILE` elements per tensor,
    :data:`_QUANT_PER_THREAD` per thread (8 heads x 128: 2 tokens, 4 warps per tensor, 2 warps
    per token and head). Per-token-head rows are split in 2: a row is a ``[2, 64]`` tile, so a
    thread holds two 8-element vectors of the same row (8 threads span 64 columns) and the row's
    absmax, scale and reciprocal are paid once per 16 elements instead of per 8 (the warps then
    lie along the rows: the absmax stays a shuffle reduction inside a warp).
    """
    block_d = triton.next_power_of_2(layout.head_size)
    block_dv = triton.next_power_of_2(max(layout.head_size_v, 1))
    widest = max(block_d, block_dv)
    block_h = max(1, min(triton.next_power_of_2(layout.num_kv_heads), _MAX_TILE // widest))
    if layout.kv_quant is KVQuantMode.NONE:
        tile_bytes = block_h * widest * element_bytes
        num_warps = max(1, min(8, tile_bytes // (32 * 16)))
        num_warps = 1 << (num_warps.bit_length() - 1)  # power of two
        return WriteConfig(1, block_h, block_d, block_dv, num_warps)
    block_t = max(1, _QUANT_TILE // (block_h * widest))
    elements = block_t * block_h * widest
    per_token_head = layout.kv_quant is not KVQuantMode.FP8_PER_TENSOR
    per_thread = _QUANT_PER_THREAD["token_head" if per_token_head else "tensor"]
    num_warps = max(1, min(8, elements // (32 * per_thread)))
    num_warps = 1 << (num_warps.bit_length() - 1)
    row_split = 2 if per_token_head and min(block_d, block_dv) >= 32 else 1
    return WriteConfig(block_t, block_h, block_d, block_dv, num_warps, row_split)


def _launch_config(layout: KVCacheLayout, element_bytes: int) -> WriteConfig:
    """:func:`launch_config`, memoized (a pure function the write paid ~3 us a call for); keyed
    by the function too, so the benchmark's sweep that patches it in this module is seen."""
    key = (launch_config, layout, element_bytes)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if len(_CONFIGS) >= 256:
            _CONFIGS.clear()
        cfg = _CONFIGS[key] = launch_config(layout, element_bytes)
    return cfg


_CONFIGS: dict[tuple[object, ...], WriteConfig] = {}


@functools.lru_cache(maxsize=8)
def _reciprocal_f32(qmax: float) -> float:
    """``RN(1 / qmax)`` in float32 (a float32 division, not a rounded float64 one)."""
    one = torch.ones((), dtype=torch.float32)
    return float(one / torch.tensor(qmax, dtype=torch.float32))


def scale_word(layout: KVCacheLayout, kv_cache: torch.Tensor) -> int:
    """Bytes per inline-scale store the kernel may use: 8 (K's and V's scale in one store) or 4
    when every scale area is that aligned in memory (base address, block/head/token strides and
    the scale offset) and contiguous (C stride 1); else 1 (bytes). 0 without per-token-head
    scales (:func:`kv_kernels.cache.scale_geometry`: inline or in a plane)."""
    if not layout.num_scales:
        return 0
    if kv_cache.element_size() != 1 or kv_cache.stride(3) != 1:
        return 1
    geometry = scale_geometry(kv_cache, layout)  # (start, head stride, token stride)
    assert geometry is not None
    align = math.gcd(kv_cache.data_ptr(), kv_cache.stride(0), *geometry)
    if layout.num_scales == 2 and align % 8 == 0:
        return 8
    return 4 if align % 4 == 0 else 1


def reshape_and_cache_triton(
    key: torch.Tensor,  # [T', H, head_size]
    value: torch.Tensor | None,  # [T', H, head_size_v]; None for MLA
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view (any strides)
    slot_mapping: torch.Tensor,  # [T] int64
    layout: KVCacheLayout,
    k_scale: torch.Tensor | None,  # float32, 1 or H elements, on the cache's device
    v_scale: torch.Tensor | None,
    error_flag: torch.Tensor | None = None,  # int32 [1]
    plan_slot: Any = None,  # the api's validated call (kv_kernels._call_cache.Entry)
) -> None:
    """Launch the write; inputs are assumed validated by the api (one launch, no host sync).
    ``plan_slot``: keeps the launch plan of calls alike in everything but addresses."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    plan = plan_slot.plan if plan_slot is not None else None
    if plan is None or plan.config_fn is not launch_config:
        plan = _write_plan(key, value, kv_cache, slot_mapping, layout, k_scale, v_scale, error_flag)
        if plan_slot is not None:
            plan_slot.plan = plan
    # 1-byte caches get a uint8 alias for the scale bytes (same strides); others never use it.
    cache_bytes = kv_cache.view(torch.uint8) if plan.byte_view else kv_cache
    args = (
        key,
        value if value is not None else key,
        kv_cache,
        cache_bytes,
        slot_mapping,
        k_scale if k_scale is not None else slot_mapping,  # never read without quant
        v_scale if v_scale is not None else slot_mapping,
        *plan.scalars,
        error_flag if error_flag is not None else slot_mapping,
    )
    _WRITE(plan.key, plan.grid, args, plan.kwargs)


class _WritePlan(NamedTuple):
    """What a write decides from shapes, strides, dtypes, alignments and the layout (not from
    addresses): the grid, the scalar arguments, the constexprs and the launch key."""

    grid: tuple[int, int]
    scalars: tuple[int, ...]  # the arguments between the scale pointers and the error flag
    kwargs: dict[str, Any]
    key: Any
    byte_view: bool  # the cache's uint8 alias is a view (1-byte caches)
    config_fn: Any  # launch_config when planned (a benchmark's sweep patches it)


def _write_plan(
    key: torch.Tensor,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    error_flag: torch.Tensor | None,
) -> _WritePlan:
    num_tokens = slot_mapping.numel()
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    cfg = _launch_config(layout, kv_cache.element_size())
    has_v = value is not None
    value_arg = value if value is not None else key
    byte_view = kv_cache.element_size() == 1
    cache_bytes = kv_cache.view(torch.uint8) if byte_view else kv_cache
    k_scale_arg = k_scale if k_scale is not None else slot_mapping
    v_scale_arg = v_scale if v_scale is not None else slot_mapping
    quant = _QUANT_CODE[layout.kv_quant]
    qmax = 0.0
    if quant != _QUANT_NONE:
        qmax = 127.0 if kv_cache.dtype == torch.int8 else float(torch.finfo(kv_cache.dtype).max)
    v_offset = layout.v_range[0] if layout.v_range is not None else 0
    geometry = scale_geometry(kv_cache, layout)  # (start, head, token stride) bytes, or None
    # (ceil division in Python: triton.cdiv is a jit function, ~1 us a call on the host)
    grid = (-(-num_tokens // cfg.block_t), -(-num_heads // cfg.block_h))
    err = error_flag if error_flag is not None else slot_mapping
    scalars = (
        num_tokens,
        num_blocks * block_size,
        *key.stride(),
        *value_arg.stride(),
        *kv_cache.stride(),
        0 if k_scale is None or k_scale.numel() == 1 else 1,
        0 if v_scale is None or v_scale.numel() == 1 else 1,
        *(geometry[1:] if geometry is not None else (0, 0)),  # (read with a plane only)
    )
    kwargs = dict(
        NUM_HEADS=num_heads,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=layout.head_size,
        HEAD_SIZE_V=max(layout.head_size_v, 1),
        V_OFFSET=v_offset,
        SCALE_OFFSET=geometry[0] if geometry is not None else 0,
        HAS_V=has_v,
        QUANT=quant,
        QMAX=qmax,
        QMAX_RCP=_reciprocal_f32(qmax) if quant >= _QUANT_INT8_TOKEN_HEAD else 0.0,
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h,
        BLOCK_D=cfg.block_d,
        BLOCK_DV=cfg.block_dv,
        ROW_SPLIT=cfg.row_split,
        CHECK=error_flag is not None,
        ROW_ALIGN=row_align(kv_cache.stride()[:3]),
        SCALE_WORD=scale_word(layout, kv_cache),
        ROUND_DOWN=not triton_interpreting(),
        SCALE_PLANE=layout.scale_plane,
        num_warps=cfg.num_warps,
    )
    # Triton specializes on these (kv_kernels._launch): the constexprs and options, dtypes and
    # 16-byte alignment of the tensors, the strides and scale strides by value; the token and
    # slot counts only by width (do_not_specialize: i32 or i64). A plan is kept only for calls
    # alike in all of them (kv_kernels._call_cache: shapes, strides, dtypes, alignment).
    tensors = (key, value_arg, kv_cache, cache_bytes, slot_mapping, k_scale_arg, v_scale_arg, err)
    launch_key = (
        tuple(kwargs.values()), tuple(t.dtype for t in tensors), align_bits(*tensors),
        scalars[2:16], num_tokens >> 31, scalars[1] >> 31,
    )  # fmt: skip
    return _WritePlan(grid, scalars, kwargs, launch_key, byte_view, launch_config)


#: the write's bound launches (kv_kernels._launch)
_WRITE = FastLauncher(_reshape_and_cache_kernel)
