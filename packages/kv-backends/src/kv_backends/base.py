"""The backend contract: a class with one literal :class:`BackendCapabilities`, a metadata builder
per KV group and an impl per layer (:mod:`kv_backends.impl`, re-exported here).

Nothing here keeps mutable state on a class: per-layer facts (``head_size_v``, scales, window,
sinks) live on impl instances, per-batch facts on metadata instances, persistent buffers on
builder instances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from kv_spec import KVCacheLayout

from kv_backends.capabilities import BackendCapabilities
from kv_backends.config import AttentionConfig, Platform
from kv_backends.impl import (
    AttentionImpl,
    LayerParams,
    check_config_and_layout,
    kernel_block_view,
    kernel_split_problem,
)
from kv_backends.metadata import CommonAttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "LayerParams",
    "MetadataBuilder",
    "kernel_block_view",
    "kernel_split_problem",
]


def _cc(cc: tuple[int, int] | None) -> str:
    return "-" if cc is None else f"{cc[0]}.{cc[1]}"


class AttentionBackend:
    """Base of every backend. Subclasses set ``NAME`` and ``CAPABILITIES`` (one literal each),
    and the builder/impl classes."""

    NAME: ClassVar[str] = ""
    CAPABILITIES: ClassVar[BackendCapabilities]
    builder_cls: ClassVar[type[MetadataBuilder]]
    impl_cls: ClassVar[type[AttentionImpl]]

    def __init__(self) -> None:
        raise TypeError(
            f"{type(self).__name__} is used through its classmethods (validate, make_builder, "
            "make_impl); it has no instances"
        )

    # -- validation --------------------------------------------------------------------------

    @classmethod
    def validate(
        cls,
        config: AttentionConfig,
        platform: Platform | None = None,
        *,
        layout: KVCacheLayout | None = None,
    ) -> list[str]:
        """Every reason this backend cannot serve ``config`` on ``platform`` (empty = usable).

        With ``platform=None`` only device-independent rules are checked. With ``layout`` (the
        cache this backend will read) kv-spec's kernel-block rule is asked of it, scale plane
        and page padding included; a config alone cannot tell those.
        """
        if layout is not None:
            check_config_and_layout(config, layout)
        caps = cls.CAPABILITIES
        reasons: list[str] = []
        if config.dtype not in caps.dtypes:
            reasons.append(f"dtype {config.dtype} not supported (supports {list(caps.dtypes)})")
        if config.kv_cache_dtype not in caps.kv_cache_dtypes:
            reasons.append(
                f"kv-cache dtype {config.kv_cache_dtype} not supported (supports {list(caps.kv_cache_dtypes)})"
            )
        if config.kv_quant not in caps.kv_quant_modes:
            reasons.append(
                f"kv_quant {config.kv_quant} not supported (supports {list(caps.kv_quant_modes)})"
            )
        if not caps.head_size_ok(config.head_size):
            reasons.append(
                f"head_size {config.head_size} not supported (must be {caps.describe_head_sizes()})"
            )
        if config.head_size_v != config.head_size:
            if not caps.supports_head_size_v_diff:
                reasons.append(
                    f"head_size_v {config.head_size_v} != head_size {config.head_size} not supported"
                )
            elif not caps.head_size_ok(config.head_size_v):
                reasons.append(
                    f"head_size_v {config.head_size_v} not supported (must be {caps.describe_head_sizes()})"
                )
        elif caps.requires_head_size_v_diff:
            reasons.append(
                f"serves only layers with head_size_v != head_size (got {config.head_size}/{config.head_size_v})"
            )
        kbs = config.kernel_block_size
        assert kbs is not None
        if not caps.kernel_block_size_ok(kbs):
            reasons.append(
                f"kernel block size {kbs} not supported (must be {caps.describe_kernel_block_sizes()})"
            )
        if config.layout_order not in caps.supported_layouts:
            reasons.append(
                f"layout {config.layout_order} not supported (reads {list(caps.supported_layouts)})"
            )
        elif caps.required_layout is not None and config.layout_order != caps.required_layout:
            reasons.append(f"requires layout {caps.required_layout}, got {config.layout_order}")
        split = kernel_split_problem(config.layout_order, config.block_size, kbs, layout)
        if split is not None:
            reasons.append(split)
        for flag, supported, what in (
            (config.has_sinks, caps.sinks, "attention sinks"),
            (config.sliding_window is not None, caps.sliding_window, "sliding window"),
            (config.softcap > 0, caps.softcap, "logit softcap"),
            (config.use_alibi, caps.alibi, "ALiBi"),
            (config.mla, caps.mla, "MLA"),
            (not config.causal, caps.non_causal, "non-causal attention"),
            (config.batch_invariant, caps.batch_invariant, "batch invariance"),
        ):
            if flag and not supported:
                reasons.append(f"{what} not supported")
        if platform is not None:
            reasons += cls._platform_reasons(platform)
            if not reasons:
                reasons += cls.extra_reasons(config, platform)
        return reasons

    @classmethod
    def _platform_reasons(cls, platform: Platform) -> list[str]:
        caps = cls.CAPABILITIES
        if not platform.is_cuda:
            return ["needs a CUDA GPU"] if caps.needs_gpu else []
        cc = platform.compute_capability
        assert cc is not None
        lo, hi = caps.min_compute_capability, caps.max_compute_capability
        if lo is not None and cc < lo:
            return [f"needs compute capability >= {_cc(lo)} (device has {_cc(cc)})"]
        if hi is not None and cc > hi:
            return [f"needs compute capability <= {_cc(hi)} (device has {_cc(cc)})"]
        return []

    @classmethod
    def extra_reasons(cls, config: AttentionConfig, platform: Platform) -> list[str]:
        """Rules that are not plain capabilities (installed packages, version rules); hook."""
        return []

    @classmethod
    def selection_notes(cls, config: AttentionConfig, platform: Platform) -> list[str]:
        """Remarks for :class:`kv_backends.Selection` when this backend is chosen; hook."""
        return []

    @classmethod
    def supports_kernel_block_size(
        cls, size: int, config: AttentionConfig | None = None, platform: Platform | None = None
    ) -> bool:
        """Whether ``size`` is a kernel block size this backend takes (``config``/``platform``
        let version-dependent backends narrow it)."""
        return cls.CAPABILITIES.kernel_block_size_ok(size)

    @classmethod
    def engine_impl_options(
        cls, *, device: torch.device, kv_cache_bytes: int, num_layers: int
    ) -> dict[str, Any]:
        """Options for :meth:`make_impl` that an engine passes when it reports every write its
        KV caches receive outside torch's in-place ops (a connector's raw load: the engine
        calls ``torch.autograd.graph.increment_version`` on the cache after it), for a cache of
        ``kv_cache_bytes`` over ``num_layers`` layers on ``device``; hook (none by default).

        An engine learns here what a backend may keep between steps without naming the backend;
        the backend keeps the policy (how much memory, on which devices) beside the feature."""
        return {}

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def make_builder(
        cls,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        device: torch.device | str = "cpu",
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        **options: Any,
    ) -> MetadataBuilder:
        """One builder per KV group; it owns that group's persistent metadata buffers."""
        check_config_and_layout(config, layout)
        return cls.builder_cls(
            config,
            layout,
            device=torch.device(device),
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            **options,
        )

    @classmethod
    def make_impl(
        cls,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        **options: Any,
    ) -> AttentionImpl:
        """One impl per layer; it carries that layer's head sizes, scales, window and sinks.

        Raises ``ValueError`` with every reason when the backend cannot serve ``config``.
        """
        check_config_and_layout(config, layout)
        reasons = cls.validate(config, layout=layout)
        if reasons:
            raise ValueError(f"{cls.NAME} cannot serve this layer: " + "; ".join(reasons))
        return cls.impl_cls(
            config,
            layout,
            scale=scale,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
            k_scale=k_scale,
            v_scale=v_scale,
            **options,
        )


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """Per-batch metadata most backends need (int32 where kernels want int32)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, kernel block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    num_reqs: int
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    #: requests from the first with one query token each
    #: (:meth:`CommonAttentionMetadata.leading_decodes`; 0 where unknown, always a true value)
    num_decodes: int = 0


class MetadataBuilder:
    """Turns a :class:`CommonAttentionMetadata` into one backend's metadata (one builder per group)."""

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        device: torch.device,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        **options: Any,
    ) -> None:
        check_config_and_layout(config, layout)
        if options:
            raise ValueError(f"{type(self).__name__} takes no options; got {sorted(options)}")
        if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} and max_num_seqs={max_num_seqs} "
                "must be positive"
            )
        self.config = config
        self.layout = layout
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

    def build(self, common: CommonAttentionMetadata) -> Any:
        if common.num_actual_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"batch has {common.num_actual_tokens} tokens; this builder was made for "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        return AttentionMetadata(
            query_start_loc=common.query_start_loc.to(torch.int32),
            seq_lens=common.seq_lens.to(torch.int32),
            block_table=common.block_table.to(torch.int32),
            slot_mapping=common.slot_mapping,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            query_start_loc_cpu=common.query_start_loc_cpu,
            seq_lens_cpu=common.seq_lens_cpu,
            num_decodes=common.leading_decodes(),
        )
