"""kv-blocktable (layer 3): which blocks each request owns, prefix caching, and block tables.

The scheduler side imports without torch (stdlib + kv-spec), so a scheduler or a prefix-aware
router gets it without a GPU stack:

- :class:`Request` (+ :class:`ExtraKeys`, :class:`MultiModalHash`): id, token ids, cache scope;
  :func:`append_decode_tokens` appends a decode step's sampled tokens to many requests at once.
- :func:`hash_block_tokens`, :class:`BlockHasher`: chained block hashes, sha256 over a canonical
  encoding (default) or xxhash-128 (``docs/block_hash.md``).
- :class:`BlockPool`: ref counts, LRU free queue, null block 0, the hash map, eviction, events.
- :class:`KVCacheManager` over a ``kv_spec.KVCacheConfig``: full, sliding-window and chunked-local
  groups sharing one pool, prefix hits valid for every group, ``allocate_slots`` / ``free``.
- KV events (:class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`), JSON-ready.

The worker side needs the ``torch`` extra (``pip install 'kv-blocktable[torch]'``) and is imported
from its own modules, never from here: ``kv_blocktable.block_table`` (``BlockTables``: persistent
rows, manager→kernel block expansion, slot mapping, CSR export) and ``kv_blocktable.attn_metadata``
(the ``CommonAttentionMetadata`` that kv-backends' builders take).
"""

from __future__ import annotations

from kv_blocktable.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    event_from_dict,
    events_from_json,
    events_to_json,
)
from kv_blocktable.hashing import (
    HASH_ALGOS,
    HASH_ENCODING_VERSION,
    BlockExtraKeys,
    BlockHasher,
    encode_block,
    hash_block_tokens,
)
from kv_blocktable.kv_cache_manager import DecodeSlots, KVCacheBlocks, KVCacheManager
from kv_blocktable.managers import (
    ChunkedLocalManager,
    FullAttentionManager,
    GroupManager,
    SlidingWindowManager,
)
from kv_blocktable.pool import NULL_BLOCK_ID, BlockPool, PrefixCacheBusyError
from kv_blocktable.request import ExtraKeys, MultiModalHash, Request, append_decode_tokens

__version__ = "0.4.0"

__all__ = [
    "HASH_ALGOS",
    "HASH_ENCODING_VERSION",
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "BlockExtraKeys",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ChunkedLocalManager",
    "DecodeSlots",
    "ExtraKeys",
    "FullAttentionManager",
    "GroupManager",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVEvent",
    "MultiModalHash",
    "PrefixCacheBusyError",
    "Request",
    "SlidingWindowManager",
    "__version__",
    "append_decode_tokens",
    "encode_block",
    "event_from_dict",
    "events_from_json",
    "events_to_json",
    "hash_block_tokens",
]
