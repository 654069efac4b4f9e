"""Triton cache write: one program per (token, chunk of heads), K and V rows moved as 2-D tiles.

Performance notes. The op is a pure scatter of ``T * H * (head_size + head_size_v)`` elements, so
it is bound by HBM bandwidth: each program moves ``BLOCK_H`` whole head rows of K and of V (about
4 KiB of bf16 each for 8 heads x 128), every thread issues 16-byte vector loads/stores (the row
dim has stride 1, which Triton specializes, and strides divisible by 16 give it the alignment),
and ``num_warps`` is sized so that each thread holds one to two 16-byte vectors per tensor. The slot
is read once per program; K/V loads do not wait for it (padding tokens, ``slot < 0``, are read
but not written: they are rare, and a load that depends on the slot would add one full memory
latency to every program). All cache offsets are int64: the program id and the slot are int64 before they meet a
stride, so caches past 2**31 elements are addressed correctly.

Per-token-head quantization reduces each head row to its absmax in registers (the row is already
there), writes the quantized row and the float32 scale's 4 bytes through a uint8 alias of the same
cache (byte stores: the scale sits at any byte offset, so a float32 store could be misaligned).
Division is ``div_rn`` (IEEE round to nearest) so the GPU agrees bit for bit with torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kv_spec import KVCacheLayout, KVQuantMode

from kv_kernels._common import row_align

__all__ = ["reshape_and_cache_triton"]

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


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T', H, HEAD_SIZE]
    value_ptr,  # [T', H, HEAD_SIZE_V] (unused when not HAS_V)
    cache_ptr,  # [B, H, N, C] in the cache dtype
    cache_bytes_ptr,  # the same memory as uint8 (1-byte caches; inline scales go through it)
    slot_ptr,  # [T] int64
    k_scale_ptr,  # float32, 1 or H elements (FP8_PER_TENSOR)
    v_scale_ptr,
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
    err_ptr,  # int32 [1]: slots past the cache are counted here (CHECK)
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    V_OFFSET: tl.constexpr,  # first C element of V
    SCALE_OFFSET: tl.constexpr,  # first C element of the inline scales
    HAS_V: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CHECK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # see kv_kernels._common.row_align
):
    tok = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)
    if CHECK:
        # a slot past the cache is never written; counted once per token (head chunk 0)
        tl.atomic_add(err_ptr, 1, mask=(slot >= num_slots) & (tl.program_id(1) == 0))
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = head0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    # (tl.where rather than `live & ...`: the interpreter mistypes a scalar-bool & vector-bool)
    head_ok = tl.where(live, heads < NUM_HEADS, False)
    heads64 = heads.to(tl.int64)
    # int64 offset of (block, head, offset, 0) for each head of the tile
    row = block * cache_sb + offset * cache_sn + heads64 * cache_sh  # [BLOCK_H]
    if ROW_ALIGN > 1:
        # rows whose strides Triton cannot see as 16-aligned (per-token-head: 2 * 128 + 8 bytes)
        # are still written in ROW_ALIGN-element vectors, not byte by byte
        row = tl.multiple_of(row, ROW_ALIGN)

    # ---- K ---------------------------------------------------------------------------------
    # Loads are masked by shape only, not by the slot, so they issue without waiting for the slot
    # load (row tok < T <= T' always exists); stores carry the slot mask.
    dk = tl.arange(0, BLOCK_D)
    k_in = (heads < NUM_HEADS)[:, None] & (dk < HEAD_SIZE)[None, :]
    k_mask = head_ok[:, None] & (dk < HEAD_SIZE)[None, :]
    k_src = key_ptr + tok * key_st + heads64[:, None] * key_sh + dk[None, :] * key_sd
    k = tl.load(k_src, mask=k_in, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    k_dst = cache_ptr + row[:, None] + dk[None, :].to(tl.int64) * cache_sc
    if QUANT == 0:
        tl.store(k_dst, k.to(cache_ptr.dtype.element_ty), mask=k_mask)
    elif QUANT == 1:
        ks = tl.load(k_scale_ptr + heads * k_scale_sh, mask=head_ok, other=1.0)  # [BLOCK_H]
        kq = tl.math.div_rn(k, ks[:, None])
        kq = tl.minimum(tl.maximum(kq, -QMAX), QMAX)
        tl.store(k_dst, kq.to(cache_ptr.dtype.element_ty), mask=k_mask)
    else:
        k_amax = tl.max(tl.abs(k), axis=1)  # [BLOCK_H]
        k_row_scale = tl.where(k_amax > 0, tl.math.div_rn(k_amax, QMAX), 1.0)
        kq = tl.math.div_rn(k, k_row_scale[:, None])
        if QUANT == 2:
            kq = tl.floor(kq + 0.5)
        kq = tl.minimum(tl.maximum(kq, -QMAX), QMAX)
        tl.store(k_dst, kq.to(cache_ptr.dtype.element_ty), mask=k_mask)

    # ---- V ---------------------------------------------------------------------------------
    if HAS_V:
        dv = tl.arange(0, BLOCK_DV)
        v_in = (heads < NUM_HEADS)[:, None] & (dv < HEAD_SIZE_V)[None, :]
        v_mask = head_ok[:, None] & (dv < HEAD_SIZE_V)[None, :]
        v_src = value_ptr + tok * value_st + heads64[:, None] * value_sh + dv[None, :] * value_sd
        v = tl.load(v_src, mask=v_in, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_DV]
        v_dst = cache_ptr + row[:, None] + (V_OFFSET + dv[None, :]).to(tl.int64) * cache_sc
        if QUANT == 0:
            tl.store(v_dst, v.to(cache_ptr.dtype.element_ty), mask=v_mask)
        elif QUANT == 1:
            vs = tl.load(v_scale_ptr + heads * v_scale_sh, mask=head_ok, other=1.0)
            vq = tl.math.div_rn(v, vs[:, None])
            vq = tl.minimum(tl.maximum(vq, -QMAX), QMAX)
            tl.store(v_dst, vq.to(cache_ptr.dtype.element_ty), mask=v_mask)
        else:
            v_amax = tl.max(tl.abs(v), axis=1)
            v_row_scale = tl.where(v_amax > 0, tl.math.div_rn(v_amax, QMAX), 1.0)
            vq = tl.math.div_rn(v, v_row_scale[:, None])
            if QUANT == 2:
                vq = tl.floor(vq + 0.5)
            vq = tl.minimum(tl.maximum(vq, -QMAX), QMAX)
            tl.store(v_dst, vq.to(cache_ptr.dtype.element_ty), mask=v_mask)

    # ---- inline float32 scales: K's 4 bytes, then V's (little-endian, as torch lays them) -------
    if QUANT >= 2:
        NUM_SCALE_BYTES: tl.constexpr = 8 if HAS_V else 4
        j = tl.arange(0, NUM_SCALE_BYTES)  # byte index within the scale area
        k_bits = k_row_scale.to(tl.int32, bitcast=True)  # [BLOCK_H]
        if HAS_V:
            v_bits = v_row_scale.to(tl.int32, bitcast=True)
            bits = tl.where((j < 4)[None, :], k_bits[:, None], v_bits[:, None])
        else:
            bits = tl.broadcast_to(k_bits[:, None], (BLOCK_H, NUM_SCALE_BYTES))
        byte = (bits >> ((j % 4) * 8)[None, :]) & 0xFF  # [BLOCK_H, NUM_SCALE_BYTES]
        s_dst = cache_bytes_ptr + row[:, None] + (SCALE_OFFSET + j[None, :]).to(tl.int64) * cache_sc
        tl.store(s_dst, byte.to(tl.uint8), mask=head_ok[:, None])


def launch_config(layout: KVCacheLayout, element_bytes: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, BLOCK_D, BLOCK_DV, num_warps)`` for ``layout``'s head sizes.

    A tile holds ``BLOCK_H`` whole rows, up to :data:`_MAX_TILE` elements; ``num_warps`` gives each
    thread one to two 16-byte vectors of the widest tile (4 warps for 8 heads x 128 of bf16).
    """
    block_d = triton.next_power_of_2(layout.head_size)
    block_dv = triton.next_power_of_2(max(layout.head_size_v, 1))
    widest = max(block_d, block_dv)
    block_h = max(1, min(triton.next_power_of_2(layout.num_kv_heads), _MAX_TILE // widest))
    tile_bytes = block_h * widest * element_bytes
    num_warps = max(1, min(8, tile_bytes // (32 * 16)))
    num_warps = 1 << (num_warps.bit_length() - 1)  # power of two
    return block_h, block_d, block_dv, num_warps


def reshape_and_cache_triton(
    key: torch.Tensor,  # [T', H, head_size]
    value: torch.Tensor | None,  # [T', H, head_size_v]; None for MLA
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view (any strides)
    slot_mapping: torch.Tensor,  # [T] int64
    layout: KVCacheLayout,
    k_scale: torch.Tensor | None,  # float32, 1 or H elements, on the cache's device
    v_scale: torch.Tensor | None,
    error_flag: torch.Tensor | None = None,  # int32 [1]
) -> None:
    """Launch the write; inputs are assumed validated by the api (one launch, no host sync)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    block_h, block_d, block_dv, num_warps = launch_config(layout, kv_cache.element_size())
    has_v = value is not None
    value_arg = value if value is not None else key
    # 1-byte caches get a uint8 alias for the scale bytes (same strides); others never use it.
    cache_bytes = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
    k_scale_arg = k_scale if k_scale is not None else slot_mapping  # never read without quant
    v_scale_arg = v_scale if v_scale is not None else slot_mapping
    quant = _QUANT_CODE[layout.kv_quant]
    qmax = 0.0
    if quant != _QUANT_NONE:
        qmax = 127.0 if kv_cache.dtype == torch.int8 else float(torch.finfo(kv_cache.dtype).max)
    v_offset = layout.v_range[0] if layout.v_range is not None else 0
    scale_offset = layout.scale_range[0] if layout.scale_range is not None else 0
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key,
        value_arg,
        kv_cache,
        cache_bytes,
        slot_mapping,
        k_scale_arg,
        v_scale_arg,
        num_blocks * block_size,
        *key.stride(),
        *value_arg.stride(),
        *kv_cache.stride(),
        0 if k_scale is None or k_scale.numel() == 1 else 1,
        0 if v_scale is None or v_scale.numel() == 1 else 1,
        error_flag if error_flag is not None else slot_mapping,
        NUM_HEADS=num_heads,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=layout.head_size,
        HEAD_SIZE_V=max(layout.head_size_v, 1),
        V_OFFSET=v_offset,
        SCALE_OFFSET=scale_offset,
        HAS_V=has_v,
        QUANT=quant,
        QMAX=qmax,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        CHECK=error_flag is not None,
        ROW_ALIGN=row_align(kv_cache.stride()[:3]),
        num_warps=num_warps,
    )
