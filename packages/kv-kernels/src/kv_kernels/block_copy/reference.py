"""Readable torch reference of the block copies (any device pair).

A page (one block of one layer slot) is ``num_chunks`` contiguous byte chunks in the cache: one
chunk for page-contiguous orders, one per kv head for the head-outer orders (LHBNC, BHLNC). Per
layer slot, :class:`~kv_kernels.block_copy.api.PageGeometry` gives a flat uint8 view of its bytes;
``as_strided`` turns it into ``[B, num_chunks, chunk_bytes]`` (block ``b``, chunk ``j`` at byte
``b * block_stride + j * chunk_stride``), and the copies are ``index_select`` / ``index_copy_`` on
dim 0. A buffer row is ``[L, num_chunks, chunk_bytes]``: the pages of all layer slots, layer-major.
Inputs are assumed validated by :mod:`kv_kernels.block_copy.api`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kv_kernels.block_copy.api import PageGeometry

__all__ = ["copy_blocks_reference", "gather_blocks_reference", "scatter_blocks_reference"]


def _pages(geo: PageGeometry, layer: int) -> torch.Tensor:
    """``[B, num_chunks, chunk_bytes]`` uint8 view of every page of one layer slot."""
    flat = geo.layer_bytes[layer]
    return flat.as_strided(
        (geo.num_blocks, geo.num_chunks, geo.chunk_bytes),
        (geo.block_stride, geo.chunk_stride, 1),
    )


def _rows(buffer: torch.Tensor, geo: PageGeometry) -> torch.Tensor:
    """``[n, L, num_chunks, chunk_bytes]`` view of a ``[n, L * page_bytes]`` uint8 buffer."""
    n = buffer.shape[0]
    return buffer.as_strided(
        (n, geo.num_layers, geo.num_chunks, geo.chunk_bytes),
        (buffer.stride(0), geo.page_bytes, geo.chunk_bytes, 1),
    )


def gather_blocks_reference(geo: PageGeometry, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i, layer l's page] = page (l, block_ids[i])`` for every layer slot."""
    rows = _rows(out, geo)
    for layer in range(geo.num_layers):
        pages = _pages(geo, layer)
        ids = block_ids.to(pages.device)
        rows[:, layer].copy_(pages.index_select(0, ids))


def scatter_blocks_reference(
    buffer: torch.Tensor, geo: PageGeometry, block_ids: torch.Tensor
) -> None:
    """``page (l, block_ids[i]) = buffer[i, layer l's page]`` for every layer slot."""
    rows = _rows(buffer, geo)
    for layer in range(geo.num_layers):
        pages = _pages(geo, layer)
        ids = block_ids.to(pages.device)
        pages.index_copy_(0, ids, rows[:, layer].to(pages.device))


def copy_blocks_reference(
    geo: PageGeometry, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor
) -> None:
    """``page (l, dst[i]) = page (l, src[i])`` for every layer slot (src and dst are disjoint)."""
    for layer in range(geo.num_layers):
        pages = _pages(geo, layer)
        src = src_block_ids.to(pages.device)
        dst = dst_block_ids.to(pages.device)
        pages.index_copy_(0, dst, pages.index_select(0, src))
