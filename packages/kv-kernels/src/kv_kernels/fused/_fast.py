"""The fused ops' call caches on CUDA (:mod:`kv_kernels._call_cache`): the keys of
``rms_norm``, ``silu_and_mul`` / ``gelu_tanh_and_mul``, ``rotary_embedding`` and
``rope_and_cache``, and the per-call checks a cached call still runs.

Each key holds every tensor's :func:`~kv_kernels._call_cache.tensor_key` and every option by
type and value: what :mod:`.api`'s checks, the launcher's plan and Triton's specialization read.
Not in a key, so never skipped: the overlap rules of ``out`` / ``residual_out`` against the
inputs (they read addresses: :func:`check_norm_overlaps` and the act op's check run per call).
Position and slot values are checked on the host only for CPU tensors, which are never cached;
on CUDA the kernels leave out-of-range rows alone and count them in ``error_flag``.
"""

from __future__ import annotations

from typing import Any

import torch
from kv_spec import KVCacheLayout

from kv_kernels._call_cache import CallCache, Entry, fast_path_allowed, scalar_key, tensor_key

__all__ = [
    "ACT",
    "NORM",
    "ROPE",
    "ROPE_CACHE",
    "act_key",
    "check_norm_overlaps",
    "launch_act",
    "launch_norm",
    "launch_rope",
    "launch_rope_cache",
    "norm_key",
    "overlap",
    "rope_cache_key",
    "rope_key",
]

NORM = CallCache("rms_norm")
ACT = CallCache("act_and_mul")
ROPE = CallCache("rotary_embedding")
ROPE_CACHE = CallCache("rope_and_cache")


def _on_cuda(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda and fast_path_allowed()


def norm_key(
    x: Any, weight: Any, eps: Any, residual: Any, out: Any, residual_out: Any,
    weight_offset: Any, weight_first: Any, impl: Any,
) -> tuple[Any, ...] | None:  # fmt: skip
    """``rms_norm``'s key, or None (not CUDA, the cache off, or an input no key describes)."""
    if not _on_cuda(x):
        return None
    try:
        return (
            tensor_key(x), tensor_key(weight), scalar_key(eps), tensor_key(residual),
            tensor_key(out), tensor_key(residual_out), scalar_key(weight_offset),
            scalar_key(weight_first), scalar_key(impl),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def act_key(op: str, x: Any, out: Any, impl: Any) -> tuple[Any, ...] | None:
    """``silu_and_mul`` / ``gelu_tanh_and_mul``'s key (``op`` names the activation)."""
    if not _on_cuda(x):
        return None
    try:
        return (op, tensor_key(x), tensor_key(out), scalar_key(impl))
    except (AttributeError, TypeError):
        return None


def rope_key(
    positions: Any, q: Any, k: Any, cos_sin_cache: Any, is_neox: Any, rotary_dim: Any,
    impl: Any, error_flag: Any,
) -> tuple[Any, ...] | None:  # fmt: skip
    """``rotary_embedding``'s key. ``q.data_ptr() == k.data_ptr()`` is a check on addresses,
    so its answer is in the key (two tensors at the same address are rejected)."""
    if not _on_cuda(q):
        return None
    try:
        return (
            tensor_key(positions), tensor_key(q), tensor_key(k), tensor_key(cos_sin_cache),
            scalar_key(is_neox), scalar_key(rotary_dim), scalar_key(impl),
            tensor_key(error_flag), k is not None and q.data_ptr() == k.data_ptr(),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def rope_cache_key(
    positions: Any, q: Any, key: Any, value: Any, cos_sin_cache: Any, kv_cache: Any,
    slot_mapping: Any, layout: Any, is_neox: Any, rotary_dim: Any, impl: Any, error_flag: Any,
) -> tuple[Any, ...] | None:  # fmt: skip
    """``rope_and_cache``'s key (the layout by ``id``: the entry holds it)."""
    base = rope_key(positions, q, key, cos_sin_cache, is_neox, rotary_dim, impl, error_flag)
    if base is None:
        return None
    try:
        return (
            *base,
            id(layout),
            tensor_key(value),
            tensor_key(kv_cache),
            tensor_key(slot_mapping),
        )
    except (AttributeError, TypeError):
        return None


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of ``a`` and ``b`` intersect (a conservative span test)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
        start = t.data_ptr()
        return start, start + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def check_norm_overlaps(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> None:
    """``rms_norm``'s rules on where ``out`` and ``residual_out`` may lie (addresses: run on
    every call that passes either, cached or not)."""
    if out is not None and residual_out is not None and overlap(out, residual_out):
        raise ValueError(
            "out and residual_out share memory: y would overwrite h; give them separate buffers"
        )
    for name, t in (("out", out), ("residual_out", residual_out)):
        if t is None:
            continue
        for src_name, src in (("x", x), ("residual", residual)):
            # the in-place forms (out=x, residual_out=residual) by identity: the span test of
            # one storage costs ~3 us of host time (separate storages ~0.4)
            if src is None or t is src:
                continue
            if overlap(t, src) and not _same_view(t, src):
                raise ValueError(
                    f"{name} partly overlaps {src_name}; it may be {src_name} itself (in place) "
                    "or separate memory, nothing in between"
                )


# ---- the launches of checked calls (the api's full path and its cache hits share them) ------------


def launch_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight_offset: float,
    weight_first: bool,
    entry: Entry | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` on Triton (outputs allocated where not given)."""
    from kv_kernels.fused.triton import rms_norm_triton

    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    h = None
    if residual is not None:
        h = (
            residual_out
            if residual_out is not None
            else torch.empty_like(x, memory_format=torch.contiguous_format)
        )
    rms_norm_triton(
        x, weight, float(eps), residual, y, h, float(weight_offset), bool(weight_first), entry
    )
    return y if h is None else (y, h)


def launch_act(
    x: torch.Tensor, out: torch.Tensor | None, act: str, entry: Entry | None
) -> torch.Tensor:
    """``silu_and_mul`` / ``gelu_tanh_and_mul`` on Triton (``out`` allocated if not given)."""
    from kv_kernels.fused.triton import act_and_mul_triton

    if out is None:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    act_and_mul_triton(x, out, act, entry)
    return out


def launch_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rotary_dim: int,
    error_flag: torch.Tensor | None,
    entry: Entry | None,
) -> None:
    """``rotary_embedding`` on Triton."""
    from kv_kernels.fused.triton import rotary_embedding_triton

    rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox, rotary_dim, error_flag, entry)


def launch_rope_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
    is_neox: bool,
    rotary_dim: int,
    error_flag: torch.Tensor | None,
    entry: Entry | None,
) -> None:
    """``rope_and_cache`` on Triton."""
    from kv_kernels.fused.triton import rope_and_cache_triton

    v_offset = layout.v_range[0] if layout.v_range is not None else 0
    rope_and_cache_triton(
        positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping, v_offset, is_neox,
        rotary_dim, error_flag, entry,
    )  # fmt: skip
