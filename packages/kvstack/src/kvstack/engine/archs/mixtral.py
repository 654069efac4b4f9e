"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a sparse MoE in place of the MLP.

The router (``block_sparse_moe.gate``) takes a softmax over all experts, keeps the top k and
renormalizes them to sum to one; each expert is a SwiGLU named ``w1`` (gate), ``w3`` (up) and
``w2`` (down), as the checkpoints store them. ``sliding_window`` (when set) applies to every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstack.engine.archs._base import ArchFamily, check_layer_types, moe_top_k

__all__ = ["MIXTRAL"]


def _parse(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (Mixtral's experts are SwiGLU/silu)")
    window = cfg.get("sliding_window")
    kind = "sliding_attention" if window is not None else "full_attention"
    layer_types, window = check_layer_types([kind] * base["num_layers"], base["num_layers"], window)
    experts, top_k = moe_top_k(cfg, "num_local_experts")
    return dict(
        layer_types=layer_types,
        sliding_window=window,
        moe_kind="mixtral",
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=base["intermediate_size"],
        norm_topk_prob=True,
    )


def _checks(arch: Any) -> None:
    assert arch.moe_kind == "mixtral" and arch.num_experts == 4 and arch.num_experts_per_tok == 2
    assert set(arch.layer_types) == {"sliding_attention"} and arch.sliding_window == 8


MIXTRAL = ArchFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    parse=_parse,
    # 4 experts top-2 on every layer, a window shorter than the prompts.
    tiny=dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    checks=_checks,
    summary="Mixtral (softmax top-k MoE, optional sliding window)",
)
