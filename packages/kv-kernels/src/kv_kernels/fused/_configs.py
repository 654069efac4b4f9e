"""Launch configurations of the fused ops' Triton kernels (:mod:`.triton` re-exports them):
rows per norm program, head tiles of the rotary kernels, and warps."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

__all__ = ["NormConfig", "RopeConfig", "norm_config", "rope_config"]

#: Elements a norm program covers when rows are narrow (q/k norms: 128-wide rows, many of them):
#: several rows per program, so a program still moves a few KiB.
_NORM_TILE = 4096


class NormConfig(NamedTuple):
    """Launch parameters of the norm kernel (``norm_config`` picks them)."""

    block_d: int  # next power of two of the row width
    block_r: int  # rows per program
    num_warps: int


def norm_config(width: int) -> NormConfig:
    """Whole rows per program: one row when it is at least :data:`_NORM_TILE` elements wide,
    else as many as fill that tile; warps give each thread about 8 elements (one 16-byte vector
    of a 16-bit row), 1 to 16."""
    block_d = triton.next_power_of_2(width)
    block_r = max(1, _NORM_TILE // block_d)
    num_warps = max(1, min(16, block_d * block_r // 256))
    return NormConfig(block_d, block_r, num_warps)


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(token stride, head stride) of a 2-D ``[T, D]`` or 3-D ``[T, H, D]`` tensor."""
    if t.dim() == 2:
        return t.stride(0), 0
    return t.stride(0), t.stride(1)


#: Most elements of one head tile of a rotary program (32 heads x 64 pairs at head 128).
_ROPE_TILE = 2048


class RopeConfig(NamedTuple):
    """Launch parameters of the rotary kernels (``rope_config`` picks them)."""

    block_hq: int  # q heads per tile (the program loops over q's heads in tiles)
    block_hk: int  # k heads per tile
    num_warps: int


def rope_config(
    num_q_heads: int, num_k_heads: int, block_half: int, is_neox: bool, *, all_k: bool = False
) -> RopeConfig:
    """Tiles of q and k heads and the warps that give each thread one 16-byte vector (8 of 16
    bits) of the smaller tile: a tile is ``[heads, block_half]`` (NeoX halves) or ``[heads, 2 *
    block_half]`` (GPT-J rows). Sized by k, usually the smaller (8 kv heads against 32 q heads:
    with warps for q's tile a thread held 2 of k's elements and k moved 4 bytes at a time), but
    never under 512 elements; q then loops over tiles of that size. ``all_k``: every k head in one tile (the cache write).
    """
    width = block_half if is_neox else 2 * block_half
    q_tile = triton.next_power_of_2(num_q_heads) * width
    k_heads = triton.next_power_of_2(max(num_k_heads, 1))
    k_tile = k_heads * width if num_k_heads else q_tile
    # k's tile, but at least 512 elements: where k is tiny (MLA's one rope head, 2 kv heads) q
    # is most of the bytes, and q keeps 16-byte vectors over two warps
    tile = max(width, min(q_tile, max(k_tile, 512), _ROPE_TILE))
    num_warps = max(1, min(8, tile // 256))
    block_hq = max(1, tile // width)
    block_hk = k_heads if all_k else max(1, min(k_heads, _ROPE_TILE // width))
    return RopeConfig(block_hq, block_hk, num_warps)
