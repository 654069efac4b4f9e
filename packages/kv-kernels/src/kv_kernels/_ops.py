"""The ops registered once as torch custom ops: ``torch.ops.kv_kernels.<name>``.

``torch.ops.kv_kernels.<name>`` is what ``torch.compile`` traces (one opaque node, mutations
declared) and what a CUDA graph captures; the public functions call it themselves when they run
under ``torch.compile`` (through :mod:`kv_kernels._op_calls`), so users call the plain functions
everywhere.

``error_flag`` is a required (nullable) argument of every op that has it: with a default, a
traced call may drop it, and torch 2.11's mutation bookkeeping then indexes past the arguments
(``IndexError`` in ``increment_version``, under ``torch.compile`` and ``opcheck`` on that
version). Schemas carry the layout as its JSON (a primitive that compiles into the graph as a constant) and
scales / block ids as tensors, every optional as a primitive sentinel (``-1`` / ``0``). Each op's
real implementation is the validating api function; the fake implementations only give output
shapes. Imports go one way: this module imports the api modules, which never import it.
"""

from __future__ import annotations

import torch
from kv_spec import KVCacheLayout

from kv_kernels._common import layout_from_json as _layout
from kv_kernels.block_copy.api import copy_blocks, gather_blocks, scatter_blocks
from kv_kernels.paged_attention.api import paged_attention
from kv_kernels.reshape_and_cache.api import reshape_and_cache
from kv_kernels.slot_mapping.api import compute_slot_mapping, expand_block_table

__all__: list[str] = []  # registers ops; nothing to import from here

Tensor = torch.Tensor


def _storage(tensors: list[Tensor], layout: KVCacheLayout) -> Tensor | list[Tensor]:
    """The op schemas take the storage as a list: one slab travels as ``[slab]``."""
    return list(tensors) if layout.order.layer_outer else tensors[0]


# ---- reshape_and_cache ---------------------------------------------------------------------------


@torch.library.custom_op("kv_kernels::reshape_and_cache", mutates_args=("kv_cache", "error_flag"))
def _reshape_and_cache(
    key: Tensor,
    value: Tensor | None,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    layout: str,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    impl: str,
    error_flag: Tensor | None,
) -> None:
    reshape_and_cache(
        key, value, kv_cache, slot_mapping, _layout(layout), k_scale, v_scale, impl=impl,
        error_flag=error_flag,
    )  # fmt: skip


@_reshape_and_cache.register_fake
def _(key, value, kv_cache, slot_mapping, layout, k_scale, v_scale, impl, error_flag) -> None:
    return None


# ---- block copies --------------------------------------------------------------------------------


@torch.library.custom_op("kv_kernels::gather_blocks", mutates_args=("out", "error_flag"))
def _gather_blocks(
    kv_cache: list[Tensor],
    layout: str,
    block_ids: Tensor,
    out: Tensor,
    impl: str,
    error_flag: Tensor | None,
) -> None:
    lay = _layout(layout)
    gather_blocks(_storage(kv_cache, lay), lay, block_ids, out, impl=impl, error_flag=error_flag)


@_gather_blocks.register_fake
def _(kv_cache, layout, block_ids, out, impl, error_flag) -> None:
    return None


@torch.library.custom_op("kv_kernels::scatter_blocks", mutates_args=("kv_cache", "error_flag"))
def _scatter_blocks(
    buffer: Tensor,
    kv_cache: list[Tensor],
    layout: str,
    block_ids: Tensor,
    impl: str,
    error_flag: Tensor | None,
) -> None:
    lay = _layout(layout)
    scatter_blocks(
        buffer, _storage(kv_cache, lay), lay, block_ids, impl=impl, error_flag=error_flag
    )


@_scatter_blocks.register_fake
def _(buffer, kv_cache, layout, block_ids, impl, error_flag) -> None:
    return None


@torch.library.custom_op("kv_kernels::copy_blocks", mutates_args=("kv_cache", "error_flag"))
def _copy_blocks(
    kv_cache: list[Tensor],
    layout: str,
    src_block_ids: Tensor,
    dst_block_ids: Tensor,
    impl: str,
    error_flag: Tensor | None,
) -> None:
    lay = _layout(layout)
    copy_blocks(
        _storage(kv_cache, lay), lay, src_block_ids, dst_block_ids, impl=impl,
        error_flag=error_flag,
    )  # fmt: skip


@_copy_blocks.register_fake
def _(kv_cache, layout, src_block_ids, dst_block_ids, impl, error_flag) -> None:
    return None


# ---- slot mapping --------------------------------------------------------------------------------


@torch.library.custom_op("kv_kernels::compute_slot_mapping", mutates_args=())
def _compute_slot_mapping(
    block_table: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    block_size: int,
    kernel_block_size: int,
    num_slots: int | None,
    impl: str,
) -> Tensor:
    return compute_slot_mapping(
        block_table,
        positions,
        query_start_loc,
        block_size,
        kernel_block_size,
        num_slots=num_slots,
        impl=impl,
    )


@_compute_slot_mapping.register_fake
def _(block_table, positions, query_start_loc, block_size, kernel_block_size, num_slots, impl):
    n = positions.shape[0] if num_slots is None else num_slots
    return positions.new_empty((n,), dtype=torch.int64)


@torch.library.custom_op("kv_kernels::expand_block_table", mutates_args=())
def _expand_block_table(
    block_table: Tensor, block_size: int, kernel_block_size: int, impl: str
) -> Tensor:
    return expand_block_table(block_table, block_size, kernel_block_size, impl=impl)


@_expand_block_table.register_fake
def _(block_table, block_size, kernel_block_size, impl):
    k = block_size // kernel_block_size
    return block_table.new_empty((block_table.shape[0], block_table.shape[1] * k))


# ---- paged attention ----


@torch.library.custom_op("kv_kernels::paged_attention", mutates_args=("out", "lse", "error_flag"))
def _paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    layout: str,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool,
    sliding_window: int,
    sinks: Tensor | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    num_splits: int,
    out: Tensor,
    lse: Tensor | None,
    impl: str,
    error_flag: Tensor | None,
    num_decodes: int = 0,
) -> None:
    res = paged_attention(
        q,
        kv_cache,
        _layout(layout),
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len=None if max_seq_len < 0 else max_seq_len,
        scale=scale,
        causal=causal,
        sliding_window=None if sliding_window < 0 else sliding_window,
        sinks=sinks,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        num_splits=None if num_splits <= 0 else num_splits,
        return_lse=lse is not None,
        out=out,
        impl=impl,
        error_flag=error_flag,
        num_decodes=num_decodes,
    )
    if lse is not None:
        lse.copy_(res[1])


@_paged_attention.register_fake
def _(
    q,
    kv_cache,
    layout,
    block_table,
    seq_lens,
    query_start_loc,
    max_query_len,
    max_seq_len,
    scale,
    causal,
    sliding_window,
    sinks,
    softcap,
    alibi_slopes,
    k_scale,
    v_scale,
    num_splits,
    out,
    lse,
    impl,
    error_flag,
    num_decodes=0,
) -> None:
    return None
