"""kv-blocktable (layer 3): the block pool, prefix cache, per-request block tables and slot mapping.

Not built yet. This package will hold ``BlockPool`` (allocate, free, touch, prefix lookup by chained
block hashes with a salt, LRU eviction, null block 0, events), a ``KVCacheManager`` per KV-cache
group kind, and ``BlockTables`` (persistent rows, manager→kernel block expansion, slot mapping, CSR
export), over the groups and ``num_blocks`` that ``kv_spec.plan_kv_cache`` produces. Its issue is
filed once kv-spec, kv-kernels and kv-backends are checked. Until then it exports only its version.
"""

from __future__ import annotations

__version__ = "0.2.0"

__all__ = ["__version__"]
