"""Cache-write test builders the kernel tests share: small layouts (optionally with padded pages),
storages whose every byte is random so a stray write shows, their raw bytes, shuffled slot mappings
with -1 padding, the float64 per-token write oracle, and rows of values that are hard to quantize.

Tests compare caches byte for byte (:func:`raw_bytes`, padding included), so the reference and the
Triton write of the same inputs into the same random storage must be bitwise equal
(:func:`write_with_both_impls`).
"""

from __future__ import annotations

import torch
from kv_spec import KVCacheLayout, KVQuantMode, LayoutOrder

from kv_kernels.cache import KVCacheStorage, allocate_kv_cache, layer_view
from kv_kernels.reshape_and_cache import reshape_and_cache

__all__ = [
    "hard_rows",
    "make_slots",
    "oracle_write",
    "random_storage",
    "raw_bytes",
    "small_layout",
    "storage_bytes",
    "with_page_padding",
    "write_case",
    "write_with_both_impls",
]


def with_page_padding(layout: KVCacheLayout, pad: int) -> KVCacheLayout:
    """``layout`` with ``pad`` bytes of padding after each page (``page_size_bytes`` raised by
    ``pad``; page-contiguous orders only); ``pad=0`` returns it unchanged."""
    if not pad:
        return layout
    d = layout.to_dict()
    d["page_size_bytes"] = layout.page_bytes + pad
    return KVCacheLayout.from_dict(d)


def small_layout(
    order: str = "LBNHC",
    *,
    num_layers: int = 2,
    num_blocks: int = 7,
    heads: int = 3,
    block_size: int = 4,
    head_size: int = 8,
    head_size_v: int = 6,
    dtype: str = "float32",
    kv_quant: str = "none",
    is_mla: bool = False,
    pad: int = 0,
    scale_plane: bool = False,
) -> KVCacheLayout:
    """A layout small enough for the interpreter (odd head and V sizes, 7 blocks of 4 tokens by
    default); MLA layouts get ``head_size_v = 0``; ``pad`` bytes after each page (see
    :func:`with_page_padding`); ``scale_plane``: per-token-head scales in a plane (kv-spec)."""
    base = KVCacheLayout(
        order=LayoutOrder(order),
        num_layers=num_layers,
        num_blocks=num_blocks,
        num_kv_heads=heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=0 if is_mla else head_size_v,
        dtype=dtype,
        kv_quant=KVQuantMode(kv_quant),
        is_mla=is_mla,
        scale_plane=scale_plane,
    )
    return with_page_padding(base, pad)


def storage_bytes(storage: KVCacheStorage) -> list[torch.Tensor]:
    """Flat uint8 views of every allocation of ``storage`` (padding included), one per tensor;
    writing through them writes the cache."""
    tensors = [storage] if isinstance(storage, torch.Tensor) else list(storage)
    out = []
    for t in tensors:
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        raw.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),), (1,))
        out.append(raw)
    return out


def raw_bytes(storage: KVCacheStorage) -> list[torch.Tensor]:
    """CPU copies of :func:`storage_bytes`: a snapshot of every byte, to compare before/after."""
    return [raw.cpu().clone() for raw in storage_bytes(storage)]


def random_storage(layout: KVCacheLayout, device: str = "cpu", seed: int = 0) -> KVCacheStorage:
    """A cache whose every byte (padding included) is random, so stray writes show. Float caches
    hold N(0, 1) values instead of random bytes: random high bytes would be NaN/inf, and a NaN
    never compares equal to itself."""
    storage = allocate_kv_cache(layout, device)
    tensors = [storage] if isinstance(storage, torch.Tensor) else list(storage)
    g = torch.Generator().manual_seed(seed)
    for raw in storage_bytes(storage):
        noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g)
        if layout.dtype in ("float32", "float16", "bfloat16"):
            noise = torch.randn(raw.numel() // layout.element_bytes, generator=g)
            noise = noise.to(tensors[0].dtype).view(torch.uint8)
        raw.copy_(noise.to(raw.device))
    return storage


def make_slots(
    num_tokens: int, layout: KVCacheLayout, seed: int, pad_every: int = 3
) -> torch.Tensor:  # [num_tokens] int64
    """Distinct shuffled slots over all blocks, with every ``pad_every``-th token -1 (none with
    ``pad_every=0``)."""
    g = torch.Generator().manual_seed(seed)
    total = layout.num_blocks * layout.block_size
    slots = torch.randperm(total, generator=g)[:num_tokens].to(torch.int64)
    if pad_every:
        slots[::pad_every] = -1
    return slots


def oracle_write(
    before: torch.Tensor,  # [B, H, N, C] float64 copy of the layer view
    key: torch.Tensor,  # [T', H, D]
    value: torch.Tensor | None,  # [T', H, Dv], None for MLA
    slots: torch.Tensor,  # [T], -1 = skip
    layout: KVCacheLayout,
) -> torch.Tensor:  # [B, H, N, C] float64
    """``reshape_and_cache`` as the obvious per-token loop, in float64: token ``t`` goes to block
    ``slots[t] // block_size``, offset ``slots[t] % block_size``; unquantized layouts only."""
    out = before.clone()
    k0, k1 = layout.k_range
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, layout.block_size)
        out[block, :, offset, k0:k1] = key[t].double()
        if value is not None:
            if layout.v_range is None:
                raise ValueError("oracle_write: an MLA layout has no V range; pass value=None")
            v0, v1 = layout.v_range
            out[block, :, offset, v0:v1] = value[t].double()
    return out


def hard_rows(num_tokens: int, heads: int, size: int, seed: int) -> torch.Tensor:
    """float32 ``[T, H, size]`` rows that stress the quantizer's two division paths: normal rows,
    rows spanning many binades, halfway quotients, -0.0, subnormals, all-zero and all -0.0 rows,
    and (in some tokens) rows whose absmax is below 2**-40 (subnormal rows among them: their
    reciprocal overflows) or above 2**60, which send their whole program to the per-element
    ``div_rn`` path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, heads, size, generator=g)
    x = x * torch.exp2(torch.randint(-30, 30, (num_tokens, heads, 1), generator=g).float())
    wide = torch.exp2(torch.randint(-60, 8, (num_tokens, heads, size), generator=g).float())
    x[::3] = (x[::3].sign() * wide[::3]).float()  # 68 binades inside a row
    x[:, :, 0] = -0.0
    x[1::4, 0, 1] = 1e-41  # a float32 subnormal
    x[2::5, -1] = 0.0
    x[3::5, 0] = -0.0
    if size > 2:  # halfway points of int8: absmax 127 makes the step exactly 1
        x[4::6, 0, 1], x[4::6, 0, 2] = 127.0, -2.5
    small = torch.randn(x[5::7, 0].shape, generator=g) * 1e-20  # absmax below 2**-40
    big = torch.randn(x[6::11, -1].shape, generator=g) * 1e25  # absmax above 2**60
    x[5::7, 0], x[6::11, -1] = small, big
    x[7::13, 1] = torch.randn(x[7::13, 1].shape, generator=g) * 1e-39  # subnormal rows
    return x


def write_case(
    order: str,
    dtype: str,
    kv_quant: str = "none",
    *,
    num_tokens: int = 1000,
    seed: int = 0,
    device: str = "cuda",
    scale_plane: bool = False,
) -> tuple[KVCacheLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A production-sized write (8 heads of 128, page 16, 96 blocks): ``(layout, key [T', 8, 128],
    value [T', 8, 128], slots [T])`` with bf16 key/value (``|key|`` ~ 3 N(0, 1)), ``T' = T + 7``
    and every 7th slot -1, on ``device``; ``scale_plane``: per-token-head scales in a plane."""
    layout = small_layout(
        order, num_layers=2, num_blocks=96, heads=8, block_size=16, head_size=128, head_size_v=128,
        dtype=dtype, kv_quant=kv_quant, scale_plane=scale_plane,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    in_dtype = torch.bfloat16
    key = (torch.randn(num_tokens + 7, 8, 128, generator=g) * 3).to(in_dtype).to(device)
    value = torch.randn(num_tokens + 7, 8, 128, generator=g).to(in_dtype).to(device)
    slots = make_slots(num_tokens, layout, seed, pad_every=7).to(device)
    return layout, key, value, slots


def write_with_both_impls(
    layout: KVCacheLayout,
    key: torch.Tensor,
    value: torch.Tensor | None,
    slots: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    *,
    device: str = "cuda",
    layer: int = 1,
    seed: int = 11,
) -> list[KVCacheStorage]:
    """``[reference, triton]``: two copies of the same :func:`random_storage` on ``device``, each
    written at layer ``layer`` by one implementation of ``reshape_and_cache``; compare their
    :func:`raw_bytes`."""
    out = []
    for impl in ("reference", "triton"):
        storage = random_storage(layout, device, seed=seed)
        reshape_and_cache(
            key, value, layer_view(storage, layout, layer), slots, layout, k_scale, v_scale,
            impl=impl,
        )  # fmt: skip
        out.append(storage)
    return out
