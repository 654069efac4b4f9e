"""One manager per KV-cache group: which blocks a request holds in that group, and its cache hits.

Every manager keeps, per request, a list of block ids by position (block ``j`` holds tokens
``[j * block_size, (j + 1) * block_size)``). Groups differ in which positions must stay live:

- full attention (and MLA): every position.
- sliding window ``w``: a query at ``p`` reads keys ``> p - w``, so once the request has computed
  ``c`` tokens, the blocks wholly before token ``c - w + 1`` are dropped: their position keeps the
  null block id 0 and the block goes back to the pool (its cache entry stays, for other requests).
- chunked local ``c``: a query reads only its own chunk, so the blocks before the chunk of the
  first uncomputed token are dropped the same way.

Block hashes come from the request at the *hash block size* ``h`` (which divides every group's
block size); a group block of ``m = block_size // h`` hash blocks is cached under the hash of its
last hash block, ``request.block_hashes[(j + 1) * m - 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

from kv_blocktable.events import BlockStored
from kv_blocktable.pool import NULL_BLOCK_ID, BlockPool
from kv_blocktable.request import Request

__all__ = [
    "ChunkedLocalManager",
    "FullAttentionManager",
    "GroupManager",
    "SlidingWindowManager",
    "make_group_manager",
]


class GroupManager:
    """Blocks of one group for every request. Subclasses define which positions may be dropped.

    A part of :class:`~kv_blocktable.KVCacheManager`, which checks its callers' requests, counts
    and hits before it calls these: the constructor, :meth:`find_longest_cache_hit` and
    :meth:`add_computed_blocks` check their arguments; the per-step methods (``allocate``,
    ``num_new_blocks``, ``remove_skipped_blocks``, ``cache_blocks``, ``free``) trust them, since
    they run for every request of every step of a hybrid model. Drive groups through
    ``KVCacheManager``.
    """

    def __init__(
        self,
        pool: BlockPool,
        group_id: int,
        spec: AttentionSpec,
        hash_block_size: int,
        enable_caching: bool,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(pool, BlockPool):
            raise TypeError(f"{owner}: pool is a {type(pool).__name__}; pass a BlockPool")
        if type(group_id) is not int or not 0 <= group_id < len(pool._cache):
            raise ValueError(
                f"{owner}: group_id={group_id!r} is not a group of the pool, [0, num_groups="
                f"{len(pool._cache)}); build the pool with one group per KV-cache group"
            )
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"{owner}: spec is a {type(spec).__name__}; pass a kv_spec spec")
        if (
            type(hash_block_size) is not int
            or hash_block_size < 1
            or spec.block_size % hash_block_size
        ):
            raise ValueError(
                f"{owner}: hash_block_size={hash_block_size!r} must be a positive int dividing "
                f"block_size={spec.block_size} (the gcd of the groups' block sizes)"
            )
        self.pool = pool
        self.group_id = group_id
        #: this group's prefix-cache map in the pool (hash -> block id), read on every lookup.
        self._cache = pool._cache[group_id]
        self.spec = spec
        self.block_size = spec.block_size
        self.hash_block_size = hash_block_size
        self.hash_ratio = spec.block_size // hash_block_size
        self.enable_caching = enable_caching
        #: request id -> block ids by position (0 = dropped / not needed).
        self.blocks: dict[str, list[int]] = {}
        #: request id -> positions already entered in the prefix cache (or skipped as null).
        self.num_cached: dict[str, int] = {}

    # -- what a subclass defines ---------------------------------------------------------------

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future query of the request attends to."""
        return 0

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[int], int]:
        """Cached blocks (null where not needed) for the longest valid hit of at most
        ``max_length`` tokens, and its length in tokens (a multiple of ``block_size``)."""
        raise NotImplementedError

    def needed_from(self, length: int) -> int:
        """The first position a hit of ``length`` tokens needs a real block at (the positions
        before it may hold the null block: no query past ``length`` reads them)."""
        return self.num_skipped_tokens(length) // self.block_size

    # -- shared --------------------------------------------------------------------------------

    def _hash_at(self, block_hashes: Sequence[bytes], j: int) -> bytes:
        return block_hashes[(j + 1) * self.hash_ratio - 1]

    def num_new_blocks(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> int:
        """Fresh blocks needed to give ``num_tokens`` tokens slots (dropped positions need none)."""
        have = len(self.blocks.get(request_id, ()))
        end = cdiv(num_tokens, self.block_size)
        if end <= have:
            return 0
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        return end - max(have, min(end, skipped))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Return the blocks no future query reads to the pool; their positions become 0."""
        n = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        if not n:
            return
        blocks = self.blocks.get(request_id)
        if not blocks:
            return
        removed = []
        # Walk back from the last skipped position: positions before a null are null already.
        for j in range(min(n, len(blocks)) - 1, -1, -1):
            b = blocks[j]
            if b == NULL_BLOCK_ID:
                break
            removed.append(b)
            blocks[j] = NULL_BLOCK_ID
        if removed:
            self.pool._release(removed)

    def add_computed_blocks(self, request_id: str, block_ids: Sequence[int]) -> None:
        """A new request takes the cached blocks of a prefix hit (already touched by the caller)."""
        owner = f"{type(self).__name__}.add_computed_blocks"
        if not isinstance(request_id, str) or request_id in self.blocks:
            raise ValueError(
                f"{owner}: request_id={request_id!r} must be a str naming a request this group "
                "holds no blocks for"
            )
        n = self.pool.num_blocks
        for b in block_ids:
            if type(b) is not int or not 0 <= b < n:
                raise ValueError(
                    f"{owner}: block id {b!r} is not an int in [0, num_blocks={n}); pass the "
                    "hit's block ids"
                )
        self.blocks[request_id] = list(block_ids)
        self.num_cached[request_id] = len(block_ids)

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> list[int]:
        """Give ``num_tokens`` tokens slots; returns the fresh block ids, in position order."""
        blocks = self.blocks.get(request_id)
        if blocks is None:
            blocks = self.blocks[request_id] = []
            self.num_cached[request_id] = 0
        end = cdiv(num_tokens, self.block_size)
        have = len(blocks)
        if end <= have:
            return []
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        start = max(have, min(end, skipped))
        if start > have:  # positions already out of the window when first reached
            blocks.extend([NULL_BLOCK_ID] * (start - have))
        new = self.pool.allocate(end - start)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's blocks that ``num_tokens`` known tokens fill in the prefix cache."""
        rid = request.request_id
        start = self.num_cached[rid]
        end = num_tokens // self.block_size
        if end <= start:
            return
        blocks = self.blocks[rid]
        hashes = request.block_hashes
        pool = self.pool
        if end == start + 1 and not pool.enable_events:  # one block (a decode step's), no events
            b = blocks[start]
            if b != NULL_BLOCK_ID:
                pool._cache_block(self.group_id, b, hashes[end * self.hash_ratio - 1])
            self.num_cached[rid] = end
            return
        group = self.group_id
        stored_from = -1
        stored: list[bytes] = []
        for j in range(start, end):
            b = blocks[j]
            h = self._hash_at(hashes, j)
            # cache_block runs first: events only decide whether to record it.
            if b != NULL_BLOCK_ID and pool._cache_block(group, b, h) and pool.enable_events:
                if not stored:
                    stored_from = j
                elif stored_from + len(stored) != j:  # a gap: close the run
                    self._emit_stored(request, stored_from, stored)
                    stored, stored_from = [], j
                stored.append(h)
        self.num_cached[rid] = end
        if stored:
            self._emit_stored(request, stored_from, stored)

    def _emit_stored(self, request: Request, first: int, hashes: list[bytes]) -> None:
        bs, hbs, m = self.block_size, self.hash_block_size, self.hash_ratio
        parent = request.block_hashes[first * m - 1] if first else None
        extra = request.extra_keys
        n_hash_blocks = len(hashes) * m
        first_hb = first * m
        self.pool.record_event(
            BlockStored(
                block_hashes=tuple(hashes),
                parent_block_hash=parent,
                token_ids=tuple(request.token_ids[first * bs : (first + len(hashes)) * bs]),
                block_size=bs,
                hash_block_size=hbs,
                extra_keys=()
                if extra is None
                else tuple(
                    extra.for_block(k * hbs, (k + 1) * hbs)
                    for k in range(first_hb, first_hb + n_hash_blocks)
                ),
                group_id=self.group_id,
                medium=self.pool.medium,
            )
        )

    def free(self, request_id: str) -> None:
        """Release all the request's blocks, tail first (so its tail is evicted before its prefix)."""
        blocks = self.blocks.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if blocks:
            held = [b for b in reversed(blocks) if b != NULL_BLOCK_ID]
            self.pool._release(held)

    def _lookup(self, block_hashes: Sequence[bytes], j: int) -> int | None:
        return self._cache.get(self._hash_at(block_hashes, j))


class FullAttentionManager(GroupManager):
    """Full (and MLA) attention: a hit is the longest run of cached blocks from position 0."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[int], int]:
        _check_hit_args(self, block_hashes, max_length)
        n = min(max_length // self.block_size, len(block_hashes) // self.hash_ratio)
        out: list[int] = []
        for j in range(n):
            b = self._lookup(block_hashes, j)
            if b is None:
                break
            out.append(b)
        return out, len(out) * self.block_size


class SlidingWindowManager(GroupManager):
    """Sliding window: a hit at length ``L`` needs only the blocks of the window before ``L``."""

    spec: SlidingWindowSpec

    def __init__(self, pool: BlockPool, group_id: int, spec: AttentionSpec, *args: object) -> None:
        super().__init__(pool, group_id, spec, *args)  # type: ignore[arg-type]
        assert isinstance(spec, SlidingWindowSpec)
        self.window = spec.sliding_window
        # Blocks before position L that a query at L can read: tokens (L - w, L), i.e. w - 1.
        self.window_blocks = cdiv(self.window - 1, self.block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[int], int]:
        _check_hit_args(self, block_hashes, max_length)
        n = min(max_length // self.block_size, len(block_hashes) // self.hash_ratio)
        need = self.window_blocks
        if need == 0:
            return [NULL_BLOCK_ID] * n, n * self.block_size
        out = [NULL_BLOCK_ID] * n
        run = 0
        # Scan from the end: the first run of `need` cached blocks gives the longest hit.
        for j in range(n - 1, -1, -1):
            b = self._lookup(block_hashes, j)
            if b is None:
                run = 0
                continue
            out[j] = b
            run += 1
            if run >= need:
                del out[j + need :]
                return out, (j + need) * self.block_size
        # No full window anywhere: the hit is the run at the very start (shorter than a window).
        del out[run:]
        return out, run * self.block_size


class ChunkedLocalManager(GroupManager):
    """Chunked local attention: a hit at length ``L`` needs the blocks of ``L``'s chunk only."""

    spec: ChunkedLocalAttentionSpec

    def __init__(self, pool: BlockPool, group_id: int, spec: AttentionSpec, *args: object) -> None:
        super().__init__(pool, group_id, spec, *args)  # type: ignore[arg-type]
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        self.chunk = spec.attention_chunk_size

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk) * self.chunk

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[int], int]:
        _check_hit_args(self, block_hashes, max_length)
        n = min(max_length // self.block_size, len(block_hashes) // self.hash_ratio)
        limit = max_length
        while True:
            # Blocks wholly before the chunk that holds token `limit` are not needed.
            start = min((limit // self.chunk) * self.chunk // self.block_size, n)
            out = [NULL_BLOCK_ID] * start
            for j in range(start, n):
                b = self._lookup(block_hashes, j)
                if b is None:
                    break
                out.append(b)
            length = len(out) * self.block_size
            # A miss can stop the hit in an earlier chunk (when chunks are not whole blocks);
            # then that chunk's blocks are needed too: look again from there.
            if (length // self.chunk) * self.chunk // self.block_size >= start:
                return out, length
            limit, n = length, len(out)


def _check_hit_args(m: GroupManager, block_hashes: object, max_length: object) -> None:
    owner = f"{type(m).__name__}.find_longest_cache_hit"
    if type(max_length) is not int or max_length < 0:
        raise ValueError(f"{owner}: max_length={max_length!r} must be an int >= 0 (tokens)")
    if not isinstance(block_hashes, (list, tuple)):
        raise TypeError(
            f"{owner}: block_hashes is a {type(block_hashes).__name__}; pass the request's "
            "block_hashes (a list of bytes)"
        )


def make_group_manager(
    pool: BlockPool,
    group_id: int,
    spec: AttentionSpec,
    hash_block_size: int,
    enable_caching: bool,
) -> GroupManager:
    """The manager for ``spec``'s kind; cross-attention is refused (no encoder cache here)."""
    if isinstance(spec, CrossAttentionSpec):
        raise ValueError(
            f"KV-cache group {group_id} is cross-attention ({spec}); kv-blocktable manages "
            "decoder self-attention caches only — plan encoder-decoder caches separately"
        )
    cls: type[GroupManager]
    if isinstance(spec, SlidingWindowSpec):
        cls = SlidingWindowManager
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        cls = ChunkedLocalManager
    else:  # FullAttentionSpec, MLAAttentionSpec: every position stays live
        cls = FullAttentionManager
    return cls(pool, group_id, spec, hash_block_size, enable_caching)
