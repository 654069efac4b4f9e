"""gpt-oss (``GptOssForCausalLM``): attention biases, one learned sink logit per query head on
every layer, sliding/full layers alternating, a top-k mixture of experts with a clamped SwiGLU
(gate and up interleaved in one stacked tensor), RMSNorm weight applied before the cast back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstack.engine.archs._base import ArchFamily, check_layer_types, moe_top_k

__all__ = ["GPT_OSS"]


def _parse(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    n = base["num_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
    ]
    layer_types, window = check_layer_types(types, n, cfg.get("sliding_window"))
    experts, top_k = moe_top_k(cfg, "num_local_experts")
    bias = bool(cfg.get("attention_bias", True))
    return dict(
        layer_types=layer_types,
        sliding_window=window,
        attention_bias=bias,
        o_proj_bias=bias,
        has_sinks=True,
        sink_layer_types=("full_attention", "sliding_attention"),
        norm_weight_first=True,
        moe_kind="gpt_oss",
        num_experts=experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )


def _checks(arch: Any) -> None:
    assert arch.has_sinks and arch.is_moe and arch.attention_bias and arch.rope.rope_type == "yarn"
    assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")


GPT_OSS = ArchFamily(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    parse=_parse,
    # Sinks, sliding/full alternating, 4 experts top-2 with a tight clamp, YaRN.
    tiny=dict(
        model_type="gpt_oss",
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        swiglu_limit=2.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    checks=_checks,
    summary="gpt-oss (sinks, alternating sliding/full, clamped-SwiGLU MoE, YaRN)",
)
