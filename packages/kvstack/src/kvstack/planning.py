"""What the CLI and the demo share: naming a model, checking tensor parallelism, planning its cache.

A model is a catalogue name (``Llama-3-8B``) or a Hugging Face ``config.json`` (or the checkpoint
directory holding one); either way it becomes a :class:`kv_spec.ModelConfig`, the KV-relevant part
of the config, so planning and backend selection treat both alike. A ``config.json`` of an
architecture the engine serves is read by the engine's own parser
(:class:`kvstack.engine.hf_config.ArchConfig`, :func:`model_from_arch`), so ``kvstack plan`` and
``kvstack backends`` describe the cache the engine allocates: MiMo-V2-Flash's sliding layers with
their own KV heads and sinks, DeepSeek-V3's MLA latent; other configs by the generic reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kv_spec import (
    CATALOGUE,
    DTYPE_BYTES,
    NULL_BLOCKS,
    KVCacheConfig,
    KVQuantMode,
    LayoutOrder,
    ModelConfig,
    get_model,
    normalize_dtype,
    plan_kv_cache,
)
from rich.table import Table

from kvstack.units import format_bytes

if TYPE_CHECKING:
    from kvstack.engine.hf_config import ArchConfig

__all__ = [
    "PlanReport",
    "check_tensor_parallel",
    "model_from_arch",
    "model_from_hf_config",
    "plan_model",
    "plan_table",
    "resolve_arch",
    "resolve_model",
]

# Cache dtype implied by a quant mode when the user names none (the mode fixes the storage type).
_QUANT_DTYPE = {
    KVQuantMode.FP8_PER_TENSOR: "fp8_e4m3",
    KVQuantMode.FP8_PER_TOKEN_HEAD: "fp8_e4m3",
    KVQuantMode.INT8_PER_TOKEN_HEAD: "int8",
}


def model_from_arch(arch: ArchConfig, *, name: str, dtype: str = "bfloat16") -> ModelConfig:
    """The :class:`ModelConfig` of the cache the engine allocates for ``arch``
    (:meth:`ArchConfig.kv_specs`): per layer type its KV heads (``sliding_num_kv_heads``), the
    window, the layers with sinks; an MLA model (``mla_kv_lora_rank > 0``) one latent of
    ``kv_lora_rank + qk_rope_head_dim`` per token (DeepSeek-V3: 512 + 64 = 576), as the runner
    caches it wherever a backend serves MLA (TORCH_SDPA on the CPU, TRITON_MLA on a GPU)."""
    n = arch.num_layers
    common: dict[str, Any] = dict(
        name=name,
        num_layers=n,
        num_q_heads=arch.num_q_heads,
        max_model_len=arch.max_position_embeddings,
        dtype=dtype,
        source=arch.model_type,
    )
    if arch.is_mla:
        width = arch.mla_kv_lora_rank + arch.mla_qk_rope_head_dim
        return ModelConfig(**common, num_kv_heads=1, head_size=width, mla=True)
    sliding = tuple(i for i in range(n) if arch.layer_window(i) is not None)
    sinks = {i for i in range(n) if arch.layer_has_sinks(i)}
    sinks_on_sliding_only = bool(sinks) and sinks != set(range(n))
    if sinks_on_sliding_only and sinks != set(sliding):
        raise ValueError(
            f"{name}: sinks on layers {sorted(sinks)} are neither every layer nor exactly the "
            f"sliding ones {list(sliding)}; kv-spec's ModelConfig cannot describe that"
        )
    swa_heads = arch.sliding_num_kv_heads if sliding else None
    return ModelConfig(
        **common,
        num_kv_heads=arch.num_kv_heads,
        head_size=arch.head_dim,
        head_size_v=arch.v_head_dim if arch.v_head_dim != arch.head_dim else None,
        sliding_window=arch.sliding_window if sliding else None,
        sliding_layers=(None if len(sliding) == n else sliding) if sliding else (),
        swa_num_kv_heads=swa_heads if swa_heads != arch.num_kv_heads else None,
        has_sinks=bool(sinks),
        sinks_on_sliding_only=sinks_on_sliding_only,
    )


def _engine_arch(config: dict[str, Any], name: str) -> ArchConfig | None:
    """The engine's reading of ``config`` when it names an architecture the engine serves
    (importing the engine loads torch, so only then), else ``None``."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        return None
    from kvstack.engine.archs import ARCHITECTURES
    from kvstack.engine.hf_config import ArchConfig

    if archs[0] not in ARCHITECTURES:
        return None
    try:
        return ArchConfig.from_hf(config)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def model_from_hf_config(config: dict[str, Any], *, name: str = "config.json") -> ModelConfig:
    """The KV-relevant fields of a Hugging Face ``config.json``.

    An architecture the engine serves (``architectures`` names one of
    :data:`kvstack.engine.archs.ARCHITECTURES`) is read by the engine's parser
    (:func:`model_from_arch`): what the engine allocates, MiMo-V2-Flash's and DeepSeek-V3's
    included. Anything else by the generic reader: sliding layers follow transformers 5,
    ``layer_types`` when present; else gpt-oss alternates (sliding first), Qwen slides from
    ``max_window_layers`` on only with ``use_sliding_window``, and any other model with a
    ``sliding_window`` slides on every layer (Mistral).
    """
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    dtype = dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16"
    arch = _engine_arch(config, name)
    if arch is not None:
        return model_from_arch(arch, name=name, dtype=dtype)
    try:
        layers = int(config["num_hidden_layers"])
        q_heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or q_heads)
        head = int(config.get("head_dim") or int(config["hidden_size"]) // q_heads)
    except KeyError as e:
        raise ValueError(f"{name} has no {e.args[0]!r}; is it a decoder-only LLM config?") from None
    head_v = config.get("head_dim_v") or config.get("v_head_dim")
    window = config.get("sliding_window")
    kind = config.get("model_type")
    types = config.get("layer_types")
    sliding: tuple[int, ...] | None = ()
    if window is None:
        pass
    elif types:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif kind == "gpt_oss":  # transformers' default: sliding first, alternating
        sliding = tuple(range(0, layers, 2))
    elif kind in ("qwen2", "qwen3"):  # off unless asked; then layers from max_window_layers on
        if config.get("use_sliding_window", False):
            sliding = tuple(range(int(config.get("max_window_layers", layers)), layers))
    else:  # Mistral: every layer
        sliding = None
    if sliding == ():
        window = None
    return ModelConfig(
        name=name,
        num_layers=layers,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=int(head_v) if head_v else None,
        max_model_len=int(config.get("max_position_embeddings") or 4096),
        dtype=dtype,
        sliding_window=int(window) if window is not None else None,
        sliding_layers=sliding,
        has_sinks=config.get("model_type") == "gpt_oss",
        source=str(config.get("model_type", "")),
    )


def resolve_arch(text: str) -> ArchConfig | None:
    """The engine's :class:`ArchConfig` of ``text`` when it is a ``config.json`` (or checkpoint
    directory) of an architecture the engine serves, else ``None`` (catalogue names, other
    configs): the facts a :class:`ModelConfig` does not carry (``attn_softcap``)."""
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # resolve_model says why
    return _engine_arch(config, str(path)) if isinstance(config, dict) else None


def resolve_model(text: str) -> ModelConfig:
    """A catalogue name, a ``config.json`` path or a checkpoint directory -> :class:`ModelConfig`."""
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"{text!r}: no such config file (expected a config.json)")
        try:
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {str(path)!r} as JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(
                f"{str(path)!r} holds a JSON {type(config).__name__}, not a config object"
            )
        return model_from_hf_config(config, name=str(path))
    try:
        return get_model(text)
    except ValueError:
        if "/" in text or "\\" in text or text.startswith(("~", ".")):
            raise ValueError(
                f"{text!r}: no such file or directory; give an existing checkpoint directory or "
                f"config.json, or a catalogue name ({', '.join(CATALOGUE)})"
            ) from None
        raise


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Raise unless ``tp`` ranks split ``model``'s heads evenly.

    Query heads must divide; KV heads must divide, or (fewer KV heads than ranks) ``tp`` must be a
    multiple of them so every rank holds a whole replica, as vLLM does.
    """
    if tp < 1:
        raise ValueError(f"--tp={tp} must be at least 1")
    if model.num_q_heads % tp:
        raise ValueError(
            f"--tp={tp} does not divide {model.name}'s {model.num_q_heads} query heads; "
            f"use a divisor of {model.num_q_heads}"
        )
    for heads in {model.num_kv_heads, model.swa_num_kv_heads or model.num_kv_heads}:
        if model.mla:
            break
        if heads % tp and tp % heads:
            raise ValueError(
                f"--tp={tp} neither divides {model.name}'s {heads} KV heads nor is a multiple of "
                "them (a rank would hold part of a head); use a divisor or a multiple"
            )


@dataclass(frozen=True)
class PlanReport:
    """One model's plan, or why it cannot serve a request (then ``config`` is ``None``)."""

    model: ModelConfig
    max_model_len: int
    memory: int
    config: KVCacheConfig | None
    #: Bytes one request of ``max_model_len`` tokens needs (across all layer slots and groups).
    bytes_per_request: int

    @property
    def fits(self) -> bool:
        return self.config is not None

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data for ``kvstack plan --json``."""
        out: dict[str, Any] = {
            "model": self.model.name,
            "memory_bytes": self.memory,
            "max_model_len": self.max_model_len,
            "bytes_per_request": self.bytes_per_request,
            "fits": self.fits,
        }
        cfg = self.config
        if cfg is None:
            return out
        out.update(
            num_blocks=cfg.num_blocks,
            num_layer_slots=cfg.num_layer_slots,
            page_size_bytes=cfg.page_size_bytes,
            total_bytes=cfg.total_bytes,
            layout_order=cfg.layout_order.value,
            scale_plane=cfg.scale_plane,
            requests_at_max_len=cfg.max_concurrency(self.max_model_len),
            groups=[
                {
                    "group_id": g.group_id,
                    "kind": g.spec.kind,
                    "num_layers": len(g.layer_names),
                    "block_size": g.spec.block_size,
                    "num_kv_heads": g.spec.num_kv_heads,
                    "head_size": g.spec.head_size,
                    "head_size_v": g.spec.v_size,
                    "dtype": g.spec.dtype,
                    "kv_quant": g.spec.kv_quant.value,
                    "sliding_window": getattr(g.spec, "sliding_window", None),
                    "tokens": cfg.num_blocks * g.spec.block_size,
                    "layout_hash": cfg.layout(g.group_id).compatibility_hash(),
                }
                for g in cfg.groups
            ],
        )
        return out


def plan_model(
    model: ModelConfig,
    memory: int,
    *,
    max_model_len: int | None = None,
    block_size: int = 16,
    tp: int = 1,
    dtype: str | None = None,
    kv_quant: str = "none",
    layout: str = "LBNHC",
    max_num_batched_tokens: int = 8192,
    scale_plane: bool | None = None,
) -> PlanReport:
    """Plan ``model``'s cache in ``memory`` bytes; a budget too small for one request gives
    a report with ``config=None`` (and what one request needs) rather than an exception.
    ``scale_plane``: where per-token-head scales sit, as kv-spec's ``plan_kv_cache`` takes it
    (``None``: in a plane after each page's data wherever the layout can take one)."""
    check_tensor_parallel(model, tp)
    quant = KVQuantMode.parse(kv_quant)
    if dtype is not None:
        _check_cache_dtype(dtype, quant)
    specs = model.kv_specs(
        block_size=block_size,
        tensor_parallel_size=tp,
        dtype=dtype or _QUANT_DTYPE.get(quant),
        kv_quant=quant,
    )
    mml = max_model_len or model.max_model_len
    order = LayoutOrder.parse(layout)
    # An unlimited budget gives the page geometry, hence what one request costs.
    big = plan_kv_cache(
        specs, 2**62, max_num_batched_tokens=max_num_batched_tokens, layout_order=order,
        scale_plane=scale_plane,
    )  # fmt: skip
    block_bytes = big.page_size_bytes * big.num_layer_slots
    need = big.blocks_per_request(mml) * block_bytes
    if memory < need + NULL_BLOCKS * block_bytes:  # the allocator's null block holds no request
        return PlanReport(model, mml, memory, None, need)
    cfg = plan_kv_cache(
        specs,
        memory,
        max_model_len=mml,
        max_num_batched_tokens=max_num_batched_tokens,
        layout_order=order,
        scale_plane=scale_plane,
    )
    return PlanReport(model, mml, memory, cfg, need)


def _check_cache_dtype(dtype: str, quant: KVQuantMode) -> None:
    """``--dtype`` names an unquantized cache dtype; a quantized one comes from ``--kv-quant``."""
    try:
        name = normalize_dtype(dtype)
    except ValueError:
        raise ValueError(
            f"--dtype={dtype!r} is not a KV-cache dtype; use float32, float16 or bfloat16 "
            "(quantized caches: --kv-quant)"
        ) from None
    if quant is KVQuantMode.NONE and DTYPE_BYTES[name] == 1:
        modes = [m.value for m in KVQuantMode if m is not KVQuantMode.NONE]
        hint = [m for m in modes if m.startswith(name[:3])] or modes
        raise ValueError(
            f"--dtype={dtype!r} is a quantized cache dtype, which --kv-quant chooses: give "
            f"--kv-quant {' or '.join(hint)} (it sets the storage dtype), and --dtype only for "
            "float32, float16 or bfloat16"
        )


def _groups_summary(cfg: KVCacheConfig) -> str:
    counts: dict[tuple[str, int], int] = {}
    for g in cfg.groups:
        key = (g.spec.kind, g.spec.block_size)
        counts[key] = counts.get(key, 0) + len(g.layer_names)
    return (
        ", ".join(f"{n} {kind} (block {bs})" for (kind, bs), n in counts.items())
        + f" in {len(cfg.groups)} group(s)"
    )


def plan_table(title: str, reports: list[PlanReport]) -> Table:
    """A rich table with one row per plan (a red row says what one request would need)."""
    table = Table(title=title)
    for col in (
        "model",
        "page",
        "layer slots",
        "blocks",
        "max_model_len",
        "requests at max len",
        "groups",
    ):
        table.add_column(col, overflow="fold")
    for r in reports:
        cfg = r.config
        if cfg is None:
            table.add_row(
                r.model.name, "-", "-", "-", f"{r.max_model_len:,}",
                f"[red]0 (one request needs {format_bytes(r.bytes_per_request)})[/red]", "-",
            )  # fmt: skip
            continue
        table.add_row(
            r.model.name,
            format_bytes(cfg.page_size_bytes),
            str(cfg.num_layer_slots),
            f"{cfg.num_blocks:,}",
            f"{r.max_model_len:,}",
            f"{cfg.max_concurrency(r.max_model_len):.2f}",
            _groups_summary(cfg),
        )
    return table
