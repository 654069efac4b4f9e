"""Parse a Hugging Face ``config.json`` into one frozen :class:`ArchConfig`.

Only the fields the reference engine reads are kept, each with the meaning transformers 5 gives
it. Anything the engine cannot honour (an unknown architecture, an activation other than SiLU, a
RoPE variant that depends on the batch) is refused here with the field, the value and what is
supported, so a model never runs with a silently different meaning.

Families:

- ``llama``: ``LlamaForCausalLM``, ``MistralForCausalLM`` (``sliding_window`` on every layer),
  ``Qwen3ForCausalLM`` (RMSNorm on each head of q and k before RoPE; ``layer_types`` choose
  sliding-window layers). A Llama config may add ``v_head_dim`` (kvstack's own flag, not a
  transformers field): values and the output projection use ``v_head_dim`` columns per head while
  queries and keys keep ``head_dim`` -- the DiffKV shape (e.g. 192/128) served by backends with
  ``head_size_v != head_size``.
- ``gpt_oss``: ``GptOssForCausalLM``: attention bias, one learned sink logit per query head,
  ``layer_types`` alternating sliding/full, a top-k mixture of experts with a clamped SwiGLU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_spec import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "RopeConfig",
    "checkpoint_dtype",
    "load_arch_config",
    "read_json_object",
]

#: ``architectures[0]`` -> model family (the module layout that serves it).
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "GptOssForCausalLM": "gpt_oss",
}

# transformers' ``default_theta`` per model type, used when a config names no rope_theta.
_DEFAULT_THETA = {"gpt_oss": 150000.0}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER_TYPES = ("full_attention", "sliding_attention")


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

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], model_type: str) -> RopeConfig:
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"rope_parameters.rope_type={rope_type!r} is not supported; the engine implements "
                f"{list(_ROPE_TYPES)} ('dynamic' NTK depends on the batch's longest sequence)"
            )
        prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if prf not in (None, 1, 1.0):
            raise ValueError(
                f"partial_rotary_factor={prf} is not supported (only full-width rotary, 1.0)"
            )
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
    """What the engine needs from ``config.json`` (and ``generation_config.json`` for EOS)."""

    architecture: str
    family: str  # "llama" | "gpt_oss"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int  # == head_dim except for kvstack's DiffKV flag
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention", one per layer
    sliding_window: int | None
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    has_sinks: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    # -- derived -----------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_name(self, i: int) -> str:
        """The KV-cache layer name of decoder layer ``i`` (its attention module's weight prefix)."""
        return f"model.layers.{i}.self_attn"

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer ``i`` in tokens (the query included), ``None`` = full."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def kv_specs(self, *, block_size: int, dtype: str) -> dict[str, AttentionSpec]:
        """One kv-spec spec per layer, keyed by :meth:`layer_name`, in layer order."""
        out: dict[str, AttentionSpec] = {}
        for i in range(self.num_layers):
            kw: dict[str, Any] = dict(
                block_size=block_size,
                num_kv_heads=self.num_kv_heads,
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
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json architectures={archs!r} is not supported; the engine serves exactly "
                f"one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        family = SUPPORTED_ARCHITECTURES[arch]
        model_type = str(cfg.get("model_type", ""))
        act = cfg.get("hidden_act", "silu")
        if family == "llama" and act != "silu":
            raise ValueError(
                f"hidden_act={act!r} is not supported (the engine's MLP is SwiGLU/silu)"
            )
        if int(cfg.get("pretraining_tp", 1)) != 1:
            raise ValueError(f"pretraining_tp={cfg['pretraining_tp']} is not supported (only 1)")

        def req_int(key: str) -> int:
            value = _require(cfg, key, "config.json")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json {key}={value!r} must be a positive int")
            return value

        hidden = req_int("hidden_size")
        num_layers = req_int("num_hidden_layers")
        q_heads = req_int("num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or q_heads)
        if q_heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={q_heads} must be a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or hidden // q_heads)
        v_head_dim = int(cfg.get("v_head_dim") or head_dim)
        if v_head_dim != head_dim and family != "llama":
            raise ValueError(
                f"v_head_dim={v_head_dim} (DiffKV) is a kvstack flag for Llama-like configs only; "
                f"{arch} keeps v_head_dim == head_dim={head_dim}"
            )
        layer_types, window = _layer_types(cfg, arch, num_layers)
        eos = _eos_ids(cfg.get("eos_token_id"))
        if generation_config is not None:
            eos += tuple(e for e in _eos_ids(generation_config.get("eos_token_id")) if e not in eos)
        moe: dict[str, Any] = {}
        if family == "gpt_oss":
            moe = dict(
                num_experts=req_int("num_local_experts"),
                num_experts_per_tok=req_int("num_experts_per_tok"),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            )
            if moe["num_experts_per_tok"] > moe["num_experts"]:
                raise ValueError(
                    f"num_experts_per_tok={moe['num_experts_per_tok']} exceeds "
                    f"num_local_experts={moe['num_experts']}"
                )
        return cls(
            architecture=arch,
            family=family,
            model_type=model_type,
            vocab_size=req_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=req_int("intermediate_size"),
            num_layers=num_layers,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=req_int("max_position_embeddings"),
            rope=RopeConfig.from_hf(cfg, model_type),
            layer_types=layer_types,
            sliding_window=window,
            attention_bias=bool(cfg.get("attention_bias", family == "gpt_oss")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            has_sinks=family == "gpt_oss",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            **moe,
        )


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"eos_token_id={value!r} must be an int, a list of ints or null")


def _layer_types(
    cfg: Mapping[str, Any], arch: str, num_layers: int
) -> tuple[tuple[str, ...], int | None]:
    """Per-layer attention kind and the window, following transformers 5 per architecture."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if arch == "MistralForCausalLM":
            # Mistral applies its window (when set) to every layer.
            kind = "sliding_attention" if window is not None else "full_attention"
            types = [kind] * num_layers
        elif arch == "Qwen3ForCausalLM":
            if not cfg.get("use_sliding_window", False):
                window = None
            first = int(cfg.get("max_window_layers", num_layers))
            types = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(num_layers)
            ]
        elif arch == "GptOssForCausalLM":
            types = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ]
        else:
            types = ["full_attention"] * num_layers
    types = tuple(types)
    if len(types) != num_layers:
        raise ValueError(
            f"config.json layer_types has {len(types)} entries; num_hidden_layers={num_layers}"
        )
    bad = sorted({t for t in types if t not in _LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types has {bad}; the engine serves {list(_LAYER_TYPES)}")
    if "sliding_attention" in types:
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ValueError(
                f"layer_types has sliding_attention layers but sliding_window={window!r}; "
                "set a positive window in tokens"
            )
    else:
        window = None
    return types, window


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
