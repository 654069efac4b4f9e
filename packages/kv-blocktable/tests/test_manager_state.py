"""KVCacheManager state machines, one per plan in ``_configs.CONFIGS`` (each group kind, hybrids).

Requests draw prompts from a few shared prefixes over a tiny alphabet (so prefixes collide often)
and are admitted with their prefix hit, prefilled in chunks, decoded token by token, preempted,
resumed, finished; the prefix cache is reset now and then. After every step the invariants hold:

- ref counts: each block's count equals the number of (request, group) lists holding it; none < 0;
- the free blocks are exactly the unheld ones, ``usage`` is exact, nothing leaks at the end;
- block ``j`` of a group is 0 (dropped) exactly when a window/chunk no longer needs it, and the list
  is as long as the slots asked for;
- a cached block is held only at a position whose whole prefix (tokens and extra keys) equals the
  prefix it was cached with — checked on the tokens, independently of the hashes;
- ``None`` from ``allocate_slots`` on admission changes nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_blocktable import ExtraKeys, KVCacheManager, PrefixCacheBusyError, Request
from kv_spec import KVCacheConfig, cdiv

from ._configs import CONFIGS
from .conftest import hypothesis_examples, hypothesis_steps

PREFIXES = [[], [1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 1, 2, 3, 1, 2, 3, 3, 3, 3, 1, 1, 1, 1, 2]]
SALTS = [None, ExtraKeys(cache_salt="tenant-b"), ExtraKeys(lora_name="adapter")]


class ManagerMachine(RuleBasedStateMachine):
    CONFIG: KVCacheConfig

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(self.CONFIG, enable_events=True)
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.computed: dict[str, int] = {}
        self.last_computed: dict[str, int] = {}  # computed count at the last allocate_slots
        self.slots: dict[str, int] = {}  # most tokens (incl. lookahead) given slots
        #: (group, block) -> (hash, prefix tokens, extra keys) it was cached with.
        self.content: dict[tuple[int, int], tuple[bytes, tuple[int, ...], ExtraKeys | None]] = {}
        self.counter = 0
        self.hits = 0

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        tail=st.lists(st.integers(1, 3), max_size=12),
        extra=st.sampled_from(SALTS),
    )
    def new_request(self, prefix: int, tail: list[int], extra: ExtraKeys | None) -> None:
        tokens = PREFIXES[prefix] + tail
        if not tokens:
            tokens = [1]
        self.counter += 1
        self.waiting[f"r{self.counter}"] = Request(f"r{self.counter}", tokens, extra)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24), lookahead=st.integers(0, 2))
    def admit(self, data: st.DataObject, chunk: int, lookahead: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        req = self.waiting[rid]
        hit, n_hit = self.mgr.get_computed_blocks(req)
        self._check_hit(req, hit.blocks, n_hit)
        mml = self.CONFIG.max_model_len
        assert mml is not None
        if req.num_tokens > mml:
            del self.waiting[rid]
            return
        new = min(chunk, req.num_tokens - n_hit)
        lookahead = min(lookahead, mml - n_hit - new)
        before = self._snapshot()
        out = self.mgr.allocate_slots(req, new, n_hit, hit, lookahead)
        if out is None:
            assert self._snapshot() == before, "a refused admission changed the pool"
            return
        self.hits += n_hit > 0
        del self.waiting[rid]
        self.running[rid] = req
        self.last_computed[rid] = n_hit
        self.computed[rid] = n_hit + new
        self.slots[rid] = n_hit + new + lookahead
        self._check_new_blocks(rid, out.get_block_ids(), [len(h) for h in hit.blocks])

    @precondition(lambda self: self.running)
    @rule(
        data=st.data(),
        chunk=st.integers(1, 10),
        token=st.integers(1, 3),
        lookahead=st.integers(0, 2),
    )
    def step(self, data: st.DataObject, chunk: int, token: int, lookahead: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        mml = self.CONFIG.max_model_len
        assert mml is not None
        computed = self.computed[rid]
        if computed == req.num_tokens:  # decode: the sampled token arrives, then one slot
            if req.num_tokens + 1 > mml:
                return
            req.append_token_ids(token)
        new = min(chunk, req.num_tokens - computed)
        lookahead = min(lookahead, mml - computed - new)
        held_before = self.mgr.get_block_ids(rid)
        out = self.mgr.allocate_slots(req, new, num_lookahead_tokens=lookahead)
        self.last_computed[rid] = computed
        if out is None:
            after = self.mgr.get_block_ids(rid)
            assert [len(x) for x in after] == [len(x) for x in held_before]
            return
        self.computed[rid] = computed + new
        self.slots[rid] = max(self.slots[rid], computed + new + lookahead)
        self._check_new_blocks(rid, out.get_block_ids(), [len(h) for h in held_before])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data: st.DataObject, preempt: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.mgr.free(req)
        for d in (self.computed, self.last_computed, self.slots):
            del d[rid]
        if preempt:  # resumed later through admit, with its outputs as part of the prompt
            self.waiting[rid] = req
        with pytest.raises(ValueError, match="holds no blocks"):
            self.mgr.get_block_ids(rid)

    @rule()
    def reset_prefix_cache(self) -> None:
        if self.running:
            with pytest.raises(PrefixCacheBusyError, match="held by running requests"):
                self.mgr.reset_prefix_cache()
        else:
            assert self.mgr.reset_prefix_cache() is True
            assert self.mgr.pool.num_cached_blocks == 0

    # -- checks --------------------------------------------------------------------------------

    def _snapshot(self) -> tuple[list[int], list[int], int]:
        pool = self.mgr.pool
        return list(pool._ref), pool.free_queue(), pool.num_cached_blocks

    def _check_hit(self, req: Request, hit: tuple[tuple[int, ...], ...], n_hit: int) -> None:
        assert 0 <= n_hit < max(req.num_tokens, 1)
        for g, (m, blocks) in enumerate(zip(self.mgr.managers, hit, strict=True)):
            assert len(blocks) * m.block_size == n_hit
            for j, b in enumerate(blocks):
                if b:
                    h = self.mgr.pool.block_hash(b)
                    want = (h, tuple(req.token_ids[: (j + 1) * m.block_size]), req.extra_keys)
                    assert self.content.get((g, b)) == want, (
                        "cached block reused for another prefix"
                    )

    def _check_new_blocks(self, rid: str, new: tuple[list[int], ...], start: list[int]) -> None:
        """The returned blocks are exactly the fresh ones appended after position ``start[g]``."""
        now = self.mgr.get_block_ids(rid)
        for g, ids in enumerate(new):
            assert ids == [b for b in now[g][start[g] :] if b]

    @invariant()
    def pool_matches_requests(self) -> None:
        mgr, pool = self.mgr, self.mgr.pool
        holders = [0] * pool.num_blocks
        for rid, req in self.running.items():
            lists = mgr.get_block_ids(rid)
            for g, (m, blocks) in enumerate(zip(mgr.managers, lists, strict=True)):
                bs = m.block_size
                assert len(blocks) == cdiv(self.slots[rid], bs)
                dropped = m.num_skipped_tokens(self.last_computed[rid]) // bs
                for j, b in enumerate(blocks):
                    assert (b == 0) == (j < dropped), (g, j, blocks, dropped)
                    if b:
                        holders[b] += 1
                        h = pool.block_hash(b)
                        if h is not None:
                            assert h == req.block_hashes[(j + 1) * m.hash_ratio - 1]
                            want = (h, tuple(req.token_ids[: (j + 1) * bs]), req.extra_keys)
                            got = self.content.get((g, b))
                            if got is None or got[0] != h:  # newly cached (maybe re-cached)
                                self.content[(g, b)] = want
                            else:
                                assert got == want, "a cached block is held for another prefix"
        assert holders[0] == 0
        assert pool._ref == holders, "ref counts differ from the holders"
        free = sorted(b for b in range(1, pool.num_blocks) if not holders[b])
        assert sorted(pool.free_queue()) == free
        assert pool.num_free_blocks == len(free)
        assert mgr.usage == 1 - len(free) / (pool.num_blocks - 1)
        # Forget the content of blocks that left the cache (evicted or reset).
        self.content = {k: v for k, v in self.content.items() if pool.block_hash(k[1]) == v[0]}

    def teardown(self) -> None:
        for req in self.running.values():
            self.mgr.free(req)
        pool = self.mgr.pool
        assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"
        assert self.mgr.usage == 0.0
        assert self.mgr.num_running_requests == 0


def _machine_test(name: str) -> type:
    cls = type(f"Machine_{name}", (ManagerMachine,), {"CONFIG": CONFIGS[name]})
    case = cls.TestCase
    case.settings = settings(
        max_examples=hypothesis_examples(25),
        stateful_step_count=hypothesis_steps(80),
        deadline=None,
    )
    return case


TestFull = _machine_test("full")
TestMLA = _machine_test("mla")
TestSliding = _machine_test("sliding")
TestSlidingWindow1 = _machine_test("sliding_w1")
TestChunked = _machine_test("chunked")
TestChunkedUnaligned = _machine_test("chunked_unaligned")
TestHybrid = _machine_test("full+sliding")
TestHybridBlockSizes = _machine_test("full+sliding(bs8)")
TestHybrid3 = _machine_test("full+chunked+sliding")
