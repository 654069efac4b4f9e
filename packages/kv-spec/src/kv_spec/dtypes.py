"""KV-cache element dtypes as plain names with byte sizes (no torch import).

``to_torch_dtype`` imports torch lazily, so ``kv_spec`` itself stays stdlib-only.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = [
    "DTYPE_BYTES",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "dtype_bytes",
    "normalize_dtype",
    "to_torch_dtype",
]

#: Every element dtype a KV cache may hold, with its size in bytes.
DTYPE_BYTES: Final[dict[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: dtypes a model computes in (queries, unquantized K/V).
FLOAT_DTYPES: Final[frozenset[str]] = frozenset({"float32", "float16", "bfloat16"})
FP8_DTYPES: Final[frozenset[str]] = frozenset({"fp8_e4m3", "fp8_e5m2"})

# Common spellings users bring from torch / vLLM; mapped, never guessed.
_ALIASES: Final[dict[str, str]] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}

_TORCH_NAMES: Final[dict[str, str]] = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
}


def normalize_dtype(dtype: object, *, field: str = "dtype") -> str:
    """Return the canonical dtype name for ``dtype`` (a name, an alias, or a ``torch.dtype``)."""
    name = str(dtype)
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(
            f"{field}={dtype!r} is not a known KV-cache dtype; use one of {sorted(DTYPE_BYTES)}"
        )
    return name


def dtype_bytes(dtype: object) -> int:
    """Size in bytes of one element of ``dtype``."""
    return DTYPE_BYTES[normalize_dtype(dtype)]


def to_torch_dtype(dtype: object) -> Any:
    """The ``torch.dtype`` for a kv-spec dtype name (imports torch on first use)."""
    import torch

    return getattr(torch, _TORCH_NAMES[normalize_dtype(dtype)])
