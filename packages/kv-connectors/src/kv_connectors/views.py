"""Registered KV caches as byte views, read from the layout descriptor only.

A connector never looks at a tensor's shape to learn what it holds: it takes each cache's
:class:`kv_spec.KVCacheLayout` and moves *whole blocks* as rows of bytes. A *row* of one block is
the bytes ``kv_kernels.gather_blocks`` writes for it: every layer slot's page, layer-major
(``[L, page_bytes]``, padding and inline per-token-head scales included, so quantized KV always
travels with its scales). With several registered caches (hybrid models: one per KV-cache group,
sharing one block-id space), a block's row is the caches' rows one after the other.

A *segment* is what moves in one ``gather_blocks``/``scatter_blocks`` call: one layer slot of a
per-layer (``L``-outer) cache, or a whole cross-layer slab. Layer-wise loading waits per segment.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kv_kernels import KVCacheStorage, gather_blocks, scatter_blocks
from kv_kernels.block_copy import PageGeometry, page_geometry
from kv_spec import KVCacheLayout

__all__ = ["ByteRange", "CacheSegment", "RegisteredKV", "is_run", "single_layer_layout"]


def single_layer_layout(layout: KVCacheLayout) -> KVCacheLayout:
    """The layout of one layer slot of an ``L``-outer cache (same page, ``num_layers=1``)."""
    data = layout.to_dict()
    data["num_layers"] = 1
    return KVCacheLayout.from_dict(data)


def is_run(block_ids: Sequence[int]) -> bool:
    """``block_ids`` are ``b0, b0 + 1, ...`` (not empty): the last id compared first, so
    shuffled ids are refused without the walk."""
    n = len(block_ids)
    if not n:
        return False
    b0 = block_ids[0]
    return block_ids[-1] == b0 + n - 1 and list(block_ids) == list(range(b0, b0 + n))


class ByteRange(tuple[int, int]):
    """``(address, nbytes)`` of one contiguous piece of a block (what NIXL descriptors name)."""

    __slots__ = ()


@dataclass(frozen=True)
class CacheSegment:
    """One unit of block copies: a per-layer tensor or a cross-layer slab."""

    cache_index: int  # which registered cache
    first_layer: int  # global index (over all registered caches) of its first layer slot
    num_layers: int
    storage: (
        KVCacheStorage  # what gather_blocks takes: ``[tensor]`` for one layer slot, or the slab
    )
    layout: KVCacheLayout  # its layout (num_layers=1 for a per-layer piece)
    row_offset: int  # byte offset of this segment's pages in a block row
    row_bytes: int  # num_layers * page_bytes

    @property
    def tensor(self) -> torch.Tensor:
        return self.storage if isinstance(self.storage, torch.Tensor) else self.storage[0]

    def chunk_ranges(self, block_id: int) -> list[ByteRange]:
        """Byte ranges of block ``block_id`` in this segment, in *row order*: read one after the
        other they are exactly the segment's part of the block's row (what ``gather_blocks``
        writes), so a remote read of them into a buffer yields producer rows.

        Layer slot ``l``'s page is ``H`` pieces of ``[N, C]`` for head-outer orders (LHBNC, BHLNC)
        and one piece otherwise; adjacent pieces are merged (a BLNHC block is one range, an LBNHC
        page one range, an LHBNC page one range per head, a BHLNC block one per layer and head).
        """
        lay = self.layout
        base = self.tensor.data_ptr() + block_id * lay.block_stride_bytes
        s_layer, _s_block, s_head = lay.byte_strides[:3]
        if lay.order.page_contiguous:
            pieces, piece, s_piece = 1, lay.page_bytes, 0
        else:
            pieces, piece, s_piece = (
                lay.num_kv_heads,
                lay.block_size * lay.content_size * lay.element_bytes,
                s_head,
            )
        out: list[ByteRange] = []
        for layer in range(self.num_layers):
            for j in range(pieces):
                addr = base + layer * s_layer + j * s_piece
                if out and out[-1][0] + out[-1][1] == addr:
                    out[-1] = ByteRange((out[-1][0], out[-1][1] + piece))
                else:
                    out.append(ByteRange((addr, piece)))
        return out


class RegisteredKV:
    """Every registered cache of a worker, cut into segments, with whole-block byte copies."""

    def __init__(
        self,
        storages: KVCacheStorage | Sequence[KVCacheStorage],
        layouts: KVCacheLayout | Sequence[KVCacheLayout],
    ) -> None:
        if isinstance(layouts, KVCacheLayout):
            layouts = [layouts]
            storages = [storages]  # type: ignore[list-item]
        layouts = list(layouts)
        storages = list(storages)
        if not layouts:
            raise ValueError("register_kv_caches needs at least one (storage, layout) pair")
        if len(storages) != len(layouts):
            raise ValueError(
                f"register_kv_caches got {len(storages)} storages and {len(layouts)} layouts; "
                "pass one layout per storage"
            )
        for i, lay in enumerate(layouts):
            if not isinstance(lay, KVCacheLayout):
                raise TypeError(f"layouts[{i}] must be a kv_spec.KVCacheLayout, got {type(lay)}")
        num_blocks = {lay.num_blocks for lay in layouts}
        if len(num_blocks) != 1:
            raise ValueError(
                f"registered caches have different num_blocks {sorted(num_blocks)}; caches that "
                "share one block-id space must have the same number of blocks"
            )
        self.layouts: tuple[KVCacheLayout, ...] = tuple(layouts)
        self.num_blocks = layouts[0].num_blocks
        self.segments: tuple[CacheSegment, ...] = tuple(self._cut(storages, layouts))
        self.row_bytes = sum(s.row_bytes for s in self.segments)
        self.num_layers = sum(lay.num_layers for lay in layouts)
        devices = {s.tensor.device for s in self.segments}
        if len(devices) != 1:
            raise ValueError(
                f"registered caches are on several devices {sorted(map(str, devices))}"
            )
        self.device: torch.device = devices.pop()
        #: Landing kernels already loaded (``load_only`` scatters), keyed by whoever lands: the
        #: layer-wise pull keys (segment, Triton's integer class of the chunk's row count).
        self.preloaded: set[tuple[object, ...]] = set()
        # Whole-row copies: one gather_blocks / scatter_blocks call per registered cache over all
        # its layer slots (a per-layer cache is one launch over its list of tensors, not one per
        # layer: issue 30 measured 32 launches and their host checks per chunk at 0.04x of NCCL).
        # Each storage is checked against its layout once here (shape, strides, dtype), and its
        # page geometry kept: the copies pass it instead of the storage, so no chunk pays the
        # check and the byte views again (~0.1 ms a slab, ~0.36 ms for 32 per-layer tensors on
        # an H200 host, on each side of every chunk).
        self._whole: tuple[tuple[PageGeometry, KVCacheLayout, int, int], ...] = tuple(
            (
                page_geometry(storage, lay),
                lay,
                self.cache_row_slice(ci).start,
                lay.num_layers * lay.page_bytes,
            )
            for ci, (storage, lay) in enumerate(zip(storages, layouts, strict=True))
        )
        self._seg_geo: tuple[PageGeometry, ...] = tuple(
            page_geometry(seg.storage, seg.layout) for seg in self.segments
        )
        # Per segment, its memory as ``[num_blocks, row_bytes]`` rows where a block's row is its
        # own bytes back to back (:meth:`contiguous_rows`), else None: a transfer's direct send
        # or receive then slices it (~1 us) in place of re-deriving the layout's strides and
        # setting a storage view every call (~20 us a call on this CPU, several a pull).
        self._direct: tuple[torch.Tensor | None, ...] = tuple(
            self._direct_view(seg) for seg in self.segments
        )

    @staticmethod
    def _cut(
        storages: Sequence[KVCacheStorage], layouts: Sequence[KVCacheLayout]
    ) -> list[CacheSegment]:
        out: list[CacheSegment] = []
        layer = 0
        offset = 0
        for ci, (storage, lay) in enumerate(zip(storages, layouts, strict=True)):
            if lay.order.layer_outer:
                if isinstance(storage, torch.Tensor) or len(storage) != lay.num_layers:
                    raise ValueError(
                        f"cache {ci} has layout {lay.order.value} (one tensor per layer slot): pass "
                        f"the list of {lay.num_layers} tensors allocate_kv_cache returned"
                    )
                one = single_layer_layout(lay)
                for t in storage:
                    out.append(CacheSegment(ci, layer, 1, [t], one, offset, one.page_bytes))
                    layer += 1
                    offset += one.page_bytes
            else:
                if not isinstance(storage, torch.Tensor):
                    raise ValueError(
                        f"cache {ci} has cross-layer layout {lay.order.value}: pass the one slab "
                        "allocate_kv_cache returned"
                    )
                nbytes = lay.num_layers * lay.page_bytes
                out.append(CacheSegment(ci, layer, lay.num_layers, storage, lay, offset, nbytes))
                layer += lay.num_layers
                offset += nbytes
        return out

    # -- geometry ------------------------------------------------------------------------------

    def segment_of_layer(self, layer: int) -> int:
        """Index of the segment holding global layer slot ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range [0, {self.num_layers})")
        for i, seg in enumerate(self.segments):
            if seg.first_layer <= layer < seg.first_layer + seg.num_layers:
                return i
        raise AssertionError("segments cover every layer")  # pragma: no cover

    def cache_row_slice(self, cache_index: int) -> slice:
        """Byte columns of a block row that belong to registered cache ``cache_index``."""
        segs = [s for s in self.segments if s.cache_index == cache_index]
        return slice(segs[0].row_offset, segs[-1].row_offset + segs[-1].row_bytes)

    def check_block_ids(self, block_ids: Sequence[int], *, what: str) -> None:
        # One pass over plain ints first (a producer checks a pull's ids on the critical path);
        # a list that fails it is walked id by id for the error naming the first bad one.
        ints = [b for b in block_ids if type(b) is int]
        if len(ints) == len(block_ids) and (
            not ints or (min(ints) >= 0 and max(ints) < self.num_blocks)
        ):
            return
        for b in block_ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise ValueError(
                    f"{what} holds block id {b!r}, outside [0, num_blocks={self.num_blocks})"
                )

    def ids_tensor(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an int64 tensor on the caches' device, checked on the host first.

        On CUDA the ids go through pinned memory with a non-blocking copy, so a copy call never
        waits for the GPU (block copies skip their own range check for device ids).
        """
        self.check_block_ids(block_ids, what="block_ids")
        # (through an int64 array: torch.tensor(list) walks the list in Python, ~40 us for 512
        # ids on this CPU against ~3)
        host = (
            torch.frombuffer(array.array("q", block_ids), dtype=torch.int64)
            if len(block_ids)
            else torch.empty(0, dtype=torch.int64)
        )
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def new_rows(self, n: int, *, pin: bool = False, width: int | None = None) -> torch.Tensor:
        """A ``uint8 [n, width or row_bytes]`` host buffer for ``n`` block rows (pinned when asked
        and the caches are on CUDA: the Triton block copies read and write pinned host rows)."""
        pin = pin and self.device.type == "cuda"
        cols = self.row_bytes if width is None else width
        return torch.empty(n, cols, dtype=torch.uint8, pin_memory=pin)

    def load_copy_kernels(self, *, host: bool, segments: bool) -> None:
        """Build and load every variant of the block copies a transfer of this cache can launch,
        so none is compiled while serving: Triton specializes a copy's row count (equal to 1,
        multiple of 16) and its pointers' alignment (the ids of a piece are a slice of a
        request's, 16-byte aligned or not). ``host``: the rows are pinned host memory (else the
        caches' device); ``segments``: one segment's columns a copy (else whole rows). An H200
        run compiled the CPU tier's copy kernels inside its first transfers (a step of 53 ms
        against ~38)."""
        if self.device.type != "cuda":
            return  # (the CPU path has nothing to compile)
        for n in (1, 16, 17):
            if n + 1 > self.num_blocks:
                break
            both = self.ids_tensor(list(range(n + 1)))
            for ids in (both[:n], both[1:]):  # (an int64 slice at an odd row: 8-byte aligned)
                if not segments:
                    rows = self._rows_for(n, self.row_bytes, host)
                    self.gather(ids, rows, load_only=True)
                    self.scatter(rows, ids, load_only=True)
                    continue
                for seg, s in enumerate(self.segments):
                    rows = self._rows_for(n, s.row_bytes, host)
                    one = range(seg, seg + 1)
                    self.gather(ids, rows, segments=one, cols=False, load_only=True)
                    self.scatter(rows, ids, segments=one, cols=False, load_only=True)

    def _rows_for(self, n: int, width: int, host: bool) -> torch.Tensor:
        if host:
            return self.new_rows(n, pin=True, width=width)
        return torch.empty(n, width, dtype=torch.uint8, device=self.device)

    def select_rows(self, rows: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
        """``rows[index]`` that stays usable by the block copies (pinned if ``rows`` is host
        memory and the caches are on CUDA; ``index_select`` alone returns pageable memory)."""
        idx = torch.tensor(list(index), dtype=torch.int64, device=rows.device)
        if rows.device.type != "cpu":
            return rows.index_select(0, idx)
        out = self.new_rows(len(idx), pin=True, width=rows.shape[1])
        return torch.index_select(rows, 0, idx, out=out)

    def _direct_view(self, seg: CacheSegment) -> torch.Tensor | None:
        lay = seg.layout
        if (
            not lay.order.page_contiguous
            or lay.scale_plane
            or lay.block_stride_bytes != seg.row_bytes
            or (seg.num_layers > 1 and lay.byte_strides[0] != lay.page_bytes)
        ):
            return None
        t = seg.tensor
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        start = t.storage_offset() * t.element_size()
        raw.set_(t.untyped_storage(), start, (self.num_blocks, seg.row_bytes), (seg.row_bytes, 1))
        return raw

    def contiguous_rows(
        self, block_ids: Sequence[int], segment: int | None = None
    ) -> torch.Tensor | None:
        """The cache's own memory as the rows of ``block_ids`` (``uint8 [n, width]``), or ``None``.

        Rows are what :meth:`gather` writes: all segments (``segment=None``) or one segment's
        columns. They already lie back to back in the cache when the ids are consecutive
        (``b0, b0 + 1, ...``), the segment's pages are contiguous (no head-outer order, no scale
        plane) and a block's pages fill its stride (cross-layer: layer pages one after the other);
        with several segments, whole rows never do. A transport then sends from (or receives
        into) this view directly: no gather, no staging copy. Ids past the cache are refused
        (``ValueError``), never clipped.
        """
        n = len(block_ids)
        if n == 0:
            return None
        if segment is None:
            if len(self.segments) != 1:
                return None
            segment = 0
        rows = self._direct[segment]
        if rows is None:
            return None
        if not is_run(block_ids):
            return None
        b0 = block_ids[0]
        if b0 < 0 or b0 + n > self.num_blocks:
            raise ValueError(
                f"block ids [{b0}, {b0 + n}) are outside [0, num_blocks={self.num_blocks})"
            )
        return rows[b0 : b0 + n]

    def host_sync(self) -> None:
        """Wait for the caches' device (CUDA) before host memory read by a copy may be reused."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- copies --------------------------------------------------------------------------------

    def gather(
        self,
        block_ids: Sequence[int] | torch.Tensor,
        out: torch.Tensor,
        *,
        segments: range | None = None,
        cols: bool = True,
        load_only: bool = False,
    ) -> None:
        """Copy blocks ``block_ids`` of the chosen segments (default: all) into ``out``.

        ``out``: ``uint8 [n, row_bytes]`` (each segment into its columns), or with ``cols=False``
        and one segment ``uint8 [n, segment row bytes]``; on any device (pinned host or the
        cache's GPU for the Triton path). Enqueued on the current stream when the cache is on CUDA.
        Whole rows (``segments=None``) are one ``gather_blocks`` call per registered cache.
        ``load_only``: copy nothing, only load the kernels the call would launch.
        """
        if segments is None:
            for geo, lay, offset, width in self._whole:
                part = out[:, offset : offset + width]
                gather_blocks(geo, lay, block_ids, part, load_only=load_only)
            return
        for i in segments:
            seg = self.segments[i]
            part = out[:, seg.row_offset : seg.row_offset + seg.row_bytes] if cols else out
            gather_blocks(self._seg_geo[i], seg.layout, block_ids, part, load_only=load_only)

    def scatter(
        self,
        rows: torch.Tensor,
        block_ids: Sequence[int] | torch.Tensor,
        *,
        segments: range | None = None,
        cols: bool = True,
        load_only: bool = False,
    ) -> None:
        """Copy ``rows`` (``uint8 [n, row_bytes]``, or one segment's ``[n, segment row bytes]``
        with ``cols=False``) into blocks ``block_ids`` of the chosen segments (whole rows: one
        ``scatter_blocks`` call per registered cache). ``load_only``: write nothing, only load
        the kernels the call would launch (``kv_kernels.scatter_blocks``)."""
        if segments is None:
            for geo, lay, offset, width in self._whole:
                part = rows[:, offset : offset + width]
                scatter_blocks(part, geo, lay, block_ids, load_only=load_only)
            return
        for i in segments:
            seg = self.segments[i]
            part = rows[:, seg.row_offset : seg.row_offset + seg.row_bytes] if cols else rows
            scatter_blocks(part, self._seg_geo[i], seg.layout, block_ids, load_only=load_only)

    def block_ranges(self, block_id: int) -> list[ByteRange]:
        """Every contiguous byte range of block ``block_id`` over all segments (segment order)."""
        out: list[ByteRange] = []
        for seg in self.segments:
            out.extend(seg.chunk_ranges(block_id))
        return out
