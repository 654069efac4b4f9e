"""What the connector benchmark's sections share: timing (host wall time and device time), the
results table with its per-section error capture, and caches of a given shape."""

from __future__ import annotations

import json
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Req", "Results", "device_s", "make_cache", "make_layout", "median_s", "sync"]


@dataclass
class Req:
    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)


#: Llama-3-8B-like: 32 layers, 8 kv heads, 128 head dim, bf16, 16-token blocks
GPU_SHAPE: dict[str, Any] = {
    "num_layers": 32,
    "num_blocks": 2048,
    "num_kv_heads": 8,
    "block_size": 16,
    "head_size": 128,
    "head_size_v": 128,
    "dtype": "bfloat16",
}
#: the CPU smoke run's
SMOKE_SHAPE: dict[str, Any] = {
    "num_layers": 4,
    "num_blocks": 64,
    "num_kv_heads": 2,
    "block_size": 4,
    "head_size": 16,
    "head_size_v": 16,
    "dtype": "float16",
}


def transfer_shape(smoke: bool) -> tuple[dict[str, Any], int]:
    """The benchmarks' cache shape and blocks a transfer moves: on a GPU 8k-token requests (512
    blocks of 16 tokens, 1 GiB); on the smoke run 16 blocks."""
    return (dict(SMOKE_SHAPE), 16) if smoke else (dict(GPU_SHAPE), 512)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_s(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Seconds of device time per call: ``iters`` calls back to back between two CUDA events, so a
    call's host work overlaps the previous call's kernel (the host cost is measured apart, by
    :func:`median_s`). On the CPU this is wall time."""
    if device.type != "cuda":
        return median_s(fn, device, iters, warmup)
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / iters


class Results:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.errors: list[dict[str, str]] = []
        self.notes: list[str] = []

    def add(
        self, section: str, case: str, nbytes: int, t: float, base: str, t_base: float, **extra: Any
    ) -> None:
        gbps, base_gbps = nbytes / t / 1e9, nbytes / t_base / 1e9
        rec = {
            "section": section,
            "case": case,
            "bytes": nbytes,
            "ms": t * 1e3,
            "GB/s": gbps,
            "baseline": base,
            "baseline_ms": t_base * 1e3,
            "baseline_GB/s": base_gbps,
            "ratio": gbps / base_gbps,
            **extra,
        }
        self.records.append(rec)
        print(json.dumps(rec), flush=True)

    def run(self, section: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # record and go on: one broken section must not hide the rest
            self.errors.append(
                {
                    "section": section,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(),
                }
            )
            print(f"[{section}] FAILED: {exc}", flush=True)


def make_layout(order: str, shape: dict[str, Any]) -> Any:
    from kv_spec import KVCacheLayout, LayoutOrder

    return KVCacheLayout(order=LayoutOrder.parse(order), **shape)


def make_cache(order: str, shape: dict[str, Any], device: torch.device) -> tuple[Any, Any, int]:
    """``(layout, storage, row bytes)``: a freshly allocated cache of ``shape`` in ``order``."""
    from kv_kernels import allocate_kv_cache

    lay = make_layout(order, shape)
    return lay, allocate_kv_cache(lay, device), lay.num_layers * lay.page_bytes
