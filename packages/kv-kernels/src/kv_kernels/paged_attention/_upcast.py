"""Upcasts of 1-byte KV tiles (fp8 / int8 pages) for the paged-attention kernel's MMAs, and the
per-row fp16 query they meet (``KV_UPCAST``, see :mod:`._kernels`).

Why. Left to itself, Triton moves a tile's upcast after the layout conversion into the MMA
operand (8 bits through shared memory are cheaper than 16), and on sm_90 (triton 3.6 and 3.9) an
8-bit K^T operand is then read from shared memory one byte at a time, and fp8 widens to bf16
element by element through f16. Upcasting here, in the layout the tile was loaded in, by packed
PTX conversions that Triton treats as opaque (``is_pure=False``: it cannot move the layout
conversion above them), leaves a 16-bit tile that reaches the MMA through shared memory in
16-byte stores and ``ldmatrix``. The conversions emit only the exact integer / fp8 -> fp16
widenings; fp16 holds every int8, e4m3 and e5m2 value exactly.

Operands read as bytes (``K_DIRECT`` / ``V_DIRECT``, :func:`upcast_tile` with ``IN_OPERAND``).
The fp16 round trip costs shared-memory traffic: per 64-token tile of K and of V, 8 KiB of bytes
read, 16 KiB of fp16 stored and 16 KiB read back by ``ldmatrix`` (ncu, H100: the fp8 decode was
bound by shared memory, L1/TEX 83%). A conversion Triton *may* move (``is_pure=True``) lets it
read the byte tile straight in the MMA operand's layout and convert there, in registers: both
operands of an fp16 MMA whose origin is 8-bit take ``kWidth=4`` (four consecutive k values a
thread), which for bytes is one 32-bit word, so K^T (head dim, its k, contiguous in memory) is
read by ``ldmatrix`` on byte pairs, 8 KiB a tile and no fp16 copy (sm_90 PTX, triton 3.6 and
3.9). V's k is the token, 128 bytes apart: read as it is, a thread's four tokens are four bytes
of four rows (``ld.shared.u8``, 64 a thread). :func:`v_operand` renames V's columns so that the
four output columns a thread accumulates are four adjacent bytes of a row: each word read is
then four columns of one token, and a 4 x 4 byte transpose (``prmt``) in registers gives the
thread its four tokens of each column; the accumulator comes out with its columns renamed the
same way, and :func:`restore_columns` puts them back once, after the KV loop. The words of one
read come from four token rows of the same banks (the byte buffer is not swizzled): 4-way bank
conflicts, still fewer wavefronts than the 40 KiB round trip.

The interpreter cannot run inline PTX: with ``PTX`` off the same tiles convert by ``.to`` (same
values, Triton's own placement), which is what the interpreter tests run; the column renaming of
``V_DIRECT`` runs there as well.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["f16_rows", "restore_columns", "upcast_tile", "v_operand"]


# Packed 1-byte -> fp16 conversions: 4 bytes of a register in ($2), two f16x2 registers out
# ($0: bytes 0-1, $1: bytes 2-3, low half first).
#: e4m3: the hardware's pairwise conversion
_E4M3_ASM = tl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
    "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)
#: e5m2: a byte is the high byte of the f16 of the same value: [0, b0, 0, b1], [0, b2, 0, b3]
_E5M2_ASM = tl.constexpr("prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;")
#: int8: x ^ 0x80 is x + 128 as an unsigned byte u; the f16 with bits 0x64uu is 1024 + u exactly
#: (ulp 1 in [1024, 2048)); less 1152 (0x6480) gives x. 2 PRMT + 2 HSUB2 + 1 LOP3 per 4 values.
_I8_ASM = tl.constexpr(
    "{ .reg .b32 u, a, b, c; xor.b32 u, $2, 0x80808080; "
    "prmt.b32 a, u, 0x64646464, 0x5140; prmt.b32 b, u, 0x64646464, 0x5342; "
    "mov.b32 c, 0x64806480; sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }"
)


@triton.jit
def _packed_to_f16(x, ASM: tl.constexpr, PURE: tl.constexpr):
    # PURE off: opaque to Triton, so the conversion into the MMA operand stays after it; on:
    # Triton may move that conversion above it, onto the byte tile (see IN_OPERAND)
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def _pin_layout(x):
    # a register move Triton cannot see through (ptxas removes it): keeps the layout conversion
    # into the MMA operand after the upcast before it
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2
    )


@triton.jit
def upcast_tile(x, DST: tl.constexpr, PTX: tl.constexpr, IN_OPERAND: tl.constexpr = False):
    """``x`` (any tile) as ``DST``; with ``PTX``, a 1-byte ``x`` converts by the packed PTX above
    (fp16 from int8 / e4m3 / e5m2; other pairs by ``.to``): in its own layout (pinned there), or
    with ``IN_OPERAND`` where Triton puts it, i.e. in the MMA operand's layout after the byte
    tile is read from shared memory in that layout (see the module docstring)."""
    if PTX and x.dtype.primitive_bitwidth == 8:
        # (fp8 handed over as its bytes: the asm reads registers, not fp8 values)
        if DST.is_fp16() and x.dtype.is_fp8e4nv():
            return _packed_to_f16(x.to(tl.uint8, bitcast=True), _E4M3_ASM, IN_OPERAND)
        if DST.is_fp16() and x.dtype.is_fp8e5():
            return _packed_to_f16(x.to(tl.uint8, bitcast=True), _E5M2_ASM, IN_OPERAND)
        if DST.is_fp16() and x.dtype.is_int8():
            return _packed_to_f16(x, _I8_ASM, IN_OPERAND)
        if IN_OPERAND:
            return x.to(DST)
        return _pin_layout(x.to(DST))
    return x.to(DST)


@triton.jit
def v_operand(v, TILE_N: tl.constexpr, DV_PAD: tl.constexpr):
    """V ``[TILE_N, DV_PAD]`` with its columns renamed for :data:`V_DIRECT` reads: column
    ``32 r + 8 w + g`` is V's ``32 w + 4 g + r`` (``g < 8``, ``w, r < 4``; ``DV_PAD = 128``).

    Why that order: in the P.V MMA (16 rows, 4 warps along the columns) lane group ``g`` of warp
    ``w`` accumulates columns ``g + 8 w + 32 r`` for ``r < 4``; renamed, those are the 4 adjacent
    bytes ``32 w + 4 g + r`` of each token, one 32-bit shared load. Any order is exact (the
    accumulator's columns follow it, :func:`restore_columns` undoes it); others are slower."""
    v = v.reshape(TILE_N, DV_PAD // 32, 8, 4)  # [tok, w, g, r] by V's own column 32w + 4g + r
    return v.permute(0, 3, 1, 2).reshape(TILE_N, DV_PAD)  # [tok, r, w, g]


@triton.jit
def restore_columns(acc, BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr):
    """The accumulator ``[BLOCK_M, DV_PAD]`` of P.V over :func:`v_operand`'s V, in V's own column
    order (once, after the KV loop)."""
    acc = acc.reshape(BLOCK_M, 4, DV_PAD // 32, 8)  # [m, r, w, g]
    return acc.permute(0, 2, 3, 1).reshape(BLOCK_M, DV_PAD)  # [m, w, g, r]


@triton.jit
def f16_rows(q, q2, D_TAIL: tl.constexpr):
    """The query rows ``[M, D]`` (and tail ``[M, D_TAIL]``) as fp16, each scaled by the power of
    two that puts its largest magnitude in ``[2^14, 2^15)``, and ``[M]`` the inverse scales.

    A bf16 row has 8 significant bits, fp16 11: scaled this way every element within 2^-28 of
    its row's maximum converts exactly (smaller ones add less than 2^-28 of the row's largest
    product to a logit), and nothing overflows fp16 (65504) whatever the bf16 range. The scale
    is built from the exponent bits (exact, no ``exp2``); an all-zero row keeps scale 1-ish.
    """
    a = tl.max(tl.abs(q.to(tl.float32)), 1)
    if D_TAIL > 0:
        a = tl.maximum(a, tl.max(tl.abs(q2.to(tl.float32)), 1))
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent: a in [2^(e-127), 2^(e-126))
    e = tl.minimum(tl.maximum(e, 15), 254)
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(141 - e)
    down = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2^(e - 141)
    q16 = (q.to(tl.float32) * up[:, None]).to(tl.float16)
    q2_16 = q16
    if D_TAIL > 0:
        q2_16 = (q2.to(tl.float32) * up[:, None]).to(tl.float16)
    return q16, q2_16, down
