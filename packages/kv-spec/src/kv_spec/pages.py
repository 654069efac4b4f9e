"""Page arithmetic, written once: content size, page size, and the manager-block -> kernel-block
view rule. :mod:`kv_spec.specs` and :mod:`kv_spec.layout` both compute through these functions.

A page is one block of one layer::

    content_size         = head_size + head_size_v + inline_scales * 4 / dtype_bytes  # MLA: head_size_v = 0
    real_page_size_bytes = block_size * num_kv_heads * content_size * dtype_bytes

Manager vs kernel blocks. The allocator's block of ``block_size`` tokens may be ``k`` kernel blocks
of ``kernel_block_size = block_size / k`` tokens: manager block ``b`` is kernel blocks
``b * k + i`` for ``i < k``. On the cache that is one plain strided view, no copy, exactly when a
block's stride is ``block_size`` times a token's stride, i.e. the block dim sits directly outside
the token dim of one layer and the page is not padded: the orders in :data:`SPLITTABLE_ORDERS`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from kv_spec._checks import check_int, check_positive_int
from kv_spec.dtypes import dtype_bytes
from kv_spec.quant import SCALE_BYTES, KVQuantMode

__all__ = [
    "SPLITTABLE_ORDERS",
    "content_size",
    "expand_block_ids",
    "inline_scales",
    "kernel_blocks_per_block",
    "real_page_size_bytes",
]

#: Orders (their ``.value``) whose per-layer block stride is ``block_size`` x the token stride, so a
#: manager block splits into kernel blocks with one view: ``B`` directly outside ``N`` (the ``L``
#: dim, when outer, does not interleave). Cross-layer orders interleave layers inside a block.
SPLITTABLE_ORDERS: Final[tuple[str, ...]] = ("LBNHC", "LHBNC")


def inline_scales(kv_quant: KVQuantMode, *, is_mla: bool) -> int:
    """float32 scales stored per token and head inside the page: K and V (2), or the latent (1),
    under per-token-head quant; 0 otherwise."""
    if not KVQuantMode.parse(kv_quant).per_token_head:
        return 0
    return 1 if is_mla else 2


def content_size(
    *, head_size: int, head_size_v: int, kv_quant: KVQuantMode, is_mla: bool, dtype: str
) -> int:
    """C, elements per token and head: K, then V (none for MLA), then the inline scales."""
    scales = inline_scales(kv_quant, is_mla=is_mla) * SCALE_BYTES // dtype_bytes(dtype)
    return head_size + (0 if is_mla else head_size_v) + scales


def real_page_size_bytes(
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    kv_quant: KVQuantMode,
    is_mla: bool,
    dtype: str,
) -> int:
    """Bytes of one unpadded page (one block of one layer)."""
    c = content_size(
        head_size=head_size, head_size_v=head_size_v, kv_quant=kv_quant, is_mla=is_mla, dtype=dtype
    )
    return block_size * num_kv_heads * c * dtype_bytes(dtype)


def kernel_blocks_per_block(block_size: int, kernel_block_size: int) -> int:
    """``k = block_size // kernel_block_size``; raises unless ``kernel_block_size`` divides
    ``block_size`` (a manager block is ``k`` whole kernel blocks)."""
    check_positive_int("kernel block view", "block_size", block_size)
    check_positive_int("kernel block view", "kernel_block_size", kernel_block_size)
    if block_size % kernel_block_size:
        raise ValueError(
            f"kernel_block_size={kernel_block_size} must divide block_size={block_size} (a manager "
            "block is k whole kernel blocks); pick a divisor of the block size"
        )
    return block_size // kernel_block_size


def expand_block_ids(
    block_ids: Iterable[int], block_size: int, kernel_block_size: int
) -> list[int]:
    """Manager block ids -> kernel block ids: ``b`` becomes ``b * k + i`` for ``i < k``; a negative
    id (padding) becomes ``k`` entries of ``-1``. Pure Python, for schedulers without torch."""
    k = kernel_blocks_per_block(block_size, kernel_block_size)
    out: list[int] = []
    for b in block_ids:
        check_int("expand_block_ids", "block id", b, minimum=-(2**63))
        out.extend([-1] * k if b < 0 else range(b * k, b * k + k))
    return out
