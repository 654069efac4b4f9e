"""kv-spec: what a paged KV cache *is* — specs, dtypes, quant modes, page sizes, the layout
standard and the memory planner. Stdlib only: ``import kv_spec`` never imports torch.

Plan a KV cache for a catalogue model in three lines::

    from kv_spec import get_model, plan_kv_cache
    specs = get_model("Llama-3-8B").kv_specs(block_size=16)
    config = plan_kv_cache(specs, available_bytes=40 * 2**30, max_model_len=8192)
"""

from __future__ import annotations

from kv_spec.catalogue import CATALOGUE, ModelConfig, get_model
from kv_spec.dtypes import DTYPE_BYTES, dtype_bytes, normalize_dtype, to_torch_dtype
from kv_spec.layout import LOGICAL_DIMS, KVCacheLayout, LayoutChoice, LayoutOrder, resolve_layout
from kv_spec.pages import (
    SPLITTABLE_ORDERS,
    content_size,
    expand_block_ids,
    kernel_blocks_per_block,
    real_page_size_bytes,
)
from kv_spec.planner import (
    NULL_BLOCKS,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    merge_kv_cache_configs,
    plan_kv_cache,
    unify_page_sizes,
)
from kv_spec.quant import SCALE_BYTES, KVQuantMode
from kv_spec.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
    merge_specs,
)

__version__ = "0.2.0"

__all__ = [
    "CATALOGUE",
    "DTYPE_BYTES",
    "LOGICAL_DIMS",
    "NULL_BLOCKS",
    "SCALE_BYTES",
    "SPLITTABLE_ORDERS",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheLayout",
    "KVCacheTensor",
    "KVQuantMode",
    "LayoutChoice",
    "LayoutOrder",
    "MLAAttentionSpec",
    "ModelConfig",
    "SlidingWindowSpec",
    "cdiv",
    "content_size",
    "dtype_bytes",
    "expand_block_ids",
    "get_model",
    "kernel_blocks_per_block",
    "merge_kv_cache_configs",
    "merge_specs",
    "normalize_dtype",
    "plan_kv_cache",
    "real_page_size_bytes",
    "resolve_layout",
    "to_torch_dtype",
    "unify_page_sizes",
]
