"""A skinny GEMM for the decode step's projections: ``y = x @ W^T (+ bias)`` at ``M <= 256``
tokens (``nn.Linear``'s layout, W ``[N, K]`` as stored), where the weight read sets the time.

``skinny_linear`` validates and dispatches (Triton on CUDA, the torch reference on the CPU);
``supports`` says whether a shape is one it takes; ``GemmConfig`` / ``pick_config`` are the tile
configs (a table measured by ``benchmarks/bench_gemm.py --sweep``, a heuristic otherwise)."""

from __future__ import annotations

from kv_kernels.gemm.api import skinny_linear, supports, unsupported_reason
from kv_kernels.gemm.configs import MAX_M, GemmConfig, default_config, pick_config

__all__ = [
    "MAX_M",
    "GemmConfig",
    "default_config",
    "pick_config",
    "skinny_linear",
    "supports",
    "unsupported_reason",
]
