"""TRITON: the unified paged-attention kernel of kv-kernels (prefill, chunked prefill and decode
in one launch pair), with every feature the kernel has.

The impl passes ``impl="triton"`` explicitly: on CUDA that is the kernel, on the CPU it works only
under ``TRITON_INTERPRET=1`` (the tests) and otherwise raises; it never quietly runs the reference.
Batch invariance comes from a fixed split count (``num_splits``, default 1 under
``batch_invariant``), which makes each sequence's result independent of the rest of the batch.

Bad metadata on the device. ``check_metadata=True`` gives the impl an int32 counter per device
that the kernels add to instead of syncing: bad block ids / pages and ``q_len > seq_len`` in
attention, slots past the cache in the cache write. Read it when a sync is free anyway (e.g. once
per step, after sampling): ``impl.metadata_errors(device)`` returns the tensor (no sync),
``impl.reset_metadata_errors()`` zeroes it. It is made on the first call on a device (or at
construction with ``device=``), so it exists before a CUDA graph is captured and is updated by
every replay.

Per-token-head quantized caches (``int8_per_token_head`` / ``fp8_per_token_head``) are read with
their inline float32 scales; the layer passes no ``k_scale`` / ``v_scale`` for them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from kv_spec import KVCacheLayout

from kv_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder
from kv_backends.capabilities import BackendCapabilities
from kv_backends.config import AttentionConfig

__all__ = ["TritonBackend", "TritonImpl"]


def _compiles_ahead(device: torch.device) -> bool:
    """Whether kernels build ahead on ``device`` (CUDA; the interpreter compiles nothing)."""
    return device.type == "cuda"


class TritonImpl(AttentionImpl):
    """Per-layer TRITON attention. Options: ``num_splits`` (``None`` = the kernel's heuristic;
    forced to 1 under batch invariance unless given), ``impl`` (``"triton"``; tests may pass
    ``"reference"`` to compare dispatch overhead) and ``check_metadata`` (count bad metadata in
    a device flag, see the module docstring)."""

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        num_splits: int | None = None,
        impl: str = "triton",
        check_metadata: bool = False,
        **kw: Any,
    ) -> None:
        if not isinstance(check_metadata, bool):
            raise TypeError(f"check_metadata={check_metadata!r} must be a bool")
        self.check_metadata = check_metadata
        self._error_flags: dict[torch.device, torch.Tensor] = {}
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

    def device_params(self, device: torch.device) -> Any:
        params = super().device_params(device)
        if self.check_metadata and device not in self._error_flags:
            # made beside the layer's other device tensors: never inside a CUDA-graph capture
            self._error_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return params

    def metadata_errors(self, device: torch.device | str) -> torch.Tensor:
        """The int32 ``[1]`` count of bad metadata the kernels saw on ``device`` since the last
        reset (a device tensor: reading its value is the caller's one sync)."""
        if not self.check_metadata:
            raise ValueError("metadata_errors needs the impl made with check_metadata=True")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device_params(dev)
        return self._error_flags[dev]

    def reset_metadata_errors(self) -> None:
        for flag in self._error_flags.values():
            flag.zero_()

    def _error_flag(self, device: torch.device) -> torch.Tensor | None:
        return self._error_flags[device] if self.check_metadata else None

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
            num_splits=self.num_splits,
            out=result,
            impl=self.impl,
            error_flag=self._error_flag(q.device),
            **self._kernel_features(layer, q, params),
        )
        return result

    def warmup(
        self,
        kv_cache: torch.Tensor,
        *,
        block_table_width: int | None = None,
        block_table_stride: int | None = None,
    ) -> dict[str, float]:
        """The cache write and attention variants a step launches, built through block 0 with
        this layer's options (``kv_kernels.warmup.warm_paged_ops``); ``{}`` off CUDA or with
        ``impl="reference"``."""
        if self.impl != "triton" or not _compiles_ahead(kv_cache.device):
            return {}
        from kv_kernels.warmup import warm_paged_ops

        cache, klayout = self.kernel_cache(kv_cache)
        params = self.device_params(cache.device)
        q = torch.empty(
            0, self.num_q_heads, self.head_size, dtype=self._q_dtype, device=cache.device
        )
        return warm_paged_ops(
            cache,
            klayout,
            num_q_heads=self.num_q_heads,
            q_dtype=self._q_dtype,
            block_table_width=block_table_width,
            block_table_stride=block_table_stride,
            scale=self.scale,
            causal=self.causal,
            num_splits=self.num_splits,
            **self._kernel_features(None, q, params),
        )

    def _kernel_features(self, layer: object, q: torch.Tensor, params: Any) -> dict[str, Any]:
        """The kernel's per-layer feature arguments (window, sinks, softcap, ALiBi, KV scales)."""
        k_scale, v_scale = self.scales(layer, q.device)
        return {
            "sliding_window": self.sliding_window,
            "sinks": params.sinks,
            "softcap": self.softcap,
            "alibi_slopes": params.alibi_slopes,
            "k_scale": k_scale,
            "v_scale": v_scale,
        }


class TritonBackend(AttentionBackend):
    NAME: ClassVar[str] = "TRITON"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"),
        kv_quant_modes=("none", "fp8_per_tensor", "int8_per_token_head", "fp8_per_token_head"),
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
        notes=(
            "kv-kernels' unified Triton kernel; reads any layout order through strides; "
            "per-token-head int8/fp8 caches with inline scales or a scale plane (kv-spec "
            "scale_plane=True: 256-byte rows, the layout decode reads fastest); batch-invariant "
            "with a fixed "
            "num_splits. On sm_90 the prefill of plain 16-bit launches (heads 64, 128, DiffKV "
            "192/128; no ALiBi, soft-cap, window, sinks, quantized cache or split) runs "
            "kv-kernels' warp-specialized Gluon kernel instead (KV_KERNELS_SM90_PREFILL=0 turns "
            "it off), and the decode over fp8 pages (and per-token-head pages with a scale "
            "plane, or inline on cards with 4+ TB/s of memory) a Gluon decode kernel "
            "(KV_KERNELS_SM90_DECODE=0 turns it off)."
        ),
    )
    builder_cls = MetadataBuilder
    impl_cls = TritonImpl
