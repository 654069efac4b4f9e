"""The FLEX_ATTENTION backend's import path before it became the :mod:`kv_backends.backends.flex`
package: the same names, re-exported (the backend, its impl, metadata and builder, the tiles)."""

from __future__ import annotations

from kv_backends.backends.flex import (
    FLEX_RECOMPILE_LIMIT,
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadata,
    FlexMetadataBuilder,
    FlexOptions,
    build_flex_block_indices,
)

__all__ = [
    "FLEX_RECOMPILE_LIMIT",
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexMetadataBuilder",
    "FlexOptions",
    "build_flex_block_indices",
]
