"""Paged decode over 1-byte pages for Hopper (sm_90): when the Gluon kernel of
:mod:`._sm90_decode_kernel` serves a launch's decode class instead of the Triton kernel, its split
count, launcher and ahead-of-time spec.

Scope (:func:`sm90_decode_eligible`): the decode class of a launch (``q_len <= 16 / group``)
with 16-bit queries, heads 128 / 128, GQA groups 1-16, a positive softmax scale, causal or not,
splits, LSE, rows of unit stride, over

- fp8 pages (e4m3 / e5m2) with no scale or a per-tensor / per-KV-head scale: everywhere on
  sm_90 (H200: 4.00 / 4.05 TB/s, 0.95 / 0.96 of its copy, against the Triton kernel's 0.77 /
  0.75; H100: 0.92-0.93, the Triton kernel's 0.91-0.93);
- int8 / fp8 pages with inline per-token-head scales (kv-spec's 264-byte rows): on cards whose
  memory peaks at :data:`INLINE_MIN_TBPS` or more (the H200: 0.67-0.68 of its copy against
  0.58-0.60; on an H100 this kernel read 0.74 where the Triton kernel reads 0.76-0.77);
- int8 / fp8 pages whose per-token-head scales sit in a scale plane (kv-spec ``scale_plane``,
  rows of 256 bytes): everywhere on sm_90 (H100 0.92, H200 0.94-0.95 of the copy, against the
  Triton kernel's 0.83-0.85 / 0.62-0.65).

ALiBi, soft-cap, windows, sinks, metadata checks, MLA and other head sizes stay with the Triton
kernel; ``KV_KERNELS_SM90_DECODE=0`` sends every decode back to it. Gluon has no interpreter: the
CPU suite compiles the kernel for sm_90 and checks its PTX; the GPU suite checks it against the
float64 oracle.

Parallelism comes from KV splits (flash-decoding): programs are one warp, the split count fills
one wave of :data:`PROGRAMS_PER_SM` programs an SM (:func:`pick_decode_splits`), and the partial
outputs go through the Triton kernel's merge.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kv_kernels._common import require_unit_rows, sm90_gluon_allowed
from kv_kernels._launch import FastLauncher
from kv_kernels.aot import aot_case_spec
from kv_kernels.paged_attention._sm90_decode_kernel import HEAD, ROWS, TILE_N, sm90_decode_kernel
from kv_kernels.paged_attention._tiles import pick_num_splits

__all__ = [
    "aot_case",
    "launch_sm90_decode",
    "peak_memory_tbps",
    "pick_decode_splits",
    "sm90_decode_eligible",
    "sm90_decode_kernel",
]

#: one-warp programs resident an SM: ncu (H200) gives 8 for both page kinds (182-212 registers a
#: thread: two warps a scheduler's register file), so one wave is 8 x the SM count. (The 64 x 4k
#: and 8 x 32k split counts measured best, 2 and 16, are the ones this picks; 12 picked them too.)
PROGRAMS_PER_SM = 8
#: Per-token-head pages go to this kernel only on cards whose memory peaks at this many TB/s or
#: more. Same process, graph-timed, 64 x 4k / 8 x 32k: H200 (4.9 TB/s peak) int8 2.85 / 2.89
#: TB/s against the Triton kernel's 2.54 / 2.46, fp8 2.87 vs 2.48; H100 (3.35 TB/s) int8 2.21 /
#: 2.23 vs 2.33 / 2.28, fp8 2.22 vs 2.31 (ncu, H200: L1/TEX 88% busy, DRAM 50%: the 8-byte
#: copies of the 264-byte rows go through L1)
INLINE_MIN_TBPS = 4.0
#: Pages whose scales sit in a scale plane (kv-spec ``scale_plane``: K and V rows of 256 bytes)
#: go to this kernel on every sm_90 card: H200, same process, 0.94-0.95 of the copy against the
#: Triton kernel's 0.62-0.65 (``paged_attention_h200_pth_plane_s12.*``).
#: tiles in flight: a ring of NBUF shared-memory slots filled by cp.async (a sweep on the H200,
#: its output only; fp8 per tensor, 64 x 4k at the best split count of each: plain loads into
#: registers, each tile waited for where it is used, 2.83 TB/s; NBUF 2 3.96, 3 3.87, 4 3.49)
NBUF = 2


#: the features the Gluon decode does not implement (the Triton kernel serves them)
_UNSERVED = ("sliding_window", "sinks", "softcap", "alibi", "check", "v_from_k")


def sm90_decode_eligible(
    *,
    cache_dtype: torch.dtype,
    head_size: int,
    head_size_v: int,
    group: int,
    block_q: int,
    features: dict[str, Any],
    peak_tbps: float = 0.0,
    **common: Any,
) -> bool:
    """Whether :func:`launch_sm90_decode` serves a launch's decode class (else the Triton kernel):
    :func:`kv_kernels._common.sm90_gluon_allowed`'s conditions (``common``: its ``arch``,
    ``compiled``, ``q_dtype``, ``scale``, ``aligned_rows``; ``KV_KERNELS_SM90_DECODE=0`` turns
    the kernel off), then this kernel's own: heads 128 / 128; ``block_q``, the decode class's
    query tokens a sequence (the Triton decode config's), filling its 16 rows (``block_q *
    group == 16``); K and V starting on 16-byte boundaries in the row; and the pages
    :func:`_pages_served` says, where ``peak_tbps`` (:func:`peak_memory_tbps`) decides
    per-token-head pages."""
    return (
        sm90_gluon_allowed("decode", group=group, features=features, unserved=_UNSERVED, **common)
        and head_size == head_size_v == HEAD.value
        and block_q * group == ROWS.value
        and features.get("k_start", 0) % 16 == 0
        and features.get("v_start", 0) % 16 == 0
        and _pages_served(cache_dtype, features, peak_tbps)
    )


def _pages_served(cache_dtype: torch.dtype, features: dict[str, Any], peak_tbps: float) -> bool:
    """fp8 pages with no scale or per-tensor / per-KV-head scales (modes 0-2), and int8 / fp8
    pages with inline per-token-head scales (mode 3) whose rows the host proved 8-byte aligned
    (``row_align`` 8, or 1: every stride a multiple of 16) on a card whose memory peaks at
    :data:`INLINE_MIN_TBPS` or more (see there), or with the scales in a scale plane
    (``features["scale_plane"]``) on any card."""
    mode = features.get("kv_scale_mode", 0)
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if mode == 3:
        # (a scale plane's 256-byte rows: on every sm_90 card, see INLINE_MIN_TBPS)
        return (
            (fp8 or cache_dtype == torch.int8)
            and features.get("row_align", 1) in (1, 8)
            and (peak_tbps >= INLINE_MIN_TBPS or bool(features.get("scale_plane")))
        )
    return fp8 and mode in (0, 1, 2)


@functools.lru_cache(maxsize=16)
def peak_memory_tbps(index: int) -> float:
    """The CUDA device's peak memory bandwidth (TB/s) from its properties (double data rate x
    bus width), 0 where torch does not report them. A property of the card, not of a batch, so a
    choice made on it keeps results batch-invariant."""
    props = torch.cuda.get_device_properties(index)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e12


def pick_decode_splits(*, num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits for a decode batch: the most (a power of two, at most 64) whose one-warp
    programs still fit one wave of ``PROGRAMS_PER_SM`` an SM, each split keeping at least 8
    tiles of 32 tokens. (A split sweep on the H200, fp8 per tensor, graph-timed, its output only:
    64 x 4k read 3.96 TB/s at 2 splits, one wave of 1,024 programs, and 3.26 at 4; 8 x 32k 4.01
    at 16 and 3.30 at 32.)"""
    return pick_num_splits(
        num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len,
        tile_n=TILE_N.value, num_sms=num_sms, waves=1, programs_per_sm=PROGRAMS_PER_SM,
        min_tiles=8,
    )  # fmt: skip


def launch_sm90_decode(
    q: torch.Tensor,  # [T, Hq, 128], unit column stride
    kv_cache: torch.Tensor,  # [B, H, N, C] fp8 / int8, unit column stride
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
    scale_rows: tuple[int, int, int] | None,  # per-token-head scales: (start, head, token) bytes
    row_align: int,  # kv_kernels._common.row_align of the cache's strides
    out: torch.Tensor,  # [T, Hq, 128]
    lse: torch.Tensor | None,  # [T, Hq] f32
    part_out: torch.Tensor,  # [T, Hq, S, 128] f32 (``out`` when S = 1)
    part_lse: torch.Tensor,  # [T, Hq, S] f32
    num_splits: int,
    key: Any = None,  # the launch's key (paged_attention_triton): a bound launch
    launches: list[Any] | None = None,  # given: append the launch (._bound.Launch), run nothing
) -> None:
    """The decode class of a launch over a 1-byte cache on sm_90 (inputs validated by the api;
    eligibility by :func:`sm90_decode_eligible`; the caller merges the splits)."""
    num_q_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[1]
    require_unit_rows(
        "the sm_90 decode kernel",
        {"q": q, "kv_cache": kv_cache, "out": out, "block_table": block_table},
    )
    lse_t = lse if lse is not None else out
    grid = (block_table.shape[0], num_kv_heads, num_splits)
    args = (
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        *(scale_rows[1:] if scale_rows else (kv_cache.stride(1), kv_cache.stride(2))),
        block_table, block_table.stride(0), seq_lens, query_start_loc,
        *scale_args,
        out, out.stride(0), out.stride(1),
        lse_t, lse_t.stride(0), lse_t.stride(1),
        part_out, part_lse,
        num_q_heads, kv_cache.shape[0], block_table.shape[1], scale * 1.4426950408889634,
    )  # fmt: skip
    kwargs = dict(
        K_START=k_start, V_START=v_start, SCALE_START=scale_rows[0] if scale_rows else 0,
        BLOCK_SIZE=block_size, ROW_ALIGN=row_align,
        GROUP=num_q_heads // num_kv_heads, KV_SCALE=kv_scale_mode, CAUSAL=causal,
        SPLIT=num_splits > 1, WRITE_LSE=lse is not None, NBUF_=NBUF, num_warps=1,
    )  # fmt: skip
    if launches is not None:
        from kv_kernels.paged_attention._bound import Launch

        launches.append(Launch(_FAST, key, grid, args, kwargs))
    elif key is not None:
        _FAST(key, grid, args, kwargs)
    else:
        sm90_decode_kernel[grid](*args, **kwargs)


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
    scale_plane: bool = False,
) -> dict[str, Any]:
    """The kernel as :func:`launch_sm90_decode` launches it, for an ahead-of-time sm_90 build
    (``kv_kernels.aot.aot_compile`` keywords, as :func:`._sm90_prefill.aot_case`);
    ``scale_plane`` (``kv_scale=3``): the scales in each page's plane, rows of 256 bytes."""
    pointers = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{cache}", "bt_ptr": "*i32",
                "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "k_scale_ptr": "*fp32",
                "v_scale_ptr": "*fp32", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}  # fmt: skip
    inline = kv_scale == 3 and not scale_plane  # per token and head: 264-byte rows, 8-aligned
    # (a plane's offset: block_size tokens x 8 heads x 256 bytes of data before it)
    start = 2 * HEAD.value if inline else block_size * 8 * 2 * HEAD.value if scale_plane else 0
    constexprs = dict(
        K_START=0, V_START=HEAD.value, SCALE_START=start,
        BLOCK_SIZE=block_size, ROW_ALIGN=8 if inline else 1, GROUP=group, KV_SCALE=kv_scale,
        CAUSAL=causal, SPLIT=split, WRITE_LSE=write_lse, NBUF_=NBUF, num_warps=1,
    )  # fmt: skip
    aligned = ["stride_qt", "stride_qh", "stride_ot", "stride_oh"]
    if not inline:  # (264-byte rows: the head and token strides are not multiples of 16)
        aligned += ["stride_kb", "stride_kh", "stride_kn"]
    if scale_plane:  # the plane's head stride (16 tokens x 8 bytes); its token stride is 8
        aligned += ["stride_ssh"]
    return aot_case_spec(
        sm90_decode_kernel, module="kv_kernels.paged_attention._sm90_decode_kernel",
        pointers=pointers, floats=("qk_scale_log2", "k_scale_val", "v_scale_val"),
        constexprs=constexprs, aligned_strides=aligned,
    )  # fmt: skip


#: bound launches (kv_kernels._launch)
_FAST = FastLauncher(sm90_decode_kernel)
