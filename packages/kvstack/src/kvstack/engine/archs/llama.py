"""The Llama skeleton and its close relatives: Llama, Mistral, Qwen3 and Qwen2.

Pre-norm decoder layers, RoPE over whole heads, GQA, a SwiGLU MLP; the four differ in switches:

- ``LlamaForCausalLM``: ``attention_bias`` on q/k/v/o, ``mlp_bias``; kvstack's own
  ``v_head_dim`` flag (values of another width than q/k: the DiffKV shape) is read here only.
- ``MistralForCausalLM``: ``sliding_window`` (when set) on every layer.
- ``Qwen3ForCausalLM``: RMSNorm over each q and k head before RoPE; sliding layers from
  ``layer_types`` or ``use_sliding_window`` + ``max_window_layers``.
- ``Qwen2ForCausalLM``: biases on q, k and v (never on o), sliding layers as Qwen3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstack.engine.archs._base import ArchFamily, check_layer_types

__all__ = ["LLAMA", "MISTRAL", "QWEN2", "QWEN3"]


def _silu_only(cfg: Mapping[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (the engine's MLP is SwiGLU/silu)")


def _qwen_layer_types(cfg: Mapping[str, Any], n: int) -> tuple[tuple[str, ...], int | None]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if not cfg.get("use_sliding_window", False):
            window = None
        first = int(cfg.get("max_window_layers", n))
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(n)
        ]
    return check_layer_types(types, n, window)


def _parse_llama(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    _silu_only(cfg)
    types = cfg.get("layer_types") or ["full_attention"] * base["num_layers"]
    layer_types, window = check_layer_types(types, base["num_layers"], cfg.get("sliding_window"))
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        layer_types=layer_types,
        sliding_window=window,
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        v_head_dim=int(cfg.get("v_head_dim") or base["head_dim"]),
    )


def _parse_mistral(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    _silu_only(cfg)
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        # Mistral applies its window (when set) to every layer.
        kind = "sliding_attention" if window is not None else "full_attention"
        types = [kind] * base["num_layers"]
    layer_types, window = check_layer_types(types, base["num_layers"], window)
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        layer_types=layer_types, sliding_window=window, attention_bias=bias, o_proj_bias=bias
    )


def _parse_qwen3(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    _silu_only(cfg)
    layer_types, window = _qwen_layer_types(cfg, base["num_layers"])
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        layer_types=layer_types,
        sliding_window=window,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
    )


def _parse_qwen2(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    _silu_only(cfg)
    layer_types, window = _qwen_layer_types(cfg, base["num_layers"])
    # Qwen2Attention: q_proj, k_proj and v_proj always carry a bias, o_proj never does.
    return dict(
        layer_types=layer_types, sliding_window=window, attention_bias=True, o_proj_bias=False
    )


def _check_llama(arch: Any) -> None:
    assert arch.rope.rope_type == "llama3"


def _check_mistral(arch: Any) -> None:
    assert set(arch.layer_types) == {"sliding_attention"} and arch.sliding_window == 8


def _check_qwen3(arch: Any) -> None:
    assert arch.qk_norm and arch.tie_word_embeddings
    assert arch.layer_types == ("full_attention", "sliding_attention")


def _check_qwen2(arch: Any) -> None:
    assert arch.attention_bias and not arch.o_proj_bias
    assert arch.layer_types == ("full_attention", "sliding_attention")


LLAMA = ArchFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    parse=_parse_llama,
    # Llama 3.1 RoPE scaling with a short "pretraining" context, so positions past 16 are scaled.
    tiny=dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    checks=_check_llama,
    summary="Llama 2/3 (RoPE scaling default/linear/llama3/yarn; kvstack's DiffKV v_head_dim flag)",
)

MISTRAL = ArchFamily(
    name="mistral",
    architectures=("MistralForCausalLM",),
    parse=_parse_mistral,
    # A window (8) much shorter than the sequences, on every layer.
    tiny=dict(model_type="mistral", sliding_window=8),
    checks=_check_mistral,
    summary="Mistral (sliding window on every layer)",
)

QWEN3 = ArchFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    parse=_parse_qwen3,
    # q/k norm; layer 1 sliding (max_window_layers=1); tied embeddings.
    tiny=dict(
        model_type="qwen3",
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
    checks=_check_qwen3,
    summary="Qwen3 dense (per-head q/k RMSNorm, optional sliding layers)",
)

QWEN2 = ArchFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    parse=_parse_qwen2,
    # q/k/v biases (no o bias); layer 1 sliding with a window shorter than the prompts.
    tiny=dict(
        model_type="qwen2",
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    checks=_check_qwen2,
    summary="Qwen2 / Qwen2.5 (q/k/v bias, optional sliding layers)",
)
