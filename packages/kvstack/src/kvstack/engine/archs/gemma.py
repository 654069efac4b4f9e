"""Gemma-2 (``Gemma2ForCausalLM``) and Gemma-3 text (``Gemma3ForCausalLM``).

What sets them apart from Llama:

- RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from one), and every layer
  has four norms: before and after attention, before and after the MLP (the "after" norms apply to
  the sublayer's output, before the residual add);
- the embedding output is multiplied by ``sqrt(hidden_size)`` (in the activation dtype);
- attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- the MLP is GeGLU with the tanh-approximated GELU (``hidden_activation="gelu_pytorch_tanh"``);
- sliding and full layers alternate (``layer_types``);
- Gemma-2: a logit softcap on attention scores (``attn_logit_softcapping``) and on the final
  logits (``final_logit_softcapping``);
- Gemma-3: per-head q/k RMSNorm (with the ``1 + weight`` rule), RoPE parameters per layer type
  (``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``), the final softcap
  only (transformers' Gemma-3 attention never applies ``attn_logit_softcapping``, so a config that
  sets it is refused rather than silently served without it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvstack.engine.archs._base import ArchFamily, check_layer_types, refuse_set

__all__ = ["GEMMA2", "GEMMA3"]


def _softcap(cfg: Mapping[str, Any], key: str) -> float:
    value = cfg.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"config.json {key}={value!r} must be a positive number or null (off)")
    return float(value)


def _common(cfg: Mapping[str, Any], base: Mapping[str, Any], period: int) -> dict[str, Any]:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"hidden_activation={act!r} is not supported (Gemma's MLP is GeGLU with "
            "'gelu_pytorch_tanh')"
        )
    refuse_set(
        cfg, "use_bidirectional_attention", [False],
        "bidirectional (non-causal) attention is for Gemma's encoder uses, not generation",
    )  # fmt: skip
    n = base["num_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)
    ]
    layer_types, window = check_layer_types(types, n, cfg.get("sliding_window"))
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is None:
        scalar = base["head_dim"]
    if isinstance(scalar, bool) or not isinstance(scalar, int | float) or not scalar > 0:
        raise ValueError(f"config.json query_pre_attn_scalar={scalar!r} must be a positive number")
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        layer_types=layer_types,
        sliding_window=window,
        attention_bias=bias,
        o_proj_bias=bias,
        hidden_act="gelu_pytorch_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=math.sqrt(base["hidden_size"]),
        attn_scale=float(scalar) ** -0.5,
        final_softcap=_softcap(cfg, "final_logit_softcapping"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _parse_gemma2(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    return dict(_common(cfg, base, 2), attn_softcap=_softcap(cfg, "attn_logit_softcapping"))


def _parse_gemma3(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"config.json attn_logit_softcapping={cfg['attn_logit_softcapping']!r} is not "
            "supported for Gemma-3: transformers' Gemma-3 attention never applies it, so the "
            "checkpoint was trained without it; set it to null"
        )
    period = int(cfg.get("_sliding_window_pattern") or cfg.get("sliding_window_pattern") or 6)
    return dict(
        _common(cfg, base, period),
        qk_norm=True,
        rope_per_layer_type=True,
        rope_parameters=_gemma3_rope_parameters(cfg),
    )


def _gemma3_rope_parameters(cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE per layer type as transformers 5 reads a Gemma-3 config, older ones included: the
    released checkpoints' ``config.json`` carry ``rope_theta`` (global layers, default 1e6),
    ``rope_local_base_freq`` (local layers, default 1e4) and ``rope_scaling`` (global layers
    only) instead of ``rope_parameters``; a missing theta takes those defaults too."""
    params = cfg.get("rope_parameters")
    out: dict[str, dict[str, Any]] = {
        t: dict(params.get(t) or {"rope_type": "default"})
        if isinstance(params, Mapping)
        else {"rope_type": "default"}
        for t in ("full_attention", "sliding_attention")
    }
    if cfg.get("rope_scaling") is not None:
        out["full_attention"].update(cfg["rope_scaling"])
    out["full_attention"].setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
    out["sliding_attention"].setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0)
    return out


def _check_gemma2(arch: Any) -> None:
    assert arch.attn_softcap == 50.0 and arch.final_softcap == 30.0 and arch.norm_offset == 1.0
    assert arch.layer_types == ("sliding_attention", "full_attention") and arch.sliding_window == 6
    assert arch.attn_scale == 24.0**-0.5 and arch.embed_scale and arch.sandwich_norms


def _check_gemma3(arch: Any) -> None:
    assert arch.qk_norm and arch.norm_offset == 1.0 and arch.attn_softcap == 0.0
    assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    ropes = {t: arch.layer_rope(i) for i, t in enumerate(arch.layer_types)}
    assert ropes["full_attention"].rope_type == "linear"
    assert ropes["full_attention"].theta != ropes["sliding_attention"].theta


GEMMA2 = ArchFamily(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    parse=_parse_gemma2,
    # Both softcaps (small enough to bend the tiny model's logits), a query_pre_attn_scalar that
    # differs from head_dim, sliding/full alternating with a window shorter than the prompts.
    tiny=dict(
        model_type="gemma2",
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    checks=_check_gemma2,
    summary="Gemma-2 (attention and final softcap, query_pre_attn_scalar, (1 + w) norms)",
)

GEMMA3 = ArchFamily(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    parse=_parse_gemma3,
    # Local, global, local (pattern 2); RoPE per layer type: the global layers' linear scaling and
    # theta differ from the local ones'; the final softcap.
    tiny=dict(
        model_type="gemma3_text",
        num_hidden_layers=3,
        sliding_window=6,
        sliding_window_pattern=2,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    checks=_check_gemma3,
    summary="Gemma-3 text (q/k norm, RoPE per layer type, local/global layers, final softcap)",
)
