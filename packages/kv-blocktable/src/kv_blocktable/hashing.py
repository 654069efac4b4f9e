"""Chained block hashes: the identity of a KV block for prefix caching, events and routers.

A block's hash covers its parent's hash, its token ids and its extra keys, so two blocks hash equal
only when their whole prefixes are equal. The byte encoding is written down in ``docs/block_hash.md``
(version 1) with test vectors that another implementation can reproduce::

    message = u8 len(parent) | parent
            | u32 num_tokens | num_tokens x i64 token id
            | u32 num_extra  | num_extra x (u32 len(kind) | kind utf-8 | u32 len(value) | value utf-8)
    digest  = sha256(message)                   (32 bytes, the default)
            | xxh3_128(message) big-endian      (16 bytes, ``algo="xxhash128"``, needs ``xxhash``)

All integers little-endian; the first block's parent is empty (length 0). No process-random seed:
the same tokens hash the same in every process, which is what an external indexer needs; tenants
who must not share blocks pass a ``cache_salt``.

Speed: one ``sha256`` call per block over a message built by concatenating precomputed byte
strings; token ids are packed for a whole run of blocks at once with ``array('q')``.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from kv_blocktable.request import ExtraKeys

__all__ = [
    "HASH_ALGOS",
    "HASH_ENCODING_VERSION",
    "BlockExtraKeys",
    "BlockHasher",
    "encode_block",
    "hash_block_tokens",
]

HASH_ENCODING_VERSION: Final = 1
HASH_ALGOS: Final = ("sha256", "xxhash128")

#: Extra keys of one block: ``(kind, value)`` pairs in a fixed order (see ``ExtraKeys.for_block``).
BlockExtraKeys = tuple[tuple[str, str], ...]

_U32 = struct.Struct("<I")
_NO_EXTRA: Final = _U32.pack(0)
_PARENT_LEN: Final = tuple(bytes((n,)) for n in range(256))
_BIG_ENDIAN: Final = sys.byteorder == "big"
_I64: Final = 2**63


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive little-endian int64 (OverflowError/TypeError on a bad id; the
    public functions check with :func:`_checked_tokens` first, a ``Request``'s are checked)."""
    arr = array("q", token_ids)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def _checked_tokens(owner: str, token_ids: object) -> Sequence[int]:
    """``token_ids`` if it is a sequence of ints (not bools) in the int64 range, else a
    ``TypeError`` / ``ValueError`` naming the first bad id (``array`` alone would take a bool as
    0 / 1 and say nothing of which id overflowed)."""
    if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Sequence):
        raise TypeError(
            f"{owner}: token_ids={token_ids!r} is a {type(token_ids).__name__}; pass a list of "
            "int token ids"
        )
    for i, t in enumerate(token_ids):
        if type(t) is not int:
            raise TypeError(
                f"{owner}: token_ids[{i}]={t!r} is a {type(t).__name__}; token ids are ints "
                "(hashed as int64)"
            )
        if not -_I64 <= t < _I64:
            raise ValueError(
                f"{owner}: token_ids[{i}]={t} is outside the int64 range [-2**63, 2**63) the "
                "hash encodes"
            )
    return token_ids


def _checked_parent(owner: str, parent_hash: object) -> bytes | None:
    if parent_hash is None:
        return None
    if not isinstance(parent_hash, bytes):
        raise TypeError(
            f"{owner}: parent_hash={parent_hash!r} is a {type(parent_hash).__name__}; pass the "
            "parent block's hash (bytes) or None for the first block"
        )
    if not 0 < len(parent_hash) <= 255:
        raise ValueError(
            f"{owner}: parent_hash has {len(parent_hash)} bytes; a block hash has 1 to 255 (pass "
            "None for the first block)"
        )
    return parent_hash


def _encode_extra(extra_keys: BlockExtraKeys | None) -> bytes:
    if not extra_keys:
        return _NO_EXTRA
    if not isinstance(extra_keys, (tuple, list)):
        raise TypeError(
            f"block extra keys {extra_keys!r} are a {type(extra_keys).__name__}; pass a tuple of "
            "(kind, value) str pairs (ExtraKeys.for_block makes them)"
        )
    parts = [_U32.pack(len(extra_keys))]
    for pair in extra_keys:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"block extra key {pair!r} is not a (kind, value) pair of str; pass a tuple of "
                "such pairs (ExtraKeys.for_block makes them)"
            )
        kind, value = pair
        for s in (kind, value):
            if not isinstance(s, str):
                raise TypeError(
                    f"block extra key {kind!r}={value!r}: kind and value must be str; "
                    f"got {type(s).__name__}"
                )
            b = s.encode()
            parts.append(_U32.pack(len(b)))
            parts.append(b)
    return b"".join(parts)


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256":
        sha256 = hashlib.sha256
        return lambda m: sha256(m).digest()
    if algo == "xxhash128":
        try:
            import xxhash
        except ImportError as e:
            raise ImportError(
                "hash algo 'xxhash128' needs the xxhash package: pip install 'kv-blocktable[xxhash]' "
                "(or use algo='sha256')"
            ) from e
        fn: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
        return fn
    raise ValueError(f"hash algo={algo!r} is not supported; choose one of {list(HASH_ALGOS)}")


def _hash_ctor(algo: str) -> Callable[[bytes], Any]:
    """The hash object constructor of ``algo`` (``ctor(message).digest()`` is
    ``_digest_fn(algo)(message)``); ``_digest_fn`` has already checked ``algo`` and the import."""
    if algo == "sha256":
        return hashlib.sha256
    import xxhash

    ctor: Callable[[bytes], Any] = xxhash.xxh3_128
    return ctor


def encode_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: BlockExtraKeys | None = None
) -> bytes:
    """The canonical message of one block (version 1); its digest is the block hash."""
    parent = _checked_parent("encode_block", parent_hash) or b""
    token_ids = _checked_tokens("encode_block", token_ids)
    return (
        _PARENT_LEN[len(parent)]
        + parent
        + _U32.pack(len(token_ids))
        + _pack_tokens(token_ids)
        + _encode_extra(extra_keys)
    )


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: BlockExtraKeys | None = None,
    *,
    algo: str = "sha256",
) -> bytes:
    """Hash of one block: ``digest(encode_block(parent_hash, token_ids, extra_keys))``."""
    return _digest_fn(algo)(encode_block(parent_hash, token_ids, extra_keys))


@dataclass(frozen=True)
class BlockHasher:
    """Computes a request's chain of block hashes, ``block_size`` tokens per block.

    ``block_size`` is the *hash block size*: the manager uses the gcd of its groups' block sizes,
    and a group block of ``m`` hash blocks is identified by the hash of its last one.
    """

    block_size: int
    algo: str = "sha256"

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"BlockHasher.block_size={self.block_size!r} must be an int")
        if self.block_size < 1:
            raise ValueError(f"BlockHasher.block_size={self.block_size} must be >= 1")
        object.__setattr__(self, "_digest", _digest_fn(self.algo))
        object.__setattr__(self, "_n_prefix", _U32.pack(self.block_size))
        # _hash_next's message, a decode step's one block, packed by one struct call: the
        # parent is this hasher's own digest (a fixed size), the tokens one block of int64.
        # Every field little-endian ("<", no padding): the same bytes as encode_block.
        size = len(self._digest(b""))  # type: ignore[attr-defined]
        object.__setattr__(self, "_digest_size", size)
        object.__setattr__(self, "_new", _hash_ctor(self.algo))
        object.__setattr__(self, "_pack_next", struct.Struct(f"<B{size}sI{self.block_size}qI").pack)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
        *,
        parent_hash: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Hashes of the full blocks ``start_block, start_block + 1, ...`` of ``token_ids``.

        ``parent_hash`` is the hash of block ``start_block - 1`` (None for block 0). A trailing
        partial block gets no hash.
        """
        owner = "BlockHasher.hash_blocks"
        token_ids = _checked_tokens(owner, token_ids)
        parent_hash = _checked_parent(owner, parent_hash)
        if type(start_block) is not int or start_block < 0:
            raise (ValueError if type(start_block) is int else TypeError)(
                f"{owner}: start_block={start_block!r} must be an int >= 0 (the index of the "
                "first block to hash)"
            )
        if start_block == 0 and parent_hash is not None:
            raise ValueError(
                f"{owner}: start_block=0 has no parent; pass parent_hash=None (block 0's parent "
                "is empty in the encoding)"
            )
        from kv_blocktable.request import ExtraKeys  # (request.py imports this module)

        if extra_keys is not None and not isinstance(extra_keys, ExtraKeys):
            raise TypeError(
                f"{owner}: extra_keys is a {type(extra_keys).__name__}; pass a "
                "kv_blocktable.ExtraKeys or None"
            )
        return self._hash_blocks(token_ids, extra_keys, parent_hash, start_block)

    def _hash_next(self, token_ids: Sequence[int], parent_hash: bytes, block: int) -> bytes:
        """The hash of block ``block >= 1`` alone, without extra keys: ``_hash_blocks``' loop
        body for the one block a decode step completes (a ``Request`` calls it every
        ``block_size`` tokens; the encoding is the same, held by the request hashing tests).

        ``parent_hash`` is this hasher's digest of block ``block - 1`` (its size is the
        digest's, which the one-struct message assumes). Speed: one ``struct`` pack of the
        whole message and the hash object's own ``digest`` — about half the time of packing the
        tokens through ``array`` and joining five parts (the sha256 itself is most of the
        rest)."""
        bs = self.block_size
        size = self._digest_size  # type: ignore[attr-defined]
        if len(parent_hash) != size:  # not this hasher's chain: the general encoding
            return self._hash_blocks(token_ids[: (block + 1) * bs], None, parent_hash, block)[0]
        return self._new(  # type: ignore[attr-defined]
            self._pack_next(  # type: ignore[attr-defined]
                size, parent_hash, bs, *token_ids[block * bs : (block + 1) * bs], 0
            )
        ).digest()

    def _hash_blocks(
        self,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None,
        parent_hash: bytes | None,
        start_block: int,
    ) -> list[bytes]:
        """``hash_blocks`` without the argument checks: a ``Request``'s tokens are checked when
        they enter it, and it passes its own chain."""
        bs = self.block_size
        end_block = len(token_ids) // bs
        if end_block <= start_block:
            return []
        if start_block > 0 and parent_hash is None:
            raise ValueError(
                f"hash_blocks(start_block={start_block}) needs the parent_hash of block "
                f"{start_block - 1}"
            )
        digest: Callable[[bytes], bytes] = self._digest  # type: ignore[attr-defined]
        packed = _pack_tokens(token_ids[start_block * bs : end_block * bs])
        step = 8 * bs
        n_prefix = _U32.pack(bs)
        out: list[bytes] = []
        parent = parent_hash or b""
        plen = _PARENT_LEN
        join = b"".join  # one allocation per message, not one per `+`
        if extra_keys is None:
            for off in range(0, len(packed), step):
                parent = digest(
                    join((plen[len(parent)], parent, n_prefix, packed[off : off + step], _NO_EXTRA))
                )
                out.append(parent)
            return out
        for i, off in enumerate(range(0, len(packed), step)):
            b = start_block + i
            extra = _encode_extra(extra_keys.for_block(b * bs, (b + 1) * bs))
            parent = digest(
                join((plen[len(parent)], parent, n_prefix, packed[off : off + step], extra))
            )
            out.append(parent)
        return out
