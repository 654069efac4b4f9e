"""The layout standard: one declared KV-cache layout, read by every backend, kernel and connector.

Every KV cache has the logical shape ``[L, B, H, N, C]``: layer slots, blocks, kv heads, tokens in a
block, content (``head_size`` K elements, then ``head_size_v`` V elements, then inline scales; for
MLA the latent). With ``scale_plane=True`` a per-token-head cache keeps its scales out of ``C``, in
a plane after each page's data (:attr:`KVCacheLayout.scale_plane_geometry`). The physical order is
one of six named permutations (:mod:`kv_spec.orders`). A :class:`KVCacheLayout` is a frozen value: it gives shapes and strides in elements and bytes, the byte offset of each layer,
the block stride and the page size, and a stable :meth:`~KVCacheLayout.compatibility_hash` that two
processes compare before they exchange KV. Nobody infers a layout from a tensor's shape.

Allocation: for the ``L``-outer orders each layer slot can be its own tensor of shape
:attr:`~KVCacheLayout.layer_shape` (the planner allocates them so); for the ``B``-outer orders
(cross-layer) all layer slots live in one slab of :attr:`~KVCacheLayout.physical_shape`, and a
block of all layers is one contiguous range, what offload and transfer prefer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kv_spec import pages
from kv_spec._checks import check_bool, check_int, check_positive_int
from kv_spec.dtypes import dtype_bytes, normalize_dtype
from kv_spec.orders import LOGICAL_DIMS, LayoutChoice, LayoutOrder, resolve_layout
from kv_spec.quant import SCALE_BYTES, KVQuantMode
from kv_spec.specs import AttentionSpec, MLAAttentionSpec

# (the orders and their resolver live in kv_spec.orders; re-exported here, where they were)
__all__ = [
    "LOGICAL_DIMS",
    "KVCacheLayout",
    "LayoutChoice",
    "LayoutOrder",
    "resolve_layout",
]

_LAYOUT_FORMAT_VERSION: Final[int] = 1


@dataclass(frozen=True, kw_only=True)
class KVCacheLayout:
    """A KV cache's layout: order, sizes, dtype and page format. Frozen and JSON-serializable.

    Sizes are logical: ``num_layers`` (L, layer slots), ``num_blocks`` (B), ``num_kv_heads`` (H),
    ``block_size`` (N) and ``content_size`` (C, derived). ``page_size_bytes`` is the bytes of one block
    of one layer, padded (only page-contiguous orders) when larger than the real page.
    """

    order: LayoutOrder
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_size: int
    head_size_v: int
    dtype: str
    kv_quant: KVQuantMode = KVQuantMode.NONE
    is_mla: bool = False
    page_size_bytes: int | None = None
    #: per-token-head scales in a plane after each page's data (``[H, N, scales]`` float32) instead
    #: of inline at the end of every row: the rows keep a K + V pitch (256 bytes for 128 + 128 of
    #: int8 / fp8), which decode reads at the copy rate where 264-byte rows read ~0.65-0.75 of it
    #: (docs/benchmarks/kernels.md, twelfth session). Same page size; page-contiguous orders only.
    scale_plane: bool = False

    def __post_init__(self) -> None:
        owner = "KVCacheLayout"
        object.__setattr__(self, "order", LayoutOrder.parse(self.order))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype, field=f"{owner}.dtype"))
        object.__setattr__(self, "kv_quant", KVQuantMode.parse(self.kv_quant))
        check_bool(owner, "is_mla", self.is_mla)
        check_bool(owner, "scale_plane", self.scale_plane)
        for name in ("num_layers", "num_blocks", "num_kv_heads", "block_size", "head_size"):
            check_positive_int(owner, name, getattr(self, name))
        check_int(owner, "head_size_v", self.head_size_v, minimum=0)
        if self.is_mla:
            if self.head_size_v != 0:
                raise ValueError(
                    f"{owner}.head_size_v={self.head_size_v} must be 0 for MLA (one latent of head_size)"
                )
            if self.num_kv_heads != 1:
                raise ValueError(f"{owner}.num_kv_heads={self.num_kv_heads} must be 1 for MLA")
        elif self.head_size_v == 0:
            raise ValueError(f"{owner}.head_size_v=0 is only valid for MLA layouts (is_mla=True)")
        if self.dtype not in self.kv_quant.allowed_dtypes:
            raise ValueError(
                f"{owner}.dtype={self.dtype!r} cannot hold kv_quant={self.kv_quant.value!r}; "
                f"that mode stores {sorted(self.kv_quant.allowed_dtypes)}"
            )
        if self.scale_plane:
            self._check_scale_plane(owner)
        real = self.real_page_size_bytes
        if self.page_size_bytes is None:
            object.__setattr__(self, "page_size_bytes", real)
        else:
            check_positive_int(owner, "page_size_bytes", self.page_size_bytes)
            if self.page_size_bytes < real:
                raise ValueError(
                    f"{owner}.page_size_bytes={self.page_size_bytes} is below the real page size "
                    f"{real}; pass >= {real} or None"
                )
            if self.page_size_bytes % self.element_bytes:
                raise ValueError(
                    f"{owner}.page_size_bytes={self.page_size_bytes} must be a multiple of the "
                    f"{self.dtype} element size {self.element_bytes}"
                )
            if self.page_size_bytes != real and not self.order.page_contiguous:
                raise ValueError(
                    f"{owner}: a padded page ({self.page_size_bytes} > {real} bytes) needs a "
                    f"page-contiguous order (LBNHC, LBHNC, BLNHC, BLHNC); {self.order.value} "
                    "interleaves pages"
                )
        if self.total_bytes >= 2**63:
            raise ValueError(
                f"{owner}: total size {self.total_bytes} bytes exceeds the int64 range; "
                "use fewer blocks or layers"
            )

    def _check_scale_plane(self, owner: str) -> None:
        if not self.kv_quant.per_token_head:
            raise ValueError(
                f"{owner}.scale_plane=True needs per-token-head scales; kv_quant="
                f"{self.kv_quant.value!r} has none (use int8_per_token_head or fp8_per_token_head, "
                "or scale_plane=False)"
            )
        if not self.order.page_contiguous:
            raise ValueError(
                f"{owner}.scale_plane=True needs a page-contiguous order (LBNHC, LBHNC, BLNHC, "
                f"BLHNC): the plane follows each page's data; {self.order.value} interleaves pages"
            )
        data = self.block_size * self.num_kv_heads * self.content_size * self.element_bytes
        if data % 16:
            raise ValueError(
                f"{owner}.scale_plane=True needs a page's data ({self.block_size} tokens x "
                f"{self.num_kv_heads} heads x {self.content_size} bytes = {data}) to be a multiple "
                "of 16 bytes so the plane starts aligned; use scale_plane=False for these sizes"
            )

    @classmethod
    def from_spec(
        cls,
        spec: AttentionSpec,
        *,
        num_blocks: int,
        num_layers: int = 1,
        order: LayoutOrder | str = LayoutOrder.LBNHC,
        scale_plane: bool = False,
    ) -> KVCacheLayout:
        """The layout of ``num_layers`` layer slots of ``spec`` with ``num_blocks`` blocks each
        (``scale_plane``: a per-token-head spec's scales in each page's plane)."""
        is_mla = isinstance(spec, MLAAttentionSpec)
        return cls(
            order=LayoutOrder.parse(order),
            num_layers=num_layers,
            num_blocks=num_blocks,
            num_kv_heads=spec.num_kv_heads,
            block_size=spec.block_size,
            head_size=spec.head_size,
            head_size_v=0 if is_mla else spec.v_size,
            dtype=spec.dtype,
            kv_quant=spec.kv_quant,
            is_mla=is_mla,
            page_size_bytes=spec.page_size_bytes,
            scale_plane=scale_plane,
        )

    # -- content dim -------------------------------------------------------------------------

    @property
    def element_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def num_scales(self) -> int:
        """Inline float32 scales per token and head: 2 (K, V) or 1 (MLA) under per-token-head quant."""
        return pages.inline_scales(self.kv_quant, is_mla=self.is_mla)

    @property
    def scale_placement(self) -> str:
        """``"inline"`` (float32 scales at the end of C), ``"plane"`` (per-token-head scales after
        each page's data, :attr:`scale_plane_geometry`), ``"external"`` (per-tensor/per-head scales
        passed to the ops), or ``"none"``."""
        if self.kv_quant.per_token_head:
            return "plane" if self.scale_plane else "inline"
        return "external" if self.kv_quant is KVQuantMode.FP8_PER_TENSOR else "none"

    @property
    def content_size(self) -> int:
        """C: elements per token and head (with a scale plane, K and V only)."""
        c = pages.content_size(
            head_size=self.head_size,
            head_size_v=self.head_size_v,
            kv_quant=self.kv_quant,
            is_mla=self.is_mla,
            dtype=self.dtype,
        )
        if self.scale_plane:
            c -= self.num_scales * SCALE_BYTES // self.element_bytes
        return c

    @property
    def scale_plane_geometry(self) -> tuple[int, int, int] | None:
        """``(offset, head_stride, token_stride)`` in bytes of the scale plane inside a page: the
        ``num_scales`` float32 scales of head ``h``, token ``n`` sit at ``offset + h * head_stride
        + n * token_stride`` from the page's first byte. ``None`` without a plane."""
        if not self.scale_plane:
            return None
        row = self.num_scales * SCALE_BYTES
        data = self.block_size * self.num_kv_heads * self.content_size * self.element_bytes
        return (data, self.block_size * row, row)

    @property
    def scale_geometry(self) -> tuple[int, int, int] | None:
        """``(offset, head_stride, token_stride)`` in bytes of the per-token-head scales, whichever
        their placement: the ``num_scales`` float32 scales of head ``h``, token ``n`` of a block
        sit at ``offset + h * head_stride + n * token_stride`` from that block's (and layer's)
        first byte. Inline: the scale range's start in a row, the rows' own strides; a plane:
        :attr:`scale_plane_geometry`. ``None`` without per-token-head scales."""
        if self.scale_plane:
            return self.scale_plane_geometry
        if self.scale_range is None:
            return None
        _, _, sh, sn, _ = self.byte_strides
        return (self.scale_range[0] * self.element_bytes, sh, sn)

    @property
    def k_range(self) -> tuple[int, int]:
        """``[start, stop)`` of K (for MLA, the whole latent) in C."""
        return (0, self.head_size)

    @property
    def v_range(self) -> tuple[int, int] | None:
        """``[start, stop)`` of V in C; ``None`` for MLA (V is read from the latent by the backend)."""
        return None if self.is_mla else (self.head_size, self.head_size + self.head_size_v)

    @property
    def scale_range(self) -> tuple[int, int] | None:
        """``[start, stop)`` in C of the inline scales (K's float32 then V's), in cache elements;
        ``None`` without inline scales (none, or a scale plane)."""
        if not self.num_scales or self.scale_plane:
            return None
        start = self.head_size + self.head_size_v
        return (start, self.content_size)

    # -- shapes and strides ------------------------------------------------------------------

    @property
    def real_page_size_bytes(self) -> int:
        return pages.real_page_size_bytes(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size_v,
            kv_quant=self.kv_quant,
            is_mla=self.is_mla,
            dtype=self.dtype,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer slot (padded if the page is padded)."""
        assert self.page_size_bytes is not None
        return self.page_size_bytes

    @property
    def logical_shape(self) -> tuple[int, int, int, int, int]:
        return (
            self.num_layers,
            self.num_blocks,
            self.num_kv_heads,
            self.block_size,
            self.content_size,
        )

    @property
    def physical_shape(self) -> tuple[int, ...]:
        """Shape of the whole cache (all layer slots) in physical order."""
        sizes = dict(zip(LOGICAL_DIMS, self.logical_shape, strict=True))
        return tuple(sizes[d] for d in self.order.value)

    @property
    def physical_strides(self) -> tuple[int, ...]:
        """Element strides of :attr:`physical_shape` (contiguous, except a padded page stride)."""
        logical = self.strides
        return tuple(logical[LOGICAL_DIMS.index(d)] for d in self.order.value)

    @property
    def strides(self) -> tuple[int, int, int, int, int]:
        """Element strides of the logical dims ``(L, B, H, N, C)``."""
        sizes = dict(zip(LOGICAL_DIMS, self.logical_shape, strict=True))
        page_elems = self.page_bytes // self.element_bytes
        out: dict[str, int] = {}
        acc = 1
        inner: set[str] = set()
        for d in reversed(self.order.value):
            if inner == {"H", "N", "C"}:
                acc = page_elems  # the dim just outside a page steps over the padded page
            out[d] = acc
            acc *= sizes[d]
            inner.add(d)
        return (out["L"], out["B"], out["H"], out["N"], out["C"])

    @property
    def byte_strides(self) -> tuple[int, int, int, int, int]:
        eb = self.element_bytes
        s = self.strides
        return (s[0] * eb, s[1] * eb, s[2] * eb, s[3] * eb, s[4] * eb)

    @property
    def total_elements(self) -> int:
        """Elements of the whole cache, padding included."""
        return self.num_layers * self.num_blocks * self.page_bytes // self.element_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.page_bytes

    def layer_byte_offset(self, layer: int) -> int:
        """Byte offset of layer slot ``layer``'s first element in the whole cache."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range [0, {self.num_layers})")
        return layer * self.byte_strides[0]

    @property
    def block_stride_bytes(self) -> int:
        return self.byte_strides[1]

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Physical shape of one layer slot (``L`` dropped): the per-layer tensor for L-outer orders."""
        return tuple(
            s for d, s in zip(self.order.value, self.physical_shape, strict=True) if d != "L"
        )

    @property
    def layer_logical_permutation(self) -> tuple[int, ...]:
        """``permute`` order turning a physical per-layer tensor into logical ``[B, H, N, C]``."""
        dims = [d for d in self.order.value if d != "L"]
        return tuple(dims.index(d) for d in "BHNC")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one allocation: one layer (L-outer) or all layers (cross-layer)."""
        return self.page_bytes * (self.num_layers if self.order.cross_layer else 1)

    @property
    def blocks_contiguous(self) -> bool:
        """Each block is one contiguous byte range of its allocation, so ``(num_blocks, block_bytes)``
        byte views work (false only for LHBNC, whose heads are outermost)."""
        return self.order.value.replace("L", "")[0] == "B"

    # -- serialization -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _LAYOUT_FORMAT_VERSION,
            "order": self.order.value,
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "num_kv_heads": self.num_kv_heads,
            "block_size": self.block_size,
            "head_size": self.head_size,
            "head_size_v": self.head_size_v,
            "dtype": self.dtype,
            "kv_quant": self.kv_quant.value,
            "is_mla": self.is_mla,
            "page_size_bytes": self.page_bytes,
            # (only when set: layouts without a plane keep the JSON and hash they had)
            **({"scale_plane": True} if self.scale_plane else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCacheLayout:
        if not isinstance(data, Mapping):
            raise ValueError(
                f"a layout must be a JSON object / mapping of its fields, got {type(data).__name__}"
            )
        data = dict(data)
        fmt = data.pop("format", _LAYOUT_FORMAT_VERSION)
        if fmt != _LAYOUT_FORMAT_VERSION:
            raise ValueError(
                f"layout format {fmt!r} is not supported by this kv-spec (reads format {_LAYOUT_FORMAT_VERSION})"
            )
        known = {
            "order",
            "num_layers",
            "num_blocks",
            "num_kv_heads",
            "block_size",
            "head_size",
            "head_size_v",
            "dtype",
            "kv_quant",
            "is_mla",
            "page_size_bytes",
            "scale_plane",
        }
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown layout fields {sorted(unknown)}; known fields are {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVCacheLayout:
        if not isinstance(text, (str, bytes, bytearray)):
            raise ValueError(f"layout JSON must be str or bytes, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"layout JSON does not parse: {e}; pass KVCacheLayout.to_json()"
            ) from None
        return cls.from_dict(data)

    def compatibility_hash(self) -> str:
        """Stable hex digest of everything that fixes how a block's bytes are read.

        ``num_blocks`` is left out on purpose: a prefill and a decode instance with different pool
        sizes exchange blocks just fine; everything else (order, layer slots, heads, block size,
        content split, dtype, quant, page bytes) must match.
        """
        d = self.to_dict()
        del d["num_blocks"]
        canon = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:32]

    # -- manager blocks as kernel blocks -------------------------------------------------------

    def kernel_block_problem(self, kernel_block_size: int) -> str | None:
        """Why this cache cannot be viewed as kernel blocks of ``kernel_block_size`` tokens
        (``None`` if it can): the rule of :mod:`kv_spec.pages`."""
        if kernel_block_size == self.block_size:
            return None
        try:
            pages.kernel_blocks_per_block(self.block_size, kernel_block_size)
        except ValueError as e:
            return str(e)
        if not self.order.splits_into_kernel_blocks:
            return (
                f"kernel block size {kernel_block_size} < block size {self.block_size} needs order "
                f"{' or '.join(pages.SPLITTABLE_ORDERS)} (block stride = block_size x token stride); "
                f"got {self.order.value}"
            )
        if self.scale_plane:
            return (
                f"kernel block size {kernel_block_size} < block size {self.block_size}: a page's "
                "scale plane follows its data, so kernel blocks are no plain view; use "
                "scale_plane=False"
            )
        if self.page_bytes != self.real_page_size_bytes:
            return (
                f"kernel block size {kernel_block_size} < block size {self.block_size} needs "
                f"unpadded pages (page_size_bytes={self.page_bytes} > real "
                f"{self.real_page_size_bytes})"
            )
        return None

    def kernel_block_layout(self, kernel_block_size: int) -> KVCacheLayout:
        """This cache seen as kernel blocks: ``num_blocks * k`` blocks of ``kernel_block_size``
        tokens (manager block ``b`` is kernel blocks ``b * k + i``). Raises ``ValueError`` with
        :meth:`kernel_block_problem`'s reason when no plain view exists."""
        problem = self.kernel_block_problem(kernel_block_size)
        if problem is not None:
            raise ValueError(problem)
        k = self.block_size // kernel_block_size
        d = self.to_dict()
        d.update(num_blocks=self.num_blocks * k, block_size=kernel_block_size, page_size_bytes=None)
        return KVCacheLayout.from_dict(d)

    def with_num_blocks(self, num_blocks: int) -> KVCacheLayout:
        d = self.to_dict()
        d["num_blocks"] = num_blocks
        return KVCacheLayout.from_dict(d)
