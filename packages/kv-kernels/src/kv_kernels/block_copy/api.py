"""Block copies: ``gather_blocks`` / ``scatter_blocks`` (paged cache <-> contiguous buffer, any device
pair) and ``copy_blocks`` (copy-on-write inside one cache).

The buffer format: a ``uint8`` tensor ``[n, layout.num_layers * layout.page_bytes]``; row ``i`` holds
block ``block_ids[i]``'s pages of every layer slot, layer-major, each page's bytes in the physical
order of the layout (for page-contiguous orders the page's raw bytes, padding included; for the
head-outer orders LHBNC / BHLNC the ``H`` per-head ``[N, C]`` pieces one after the other). Two
caches with the same :meth:`~kv_spec.KVCacheLayout.compatibility_hash` exchange such rows as they are.

Every function validates its inputs and dispatches on an explicit ``impl``: ``"reference"`` (torch,
any device pair), ``"triton"`` (one launch; cache on CUDA, buffer on the same GPU or in pinned host
memory; or all on the CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (triton when the cache is on
CUDA, else reference). Nothing falls back silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from kv_spec import KVCacheLayout, to_torch_dtype

from kv_kernels import _op_calls
from kv_kernels._common import check_error_flag, resolve_impl
from kv_kernels.cache import KVCacheStorage

__all__ = ["PageGeometry", "copy_blocks", "gather_blocks", "page_geometry", "scatter_blocks"]

BlockIds = torch.Tensor | Sequence[int]


class PageGeometry(NamedTuple):
    """Where the pages of a cache live, in bytes; what both implementations copy from.

    A page (one block of one layer slot) is ``num_chunks`` contiguous chunks of ``chunk_bytes``;
    chunk ``j`` of block ``b`` of layer slot ``l`` starts at byte
    ``b * block_stride + j * chunk_stride`` of ``layer_bytes[l]``.
    """

    num_layers: int
    num_blocks: int
    page_bytes: int  # bytes of one page in a buffer row (padding included)
    num_chunks: int  # 1 for page-contiguous orders, H for LHBNC / BHLNC
    chunk_bytes: int  # page_bytes // num_chunks
    block_stride: int  # bytes between consecutive blocks of one layer slot
    chunk_stride: int  # bytes between consecutive chunks of one page
    layer_stride: (
        int | None
    )  # bytes between layer slots of a cross-layer slab; None for per-layer tensors
    layer_bytes: tuple[torch.Tensor, ...]  # per layer slot: flat uint8 view from its first byte


def page_geometry(kv_cache: KVCacheStorage, layout: KVCacheLayout) -> PageGeometry:
    """Check ``kv_cache`` (what :func:`~kv_kernels.allocate_kv_cache` returned for ``layout``) and
    describe its pages in bytes."""
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
    dtype = to_torch_dtype(layout.dtype)
    eb = layout.element_bytes
    order = layout.order
    byte_strides = layout.byte_strides  # (L, B, H, N, C)
    if order.page_contiguous:
        num_chunks, chunk_bytes, chunk_stride = 1, layout.page_bytes, layout.page_bytes
    else:
        # heads outside blocks: a page is H pieces of [N, C], one per head
        num_chunks = layout.num_kv_heads
        chunk_bytes = layout.block_size * layout.content_size * eb
        chunk_stride = byte_strides[2]
    if order.layer_outer:
        if isinstance(kv_cache, torch.Tensor) or not isinstance(kv_cache, Sequence):
            raise ValueError(
                f"layout {order.value} is allocated per layer slot: pass the list of "
                f"{layout.num_layers} per-layer tensors from allocate_kv_cache, not one tensor"
            )
        if len(kv_cache) != layout.num_layers:
            raise ValueError(
                f"kv_cache has {len(kv_cache)} layer tensors; the layout has {layout.num_layers} layer slots"
            )
        strides = tuple(
            s for d, s in zip(order.value, layout.physical_strides, strict=True) if d != "L"
        )
        tensors = list(kv_cache)
        for i, t in enumerate(tensors):
            _check_storage(f"kv_cache[{i}]", t, layout.layer_shape, strides, dtype, layout)
        layer_bytes = tuple(_flat_bytes(t) for t in tensors)
        layer_stride = None
    else:
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(
                f"layout {order.value} is cross-layer: pass the one slab from allocate_kv_cache"
            )
        _check_storage(
            "kv_cache", kv_cache, layout.physical_shape, layout.physical_strides, dtype, layout
        )
        tensors = [kv_cache]
        flat = _flat_bytes(kv_cache)
        layer_stride = byte_strides[0]
        layer_bytes = tuple(flat[i * layer_stride :] for i in range(layout.num_layers))
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"the layer tensors of kv_cache are on several devices {sorted(map(str, devices))}"
        )
    return PageGeometry(
        num_layers=layout.num_layers,
        num_blocks=layout.num_blocks,
        page_bytes=layout.page_bytes,
        num_chunks=num_chunks,
        chunk_bytes=chunk_bytes,
        block_stride=byte_strides[1],
        chunk_stride=chunk_stride,
        layer_stride=layer_stride,
        layer_bytes=layer_bytes,
    )


def _geometry(
    kv_cache: KVCacheStorage | PageGeometry, layout: KVCacheLayout, op: str
) -> PageGeometry:
    """``kv_cache``'s :class:`PageGeometry`: computed and checked (:func:`page_geometry`), or the
    one the caller computed once for this cache and passes back (a connector copying from its
    registered cache chunk after chunk: the check and the byte views cost ~0.1 ms per cache, and
    ~0.36 ms for 32 per-layer tensors, on a GPU host), held to ``layout``'s sizes."""
    if not isinstance(kv_cache, PageGeometry):
        return page_geometry(kv_cache, layout)
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
    got = (kv_cache.num_layers, kv_cache.num_blocks, kv_cache.page_bytes)
    want = (layout.num_layers, layout.num_blocks, layout.page_bytes)
    if got != want:
        raise ValueError(
            f"{op}: the PageGeometry given as kv_cache has (num_layers, num_blocks, page_bytes)="
            f"{got} but the layout has {want}; pass page_geometry(kv_cache, layout) of this cache"
        )
    return kv_cache


def _check_storage(
    name: str,
    t: object,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: torch.dtype,
    layout: KVCacheLayout,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(
            f"{name} is {t.dtype}{list(t.shape)} but layout {layout.order.value} stores "
            f"{dtype}{list(shape)}; allocate it with allocate_kv_cache(layout)"
        )
    if tuple(t.stride()) != tuple(strides):
        raise ValueError(
            f"{name} has strides {t.stride()} but the layout's are {strides}; block copies move "
            "whole pages and need the storage as allocate_kv_cache made it (not a layer view)"
        )


def _storage_only(kv_cache: KVCacheStorage | PageGeometry, op: str) -> KVCacheStorage:
    """The storage a custom op takes under ``torch.compile`` (a :class:`PageGeometry` is refused)."""
    if isinstance(kv_cache, PageGeometry):
        raise ValueError(
            f"{op}: under torch.compile pass the cache storage, not its PageGeometry (the custom "
            "op takes tensors)"
        )
    return kv_cache


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view from ``t``'s first byte to the end of its storage (page padding included)."""
    start = t.storage_offset() * t.element_size()
    nbytes = t.untyped_storage().nbytes() - start
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(t.untyped_storage(), start, (nbytes,), (1,))
    return raw


def _resolve_impl(impl: str, geo: PageGeometry, others: Sequence[torch.Tensor], op: str) -> str:
    """Pick the implementation and check that it can address every tensor involved."""
    return resolve_impl(impl, geo.layer_bytes[0].device, op=op, others=others)


def _as_ids(name: str, ids: BlockIds, num_blocks: int, device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of block ids, range-checked when it is on the CPU."""
    if not isinstance(ids, torch.Tensor):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(
                f"{name} must be a sequence of ints or an int tensor, got {type(ids).__name__}"
            )
        non_ints = [x for x in ids if isinstance(x, bool) or not isinstance(x, int)]
        if non_ints:
            # torch.tensor([1.7], dtype=int64) truncates to block 1: refuse instead
            raise TypeError(
                f"{name} holds {non_ints[0]!r} ({type(non_ints[0]).__name__}); block ids must be ints"
            )
        huge = [x for x in ids if not -(2**63) <= x < 2**63]
        if huge:
            raise ValueError(
                f"{name} holds block id {huge[0]}, outside [0, num_blocks={num_blocks})"
            )
        ids = torch.tensor(list(ids), dtype=torch.int64)
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} dtype {ids.dtype} must be int32 or int64")
    if ids.device.type == "cpu":
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= num_blocks:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"{name} holds block id {bad}, outside [0, num_blocks={num_blocks})"
                )
    elif ids.device != device:
        raise ValueError(
            f"{name} is on {ids.device}; pass it on the CPU or on the cache's device {device}"
        )
    # CUDA ids are not range-checked (that would synchronize); the kernel skips ids out of range.
    return ids.to(torch.int64)


def _check_unique(name: str, ids: torch.Tensor) -> None:
    if ids.device.type == "cpu" and ids.numel() and torch.unique(ids).numel() != ids.numel():
        raise ValueError(
            f"{name} holds duplicate block ids; each destination block may be written once per call"
        )


def _check_buffer(name: str, buf: torch.Tensor, n: int, geo: PageGeometry) -> None:
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    row = geo.num_layers * geo.page_bytes
    if buf.dtype != torch.uint8 or buf.dim() != 2 or tuple(buf.shape) != (n, row):
        raise ValueError(
            f"{name} is {buf.dtype}{list(buf.shape)}; expected uint8 [{n}, {row}] "
            f"(block ids x num_layers={geo.num_layers} * page_bytes={geo.page_bytes})"
        )
    if n and (buf.stride(1) != 1 or buf.stride(0) < row):
        raise ValueError(
            f"{name} rows must be contiguous (strides {buf.stride()}; need (>= {row}, 1))"
        )


def gather_blocks(
    kv_cache: KVCacheStorage | PageGeometry,
    layout: KVCacheLayout,
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    impl: str = "auto",
    error_flag: torch.Tensor | None = None,
    load_only: bool = False,
) -> None:
    """Copy blocks ``block_ids`` (``[n]``, every layer slot) of ``kv_cache`` into ``out``.

    ``kv_cache`` is the whole storage from :func:`~kv_kernels.allocate_kv_cache`; ``out`` is a
    ``uint8 [n, num_layers * page_bytes]`` buffer (format in the module docstring) on any device;
    with ``impl="triton"`` on the cache's GPU or in pinned host memory. Block ids on the CPU are
    range-checked; ids on the GPU are not (that would synchronize): out-of-range ones are skipped and,
    with ``error_flag`` (int32 ``[1]`` on the cache's device), counted there.

    CUDA graphs: capture works with a cross-layer (slab) layout and block ids already on the GPU;
    a per-layer cache needs a per-call address table and raises under capture.

    ``kv_cache`` may also be its :class:`PageGeometry` (``page_geometry(kv_cache, layout)``,
    computed once by a caller that copies from the same cache again and again): the storage
    check is then skipped (not under ``torch.compile``, whose op takes the storage).

    ``load_only=True`` reads and writes nothing: it checks the call and builds and loads the
    Triton kernel variant it would launch (an empty grid), for a caller about to leave the
    device busy on a kernel that waits for another process (an NCCL receive): CUDA loads a
    module only when the device can take it, so a copy whose kernel is first loaded under a
    pending receive waits for that receive (the 2 x H200 layer-wise pull whose producer held
    its last layer until the first had landed hung there). The reference path loads nothing.
    """
    if torch.compiler.is_compiling():
        if load_only:  # (the compiled graph builds its kernels itself)
            return
        _op_calls.gather_blocks_op(
            _storage_only(kv_cache, "gather_blocks"), layout, block_ids, out, impl=impl,
            error_flag=error_flag,
        )  # fmt: skip
        return
    geo = _geometry(kv_cache, layout, "gather_blocks")
    device = geo.layer_bytes[0].device
    ids = _as_ids("block_ids", block_ids, geo.num_blocks, device)
    _check_buffer("out", out, ids.numel(), geo)
    chosen = _resolve_impl(impl, geo, [out], "gather_blocks")
    check_error_flag(error_flag, device, op="gather_blocks")
    if load_only and chosen == "reference":
        return
    if chosen == "reference":
        from kv_kernels.block_copy.reference import gather_blocks_reference

        gather_blocks_reference(geo, ids, out)
    else:
        from kv_kernels.block_copy.triton import gather_blocks_triton

        gather_blocks_triton(geo, ids, out, error_flag, load_only)


def scatter_blocks(
    buffer: torch.Tensor,
    kv_cache: KVCacheStorage | PageGeometry,
    layout: KVCacheLayout,
    block_ids: BlockIds,
    *,
    impl: str = "auto",
    error_flag: torch.Tensor | None = None,
    load_only: bool = False,
) -> None:
    """Copy rows of ``buffer`` (``uint8 [n, num_layers * page_bytes]``) into blocks ``block_ids`` of
    ``kv_cache`` (every layer slot); the inverse of :func:`gather_blocks`. Duplicate ids are
    rejected (when the ids are on the CPU). ``kv_cache`` may be its :class:`PageGeometry`, as
    for :func:`gather_blocks`; ``load_only`` as there."""
    if torch.compiler.is_compiling():
        if load_only:  # (the compiled graph builds its kernels itself)
            return
        _op_calls.scatter_blocks_op(
            buffer, _storage_only(kv_cache, "scatter_blocks"), layout, block_ids, impl=impl,
            error_flag=error_flag,
        )  # fmt: skip
        return
    geo = _geometry(kv_cache, layout, "scatter_blocks")
    device = geo.layer_bytes[0].device
    ids = _as_ids("block_ids", block_ids, geo.num_blocks, device)
    _check_unique("block_ids", ids)
    _check_buffer("buffer", buffer, ids.numel(), geo)
    chosen = _resolve_impl(impl, geo, [buffer], "scatter_blocks")
    check_error_flag(error_flag, device, op="scatter_blocks")
    if load_only and chosen == "reference":
        return
    if chosen == "reference":
        from kv_kernels.block_copy.reference import scatter_blocks_reference

        scatter_blocks_reference(buffer, geo, ids)
    else:
        from kv_kernels.block_copy.triton import scatter_blocks_triton

        scatter_blocks_triton(buffer, geo, ids, error_flag, load_only)


def copy_blocks(
    kv_cache: KVCacheStorage,
    layout: KVCacheLayout,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    impl: str = "auto",
    error_flag: torch.Tensor | None = None,
) -> None:
    """Copy block ``src_block_ids[i]`` to ``dst_block_ids[i]`` in every layer slot (copy-on-write).

    Destinations must be distinct and must not be among the sources (the copies run in parallel);
    checked when the ids are on the CPU.
    """
    if torch.compiler.is_compiling():
        _op_calls.copy_blocks_op(
            kv_cache, layout, src_block_ids, dst_block_ids, impl=impl, error_flag=error_flag
        )
        return
    geo = page_geometry(kv_cache, layout)
    device = geo.layer_bytes[0].device
    src = _as_ids("src_block_ids", src_block_ids, geo.num_blocks, device)
    dst = _as_ids("dst_block_ids", dst_block_ids, geo.num_blocks, device)
    if src.numel() != dst.numel():
        raise ValueError(
            f"src_block_ids has {src.numel()} ids but dst_block_ids has {dst.numel()}; pair them"
        )
    _check_unique("dst_block_ids", dst)
    if src.device.type == "cpu" and dst.device.type == "cpu" and src.numel():
        both = set(src.tolist()) & set(dst.tolist())
        if both:
            raise ValueError(
                f"blocks {sorted(both)[:8]} are both sources and destinations; the copies run in "
                "parallel, so split the call"
            )
    chosen = _resolve_impl(impl, geo, [], "copy_blocks")
    check_error_flag(error_flag, device, op="copy_blocks")
    if chosen == "reference":
        from kv_kernels.block_copy.reference import copy_blocks_reference

        copy_blocks_reference(geo, src, dst)
    else:
        from kv_kernels.block_copy.triton import copy_blocks_triton

        copy_blocks_triton(geo, src, dst, error_flag)
