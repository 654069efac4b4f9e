"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm) with a sparse MoE.

The router takes a softmax over all experts and keeps the top k, renormalized only with
``norm_topk_prob``; with ``use_sliding_window`` every layer is windowed; layers in ``mlp_only_layers`` (or off the ``decoder_sparse_step`` stride) keep a
dense SwiGLU of ``intermediate_size``, experts have ``moe_intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstack.engine.archs._base import ArchFamily, check_layer_types, moe_top_k, positive_int

__all__ = ["QWEN3_MOE"]


def _parse(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (Qwen3-MoE's MLPs are SwiGLU/silu)")
    n = base["num_layers"]
    # transformers: the window (with use_sliding_window) applies to every layer, as Mistral's.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    kind = "sliding_attention" if window is not None else "full_attention"
    layer_types, window = check_layer_types([kind] * n, n, window)
    bias = bool(cfg.get("attention_bias", False))
    # transformers 5 saves num_experts as num_local_experts (its attribute_map); older configs
    # carry num_experts.
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts, top_k = moe_top_k(cfg, key)
    step = positive_int(cfg, "decoder_sparse_step", default=1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < n for i in dense):
        raise ValueError(
            f"config.json mlp_only_layers={dense!r} must be a list of layer indices in [0, {n})"
        )
    return dict(
        layer_types=layer_types,
        sliding_window=window,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        moe_kind="softmax_topk",
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=positive_int(cfg, "moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        mlp_layer_types=tuple(
            "dense" if i in dense or (i + 1) % step else "sparse" for i in range(n)
        ),
    )


def _checks(arch: Any) -> None:
    assert arch.qk_norm and arch.moe_kind == "softmax_topk" and not arch.norm_topk_prob
    assert arch.mlp_layer_types == ("dense", "sparse", "sparse")
    assert set(arch.layer_types) == {"full_attention"}


QWEN3_MOE = ArchFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    parse=_parse,
    # Layer 0 dense (mlp_only_layers), then 4 experts top-2 without renormalization. No window
    # (Mixtral and Mistral cover a window on every layer; with one here the engine test's pool
    # would free enough blocks never to preempt).
    tiny=dict(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        norm_topk_prob=False,
    ),
    checks=_checks,
    summary="Qwen3-MoE (q/k norm, softmax top-k MoE, dense mlp_only_layers, optional sliding window)",
)
