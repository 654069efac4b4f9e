"""TORCH_SDPA: gathers each request's pages and runs torch attention in float32.

The CPU default and the oracle every other backend is tested against: one request at a time, no
tiling, no tricks, so a reader can check it by eye. Plain batches go through
``torch.nn.functional.scaled_dot_product_attention``; sinks and softcap (which SDPA cannot take)
through an explicit softmax with the sink as an extra logit column.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kv_backends.backends._torch_ops import (
    attend_one_request,
    dequant,
    gather_request_kv,
)
from kv_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder
from kv_backends.capabilities import BackendCapabilities

__all__ = ["TorchSDPABackend", "TorchSDPAImpl"]


class TorchSDPAImpl(AttentionImpl):
    """Per-layer TORCH_SDPA attention (float32 math, output cast to the query dtype)."""

    def cache_write_impl(self) -> str:
        # The reference backend writes with the torch reference on every device, so it stays an
        # oracle that shares no Triton code with the backends it checks.
        return "reference"

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_forward_inputs(q, kv_cache, metadata)
        result = self.empty_output(q, out)
        cache, klayout = self.kernel_cache(kv_cache)  # [B*k, H, kbs, C]
        params = self.device_params(q.device)
        k_scale, v_scale = self.scales(layer, q.device)
        qsl = (
            metadata.query_start_loc_cpu
            if metadata.query_start_loc_cpu is not None
            else metadata.query_start_loc.cpu()
        ).tolist()
        seq_lens = (
            metadata.seq_lens_cpu if metadata.seq_lens_cpu is not None else metadata.seq_lens.cpu()
        ).tolist()
        for r in range(metadata.num_reqs):
            q0, q1, s = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
            if q1 == q0:
                continue
            if q1 - q0 > s:
                raise ValueError(f"request {r}: query_len={q1 - q0} exceeds seq_len={s}")
            k, v = gather_request_kv(cache, metadata.block_table[r], s, klayout)
            o = attend_one_request(
                q[q0:q1],
                dequant(k, k_scale),
                dequant(v, v_scale),
                scale=self.scale,
                causal=self.causal,
                sliding_window=self.sliding_window,
                sinks=params.sinks,
                softcap=self.softcap,
                alibi_slopes=params.alibi_slopes,
            )
            result[q0:q1] = o.to(result.dtype)
        if q.shape[0] > metadata.num_actual_tokens:
            result[metadata.num_actual_tokens :] = 0
        return result


class TorchSDPABackend(AttentionBackend):
    NAME: ClassVar[str] = "TORCH_SDPA"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        kv_quant_modes=("none", "fp8_per_tensor"),
        head_size_rule=(1, 1024, 1),
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
        cudagraph_support="never",
        needs_gpu=False,
        notes="Reference: gathers pages per request, float32 math; CPU default and test oracle.",
    )
    builder_cls = MetadataBuilder
    impl_cls = TorchSDPAImpl
