"""Cache write: ``reshape_and_cache`` (validating api), its torch reference and the ``read_kv``
read-back helper (dequantizes to float32; for tests and debugging)."""

from __future__ import annotations

from kv_kernels.reshape_and_cache.api import reshape_and_cache
from kv_kernels.reshape_and_cache.reference import read_kv, reshape_and_cache_reference

__all__ = ["read_kv", "reshape_and_cache", "reshape_and_cache_reference"]
