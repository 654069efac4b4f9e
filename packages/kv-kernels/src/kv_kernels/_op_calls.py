"""Calls of the custom ops ``torch.ops.kv_kernels.*`` with the public functions' argument types.

Each public function calls these under ``torch.compile`` (one opaque node with its mutations
declared, instead of tracing the validation and the launcher). They reach the ops through
``torch.ops`` only, so this module imports no op module: the registrations live in
:mod:`kv_kernels._ops`, which imports the api modules, never the other way round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kv_spec import KVCacheLayout

from kv_kernels._common import layout_json, scale_tensor

__all__ = [
    "compute_slot_mapping_op",
    "copy_blocks_op",
    "expand_block_table_op",
    "gather_blocks_op",
    "paged_attention_op",
    "reshape_and_cache_op",
    "scatter_blocks_op",
]

Tensor = torch.Tensor


def _as_list(kv_cache: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [kv_cache] if isinstance(kv_cache, Tensor) else list(kv_cache)


def _ids(ids: Tensor | Sequence[int]) -> Tensor:
    return ids if isinstance(ids, Tensor) else torch.tensor(list(ids), dtype=torch.int64)


def _scale(scale: float | Tensor | None, device: torch.device) -> Tensor | None:
    return None if scale is None else scale_tensor(scale, device)


def reshape_and_cache_op(
    key: Tensor,
    value: Tensor | None,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    layout: KVCacheLayout,
    k_scale: float | Tensor | None = None,
    v_scale: float | Tensor | None = None,
    *,
    impl: str = "auto",
    error_flag: Tensor | None = None,
) -> None:
    """``torch.ops.kv_kernels.reshape_and_cache`` with the api's argument types."""
    torch.ops.kv_kernels.reshape_and_cache(
        key,
        value,
        kv_cache,
        slot_mapping,
        layout_json(layout),
        _scale(k_scale, kv_cache.device),
        _scale(v_scale, kv_cache.device),
        impl,
        error_flag,
    )


def gather_blocks_op(
    kv_cache: Tensor | Sequence[Tensor],
    layout: KVCacheLayout,
    block_ids: Tensor | Sequence[int],
    out: Tensor,
    *,
    impl: str = "auto",
    error_flag: Tensor | None = None,
) -> None:
    """``torch.ops.kv_kernels.gather_blocks`` with the api's argument types."""
    torch.ops.kv_kernels.gather_blocks(
        _as_list(kv_cache), layout_json(layout), _ids(block_ids), out, impl, error_flag
    )


def scatter_blocks_op(
    buffer: Tensor,
    kv_cache: Tensor | Sequence[Tensor],
    layout: KVCacheLayout,
    block_ids: Tensor | Sequence[int],
    *,
    impl: str = "auto",
    error_flag: Tensor | None = None,
) -> None:
    """``torch.ops.kv_kernels.scatter_blocks`` with the api's argument types."""
    torch.ops.kv_kernels.scatter_blocks(
        buffer, _as_list(kv_cache), layout_json(layout), _ids(block_ids), impl, error_flag
    )


def copy_blocks_op(
    kv_cache: Tensor | Sequence[Tensor],
    layout: KVCacheLayout,
    src_block_ids: Tensor | Sequence[int],
    dst_block_ids: Tensor | Sequence[int],
    *,
    impl: str = "auto",
    error_flag: Tensor | None = None,
) -> None:
    """``torch.ops.kv_kernels.copy_blocks`` with the api's argument types."""
    torch.ops.kv_kernels.copy_blocks(
        _as_list(kv_cache),
        layout_json(layout),
        _ids(src_block_ids),
        _ids(dst_block_ids),
        impl,
        error_flag,
    )


def compute_slot_mapping_op(
    block_table: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    block_size: int,
    kernel_block_size: int,
    *,
    num_slots: int | None = None,
    impl: str = "auto",
) -> Tensor:
    """``torch.ops.kv_kernels.compute_slot_mapping`` with the api's argument types."""
    return torch.ops.kv_kernels.compute_slot_mapping(
        block_table, positions, query_start_loc, block_size, kernel_block_size, num_slots, impl
    )


def expand_block_table_op(
    block_table: Tensor, block_size: int, kernel_block_size: int, *, impl: str = "auto"
) -> Tensor:
    """``torch.ops.kv_kernels.expand_block_table`` with the api's argument types."""
    return torch.ops.kv_kernels.expand_block_table(block_table, block_size, kernel_block_size, impl)


def paged_attention_op(
    q: Tensor,
    kv_cache: Tensor,
    layout: KVCacheLayout,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    *,
    max_seq_len: int | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: Tensor | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    k_scale: float | Tensor | None,
    v_scale: float | Tensor | None,
    num_splits: int | None,
    return_lse: bool,
    out: Tensor,
    impl: str,
    error_flag: Tensor | None = None,
    num_decodes: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Call ``torch.ops.kv_kernels.paged_attention`` with the api's argument types."""

    lse = (
        torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
        if return_lse
        else None
    )
    torch.ops.kv_kernels.paged_attention(
        q,
        kv_cache,
        layout_json(layout),
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        -1 if max_seq_len is None else max_seq_len,
        scale,
        causal,
        -1 if sliding_window is None else sliding_window,
        sinks,
        softcap,
        alibi_slopes,
        _scale(k_scale, q.device),
        _scale(v_scale, q.device),
        0 if num_splits is None else num_splits,
        out,
        lse,
        impl,
        error_flag,
        num_decodes,
    )
    return (out, lse) if lse is not None else out
