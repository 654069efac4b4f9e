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

import importlib
from types import ModuleType
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


def _kernels() -> ModuleType:
    """``kv_kernels.paged_attention``, imported on first use (importing this module stays
    cheap) and then read from a module global: an import statement in ``forward`` costs a
    module-table lookup per call. ``forward`` reads the function off the module each call, so a
    test that patches ``kv_kernels.paged_attention.paged_attention`` is still what runs."""
    global _PAGED_ATTENTION_MODULE
    if _PAGED_ATTENTION_MODULE is None:
        _PAGED_ATTENTION_MODULE = importlib.import_module("kv_kernels.paged_attention")
    return _PAGED_ATTENTION_MODULE


_PAGED_ATTENTION_MODULE: ModuleType | None = None

#: paged_attention's keyword defaults that an impl's options often equal (None for the rest).
_DEFAULT_TRUE = frozenset({"causal"})
_DEFAULT_ZERO = frozenset({"softcap"})


def _is_kernel_default(name: str, value: object) -> bool:
    """Whether ``name=value`` is what ``paged_attention`` does without the argument (its
    signature's default: ``causal=True``, ``softcap=0.0``, None for every other option
    an impl passes; ``scale`` and ``impl`` are always given)."""
    if name in ("scale", "impl"):
        return False
    if name in _DEFAULT_TRUE:
        return value is True
    if name in _DEFAULT_ZERO:
        return type(value) is float and value == 0.0
    return value is None


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
        # forward's per-device launch arguments (see _launch_kwargs), made on first use.
        self._launch: dict[torch.device, dict[str, Any]] = {}
        # The cache is already in kernel blocks (no per-step view), as in most plans.
        self._whole_blocks = config.kernel_block_size == layout.block_size

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
        # The host path of every layer's every step, written for it (issue 32: <= 5 us over the
        # direct kernel call). The checks are check_forward_inputs' and empty_output's, each
        # tensor attribute read once (q.shape makes a new Size per read; a wrong rank fails the
        # unpacking) and dtypes compared by identity (torch dtypes are singletons); any failing
        # test runs those methods, which raise the named errors. The kernel's arguments that
        # depend on the layer and the device alone are one dict per device (_launch_kwargs),
        # not rebuilt per call. CPU, kernel replaced by a stub of its signature: the checks were
        # ~0.7 of forward's ~1.25 us over the direct call (bench_host.py --cpu).
        t, hq, _ = self.forward_q_shape(q, kv_cache, metadata)
        if out is None:
            # The kernel writes every real token's row: only padding rows (which see no key)
            # are zeroed, where there are any -- a decode step at a captured size has none, so
            # no fill kernel per layer (32 a step of an 8B model, ~1 us of device time each).
            out = self.empty_output(q, None, zeroed=False)
            n = metadata.num_actual_tokens
            if n < t:
                out[n:].zero_()
        elif out.dtype is not self._q_dtype or out.shape != (t, hq, self.head_size_v):
            out = self.empty_output(q, out)  # (raises the named error)
        if self._whole_blocks:
            cache, klayout = kv_cache, self.layout
        else:
            cache, klayout = self.kernel_cache(kv_cache)
        kw = self._launch.get(q.device) if layer is None else None
        if kw is None:
            kw = self._launch_kwargs(layer, q, q.device)
        if metadata.num_decodes and metadata.max_query_len > 1:
            # a mixed batch: its prefill programs start past its leading decodes (a decode step
            # keeps the default, so one call key serves it whatever its size)
            kw = {**kw, "num_decodes": metadata.num_decodes}
        (_PAGED_ATTENTION_MODULE or _kernels()).paged_attention(
            q,
            cache,
            klayout,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            out=out,
            **kw,
        )
        return out

    def _launch_kwargs(
        self, layer: object, q: torch.Tensor, device: torch.device
    ) -> dict[str, Any]:
        """The kernel's keyword arguments besides the batch's: the impl's options, the error
        counter and the layer's features (:meth:`_kernel_features`: float32 tensors on
        ``device``, made once by :meth:`device_params`). Kept per device for ``layer=None``
        (what engines pass; the impl's own scales); a layer object may carry its own
        ``k_scale`` / ``v_scale`` (dynamic quantization), so its dict is made per call."""
        params = self.device_params(device)
        every = {
            "scale": self.scale,
            "causal": self.causal,
            "num_splits": self.num_splits,
            "impl": self.impl,
            "error_flag": self._error_flag(device),
            **self._kernel_features(layer, q, params),
        }
        # Arguments at paged_attention's defaults are left out (the same call): binding
        # a dozen keywords costs more than the rest of forward's host work together.
        kw = {k: v for k, v in every.items() if not _is_kernel_default(k, v)}
        if layer is None:
            self._launch[device] = kw
        return kw

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
