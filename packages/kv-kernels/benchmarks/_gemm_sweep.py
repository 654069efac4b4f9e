"""bench_gemm.py's helpers: the decode projections' shapes, the sweep grid, the timer and the
parallel precompile (imported from the script's own folder).

Precompile: Triton compiles a config on its first launch (~0.5-1 s each on the host, one at a
time). A sweep of ~50 configs x 5 M buckets is ~200 distinct compiles, most of a 5-minute
budget. :func:`precompile` launches one call of each distinct compile key in a pool of spawned
processes (each with its own CUDA context, on empty tensors of the case's shape: the same
specialization as the real call), so they land in Triton's on-disk cache in parallel and the
main process's first launch of each loads the cubin (~10-50 ms) instead of compiling it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NamedTuple

import torch

__all__ = [
    "SHAPES",
    "Shape",
    "compile_keys",
    "default_workers",
    "graph_us",
    "precompile",
    "sweep_grid",
]


class Shape(NamedTuple):
    """One projection ``y[M, N] = x[M, K] @ W[N, K]^T``."""

    name: str
    n: int
    k: int


#: Llama-3-8B (hidden 4096, 32 q / 8 kv heads of 128, MLP 14336, vocab 128256), DeepSeek-V3
#: (hidden 7168; q_lora 1536, kv_lora 512 + rope 64, 128 heads of 128 (+64 rope) q / 128 v,
#: shared expert MLP 2048), MiMo-7B (hidden 4096, 32 / 8 heads of 128, MLP 11008).
SHAPES = (
    Shape("llama3-8b.qkv", 6144, 4096),
    Shape("llama3-8b.o_proj", 4096, 4096),
    Shape("llama3-8b.gate_up", 28672, 4096),
    Shape("llama3-8b.down", 4096, 14336),
    Shape("llama3-8b.lm_head", 128256, 4096),
    Shape("deepseek-v3.qkv_a", 2112, 7168),
    Shape("deepseek-v3.q_b", 24576, 1536),
    Shape("deepseek-v3.o_proj", 7168, 16384),
    Shape("deepseek-v3.shared_down", 7168, 2048),
    Shape("mimo-7b.gate_up", 22016, 4096),
    Shape("mimo-7b.down", 4096, 11008),
)


def sweep_grid(m: int, n: int, k: int) -> list[Any]:
    """The configs the sweep times at ``m`` tokens: BLOCK_M from the bucket (and one smaller
    for 128+ tokens), ``(block_n, block_k)`` pairs, split counts up to the first that gives
    >= 2 CTAs a SM (each slice >= 2 K steps), and 2 pipeline depths within shared memory:
    ~10-60 a shape (fewer for wide N, which needs no split)."""
    from kv_kernels.gemm.configs import (
        BLOCK_M_BY_BUCKET,
        NUM_SMS,
        SHARED_MEMORY_BUDGET,
        GemmConfig,
        m_bucket,
        shared_bytes,
    )

    bms = [BLOCK_M_BY_BUCKET[m_bucket(m)]]
    if m > 64:
        bms.append(64)
    tiles = ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128))
    out = []
    for bm in bms:
        for bn, bk in tiles:
            ctas = -(-n // bn) * -(-m // bm)
            for split in (1, 2, 4, 8, 16):
                # a split must leave >= 2 K steps a slice, and is worth trying only while the
                # grid at half of it had < 2 CTAs a SM
                if split > 1 and (k // (bk * split) < 2 or ctas * split // 2 >= 2 * NUM_SMS):
                    continue
                for stages in (3, 5):
                    warps = 8 if bm * bn >= 128 * 64 else 4
                    cfg = GemmConfig(bm, bn, bk, split, warps, stages)
                    if shared_bytes(cfg) <= SHARED_MEMORY_BUDGET:
                        out.append(cfg)
    return out


def compile_keys(m: int, k: int, cfg: Any) -> list[tuple[Any, ...]]:
    """What makes Triton compile new variants for one launch of ``cfg``: the GEMM kernel's
    tiles, warps, stages, whether it splits and whether K's slices are full; the reduce
    kernel's split count (M = 1 is specialized as a constant in both; every shape here has
    N and K multiples of 16)."""
    from kv_kernels.gemm.triton import split_geometry

    bm, bn, bk, split, warps, stages = cfg
    keys: list[tuple[Any, ...]] = [
        ("gemm", m == 1, bm, bn, bk, split > 1, warps, stages, split_geometry(k, cfg)[1])
    ]
    if split > 1:
        keys.append(("reduce", m == 1, split))
    return keys


def _warm(jobs: Sequence[tuple[int, int, int, tuple[int, ...]]]) -> list[str]:
    """Worker: one launch of each ``(m, n, k, config)`` on empty bf16 tensors; the failures."""
    from kv_kernels.gemm import GemmConfig, skinny_linear

    failed = []
    for m, n, k, cfg in jobs:
        try:
            x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
            skinny_linear(x, w, config=GemmConfig(*cfg))
            torch.cuda.synchronize()
        except Exception as e:  # (reported by the parent; the sweep skips the config)
            failed.append(f"{m}x{n}x{k} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    return failed


def precompile(cases: Sequence[tuple[int, int, int, Any]], workers: int) -> list[str]:
    """Compile every distinct key of ``cases`` (``(m, n, k, cfg)``) in ``workers`` spawned
    processes; returns the failures (each worker's first CUDA call costs ~1-3 s)."""
    seen: dict[tuple[Any, ...], tuple[int, int, int, tuple[int, ...]]] = {}
    for m, n, k, cfg in cases:
        for key in compile_keys(m, k, cfg):
            seen.setdefault(key, (m, n, k, tuple(cfg)))
    jobs = list(dict.fromkeys(seen.values()))
    if not jobs:
        return []
    workers = max(1, min(workers, len(jobs)))
    chunks = [jobs[i::workers] for i in range(workers)]
    import multiprocessing as mp

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return [f for got in pool.map(_warm, chunks) for f in got]


def graph_us(
    calls: Sequence[Callable[[], Any]], *, target_us: float, est_us: float, replays: int = 5
) -> float:
    """Median GPU microseconds of one call: ``calls`` (one per weight copy, cycled so L2 never
    holds the weight a call reads) captured back to back in one CUDA graph of enough calls to
    last ~``target_us``, the graph replayed ``replays`` times between CUDA events."""
    reps = max(len(calls), min(400, int(target_us / max(est_us, 0.5)) + 1))
    reps = -(-reps // len(calls)) * len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (cuBLAS handles and workspaces made outside the capture)
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def default_workers() -> int:
    """Compile processes: the host's cores less one, at most 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))
