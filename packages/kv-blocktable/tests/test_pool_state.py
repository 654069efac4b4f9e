"""BlockPool against a plain model: a dict of ref counts, a Python list as the free queue, a dict
as the hash map. Random interleavings of allocate / free / double free / touch / cache / reset."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_blocktable import BlockPool, PrefixCacheBusyError
from kv_blocktable.events import AllBlocksCleared, BlockRemoved

from .conftest import hypothesis_examples, hypothesis_steps

NUM_BLOCKS = 12
NUM_GROUPS = 2
HASHES = [bytes([i]) * 4 for i in range(6)]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, num_groups=NUM_GROUPS, enable_events=True)
        self.ref = dict.fromkeys(range(1, NUM_BLOCKS), 0)
        self.queue = list(range(1, NUM_BLOCKS))  # eviction order, front first
        self.cache: dict[tuple[int, bytes], int] = {}
        self.hash_of: dict[int, tuple[int, bytes]] = {}
        self.removed: list[tuple[int, bytes]] = []  # expected BlockRemoved content, in order
        self.cleared = 0

    def _evict(self, b: int) -> None:
        key = self.hash_of.pop(b, None)
        if key is not None:
            del self.cache[key]
            self.removed.append(key)

    @rule(n=st.integers(0, NUM_BLOCKS))
    def allocate(self, n: int) -> None:
        if n > len(self.queue):
            with pytest.raises(ValueError, match="free"):
                self.pool.allocate(n)
            return
        ids = self.pool.allocate(n)
        assert ids == self.queue[:n]
        del self.queue[:n]
        for b in ids:
            self._evict(b)
            self.ref[b] = 1

    @precondition(lambda self: any(self.ref.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # One reference per distinct block, in a random order (a request's tail-first list).
        held = [b for b, r in self.ref.items() if r]
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        self.pool.free(ids)
        front = []
        for b in ids:
            self.ref[b] -= 1
            if not self.ref[b]:
                # Cached blocks go to the back (LRU); uncached ones to the front, in order.
                (self.queue if b in self.hash_of else front).append(b)
        self.queue[:0] = front

    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        # A free that holds one unheld block (or the null block, or an out-of-range id)
        # raises and changes nothing, even if other blocks in the call are held.
        bad = data.draw(
            st.sampled_from([0, NUM_BLOCKS, -1, *[b for b, r in self.ref.items() if not r]])
        )
        held = [b for b, r in self.ref.items() if r]
        ids = [*held[:2], bad]
        before = (list(self.pool._ref), self.pool.free_queue())
        with pytest.raises(ValueError, match="null block|not held|outside"):
            self.pool.free(ids)
        assert (list(self.pool._ref), self.pool.free_queue()) == before

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        # Prefix hits touch cached blocks (free or held); touching a held block shares it.
        candidates = [b for b in self.ref if b in self.hash_of or self.ref[b]]
        if not candidates:
            return
        ids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=4, unique=True))
        self.pool.touch(ids)
        for b in ids:
            if not self.ref[b]:
                self.queue.remove(b)
            self.ref[b] += 1

    @rule(data=st.data(), group=st.integers(0, NUM_GROUPS - 1), h=st.sampled_from(HASHES))
    def cache(self, data: st.DataObject, group: int, h: bytes) -> None:
        held = [b for b, r in self.ref.items() if r and b not in self.hash_of]
        if not held:
            return
        b = data.draw(st.sampled_from(held))
        stored = self.pool.cache_block(group, b, h)
        assert stored == ((group, h) not in self.cache)
        if stored:
            self.cache[(group, h)] = b
            self.hash_of[b] = (group, h)

    @rule()
    def reset(self) -> None:
        if any(self.ref.values()):
            with pytest.raises(PrefixCacheBusyError, match="held"):
                self.pool.reset_prefix_cache()
            return
        self.pool.reset_prefix_cache()
        self.cache.clear()
        self.hash_of.clear()
        self.cleared += 1

    @rule()
    def events_match_the_model(self) -> None:
        events = self.pool.take_events()
        removed = [
            (e.group_id, h) for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes
        ]
        assert removed == self.removed
        assert sum(isinstance(e, AllBlocksCleared) for e in events) == self.cleared
        self.removed, self.cleared = [], 0

    @invariant()
    def state_matches_model(self) -> None:
        p = self.pool
        assert p.free_queue() == self.queue
        assert [p.ref_count(b) for b in self.ref] == list(self.ref.values())
        assert min(self.ref.values()) >= 0
        assert p.num_free_blocks == len(self.queue) == sum(1 for r in self.ref.values() if not r)
        assert p.usage == 1 - len(self.queue) / (NUM_BLOCKS - 1)
        assert p.num_cached_blocks == len(self.cache)
        for (g, h), b in self.cache.items():
            assert p.get_cached_block(g, h) == b and p.block_hash(b) == h
        for b in self.ref:
            assert (p.block_hash(b) is None) == (b not in self.hash_of)
        assert p.ref_count(0) == 0  # the null block is never handed out
        # The live entries of the uncached stack are uncached (allocate relies on it).
        pending = p._stale[:]
        for b in reversed(p._front):
            if pending[b]:
                pending[b] -= 1
            else:
                assert p.block_hash(b) is None, f"cached block {b} on the uncached stack"


PoolMachine.TestCase.settings = settings(
    max_examples=hypothesis_examples(40),
    stateful_step_count=hypothesis_steps(120),
    deadline=None,
)
TestPoolMachine = PoolMachine.TestCase


def test_touch_of_a_free_block_then_refree_keeps_lru_order() -> None:
    # The lazy-deletion queue: touching a free block leaves a stale entry that must be skipped.
    pool = BlockPool(5)
    ids = pool.allocate(4)
    for b in ids:
        pool.cache_block(0, b, bytes([b]))
    pool.free(ids)  # cached: to the back, queue 1 2 3 4
    pool.touch([2])  # queue 1 3 4 (a stale entry for 2)
    pool.free([2])  # queue 1 3 4 2
    assert pool.free_queue() == [1, 3, 4, 2]
    assert pool.allocate(4) == [1, 3, 4, 2]
    assert pool.num_free_blocks == 0 and pool.num_cached_blocks == 0  # all evicted


def test_uncached_blocks_are_reused_first() -> None:
    pool = BlockPool(6)
    ids = pool.allocate(5)
    pool.cache_block(0, ids[0], b"a")
    pool.cache_block(0, ids[1], b"b")
    pool.free(ids[::-1])  # a request frees tail first: 5 4 3 uncached, 2 1 cached
    assert pool.free_queue() == [5, 4, 3, 2, 1]
    pool.touch([4])  # an uncached free block touched (public API), then freed again
    pool.free([4])
    assert pool.free_queue() == [4, 5, 3, 2, 1]
    assert pool.allocate(3) == [4, 5, 3] and pool.num_cached_blocks == 2


def test_queue_compaction_keeps_order() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    for b in ids:
        pool.cache_block(0, b, bytes([b]))
    pool.free(ids)
    for _ in range(20):  # many touch/free cycles: stale entries pile up, then get compacted
        pool.touch([1])
        pool.free([1])
    assert len(pool._front) + len(pool._back) <= 2 * pool.num_blocks
    assert pool.free_queue() == [2, 3, 1]
    # Compaction must not move cached blocks onto the uncached stack (whose blocks are handed
    # out without an eviction check): the next allocation evicts block 2's hash.
    assert pool.allocate(1) == [2]
    assert pool.block_hash(2) is None and pool.num_cached_blocks == 2
