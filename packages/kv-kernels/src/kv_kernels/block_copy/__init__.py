"""Block copies: ``gather_blocks`` / ``scatter_blocks`` (paged cache <-> contiguous uint8 buffer,
any device pair: GPU <-> pinned host for offload, GPU <-> GPU for transfer) and ``copy_blocks``
(copy-on-write), each over every layer slot of a block in one launch."""

from __future__ import annotations

from kv_kernels.block_copy.api import (
    PageGeometry,
    copy_blocks,
    gather_blocks,
    page_geometry,
    scatter_blocks,
)

__all__ = ["PageGeometry", "copy_blocks", "gather_blocks", "page_geometry", "scatter_blocks"]
