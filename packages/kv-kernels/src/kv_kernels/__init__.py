"""kv-kernels: the ops a paged KV cache needs — cache writes, paged attention, block copies and
slot mapping — and the fused elementwise ops of the layers around it (RMSNorm with the residual
add, SiLU/GELU-and-mul, RoPE), each with a readable torch reference (CPU) and a Triton kernel
(NVIDIA GPUs).

Every op takes ``impl="reference" | "triton" | "auto"`` (auto: Triton for CUDA tensors, the
reference on the CPU) and never falls back silently. Caches are read through per-layer logical
``[B, H, N, C]`` views of a :class:`kv_spec.KVCacheLayout` (:func:`layer_view`), so every physical
order works without copies; offsets are 64-bit.
"""

from __future__ import annotations

from kv_kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks
from kv_kernels.cache import (
    KVCacheStorage,
    allocate_kv_cache,
    kernel_block_view,
    layer_view,
    layer_views,
    scale_plane_view,
)
from kv_kernels.fused import (
    gelu_tanh_and_mul,
    rms_norm,
    rope_and_cache,
    rope_cos_sin_cache,
    rotary_embedding,
    silu_and_mul,
)
from kv_kernels.paged_attention import merge_attn_states, paged_attention
from kv_kernels.reshape_and_cache import read_kv, reshape_and_cache
from kv_kernels.slot_mapping import compute_slot_mapping, expand_block_table

# Last: registers torch.ops.kv_kernels.* (it imports the api modules above, never the reverse).
from kv_kernels import _ops  # noqa: F401  isort: skip

__version__ = "0.4.0"

__all__ = [
    "KVCacheStorage",
    "allocate_kv_cache",
    "compute_slot_mapping",
    "copy_blocks",
    "expand_block_table",
    "gather_blocks",
    "gelu_tanh_and_mul",
    "kernel_block_view",
    "layer_view",
    "layer_views",
    "merge_attn_states",
    "paged_attention",
    "read_kv",
    "reshape_and_cache",
    "rms_norm",
    "rope_and_cache",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "scale_plane_view",
    "scatter_blocks",
    "silu_and_mul",
]
