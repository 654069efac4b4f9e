"""The block pool: block ids, reference counts, the free queue and the prefix-cache hash map.

State is kept in flat lists indexed by block id (no per-block Python objects): ``ref[b]`` is the
number of holders, ``hash[b]`` the block's hash while it is cached. Block 0 is the *null block*: it
is never handed out, never freed, and stands for "no block here" in a request's list (a sliding
window's dropped blocks).

The free queue orders the blocks with ``ref == 0``: ``allocate`` takes from the front. ``free``
appends cached blocks to the back, so the cached block freed longest ago is evicted first, and puts
uncached blocks (which no request can hit) at the front, so they are reused before any cached
block is evicted (vLLM 0.33 does the same).

Representation, chosen so that allocate and free run as C-level list/deque operations:

- the front of the queue is a Python list used as a stack (``_front``, top = next block): uncached
  blocks are pushed and taken in slices (``ids = front[-n:]; del front[-n:]``);
- the back is a ``collections.deque`` (``_back``) of cached blocks in LRU order: ``extend`` at the
  back, ``popleft`` once the stack is empty (after ``reset_prefix_cache`` it may hold uncached
  blocks too, in place; only the stack is guaranteed uncached, which ``allocate`` relies on).

A cached free block can be taken out of the middle by ``touch`` (a prefix hit). That is *lazy
deletion*: ``touch`` only counts the block's entry as stale and ``allocate`` skips stale entries
when it reaches them. A block's stale entries always come before its live one (a touched block is
cached, and a cached block is freed to the back), so a per-block counter is exact; the one case
that would break this — an uncached block touched while free, then freed to the front — compacts
the queue first. The queue is also compacted when stale entries outnumber the blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from kv_spec._checks import check_bool, check_int

from kv_blocktable.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["NULL_BLOCK_ID", "BlockPool", "PrefixCacheBusyError"]

NULL_BLOCK_ID = 0
MAX_NUM_BLOCKS = 2**31


class PrefixCacheBusyError(RuntimeError):
    """``reset_prefix_cache`` was refused: blocks are still held by requests."""


class BlockPool:
    """``num_blocks`` block ids (0 is the null block) shared by ``num_groups`` KV-cache groups.

    Cached blocks are keyed by ``(group, hash)``: one block id belongs to one group at a time, and
    the same tokens cached by two groups are two blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        num_groups: int = 1,
        enable_events: bool = False,
        medium: str = "GPU",
    ) -> None:
        check_int("BlockPool", "num_blocks", num_blocks, minimum=2)
        check_int("BlockPool", "num_groups", num_groups, minimum=1)
        # Upper bounds, so a wrong count fails here and not as a MemoryError / OverflowError in
        # the per-block lists: block ids fit int32 (block tables are int32), and a group with no
        # block to hold is a mistake.
        if num_blocks > MAX_NUM_BLOCKS:
            raise ValueError(
                f"BlockPool.num_blocks={num_blocks} is past {MAX_NUM_BLOCKS} (2**31: block ids are "
                "int32 in block tables); plan with larger blocks"
            )
        if num_groups >= num_blocks:
            raise ValueError(
                f"BlockPool.num_groups={num_groups} must be < num_blocks={num_blocks} (each group "
                "needs a block besides the null block); pass one group per KV-cache group"
            )
        check_bool("BlockPool", "enable_caching", enable_caching)
        check_bool("BlockPool", "enable_events", enable_events)
        if not isinstance(medium, str) or not medium:
            raise ValueError(
                f"BlockPool.medium={medium!r} must be a non-empty str naming where the blocks "
                'live (e.g. "GPU", "CPU"); events carry it'
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.medium = medium
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._group: list[int] = [0] * num_blocks
        self._cache: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self._num_groups = num_groups
        self._num_cached = 0
        self._front: list[int] = list(range(num_blocks - 1, 0, -1))  # top (end) = block 1
        self._back: deque[int] = deque()
        self._stale: list[int] = [0] * num_blocks
        self._num_stale = 0
        self._num_free = num_blocks - 1
        self._events: list[KVEvent] = []

    # -- counters ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder (cached or not): what ``allocate`` can hand out."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by someone, in [0, 1]."""
        return 1.0 - self._num_free / (self.num_blocks - 1)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The block's hash while it is in the prefix cache, else None."""
        self._check_id(block_id)
        return self._hash[block_id]

    def free_queue(self) -> list[int]:
        """The free block ids in eviction order (front first). O(queue): for tests and debugging."""
        pending = self._stale[:]
        out = []
        for b in (*reversed(self._front), *self._back):
            if pending[b]:
                pending[b] -= 1
            else:
                out.append(b)
        return out

    # -- allocate / free / touch ---------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, evicting any cached ones; ref = 1."""
        if type(n) is not int:  # bool and float included: never a count
            raise TypeError(
                f"BlockPool.allocate(n={n!r}): n is a {type(n).__name__}; pass an int in "
                f"[0, num_free_blocks={self._num_free}]"
            )
        if n > self._num_free or n < 0:
            raise ValueError(
                f"BlockPool.allocate(n={n}): {self._num_free} blocks are free; check "
                "num_free_blocks before allocating (n must be in [0, num_free_blocks])"
            )
        front = self._front
        if not self._num_stale and len(front) >= n:
            # The common case: uncached blocks off the stack in one slice; none needs eviction.
            ids = front[-n:] if n else []
            del front[len(front) - n :]
            ids.reverse()
        else:
            ids = self._take_slow(n)
        ref = self._ref
        for b in ids:
            ref[b] = 1
        self._num_free -= n
        return ids

    def _take_slow(self, n: int) -> list[int]:
        """The stack's blocks, then the back's (evicting cached ones); with stale entries, one
        entry at a time to skip them."""
        front, back, stale = self._front, self._back, self._stale
        if not self._num_stale:  # every entry is live: the stack, then the back, in order
            k = min(n, len(front))
            ids = front[len(front) - k :]
            del front[len(front) - k :]
            ids.reverse()
            if k < n:
                pop = back.popleft
                ids += [pop() for _ in range(n - k)]
        else:
            ids = []
            while len(ids) < n:
                b = front.pop() if front else back.popleft()
                if stale[b]:
                    stale[b] -= 1
                    self._num_stale -= 1
                else:
                    ids.append(b)
        if self._num_cached:
            h = self._hash
            evicted = [b for b in ids if h[b] is not None]
            if evicted:
                self._evict(evicted)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block. Blocks left with none join the free queue in the
        order given: cached ones at the back (pass a request's blocks tail first, so its tail is
        evicted before its shared prefix), uncached ones at the front. Raises ``ValueError`` and
        changes nothing if any block is not held (a double free), is the null block, or is out of
        range."""
        ids = block_ids if type(block_ids) is list else _as_list("free", block_ids)
        # Ids >= num_blocks and non-ints fail the ref lookup in _release (and are undone there);
        # negative ids would silently index from the end and 0 is the null block: the minimum
        # tells, so well-formed ids pay one min(). A bool minimum (True alone, or first of the
        # ids equal to 1) is refused too; a True after a 1 would count as block 1 (finding it
        # costs a pass over every call's ids, ~10% of an allocate + free).
        if ids:
            try:
                lo = min(ids)
                low = lo < 1 or type(lo) is not int
            except TypeError:  # None, str, ... (beside ints, or alone)
                raise self._bad_id_error("free", ids) from None
            if low:
                _check_low_ids("free", ids, lo, self.num_blocks)
        self._release(ids)

    def _release(self, ids: Sequence[int]) -> None:
        """``free`` without the low-id check, for managers that pass ids the pool gave them."""
        ref = self._ref
        zero = []
        for i, b in enumerate(ids):
            try:
                r = ref[b] - 1
            except (IndexError, TypeError):
                r = -2
            if r < 0:
                for prev in ids[:i]:  # undo: a failed free changes nothing
                    ref[prev] += 1
                if r == -2:
                    raise self._bad_id_error("free", [b]) from None
                raise ValueError(
                    f"BlockPool.free: block {b} is not held by anyone (ref count 0): a double "
                    "free, or a block this pool never handed out"
                )
            ref[b] = r
            if not r:
                zero.append(b)
        if not zero:
            return
        self._num_free += len(zero)
        if self._num_cached:
            h = self._hash
            cached = [b for b in zero if h[b] is not None]
            if cached:
                self._back.extend(cached)
                if len(cached) == len(zero):
                    return
                zero = [b for b in zero if h[b] is None]
        if self._num_stale and any(self._stale[b] for b in zero):
            self._compact()  # see the module docstring: keeps stale entries behind live ones
        zero.reverse()
        self._front.extend(zero)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a request reusing cached blocks). A block with no
        holder leaves the free queue, so it can no longer be evicted."""
        ids = block_ids if type(block_ids) is list else _as_list("touch", block_ids)
        if ids:
            try:
                lo, hi = min(ids), max(ids)
                low = lo < 1 or type(lo) is not int
            except TypeError:  # None, str, ... (beside ints, or alone)
                raise self._bad_id_error("touch", ids) from None
            if low:
                _check_low_ids("touch", ids, lo, self.num_blocks)
            if hi >= self.num_blocks or not all(type(b) is int for b in ids):
                raise self._bad_id_error("touch", ids)
        ref = self._ref
        stale = self._stale
        for b in ids:
            if not ref[b]:
                stale[b] += 1
                self._num_stale += 1
                self._num_free -= 1
            ref[b] += 1
        if self._num_stale > self.num_blocks:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries. Each live entry stays in its part: the stack keeps only
        uncached blocks, which is what lets ``allocate`` skip the eviction check there."""
        pending = self._stale
        front: list[int] = []
        for b in reversed(self._front):  # pop order: stale entries come first
            if pending[b]:
                pending[b] -= 1
            else:
                front.append(b)
        back: deque[int] = deque()
        for b in self._back:
            if pending[b]:
                pending[b] -= 1
            else:
                back.append(b)
        front.reverse()
        self._front, self._back = front, back
        self._num_stale = 0

    # -- prefix cache --------------------------------------------------------------------------

    def get_cached_block(self, group: int, block_hash: bytes) -> int | None:
        """The block caching ``block_hash`` for ``group``, or None."""
        self._check_group("get_cached_block", group)
        if type(block_hash) is not bytes:
            raise self._bad_hash_error("get_cached_block", block_hash)
        return self._cache[group].get(block_hash)

    def cache_block(self, group: int, block_id: int, block_hash: bytes) -> bool:
        """Enter a held, full block in the prefix cache. Returns False (and changes nothing) if
        another block already caches this hash for ``group`` (two requests computed the same
        block at once; the second copy stays uncached and is freed normally).

        ``group`` is a group index, ``block_id`` a block this pool handed out (not the null
        block) and ``block_hash`` ``bytes``; anything else raises (``None`` would leave the
        block findable after it was freed and reused)."""
        # The fast path checks the hash's type and the low bounds; the high bounds and the
        # ids' types are the lists' own (an IndexError / TypeError for 2.5 or None, caught
        # before anything changed; a bool indexes as 0 / 1, the same number). The body is
        # _cache_block's, inlined: a call would cost more than the checks.
        try:
            if block_hash.__class__ is not bytes or block_id < 1 or group < 0:
                raise TypeError
            cache = self._cache[group]
            if block_hash in cache:
                return False
            held = self._ref[block_id]
        except (TypeError, IndexError):
            raise self._cache_args_error(group, block_id, block_hash) from None
        h = self._hash
        if not held:
            raise ValueError(f"block {block_id} is free; only a held block can be cached")
        if h[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached under another hash")
        cache[block_hash] = block_id
        h[block_id] = block_hash
        self._group[block_id] = group
        self._num_cached += 1
        return True

    def _cache_args_error(self, group: object, block_id: object, block_hash: object) -> Exception:
        try:
            self._check_group("cache_block", group)
        except (TypeError, ValueError) as e:
            return e
        if type(block_hash) is not bytes:
            return self._bad_hash_error("cache_block", block_hash)
        return self._bad_id_error("cache_block", [block_id])

    def _cache_block(self, group: int, block_id: int, block_hash: bytes) -> bool:
        """``cache_block`` without the argument checks, for managers (their ids come from this
        pool, their hashes from a ``BlockHasher``)."""
        cache = self._cache[group]
        if block_hash in cache:
            return False
        if not self._ref[block_id]:
            # A free block lives on the uncached stack; caching it there would let it be
            # handed out without eviction. Only a holder (the request that filled it) caches it.
            raise ValueError(f"block {block_id} is free; only a held block can be cached")
        if self._hash[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached under another hash")
        cache[block_hash] = block_id
        self._hash[block_id] = block_hash
        self._group[block_id] = group
        self._num_cached += 1
        return True

    def _evict(self, ids: list[int]) -> None:
        h = self._hash
        g = self._group
        if not self.enable_events:  # no runs to record: one dict delete per block
            cache = self._cache
            for b in ids:
                del cache[g[b]][h[b]]  # type: ignore[arg-type]
                h[b] = None
            self._num_cached -= len(ids)
            return
        runs: list[tuple[int, list[bytes]]] = []  # (group, hashes) in eviction order
        for b in ids:
            bh = h[b]
            assert bh is not None
            del self._cache[g[b]][bh]
            h[b] = None
            if runs and runs[-1][0] == g[b]:
                runs[-1][1].append(bh)
            else:
                runs.append((g[b], [bh]))
        self._num_cached -= len(ids)
        if self.enable_events:
            for group, hashes in runs:
                self._events.append(BlockRemoved(tuple(hashes), group, self.medium))

    def reset_prefix_cache(self) -> None:
        """Drop every cached hash. Refused with :class:`PrefixCacheBusyError` while any block is
        held: a running request's blocks would stay cached under hashes the reset promised gone."""
        held = self.num_blocks - 1 - self._num_free
        if held:
            raise PrefixCacheBusyError(
                f"reset_prefix_cache refused: {held} blocks are held by running requests; free "
                "(or preempt) them first, then reset"
            )
        for cache in self._cache:
            cache.clear()
        self._hash = [None] * self.num_blocks
        self._num_cached = 0
        if self.enable_events:
            self._events.append(AllBlocksCleared(self.medium))

    # -- events --------------------------------------------------------------------------------

    def record_event(self, event: KVEvent) -> None:
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(
                f"BlockPool.record_event(event={event!r}): a {type(event).__name__}; pass a "
                "BlockStored, BlockRemoved or AllBlocksCleared"
            )
        if self.enable_events:
            self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first (empty unless ``enable_events``)."""
        out, self._events = self._events, []
        return out

    # -- helpers -------------------------------------------------------------------------------

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise TypeError(f"block id {block_id!r} must be an int")
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside [0, num_blocks={self.num_blocks})")

    def _check_group(self, op: str, group: object) -> None:
        if type(group) is not int or not 0 <= group < len(self._cache):
            raise (ValueError if type(group) is int else TypeError)(
                f"BlockPool.{op}: group={group!r} is not a group index in [0, num_groups="
                f"{len(self._cache)}); pass the KV-cache group's position in the plan"
            )

    def _bad_hash_error(self, op: str, block_hash: object) -> Exception:
        return TypeError(
            f"BlockPool.{op}: block_hash={block_hash!r} must be bytes (a BlockHasher digest); "
            f"got {type(block_hash).__name__}"
        )

    def _bad_id_error(self, op: str, ids: Sequence[object]) -> Exception:
        """The error for the first id in ``ids`` that is not a block this pool hands out."""
        for b in ids:
            if type(b) is not int:
                return TypeError(
                    f"BlockPool.{op}: block id {b!r} is a {type(b).__name__}; block ids are ints "
                    f"in [1, num_blocks={self.num_blocks})"
                )
            if b == NULL_BLOCK_ID:
                return ValueError(
                    f"BlockPool.{op}: block 0 is the null block; it is never allocated, cached "
                    "or freed"
                )
            if not 1 <= b < self.num_blocks:
                return ValueError(
                    f"BlockPool.{op}: block id {b} is outside [1, num_blocks={self.num_blocks})"
                )
        raise AssertionError(f"no bad id in {ids!r}")  # callers found one


def _as_list(op: str, block_ids: object) -> list[int]:
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__iter__"):
        raise TypeError(
            f"BlockPool.{op}: block_ids={block_ids!r} is a {type(block_ids).__name__}; pass a "
            "list of block ids"
        )
    return list(block_ids)


def _check_low_ids(op: str, ids: list[int], lo: int, num_blocks: int) -> None:
    """The slow path of a minimum below 1 or not an int: anything but an int (a bool compares
    equal to 0 / 1, True is not block 1), the null block 0 and negative ids are refused."""
    for b in ids:
        if type(b) is not int:
            raise TypeError(
                f"BlockPool.{op}: block id {b!r} is a {type(b).__name__}; block ids are ints "
                "(True is not block 1)"
            )
    if lo < 1:
        raise ValueError(
            f"BlockPool.{op}: block 0 is the null block; it is never allocated, cached or freed"
            if lo == NULL_BLOCK_ID
            else f"BlockPool.{op}: block id {lo} is outside [1, num_blocks={num_blocks})"
        )
