"""KV-cache quantization modes and the scale bytes they add to a page."""

from __future__ import annotations

from enum import Enum
from typing import Final

__all__ = ["SCALE_BYTES", "KVQuantMode"]

#: Scales are stored as float32.
SCALE_BYTES: Final[int] = 4


class KVQuantMode(str, Enum):
    """How K/V values are quantized in the cache.

    - ``NONE``: values stored in the cache dtype as they come.
    - ``FP8_PER_TENSOR``: fp8 storage, ``x / scale`` with one scale per tensor (or per head),
      the scales live outside the cache (passed to the ops as ``k_scale`` / ``v_scale``).
    - ``INT8_PER_TOKEN_HEAD`` / ``FP8_PER_TOKEN_HEAD``: one float32 scale per token and head for K
      and one for V, stored inside the page next to the data (the layout's content dim holds them).
    """

    NONE = "none"
    FP8_PER_TENSOR = "fp8_per_tensor"
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"
    FP8_PER_TOKEN_HEAD = "fp8_per_token_head"

    @property
    def per_token_head(self) -> bool:
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD)

    @property
    def allowed_dtypes(self) -> frozenset[str]:
        """Cache dtypes this mode can store."""
        if self is KVQuantMode.NONE:
            return frozenset({"float32", "float16", "bfloat16"})
        if self is KVQuantMode.INT8_PER_TOKEN_HEAD:
            return frozenset({"int8"})
        return frozenset({"fp8_e4m3", "fp8_e5m2"})

    @classmethod
    def parse(cls, value: object) -> KVQuantMode:
        if isinstance(value, KVQuantMode):
            return value
        try:
            return cls(str(value))
        except ValueError:
            raise ValueError(
                f"kv_quant={value!r} is not a known quant mode; use one of {[m.value for m in cls]}"
            ) from None
