"""The skinny GEMM's Triton kernels and launcher: ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)``.

One CTA owns ``BLOCK_N`` rows of ``W`` (``BLOCK_N`` output features) for ``BLOCK_M`` tokens and
one ``SPLIT_K`` slice of ``K``, and computes ``acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T``: the
weight rows are the MMA's M side, so a tile of 64 rows fills an sm_90 warpgroup MMA while the
token side can be as small as 16 (the "swap AB" trick of skinny GEMMs). W is read once per M
tile: CTAs of one weight tile are launched next to each other (the M tile is the fastest grid
axis), so a second M tile reads W from L2.

Split K: each slice writes float32 partials ``ws[s, M, N]``; :func:`_splitk_reduce_kernel` sums
the slices in a fixed order, adds the bias and rounds once. Deterministic (no atomics: the same
bits every run and whatever order CTAs run in) and CUDA-graph safe (the workspace comes from
torch's caching allocator, which a graph capture serves from its private pool). The partials
cost ``2 * SPLIT_K * M * N * 4`` bytes (written then read, mostly in L2): 4% of W's bytes for
Llama's o_proj at M 64, split 4.

Addressing: every row offset is int64 (``offs.to(tl.int64) * stride``); loads of rows past M
or N read row ``r % M`` / ``r % N`` (in bounds, their results masked at the store) so the
hot loop carries no N mask; K's tail is masked only when a slice is ragged (``EVEN_K``).
Nothing is read outside x / W / bias or written outside out (and the workspace).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kv_kernels._launch import FastLauncher, align_bits, int_class
from kv_kernels.gemm.configs import GemmConfig

__all__ = ["launch_skinny_linear", "split_geometry"]


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid % num_m
    rest = pid // num_m
    pid_n = rest % num_n
    pid_k = rest // num_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past the ends load a valid row (wrapped) and are masked at the store
    rows_m = (offs_m % M).to(tl.int64)
    rows_n = (offs_n % N).to(tl.int64)
    k_start = pid_k * K_PER_SPLIT
    offs_k = tl.arange(0, BLOCK_K)
    cols = (k_start + offs_k).to(tl.int64)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + cols[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows_m[None, :] * stride_xm + cols[:, None] * stride_xk  # [BLOCK_K, BLOCK_M]
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_ok = (k_start + k + offs_k) < k_end
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(w, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk

    store_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if SPLIT:
        # partials: ws[pid_k, m, n], contiguous [SPLIT_K, M, N] float32
        base = pid_k.to(tl.int64) * M * N
        ws_ptrs = ws_ptr + base + offs_m.to(tl.int64)[None, :] * N + offs_n.to(tl.int64)[:, None]
        tl.store(ws_ptrs, acc, mask=store_mask)
    else:
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows_n).to(tl.float32)
            acc += bias[:, None]
        y_ptrs = (
            y_ptr
            + offs_m.to(tl.int64)[None, :] * stride_ym
            + offs_n.to(tl.int64)[:, None] * stride_yn
        )
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, b_ptr, y_ptr, M, N, stride_ym, stride_yn,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """``y = sum_s ws[s] (+ bias)``, the slices summed in order 0..SPLIT_K-1 (deterministic)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows = offs_m.to(tl.int64)[:, None]
    cols = offs_n.to(tl.int64)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # row m of slice s is row s * M + m of ws
        acc += tl.load(ws_ptr + (rows + s * M) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = (
        y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
    )
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_GEMM = FastLauncher(_skinny_gemm_kernel)
_REDUCE = FastLauncher(_splitk_reduce_kernel)
_REDUCE_BLOCK_M, _REDUCE_BLOCK_N = 16, 256


def split_geometry(k: int, cfg: GemmConfig) -> tuple[int, bool]:
    """``(k_per_split, even_k)``: each of ``cfg.split_k`` slices covers ``k_per_split`` columns
    (a multiple of ``block_k``; the last slice may be shorter, or empty when ``split_k`` is
    large for ``k``: it then writes zero partials); ``even_k`` when every slice is full."""
    per = -(-k // cfg.split_k)
    per = -(-per // cfg.block_k) * cfg.block_k
    return per, per * cfg.split_k == k


def launch_skinny_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N], x's dtype
    cfg: GemmConfig,
) -> torch.Tensor:
    """Launch the kernel(s) for validated inputs (``kv_kernels.gemm.api`` checks them)."""
    m, k = x.shape
    n = weight.shape[0]
    per, even_k = split_geometry(k, cfg)
    split = cfg.split_k > 1
    ieee = x.dtype == torch.float32
    ws = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    b = bias if bias is not None else weight  # (never read without HAS_BIAS)
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n) * cfg.split_k,)
    args = (
        x, weight, b, out, ws, m, n, k, per,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1),
    )  # fmt: skip
    consts = {
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SPLIT": split,
        "HAS_BIAS": bias is not None, "EVEN_K": even_k, "IEEE": ieee,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
    }  # fmt: skip
    key = (
        cfg, x.dtype, weight.dtype, out.dtype, None if bias is None else bias.dtype, even_k,
        align_bits(x, weight, b, out, ws),
        *(int_class(v) for v in args[5:]),
    )  # fmt: skip
    _GEMM(key, grid, args, consts)
    if split:
        rgrid = (-(-m // _REDUCE_BLOCK_M), -(-n // _REDUCE_BLOCK_N))
        rargs: tuple[Any, ...] = (ws, b, out, m, n, out.stride(0), out.stride(1))
        rconsts = {
            "SPLIT_K": cfg.split_k, "BLOCK_M": _REDUCE_BLOCK_M, "BLOCK_N": _REDUCE_BLOCK_N,
            "HAS_BIAS": bias is not None, "num_warps": 4,
        }  # fmt: skip
        rkey = (
            cfg.split_k, out.dtype, None if bias is None else bias.dtype,
            align_bits(ws, b, out), *(int_class(v) for v in rargs[3:]),
        )  # fmt: skip
        _REDUCE(rkey, rgrid, rargs, rconsts)
    return out
