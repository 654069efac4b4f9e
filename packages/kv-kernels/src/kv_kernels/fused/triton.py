"""Triton kernels of the fused elementwise ops and their launchers (one launch per call).

Every kernel loads in the tensor's dtype and upcasts right after the load: the arithmetic is
float32 on every path (the interpreter computes bf16 arithmetic wrongly, and the GPU would round
each step otherwise). Token offsets are int64 (``tok * stride`` past 2**31 elements on long
prefills of wide rows); column offsets stay int32 (a row is at most a few thousand elements).

Why these are worth a kernel each (per layer of a decode step; bytes at Llama-3-8B's shape are
in ``benchmarks/bench_fused.py``): torch's residual add + RMSNorm is two to six launches and reads
the residual stream two or three times; SiLU-and-mul is two launches and writes the gate's
activation only to read it back; RoPE as ``x * cos + rotate_half(x) * sin`` is four to seven
launches per tensor. Each fused kernel reads its inputs once and writes its outputs once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kv_kernels._launch import FastLauncher, align_bits, int_class
from kv_kernels.fused._configs import (
    NormConfig,
    RopeConfig,
    _row_strides,
    norm_config,
    rope_config,
)

__all__ = [
    "NormConfig",
    "RopeConfig",
    "act_and_mul_triton",
    "norm_config",
    "rms_norm_triton",
    "rope_and_cache_triton",
    "rope_config",
    "rotary_embedding_triton",
]

#: Largest row the norm kernel holds in registers at once (elements): 32768 (a 16-warp program
#: keeps 64 float32 per thread per live value). Wider rows raise in the api.
MAX_NORM_WIDTH = 32768
#: Columns of one activation program (a row of the MLP's intermediate is split over programs).
_ACT_BLOCK = 1024


# ---- RMSNorm (+ residual add) -------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    num_rows,
    rows_per_token,  # 3-D inputs [T, H, D]: row r is head r % H of token r // H (1 for 2-D)
    x_st,
    x_sh,
    res_st,
    res_sh,
    y_st,
    y_sh,
    h_st,
    h_sh,
    w_sh,  # per-head gains [H, D]: the head stride (0 for one [D] gain)
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,  # multiply the gain in float32 before rounding (Gemma, gpt-oss)
    WEIGHT_OFFSET: tl.constexpr,  # Gemma's gain is 1 + weight
    PER_HEAD_WEIGHT: tl.constexpr = False,  # weight [H, D]: Qwen3's q and k norms in one call
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R] int64
    tok = rows // rows_per_token
    head = rows % rows_per_token
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < D)[None, :]  # [R, BLOCK_D]
    x = tl.load(x_ptr + (tok * x_st + head * x_sh)[:, None] + cols[None, :], mask=mask, other=0.0)
    hf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(
            res_ptr + (tok * res_st + head * res_sh)[:, None] + cols[None, :], mask=mask, other=0.0
        )
        # the residual stream is stored in the input dtype; the norm reads the rounded sum, as
        # the unfused `h = x + residual; norm(h)` does
        h = (hf + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + (tok * h_st + head * h_sh)[:, None] + cols[None, :], h, mask=mask)
        hf = h.to(tl.float32)
    mean_sq = tl.sum(hf * hf, axis=1) / D  # [R]
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    normed = hf * rstd[:, None]
    if PER_HEAD_WEIGHT:
        gain = tl.load(w_ptr + (head * w_sh)[:, None] + cols[None, :], mask=mask, other=0.0)
    else:
        gain = tl.load(w_ptr + cols, mask=cols < D, other=0.0)[None, :]
    gain = gain.to(tl.float32) + WEIGHT_OFFSET
    if WEIGHT_FIRST:
        y = normed * gain
    else:
        y = normed.to(y_ptr.dtype.element_ty).to(tl.float32) * gain
    tl.store(
        y_ptr + (tok * y_st + head * y_sh)[:, None] + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


def rms_norm_triton(
    x: torch.Tensor,  # [T, D] or [T, H, D], unit last stride
    weight: torch.Tensor,  # [D], or [H, D] for 3-D x; unit last stride
    eps: float,
    residual: torch.Tensor | None,  # like x
    y: torch.Tensor,  # like x: the output
    h: torch.Tensor | None,  # like x: x + residual (with a residual)
    weight_offset: float,
    weight_first: bool,
    plan_slot: Any = None,  # the api's validated call (kv_kernels._call_cache.Entry)
) -> None:
    """Launch the norm; inputs are assumed validated by the api (one launch, no host sync).
    ``plan_slot``: keeps the launch plan of calls alike in everything but addresses."""
    plan = plan_slot.plan if plan_slot is not None else None
    if plan is not None:
        res, hh = residual if residual is not None else x, h if h is not None else y
        _NORM(plan.key, plan.grid, (x, res, weight, y, hh, *plan.scalars), plan.kwargs)
        return
    width = x.shape[-1]
    rows_per_token = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * rows_per_token
    if num_rows == 0:
        return
    cfg = norm_config(width)
    res = residual if residual is not None else x
    hh = h if h is not None else y
    grid = (-(-num_rows // cfg.block_r),)  # (triton.cdiv is a jit function: ~1 us on the host)
    args = (
        x, res, weight, y, hh,
        num_rows, rows_per_token,
        *_row_strides(x), *_row_strides(res), *_row_strides(y), *_row_strides(hh),
        weight.stride(0) if weight.dim() == 2 else 0,
        float(eps),
    )  # fmt: skip
    kwargs = dict(
        D=width,
        BLOCK_D=cfg.block_d,
        BLOCK_R=cfg.block_r,
        HAS_RESIDUAL=residual is not None,
        WEIGHT_FIRST=weight_first,
        WEIGHT_OFFSET=float(weight_offset),
        PER_HEAD_WEIGHT=weight.dim() == 2,
        num_warps=cfg.num_warps,
    )
    # (kv_kernels._launch: constexprs, dtypes and alignment, the row count's class, the strides)
    tensors = (x, res, weight, y, hh)
    key = (
        tuple(kwargs.values()), tuple(t.dtype for t in tensors), align_bits(*tensors),
        int_class(num_rows), args[6:16],
    )  # fmt: skip
    _keep(plan_slot, grid, args[5:], kwargs, key)
    _NORM(key, grid, args, kwargs)


# ---- SiLU / GELU-tanh and mul --------------------------------------------------------------------


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_st,
    out_st,
    D: tl.constexpr,  # output columns (the input row is 2 * D)
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,  # 0: silu, 1: gelu (tanh approximation)
):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = x_ptr + tok * x_st
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + D + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        # x * sigmoid(x); for x -> -inf exp(-x) overflows to inf and the quotient is -0, not NaN
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits +-1 where exp overflows or underflows
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    tl.store(out_ptr + tok * out_st + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul_triton(x: torch.Tensor, out: torch.Tensor, act: str, plan_slot: Any = None) -> None:
    """``out[t] = act(x[t, :d]) * x[t, d:]`` for 2-D ``x`` ``[T, 2d]`` and ``out`` ``[T, d]`` (unit
    last strides); ``act`` is ``"silu"`` or ``"gelu_tanh"``. ``plan_slot``: as the norm's."""
    plan = plan_slot.plan if plan_slot is not None else None
    if plan is not None:
        _ACT(plan.key, plan.grid, (x, out, *plan.scalars), plan.kwargs)
        return
    num_tokens, d = out.shape
    if num_tokens == 0 or d == 0:
        return
    block = min(_ACT_BLOCK, triton.next_power_of_2(d))
    # 4 warps for a full 1024-column block of gate + up: 8 elements of each per thread
    num_warps = max(1, min(4, block // 256))
    grid = (num_tokens, -(-d // block))
    args = (x, out, x.stride(0), out.stride(0))
    kwargs = dict(D=d, BLOCK=block, ACT=0 if act == "silu" else 1, num_warps=num_warps)
    key = (d, block, kwargs["ACT"], num_warps, x.dtype, out.dtype, align_bits(x, out), args[2:])
    _keep(plan_slot, grid, args[2:], kwargs, key)
    _ACT(key, grid, args, kwargs)


# ---- rotary embedding ----------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    base,  # this token's row of q or k
    s_h,
    num_heads,
    cos,  # [1, BLOCK_HALF] float32
    sin,
    ok,  # scalar: the position is inside the cache
    IS_NEOX: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    i = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]: pair index
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        row = base + heads.to(tl.int64) * s_h
        if IS_NEOX:
            # pair i is (column i, column i + HALF): two contiguous half-rows
            mask = (heads < num_heads) & (i < HALF)
            x1 = tl.load(row + i, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + i + HALF, mask=mask, other=0.0).to(tl.float32)
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            # (tl.where rather than `&`: the interpreter mistypes a scalar-bool & tensor-bool)
            write = tl.where(ok, mask, False)
            tl.store(row + i, o1.to(base.dtype.element_ty), mask=write)
            tl.store(row + i + HALF, o2.to(base.dtype.element_ty), mask=write)
        else:
            # pair i is (column 2i, column 2i + 1): the rotated columns are read as one
            # contiguous row and split in registers, so the loads and stores stay vectors
            # (two stride-2 loads would move one element at a time)
            c = tl.arange(0, 2 * BLOCK_HALF)[None, :]  # [1, 2 * BLOCK_HALF]
            mask = (heads < num_heads) & (c < 2 * HALF)
            x = tl.load(row + c, mask=mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            o = tl.reshape(tl.join(o1, o2), (BLOCK_H, 2 * BLOCK_HALF))
            write = tl.where(ok, mask, False)
            tl.store(row + c, o.to(base.dtype.element_ty), mask=write)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cs_ptr,
    err_ptr,
    num_q_heads,
    num_k_heads,
    max_pos,
    q_st,
    q_sh,
    k_st,
    k_sh,
    cs_st,
    HALF: tl.constexpr,  # rotary_dim / 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_K: tl.constexpr,
    CHECK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    ok = (pos >= 0) & (pos < max_pos)
    if CHECK:
        tl.atomic_add(err_ptr, 1, mask=pos >= max_pos)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cs_row = cs_ptr + tl.where(ok, pos, 0) * cs_st  # a bad position reads row 0, writes nothing
    cos = tl.load(cs_row + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + tok * q_st, q_sh, num_q_heads, cos, sin, ok,
        IS_NEOX, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    if HAS_K:
        _rotate_heads(
            k_ptr + tok * k_st, k_sh, num_k_heads, cos, sin, ok,
            IS_NEOX, HALF, BLOCK_HK, BLOCK_HALF,
        )  # fmt: skip


def rotary_embedding_triton(
    positions: torch.Tensor,  # [T] int32 / int64
    q: torch.Tensor,  # [T', Hq, D], unit last stride
    k: torch.Tensor | None,  # [T', Hk, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim], unit last stride
    is_neox: bool,
    rotary_dim: int,
    error_flag: torch.Tensor | None,
    plan_slot: Any = None,  # (as the norm's)
) -> None:
    """One launch, one program per token rotating all its q heads, then its k heads."""
    plan = plan_slot.plan if plan_slot is not None else None
    if plan is not None:
        err = error_flag if error_flag is not None else positions
        tensors = (positions, q, k if k is not None else q, cos_sin_cache, err)
        _ROPE(plan.key, plan.grid, (*tensors, *plan.scalars), plan.kwargs)
        return
    num_tokens = positions.numel()
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    k_arg = k if k is not None else q
    cfg = rope_config(q.shape[1], 0 if k is None else k.shape[1], block_half, is_neox)
    block_hq, block_hk, num_warps = cfg
    args = (
        positions, q, k_arg, cos_sin_cache,
        error_flag if error_flag is not None else positions,
        q.shape[1], k_arg.shape[1], cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), k_arg.stride(0), k_arg.stride(1), cos_sin_cache.stride(0),
    )  # fmt: skip
    kwargs = dict(
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        IS_NEOX=is_neox,
        HAS_K=k is not None,
        CHECK=error_flag is not None,
        num_warps=num_warps,
    )
    tensors = (positions, q, k_arg, cos_sin_cache, args[4])
    key = (
        tuple(kwargs.values()), tuple(t.dtype for t in tensors), align_bits(*tensors), args[5:],
    )  # fmt: skip
    _keep(plan_slot, (num_tokens,), args[5:], kwargs, key)
    _ROPE(key, (num_tokens,), args, kwargs)


# ---- RoPE fused into the cache write -------------------------------------------------------------


@triton.jit
def _rotate_k_into_cache(
    k_row,  # [BLOCK_HK, 1] pointers: this token's k heads
    cache_row,  # [BLOCK_HK, 1] pointers: their cache rows at the token's slot
    cos,  # [1, BLOCK_HALF] float32
    sin,
    ok,  # scalar: the position is inside the table (else K goes to the cache unrotated)
    live,  # scalar: the slot is inside the cache (else nothing is written there)
    head_ok,  # [BLOCK_HK, 1]
    cache_sc,
    IS_NEOX: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """The rotated columns by the same halves / even-odd split as :func:`_rotate_heads` (so the
    bits are those of ``rotary_embedding``), stored to k and to the cache row; then the
    unrotated tail (partial rotary) to the cache. Every access is a contiguous run of a row."""
    # (tl.where rather than `&`: the interpreter mistypes a scalar-bool & tensor-bool)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if IS_NEOX:
        mask = head_ok & (i < HALF)
        x1 = tl.load(k_row + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_row + i + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = tl.where(ok, x1 * cos - x2 * sin, x1).to(k_row.dtype.element_ty)
        o2 = tl.where(ok, x2 * cos + x1 * sin, x2).to(k_row.dtype.element_ty)
        tl.store(k_row + i, o1, mask=tl.where(ok, mask, False))
        tl.store(k_row + i + HALF, o2, mask=tl.where(ok, mask, False))
        to_cache = tl.where(live, mask, False)
        tl.store(
            cache_row + i.to(tl.int64) * cache_sc, o1.to(cache_row.dtype.element_ty), mask=to_cache
        )
        tl.store(
            cache_row + (i + HALF).to(tl.int64) * cache_sc,
            o2.to(cache_row.dtype.element_ty),
            mask=to_cache,
        )
    else:
        c = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        mask = head_ok & (c < 2 * HALF)
        x = tl.load(k_row + c, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_HK, BLOCK_HALF, 2)))
        o = tl.reshape(
            tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), (BLOCK_HK, 2 * BLOCK_HALF)
        )
        o = tl.where(ok, o, x).to(k_row.dtype.element_ty)
        tl.store(k_row + c, o, mask=tl.where(ok, mask, False))
        tl.store(
            cache_row + c.to(tl.int64) * cache_sc,
            o.to(cache_row.dtype.element_ty),
            mask=tl.where(live, mask, False),
        )
    if 2 * HALF < HEAD_SIZE:
        t = 2 * HALF + tl.arange(0, BLOCK_TAIL)[None, :]
        mask = head_ok & (t < HEAD_SIZE)
        tail = tl.load(k_row + t, mask=mask, other=0.0)
        tl.store(
            cache_row + t.to(tl.int64) * cache_sc,
            tail.to(cache_row.dtype.element_ty),
            mask=tl.where(live, mask, False),
        )


@triton.jit
def _rope_and_cache_kernel(
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cs_ptr,
    cache_ptr,
    err_ptr,
    num_q_heads,
    max_pos,
    num_slots,
    q_st,
    q_sh,
    k_st,
    k_sh,
    v_st,
    v_sh,
    cs_st,
    cache_sb,
    cache_sh,
    cache_sn,
    cache_sc,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    V_OFFSET: tl.constexpr,  # first C element of V in a cache row
    HALF: tl.constexpr,  # rotary_dim / 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,  # next power of two of NUM_KV_HEADS
    BLOCK_TAIL: tl.constexpr,  # next power of two of HEAD_SIZE - rotary_dim (1 if none)
    BLOCK_DV: tl.constexpr,
    IS_NEOX: tl.constexpr,
    CHECK: tl.constexpr,
):
    """One token: rotate its q heads in place; rotate its k heads (in place too) and write them
    with its v heads into the cache at its slot."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    ok = (pos >= 0) & (pos < max_pos)
    slot = tl.load(slot_ptr + tok)
    live = (slot >= 0) & (slot < num_slots)
    if CHECK:
        tl.atomic_add(err_ptr, 1, mask=(pos >= max_pos) | (slot >= num_slots))
    cs_row = cs_ptr + tl.where(ok, pos, 0) * cs_st
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cs_row + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + tok * q_st, q_sh, num_q_heads, cos, sin, ok,
        IS_NEOX, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip

    heads = tl.arange(0, BLOCK_HK)[:, None]  # [BLOCK_HK, 1]
    heads64 = heads.to(tl.int64)
    head_ok = heads < NUM_KV_HEADS
    k_row = k_ptr + tok * k_st + heads64 * k_sh
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    row = cache_ptr + block * cache_sb + offset * cache_sn + heads64 * cache_sh  # [BLOCK_HK, 1]
    _rotate_k_into_cache(
        k_row, row, cos, sin, ok, live, head_ok, cache_sc,
        IS_NEOX, HALF, BLOCK_HALF, HEAD_SIZE, BLOCK_HK, BLOCK_TAIL,
    )  # fmt: skip
    cv = tl.arange(0, BLOCK_DV)[None, :]
    v_mask = (heads < NUM_KV_HEADS) & (cv < HEAD_SIZE_V)
    v = tl.load(v_ptr + tok * v_st + heads64 * v_sh + cv, mask=v_mask, other=0.0)
    tl.store(
        row + (V_OFFSET + cv).to(tl.int64) * cache_sc,
        v.to(cache_ptr.dtype.element_ty),
        mask=tl.where(live, v_mask, False),
    )


def rope_and_cache_triton(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T', Hq, D]
    key: torch.Tensor,  # [T', Hk, D]
    value: torch.Tensor,  # [T', Hk, Dv]
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]
    kv_cache: torch.Tensor,  # [B, Hk, N, C] layer view, unquantized
    slot_mapping: torch.Tensor,  # [T] int64
    v_offset: int,
    is_neox: bool,
    rotary_dim: int,
    error_flag: torch.Tensor | None,
    plan_slot: Any = None,  # (as the norm's)
) -> None:
    """One launch, one program per token (validated by the api)."""
    plan = plan_slot.plan if plan_slot is not None else None
    if plan is not None:
        err = error_flag if error_flag is not None else slot_mapping
        tensors = (positions, slot_mapping, q, key, value, cos_sin_cache, kv_cache, err)
        _ROPE_CACHE(plan.key, plan.grid, (*tensors, *plan.scalars), plan.kwargs)
        return
    num_tokens = positions.numel()
    if num_tokens == 0:
        return
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    cfg = rope_config(q.shape[1], num_kv_heads, block_half, is_neox, all_k=True)
    block_tail = triton.next_power_of_2(max(1, key.shape[2] - rotary_dim))
    block_dv = triton.next_power_of_2(value.shape[2])
    args = (
        positions, slot_mapping, q, key, value, cos_sin_cache, kv_cache,
        error_flag if error_flag is not None else slot_mapping,
        q.shape[1], cos_sin_cache.shape[0], num_blocks * block_size,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0), *kv_cache.stride(),
    )  # fmt: skip
    kwargs = dict(
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=key.shape[2],
        HEAD_SIZE_V=value.shape[2],
        V_OFFSET=v_offset,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HQ=cfg.block_hq,
        BLOCK_HK=cfg.block_hk,
        BLOCK_TAIL=block_tail,
        BLOCK_DV=block_dv,
        IS_NEOX=is_neox,
        CHECK=error_flag is not None,
        num_warps=cfg.num_warps,
    )
    err = error_flag if error_flag is not None else slot_mapping
    tensors = (positions, slot_mapping, q, key, value, cos_sin_cache, kv_cache, err)
    launch_key = (
        tuple(kwargs.values()), tuple(t.dtype for t in tensors), align_bits(*tensors), args[8:],
    )  # fmt: skip
    _keep(plan_slot, (num_tokens,), args[8:], kwargs, launch_key)
    _ROPE_CACHE(launch_key, (num_tokens,), args, kwargs)


class _Plan(NamedTuple):
    """A launch's decisions from shapes, strides, dtypes, alignments and options (not from
    addresses): kept per validated api call (kv_kernels._call_cache), which keys on all of them."""

    grid: tuple[int, ...]
    scalars: tuple[Any, ...]  # the arguments after the tensors
    kwargs: dict[str, Any]
    key: Any  # the FastLauncher key


def _keep(
    slot: Any, grid: tuple[int, ...], scalars: tuple[Any, ...], kwargs: Any, key: Any
) -> None:
    if slot is not None:
        slot.plan = _Plan(grid, scalars, kwargs, key)


#: bound launches of the four kernels (kv_kernels._launch)
_NORM = FastLauncher(_rms_norm_kernel)
_ACT = FastLauncher(_act_and_mul_kernel)
_ROPE = FastLauncher(_rotary_kernel)
_ROPE_CACHE = FastLauncher(_rope_and_cache_kernel)
