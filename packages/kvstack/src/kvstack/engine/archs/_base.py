"""What every architecture module declares (:class:`ArchFamily`) and the parsing helpers they
share. Imports nothing of the engine, so ``hf_config`` can read the registry without a cycle."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LAYER_TYPES",
    "ArchFamily",
    "ParseFn",
    "check_layer_types",
    "moe_top_k",
    "positive_int",
    "refuse_set",
    "require",
]

LAYER_TYPES = ("full_attention", "sliding_attention")

#: ``parse(cfg, base) -> fields``: ``cfg`` is ``config.json``; ``base`` holds the fields every
#: family shares, already parsed (``num_layers``, ``num_q_heads``, ``head_dim``, ...). Returns the
#: :class:`~kvstack.engine.hf_config.ArchConfig` fields this family sets or overrides, always
#: ``layer_types`` and ``sliding_window``.
ParseFn = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class ArchFamily:
    """One served architecture: its ``config.json`` names, its parser and its tiny test config.

    ``tiny`` is a transformers config (``model_type`` plus overrides of the shared tiny sizes in
    :mod:`kvstack.engine.testing`) chosen to exercise what makes the family different;
    ``checks(arch)`` asserts that the parsed tiny config still does (a config that lost its window
    or its sinks would let the parity test pass vacuously). ``renames`` maps checkpoint tensor-name
    suffixes to the engine's parameter names where transformers saves another name;
    ``skips_extra_layers`` drops the tensors of layers past the config's count.
    """

    name: str
    architectures: tuple[str, ...]
    parse: ParseFn
    tiny: Mapping[str, Any]
    checks: Callable[[Any], None]
    summary: str
    renames: Mapping[str, str] = field(default_factory=dict)
    #: Checkpoint tensors of layers past ``num_hidden_layers`` are not the model's (DeepSeek-V3's
    #: multi-token-prediction layer 61, which transformers skips too) and are not loaded.
    skips_extra_layers: bool = False
    #: Parameters (name suffixes) kept in float32 whatever the model's dtype, as transformers'
    #: ``_keep_in_fp32_modules_strict`` keeps them (the DeepSeek-style router: a bf16 router
    #: would pick other experts than the checkpoint's own reference).
    keep_fp32: tuple[str, ...] = ()


def require(d: Mapping[str, Any], key: str, where: str = "config.json") -> Any:
    if d.get(key) is None:
        raise ValueError(f"{where} has no {key!r}; the engine needs it to build the model")
    return d[key]


def positive_int(d: Mapping[str, Any], key: str, *, default: int | None = None) -> int:
    value = d.get(key, default) if default is not None else require(d, key)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json {key}={value!r} must be a positive int")
    return value


def refuse_set(cfg: Mapping[str, Any], key: str, allowed: Sequence[object], why: str) -> None:
    """Refuse ``cfg[key]`` unless it is absent or one of ``allowed`` (never ignore a field)."""
    value = cfg.get(key)
    if value is not None and value not in allowed:
        raise ValueError(
            f"config.json {key}={value!r} is not supported (the engine serves {list(allowed)}): {why}"
        )


def check_layer_types(
    types: Sequence[str], num_layers: int, window: object
) -> tuple[tuple[str, ...], int | None]:
    """``layer_types`` checked against the layer count and kinds, with the window they need."""
    types = tuple(types)
    if len(types) != num_layers:
        raise ValueError(
            f"config.json layer_types has {len(types)} entries; num_hidden_layers={num_layers}"
        )
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types has {bad}; the engine serves {list(LAYER_TYPES)}")
    if "sliding_attention" not in types:
        return types, None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(
            f"layer_types has sliding_attention layers but sliding_window={window!r}; "
            "set a positive window in tokens"
        )
    return types, window


def moe_top_k(cfg: Mapping[str, Any], experts_key: str) -> tuple[int, int]:
    """``(num_experts, num_experts_per_tok)``, the second at most the first."""
    n = positive_int(cfg, experts_key)
    k = positive_int(cfg, "num_experts_per_tok")
    if k > n:
        raise ValueError(f"num_experts_per_tok={k} exceeds {experts_key}={n}; lower it to <= {n}")
    return n, k
