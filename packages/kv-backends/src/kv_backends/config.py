"""What a backend is asked to serve (:class:`AttentionConfig`) and where (:class:`Platform`)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kv_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVQuantMode,
    LayoutOrder,
    MLAAttentionSpec,
    ModelConfig,
    SlidingWindowSpec,
    get_model,
    normalize_dtype,
)

__all__ = ["AttentionConfig", "Platform", "check_tensor_parallel", "configs_for_model"]


def _check_positive_int(name: str, value: object, *, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"AttentionConfig.{name}={value!r} must be a positive int{extra}; "
            f"got {type(value).__name__}"
        )
    if value <= 0:
        raise ValueError(f"AttentionConfig.{name}={value} must be a positive int{extra}")


def _check_softcap(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"AttentionConfig.softcap={value!r} must be a float >= 0 (0 = off); "
            f"got {type(value).__name__}"
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"AttentionConfig.softcap={value!r} must be a finite float >= 0 (0 = off); "
            "NaN or inf would turn every logit into NaN or leave it uncapped"
        )
    return float(value)


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """One attention layer (or group of identical layers) as a backend sees it.

    Build it with :meth:`from_spec` from a kv-spec spec plus the model facts a spec does not hold
    (query heads, sinks, softcap, alibi). ``block_size`` is the manager block size of the group;
    ``kernel_block_size`` the page size the kernel addresses (a divisor of ``block_size``, see
    :func:`kv_backends.prepare_kernel_block_sizes`). ``sliding_window`` counts tokens, the current
    one included; ``None`` = full attention.
    """

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"
    kv_quant: str = "none"
    block_size: int = 16
    kernel_block_size: int | None = None
    layout_order: str = "LBNHC"
    sliding_window: int | None = None
    has_sinks: bool = False
    softcap: float = 0.0
    use_alibi: bool = False
    causal: bool = True
    mla: bool = False
    batch_invariant: bool = False
    #: FlashAttention major version to force (2, 3 or 4); ``None`` = follow the version rules.
    flash_attn_version: int | None = None
    kind: str = "full"

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_size", "head_size_v", "block_size"):
            _check_positive_int(name, getattr(self, name))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"AttentionConfig.num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (GQA groups query heads per KV head)"
            )
        for name in ("has_sinks", "use_alibi", "causal", "mla", "batch_invariant"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"AttentionConfig.{name}={value!r} must be a bool")
        if not isinstance(self.kind, str):
            raise TypeError(f"AttentionConfig.kind={self.kind!r} must be a str (e.g. 'full')")
        object.__setattr__(
            self, "dtype", normalize_dtype(self.dtype, field="AttentionConfig.dtype")
        )
        object.__setattr__(
            self,
            "kv_cache_dtype",
            normalize_dtype(self.kv_cache_dtype, field="AttentionConfig.kv_cache_dtype"),
        )
        object.__setattr__(self, "kv_quant", KVQuantMode.parse(self.kv_quant).value)
        object.__setattr__(self, "layout_order", LayoutOrder.parse(self.layout_order).value)
        if self.kernel_block_size is None:
            object.__setattr__(self, "kernel_block_size", self.block_size)
        kbs = self.kernel_block_size
        _check_positive_int("kernel_block_size", kbs)
        assert kbs is not None
        if self.block_size % kbs:
            raise ValueError(
                f"AttentionConfig.kernel_block_size={kbs} must be a positive divisor of "
                f"block_size={self.block_size}"
            )
        if self.sliding_window is not None:
            _check_positive_int(
                "sliding_window", self.sliding_window, extra=" or None (full attention)"
            )
        object.__setattr__(self, "softcap", _check_softcap(self.softcap))
        if isinstance(self.flash_attn_version, bool) or self.flash_attn_version not in (
            None,
            2,
            3,
            4,
        ):
            raise ValueError(
                f"AttentionConfig.flash_attn_version={self.flash_attn_version!r} must be 2, 3, 4 or None"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def kernel_blocks_per_block(self) -> int:
        assert self.kernel_block_size is not None
        return self.block_size // self.kernel_block_size

    def with_kernel_block_size(self, kernel_block_size: int) -> AttentionConfig:
        return replace(self, kernel_block_size=kernel_block_size)

    @classmethod
    def from_spec(
        cls,
        spec: AttentionSpec,
        *,
        num_q_heads: int,
        dtype: str | None = None,
        has_sinks: bool = False,
        softcap: float = 0.0,
        use_alibi: bool = False,
        layout_order: LayoutOrder | str = LayoutOrder.LBNHC,
        kernel_block_size: int | None = None,
        batch_invariant: bool = False,
        flash_attn_version: int | None = None,
    ) -> AttentionConfig:
        """The config of a layer with ``spec`` in a model with ``num_q_heads`` query heads (per rank).

        ``dtype`` is the compute dtype (defaults to the spec's dtype when that is a float dtype,
        else bfloat16, e.g. for an fp8 cache).
        """
        if isinstance(spec, ChunkedLocalAttentionSpec):
            raise ValueError(
                "ChunkedLocalAttentionSpec layers are not served by kv-backends yet: no backend "
                "implements chunked-local masking; file an issue with the model name"
            )
        mla = isinstance(spec, MLAAttentionSpec)
        compute = dtype or (
            spec.dtype if spec.dtype in ("float32", "float16", "bfloat16") else "bfloat16"
        )
        return cls(
            num_q_heads=num_q_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            head_size_v=spec.v_size,
            dtype=compute,
            kv_cache_dtype=spec.dtype,
            kv_quant=spec.kv_quant.value,
            block_size=spec.block_size,
            kernel_block_size=kernel_block_size,
            layout_order=LayoutOrder.parse(layout_order).value,
            sliding_window=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
            has_sinks=has_sinks,
            softcap=softcap,
            use_alibi=use_alibi,
            causal=not isinstance(spec, CrossAttentionSpec),
            mla=mla,
            batch_invariant=batch_invariant,
            flash_attn_version=flash_attn_version,
            kind=spec.kind,
        )


def configs_for_model(
    model: ModelConfig | str,
    *,
    block_size: int = 16,
    dtype: str | None = None,
    tensor_parallel_size: int = 1,
    layout_order: LayoutOrder | str = LayoutOrder.LBNHC,
) -> dict[str, AttentionConfig]:
    """The distinct attention configs of a catalogue model, keyed by a readable name.

    Keys are ``"<kind> (layers a-b, ...)"``, e.g. ``"sliding_window (18 layers)"``; layers with
    equal configs share one entry. Query heads are split over ``tensor_parallel_size`` ranks
    (see :func:`check_tensor_parallel` for the sizes that are accepted).
    """
    m = get_model(model) if isinstance(model, str) else model
    tp = check_tensor_parallel(m, tensor_parallel_size)
    specs = m.kv_specs(block_size=block_size, dtype=dtype, tensor_parallel_size=tp)
    q_heads = m.num_q_heads // tp
    by_config: dict[AttentionConfig, list[int]] = {}
    for i, spec in enumerate(specs.values()):
        cfg = AttentionConfig.from_spec(
            spec, num_q_heads=q_heads, has_sinks=m.layer_has_sinks(i), layout_order=layout_order
        )
        by_config.setdefault(cfg, []).append(i)
    return {f"{cfg.kind} ({len(layers)} layers)": cfg for cfg, layers in by_config.items()}


def check_tensor_parallel(model: ModelConfig, tensor_parallel_size: object) -> int:
    """``tensor_parallel_size`` if ``model``'s heads split evenly over it, else ``ValueError``.

    The rule (vLLM's): query heads must divide evenly (``num_q_heads % tp == 0``); KV heads are
    split when ``tp <= num_kv_heads`` (``num_kv_heads % tp == 0``) and replicated when
    ``tp > num_kv_heads`` (``tp % num_kv_heads == 0``, each rank keeps one head). MLA's single
    latent is replicated on every rank. Nothing is floored or clamped.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
        raise TypeError(
            f"tensor_parallel_size={tensor_parallel_size!r} must be a positive int; "
            f"got {type(tensor_parallel_size).__name__}"
        )
    tp = tensor_parallel_size
    if tp <= 0:
        raise ValueError(f"tensor_parallel_size={tp} must be a positive int")
    if model.num_q_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {model.name}'s {model.num_q_heads} query "
            f"heads; use one of {_divisors(model.num_q_heads)}"
        )
    if model.mla:
        return tp
    kv_head_counts = {model.num_kv_heads}
    if model.swa_num_kv_heads:
        kv_head_counts.add(model.swa_num_kv_heads)
    for heads in sorted(kv_head_counts):
        if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
            raise ValueError(
                f"tensor_parallel_size={tp} neither divides {model.name}'s {heads} KV heads nor is "
                f"a multiple of them (to replicate one head per rank); use a divisor of {heads} or a "
                f"multiple of {heads} that divides {model.num_q_heads}"
            )
    return tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _default_probe(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        # find_spec imports parent packages; a broken parent means the module is not usable.
        return False


@dataclass(frozen=True)
class Platform:
    """Where attention runs: ``name`` ``"cpu"`` or ``"cuda"``, the device's compute capability,
    and which optional modules are importable.

    ``installed`` (a set of module names) replaces the import probe, so tests can pretend that
    e.g. only ``flash_attn.cute`` (FA4) is installed on an sm_90 machine.
    """

    name: str
    compute_capability: tuple[int, int] | None = None
    installed: frozenset[str] | None = None
    probe: Callable[[str], bool] = field(default=_default_probe, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.name not in ("cpu", "cuda"):
            raise ValueError(f"Platform.name={self.name!r} must be 'cpu' or 'cuda'")
        if self.name == "cuda" and self.compute_capability is None:
            raise ValueError("a cuda Platform needs compute_capability=(major, minor), e.g. (9, 0)")
        if self.name == "cpu" and self.compute_capability is not None:
            raise ValueError("a cpu Platform has no compute_capability; pass None")
        if self.installed is not None:
            object.__setattr__(self, "installed", frozenset(self.installed))

    @classmethod
    def cpu(cls, installed: Iterable[str] | None = None) -> Platform:
        return cls("cpu", None, None if installed is None else frozenset(installed))

    @classmethod
    def cuda(
        cls, compute_capability: tuple[int, int], installed: Iterable[str] | None = None
    ) -> Platform:
        major, minor = compute_capability
        return cls(
            "cuda", (int(major), int(minor)), None if installed is None else frozenset(installed)
        )

    @classmethod
    def detect(cls, device: str | int | Any = None) -> Platform:
        """The platform of ``device`` (default: the current CUDA device if any, else the CPU)."""
        import torch

        dev = torch.device(device) if device is not None else None
        if (dev is None and torch.cuda.is_available()) or (dev is not None and dev.type == "cuda"):
            cc = torch.cuda.get_device_capability(dev)
            return cls("cuda", (int(cc[0]), int(cc[1])))
        return cls("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    @property
    def label(self) -> str:
        """``"cpu"`` or ``"sm_90"``-style."""
        if self.compute_capability is None:
            return self.name
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    def has_module(self, module: str) -> bool:
        """Whether ``module`` is importable here (the injected set when given)."""
        if self.installed is not None:
            return module in self.installed
        return self.probe(module)

    def with_installed(self, installed: Iterable[str]) -> Platform:
        return replace(self, installed=frozenset(installed))
