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

    def __post_init__(self) -> None:
        _check_hashes("BlockStored", self.block_hashes)
        if self.parent_block_hash is not None:
            _check_hashes("BlockStored", (self.parent_block_hash,), "parent_block_hash")
        for name in ("block_size", "hash_block_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"BlockStored.{name}={v!r} must be an int >= 1")
        if self.block_size % self.hash_block_size:
            raise ValueError(
                f"BlockStored.hash_block_size={self.hash_block_size} must divide "
                f"block_size={self.block_size}"
            )
        if (
            not isinstance(self.token_ids, tuple)
            or len(self.token_ids) != len(self.block_hashes) * self.block_size
        ):
            raise ValueError(
                f"BlockStored.token_ids must be a tuple of len(block_hashes) x block_size = "
                f"{len(self.block_hashes) * self.block_size} token ids; got "
                f"{type(self.token_ids).__name__} of {len(self.token_ids)}"
            )
        m = len(self.block_hashes) * (self.block_size // self.hash_block_size)
        if not isinstance(self.extra_keys, tuple) or len(self.extra_keys) not in (0, m):
            raise ValueError(
                f"BlockStored.extra_keys must be () or a tuple of one entry per hash block "
                f"({m}); got {self.extra_keys!r}"
            )
        _check_place("BlockStored", self.group_id, self.medium)

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

    def __post_init__(self) -> None:
        _check_hashes("BlockRemoved", self.block_hashes)
        _check_place("BlockRemoved", self.group_id, self.medium)

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

    def __post_init__(self) -> None:
        _check_place("AllBlocksCleared", 0, self.medium)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "medium": self.medium}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _check_hashes(owner: str, hashes: object, name: str = "block_hashes") -> None:
    if not isinstance(hashes, tuple) or not all(type(h) is bytes and h for h in hashes):
        raise TypeError(
            f"{owner}.{name}={hashes!r} must be a tuple of non-empty bytes (block hashes)"
        )


def _check_place(owner: str, group_id: object, medium: object) -> None:
    if type(group_id) is not int or group_id < 0:
        raise ValueError(f"{owner}.group_id={group_id!r} must be an int >= 0")
    if not isinstance(medium, str) or not medium:
        raise ValueError(f"{owner}.medium={medium!r} must be a non-empty str")


def _get(d: dict[str, Any], kind: str, name: str) -> Any:
    if name not in d:
        raise ValueError(f"{kind} event dict has no {name!r} field; got fields {sorted(d)}")
    return d[name]


def _unhex(kind: str, name: str, value: object) -> bytes:
    try:
        return bytes.fromhex(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"{kind}.{name}: {value!r} is not a lowercase hex string of a block hash"
        ) from None


def _list(kind: str, name: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{kind}.{name}={value!r} must be a JSON array")
    return value


def event_from_dict(d: dict[str, Any]) -> KVEvent:
    """Inverse of ``event.to_dict()``; a missing or mistyped field raises ``ValueError`` /
    ``TypeError`` naming it (the events' own checks run too), as does an unknown ``type``."""
    if not isinstance(d, dict):
        raise TypeError(f"a KV event is a dict (see to_dict); got {type(d).__name__}: {d!r}")
    kind = d.get("type")
    if kind == "BlockStored":
        parent = _get(d, kind, "parent_block_hash")
        tokens = _list(kind, "token_ids", _get(d, kind, "token_ids"))
        for bad in tokens:
            if type(bad) is not int:
                raise TypeError(f"BlockStored.token_ids holds {bad!r}; token ids are ints")
        extra = []
        for block in _list(kind, "extra_keys", _get(d, kind, "extra_keys")):
            pairs = _list(kind, "extra_keys[]", block)
            if not all(
                isinstance(kv, list) and len(kv) == 2 and all(isinstance(x, str) for x in kv)
                for kv in pairs
            ):
                raise TypeError(
                    f"BlockStored.extra_keys entry {block!r} must be a list of [kind, value] "
                    "str pairs"
                )
            extra.append(tuple((k, v) for k, v in pairs))
        return BlockStored(
            block_hashes=tuple(
                _unhex(kind, "block_hashes", h)
                for h in _list(kind, "block_hashes", _get(d, kind, "block_hashes"))
            ),
            parent_block_hash=None if parent is None else _unhex(kind, "parent_block_hash", parent),
            token_ids=tuple(tokens),
            block_size=_get(d, kind, "block_size"),
            hash_block_size=_get(d, kind, "hash_block_size"),
            extra_keys=tuple(extra),
            group_id=_get(d, kind, "group_id"),
            medium=_get(d, kind, "medium"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(
                _unhex(kind, "block_hashes", h)
                for h in _list(kind, "block_hashes", _get(d, kind, "block_hashes"))
            ),
            group_id=_get(d, kind, "group_id"),
            medium=_get(d, kind, "medium"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(medium=_get(d, kind, "medium"))
    raise ValueError(
        f"unknown KV event type={kind!r}; expected BlockStored, BlockRemoved or AllBlocksCleared"
    )


def events_to_json(events: Sequence[KVEvent]) -> str:
    """A JSON array of the events' dicts."""
    return json.dumps([e.to_dict() for e in events])


def events_from_json(text: str) -> list[KVEvent]:
    return [event_from_dict(d) for d in json.loads(text)]
