"""Which backends exist and in which order the selector tries them, held as data.

``BACKEND_PRIORITY`` and ``BACKEND_CLASSES`` are plain literals: ``tools/generate_backend_docs.py``
reads them with ``ast`` to write ``docs/attention_backends.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from kv_backends.base import AttentionBackend

__all__ = ["BACKEND_CLASSES", "BACKEND_PRIORITY", "backend_names", "get_backend"]

#: Backend name -> ``"module:Class"``; classes are imported on first use (keeps import light).
BACKEND_CLASSES: Final[dict[str, str]] = {
    "TORCH_SDPA": "kv_backends.backends.torch_sdpa:TorchSDPABackend",
    "TRITON": "kv_backends.backends.triton_attn:TritonBackend",
    "TRITON_MLA": "kv_backends.backends.triton_mla:TritonMLABackend",
    "FLEX_ATTENTION": "kv_backends.backends.flex.backend:FlexAttentionBackend",
    "FLASH_ATTN": "kv_backends.backends.flash_attn:FlashAttnBackend",
    "FLASH_ATTN_DIFFKV": "kv_backends.backends.flash_attn_diffkv:FlashAttnDiffKVBackend",
}

#: Per platform, the order the selector tries backends in; the first that validates wins.
#: FLASH_ATTN_DIFFKV comes first on CUDA because it serves only head_size_v != head_size layers
#: (and rejects the rest), so DiffKV layers get it automatically. TRITON_MLA serves only MLA
#: layers, which every other backend rejects, so its place among them decides nothing else.
BACKEND_PRIORITY: Final[dict[str, tuple[str, ...]]] = {
    "cpu": ("TORCH_SDPA", "FLEX_ATTENTION"),
    "cuda": (
        "FLASH_ATTN_DIFFKV",
        "FLASH_ATTN",
        "TRITON_MLA",
        "TRITON",
        "FLEX_ATTENTION",
        "TORCH_SDPA",
    ),
}


def backend_names() -> tuple[str, ...]:
    return tuple(BACKEND_CLASSES)


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class called ``name`` (case-insensitive)."""
    if not isinstance(name, str):
        raise TypeError(
            f"backend name {name!r} must be a str, one of {list(BACKEND_CLASSES)}; "
            f"got {type(name).__name__}"
        )
    key = name.upper()
    if key not in BACKEND_CLASSES:
        raise ValueError(f"unknown attention backend {name!r}; known: {list(BACKEND_CLASSES)}")
    module, _, cls = BACKEND_CLASSES[key].partition(":")
    backend: type[AttentionBackend] = getattr(importlib.import_module(module), cls)
    return backend
