"""FLASH_ATTN: FlashAttention 2 / 3 / 4 over the packed paged cache, with its version rules as data.

Which version runs is decided by :func:`resolve_fa_version` from the ``version_rules`` of the
backend's ``CAPABILITIES`` literal (what the docs tool reads): ``FA_VERSIONS`` (what each version
supports and which module provides it), ``FA_PREFERRED`` (the version each compute capability
prefers) and ``FA_UPGRADES`` (configs that move a preference to another version) are views of it. When the preferred version is not installed, or cannot
serve the config, the next version of ``FA_FALLBACK_ORDER`` that is installed and can is used, and
the :class:`~kv_backends.Selection` says so. ``AttentionConfig.flash_attn_version`` forces one;
it is validated like everything else (no silent replacement).

K and V are strided views of the packed cache: the kernel-block view ``[B, H, N, C]`` is
transposed to ``[B, N, H, C]`` (NHD, what every FA version's paged API takes; for HND caches the
view is simply strided the other way) and sliced on ``C``. Paged KV goes in as an int32
``page_table`` ``[batch, pages]`` with ``seqused_k``/``cache_seqlens`` (FA3/FA4) or a
``block_table`` with ``cu_seqlens_k`` (FA2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

import torch
from kv_spec import KVCacheLayout

from kv_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder
from kv_backends.capabilities import BackendCapabilities
from kv_backends.config import AttentionConfig, Platform
from kv_backends.metadata import CommonAttentionMetadata

__all__ = [
    "FA_CONDITION_TEXT",
    "FA_FALLBACK_ORDER",
    "FA_PREFERRED",
    "FA_UPGRADES",
    "FA_VERSIONS",
    "FAVersionChoice",
    "FlashAttnBackend",
    "FlashAttnImpl",
    "FlashAttnMetadata",
    "resolve_fa_version",
]

_CONDITIONS: Final = {
    "sinks_with_head_size_v_diff": lambda c: c.has_sinks and c.head_size_v != c.head_size,
    "head_size_over_256": lambda c: c.head_size > 256,
}


def _version_reasons(version: int, config: AttentionConfig, platform: Platform) -> list[str]:
    """Why FA``version`` cannot serve ``config`` on ``platform`` (installation not checked)."""
    rules = FA_VERSIONS[version]
    reasons = []
    if platform.is_cuda:
        cc = platform.compute_capability
        assert cc is not None
        lo, hi = rules["min_compute_capability"], rules["max_compute_capability"]
        if cc < lo or (hi is not None and cc > hi):
            reasons.append(
                f"FA{version} runs on compute capability {lo[0]}.{lo[1]}"
                + (f"-{hi[0]}.{hi[1]}" if hi is not None else "+")
                + f", not {cc[0]}.{cc[1]}"
            )
    if max(config.head_size, config.head_size_v) > rules["max_head_size"]:
        reasons.append(f"FA{version} supports head sizes <= {rules['max_head_size']}")
    if config.head_size_v != config.head_size and not rules["head_size_v_diff"]:
        reasons.append(f"FA{version} needs head_size_v == head_size")
    if config.has_sinks and not rules["sinks"]:
        reasons.append(f"FA{version} has no attention sinks")
    if config.softcap and not rules["softcap"]:
        reasons.append(f"FA{version} has no softcap")
    if config.use_alibi and not rules["alibi"]:
        reasons.append(f"FA{version} has no ALiBi")
    mult = rules["kernel_block_size_multiple_of"]
    if config.kernel_block_size is not None and config.kernel_block_size % mult:
        reasons.append(
            f"FA{version} needs kernel block sizes that are multiples of {mult} (got {config.kernel_block_size})"
        )
    return reasons


@dataclass(frozen=True)
class FAVersionChoice:
    """The FlashAttention version for a config: ``version`` (``None`` = none works), remarks for
    the selection, and the reasons when none works."""

    version: int | None
    notes: tuple[str, ...]
    reasons: tuple[str, ...]


def preferred_fa_version(config: AttentionConfig, platform: Platform) -> tuple[int, list[str]]:
    """The version the rules prefer for ``config`` on ``platform``, with the rules that applied."""
    cc = platform.compute_capability or (0, 0)
    version = next(v for major, v in FA_PREFERRED if cc[0] >= major)
    why = [f"FA{version} preferred on {platform.label}"]
    for rule in FA_UPGRADES:
        if (
            cc[0] == rule["on_major"]
            and version == rule["from_version"]
            and _CONDITIONS[rule["when"]](config)
        ):
            version = rule["to_version"]
            why.append(
                f"FA{rule['from_version']} -> FA{version} on {platform.label} because "
                f"{FA_CONDITION_TEXT[rule['when']]}"
            )
    return version, why


def resolve_fa_version(config: AttentionConfig, platform: Platform) -> FAVersionChoice:
    """Apply the version rules (see the module docstring)."""
    if not platform.is_cuda:
        return FAVersionChoice(None, (), ("FlashAttention needs a CUDA GPU",))
    if config.flash_attn_version is not None:
        v = config.flash_attn_version
        reasons = _version_reasons(v, config, platform)
        if not platform.has_module(FA_VERSIONS[v]["module"]):
            reasons.append(
                f"FA{v} requested but {FA_VERSIONS[v]['module']} is not installed "
                f"(package {FA_VERSIONS[v]['package']})"
            )
        return FAVersionChoice(
            None if reasons else v,
            (f"runs FA{v} ({FA_VERSIONS[v]['module']}): requested by flash_attn_version",)
            if not reasons
            else (),
            tuple(reasons),
        )
    preferred, why = preferred_fa_version(config, platform)
    candidates = [preferred] + [v for v in FA_FALLBACK_ORDER if v != preferred]
    skipped: list[str] = []
    for v in candidates:
        module = FA_VERSIONS[v]["module"]
        problems = _version_reasons(v, config, platform)
        if not platform.has_module(module):
            problems.insert(0, f"FA{v}: {module} not installed")
        if not problems:
            detail = [*why, *skipped] if (v != preferred or len(why) > 1) else []
            note = f"runs FA{v} ({module})" + (": " + "; ".join(detail) if detail else "")
            return FAVersionChoice(v, (note,), ())
        skipped.append("; ".join(problems))
    return FAVersionChoice(None, (), (*why, *skipped))


@dataclass(frozen=True, kw_only=True)
class FlashAttnMetadata(AttentionMetadata):
    """FA metadata: int32 offsets, and ``cu_seqlens_k`` for FA2's paged varlen call."""

    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32


class FlashAttnMetadataBuilder(MetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        base = super().build(common)
        cu_k = torch.zeros(base.num_reqs + 1, dtype=torch.int32, device=base.seq_lens.device)
        torch.cumsum(base.seq_lens, 0, out=cu_k[1:])
        return FlashAttnMetadata(
            **{f: getattr(base, f) for f in base.__dataclass_fields__},
            cu_seqlens_k=cu_k,
        )


class FlashAttnImpl(AttentionImpl):
    """Per-layer FlashAttention. ``version`` (option) is the FA major version; when not given it
    is resolved from the rules for the current CUDA device once, at construction."""

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        version: int | None = None,
        platform: Platform | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, layout, **kw)
        if version is None:
            choice = resolve_fa_version(config, platform or Platform.detect())
            if choice.version is None:
                raise ValueError(
                    "no FlashAttention version can serve this layer: " + "; ".join(choice.reasons)
                )
            version = choice.version
        elif version not in FA_VERSIONS:
            raise ValueError(
                f"FlashAttention version={version!r} must be one of {list(FA_VERSIONS)}"
            )
        self.version = version
        self._fn: Any = None  # the version's entry point, imported on first use
        self._sinks_bf16: dict[torch.device, torch.Tensor] = {}

    def _fa4_sinks(self, device: torch.device) -> torch.Tensor | None:
        # FA4 takes learnable sinks in bf16; cast once per device, not per step.
        sinks = self.device_params(device).sinks
        if sinks is None:
            return None
        cached = self._sinks_bf16.get(device)
        if cached is None:
            cached = self._sinks_bf16[device] = sinks.to(torch.bfloat16)
        return cached

    def _func(self) -> Any:
        if self._fn is None:
            if self.version == 4:
                from flash_attn.cute import flash_attn_varlen_func
            elif self.version == 3:
                from flash_attn_interface import flash_attn_with_kvcache as flash_attn_varlen_func
            else:
                from flash_attn import flash_attn_varlen_func
            self._fn = flash_attn_varlen_func
        return self._fn

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_forward_inputs(q, kv_cache, metadata)
        t = metadata.num_actual_tokens
        # Without padding rows and a caller buffer, FA's own output is returned as is (no copy).
        result = self.empty_output(q, out) if (out is not None or q.shape[0] != t) else None
        if t == 0:
            assert result is not None
            return result
        cache, klayout = self.kernel_cache(kv_cache)  # [B, H, N, C]
        nhd = cache.transpose(1, 2)  # [B, N, H, C] view (no copy)
        k0, k1 = klayout.k_range
        assert klayout.v_range is not None
        v0, v1 = klayout.v_range
        k = nhd[..., k0:k1]  # [B, N, H, D] strided view of the packed cache
        v = nhd[..., v0:v1]  # [B, N, H, Dv]
        # FA's (left, right) window: causal layers look back w - 1 keys; a non-causal window
        # bounds both sides (|p - k| < w, docs/attention_semantics.md).
        if self.sliding_window is None:
            window = (-1, -1)
        else:
            w = self.sliding_window - 1
            window = (w, 0) if self.causal else (w, w)
        fn = self._func()
        qa = q[:t]
        o: torch.Tensor
        if self.version == 4:
            o = fn(
                qa,
                k,
                v,
                cu_seqlens_q=metadata.query_start_loc,
                max_seqlen_q=metadata.max_query_len,
                max_seqlen_k=metadata.max_seq_len,
                seqused_k=metadata.seq_lens,
                page_table=metadata.block_table,
                softmax_scale=self.scale,
                causal=self.causal,
                window_size=(None, None) if self.sliding_window is None else window,
                learnable_sink=self._fa4_sinks(q.device),
                softcap=self.softcap,
            )
        elif self.version == 3:
            o = fn(
                qa,
                k,
                v,
                cache_seqlens=metadata.seq_lens,
                page_table=metadata.block_table,
                cu_seqlens_q=metadata.query_start_loc,
                max_seqlen_q=metadata.max_query_len,
                softmax_scale=self.scale,
                causal=self.causal,
                window_size=window,
                softcap=self.softcap,
            )
        else:
            o = fn(
                qa,
                k,
                v,
                metadata.query_start_loc,
                metadata.cu_seqlens_k,
                metadata.max_query_len,
                metadata.max_seq_len,
                softmax_scale=self.scale,
                causal=self.causal,
                window_size=window,
                softcap=self.softcap,
                alibi_slopes=self.device_params(q.device).alibi_slopes,
                block_table=metadata.block_table,
            )
        if isinstance(o, tuple):  # some versions return (out, lse)
            o = o[0]
        if result is None:
            return o
        result[:t] = o
        return result


class FlashAttnBackend(AttentionBackend):
    NAME: ClassVar[str] = "FLASH_ATTN"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float16", "bfloat16"),
        kv_cache_dtypes=("float16", "bfloat16"),
        kv_quant_modes=("none",),
        head_size_rule=(8, 256, 8),
        supports_head_size_v_diff=False,
        kernel_block_size_multiple_of=16,
        supported_layouts=("LBNHC", "LBHNC", "BLNHC", "BLHNC"),
        sinks=True,
        sliding_window=True,
        softcap=True,
        alibi=True,
        mla=False,
        non_causal=True,
        batch_invariant=False,
        cudagraph_support="uniform_batch",
        min_compute_capability=(8, 0),
        needs_gpu=True,
        notes="flash-attn 2/3/4 (version rules below); sinks need FA4, ALiBi FA2; FA2 needs kernel blocks that are multiples of 256.",
        version_rules={
            "title": "FlashAttention version rules",
            "label": "FA{}",
            "config_field": "flash_attn_version",
            "versions": {
                2: {
                    # FA2's compiled extension, not the ``flash_attn`` package: FA4 installs
                    # ``flash_attn/cute``, which makes ``flash_attn`` importable without FA2 (a
                    # GPU conformance run selected FA2 for ALiBi and failed to import it).
                    "module": "flash_attn_2_cuda",
                    "package": "flash-attn",
                    "min_compute_capability": (8, 0),
                    "max_compute_capability": None,
                    "max_head_size": 256,
                    "head_size_v_diff": False,
                    "sinks": False,
                    "softcap": True,
                    "alibi": True,
                    "kernel_block_size_multiple_of": 256,
                },
                3: {
                    "module": "flash_attn_interface",
                    "package": "flash-attn-3 (built from source; no wheels)",
                    "min_compute_capability": (9, 0),
                    "max_compute_capability": (9, 0),
                    "max_head_size": 256,
                    "head_size_v_diff": True,
                    "sinks": False,
                    "softcap": True,
                    "alibi": False,
                    "kernel_block_size_multiple_of": 16,
                },
                4: {
                    "module": "flash_attn.cute",
                    "package": "flash-attn-4",
                    "min_compute_capability": (9, 0),
                    "max_compute_capability": (11, 9),
                    "max_head_size": 256,
                    "head_size_v_diff": True,
                    "sinks": True,
                    "softcap": True,
                    "alibi": False,
                    "kernel_block_size_multiple_of": 16,
                },
            },
            # (min compute capability major, version): the first row whose bound the device meets.
            "preferred": ((10, 4), (9, 3), (0, 2)),
            # On devices of major on_major, from_version becomes to_version when `when` holds.
            "upgrades": (
                {
                    "on_major": 9,
                    "from_version": 3,
                    "to_version": 4,
                    "when": "sinks_with_head_size_v_diff",
                },
                {"on_major": 9, "from_version": 3, "to_version": 4, "when": "head_size_over_256"},
            ),
            "conditions": {
                "sinks_with_head_size_v_diff": "the layer has attention sinks and head_size_v != head_size",
                "head_size_over_256": "head_size > 256",
            },
            "fallback_order": (4, 3, 2),
        },
    )
    builder_cls = FlashAttnMetadataBuilder
    impl_cls = FlashAttnImpl

    @classmethod
    def extra_reasons(cls, config: AttentionConfig, platform: Platform) -> list[str]:
        choice = resolve_fa_version(config, platform)
        return [] if choice.version is not None else list(choice.reasons)

    @classmethod
    def selection_notes(cls, config: AttentionConfig, platform: Platform) -> list[str]:
        return list(resolve_fa_version(config, platform).notes)

    @classmethod
    def supports_kernel_block_size(
        cls, size: int, config: AttentionConfig | None = None, platform: Platform | None = None
    ) -> bool:
        if not cls.CAPABILITIES.kernel_block_size_ok(size):
            return False
        if config is None or platform is None:
            return True
        if config.block_size % size == 0:
            config = config.with_kernel_block_size(size)
        choice = resolve_fa_version(config, platform)
        if choice.version is None:
            return False
        multiple: int = FA_VERSIONS[choice.version]["kernel_block_size_multiple_of"]
        return size % multiple == 0


# The version rules live in the CAPABILITIES literal (one home; the docs tool reads it there).
# These names are views of it, kept for callers and readability.
_RULES: Final[dict[str, Any]] = FlashAttnBackend.CAPABILITIES.version_rules or {}
#: What each FlashAttention major version supports, and where it comes from.
FA_VERSIONS: Final[dict[int, dict[str, Any]]] = _RULES["versions"]
#: ``(min compute capability major, version)``: the first row whose bound the device meets.
FA_PREFERRED: Final[tuple[tuple[int, int], ...]] = _RULES["preferred"]
#: Configs that move a preference (conditions are named; see ``FA_CONDITION_TEXT``).
FA_UPGRADES: Final[tuple[dict[str, Any], ...]] = _RULES["upgrades"]
#: After the preferred version, the order in which others are tried.
FA_FALLBACK_ORDER: Final[tuple[int, ...]] = _RULES["fallback_order"]
#: What each named condition of ``FA_UPGRADES`` means (for people and the docs).
FA_CONDITION_TEXT: Final[dict[str, str]] = _RULES["conditions"]
