"""The request as the scheduler side sees it: an id, token ids and the keys that scope its cache.

No engine types: a scheduler, a router or a test builds a :class:`Request` from plain values.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kv_blocktable.hashing import BlockExtraKeys, BlockHasher

__all__ = ["ExtraKeys", "MultiModalHash", "Request", "append_decode_tokens"]


@dataclass(frozen=True)
class MultiModalHash:
    """One multimodal input: its content hash and the placeholder tokens it occupies.

    A block gets the hash of every input whose placeholder range ``[offset, offset + length)``
    overlaps it, so two prompts with the same placeholder tokens but different images differ.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(
                f"MultiModalHash.identifier={self.identifier!r} must be a non-empty str"
            )
        for name, minimum in (("offset", 0), ("length", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"MultiModalHash.{name}={v!r} must be an int >= {minimum}")


@dataclass(frozen=True)
class ExtraKeys:
    """What besides the tokens decides whether a cached block may be reused.

    - ``cache_salt``: isolates tenants; it enters the first block's hash, and the chain carries it.
    - ``lora_name``: the adapter the KV was computed with; it enters every block's hash.
    - ``mm_hashes``: multimodal inputs; each enters the hash of the blocks its placeholders overlap.
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    mm_hashes: tuple[MultiModalHash, ...] = ()

    def __post_init__(self) -> None:
        for name in ("cache_salt", "lora_name"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"ExtraKeys.{name}={v!r} must be a non-empty str or None")
        if isinstance(self.mm_hashes, MultiModalHash) or not isinstance(
            self.mm_hashes, (tuple, list)
        ):
            raise TypeError(
                f"ExtraKeys.mm_hashes={self.mm_hashes!r} must be a tuple of MultiModalHash "
                f"values; got {type(self.mm_hashes).__name__}"
            )
        mm = tuple(self.mm_hashes)
        for m in mm:
            if not isinstance(m, MultiModalHash):
                raise TypeError(
                    f"ExtraKeys.mm_hashes holds a {type(m).__name__}; pass MultiModalHash values"
                )
        object.__setattr__(self, "mm_hashes", tuple(sorted(mm, key=lambda m: m.offset)))

    def for_block(self, start: int, end: int) -> BlockExtraKeys:
        """The ``(kind, value)`` pairs that enter the hash of the block of tokens ``[start, end)``."""
        keys: list[tuple[str, str]] = []
        if start == 0 and self.cache_salt is not None:
            keys.append(("cache_salt", self.cache_salt))
        if self.lora_name is not None:
            keys.append(("lora_name", self.lora_name))
        for m in self.mm_hashes:
            if m.offset < end and m.offset + m.length > start:
                keys.append(("mm_hash", m.identifier))
        return tuple(keys)


@dataclass(slots=True, eq=False)
class Request:
    """A request's id, its tokens (prompt, then outputs as they are appended) and extra keys.

    ``block_hashes`` holds the chained hashes of the request's *full* hash blocks and is extended
    as tokens are appended. It is computed by the bound :class:`BlockHasher`; a
    ``KVCacheManager`` binds its own on first sight (a request belongs to one manager's hash space).
    """

    request_id: str
    token_ids: list[int]
    extra_keys: ExtraKeys | None = None
    block_hasher: BlockHasher | None = None
    _block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    # Token count at which the next block hash is due (never, until a hasher is bound): one
    # comparison per appended token instead of a division.
    _next_hash_at: int = field(default=sys.maxsize, init=False, repr=False)
    # The KVCacheManager this request is running in (None: not admitted). A manager's decode
    # fast path checks it by identity: another Request object with the same id is not this one.
    _kv_owner: object = field(default=None, init=False, repr=False)
    # Its tokens computed (or scheduled) in that manager: the manager's count, kept here so a
    # decode step reads and writes it as an attribute rather than by id in a dict.
    _kv_computed: int = field(default=0, init=False, repr=False)
    # The computed count below which that manager's allocate_decode_slots has nothing to check
    # for it (see kv_blocktable._decode_slots); 0 (always check) until it sets one.
    _kv_due: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"Request.request_id={self.request_id!r} must be a non-empty str")
        if self.extra_keys is not None and not isinstance(self.extra_keys, ExtraKeys):
            raise TypeError(
                f"Request.extra_keys is a {type(self.extra_keys).__name__}; pass ExtraKeys or None"
            )
        if self.block_hasher is not None and not isinstance(self.block_hasher, BlockHasher):
            raise TypeError(
                f"Request.block_hasher is a {type(self.block_hasher).__name__}; pass a "
                "BlockHasher or None"
            )
        self.token_ids = _check_tokens(self.request_id, self.token_ids)
        if self.block_hasher is not None:
            self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        """Hashes of the full hash blocks so far (read-only by convention: do not mutate)."""
        return self._block_hashes

    def append_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append output token ids (one int or several) and hash any block they complete."""
        tokens = self.token_ids
        # The decode fast path: a one-digit int (below 2**30) is compared by the interpreter's
        # int fast path, then the int64 bounds (literals: constants load faster than globals).
        if type(token_ids) is int and (
            0 <= token_ids <= 0x3FFFFFFF or -0x8000000000000000 <= token_ids <= 0x7FFFFFFFFFFFFFFF
        ):
            tokens.append(token_ids)
        else:
            tokens.extend(_check_tokens(self.request_id, _iterable(token_ids)))
        if len(tokens) >= self._next_hash_at:
            self._extend_hashes()

    def bind_hasher(self, hasher: BlockHasher) -> None:
        """Hash this request's blocks with ``hasher`` (a no-op if it is already bound to it)."""
        if not isinstance(hasher, BlockHasher):
            raise TypeError(
                f"request {self.request_id!r}: bind_hasher(hasher={hasher!r}) takes a "
                f"BlockHasher; got {type(hasher).__name__}"
            )
        if self.block_hasher == hasher:
            return
        if self.block_hasher is not None:
            raise ValueError(
                f"request {self.request_id!r} is hashed with {self.block_hasher} but this manager "
                f"uses {hasher}; a request belongs to one manager (build a new Request to move it)"
            )
        self.block_hasher = hasher
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        h = self.block_hasher
        assert h is not None
        hashes = self._block_hashes
        n, bs = len(hashes), h.block_size
        if n and self.extra_keys is None and (n + 1) * bs <= len(self.token_ids) < (n + 2) * bs:
            # Exactly one block completed (what decoding does every block_size tokens).
            hashes.append(h._hash_next(self.token_ids, hashes[-1], n))
        else:
            hashes.extend(
                h._hash_blocks(self.token_ids, self.extra_keys, hashes[-1] if hashes else None, n)
            )
        self._next_hash_at = (len(hashes) + 1) * bs


_I64 = 2**63


def append_decode_tokens(requests: Sequence[Request], token_ids: Sequence[int]) -> None:
    """``requests[i].append_token_ids(token_ids[i])`` for every ``i`` in order — one sampled
    token per request, a decode step's update — with the same tokens, block hashes and errors.

    One loop, no call per request: each id gets ``append_token_ids``' own fast-path test (an
    ``int``, not a bool, in the int64 range), is appended, and only a request whose token
    completes a hash block hashes it (that block alone, inline). Anything else — an id the test
    refuses, a request that is not exactly a :class:`Request` — runs that request's own
    ``append_token_ids``, so a bad id raises its error, naming the request, after the requests
    before it got their tokens, as the loop of calls would.

    Speed (256 requests, 2-core EPYC): the checks inline cost less than checking the ids in
    bulk first (a pass over their types plus an ``array('q')`` build is ~9 us; the inline test
    ~5 us); the loop itself is about what the calls cost (~25 us), the saving is the hashing's
    calls (16 blocks a step at block size 16).
    """
    # (the exact-type test first: an ABC check costs about a microsecond)
    seqs = (list, tuple)
    if not (type(requests) in seqs or isinstance(requests, Sequence)) or not (
        type(token_ids) in seqs
        or (isinstance(token_ids, Sequence) and not isinstance(token_ids, (str, bytes)))
    ):
        raise TypeError(
            f"append_decode_tokens: requests ({type(requests).__name__}) and token_ids "
            f"({type(token_ids).__name__}) must be sequences, one int token id per request"
        )
    if len(requests) != len(token_ids):
        raise ValueError(
            f"append_decode_tokens: got {len(requests)} requests but {len(token_ids)} token "
            "ids; pass one sampled token id per request"
        )
    cls = Request
    for req, t in zip(requests, token_ids, strict=True):
        # The int64 test as in append_token_ids: a one-digit int (below 2**30, any token of a
        # real vocabulary) is compared by the interpreter's int fast path; the bounds of int64
        # are wider ints, compared generically (~3 us a step of 256 for the short cut).
        if type(req) is not cls or not (
            type(t) is int
            and (0 <= t <= 0x3FFFFFFF or -0x8000000000000000 <= t <= 0x7FFFFFFFFFFFFFFF)
        ):
            req.append_token_ids(t)  # its own method: a subclass's, or the error of a bad id
            continue
        tokens = req.token_ids
        tokens.append(t)
        due = req._next_hash_at
        if len(tokens) >= due:
            hashes = req._block_hashes
            if len(tokens) == due and hashes and req.extra_keys is None:
                # _extend_hashes' one-block case inline (the block this token completes,
                # chained on the last hash): a call less for each of a step's completed blocks.
                h = req.block_hasher
                assert h is not None  # a due hash means a bound hasher
                hashes.append(h._hash_next(tokens, hashes[-1], len(hashes)))
                req._next_hash_at = due + h.block_size
            else:
                req._extend_hashes()


def _iterable(token_ids: int | Iterable[int]) -> Iterable[int]:
    return [token_ids] if isinstance(token_ids, int) else token_ids


def _check_tokens(request_id: str, token_ids: object) -> list[int]:
    """A copy of ``token_ids`` (the request owns its tokens) if every id is an int (not a bool)
    in the int64 range; a str is refused, not read as characters."""
    if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Iterable):
        raise TypeError(
            f"request {request_id!r}: token_ids={token_ids!r} is a {type(token_ids).__name__}; "
            "pass a list of int token ids (a str is not read as digits)"
        )
    ids = list(token_ids)
    # Fast path (an 8k-token prompt: ~0.3 ms against ~2 ms for the loop below, which names the
    # first bad id): every id an int, the extremes in range.
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= -_I64 and max(ids) < _I64)):
        return ids
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise TypeError(
                f"request {request_id!r}: token id {t!r} (index {i}) is a {type(t).__name__}; "
                "token ids are ints in [-2**63, 2**63) (hashed as int64), never rounded"
            )
        if not -_I64 <= t < _I64:
            raise ValueError(
                f"request {request_id!r}: token id {t} (index {i}) is outside [-2**63, 2**63) "
                "(token ids are hashed as int64)"
            )
    return ids
