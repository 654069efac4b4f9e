"""The cache-write, block-copy and slot-mapping ops registered once as torch custom ops.

``torch.ops.kv_kernels.<name>`` is what ``torch.compile`` traces (one opaque node, mutations
declared) and what a CUDA graph captures; the public functions in each op's ``api.py`` call it
themselves when they run under ``torch.compile``, so users call the plain functions everywhere.

Schemas carry the layout as its JSON (a primitive that compiles into the graph as a constant) and
scales / block ids as tensors. Each op's real implementation is the validating api function; the
fake implementations only give output shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from kv_spec import KVCacheLayout

__all__ = [
    "compute_slot_mapping_op",
    "copy_blocks_op",
    "expand_block_table_op",
    "gather_blocks_op",
    "reshape_and_cache_op",
    "scatter_blocks_op",
]

Tensor = torch.Tensor


@functools.lru_cache(maxsize=256)
def _layout(layout_json: str) -> KVCacheLayout:
    """Parse a layout once per distinct JSON (layouts are frozen values)."""
    return KVCacheLayout.from_json(layout_json)


def _layout_json(layout: KVCacheLayout) -> str:
    """The layout as JSON, for the op schemas (``KVCacheLayout.from_json`` reads it back).

    Written with an f-string over the fields rather than ``layout.to_json()``: under torch.compile
    dynamo folds attribute reads and string formatting of constants into one constant string,
    while it cannot trace ``json.dumps`` nor (torch 2.11) pass a frozen dataclass to
    ``assume_constant_result``. Every field is an int, a bool or a plain identifier, so no escaping
    is needed; a test checks the round trip.
    """
    return (
        f'{{"order":"{layout.order.value}","num_layers":{layout.num_layers},'
        f'"num_blocks":{layout.num_blocks},"num_kv_heads":{layout.num_kv_heads},'
        f'"block_size":{layout.block_size},"head_size":{layout.head_size},'
        f'"head_size_v":{layout.head_size_v},"dtype":"{layout.dtype}",'
        f'"kv_quant":"{layout.kv_quant.value}","is_mla":{"true" if layout.is_mla else "false"},'
        f'"page_size_bytes":{layout.page_size_bytes}}}'
    )


def _storage(tensors: list[Tensor], layout: KVCacheLayout) -> Tensor | list[Tensor]:
    """The op schemas take the storage as a list: one slab travels as ``[slab]``."""
    return list(tensors) if layout.order.layer_outer else tensors[0]


def _as_list(kv_cache: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [kv_cache] if isinstance(kv_cache, Tensor) else list(kv_cache)


def _ids(ids: Tensor | Sequence[int]) -> Tensor:
    return ids if isinstance(ids, Tensor) else torch.tensor(list(ids), dtype=torch.int64)


def _scale(scale: float | Tensor | None, device: torch.device) -> Tensor | None:
    if scale is None or isinstance(scale, Tensor):
        return scale
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


# ---- reshape_and_cache ---------------------------------------------------------------------------


@torch.library.custom_op("kv_kernels::reshape_and_cache", mutates_args=("kv_cache",))
def _reshape_and_cache(
    key: Tensor,
    value: Tensor | None,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    layout: str,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    impl: str,
) -> None:
    from kv_kernels.reshape_and_cache.api import reshape_and_cache

    reshape_and_cache(
        key, value, kv_cache, slot_mapping, _layout(layout), k_scale, v_scale, impl=impl
    )


@_reshape_and_cache.register_fake
def _(key, value, kv_cache, slot_mapping, layout, k_scale, v_scale, impl) -> None:
    return None


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
) -> None:
    """``torch.ops.kv_kernels.reshape_and_cache`` with the api's argument types."""
    torch.ops.kv_kernels.reshape_and_cache(
        key,
        value,
        kv_cache,
        slot_mapping,
        _layout_json(layout),
        _scale(k_scale, kv_cache.device),
        _scale(v_scale, kv_cache.device),
        impl,
    )


# ---- block copies --------------------------------------------------------------------------------


@torch.library.custom_op("kv_kernels::gather_blocks", mutates_args=("out",))
def _gather_blocks(
    kv_cache: list[Tensor], layout: str, block_ids: Tensor, out: Tensor, impl: str
) -> None:
    from kv_kernels.block_copy.api import gather_blocks

    lay = _layout(layout)
    gather_blocks(_storage(kv_cache, lay), lay, block_ids, out, impl=impl)


@_gather_blocks.register_fake
def _(kv_cache, layout, block_ids, out, impl) -> None:
    return None


@torch.library.custom_op("kv_kernels::scatter_blocks", mutates_args=("kv_cache",))
def _scatter_blocks(
    buffer: Tensor, kv_cache: list[Tensor], layout: str, block_ids: Tensor, impl: str
) -> None:
    from kv_kernels.block_copy.api import scatter_blocks

    lay = _layout(layout)
    scatter_blocks(buffer, _storage(kv_cache, lay), lay, block_ids, impl=impl)


@_scatter_blocks.register_fake
def _(buffer, kv_cache, layout, block_ids, impl) -> None:
    return None


@torch.library.custom_op("kv_kernels::copy_blocks", mutates_args=("kv_cache",))
def _copy_blocks(
    kv_cache: list[Tensor], layout: str, src_block_ids: Tensor, dst_block_ids: Tensor, impl: str
) -> None:
    from kv_kernels.block_copy.api import copy_blocks

    lay = _layout(layout)
    copy_blocks(_storage(kv_cache, lay), lay, src_block_ids, dst_block_ids, impl=impl)


@_copy_blocks.register_fake
def _(kv_cache, layout, src_block_ids, dst_block_ids, impl) -> None:
    return None


def gather_blocks_op(
    kv_cache: Tensor | Sequence[Tensor],
    layout: KVCacheLayout,
    block_ids: Tensor | Sequence[int],
    out: Tensor,
    *,
    impl: str = "auto",
) -> None:
    """``torch.ops.kv_kernels.gather_blocks`` with the api's argument types."""
    torch.ops.kv_kernels.gather_blocks(
        _as_list(kv_cache), _layout_json(layout), _ids(block_ids), out, impl
    )


def scatter_blocks_op(
    buffer: Tensor,
    kv_cache: Tensor | Sequence[Tensor],
    layout: KVCacheLayout,
    block_ids: Tensor | Sequence[int],
    *,
    impl: str = "auto",
) -> None:
    """``torch.ops.kv_kernels.scatter_blocks`` with the api's argument types."""
    torch.ops.kv_kernels.scatter_blocks(
        buffer, _as_list(kv_cache), _layout_json(layout), _ids(block_ids), impl
    )


def copy_blocks_op(
    kv_cache: Tensor | Sequence[Tensor],
    layout: KVCacheLayout,
    src_block_ids: Tensor | Sequence[int],
    dst_block_ids: Tensor | Sequence[int],
    *,
    impl: str = "auto",
) -> None:
    """``torch.ops.kv_kernels.copy_blocks`` with the api's argument types."""
    torch.ops.kv_kernels.copy_blocks(
        _as_list(kv_cache), _layout_json(layout), _ids(src_block_ids), _ids(dst_block_ids), impl
    )


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
    from kv_kernels.slot_mapping.api import compute_slot_mapping

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
    from kv_kernels.slot_mapping.api import expand_block_table

    return expand_block_table(block_table, block_size, kernel_block_size, impl=impl)


@_expand_block_table.register_fake
def _(block_table, block_size, kernel_block_size, impl):
    k = block_size // kernel_block_size
    return block_table.new_empty((block_table.shape[0], block_table.shape[1] * k))


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
