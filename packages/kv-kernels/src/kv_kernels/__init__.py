"""kv-kernels: the ops a paged KV cache needs — cache writes, paged attention, block copies and
slot mapping — each with a readable torch reference (CPU) and a Triton kernel (NVIDIA GPUs).
"""

from __future__ import annotations

from kv_kernels.cache import KVCacheStorage, allocate_kv_cache, layer_view, layer_views

__version__ = "0.1.0"

__all__ = ["KVCacheStorage", "allocate_kv_cache", "layer_view", "layer_views"]
