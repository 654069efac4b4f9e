"""KV events: what an external indexer (a prefix-aware router) needs to mirror a pool's cache.

Values, drained with ``KVCacheManager.take_events()`` (or ``BlockPool.take_events()``), in the order
they happened. Hashes are ``bytes`` in Python and lowercase hex in JSON. ``to_json`` /
``events_from_json`` round-trip exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kv_blocktable.hashing import BlockExtraKeys

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "event_from_dict",
    "events_from_json",
    "events_to_json",
]


@dataclass(frozen=True)
class BlockStored:
    """Blocks of one group entered the prefix cache (consecutive blocks of one request).

    ``block_hashes[i]`` identifies the ``i``-th stored block of ``block_size`` tokens; it is the
    chained hash of its last ``hash_block_size``-token sub-block (equal sizes in the common case).
    ``token_ids`` holds the blocks' tokens (``len(block_hashes) * block_size``), ``parent_block_hash``
    the hash of the hash block before the first stored one (None at the start of a sequence), and
    ``extra_keys`` one entry per *hash* block — or ``()`` when the request has no extra keys — so an
    indexer can recompute every hash from this event alone (``docs/block_hash.md``).
    """

    type: ClassVar[str] = "BlockStored"
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    hash_block_size: int
    extra_keys: tuple[BlockExtraKeys, ...] = ()
    group_id: int = 0
    medium: str = "GPU"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "block_hashes": [h.hex() for h in self.block_hashes],
            "parent_block_hash": None
            if self.parent_block_hash is None
            else self.parent_block_hash.hex(),
            "token_ids": list(self.token_ids),
            "block_size": self.block_size,
            "hash_block_size": self.hash_block_size,
            "extra_keys": [[list(kv) for kv in block] for block in self.extra_keys],
            "group_id": self.group_id,
            "medium": self.medium,
        }


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks of one group left the prefix cache (evicted for reuse)."""

    type: ClassVar[str] = "BlockRemoved"
    block_hashes: tuple[bytes, ...]
    group_id: int = 0
    medium: str = "GPU"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "block_hashes": [h.hex() for h in self.block_hashes],
            "group_id": self.group_id,
            "medium": self.medium,
        }


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache of this medium was dropped (``reset_prefix_cache``)."""

    type: ClassVar[str] = "AllBlocksCleared"
    medium: str = "GPU"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "medium": self.medium}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_from_dict(d: dict[str, Any]) -> KVEvent:
    """Inverse of ``event.to_dict()``; raises ValueError on an unknown ``type``."""
    kind = d.get("type")
    if kind == "BlockStored":
        parent = d["parent_block_hash"]
        return BlockStored(
            block_hashes=tuple(bytes.fromhex(h) for h in d["block_hashes"]),
            parent_block_hash=None if parent is None else bytes.fromhex(parent),
            token_ids=tuple(d["token_ids"]),
            block_size=d["block_size"],
            hash_block_size=d["hash_block_size"],
            extra_keys=tuple(tuple((k, v) for k, v in block) for block in d["extra_keys"]),
            group_id=d["group_id"],
            medium=d["medium"],
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(bytes.fromhex(h) for h in d["block_hashes"]),
            group_id=d["group_id"],
            medium=d["medium"],
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(medium=d["medium"])
    raise ValueError(
        f"unknown KV event type={kind!r}; expected BlockStored, BlockRemoved or AllBlocksCleared"
    )


def events_to_json(events: Sequence[KVEvent]) -> str:
    """A JSON array of the events' dicts."""
    return json.dumps([e.to_dict() for e in events])


def events_from_json(text: str) -> list[KVEvent]:
    return [event_from_dict(d) for d in json.loads(text)]
