"""Paged attention over a KV cache in the layout standard: one varlen op for prefill, chunked
prefill and decode in one batch, plus the merge of partial attention states (cascade / shared
prefix, split-KV).

``api`` validates and dispatches (``impl="reference"`` torch on any device, ``impl="triton"`` the
unified Triton kernel, ``impl="auto"`` Triton for CUDA tensors and the reference on the CPU).
"""

from __future__ import annotations

from kv_kernels.paged_attention.api import merge_attn_states, paged_attention

__all__ = ["merge_attn_states", "paged_attention"]
