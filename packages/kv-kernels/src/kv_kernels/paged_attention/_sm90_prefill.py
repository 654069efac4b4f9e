"""Paged prefill for Hopper (sm_90): when the warp-specialized Gluon kernel of
:mod:`._sm90_prefill_kernel` serves a launch's prefill class instead of the Triton kernel, its
launcher, TMA descriptors and ahead-of-time spec.

Why a second kernel. The Triton kernel (:mod:`._kernels`) reaches ~415 TFLOP/s at page 16 on an
H100 (FA4: 532-553): Triton 3.6 waits on each warpgroup MMA as soon as it is issued and keeps the
page gathers, the MMAs and the softmax of a program in one instruction stream. Gluon states the
schedule, as FlashAttention-3 does (a producer warpgroup filling rings of K / V tiles by
``cp.async`` gathers or, where pages hold whole tiles, TMA boxes; two consumer warpgroups
overlapping one tile's softmax with the next MMAs).

Scope (:func:`sm90_prefill_eligible`): 16-bit queries and cache of the same dtype, (K, V) head
sizes 64 / 64, 128 / 128 or DiffKV's 192 / 128, GQA groups 1-16, a positive scale, causal
or not, LSE; ALiBi, soft-cap, windows, sinks, quantized caches, KV splits, MLA and metadata
checks stay with the Triton kernel; ``KV_KERNELS_SM90_PREFILL=0`` sends every prefill back to
it. Gluon has no interpreter: the CPU suite compiles this kernel for sm_90, the GPU suite checks
it against the float64 oracle.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kv_kernels._common import require_unit_rows, sm90_gluon_allowed, tma_addressable
from kv_kernels.aot import aot_case_spec
from kv_kernels.paged_attention._launch_args import prefill_grid_q
from kv_kernels.paged_attention._sm90_prefill_kernel import sm90_prefill_kernel
from kv_kernels.paged_attention._tiles import split_head

__all__ = [
    "aot_case",
    "launch_sm90_prefill",
    "sm90_prefill_eligible",
    "sm90_prefill_kernel",
]

#: rows per consumer warpgroup (a warpgroup MMA's M), and the program's two consumers
WG_M = 64
BLOCK_M = 2 * WG_M
#: KV tile (tokens) and ring slots
TILE_N = 128
NBUF = 2


def _register_split() -> tuple[int, int]:
    """The producer's and each consumer's registers after ``setmaxnreg`` (``2 C + P <= 512``).

    Triton 3.6 (the GPU machine's; H100, 4 x 4096 causal, same process, best of three interleaved
    rounds): 120 / 192 reads head 128 468 / 475 and DiffKV 192/128 479 / 501 TFLOP/s at page 16 /
    128, against 453 / 468 and 454 / 475 at 80 / 216 (96 / 208, 104 / 200, 112 / 200 in between;
    128 / 192 418-462). Its sm_90 builds spill 0 bytes a thread at head 128 and 8 at DiffKV.
    Triton 3.9's consumer needs more: 120 / 192 spills 232 bytes a thread there and 80 / 216
    48-56, so later versions keep 80 / 216 (not measured on a GPU: the machine has 3.6)."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (120, 192) if (major, minor) <= (3, 6) else (80, 216)


P_REGS, C_REGS = _register_split()


#: (K, V) head sizes served: 192 / 128 is DiffKV's split head (128 + 64 columns of K)
_HEADS = ((64, 64), (128, 128), (192, 128))

#: the features the Gluon kernel does not implement (the Triton kernel serves them)
_UNSERVED = ("sliding_window", "sinks", "softcap", "alibi", "kv_scale_mode", "split", "check",
             "v_from_k", "scale_words")  # fmt: skip


def sm90_prefill_eligible(
    *,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_size: int,
    head_size_v: int,
    features: dict[str, Any],
    **common: Any,
) -> bool:
    """Whether :func:`launch_sm90_prefill` serves a prefill launch (else the Triton kernel):
    :func:`kv_kernels._common.sm90_gluon_allowed`'s conditions (``common``: its ``arch``,
    ``compiled``, ``group``, ``scale``, ``aligned_rows``;
    ``KV_KERNELS_SM90_PREFILL=0`` turns the kernel off), then this kernel's own: a cache of
    q's dtype and (K, V) head sizes in :data:`_HEADS`."""
    return (
        sm90_gluon_allowed(
            "prefill", q_dtype=q_dtype, features=features, unserved=_UNSERVED, **common
        )
        and cache_dtype == q_dtype
        and (head_size, head_size_v) in _HEADS
    )


def launch_sm90_prefill(
    q: torch.Tensor,  # [T, Hq, D], unit column stride
    kv_cache: torch.Tensor,  # [B, H, N, C], unit column stride
    *,
    k_start: int,
    v_start: int,
    block_table: torch.Tensor,  # [num_seqs, max_blocks], unit column stride
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    block_size: int,
    out: torch.Tensor,  # [T, Hq, D], unit column stride
    lse: torch.Tensor | None,  # [T, Hq] f32
    q_len_min: int,
    seq_lo: int = 0,
) -> None:
    """The prefill class (sequences with ``q_len >= q_len_min``, from ``seq_lo`` on: the ones
    before hold one query token each) of a paged 16-bit cache on sm_90 (inputs validated by the
    api; eligibility by :func:`sm90_prefill_eligible`)."""
    num_tokens, num_q_heads, head = q.shape
    num_kv_heads = kv_cache.shape[1]
    group = num_q_heads // num_kv_heads
    block_q = BLOCK_M // group
    num_seqs = block_table.shape[0]
    d_main, d_tail = split_head(head)
    require_unit_rows(
        "the sm_90 prefill kernel",
        {"q": q, "kv_cache": kv_cache, "out": out, "block_table": block_table},
    )
    lse_t = lse if lse is not None else out
    grid = (prefill_grid_q(num_tokens, num_seqs, block_q, seq_lo), num_kv_heads)
    if grid[0] <= 0:
        return
    descs = _tma_descriptors(kv_cache, block_size, d_main, d_tail)
    sm90_prefill_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table, block_table.stride(0), seq_lens, query_start_loc,
        out, out.stride(0), out.stride(1),
        lse_t, lse_t.stride(0), lse_t.stride(1),
        num_seqs, kv_cache.shape[0], block_table.shape[1], scale * 1.4426950408889634,
        q_len_min, 2**31 - 1, seq_lo, *(descs or (None, None)),
        D_MAIN=d_main, D_TAIL=d_tail, HEAD_V=out.shape[2], K_START=k_start, V_START=v_start,
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_Q=block_q, TILE_N=TILE_N, NBUF=NBUF,
        CAUSAL=causal, WRITE_LSE=lse is not None, P_WARPS=4, C_REGS=C_REGS,
        P_REGS=P_REGS, num_warps=4, USE_TMA=descs is not None,
    )  # fmt: skip


#: whole tiles of pages of ``TILE_N``-multiple tokens by TMA (tests turn it off to check the
#: gathers at those pages)
TMA_TILES = True
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _tma_layout(width: int, dtype: Any) -> Any:
    """The shared layout of a TMA box ``[1, 1, TILE_N, width]`` (the K / V tiles' own, as 4-d)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, TILE_N, width], dtype)


def _tma_descriptors(
    kv_cache: torch.Tensor, block_size: int, d_main: int, d_tail: int
) -> tuple[TensorDescriptor, TensorDescriptor | None] | None:
    """TMA descriptors of boxes ``[1, 1, TILE_N, width]`` over the cache ``[B, H, N, C]``: one
    ``d_main`` wide for K and V (V is as wide as K's main columns in every served head) and, for
    a split head, one for K's tail; ``None`` (the producer gathers every tile) unless the pages
    hold whole tiles and TMA can address the cache (a 16-byte aligned base and strides). Each
    descriptor is encoded again at every launch (host time: the bench's ``host_ms``), so there
    are as few as the heads need."""
    if not TMA_TILES or block_size % TILE_N or not tma_addressable(kv_cache):
        return None
    dtype = _GL_DTYPES[kv_cache.dtype]

    def box(width: int) -> TensorDescriptor:
        layout = _tma_layout(width, dtype)
        return TensorDescriptor.from_tensor(kv_cache, [1, 1, TILE_N, width], layout)

    return box(d_main), (box(d_tail) if d_tail else None)


def aot_case(
    *,
    dtype: str = "bf16",
    head: int = 128,
    head_v: int | None = None,
    group: int = 4,
    block_size: int = 16,
    causal: bool = True,
    write_lse: bool = False,
) -> dict[str, Any]:
    """The kernel as :func:`launch_sm90_prefill` launches it, for an ahead-of-time sm_90 build
    (``kv_kernels.aot.aot_compile`` keywords: ``kernel`` named in ``module``, ``signature``,
    ``constexprs``, ``num_warps``, ``divisible_by_16``: the pointers and strides a launch from
    contiguous tensors aligns)."""
    pointers = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "bt_ptr": "*i32",
                "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "out_ptr": f"*{dtype}",
                "lse_ptr": "*fp32"}  # fmt: skip
    d_main, d_tail = split_head(head)
    head_v = head_v or head
    tma = TMA_TILES and block_size % TILE_N == 0
    constexprs: dict[str, Any] = dict(
        D_MAIN=d_main, D_TAIL=d_tail, HEAD_V=head_v, K_START=0, V_START=head,
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_Q=BLOCK_M // group, TILE_N=TILE_N, NBUF=NBUF,
        CAUSAL=causal, WRITE_LSE=write_lse, P_WARPS=4, C_REGS=C_REGS,
        P_REGS=P_REGS, num_warps=4, USE_TMA=tma,
    )  # fmt: skip
    descriptors = {}
    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    for name, width in (("kv_desc", d_main), ("tail_desc", d_tail)):
        if tma and width:
            layout = _tma_layout(width, gl_dtype)
            descriptors[name] = f"tensordesc<{dtype}[1, 1, {TILE_N}, {width}],{layout!r}>"
        else:
            constexprs[name] = None
    strides = [n for n in sm90_prefill_kernel.arg_names if n.startswith("stride_")]
    return aot_case_spec(
        sm90_prefill_kernel, module=__name__, pointers=pointers, floats=("qk_scale_log2",),
        constexprs=constexprs, aligned_strides=[n for n in strides if n != "stride_lh"],
        descriptors=descriptors,
    )  # fmt: skip
