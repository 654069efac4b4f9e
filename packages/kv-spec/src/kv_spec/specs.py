"""What one attention layer stores per token, and how much memory that takes.

Every spec is a frozen dataclass built with keyword arguments. ``head_size_v`` is declared once, on
:class:`AttentionSpec`, and defaults to ``head_size``; DiffKV models (``head_size_v != head_size``)
need no other special case. MLA stores one latent vector per token (``head_size`` is the latent
width, no K/V doubling).

Page size of one block of one layer::

    real_page_size_bytes = block_size * num_kv_heads * content_size * dtype_bytes
    content_size         = head_size + head_size_v (+ inline scale elements)   # MLA: head_size (+ scales)

Per-token-head quantization stores one float32 scale per token and head for K and one for V inside
the page, so ``content_size`` grows by ``2 * 4 / dtype_bytes`` elements (MLA: one scale, ``4 / dtype_bytes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_spec import pages
from kv_spec._checks import check_positive_int
from kv_spec.dtypes import dtype_bytes, normalize_dtype
from kv_spec.quant import SCALE_BYTES, KVQuantMode

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "cdiv",
    "merge_specs",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Base of every KV-cache spec: the fields all attention layers share.

    Not instantiated directly: pick the subclass that says how the layer attends.
    """

    kind: ClassVar[str] = "attention"
    #: Whether ``head_size_v`` may differ from ``head_size`` for this kind of layer.
    allows_head_size_v: ClassVar[bool] = True
    #: One latent per token instead of K and V (MLA): no V in the page.
    stores_latent: ClassVar[bool] = False

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    head_size_v: int | None = None
    kv_quant: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if type(self) is AttentionSpec:
            raise TypeError(
                "AttentionSpec is the abstract base; use FullAttentionSpec, SlidingWindowSpec, "
                "ChunkedLocalAttentionSpec, MLAAttentionSpec or CrossAttentionSpec"
            )
        check_positive_int(owner, "block_size", self.block_size)
        check_positive_int(owner, "num_kv_heads", self.num_kv_heads)
        check_positive_int(owner, "head_size", self.head_size)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype, field=f"{owner}.dtype"))
        quant = KVQuantMode.parse(self.kv_quant)
        object.__setattr__(self, "kv_quant", quant)
        if self.dtype not in quant.allowed_dtypes:
            raise ValueError(
                f"{owner}.dtype={self.dtype!r} cannot hold kv_quant={quant.value!r}; "
                f"that mode stores {sorted(quant.allowed_dtypes)}"
            )
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        else:
            check_positive_int(owner, "head_size_v", self.head_size_v)
            if not self.allows_head_size_v and self.head_size_v != self.head_size:
                raise ValueError(
                    f"{owner}.head_size_v={self.head_size_v} is not allowed: {self.kind} layers "
                    f"store one latent of head_size={self.head_size}; leave head_size_v unset"
                )
        if self.page_size_padded is not None:
            check_positive_int(owner, "page_size_padded", self.page_size_padded)
            real = self.real_page_size_bytes
            if self.page_size_padded < real:
                raise ValueError(
                    f"{owner}.page_size_padded={self.page_size_padded} is smaller than the real page "
                    f"size {real} bytes; pass a value >= {real} or None"
                )
            eb = dtype_bytes(self.dtype)
            if self.page_size_padded % eb:
                raise ValueError(
                    f"{owner}.page_size_padded={self.page_size_padded} must be a multiple of the "
                    f"{self.dtype} element size ({eb} bytes) so the layout can address it"
                )

    # -- sizes -------------------------------------------------------------------------------

    @property
    def v_size(self) -> int:
        """``head_size_v`` as an int (``__post_init__`` has filled the default)."""
        assert self.head_size_v is not None
        return self.head_size_v

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def num_scales(self) -> int:
        """Inline float32 scales per token and head (0 unless per-token-head quant)."""
        return pages.inline_scales(self.kv_quant, is_mla=self.stores_latent)

    @property
    def scale_elements(self) -> int:
        """Elements of the content dim taken by inline scales."""
        return self.num_scales * SCALE_BYTES // self.dtype_bytes

    @property
    def content_size(self) -> int:
        """Elements per token and head in the packed cache: K then V (MLA: the latent), then
        inline scales (:func:`kv_spec.pages.content_size`)."""
        return pages.content_size(
            head_size=self.head_size,
            head_size_v=self.v_size,
            kv_quant=self.kv_quant,
            is_mla=self.stores_latent,
            dtype=self.dtype,
        )

    @property
    def real_page_size_bytes(self) -> int:
        return pages.real_page_size_bytes(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.v_size,
            kv_quant=self.kv_quant,
            is_mla=self.stores_latent,
            dtype=self.dtype,
        )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: the padded size if set, else the real size."""
        return (
            self.page_size_padded
            if self.page_size_padded is not None
            else self.real_page_size_bytes
        )

    @property
    def bytes_per_token(self) -> int:
        """Real (unpadded) bytes one token takes in one layer."""
        return self.real_page_size_bytes // self.block_size

    def max_memory_usage_bytes(
        self, *, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        """Bytes one request of ``max_model_len`` tokens can hold in this layer at once."""
        max_model_len = check_positive_int(type(self).__name__, "max_model_len", max_model_len)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def with_block_size(self, block_size: int) -> AttentionSpec:
        """The same spec with another block size (padding dropped: the page is recomputed)."""
        return dataclasses.replace(self, block_size=block_size, page_size_padded=None)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens (the current one included)."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(type(self).__name__, "sliding_window", self.sliding_window)

    def max_memory_usage_bytes(
        self, *, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        # The window plus the tokens scheduled in one step stay live; +1 block because a window
        # rarely starts on a block boundary, so it can straddle one more block than it fills.
        max_model_len = check_positive_int(type(self).__name__, "max_model_len", max_model_len)
        batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        num_tokens = min(self.sliding_window - 1 + batched, max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama-4 style)."""

    kind: ClassVar[str] = "chunked_local"
    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(type(self).__name__, "attention_chunk_size", self.attention_chunk_size)

    def max_memory_usage_bytes(
        self, *, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        max_model_len = check_positive_int(type(self).__name__, "max_model_len", max_model_len)
        batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        num_tokens = min(self.attention_chunk_size + batched, max_model_len)
        return cdiv(num_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(AttentionSpec):
    """Multi-head latent attention: one compressed latent of ``head_size`` per token, one 'head'.

    For DeepSeek-V3, ``head_size = kv_lora_rank + qk_rope_head_dim = 512 + 64``.
    """

    kind: ClassVar[str] = "mla"
    allows_head_size_v: ClassVar[bool] = False
    stores_latent: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(
                f"MLAAttentionSpec.num_kv_heads={self.num_kv_heads} must be 1: MLA stores one "
                "latent per token shared by all query heads"
            )


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder→encoder attention: K/V of the encoder output, written once per request."""

    kind: ClassVar[str] = "cross"


_MERGE_FIELDS_IGNORED: frozenset[str] = frozenset()


def merge_specs(specs: Sequence[AttentionSpec]) -> AttentionSpec:
    """Merge the spec one layer has on each tensor-parallel worker.

    Workers must agree exactly; the error names every field that differs and its values.
    """
    if not specs:
        raise ValueError("merge_specs needs at least one spec; got an empty sequence")
    first = specs[0]
    for i, other in enumerate(specs[1:], start=1):
        if type(other) is not type(first):
            raise ValueError(
                f"cannot merge specs of different kinds: worker 0 has {type(first).__name__}, "
                f"worker {i} has {type(other).__name__}"
            )
        diffs = [
            f"{f.name}: {getattr(first, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in dataclasses.fields(first)
            if f.name not in _MERGE_FIELDS_IGNORED
            and getattr(first, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise ValueError(
                f"cannot merge {type(first).__name__} across workers: worker 0 and worker {i} "
                f"disagree on {'; '.join(diffs)}; every worker must build the same spec for a layer"
            )
    return first
