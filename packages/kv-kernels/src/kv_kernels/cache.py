"""Allocating a KV cache from its layout, and taking per-layer logical views of it.

Every op reads the cache through a *layer view*: a tensor with logical dims ``[B, H, N, C]``
(blocks, kv heads, tokens in a block, content) whose strides come from the physical order. Ops read
strides from the tensor, so any of the six orders (and padded pages) works without a copy. A
layout with a scale plane (kv-spec ``scale_plane``) keeps its per-token-head scales after each
page's data, outside the rows: :func:`scale_plane_view` is their ``[B, H, N, scales]`` view.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kv_spec import KVCacheLayout, to_torch_dtype

__all__ = [
    "KVCacheStorage",
    "allocate_kv_cache",
    "kernel_block_view",
    "layer_view",
    "layer_views",
    "scale_bytes",
    "scale_geometry",
    "scale_plane_view",
    "scale_values",
]

#: What :func:`allocate_kv_cache` returns: one tensor per layer slot (L-outer orders) or one slab.
KVCacheStorage = torch.Tensor | Sequence[torch.Tensor]


def allocate_kv_cache(
    layout: KVCacheLayout, device: torch.device | str = "cpu", *, zero: bool = True
) -> KVCacheStorage:
    """Allocate the storage ``layout`` describes.

    L-outer orders give a list of ``num_layers`` tensors of ``layout.layer_shape`` (physical order);
    cross-layer orders give one slab of ``layout.physical_shape``. Padded pages are allocated as raw
    pages and viewed with the page stride.
    """
    dtype = to_torch_dtype(layout.dtype)
    make = torch.zeros if zero else torch.empty
    if layout.order.layer_outer:
        per_layer = layout.num_blocks * layout.page_bytes // layout.element_bytes
        return [
            _strided(make(per_layer, dtype=dtype, device=device), layout, layer=None)
            for _ in range(layout.num_layers)
        ]
    return _strided(make(layout.total_elements, dtype=dtype, device=device), layout, layer=None)


def _strided(flat: torch.Tensor, layout: KVCacheLayout, layer: int | None) -> torch.Tensor:
    if layout.order.layer_outer:
        shape = layout.layer_shape
        strides = tuple(
            s for d, s in zip(layout.order.value, layout.physical_strides, strict=True) if d != "L"
        )
    else:
        shape = layout.physical_shape
        strides = layout.physical_strides
    return flat.as_strided(shape, strides)


def layer_view(storage: KVCacheStorage, layout: KVCacheLayout, layer: int) -> torch.Tensor:
    """Logical ``[B, H, N, C]`` view of layer slot ``layer`` (no copy)."""
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer={layer} is out of range [0, {layout.num_layers}) for this layout")
    if layout.order.layer_outer:
        if isinstance(storage, torch.Tensor):
            raise ValueError(
                f"layout {layout.order.value} is allocated per layer slot: pass the list of "
                "per-layer tensors from allocate_kv_cache, not one tensor"
            )
        t = storage[layer]
        _check_shape(t, layout.layer_shape, layout)
        return t.permute(layout.layer_logical_permutation)
    if not isinstance(storage, torch.Tensor):
        raise ValueError(
            f"layout {layout.order.value} is cross-layer: pass the one slab from allocate_kv_cache"
        )
    _check_shape(storage, layout.physical_shape, layout)
    logical = storage.permute(_inverse(layout.order.permutation))  # [L, B, H, N, C]
    return logical[layer]


def layer_views(storage: KVCacheStorage, layout: KVCacheLayout) -> list[torch.Tensor]:
    """Logical ``[B, H, N, C]`` views of every layer slot."""
    return [layer_view(storage, layout, i) for i in range(layout.num_layers)]


def kernel_block_view(
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view
    layout: KVCacheLayout,
    kernel_block_size: int,
) -> tuple[torch.Tensor, KVCacheLayout]:
    """The layer view ``kv_cache`` seen as kernel blocks of ``kernel_block_size`` tokens: a
    ``[B * k, H, kernel_block_size, C]`` view (no copy) and its layout
    (:meth:`kv_spec.KVCacheLayout.kernel_block_layout`: manager block ``b`` is kernel blocks
    ``b * k + i``). Raises ``ValueError`` with kv-spec's reason when the order or padding allows
    no plain view."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a layer view tensor, got {type(kv_cache).__name__}")
    klayout = layout.kernel_block_layout(kernel_block_size)
    if kernel_block_size == layout.block_size:
        return kv_cache, layout
    expected = (layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.content_size)
    if tuple(kv_cache.shape) != expected:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; the layout's [B, H, N, C] layer view is "
            f"{expected}: pass layer_view(storage, layout, layer)"
        )
    sb, sh, sn, sc = kv_cache.stride()
    if sb != layout.block_size * sn:  # kv-spec's rule, checked on the tensor itself
        raise ValueError(
            f"kv_cache block stride {sb} != block_size x token stride {layout.block_size * sn}: "
            "not the layer view of this layout"
        )
    view = kv_cache.as_strided(
        (klayout.num_blocks, layout.num_kv_heads, kernel_block_size, layout.content_size),
        (kernel_block_size * sn, sh, sn, sc),
    )
    return view, klayout


def scale_plane_view(kv_cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """The per-token-head scales of a layout with a scale plane (``layout.scale_plane``) as a
    float32 ``[B, H, N, num_scales]`` view aliasing the pages of the layer view ``kv_cache``
    (no copy): scale ``(b, h, n, i)`` is K's (``i = 0``) or V's (``i = 1``) scale of that row."""
    geo = layout.scale_plane_geometry
    if geo is None:
        raise ValueError(
            f"scale_plane_view: layout has scale_placement={layout.scale_placement!r}; only a "
            "layout with scale_plane=True has a plane"
        )
    expected = (layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.content_size)
    if tuple(kv_cache.shape) != expected or kv_cache.element_size() != layout.element_bytes:
        raise ValueError(
            f"scale_plane_view: kv_cache has shape {tuple(kv_cache.shape)} ({kv_cache.dtype}); "
            f"the layout's layer view is {expected} of {layout.dtype}: pass layer_view(...)"
        )
    return scale_values(kv_cache, geo, layout.num_scales)  # (a plane is aligned: a view)


def scale_geometry(kv_cache: torch.Tensor, layout: KVCacheLayout) -> tuple[int, int, int] | None:
    """``(offset, head_stride, token_stride)`` in bytes of the per-token-head scales of the layer
    view ``kv_cache`` (``KVCacheLayout.scale_geometry``, with inline scales following the
    tensor's own row strides: ops take any strided view); ``None`` without such scales."""
    geometry = layout.scale_geometry
    if geometry is None or layout.scale_plane:
        return geometry
    eb = kv_cache.element_size()
    return (geometry[0], kv_cache.stride(1) * eb, kv_cache.stride(2) * eb)


def scale_bytes(
    kv_cache: torch.Tensor, geometry: tuple[int, int, int], num_scales: int
) -> torch.Tensor:
    """The bytes of every row's per-token-head scales, inline or in a plane, as a uint8
    ``[B, H, N, 4 * num_scales]`` view of the 1-byte layer view ``kv_cache`` (any alignment;
    ``geometry``: ``KVCacheLayout.scale_geometry``). Writers store through it."""
    if kv_cache.element_size() != 1:  # (kv-spec allows per-token-head scales on 1-byte caches)
        raise ValueError(f"a {kv_cache.dtype} cache holds no per-token-head scales")
    offset, head_stride, token_stride = geometry
    b, h, n, _ = kv_cache.shape
    return kv_cache.view(torch.uint8).as_strided(
        (b, h, n, 4 * num_scales),
        (kv_cache.stride(0), head_stride, token_stride, 1),
        kv_cache.storage_offset() + offset,
    )


def scale_values(
    kv_cache: torch.Tensor, geometry: tuple[int, int, int], num_scales: int
) -> torch.Tensor:
    """:func:`scale_bytes` as float32 ``[B, H, N, num_scales]``: a view where every scale is
    4-byte aligned (a plane always is), else a copy (inline scales may sit at any byte)."""
    raw = scale_bytes(kv_cache, geometry, num_scales)
    aligned = raw.storage_offset() % 4 == 0 and all(st % 4 == 0 for st in raw.stride()[:3])
    return (raw if aligned else raw.contiguous()).view(torch.float32)


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for phys, logical in enumerate(perm):
        inv[logical] = phys
    return tuple(inv)


def _check_shape(t: torch.Tensor, shape: tuple[int, ...], layout: KVCacheLayout) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"cache tensor has shape {tuple(t.shape)} but layout {layout.order.value} expects "
            f"{tuple(shape)}; allocate it with allocate_kv_cache(layout)"
        )
    if t.dtype != to_torch_dtype(layout.dtype):
        raise ValueError(f"cache tensor dtype {t.dtype} does not match layout dtype {layout.dtype}")
