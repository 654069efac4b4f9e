"""The fused ops registered as torch custom ops, ``torch.ops.kv_kernels.{rms_norm,
act_and_mul, rotary_embedding, rope_and_cache}``: what ``torch.compile`` traces (one opaque node each, its
mutations declared) and what a CUDA graph captures. The public functions in
:mod:`kv_kernels.fused.api` call these themselves under ``torch.compile`` (through
``torch.ops`` only: this module imports the api, never the reverse).

Every op writes into tensors the caller passes (declared in ``mutates_args``) and returns
nothing, so a compiled model body keeps the in-place residual stream and rotated q/k without
extra copies. Optionals are required (nullable) arguments, as :mod:`kv_kernels._ops` explains.
"""

from __future__ import annotations

import torch

from kv_kernels._common import layout_from_json
from kv_kernels.fused.api import (
    gelu_tanh_and_mul,
    rms_norm,
    rope_and_cache,
    rotary_embedding,
    silu_and_mul,
)

__all__: list[str] = []  # registers ops; nothing to import from here

Tensor = torch.Tensor


@torch.library.custom_op("kv_kernels::rms_norm", mutates_args=("out", "residual_out"))
def _rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None,
    out: Tensor,
    residual_out: Tensor | None,
    weight_offset: float,
    weight_first: bool,
    impl: str,
) -> None:
    rms_norm(
        x, weight, eps, residual=residual, out=out, residual_out=residual_out,
        weight_offset=weight_offset, weight_first=weight_first, impl=impl,
    )  # fmt: skip


@_rms_norm.register_fake
def _(x, weight, eps, residual, out, residual_out, weight_offset, weight_first, impl) -> None:
    return None


@torch.library.custom_op("kv_kernels::act_and_mul", mutates_args=("out",))
def _act_and_mul(x: Tensor, out: Tensor, act: str, impl: str) -> None:
    if act == "silu":
        silu_and_mul(x, out=out, impl=impl)
    elif act == "gelu_tanh":
        gelu_tanh_and_mul(x, out=out, impl=impl)
    else:
        raise ValueError(f"act_and_mul: act={act!r} must be 'silu' or 'gelu_tanh'")


@_act_and_mul.register_fake
def _(x, out, act, impl) -> None:
    return None


@torch.library.custom_op("kv_kernels::rotary_embedding", mutates_args=("q", "k", "error_flag"))
def _rotary_embedding(
    positions: Tensor,
    q: Tensor,
    k: Tensor | None,
    cos_sin_cache: Tensor,
    is_neox: bool,
    rotary_dim: int,
    impl: str,
    error_flag: Tensor | None,
) -> None:
    rotary_embedding(
        positions, q, k, cos_sin_cache, is_neox=is_neox, rotary_dim=rotary_dim, impl=impl,
        error_flag=error_flag,
    )  # fmt: skip


@_rotary_embedding.register_fake
def _(positions, q, k, cos_sin_cache, is_neox, rotary_dim, impl, error_flag) -> None:
    return None


@torch.library.custom_op(
    "kv_kernels::rope_and_cache", mutates_args=("q", "key", "kv_cache", "error_flag")
)
def _rope_and_cache(
    positions: Tensor,
    q: Tensor,
    key: Tensor,
    value: Tensor,
    cos_sin_cache: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    layout: str,
    is_neox: bool,
    rotary_dim: int,
    impl: str,
    error_flag: Tensor | None,
) -> None:
    rope_and_cache(
        positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping, layout_from_json(layout),
        is_neox=is_neox, rotary_dim=rotary_dim, impl=impl, error_flag=error_flag,
    )  # fmt: skip


@_rope_and_cache.register_fake
def _(
    positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping, layout, is_neox, rotary_dim,
    impl, error_flag,
) -> None:  # fmt: skip
    return None
