"""Parse a Hugging Face ``config.json`` into one frozen :class:`ArchConfig`.

Only the fields the reference engine reads are kept, each with the meaning transformers 5 gives
it. Anything the engine cannot honour (an unknown architecture, an activation other than the
family's, a RoPE variant that depends on the batch) is refused here with the field, the value and
what is supported, so a model never runs with a silently different meaning.

The fields every family shares are parsed here; what makes a family different is parsed by its
module in :mod:`kvstack.engine.archs` (one module per architecture, one registry), which sets the
switches of :class:`ArchConfig` the model reads: projection biases, per-head q/k norms, sinks and
which layer types carry them, sliding-window layers, per-type RoPE and partial rotary, Gemma's
norms, scales and softcaps, the kind of MLP or MoE per layer, MLA's low ranks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kv_spec import AttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from kvstack.engine.archs import ARCHITECTURES, family_of
from kvstack.engine.archs._base import LAYER_TYPES as _LAYER_TYPES

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "RopeConfig",
    "checkpoint_dtype",
    "load_arch_config",
    "read_json_object",
]

#: ``architectures[0]`` -> the name of the family that serves it (:mod:`kvstack.engine.archs`).
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {a: f.name for a, f in ARCHITECTURES.items()}

# transformers' ``default_theta`` per model type, used when a config names no rope_theta.
_DEFAULT_THETA = {"gpt_oss": 150000.0}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{where} has no {key!r}; the engine needs it to build the model")
    return d[key]


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' ``rope_parameters``).

    ``rope_type`` is ``default``, ``linear`` (positions divided by ``factor``), ``llama3``
    (Llama 3.1's per-frequency smoothing) or ``yarn`` (gpt-oss; cos/sin scaled by
    ``attention_factor``). ``dynamic`` NTK is refused: transformers recomputes its frequencies from
    the longest position in the *batch*, so a token's logits would depend on its neighbours.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    #: The fraction of each head RoPE turns (its first ``int(head_dim * factor)`` dims).
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(
        cls,
        cfg: Mapping[str, Any],
        model_type: str,
        *,
        params: Mapping[str, Any] | None = None,
        partial_default: float | None = None,
    ) -> RopeConfig:
        """From ``cfg``'s ``rope_parameters`` (or ``params``, one layer type's entry of them).
        ``partial_default``: the family allows partial rotary and defaults to this fraction; without
        it, any ``partial_rotary_factor`` but 1 is refused."""
        if params is None:
            params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        params = dict(params)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"rope_parameters.rope_type={rope_type!r} is not supported; the engine implements "
                f"{list(_ROPE_TYPES)} ('dynamic' NTK depends on the batch's longest sequence)"
            )
        prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if partial_default is None and prf not in (None, 1, 1.0):
            raise ValueError(
                f"partial_rotary_factor={prf} is not supported for {model_type!r} (only "
                "full-width rotary, 1.0)"
            )
        if prf is None:
            prf = 1.0 if partial_default is None else partial_default
        if isinstance(prf, bool) or not isinstance(prf, int | float) or not 0 < prf <= 1:
            raise ValueError(f"partial_rotary_factor={prf!r} must be a number in (0, 1]")
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            theta = _DEFAULT_THETA.get(model_type, 10000.0)
        omp = params.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn") and omp is None:
            omp = cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if rope_type in ("linear", "llama3") and params.get("factor") is None:
            raise ValueError(f"rope_parameters has rope_type={rope_type!r} but no 'factor'")
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor"):
                _require(params, key, "rope_parameters (rope_type='llama3')")
        factor = params.get("factor")
        if rope_type == "yarn" and factor is None:
            # transformers: the ratio of the extended to the pretraining context.
            factor = _require(cfg, "max_position_embeddings", "config") / omp
        return cls(
            rope_type=rope_type,
            theta=float(theta),
            factor=float(factor) if factor is not None else 1.0,
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            original_max_position_embeddings=None if omp is None else int(omp),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            partial_rotary_factor=float(prf),
        )

    def yarn_attention_factor(self) -> float:
        """The cos/sin multiplier of YaRN (1.0 for other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


@dataclass(frozen=True, kw_only=True)
class ArchConfig:
    """What the engine needs from ``config.json`` (and ``generation_config.json`` for EOS).

    The switches past ``bos_token_id`` are set by the family's module (:mod:`kvstack.engine.archs`);
    their defaults are the Llama skeleton's."""

    architecture: str
    family: str  # the registry name of the family (kvstack.engine.archs.FAMILIES)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int  # == head_dim except for DiffKV shapes (MiMo-V2-Flash, MLA, kvstack's flag)
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention", one per layer
    sliding_window: int | None
    attention_bias: bool = False  # on q, k and v
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    has_sinks: bool = False  # some layer has sinks (those of sink_layer_types)
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # -- family switches ---------------------------------------------------------------------
    sink_layer_types: tuple[str, ...] = ()
    sliding_num_kv_heads: int | None = None  # KV heads of sliding layers where they differ
    #: RoPE per layer type (Gemma-3, MiMo-V2-Flash); a type not in it uses :attr:`rope`.
    rope_by_type: Mapping[str, RopeConfig] = field(default_factory=dict)
    norm_weight_first: bool = False  # gpt-oss: (weight * x).to(dtype)
    norm_offset: float = 0.0  # Gemma: x / rms(x) * (offset + weight)
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP as well
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_pytorch_tanh"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    v_scale: float = 1.0  # MiMo-V2-Flash: values times attention_value_scale
    #: "" (dense), "gpt_oss", "mixtral", "softmax_topk" (Qwen3-MoE), "grouped_sigmoid" (DeepSeek)
    moe_kind: str = ""
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer; () = all one kind
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    mla_q_lora_rank: int | None = None
    mla_kv_lora_rank: int = 0  # > 0: multi-head latent attention
    mla_qk_nope_head_dim: int = 0
    mla_qk_rope_head_dim: int = 0
    mla_rope_interleave: bool = False

    # -- derived -----------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank > 0

    @property
    def scale(self) -> float:
        """The attention logits' scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def layer_name(self, i: int) -> str:
        """The KV-cache layer name of decoder layer ``i`` (its attention module's weight prefix)."""
        return f"model.layers.{i}.self_attn"

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer ``i`` in tokens (the query included), ``None`` = full."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_num_kv_heads(self, i: int) -> int:
        if self.sliding_num_kv_heads is not None and self.layer_types[i] == "sliding_attention":
            return self.sliding_num_kv_heads
        return self.num_kv_heads

    def layer_has_sinks(self, i: int) -> bool:
        return self.has_sinks and self.layer_types[i] in self.sink_layer_types

    def layer_rope(self, i: int) -> RopeConfig:
        return self.rope_by_type.get(self.layer_types[i], self.rope)

    def rotary_dim(self, i: int) -> int:
        """How many leading dims of each q/k head layer ``i`` rotates."""
        if self.is_mla:
            return self.mla_qk_rope_head_dim
        return int(self.head_dim * self.layer_rope(i).partial_rotary_factor)

    def layer_mlp(self, i: int) -> str:
        """``"dense"`` or ``"sparse"`` (a mixture of experts) for layer ``i``."""
        if self.mlp_layer_types:
            return self.mlp_layer_types[i]
        return "sparse" if self.is_moe else "dense"

    def kv_specs(
        self, *, block_size: int, dtype: str, mla_latent: bool = False
    ) -> dict[str, AttentionSpec]:
        """One kv-spec spec per layer, keyed by :meth:`layer_name`, in layer order. MLA layers
        get per-head decompressed K/V (``head_dim`` / ``v_head_dim``), or with ``mla_latent``
        one latent row of ``kv_lora_rank + qk_rope_head_dim`` per token (``MLAAttentionSpec``,
        the absorbed form of :meth:`CausalLM.forward`): see :mod:`kvstack.engine.archs.deepseek_v3`."""
        out: dict[str, AttentionSpec] = {}
        if mla_latent and self.is_mla:
            width = self.mla_kv_lora_rank + self.mla_qk_rope_head_dim
            return {
                self.layer_name(i): MLAAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=width, dtype=dtype
                )
                for i in range(self.num_layers)
            }
        for i in range(self.num_layers):
            kw: dict[str, Any] = dict(
                block_size=block_size,
                num_kv_heads=self.layer_num_kv_heads(i),
                head_size=self.head_dim,
                head_size_v=self.v_head_dim,
                dtype=dtype,
            )
            window = self.layer_window(i)
            out[self.layer_name(i)] = (
                SlidingWindowSpec(sliding_window=window, **kw)
                if window is not None
                else FullAttentionSpec(**kw)
            )
        return out

    # -- parsing -----------------------------------------------------------------------------

    @classmethod
    def from_hf(
        cls, cfg: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ArchConfig:
        """Parse a ``config.json`` dict (and optionally ``generation_config.json``)."""
        archs = cfg.get("architectures") or []
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(
                f"config.json architectures={archs!r} is not supported; the engine serves exactly "
                f"one of {sorted(ARCHITECTURES)}"
            )
        arch = archs[0]
        family = family_of(arch)
        model_type = str(cfg.get("model_type", ""))
        if int(cfg.get("pretraining_tp", 1)) != 1:
            raise ValueError(f"pretraining_tp={cfg['pretraining_tp']} is not supported (only 1)")

        def req_int(key: str) -> int:
            value = _require(cfg, key, "config.json")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json {key}={value!r} must be a positive int")
            return value

        hidden = req_int("hidden_size")
        q_heads = req_int("num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or q_heads)
        if q_heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={q_heads} must be a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or hidden // q_heads)
        base: dict[str, Any] = dict(
            architecture=arch,
            family=family.name,
            model_type=model_type,
            vocab_size=req_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=req_int("intermediate_size"),
            num_layers=req_int("num_hidden_layers"),
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=req_int("max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
        )
        fields = family.parse(cfg, base)
        per_type = bool(fields.pop("rope_per_layer_type", False))
        partial = fields.pop("partial_rotary_default", None)
        rope_params = fields.pop("rope_parameters", None)  # a family's reading of older configs
        fields = {**base, **fields}
        v_flag = cfg.get("v_head_dim")
        if (
            v_flag is not None
            and v_flag != fields["head_dim"]
            and fields["v_head_dim"] == fields["head_dim"]
        ):
            raise ValueError(
                f"v_head_dim={v_flag} (DiffKV) is a kvstack flag for Llama-like configs only; "
                f"{arch} keeps v_head_dim == head_dim={fields['head_dim']}"
            )
        fields["rope"], fields["rope_by_type"] = _ropes(
            cfg if rope_params is None else {**cfg, "rope_parameters": rope_params},
            model_type,
            fields["layer_types"],
            per_type=per_type,
            partial_default=partial,
        )
        eos = _eos_ids(cfg.get("eos_token_id"))
        if generation_config is not None:
            eos += tuple(e for e in _eos_ids(generation_config.get("eos_token_id")) if e not in eos)
        out = cls(eos_token_ids=eos, **fields)
        if out.is_mla:
            out = replace(out, attn_scale=_mla_scale(out))
        for i in range(out.num_layers):
            if out.rotary_dim(i) % 2 or out.rotary_dim(i) <= 0:
                raise ValueError(
                    f"layer {i} rotates {out.rotary_dim(i)} dims of head_dim={out.head_dim} "
                    "(partial_rotary_factor); it must be a positive even number"
                )
        return out


def _ropes(
    cfg: Mapping[str, Any],
    model_type: str,
    layer_types: tuple[str, ...],
    *,
    per_type: bool,
    partial_default: float | None,
) -> tuple[RopeConfig, dict[str, RopeConfig]]:
    """The default RoPE and, for families with RoPE per layer type, one per type."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    keyed = isinstance(params, Mapping) and bool(params) and set(params) <= set(_LAYER_TYPES)
    if not keyed:
        rope = RopeConfig.from_hf(cfg, model_type, partial_default=partial_default)
        return rope, {}
    if not per_type:
        raise ValueError(
            f"config.json rope_parameters is keyed by layer type ({sorted(params)}); {model_type!r} "
            "takes one set of RoPE parameters"
        )
    missing = sorted(set(layer_types) - set(params))
    if missing:
        raise ValueError(
            f"config.json rope_parameters has no entry for layer type(s) {missing}; give one per "
            f"type in layer_types ({sorted(set(layer_types))})"
        )
    by_type = {
        t: RopeConfig.from_hf(cfg, model_type, params=params[t], partial_default=partial_default)
        for t in sorted(params)
    }
    return by_type.get("full_attention", next(iter(by_type.values()))), by_type


def _mla_scale(arch: ArchConfig) -> float:
    # transformers' yarn_apply_mscale: a scaled RoPE with mscale_all_dim multiplies the softmax
    # scale by mscale(factor, mscale_all_dim) squared.
    scale = arch.head_dim**-0.5
    rope = arch.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"eos_token_id={value!r} must be an int, a list of ints or null")


def load_arch_config(model_dir: str | Path) -> ArchConfig:
    """Read ``model_dir/config.json`` (and ``generation_config.json`` when present)."""
    root = Path(model_dir)
    path = root / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; model_dir must hold a Hugging Face config.json"
        )
    cfg = read_json_object(path)
    gen_path = root / "generation_config.json"
    gen = read_json_object(gen_path) if gen_path.is_file() else None
    try:
        return ArchConfig.from_hf(cfg, gen)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON object from ``path``; a ``ValueError`` naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: holds a JSON {type(data).__name__}, not an object of config fields"
        )
    return data


def checkpoint_dtype(cfg: Mapping[str, Any]) -> str | None:
    """The dtype a ``config.json`` says its weights are in (``dtype``, or the older
    ``torch_dtype``), as ``"bfloat16"`` / ``"float16"`` / ``"float32"``; None when it names none
    of these."""
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    name = str(value).removeprefix("torch.") if value is not None else None
    return {"bfloat16": "bfloat16", "float16": "float16", "half": "float16",
            "float32": "float32", "float": "float32"}.get(name or "")  # fmt: skip
