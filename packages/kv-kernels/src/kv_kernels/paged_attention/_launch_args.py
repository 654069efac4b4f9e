"""Argument helpers of the paged-attention launcher (:mod:`.triton`): dequant-scale arguments,
the inline-scale view of a cache, TMA descriptors, split buffers and register caps."""

from __future__ import annotations

from typing import Any

import torch

from kv_kernels._common import tma_addressable
from kv_kernels.paged_attention._tiles import AttentionConfig

__all__: list[str] = []


def _scale_args(
    k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None, q: torch.Tensor
) -> tuple[int, tuple[Any, ...]]:
    """fp8 dequant scales as kernel arguments: ``(mode, (k_ptr, v_ptr, k_stride, v_stride, k_val,
    v_val))``. Two floats ride as scalars (mode 1); if either is a tensor (per tensor or per kv
    head) both are read from memory (mode 2; a float partner becomes a 1-element tensor)."""
    if k_scale is None:
        return 0, (q, q, 0, 0, 1.0, 1.0)
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        ks, vs = (
            x
            if isinstance(x, torch.Tensor)
            else torch.full((1,), float(x), dtype=torch.float32, device=q.device)  # type: ignore[arg-type]
            for x in (k_scale, v_scale)
        )
        return 2, (ks, vs, 0 if ks.numel() == 1 else 1, 0 if vs.numel() == 1 else 1, 1.0, 1.0)
    return 1, (q, q, 0, 0, float(k_scale), float(v_scale))  # type: ignore[arg-type]


def _inline_scale_args(
    kv_cache: torch.Tensor, rows: tuple[int, int, int] | None
) -> tuple[torch.Tensor, int, int, bool]:
    """``(kvs, k_idx, v_idx, words)``: the cache seen as float32 words when every stride and the
    scale offset allow it (one 4-byte load per scale), else as bytes (the scale assembled from
    its 4 bytes: it may sit at any byte offset). Per-token-head caches are 1-byte dtypes, so
    element offsets are byte offsets. ``rows``: ``KVCacheLayout.scale_geometry``."""
    if rows is None:
        return kv_cache, 0, 0, False
    scale_start, head_stride, token_stride = rows
    raw = kv_cache.view(torch.uint8)
    # the whole storage as bytes, so a float32 view of it covers every layer slot the view spans
    flat = torch.empty(0, dtype=torch.uint8, device=raw.device).set_(raw.untyped_storage())
    aligned = (
        raw.stride(3) == 1
        and all(st % 4 == 0 for st in (raw.stride(0), head_stride, token_stride))
        and scale_start % 4 == 0
        and raw.storage_offset() % 4 == 0
        and flat.numel() % 4 == 0
    )
    if aligned:
        # word offsets are the byte offsets / 4 (the kernel divides; all are multiples of 4)
        words = flat.view(torch.float32)[raw.storage_offset() // 4 :]
        return words, scale_start // 4, scale_start // 4 + 1, True
    return raw, scale_start, scale_start + 4, False


def _tma_descriptors(
    kv_cache: torch.Tensor, k_range: tuple[int, int], v_range: tuple[int, int], cfg: AttentionConfig
) -> tuple[Any, Any] | None:
    """TMA descriptors of K and V over the layer viewed as ``[B, N, H, C]`` (boxes of one tile of
    one head) when ``cfg.tma`` and the copy engine can address the cache: unit column stride,
    16-byte aligned strides and bases. ``None`` otherwise: the kernel gathers by pointers (same
    results, bit for bit; only the copy mechanism differs)."""
    if not cfg.tma:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    bnhc = kv_cache.permute(0, 2, 1, 3)
    descs = []
    for lo, hi in (k_range, v_range):
        part = bnhc[..., lo:hi]
        if not tma_addressable(part):
            return None
        descs.append(
            TensorDescriptor(
                part, list(part.shape), list(part.stride()), [1, cfg.tile_n, 1, hi - lo]
            )
        )
    return descs[0], descs[1]


def prefill_grid_q(num_tokens: int, num_seqs: int, block_q: int, seq_lo: int = 0) -> int:
    """Programs on axis 0 of a tiled (prefill-class) launch over the sequences from ``seq_lo``:
    each sequence's ``ceil(q_len / block_q)`` tiles, at most one more than its share of
    ``num_tokens // block_q`` (:func:`._kernels._find_seq`), less the ``seq_lo // block_q +
    seq_lo`` that the sequences below ``seq_lo`` reserve when each holds one query token (a
    decode: the api's ``num_decodes``). A mixed step of 256 decodes beside one 1,024-token
    prefill launched 297 x 8 programs on Llama-3-8B's heads for the 32 x 8 that have rows, and
    each of the others still staged its q and set up its barriers: the sm_90 prefill kernel took
    3.1 ms a step there (1.7 at 64 decodes), 1.3 (1.2) with the decodes left out (H200, 32
    layers, the engine's step profile)."""
    return num_tokens // block_q + num_seqs - (seq_lo // block_q + seq_lo)


def _reg_cap(cfg: AttentionConfig) -> dict[str, int]:
    """``maxnreg`` for a config that caps registers (a launch option Triton passes to ptxas)."""
    return {"maxnreg": cfg.max_registers} if cfg.max_registers else {}


def split_scratch(
    num_tokens: int, num_q_heads: int, num_splits: int, dv_pad: int
) -> tuple[int, int]:
    """``(float32 elements, offset of the LSEs)`` of a split launch's one scratch buffer: the
    partial outputs ``[T, Hq, S, DV_PAD]`` from element 0, the partial LSEs ``[T, Hq, S]`` from
    the offset (rounded up to 32 elements: 128 bytes, so both start 16-byte aligned, as Triton's
    pointer specialization and two separate allocations would have them)."""
    n_out = num_tokens * num_q_heads * num_splits * dv_pad
    offset = -(-n_out // 32) * 32
    return offset + num_tokens * num_q_heads * num_splits, offset


def split_views(
    buf: torch.Tensor, num_tokens: int, num_q_heads: int, num_splits: int, dv_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial outputs and LSEs inside ``buf`` (:func:`split_scratch`'s layout)."""
    _, offset = split_scratch(num_tokens, num_q_heads, num_splits, dv_pad)
    part_out = buf[: num_tokens * num_q_heads * num_splits * dv_pad]
    part_lse = buf[offset : offset + num_tokens * num_q_heads * num_splits]
    return (
        part_out.view(num_tokens, num_q_heads, num_splits, dv_pad),
        part_lse.view(num_tokens, num_q_heads, num_splits),
    )


def _split_buffers(
    out: torch.Tensor, num_splits: int, dv_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs ``[T, Hq, S, DV_PAD]`` and LSEs ``[T, Hq, S]`` (f32) of a split launch, in
    one allocation (:func:`split_scratch`: one trip through the caching allocator, not two);
    without splits the kernel never touches them and ``out`` stands in for both."""
    if num_splits == 1:
        return out, out
    t, hq = out.shape[0], out.shape[1]
    size, _ = split_scratch(t, hq, num_splits, dv_pad)
    buf = torch.empty((size,), dtype=torch.float32, device=out.device)
    return split_views(buf, t, hq, num_splits, dv_pad)
