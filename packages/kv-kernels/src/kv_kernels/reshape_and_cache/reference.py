"""Readable torch reference of the cache write, and the read-back helper :func:`read_kv` (any device).

The write, token by token, is::

    for t, slot in enumerate(slot_mapping):
        if slot < 0: continue                      # padding
        block, offset = divmod(slot, N)
        cache[block, :, offset, k_range] = quant(key[t])
        cache[block, :, offset, v_range] = quant(value[t])
        cache[block, :, offset, scale_range] = bytes(k_scale_row, v_scale_row)   # per-token-head only
        # (with a scale plane: plane[block, :, offset] = (k_scale_row, v_scale_row) instead)

done here for all tokens at once with advanced indexing. Quantization (all in float32):

- ``FP8_PER_TENSOR``: ``q = clamp(x / s, -fmax, fmax)`` cast to fp8 (round to nearest even), ``s``
  a per-tensor or per-head scale given by the caller.
- ``INT8_PER_TOKEN_HEAD``: ``s = absmax(x_row) / 127`` (``1.0`` for an all-zero row),
  ``q = clamp(floor(x / s + 0.5), -127, 127)``.
- ``FP8_PER_TOKEN_HEAD``: ``s = absmax(x_row) / fmax`` (``1.0`` for an all-zero row),
  ``q = clamp(x / s, -fmax, fmax)`` cast to fp8.

Per-token-head scales are float32 and stored inline: their 4 bytes (K's, then V's) are bit-cast
into the 1-byte cache elements of ``layout.scale_range``; with ``layout.scale_plane`` they go to
the page's scale plane (:func:`kv_kernels.cache.scale_plane_view`). Inputs are assumed validated by
:mod:`kv_kernels.reshape_and_cache.api`.
"""

from __future__ import annotations

import torch
from kv_spec import KVCacheLayout, KVQuantMode, to_torch_dtype

from kv_kernels.cache import scale_bytes, scale_geometry, scale_values

__all__ = ["quant_max", "read_kv", "reshape_and_cache_reference"]


def quant_max(cache_dtype: torch.dtype) -> float:
    """Largest magnitude a quantized cache element holds (127 for int8, the fp8 format's max)."""
    if cache_dtype == torch.int8:
        return 127.0
    return float(torch.finfo(cache_dtype).max)


def _row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-row (last dim) float32 scale ``absmax / qmax``; 1.0 for all-zero rows (any scale
    dequantizes zeros to zeros, and a reader never divides by 0)."""
    amax = x.abs().amax(dim=-1)  # [T, H]
    # a tensor divisor: CUDA torch turns `tensor / python_scalar` into a multiply by the
    # reciprocal, which can differ from the kernel's IEEE division in the last bit
    scale = amax / torch.full_like(amax, qmax)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _quantize(
    x: torch.Tensor,  # [T, H, D] float32
    mode: KVQuantMode,
    cache_dtype: torch.dtype,
    scale: torch.Tensor | None,  # [H] float32, FP8_PER_TENSOR only
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values in cache_dtype, per-row float32 scales [T, H] or None)``."""
    if mode is KVQuantMode.NONE:
        return x.to(cache_dtype), None
    qmax = quant_max(cache_dtype)
    if mode is KVQuantMode.FP8_PER_TENSOR:
        assert scale is not None
        y = x / scale[None, :, None]
        return y.clamp(-qmax, qmax).to(cache_dtype), None
    row_scale = _row_scale(x, qmax)  # [T, H]
    y = x / row_scale[..., None]
    if mode is KVQuantMode.INT8_PER_TOKEN_HEAD:
        y = torch.floor(y + 0.5)
    return y.clamp(-qmax, qmax).to(cache_dtype), row_scale


def _head_scale(scale: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """A float32 ``[H]`` view of a 1-element or ``[H]`` scale tensor."""
    if scale is None:
        return None
    return scale.to(torch.float32).reshape(-1).expand(num_heads)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as uint8 (last dim grows by the element size); 1-byte dtypes are
    written through uint8 views because CPU ``index_put_`` does not take fp8."""
    return t.contiguous().view(torch.uint8)


def reshape_and_cache_reference(
    key: torch.Tensor,  # [T', H, head_size]
    value: torch.Tensor | None,  # [T', H, head_size_v]; None for MLA
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view (any strides)
    slot_mapping: torch.Tensor,  # [T] int64
    layout: KVCacheLayout,
    k_scale: torch.Tensor | None,  # 1-element or [H] float (FP8_PER_TENSOR only)
    v_scale: torch.Tensor | None,
) -> None:
    """Write the first ``T = slot_mapping.numel()`` tokens of ``key``/``value`` into ``kv_cache``."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    num_heads = kv_cache.shape[1]
    slots = slot_mapping.reshape(-1).to(torch.int64)
    # Padding slots (< 0) are skipped. Most batches have none: one reduction tells, and then no
    # boolean mask is needed (a nonzero plus a copy of key and of value; the mask read the
    # device back too, so a CUDA caller waits no more than before).
    keep: torch.Tensor | None = None
    if int(slots.min()) < 0:
        keep = slots >= 0  # [T]
        slots = slots[keep]
        if slots.numel() == 0:
            return
    blocks = slots // block_size  # [T_kept]
    offsets = slots % block_size  # [T_kept]
    mode = layout.kv_quant
    cache_dtype = kv_cache.dtype
    one_byte = kv_cache.element_size() == 1
    # Indexing dims 0 and 2 with tensors and slicing C gives [T_kept, H, len(range)].
    target = kv_cache.view(torch.uint8) if one_byte else kv_cache

    def write(
        x: torch.Tensor, rng: tuple[int, int], scale: torch.Tensor | None
    ) -> torch.Tensor | None:
        x = x[:num_tokens] if keep is None else x[:num_tokens][keep.to(x.device)]  # [T_kept, H, D]
        if mode is not KVQuantMode.NONE:
            x = x.to(torch.float32)  # quantize in float32; an unquantized write copies as is
        q, row_scale = _quantize(x, mode, cache_dtype, _head_scale(scale, num_heads))
        target[blocks, :, offsets, rng[0] : rng[1]] = _bytes_of(q) if one_byte else q
        return row_scale

    k_row_scale = write(key, layout.k_range, k_scale)
    v_row_scale = None
    if value is not None:
        assert layout.v_range is not None
        v_row_scale = write(value, layout.v_range, v_scale)
    if layout.num_scales:
        assert k_row_scale is not None
        rows = [k_row_scale] if v_row_scale is None else [k_row_scale, v_row_scale]
        geometry = scale_geometry(kv_cache, layout)
        assert geometry is not None
        scales = scale_bytes(kv_cache, geometry, layout.num_scales)  # inline or in a plane
        scales[blocks, :, offsets] = _bytes_of(torch.stack(rows, dim=-1))  # [T_kept, H, 4 S]


def read_kv(
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view
    layout: KVCacheLayout,
    slots: torch.Tensor,  # [S] int, every slot >= 0
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read the tokens at ``slots`` back as float32, dequantized: ``(k [S, H, head_size],
    v [S, H, head_size_v] or None for MLA)``.

    ``FP8_PER_TENSOR`` needs the same ``k_scale``/``v_scale`` (float, 1-element or ``[H]``) the
    write used; per-token-head modes read their inline scales. For tests and debugging: it makes
    a copy of every row it reads.
    """
    if not isinstance(layout, KVCacheLayout):
        raise TypeError(f"read_kv: layout must be a KVCacheLayout, got {type(layout).__name__}")
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"read_kv: kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    expected = (layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.content_size)
    if tuple(kv_cache.shape) != expected:
        raise ValueError(
            f"read_kv: kv_cache has shape {tuple(kv_cache.shape)} but the layout's [B, H, N, C] "
            f"layer view is {expected}; pass layer_view(storage, layout, layer)"
        )
    if isinstance(slots, torch.Tensor):
        if slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
            raise TypeError(f"read_kv: slots must be an integer tensor, got {slots.dtype}")
    elif not all(isinstance(x, int) and not isinstance(x, bool) for x in slots):
        raise TypeError("read_kv: slots must be ints (a non-int slot would be truncated silently)")
    slots = torch.as_tensor(slots, dtype=torch.int64, device=kv_cache.device).reshape(-1)
    num_slots = layout.num_blocks * layout.block_size
    if slots.numel() and int(slots.min()) < 0:
        raise ValueError("read_kv: slots must be >= 0 (padding slots hold nothing to read)")
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(
            f"read_kv: slot {int(slots.max())} is past the cache's {num_slots} slots "
            f"(num_blocks={layout.num_blocks} x block_size={layout.block_size})"
        )
    if kv_cache.dtype != to_torch_dtype(layout.dtype):
        raise ValueError(
            f"read_kv: cache dtype {kv_cache.dtype} does not match layout dtype {layout.dtype}"
        )
    num_heads = kv_cache.shape[1]
    rows = kv_cache[slots // layout.block_size, :, slots % layout.block_size]  # [S, H, C]
    mode = layout.kv_quant

    def scale_of(scale: float | torch.Tensor | None, which: int, name: str) -> torch.Tensor:
        if mode is KVQuantMode.NONE:
            return torch.ones((), device=kv_cache.device)
        if mode is KVQuantMode.FP8_PER_TENSOR:
            if scale is None:
                raise ValueError(
                    f"read_kv: layout is fp8_per_tensor; pass the {name} the write used"
                )
            s = torch.as_tensor(scale, dtype=torch.float32, device=kv_cache.device).reshape(-1)
            return s.expand(num_heads)[None, :, None]  # [1, H, 1]
        geometry = scale_geometry(kv_cache, layout)  # inline or in a plane
        assert geometry is not None
        values = scale_values(kv_cache, geometry, layout.num_scales)  # [B, H, N, scales]
        return values[slots // layout.block_size, :, slots % layout.block_size, which, None]

    k0, k1 = layout.k_range
    k = rows[..., k0:k1].to(torch.float32) * scale_of(k_scale, 0, "k_scale")
    if layout.v_range is None:
        return k, None
    v0, v1 = layout.v_range
    v = rows[..., v0:v1].to(torch.float32) * scale_of(v_scale, 1, "v_scale")
    return k, v
