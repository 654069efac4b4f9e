"""TORCH_SDPA's MLA path: absorbed attention over a latent cache through kv-kernels' torch
reference, the CPU's MLA backend and the oracle TRITON_MLA is read against.

The contract is TRITON_MLA's (:mod:`.triton_mla`): the cache holds one latent row per token
(``MLAAttentionSpec``: one "kv head" of ``head_size = kv_lora_rank + rope``, DeepSeek-V3
512 + 64); the layer has absorbed ``W_UK`` into its queries, so ``q`` is ``[T, Hq, kv_lora_rank +
rope]``; K is the whole latent row and V its first ``kv_lora_rank`` columns of the same storage;
the output is ``[T, Hq, kv_lora_rank]``, which the layer multiplies by ``W_UV``. The write stores
the latent once: ``do_kv_cache_update(layer, latent, None, cache, slots)``. An fp8 latent
(``fp8_per_tensor``) has one scale, ``k_scale``, for the write and for K and V alike.

Attention is ``kv_kernels.paged_attention(..., kv_lora_rank=, impl="reference")``: a per-request
gather of the latent pages and a float32 softmax, nothing shared with the Triton kernel. It is
not the padded-group batching of K/V layers (a latent row is one 576-wide head that every query
head reads, so there is nothing per KV head to batch), and each request is computed alone, so the
output stays bitwise batch invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from kv_spec import KVCacheLayout

from kv_backends.backends.triton_mla import default_kv_lora_rank
from kv_backends.config import AttentionConfig

if TYPE_CHECKING:
    from kv_backends.base import AttentionMetadata, LayerParams

__all__ = ["attend_latent", "latent_rank"]


def latent_rank(config: AttentionConfig, layout: KVCacheLayout, kv_lora_rank: object) -> int | None:
    """The latent width V reads of an MLA layer (``kv_lora_rank``, default
    :func:`~kv_backends.backends.triton_mla.default_kv_lora_rank` of the row), or ``None`` for a
    K/V layer, which takes no ``kv_lora_rank``."""
    if not config.mla and not layout.is_mla:
        if kv_lora_rank is not None:
            raise ValueError(
                f"TORCH_SDPA kv_lora_rank={kv_lora_rank!r} is only for MLA layers "
                "(config.mla=True over an MLAAttentionSpec layout); pass None"
            )
        return None
    if config.mla != layout.is_mla:
        raise ValueError(
            f"TORCH_SDPA: config.mla={config.mla} but layout.is_mla={layout.is_mla}; an MLA layer "
            "needs both (AttentionConfig.from_spec and KVCacheLayout.from_spec of one "
            "MLAAttentionSpec)"
        )
    rank = default_kv_lora_rank(config.head_size) if kv_lora_rank is None else kv_lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < config.head_size:
        raise ValueError(
            f"kv_lora_rank={rank!r} must be an int in [1, head_size={config.head_size}) "
            "(the latent part of the row; the rest is the rope part)"
        )
    return rank


def attend_latent(
    q: torch.Tensor,  # [T, Hq, kv_lora_rank + rope], absorbed
    cache: torch.Tensor,  # [B, 1, N, kv_lora_rank + rope] (kernel blocks)
    layout: KVCacheLayout,  # the kernel-block layout of ``cache``
    metadata: AttentionMetadata,
    *,
    kv_lora_rank: int,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float,
    params: LayerParams,
    out: torch.Tensor,  # [T, Hq, kv_lora_rank], written
    k_scale: torch.Tensor | None = None,  # an fp8 latent's one scale ([] or [1])
) -> torch.Tensor:
    """Absorbed attention of ``q`` over the latent rows into ``out``; rows past the batch's
    tokens (CUDA-graph style padding) are zeroed. Window, sinks, softcap and ALiBi are the
    reference's, as on K/V layers (an MLA model has none today, but a declared feature is
    honoured, never dropped). ``k_scale``: an fp8 latent's scale (K and V are read with it)."""
    from kv_kernels.paged_attention import paged_attention

    paged_attention(
        q,
        cache,
        layout,
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        sinks=params.sinks,
        softcap=softcap,
        alibi_slopes=params.alibi_slopes,
        out=out,
        impl="reference",
        kv_lora_rank=kv_lora_rank,
        k_scale=k_scale,
    )
    tail = metadata.num_actual_tokens
    if q.shape[0] > tail:
        out[tail:] = 0  # the reference leaves rows past query_start_loc[-1] alone
    return out
