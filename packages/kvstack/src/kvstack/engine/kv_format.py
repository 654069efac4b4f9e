"""What the runner's KV cache stores per token: its element dtype (``kv_cache_dtype``, vLLM's
option of that name) and, for MLA models, one latent row or decompressed K/V per head.

``kv_cache_dtype="auto"`` stores K/V in the model dtype. ``"fp8"`` (an alias of ``"fp8_e4m3"``)
and ``"fp8_e5m2"`` store them in fp8 under kv-spec's ``fp8_per_tensor`` quant: one float32
scale per layer for K and one for V, the cache holding ``x / scale`` and every reader
multiplying back before the dot product (DESIGN.md, "fp8 per-tensor"). The scales are 1.0, as
vLLM's are without calibrated scales in the checkpoint: e4m3 then keeps ``|x| <= 448`` with 3
mantissa bits, e5m2 ``|x| <= 57344`` with 2; kv-kernels' writes saturate past the range.

Where it goes: the planner gets specs of fp8 ``dtype`` and ``kv_quant`` (pages of one byte an
element; per-tensor scales live outside the pages, so there is no scale plane), the selector
keeps only backends whose ``CAPABILITIES`` declare the mode (its rejections name it), and each
layer's impl is made with its own scale tensors (``make_impl(k_scale=, v_scale=)``, the
backend contract's per-layer scales), which the impl's cache write and its attention both read:
the runner's ``attend`` passes ``layer=None``, so the impl's scales are the ones used.

MLA models (DeepSeek-V3) keep one latent row per token (:func:`mla_cache_choice`); in fp8 it is
stored as ``latent / k_scale`` and K and V are both read back from it with that one scale, as
vLLM's fp8 latent cache is (issue 31). Each layer's impl still gets a ``k_scale`` and an equal
``v_scale`` (kv-backends' MLA impls take ``v_scale`` ``None`` or equal to ``k_scale``) and uses
``k_scale`` alone: ``impl.scales(None, device)`` gives ``(k_scale, None)`` for such a layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar

import torch
from kv_backends import AttentionConfig, NoBackendError, Platform, get_backend, select_backend
from kv_spec import AttentionSpec, KVQuantMode, LayoutOrder

if TYPE_CHECKING:
    from kvstack.engine.hf_config import ArchConfig

__all__ = ["KV_CACHE_DTYPES", "KVCacheDtype", "mla_cache_choice", "parse_kv_cache_dtype"]

#: ``kv_cache_dtype`` values, as vLLM spells them (``fp8`` = ``fp8_e4m3``).
KV_CACHE_DTYPES: Final = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_STORAGE: Final[dict[str, str | None]] = {
    "auto": None,
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}
#: The per-tensor dequant scale of every layer's K and V (vLLM's default without calibration).
DEFAULT_KV_SCALE: Final = 1.0

_Spec = TypeVar("_Spec", bound=AttentionSpec)


@dataclass(frozen=True)
class KVCacheDtype:
    """A resolved ``kv_cache_dtype``: ``option`` as given, ``storage`` the kv-spec dtype the
    cache holds (``None``: the model dtype), ``quant`` the mode its readers dequantize with."""

    option: str
    storage: str | None

    @property
    def quantized(self) -> bool:
        return self.storage is not None

    @property
    def quant(self) -> KVQuantMode:
        return KVQuantMode.FP8_PER_TENSOR if self.quantized else KVQuantMode.NONE

    def spec(self, spec: _Spec) -> _Spec:
        """``spec`` storing this dtype (unchanged for ``auto``)."""
        if self.storage is None:
            return spec
        return dataclasses.replace(spec, dtype=self.storage, kv_quant=self.quant)

    def specs(self, specs: dict[str, AttentionSpec]) -> dict[str, AttentionSpec]:
        """Every layer's spec storing this dtype, keys and order kept."""
        return {name: self.spec(s) for name, s in specs.items()}

    def layer_scales(self, device: torch.device) -> dict[str, torch.Tensor]:
        """One layer's ``make_impl`` scale arguments: float32 0-d ``k_scale`` and ``v_scale``
        made on ``device`` (so no host->device copy happens in a step or a graph capture), or
        none for an unquantized cache. Each layer gets tensors of its own, as each would hold
        its own calibrated scales."""
        if not self.quantized:
            return {}
        return {
            name: torch.full((), DEFAULT_KV_SCALE, dtype=torch.float32, device=device)
            for name in ("k_scale", "v_scale")
        }

    def __str__(self) -> str:
        if self.storage is None:
            return "auto (the model dtype)"
        return f"{self.storage} ({self.quant.value}, K/V scales {DEFAULT_KV_SCALE:g})"


def parse_kv_cache_dtype(value: object) -> KVCacheDtype:
    """``value`` resolved, or an error naming the option, the value and the choices."""
    if not isinstance(value, str):
        raise TypeError(
            f"kv_cache_dtype={value!r} is a {type(value).__name__}; give a str, one of "
            f"{list(KV_CACHE_DTYPES)}"
        )
    if value not in _STORAGE:
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported; choose one of {list(KV_CACHE_DTYPES)} "
            "('auto': the model dtype; 'fp8' = 'fp8_e4m3', per-tensor scales)"
        )
    return KVCacheDtype(value, _STORAGE[value])


def mla_cache_choice(
    arch: ArchConfig,
    platform: Platform,
    kv: KVCacheDtype,
    *,
    block_size: int,
    dtype: str,
    layout_order: LayoutOrder | str,
    backend: str | None,
) -> tuple[bool, str | None]:
    """Whether an MLA model caches its latent (a backend here serves an ``MLAAttentionSpec``
    group of ``kv``'s dtype), and why. An explicit ``backend`` that declares no MLA asks for
    decompressed K/V; one that declares MLA but cannot serve it here raises its reasons. An fp8
    cache is an fp8 latent where a backend declares ``fp8_per_tensor`` for MLA layers
    (TRITON_MLA on a GPU, TORCH_SDPA on the CPU); one that no backend serves as a latent (a
    named backend that declares no fp8, say) is refused, never decompressed unasked: per-head
    K/V take more bytes a token in fp8 than the latent does in 16 bits."""
    if not arch.is_mla:
        return False, None
    if backend is not None and not get_backend(backend).CAPABILITIES.mla:
        return False, f"K/V decompressed per head (backend={backend!r} serves no MLA)"
    latent = arch.kv_specs(block_size=block_size, dtype=dtype, mla_latent=True)
    spec = kv.spec(next(iter(latent.values())))
    config = AttentionConfig.from_spec(
        spec, num_q_heads=arch.num_q_heads, dtype=dtype, layout_order=layout_order
    )
    try:
        sel = select_backend(config, platform, prefer=backend)
    except NoBackendError as e:
        why = "; ".join(x.strip() for x in str(e).splitlines()[1:])
        if kv.quantized:
            raise ValueError(
                f"kv_cache_dtype={kv.option!r}: no backend on {platform.label} serves an MLA "
                f"latent cache in {kv.storage} ({why}); use kv_cache_dtype='auto' (a {dtype} "
                "latent), or name a backend without MLA (backend='TRITON' on a GPU) to cache "
                f"decompressed K/V per head in {kv.storage}"
            ) from None
        return False, (
            "K/V decompressed per head (no backend serves an MLA latent cache on "
            f"{platform.label}: {why})"
        )
    except ValueError as e:
        if kv.quantized:  # the named backend's reasons, with the option that caused them
            raise ValueError(f"kv_cache_dtype={kv.option!r}: {e}") from None
        raise
    stored = f" in {kv.storage} (one per-tensor scale)" if kv.quantized else ""
    return True, (
        f"one latent row of {spec.head_size} per token{stored}, attended absorbed ({sel.name})"
    )
