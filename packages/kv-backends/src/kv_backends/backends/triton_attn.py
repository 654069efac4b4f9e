"""TRITON: the unified paged-attention kernel of kv-kernels (prefill, chunked prefill and decode
in one launch pair), with every feature the kernel has.

The impl passes ``impl="triton"`` explicitly: on CUDA that is the kernel, on the CPU it works only
under ``TRITON_INTERPRET=1`` (the tests) and otherwise raises; it never quietly runs the reference.
Batch invariance comes from a fixed split count (``num_splits``, default 1 under
``batch_invariant``), which makes each sequence's result independent of the rest of the batch.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kv_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder
from kv_backends.capabilities import BackendCapabilities
from kv_backends.config import AttentionConfig

__all__ = ["TritonBackend", "TritonImpl"]


class TritonImpl(AttentionImpl):
    """Per-layer TRITON attention. Options: ``num_splits`` (``None`` = the kernel's heuristic;
    forced to 1 under batch invariance unless given) and ``impl`` (``"triton"``; tests may pass
    ``"reference"`` to compare dispatch overhead)."""

    def __init__(
        self,
        config: AttentionConfig,
        layout: Any,
        *,
        num_splits: int | None = None,
        impl: str = "triton",
        **kw: Any,
    ) -> None:
        super().__init__(config, layout, **kw)
        if num_splits is None and config.batch_invariant:
            num_splits = 1
        if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
            raise ValueError(f"num_splits={num_splits!r} must be None or an int >= 1")
        if impl not in ("triton", "reference"):
            raise ValueError(f"TRITON backend impl={impl!r} must be 'triton' or 'reference'")
        self.num_splits = num_splits
        self.impl = impl

    def cache_write_impl(self) -> str:
        return self.impl

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from kv_kernels.paged_attention import paged_attention

        self.check_forward_inputs(q, kv_cache, metadata)
        result = self.empty_output(q, out)
        cache, klayout = self.kernel_cache(kv_cache)
        # float32 on q's device, made once per device (no copies on the step path or in capture).
        params = self.device_params(q.device)
        k_scale, v_scale = self.scales(layer, q.device)
        paged_attention(
            q,
            cache,
            klayout,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=self.scale,
            causal=self.causal,
            sliding_window=self.sliding_window,
            sinks=params.sinks,
            softcap=self.softcap,
            alibi_slopes=params.alibi_slopes,
            k_scale=k_scale,
            v_scale=v_scale,
            num_splits=self.num_splits,
            out=result,
            impl=self.impl,
        )
        return result


class TritonBackend(AttentionBackend):
    NAME: ClassVar[str] = "TRITON"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        kv_quant_modes=("none", "fp8_per_tensor"),
        head_size_rule=(16, 256, 1),
        supports_head_size_v_diff=True,
        kernel_block_size_multiple_of=1,
        supported_layouts=("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"),
        sinks=True,
        sliding_window=True,
        softcap=True,
        alibi=True,
        mla=False,
        non_causal=True,
        batch_invariant=True,
        cudagraph_support="uniform_batch",
        min_compute_capability=(8, 0),
        needs_gpu=True,
        notes="kv-kernels' unified Triton kernel; reads any layout order through strides; batch-invariant with a fixed num_splits.",
    )
    builder_cls = MetadataBuilder
    impl_cls = TritonImpl
