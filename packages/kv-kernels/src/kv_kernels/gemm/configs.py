"""Tile configs of the skinny GEMM: the value type, its checks, the table of measured configs
and the heuristic for shapes the table lacks. Imports neither torch nor Triton.

Why these knobs. At ``M <= 256`` a decode projection ``y = x @ W^T`` is bound by reading ``W``
(``N * K * 2`` bytes for bf16: 50 MB for Llama-3-8B's qkv, 12 us at 4.2 TB/s, where its FLOPs
take ~4 us). What sets the time is how many bytes of ``W`` are in flight: enough CTAs (one per
``BLOCK_N`` rows of ``W`` and ``SPLIT_K`` slice of ``K``; 132 SMs on an H100 / H200) times
enough pipeline stages (``num_stages`` tiles of ``BLOCK_N x BLOCK_K`` loaded ahead).
``BLOCK_M`` only has to cover the tokens: the kernel computes ``W_tile @ x_tile^T`` so the
weight rows are the MMA's M side (64 rows a warpgroup on sm_90) and the tokens its N side
(which may be 16).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "BLOCK_M_BY_BUCKET",
    "MAX_M",
    "M_BUCKETS",
    "SHARED_MEMORY_BUDGET",
    "TABLE",
    "GemmConfig",
    "check_config",
    "default_config",
    "m_bucket",
    "pick_config",
    "shared_bytes",
]

#: The most tokens the skinny kernel takes; larger M is a compute-bound GEMM (torch's matmul).
MAX_M = 256
#: Upper ends of the M buckets the table is keyed by.
M_BUCKETS = (16, 32, 64, 128, 256)
#: The default BLOCK_M of each bucket (256 tokens: two tiles of 128, which re-read W from L2).
BLOCK_M_BY_BUCKET = {16: 16, 32: 32, 64: 64, 128: 128, 256: 128}
#: sm_90's opt-in shared memory a block may use (kv_kernels.aot.SHARED_MEMORY_LIMIT[90]) less
#: a margin for Triton's own scratch (the epilogue's layout conversion, barriers).
SHARED_MEMORY_BUDGET = 232448 - 8192
#: SMs of an H100 / H200: the heuristic aims for at least two CTAs a SM.
NUM_SMS = 132

_POW2 = tuple(1 << i for i in range(12))


class GemmConfig(NamedTuple):
    """One launch's tiles: ``block_m`` tokens x ``block_n`` output features a CTA, ``block_k``
    of the reduction a step, ``split_k`` CTAs along K (partials in a float32 workspace summed
    by a second kernel in a fixed order: deterministic, CUDA-graph safe), ``num_warps`` and
    ``num_stages`` (Triton's software pipeline depth)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def shared_bytes(cfg: GemmConfig, elem_bytes: int = 2) -> int:
    """Shared memory the pipeline's buffers take, counted high: ``num_stages`` tiles of W and
    of x (Triton keeps ``num_stages - 1`` in flight plus the one being read)."""
    return cfg.num_stages * (cfg.block_n * cfg.block_k + cfg.block_k * cfg.block_m) * elem_bytes


def check_config(cfg: object, *, elem_bytes: int = 2) -> GemmConfig:
    """``cfg`` as a :class:`GemmConfig`, or a ValueError / TypeError naming the bad field, its
    value, the bound and the fix."""
    if not isinstance(cfg, GemmConfig):
        raise TypeError(
            f"config must be a kv_kernels.gemm.GemmConfig, got {type(cfg).__name__}; build one "
            "with GemmConfig(block_m, block_n, block_k, split_k, num_warps, num_stages)"
        )
    for field, value, allowed in (
        ("block_m", cfg.block_m, (16, 32, 64, 128)),
        ("block_n", cfg.block_n, (16, 32, 64, 128, 256)),
        ("block_k", cfg.block_k, (16, 32, 64, 128, 256)),
        ("num_warps", cfg.num_warps, (1, 2, 4, 8)),
    ):
        if type(value) is not int or value not in allowed:
            raise ValueError(
                f"GemmConfig.{field}={value!r} must be one of {list(allowed)} (tl.dot takes "
                "power-of-2 tiles of at least 16)"
            )
    for field, value, hi in (("split_k", cfg.split_k, 64), ("num_stages", cfg.num_stages, 8)):
        if type(value) is not int or not 1 <= value <= hi:
            raise ValueError(f"GemmConfig.{field}={value!r} must be an int in [1, {hi}]")
    smem = shared_bytes(cfg, elem_bytes)
    if smem > SHARED_MEMORY_BUDGET:
        raise ValueError(
            f"GemmConfig {tuple(cfg)} needs ~{smem} bytes of shared memory for its pipeline, over "
            f"the {SHARED_MEMORY_BUDGET} an sm_90 block may use; lower num_stages, block_k or block_n"
        )
    return cfg


def m_bucket(m: int) -> int:
    """The table's M bucket of ``m`` tokens (1..256): the smallest of :data:`M_BUCKETS` >= m."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"M={m} > {MAX_M}: the skinny GEMM takes at most {MAX_M} tokens")


#: Measured configs keyed by (M bucket, N, K) for 16-bit weights: pasted unchanged from
#: ``benchmarks/bench_gemm.py --sweep`` on an NVIDIA H200 (triton 3.6, torch 2.11, bf16; the
#: record is docs/benchmarks/gemm_sweep_h200.{json,md}). Llama-3-8B's projections, each bucket
#: timed at its top M only (16, 64, 128, 256; bucket 32 is not in it); each comment is that
#: M's per-call time back to back in a CUDA graph, weights L2-cold. A shape not in it takes
#: :func:`default_config`.
TABLE: dict[tuple[int, int, int], GemmConfig] = {
    (16, 4096, 4096): GemmConfig(16, 32, 256, 1, 4, 5),  # 11.6 us avg over 1 M
    (16, 4096, 14336): GemmConfig(16, 64, 256, 1, 4, 5),  # 31.5 us avg over 1 M
    (16, 6144, 4096): GemmConfig(16, 64, 128, 1, 4, 5),  # 14.9 us avg over 1 M
    (16, 28672, 4096): GemmConfig(16, 128, 128, 1, 4, 3),  # 57.5 us avg over 1 M
    (16, 128256, 4096): GemmConfig(16, 128, 128, 1, 4, 3),  # 241.7 us avg over 1 M
    (64, 4096, 4096): GemmConfig(64, 64, 128, 1, 4, 5),  # 12.6 us avg over 1 M
    (64, 4096, 14336): GemmConfig(64, 64, 128, 2, 4, 5),  # 34.0 us avg over 1 M
    (64, 6144, 4096): GemmConfig(64, 64, 128, 1, 4, 5),  # 16.1 us avg over 1 M
    (64, 28672, 4096): GemmConfig(64, 128, 64, 1, 8, 3),  # 59.5 us avg over 1 M
    (64, 128256, 4096): GemmConfig(64, 128, 64, 1, 8, 3),  # 256.6 us avg over 1 M
    (128, 4096, 4096): GemmConfig(64, 64, 128, 1, 4, 5),  # 12.8 us avg over 1 M
    (128, 4096, 14336): GemmConfig(64, 64, 128, 1, 4, 5),  # 37.2 us avg over 1 M
    (128, 6144, 4096): GemmConfig(64, 64, 64, 1, 4, 5),  # 20.9 us avg over 1 M
    (128, 28672, 4096): GemmConfig(128, 128, 64, 1, 8, 3),  # 66.0 us avg over 1 M
    (128, 128256, 4096): GemmConfig(128, 128, 64, 1, 8, 3),  # 273.4 us avg over 1 M
    (256, 4096, 4096): GemmConfig(128, 64, 64, 1, 8, 5),  # 18.7 us avg over 1 M
    (256, 4096, 14336): GemmConfig(128, 64, 64, 1, 8, 5),  # 60.3 us avg over 1 M
    (256, 6144, 4096): GemmConfig(128, 128, 64, 1, 8, 5),  # 24.8 us avg over 1 M
    (256, 28672, 4096): GemmConfig(128, 128, 64, 1, 8, 3),  # 99.2 us avg over 1 M
    (256, 128256, 4096): GemmConfig(128, 128, 64, 1, 8, 3),  # 438.7 us avg over 1 M
}


def default_config(m: int, n: int, k: int, elem_bytes: int = 2) -> GemmConfig:
    """The heuristic for a shape the table lacks: BLOCK_M by M bucket, 64 weight rows a CTA,
    128-wide K steps, and ``split_k`` so that at least ~2 CTAs a SM stream W (Llama's o_proj
    at N 4096 has only 64 tiles of 64 rows: 2 SMs in 3 would idle without a split), while every
    split keeps at least 4 K steps to pipeline over."""
    block_m = BLOCK_M_BY_BUCKET[m_bucket(m)]
    block_n, block_k = 64, 128
    tiles = -(-n // block_n) * -(-m // block_m)
    split = 1
    while tiles * split < 2 * NUM_SMS and k // (block_k * split * 2) >= 4 and split < 16:
        split *= 2
    # stages: keep the pipeline within shared memory as BLOCK_M grows (x's tile takes room too)
    stages = 5 if block_m <= 32 else 4 if block_m <= 64 else 3
    warps = 4 if block_m <= 64 else 8
    cfg = GemmConfig(block_m, block_n, block_k, split, warps, stages)
    while shared_bytes(cfg, elem_bytes) > SHARED_MEMORY_BUDGET and cfg.num_stages > 2:
        cfg = cfg._replace(num_stages=cfg.num_stages - 1)  # (float32 tiles are twice as wide)
    return cfg


def pick_config(m: int, n: int, k: int, elem_bytes: int = 2) -> GemmConfig:
    """The table's config for ``(m_bucket(m), n, k)`` (16-bit weights), else the heuristic."""
    cfg = TABLE.get((m_bucket(m), n, k)) if elem_bytes == 2 else None
    return cfg if cfg is not None else default_config(m, n, k, elem_bytes)
