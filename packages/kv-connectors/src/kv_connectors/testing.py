"""Helpers for connector tests (ours and an engine's): layouts that cover the standard, caches
filled with random bytes, and a block's bytes read back through the layout.

A random fill writes random *bytes* into the whole storage (padding and inline scales included),
so a byte-exact comparison catches a wrong page, a lost scale or a torn copy.
"""

from __future__ import annotations

import torch
from kv_kernels import KVCacheStorage, allocate_kv_cache, layer_view, scale_plane_view
from kv_spec import KVCacheLayout, KVQuantMode, LayoutOrder

__all__ = [
    "block_bytes",
    "fill_random",
    "make_layout",
    "random_cache",
    "standard_layouts",
]


def make_layout(
    order: LayoutOrder | str = LayoutOrder.LBNHC,
    *,
    num_layers: int = 2,
    num_blocks: int = 16,
    num_kv_heads: int = 2,
    block_size: int = 4,
    head_size: int = 8,
    head_size_v: int | None = None,
    dtype: str = "float16",
    kv_quant: str = "none",
    page_size_bytes: int | None = None,
    scale_plane: bool = False,
) -> KVCacheLayout:
    return KVCacheLayout(
        order=LayoutOrder.parse(order),
        num_layers=num_layers,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size if head_size_v is None else head_size_v,
        dtype=dtype,
        kv_quant=KVQuantMode.parse(kv_quant),
        page_size_bytes=page_size_bytes,
        scale_plane=scale_plane,
    )


def standard_layouts(**overrides: object) -> dict[str, KVCacheLayout]:
    """Every physical order, DiffKV (192/128), int8 and fp8 per-token-head, and a padded page."""
    out = {o.value: make_layout(o, **overrides) for o in LayoutOrder}  # type: ignore[arg-type]
    small = {k: v for k, v in overrides.items() if k in ("num_layers", "num_blocks")}
    out["diffkv_192_128"] = make_layout(
        "LBNHC",
        head_size=192,
        head_size_v=128,
        num_kv_heads=1,
        block_size=2,
        **small,  # type: ignore[arg-type]
    )
    out["int8_pth_BLNHC"] = make_layout(
        "BLNHC",
        dtype="int8",
        kv_quant="int8_per_token_head",
        **small,  # type: ignore[arg-type]
    )
    out["fp8_pth_LBHNC"] = make_layout(
        "LBHNC",
        dtype="fp8_e4m3",
        kv_quant="fp8_per_token_head",
        **small,  # type: ignore[arg-type]
    )
    base = make_layout("LBNHC", **small)  # type: ignore[arg-type]
    out["padded_LBNHC"] = make_layout("LBNHC", page_size_bytes=base.page_bytes + 64, **small)  # type: ignore[arg-type]
    return out


def _raw_tensors(storage: KVCacheStorage) -> list[torch.Tensor]:
    return [storage] if isinstance(storage, torch.Tensor) else list(storage)


def fill_random(storage: KVCacheStorage, *, seed: int) -> None:
    """Overwrite every byte of ``storage`` (padding included) with seeded random bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in _raw_tensors(storage):
        start = t.storage_offset() * t.element_size()
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        nbytes = t.untyped_storage().nbytes() - start
        raw.set_(t.untyped_storage(), start, (nbytes,), (1,))
        raw.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))


def random_cache(
    layout: KVCacheLayout, *, seed: int, device: torch.device | str = "cpu"
) -> KVCacheStorage:
    storage = allocate_kv_cache(layout, device)
    fill_random(storage, seed=seed)
    return storage


def block_bytes(storage: KVCacheStorage, layout: KVCacheLayout, block_id: int) -> torch.Tensor:
    """Logical bytes of block ``block_id`` over every layer: ``uint8 [L, H, N, C_bytes]`` on the CPU.

    Read through :func:`kv_kernels.layer_view` (real content, padding excluded), so two layouts that
    hold the same KV compare equal whatever their physical order; a layout with a scale plane
    gives each row's scales after its K and V, as inline scales sit.
    """
    pages = []
    for layer in range(layout.num_layers):
        view = layer_view(storage, layout, layer)
        row = view[block_id].contiguous().view(torch.uint8).cpu()  # [H, N, C * element_bytes]
        if layout.scale_plane:
            scales = scale_plane_view(view, layout)[block_id].contiguous().view(torch.uint8)
            row = torch.cat([row, scales.cpu()], dim=-1)
        pages.append(row)
    return torch.stack(pages)
