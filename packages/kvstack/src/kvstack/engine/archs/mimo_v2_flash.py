"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): the model DiffKV was built for.

- q/k heads of ``head_dim`` (192), v heads of ``v_head_dim`` (128): K/V pages of different widths
  (``head_size_v``), served without padding V to K's width;
- hybrid ``layer_types``: sliding-window layers have twice ``num_key_value_heads`` and one learned
  sink logit per query head (``attention_sink_bias`` in the checkpoint); full layers neither;
- partial rotary: RoPE turns the first ``int(head_dim * partial_rotary_factor)`` dims of each head,
  with parameters per layer type (``rope_parameters = {"full_attention": ..., "sliding_attention":
  ...}``, each with its own theta and factor);
- values scaled by ``attention_value_scale`` before attention;
- ``mlp_layer_types``: dense SwiGLU layers, then DeepSeek-style sparse layers (sigmoid router with
  ``e_score_correction_bias`` for the choice, ``n_group`` / ``topk_group`` group-limited routing,
  ``norm_topk_prob``, ``routed_scaling_factor``), no shared experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstack.engine.archs._base import ArchFamily, check_layer_types, moe_top_k, positive_int
from kvstack.engine.archs.deepseek_v3 import routed_moe_fields

__all__ = ["MIMO_V2_FLASH"]


def _parse(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (MiMo's MLPs are SwiGLU/silu)")
    n = base["num_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention" for i in range(n)
    ]
    window = cfg.get("sliding_window")
    if cfg.get("sliding_window_size") is not None:
        # transformers: the reference attends to sliding_window_size previous tokens plus the
        # query, so the window (which counts the query) is one more.
        window = positive_int(cfg, "sliding_window_size") + 1
    layer_types, window = check_layer_types(types, n, window)
    mlp = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if len(mlp) != n or not set(mlp) <= {"dense", "sparse"}:
        raise ValueError(
            f"config.json mlp_layer_types={mlp!r} must list 'dense' or 'sparse' for each of the "
            f"{n} layers"
        )
    v_scale = cfg.get("attention_value_scale")
    v_scale = 1.0 if v_scale is None else v_scale
    if isinstance(v_scale, bool) or not isinstance(v_scale, int | float) or not v_scale > 0:
        raise ValueError(f"config.json attention_value_scale={v_scale!r} must be a positive number")
    out = dict(
        layer_types=layer_types,
        sliding_window=window,
        v_head_dim=positive_int(cfg, "v_head_dim"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_proj_bias=False,
        sliding_num_kv_heads=2 * base["num_kv_heads"],
        has_sinks="sliding_attention" in layer_types,
        sink_layer_types=("sliding_attention",),
        v_scale=float(v_scale),
        rope_per_layer_type=True,
        partial_rotary_default=0.334,
        rope_parameters=_rope_parameters(cfg),
        mlp_layer_types=tuple(mlp),
    )
    if "sparse" in mlp:
        experts, top_k = moe_top_k(cfg, "n_routed_experts")
        out.update(
            moe_kind="grouped_sigmoid",
            num_experts=experts,
            num_experts_per_tok=top_k,
            **routed_moe_fields(cfg, experts),
        )
    return out


#: transformers' RoPE per layer type when a config names none (the released thetas).
_DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def _rope_parameters(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """``rope_parameters`` keyed by layer type, or transformers' defaults when the config has
    none. transformers then ignores flat ``rope_theta`` / ``swa_rope_theta``; a config whose
    flat values differ from the defaults is refused rather than served with either meaning."""
    params = cfg.get("rope_parameters")
    if params is not None:
        return dict(params)
    for key, t in (("rope_theta", "full_attention"), ("swa_rope_theta", "sliding_attention")):
        value = cfg.get(key)
        if value is not None and float(value) != _DEFAULT_ROPE[t]["rope_theta"]:
            raise ValueError(
                f"config.json {key}={value!r} without rope_parameters: transformers ignores it "
                f"(and uses {_DEFAULT_ROPE[t]['rope_theta']:g}); give rope_parameters keyed by "
                "layer type ({'full_attention': {...}, 'sliding_attention': {...}})"
            )
    return _DEFAULT_ROPE


def _checks(arch: Any) -> None:
    assert (arch.head_dim, arch.v_head_dim) == (192, 128)
    assert arch.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [arch.layer_num_kv_heads(i) for i in range(3)] == [1, 2, 2]
    assert [arch.layer_has_sinks(i) for i in range(3)] == [False, True, True]
    assert arch.mlp_layer_types == ("dense", "sparse", "sparse") and arch.n_group == 2
    assert arch.v_scale != 1.0
    full, swa = arch.layer_rope(0), arch.layer_rope(1)
    assert full.theta != swa.theta and arch.rotary_dim(0) == 64 < arch.head_dim


MIMO_V2_FLASH = ArchFamily(
    name="mimo_v2_flash",
    architectures=("MiMoV2FlashForCausalLM",),
    parse=_parse,
    # The real head shape (192 / 128, rotary over the first 64 dims), a window shorter than the
    # prompts, sinks on the sliding layers, 8 experts in 2 groups (top-1 group, top-2 experts).
    tiny=dict(
        model_type="mimo_v2_flash",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=192,
        v_head_dim=128,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        sliding_window=6,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        routed_scaling_factor=1.5,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "partial_rotary_factor": 0.334,
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.334,
            },
        },
    ),
    checks=_checks,
    summary="MiMo-V2-Flash (head 192 / V 128, sinks on sliding layers, partial RoPE per type, MoE)",
    renames={"self_attn.attention_sink_bias": "self_attn.sinks"},
    keep_fp32=("mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
)
