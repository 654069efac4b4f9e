"""The kernels the backends wrap, called by hand with a batch's own inputs: the baselines of
``bench_host.py`` and ``bench_backends.py`` (which import this module from their own folder)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def direct_paged_attention(b: Any, md: Any, out: torch.Tensor, **kw: Any) -> Callable[[], Any]:
    """kv-kernels' ``paged_attention`` (``impl="triton"``) over ``b``'s cache, into ``out``;
    ``kw``: further kernel arguments (e.g. ``scale``)."""
    from kv_kernels.paged_attention import paged_attention

    return lambda: paged_attention(
        b.q,
        b.kv_cache,
        b.layout,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.max_query_len,
        max_seq_len=md.max_seq_len,
        out=out,
        impl="triton",
        **kw,
    )


def direct_flash_attn(b: Any, md: Any, impl: Any) -> Callable[[], Any]:
    """FlashAttention-4's ``flash_attn_varlen_func`` (causal, paged) over ``b``'s cache, K and V
    split from its rows at ``head_size``."""
    from flash_attn.cute import flash_attn_varlen_func

    d = b.config.head_size
    nhd = b.kv_cache.transpose(1, 2)
    k, v = nhd[..., :d], nhd[..., d:]
    return lambda: flash_attn_varlen_func(
        b.q,
        k,
        v,
        cu_seqlens_q=md.query_start_loc,
        max_seqlen_q=md.max_query_len,
        max_seqlen_k=md.max_seq_len,
        seqused_k=md.seq_lens,
        page_table=md.block_table,
        softmax_scale=impl.scale,
        causal=True,
    )
