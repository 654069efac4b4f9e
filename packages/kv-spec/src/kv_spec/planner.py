"""The memory planner: from layer specs and a byte budget to groups, blocks and tensors.

Layers that share a spec form a group with one block table. Hybrid models (full + sliding window,
or groups with different head counts) get several groups that share one block-id space and one
page size: the planner unifies page sizes by growing a group's block size by an integer factor, or
else pads the smaller pages when allowed, or else raises.

Memory model (vLLM's hybrid allocator): the groups are cut to ``S`` layers each (``S`` layer
slots); layer slot ``s`` holds the ``s``-th layer of every group, and a block id is owned by one
group at a time, so the slots' memory is shared between groups without aliasing. Then::

    num_blocks = available_bytes // (page_size_bytes * S)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from kv_spec._checks import check_bool, check_int, check_positive_int
from kv_spec.layout import KVCacheLayout, LayoutOrder
from kv_spec.specs import AttentionSpec, cdiv

__all__ = [
    "NULL_BLOCKS",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheTensor",
    "merge_kv_cache_configs",
    "plan_kv_cache",
    "unify_page_sizes",
]

#: Block ids the allocator reserves and never gives a request: block 0, the *null block*
#: (kv-blocktable's ``BlockPool``, as vLLM's), which block tables use for positions a group no
#: longer reads (sliding windows). A plan must hold one request in the other blocks.
NULL_BLOCKS: Final[int] = 1


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec and one block table."""

    group_id: int
    layer_names: tuple[str, ...]
    spec: AttentionSpec


@dataclass(frozen=True)
class KVCacheTensor:
    """One allocation: ``size_bytes`` bytes shared by ``shared_by`` layers (at most one per group)."""

    name: str
    size_bytes: int
    shared_by: tuple[str, ...]
    layer_slot: int | None  # None: a cross-layer slab holding every slot


@dataclass(frozen=True)
class KVCacheConfig:
    """What to allocate and how it is addressed. Built by :func:`plan_kv_cache`."""

    num_blocks: int
    num_layer_slots: int
    page_size_bytes: int
    layout_order: LayoutOrder
    groups: tuple[KVCacheGroup, ...]
    tensors: tuple[KVCacheTensor, ...]
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    #: per-token-head groups keep their scales in a plane after each page's data
    #: (:attr:`KVCacheLayout.scale_plane`); other groups are unaffected. :func:`plan_kv_cache`
    #: sets it wherever the groups' layouts can take a plane unless told otherwise
    scale_plane: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(t.size_bytes for t in self.tensors)

    def group_of(self, layer_name: str) -> KVCacheGroup:
        for g in self.groups:
            if layer_name in g.layer_names:
                return g
        raise KeyError(f"layer {layer_name!r} is in no KV-cache group of this config")

    def layer_slot(self, layer_name: str) -> int:
        """Index of the layer slot holding ``layer_name``'s pages."""
        return self.group_of(layer_name).layer_names.index(layer_name)

    def layout(self, group_id: int) -> KVCacheLayout:
        """The layout of group ``group_id`` over the whole allocation (all layer slots)."""
        if isinstance(group_id, bool) or not isinstance(group_id, int):
            raise ValueError(f"group_id={group_id!r} must be an int index of config.groups")
        if not 0 <= group_id < len(self.groups):
            raise ValueError(
                f"group_id={group_id} is out of range: this config has {len(self.groups)} KV-cache "
                f"group(s), ids 0..{len(self.groups) - 1}"
            )
        spec = self.groups[group_id].spec
        return KVCacheLayout.from_spec(
            spec,
            num_blocks=self.num_blocks,
            num_layers=self.num_layer_slots,
            order=self.layout_order,
            scale_plane=self.scale_plane and spec.kv_quant.per_token_head,
        )

    def blocks_per_request(self, max_model_len: int | None = None) -> int:
        """Blocks one request of ``max_model_len`` tokens needs across all groups."""
        mml = max_model_len if max_model_len is not None else self.max_model_len
        if mml is None:
            raise ValueError("blocks_per_request needs max_model_len (none was planned with)")
        return _blocks_per_request(
            self.groups, self.page_size_bytes, mml, self.max_num_batched_tokens
        )

    def max_concurrency(self, max_model_len: int | None = None) -> float:
        """How many requests of ``max_model_len`` tokens fit at once (in the blocks the allocator
        hands out: all but the :data:`NULL_BLOCKS`)."""
        return (self.num_blocks - NULL_BLOCKS) / self.blocks_per_request(max_model_len)


def _blocks_per_request(
    groups: Sequence[KVCacheGroup], page: int, max_model_len: int, batched: int | None
) -> int:
    return sum(
        cdiv(
            g.spec.max_memory_usage_bytes(
                max_model_len=max_model_len, max_num_batched_tokens=batched
            ),
            page,
        )
        for g in groups
    )


def unify_page_sizes(
    specs: Sequence[AttentionSpec], *, allow_padding: bool = True
) -> list[AttentionSpec]:
    """Give every spec the largest page size: grow block sizes by an integer factor, else pad."""
    if not specs:
        return []
    target = max(s.page_size_bytes for s in specs)
    out: list[AttentionSpec] = []
    for s in specs:
        page = s.page_size_bytes
        if page == target:
            out.append(s)
        elif s.page_size_padded is None and target % page == 0:
            out.append(s.with_block_size(s.block_size * (target // page)))
        elif allow_padding and target % s.dtype_bytes == 0:
            out.append(replace(s, page_size_padded=target))
        else:
            raise ValueError(
                f"cannot unify page sizes: {type(s).__name__}(block_size={s.block_size}) has a "
                f"{page}-byte page and the largest page is {target} bytes, which is not an integer "
                "multiple; pass allow_padding=True or choose block sizes whose pages divide evenly"
            )
    return out


def plan_kv_cache(
    specs: Mapping[str, AttentionSpec],
    available_bytes: int,
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    layout_order: LayoutOrder | str = LayoutOrder.LBNHC,
    allow_padding: bool = True,
    scale_plane: bool | None = None,
) -> KVCacheConfig:
    """Plan a KV cache for ``specs`` (layer name -> spec) within ``available_bytes``.

    Given ``max_model_len`` it refuses a budget too small for one request of that length.
    ``scale_plane``: where per-token-head groups keep their scales. ``None`` (the default): in a
    plane after each page's data (``KVCacheLayout.scale_plane``: rows of K + V at a 16-byte pitch,
    the layout decode reads fastest; same page bytes) when every such group's layout can take one
    (a page-contiguous order, page data a multiple of 16 bytes), else inline in the rows;
    ``True``: a plane, refused when no layer has per-token-head scales or a group's layout cannot
    take one; ``False``: inline. The config records the choice (:attr:`KVCacheConfig.scale_plane`).
    A plane layout has no kernel-block view (:meth:`KVCacheLayout.kernel_block_problem`): plan
    with ``False`` for a backend that splits blocks and reads per-token-head scales.
    """
    if not specs:
        raise ValueError("plan_kv_cache needs at least one layer spec; got an empty mapping")
    for name, spec in specs.items():
        if not isinstance(spec, AttentionSpec):
            raise ValueError(
                f"layer {name!r} has {type(spec).__name__}, not a kv_spec AttentionSpec"
            )
    check_int("plan_kv_cache", "available_bytes", available_bytes, minimum=0)
    if max_model_len is not None:
        check_positive_int("plan_kv_cache", "max_model_len", max_model_len)
    if max_num_batched_tokens is not None:
        check_positive_int("plan_kv_cache", "max_num_batched_tokens", max_num_batched_tokens)
    order = LayoutOrder.parse(layout_order)
    if scale_plane is not None:
        check_bool("plan_kv_cache", "scale_plane", scale_plane)
    if scale_plane and not any(s.kv_quant.per_token_head for s in specs.values()):
        raise ValueError(
            "scale_plane=True but no layer stores per-token-head scales (kv_quant "
            f"{sorted({s.kv_quant.value for s in specs.values()})}); drop scale_plane or use "
            "int8_per_token_head / fp8_per_token_head"
        )

    # Group layers by spec, in first-seen order.
    by_spec: dict[AttentionSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    unified = unify_page_sizes(list(by_spec), allow_padding=allow_padding)
    page = unified[0].page_size_bytes
    padded = [s for s in unified if s.page_size_bytes != s.real_page_size_bytes]
    if padded and not order.page_contiguous:
        raise ValueError(
            f"{type(padded[0]).__name__} pages need padding ({padded[0].real_page_size_bytes} -> "
            f"{page} bytes), which layout {order.value} cannot express (it interleaves pages); "
            "use LBNHC, LBHNC, BLNHC or BLHNC"
        )

    layer_lists = list(by_spec.values())
    slots = (
        min(len(names) for names in layer_lists) if len(layer_lists) > 1 else len(layer_lists[0])
    )
    groups: list[KVCacheGroup] = []
    for spec, names in zip(unified, layer_lists, strict=True):
        for start in range(0, len(names), slots):
            groups.append(KVCacheGroup(len(groups), tuple(names[start : start + slots]), spec))

    num_blocks = available_bytes // (page * slots)
    if num_blocks < 1:
        raise ValueError(
            f"available_bytes={available_bytes} holds no block: one block id costs "
            f"{page} bytes x {slots} layer slots = {page * slots} bytes"
        )
    if max_model_len is not None:
        need = _blocks_per_request(groups, page, max_model_len, max_num_batched_tokens)
        if num_blocks - NULL_BLOCKS < need:
            raise ValueError(
                f"available_bytes={available_bytes} gives num_blocks={num_blocks} "
                f"({page}-byte pages x {slots} layer slots), but one request of "
                f"max_model_len={max_model_len} needs {need} blocks besides the allocator's "
                f"null block; give at least {(need + NULL_BLOCKS) * page * slots} bytes or lower "
                "max_model_len"
            )

    tensors: list[KVCacheTensor]
    if order.layer_outer:
        tensors = [
            KVCacheTensor(
                name=f"kv_cache.slot{s}",
                size_bytes=num_blocks * page,
                shared_by=tuple(g.layer_names[s] for g in groups if s < len(g.layer_names)),
                layer_slot=s,
            )
            for s in range(slots)
        ]
    else:
        tensors = [
            KVCacheTensor(
                name="kv_cache.slab",
                size_bytes=num_blocks * page * slots,
                shared_by=tuple(n for g in groups for n in g.layer_names),
                layer_slot=None,
            )
        ]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        num_layer_slots=slots,
        page_size_bytes=page,
        layout_order=order,
        groups=tuple(groups),
        tensors=tuple(tensors),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        scale_plane=scale_plane is not False
        and any(g.spec.kv_quant.per_token_head for g in groups),
    )
    if config.scale_plane:  # each plane layout validates itself (order, alignment)
        try:
            for g in groups:
                config.layout(g.group_id)
        except ValueError:
            if scale_plane:  # asked for: refuse, naming the group's problem
                raise
            config = replace(config, scale_plane=False)  # the default: inline where no plane fits
    return config


def merge_kv_cache_configs(configs: Sequence[KVCacheConfig]) -> KVCacheConfig:
    """One config for all workers: the same groups everywhere, ``num_blocks`` = the minimum."""
    if not configs:
        raise ValueError("merge_kv_cache_configs needs at least one config")
    first = configs[0]
    for i, c in enumerate(configs[1:], start=1):
        if (c.groups, c.num_layer_slots, c.page_size_bytes, c.layout_order, c.scale_plane) != (
            first.groups,
            first.num_layer_slots,
            first.page_size_bytes,
            first.layout_order,
            first.scale_plane,
        ):
            raise ValueError(
                f"worker {i}'s KV-cache config differs from worker 0's in groups, layer slots, page "
                "size, layout order or scale plane; every worker must plan from the same specs"
            )
    num_blocks = min(c.num_blocks for c in configs)
    per_block = first.page_size_bytes * (
        1 if first.layout_order.layer_outer else first.num_layer_slots
    )
    tensors = tuple(replace(t, size_bytes=num_blocks * per_block) for t in first.tensors)
    return replace(first, num_blocks=num_blocks, tensors=tensors)
