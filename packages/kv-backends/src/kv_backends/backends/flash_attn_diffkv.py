"""FLASH_ATTN_DIFFKV: FlashAttention for layers whose V head differs from K's (e.g. 192/128).

K and V are two strided views of the one packed cache (``C = head_size + head_size_v``), so V is
never padded to K's width and nothing is copied. Every impl instance carries its own
``head_size_v``: a model whose layers differ (or a process serving two models) needs no global
switch. The selector tries this backend first on CUDA; it rejects layers with equal head sizes,
which then go to FLASH_ATTN.
"""

from __future__ import annotations

from typing import ClassVar

from kv_backends.backends.flash_attn import FlashAttnBackend
from kv_backends.capabilities import BackendCapabilities

__all__ = ["FlashAttnDiffKVBackend"]


class FlashAttnDiffKVBackend(FlashAttnBackend):
    NAME: ClassVar[str] = "FLASH_ATTN_DIFFKV"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float16", "bfloat16"),
        kv_cache_dtypes=("float16", "bfloat16"),
        kv_quant_modes=("none",),
        head_size_rule=(8, 256, 8),
        supports_head_size_v_diff=True,
        requires_head_size_v_diff=True,
        kernel_block_size_multiple_of=16,
        supported_layouts=("LBNHC", "LBHNC", "BLNHC", "BLHNC"),
        sinks=True,
        sliding_window=True,
        softcap=True,
        alibi=False,
        mla=False,
        non_causal=True,
        batch_invariant=False,
        cudagraph_support="uniform_batch",
        min_compute_capability=(9, 0),
        needs_gpu=True,
        notes="FA3/FA4 with head_size_v != head_size on the packed layout (V not padded); per-layer head_size_v.",
    )
