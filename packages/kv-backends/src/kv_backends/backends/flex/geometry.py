"""FLEX_ATTENTION's cache geometry: how the kernel-block view maps to physical tokens (one
strided sequence, ``tpb`` physical tokens a block), and the windows of at most 2^31 elements it
is cut into (Flex's templates compute element offsets in 32 bits)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["INT32_LIMIT", "CacheGeometry", "cache_geometry"]

#: Torch's Flex templates compute element offsets in 32 bits.
INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class CacheGeometry:
    """How the kernel-block view maps to physical tokens, and the windows it is cut into."""

    n: int  # tokens per kernel block
    tpb: int  # physical tokens per block stride
    num_blocks: int
    sn: int  # token stride (elements)
    window_tokens: int  # physical tokens per window (multiple of tpb and kv_block_size)
    total_tokens: int  # physical tokens of the whole view

    @property
    def num_windows(self) -> int:
        return -(-self.total_tokens // self.window_tokens)

    def window_len(self, w: int) -> int:
        return min(self.window_tokens, self.total_tokens - w * self.window_tokens)


def cache_geometry(
    kv_cache: torch.Tensor, kv_block_size: int, max_view_elements: int
) -> CacheGeometry:
    b, h, n, c = kv_cache.shape
    sb, sh, sn, sc = kv_cache.stride()
    if sc != 1 or sn < h * sh or sh < c:
        raise ValueError(
            f"FLEX_ATTENTION needs a token-major (NHD) cache with contiguous content; got strides "
            f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)} (use order LBNHC or BLNHC)"
        )
    if sb % sn:
        raise ValueError(
            f"FLEX_ATTENTION needs the block stride {sb} to be a multiple of the token stride {sn} "
            "(a padded page must pad by whole tokens); use an unpadded layout"
        )
    tpb = sb // sn
    align = math.lcm(tpb, kv_block_size)
    if tpb % min(n, kv_block_size):
        raise ValueError(
            f"FLEX_ATTENTION: block stride of {tpb} tokens is not a multiple of "
            f"min(block {n}, kv_block_size {kv_block_size})"
        )
    total = (b - 1) * tpb + n
    # Largest element offset inside a window of W tokens: (W-1)*sn + (h-1)*sh + c - 1.
    budget = max_view_elements - (h - 1) * sh - c
    window = (budget // sn + 1) // align * align
    if window <= 0:
        raise ValueError(
            f"max_view_elements={max_view_elements} cannot hold one aligned window of {align} "
            f"tokens x {sn} elements; raise it"
        )
    window = min(window, -(-total // align) * align)
    return CacheGeometry(n, tpb, b, sn, window, total)
