"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention and a routed MoE.

- MLA: queries through a low-rank ``q_a_proj`` -> RMSNorm -> ``q_b_proj`` (or one ``q_proj`` when
  ``q_lora_rank`` is null); one latent per token, ``kv_a_proj_with_mqa`` -> ``kv_lora_rank``
  compressed K/V (RMSNorm'd) plus a shared ``qk_rope_head_dim`` rotary key; ``kv_b_proj``
  decompresses the latent to per-head ``qk_nope_head_dim`` keys and ``v_head_dim`` values. Query
  and key heads are ``qk_nope_head_dim + qk_rope_head_dim`` wide (192 in the release), values
  ``v_head_dim`` (128). RoPE turns only the rope part, with ``rope_interleave`` pairs (x0, x1),
  (x2, x3), ... Scale ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
  under YaRN.
- MoE from layer ``first_k_dense_replace`` on: sigmoid router scores, ``e_score_correction_bias``
  added for the choice only, experts split into ``n_group`` groups of which the ``topk_group`` with
  the best two-expert sums are eligible, ``norm_topk_prob``, ``routed_scaling_factor``, plus
  ``n_shared_experts`` always-on experts (one SwiGLU of ``n_shared_experts *
  moe_intermediate_size``).

The engine's model computes the decompressed K/V per head, so the cache-free reference and any
backend serving ``head_size_v != head_size`` can run it; the latent cache (one
``kv_lora_rank + qk_rope_head_dim`` row per token, kv-spec's ``MLAAttentionSpec``) with absorbed
decode runs where a backend declares MLA: TORCH_SDPA on the CPU, TRITON_MLA on a GPU (the
runner picks the latent cache then, decompressed K/V otherwise). Over the latent cache, prefill
rows attend K/V decompressed from it per step (:mod:`kvstack.engine.mla_prefill`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstack.engine.archs._base import ArchFamily, check_layer_types, moe_top_k, positive_int

__all__ = ["DEEPSEEK_V3", "routed_moe_fields"]


def routed_moe_fields(cfg: Mapping[str, Any], experts: int) -> dict[str, Any]:
    """The DeepSeek-style router's fields (shared with MiMo-V2-Flash)."""
    groups = positive_int(cfg, "n_group", default=1)
    top_groups = positive_int(cfg, "topk_group", default=1)
    if experts % groups:
        raise ValueError(f"config.json n_group={groups} must divide the {experts} routed experts")
    if top_groups > groups:
        raise ValueError(f"config.json topk_group={top_groups} exceeds n_group={groups}")
    if experts // groups < 2:
        raise ValueError(
            f"config.json n_group={groups} leaves {experts // groups} expert(s) a group; the router "
            "scores a group by its best two experts, so each group needs at least 2"
        )
    scale = cfg.get("routed_scaling_factor")
    scaling = 1.0 if scale is None else float(scale)
    topk_method = cfg.get("topk_method")
    if topk_method not in (None, "noaux_tc"):
        raise ValueError(
            f"config.json topk_method={topk_method!r} is not supported (transformers and the "
            "engine route with 'noaux_tc': sigmoid scores, bias-corrected group-limited top-k)"
        )
    scoring = cfg.get("scoring_func")
    if scoring not in (None, "sigmoid"):
        raise ValueError(f"config.json scoring_func={scoring!r} is not supported (only 'sigmoid')")
    return dict(
        moe_intermediate_size=positive_int(cfg, "moe_intermediate_size"),
        n_group=groups,
        topk_group=top_groups,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=scaling,
    )


def _parse(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (DeepSeek's MLPs are SwiGLU/silu)")
    n = base["num_layers"]
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None:
        q_lora = positive_int(cfg, "q_lora_rank")
    nope = positive_int(cfg, "qk_nope_head_dim")
    rope = positive_int(cfg, "qk_rope_head_dim")
    if rope % 2:
        raise ValueError(f"config.json qk_rope_head_dim={rope} must be even (RoPE turns pairs)")
    experts, top_k = moe_top_k(cfg, "n_routed_experts")
    first_dense = cfg.get("first_k_dense_replace")
    first_dense = 0 if first_dense is None else int(first_dense)
    if not 0 <= first_dense <= n:
        raise ValueError(f"config.json first_k_dense_replace={first_dense} must be in [0, {n}]")
    shared = cfg.get("n_shared_experts")
    layer_types, window = check_layer_types(["full_attention"] * n, n, None)
    return dict(
        layer_types=layer_types,
        sliding_window=window,
        # Decompressed per-head K/V: every query head has its own key/value head.
        num_kv_heads=base["num_q_heads"],
        head_dim=nope + rope,
        v_head_dim=positive_int(cfg, "v_head_dim"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        mla_q_lora_rank=q_lora,
        mla_kv_lora_rank=positive_int(cfg, "kv_lora_rank"),
        mla_qk_nope_head_dim=nope,
        mla_qk_rope_head_dim=rope,
        mla_rope_interleave=bool(cfg.get("rope_interleave", True)),
        moe_kind="grouped_sigmoid",
        num_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=0 if shared is None else int(shared),
        mlp_layer_types=tuple("dense" if i < first_dense else "sparse" for i in range(n)),
        **routed_moe_fields(cfg, experts),
    )


def _checks(arch: Any) -> None:
    assert arch.is_mla and arch.mla_q_lora_rank and arch.mla_rope_interleave
    assert (arch.head_dim, arch.v_head_dim) == (32, 16) and arch.rotary_dim(0) == 16
    assert arch.rope.rope_type == "yarn" and arch.attn_scale != arch.head_dim**-0.5
    assert arch.mlp_layer_types == ("dense", "sparse", "sparse")
    assert arch.n_group == 4 and arch.topk_group == 2 and arch.n_shared_experts == 1


DEEPSEEK_V3 = ArchFamily(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    parse=_parse,
    # MLA with both low ranks (a 32 + 16 latent row: a width TRITON_MLA's kernel takes), YaRN
    # with mscale (scale != head_dim ** -0.5), one dense layer,
    # then 8 experts in 4 groups (top-2 groups, top-2 experts) and a shared expert.
    tiny=dict(
        model_type="deepseek_v3",
        num_hidden_layers=3,
        num_key_value_heads=4,
        head_dim=16,  # transformers' rotary reads head_dim: DeepSeek's is qk_rope_head_dim
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    checks=_checks,
    summary="DeepSeek-V3 (MLA with q/kv low rank and YaRN, grouped sigmoid MoE + shared experts)",
    skips_extra_layers=True,
    keep_fp32=("mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
)
