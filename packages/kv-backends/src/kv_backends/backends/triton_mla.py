"""TRITON_MLA: multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in the absorbed form, on
kv-kernels' unified Triton kernel.

The cache holds one latent row per token (``MLAAttentionSpec``: one "kv head" of ``head_size =
kv_lora_rank + qk_rope_head_dim``, DeepSeek-V3 512 + 64). The layer has already absorbed
``W_UK`` into its queries, so ``q`` is ``[T, Hq, kv_lora_rank + rope]`` (the absorbed nope part,
then the rope part); attention uses K = the whole latent row and V = its first ``kv_lora_rank``
columns of the same storage (the kernel reads the page once and uses that tile for both), and the
output is ``[T, Hq, kv_lora_rank]``, which the layer multiplies by ``W_UV``. Prefill in this form
is correct but not fast (the kernel is tuned for decode; engines usually prefill MLA in the
non-absorbed form).

The cache write stores the latent row: ``do_kv_cache_update(layer, latent, None, cache, slots)``
with ``latent`` ``[T, 1, kv_lora_rank + rope]`` (``kv_c_normed`` then ``k_pe``), through
``reshape_and_cache``'s MLA path.

fp8 latents (``kv_quant="fp8_per_tensor"``, e4m3 or e5m2: vLLM's ``fp8`` cache for DeepSeek) have
one scale, ``k_scale``: the write stores ``latent / k_scale`` and attention reads K and V back
from those bytes with it. ``make_impl(k_scale=...)`` (``v_scale`` ``None`` or the same value).
The sm_90 Gluon MLA kernel serves 16-bit latents only; an fp8 latent runs the Triton kernel.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from kv_spec import KVCacheLayout

from kv_backends.backends.triton_attn import TritonImpl
from kv_backends.base import AttentionBackend, MetadataBuilder
from kv_backends.capabilities import BackendCapabilities
from kv_backends.config import AttentionConfig, Platform

__all__ = ["TritonMLABackend", "TritonMLAImpl", "default_kv_lora_rank"]


def default_kv_lora_rank(head_size: int) -> int:
    """The latent width of a ``head_size`` row: its largest power of two below it, the rest
    being the rope part (DeepSeek-V2/V3/R1 and Kimi K2 576 = 512 + 64, MiniCPM3 288 = 256 + 32).
    The kernel reads exactly such rows: a power-of-two latent tile plus a power-of-two tail."""
    return 1 << ((head_size - 1).bit_length() - 1)


class TritonMLAImpl(TritonImpl):
    """Per-layer absorbed MLA decode. Options as :class:`TritonImpl`, plus ``kv_lora_rank``
    (default :func:`default_kv_lora_rank`): the latent width, i.e. the V columns and the output
    width."""

    _out_note: ClassVar[str] = " (MLA: one kv_lora_rank-wide latent output per query head)"

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        kv_lora_rank: int | None = None,
        **kw: Any,
    ) -> None:
        if not config.mla or not layout.is_mla:
            raise ValueError(
                f"TRITON_MLA serves MLA layers only (config.mla={config.mla}, "
                f"layout.is_mla={layout.is_mla}); use TRITON for other layers"
            )
        rank = default_kv_lora_rank(config.head_size) if kv_lora_rank is None else kv_lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < config.head_size:
            raise ValueError(
                f"kv_lora_rank={rank!r} must be an int in [1, head_size={config.head_size}) "
                "(the latent part of the row; the rest is the rope part)"
            )
        super().__init__(config, layout, **kw)
        self.kv_lora_rank = rank
        self.head_size_v = rank  # the output width (before the layer's W_UV)

    def do_kv_cache_update(
        self,
        layer: object,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write the latent rows ``key`` ``[T, 1, kv_lora_rank + rope]``; ``value`` must be
        ``None`` (V is read from the same rows)."""
        if value is not None:
            raise ValueError(
                "TRITON_MLA stores one latent row per token: pass the latent as key and "
                "value=None (V is the latent's first kv_lora_rank columns)"
            )
        super().do_kv_cache_update(layer, key, None, kv_cache, slot_mapping)

    def _kernel_features(self, layer: object, q: torch.Tensor, params: Any) -> dict[str, Any]:
        """Absorbed attention of ``q`` ``[T, Hq, head_size]`` over the latent cache: the kernel
        returns ``[T, Hq, kv_lora_rank]`` (padding rows zero); MLA layers have no window, sinks,
        softcap or ALiBi; an fp8 latent its one scale, ``k_scale``."""
        k_scale, _ = self.scales(layer, q.device)
        return {"kv_lora_rank": self.kv_lora_rank, "k_scale": k_scale}


class TritonMLABackend(AttentionBackend):
    NAME: ClassVar[str] = "TRITON_MLA"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        kv_quant_modes=("none", "fp8_per_tensor"),
        # a power-of-two latent <= 512 plus a power-of-two rope tail >= 16 (the kernel's split)
        head_sizes=(48, 80, 144, 192, 288, 320, 576),
        kernel_block_size_multiple_of=1,
        supported_layouts=("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"),
        mla=True,
        batch_invariant=True,
        cudagraph_support="uniform_batch",
        min_compute_capability=(8, 0),
        needs_gpu=True,
        notes=(
            "MLA absorbed decode on kv-kernels' unified Triton kernel: one latent row per token "
            "(power-of-two kv_lora_rank + rope tail), V read from the same page tile; serves MLA "
            "layers only. fp8 latents (e4m3 / e5m2 per tensor) have one scale, k_scale, for K "
            "and V alike. On sm_90 the decode of a 512 + 64 latent (16-bit, or fp8 e4m3 with "
            "its one scale) at 64 or 128 query heads (DeepSeek-V3 on one GPU), or at 16 or 32 "
            "(tensor parallelism 8 / 4), runs one of kv-kernels' warp-specialized Gluon MLA "
            "kernels instead (KV_KERNELS_SM90_MLA=0 turns them off)."
        ),
    )
    builder_cls = MetadataBuilder
    impl_cls = TritonMLAImpl

    @classmethod
    def validate(
        cls,
        config: AttentionConfig,
        platform: Platform | None = None,
        *,
        layout: KVCacheLayout | None = None,
    ) -> list[str]:
        reasons = super().validate(config, platform, layout=layout)
        if not config.mla:
            reasons.append("serves only MLA layers (one latent per token)")
        return reasons
