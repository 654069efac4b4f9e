"""FLEX_ATTENTION's backend class: its one ``CAPABILITIES`` literal (read with ``ast`` by
tools/generate_backend_docs.py) and its builder and impl classes. The package docstring
(:mod:`kv_backends.backends.flex`) says how the backend works."""

from __future__ import annotations

from typing import ClassVar

from kv_backends.backends.flex.impl import FlexAttentionImpl
from kv_backends.backends.flex.metadata import FlexMetadataBuilder
from kv_backends.base import AttentionBackend
from kv_backends.capabilities import BackendCapabilities

__all__ = ["FlexAttentionBackend"]


class FlexAttentionBackend(AttentionBackend):
    NAME: ClassVar[str] = "FLEX_ATTENTION"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("float32", "float16", "bfloat16"),
        kv_quant_modes=("none",),
        head_size_rule=(16, 256, 8),
        supports_head_size_v_diff=True,
        kernel_block_sizes=(16, 32, 64, 128, 256, 512, 1024),
        supported_layouts=("LBNHC", "BLNHC"),
        sinks=True,
        sliding_window=True,
        softcap=True,
        alibi=True,
        mla=False,
        non_causal=True,
        batch_invariant=True,
        cudagraph_support="never",
        needs_gpu=False,
        notes="torch FlexAttention with a per-batch block mask; token-major (NHD) orders only; caches over 2^31 elements are cut into re-based windows.",
    )
    builder_cls = FlexMetadataBuilder
    impl_cls = FlexAttentionImpl
