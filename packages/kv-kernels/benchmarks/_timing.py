"""GPU time and host time of one call, for the attention benchmarks (imported from the scripts'
own folder).

``triton.testing.do_bench`` times calls between CUDA events on the stream. When the host takes
longer to enqueue a call than the GPU takes to run it, the GPU waits for the host inside the
timed span, and the figure is the host's, with the host's jitter. Our launcher spends ~0.19-0.28
ms of Python a call (H100 machine, ``paged_attention(..., impl="triton")``), a short decode
kernel 0.1-0.2 ms: the same case then read 0.5-1.3 TB/s in four back-to-back ``do_bench`` calls
and 2.52 TB/s in each of four CUDA-graph replays (MLA at 16 heads, 64 x 4k; seventh session).
That was the "timing variance" of the earlier kernels.md notes.

So every figure is three numbers:

- ``ms``: GPU time, from replaying the call in a CUDA graph (``do_bench_cudagraph``: no host in
  the loop); a call that cannot be captured falls back to ``do_bench`` and says so (``timing``);
- ``eager_ms``: ``do_bench`` as before, what a caller without CUDA graphs waits;
- ``host_ms``: the wall time of enqueuing one call (no synchronization in the loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import triton

__all__ = ["copy_limit", "gpu_ms", "host_ms", "timed"]


def gpu_ms(fn: Callable[[], Any], *, warmup: int = 15, rep: int = 60) -> tuple[float, str]:
    """``(ms, timing)``: the median GPU time of ``fn`` replayed in a CUDA graph
    (``timing="cudagraph"``), or of ``do_bench`` where capture fails (``"eager"``)."""
    try:
        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")), (
            "cudagraph"
        )
    except Exception:  # (not capturable: a host sync, a CPU tensor, ...)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        return float(ms), "eager"


def host_ms(fn: Callable[[], Any], calls: int = 50) -> float:
    """Mean wall ms to enqueue one call of ``fn`` (the GPU may still be running them)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return ms


def timed(fn: Callable[[], Any], *, warmup: int = 15, rep: int = 60) -> dict[str, Any]:
    """``{"ms", "timing", "eager_ms", "host_ms"}`` of ``fn`` (see the module docstring)."""
    ms, timing = gpu_ms(fn, warmup=warmup, rep=rep)
    eager = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return {"ms": ms, "timing": timing, "eager_ms": float(eager), "host_ms": host_ms(fn)}


def copy_limit(device: str = "cuda") -> float:
    """TB/s of a device-to-device copy of 1 GiB (read + written bytes), the bandwidth roof the
    decode cases are read against (a CPU stand-in for ``--smoke``)."""
    x = torch.empty(2**30 if device == "cuda" else 2**24, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    if device != "cuda":
        t0 = time.perf_counter()
        y.copy_(x)
        return 2 * x.numel() / ((time.perf_counter() - t0) * 1e3) / 1e9
    # Eager on purpose: one launch, ~0.7 ms of GPU work, so no host gap; and captured in a CUDA
    # graph the copy becomes a memcpy node run by the copy engines, not the SMs (2.42 TB/s on
    # an H100 against the SM copy's 3.0: not the roof a kernel reading HBM is held to).
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=15, rep=60, return_mode="median")
    return 2 * x.numel() / ms / 1e9
