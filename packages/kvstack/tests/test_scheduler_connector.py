"""The scheduler with a KV connector, over a real ``KVCacheManager`` and a fake model (no torch).

The fake cache stores token ids; a fake tier (``FakeTier``, a ``SchedulerConnector``) stores the
blocks of finished requests under their block hashes and loads them back, in-step or
asynchronously, sometimes failing some blocks (which then hold junk). Before every chunk the
request's blocks must hold exactly its tokens for every position before the chunk (what attention
reads), so a load counted before it landed, a failed block not recomputed, a loaded block entered
into the prefix cache before it was verified, or blocks freed under a transfer fail here. Outputs
must equal a run with no contention and no tier.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_blocktable import KVCacheManager, Request
from kv_spec import FullAttentionSpec, plan_kv_cache
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.scheduler import Scheduler, Sequence

VOCAB = 97
MAX_MODEL_LEN = 64
JUNK = -1
EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "40"))


def fake_next(tokens: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(tokens)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_next(toks))
    return toks[len(prompt) :]


@dataclass
class Load:
    seq: Sequence
    hit: int
    block_ids: list[int]
    tokens: list[list[int]]  # what each block should hold
    failed: int  # index of the first failed block (len: none failed)
    lands_in: int = 0  # async: steps until it lands


@dataclass
class FakeTier:
    """A block-hash store with in-step and asynchronous loads, failures and delayed frees."""

    block_size: int
    rng: random.Random
    scheduler: Scheduler | None = None
    store: dict[bytes, list[int]] = field(default_factory=dict)
    step_loads: list[Load] = field(default_factory=list)
    async_loads: list[Load] = field(default_factory=list)
    sending: dict[str, int] = field(default_factory=dict)  # request -> steps until sent
    asyncs: bool = False
    #: The fake KV cache: block id -> {offset: token id} (outlives a ``run``, as the pool does).
    cache: dict[int, dict[int, int]] = field(default_factory=dict)

    def match(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        assert self.scheduler is not None
        if seq.kv.block_hasher is None:  # (prefix caching off: the engine's driver binds it too)
            seq.kv.bind_hasher(self.scheduler.kv.hasher)
        bs = self.block_size
        first = num_computed_tokens // bs
        hits = 0
        for h in seq.kv.block_hashes[first:]:
            if h not in self.store:
                break
            hits += 1
        self.asyncs = self.rng.random() < 0.5
        return hits * bs, self.asyncs

    def allocated(self, seq: Sequence, block_ids: list[int], ext: int, load_async: bool) -> None:
        if not ext:
            return
        assert self.scheduler is not None
        bs = self.block_size
        hit = self.scheduler.kv.num_computed_tokens(seq.request_id)  # only the local hit, yet
        first, n = hit // bs, ext // bs
        hashes = seq.kv.block_hashes[first : first + n]
        failed = self.rng.choice([n, n, n, self.rng.randrange(n)])
        load = Load(seq, hit, block_ids[first : first + n], [self.store[h] for h in hashes], failed)
        if load_async:
            load.lands_in = self.rng.randrange(3)
            self.async_loads.append(load)
        else:
            self.step_loads.append(load)

    def finished(self, seq: Sequence) -> bool:
        bs = self.block_size
        n = seq.num_computed_tokens // bs  # only blocks whose every slot was computed
        for i, h in enumerate(seq.kv.block_hashes[:n]):
            self.store[h] = seq.token_ids[i * bs : (i + 1) * bs]
        if self.rng.random() < 0.5:
            self.sending[seq.request_id] = self.rng.randrange(3)
            return True
        return False


def _write(cache: dict[int, dict[int, int]], load: Load, bs: int) -> int:
    """Land ``load`` in the fake cache (junk from its first failed block); the tokens it keeps."""
    for i, (b, toks) in enumerate(zip(load.block_ids, load.tokens, strict=True)):
        cache[b] = {j: (t if i < load.failed else JUNK) for j, t in enumerate(toks)}
    return load.hit + load.failed * bs


def run(sched: Scheduler, tier: FakeTier, seqs: list[Sequence]) -> None:
    bs = tier.block_size
    cache = tier.cache
    for s in seqs:
        sched.add(s)
    step = 0
    while sched.has_unfinished or sched.has_pending_kv:
        out = sched.schedule()
        assert len(sched.running) + len(sched.loading) <= sched.max_num_seqs
        failed: dict[str, int] = {}
        for load in tier.step_loads:  # loads inside this step's forward
            kept = _write(cache, load, bs)
            if load.failed < len(load.block_ids):
                failed[load.seq.request_id] = kept
        tier.step_loads.clear()
        sampled = []
        for c in out.chunks:
            seq = c.seq
            [blocks] = sched.kv.get_block_ids(seq.kv)
            rid = seq.request_id
            if rid not in failed:
                for pos in range(c.start):  # what attention reads
                    assert cache[blocks[pos // bs]][pos % bs] == seq.token_ids[pos], (rid, pos)
            for pos in range(c.start, c.end):  # (computed over junk when its load failed)
                value = JUNK if rid in failed else seq.token_ids[pos]
                cache.setdefault(blocks[pos // bs], {})[pos % bs] = value
            if c.samples and rid not in failed:
                sampled.append((seq, fake_next(seq.token_ids)))
        for c in out.chunks:
            if c.seq.request_id in failed:
                sched.rewind(c.seq, failed[c.seq.request_id])
        sched.update(out, sampled)
        for load in list(tier.async_loads):  # asynchronous loads land between steps
            if load.lands_in == 0:
                tier.async_loads.remove(load)
                sched.kv_loaded(load.seq.request_id, _write(cache, load, bs))
            else:
                load.lands_in -= 1
        for rid, left in list(tier.sending.items()):
            if left == 0:
                del tier.sending[rid]
                sched.kv_sent(rid)
            else:
                tier.sending[rid] = left - 1
        step += 1
        assert step < 3000, "the scheduler made no progress"


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Scheduler, FakeTier, list[list[Sequence]]]:
    bs = draw(st.sampled_from([2, 4, 8]))
    need = MAX_MODEL_LEN // bs
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype="float32")
    blocks = draw(st.integers(need + 1, 2 * need))
    cfg = plan_kv_cache({"l0": spec}, blocks * spec.page_size_bytes, max_model_len=MAX_MODEL_LEN)
    tier = FakeTier(bs, random.Random(draw(st.integers(0, 2**16))))
    # Without the pool's prefix cache every reuse comes from the tier (loads, failures); with
    # it the tier serves what the pool evicted.
    sched = Scheduler(
        KVCacheManager(cfg, enable_prefix_caching=draw(st.booleans())),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        max_num_seqs=draw(st.integers(1, 4)),
        max_model_len=MAX_MODEL_LEN,
        connector=tier,
    )
    prefix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=24))
    rounds = []
    for r in range(2):  # the second round finds the first round's blocks in the tier
        batch = []
        for i in range(draw(st.integers(1, 4))):
            tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16))
            prompt = prefix + tail
            params = SamplingParams(max_new_tokens=draw(st.integers(1, 8)))
            batch.append(Sequence(Request(f"r{r}-{i}", prompt), params, prompt_len=len(prompt)))
        rounds.append(batch)
    return sched, tier, rounds


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_connector_loads_failures_and_delayed_frees_feed_every_token_right(
    case: tuple[Scheduler, FakeTier, list[list[Sequence]]],
) -> None:
    sched, tier, rounds = case
    for batch in rounds:
        prompts = {s.request_id: list(s.token_ids) for s in batch}
        run(sched, tier, batch)
        for s in batch:
            assert s.output_token_ids == reference(prompts[s.request_id], s.params.max_new_tokens)
    assert sched.kv.usage == 0.0 and not sched.sending and not sched.loading


def test_the_tier_serves_a_second_round() -> None:
    """A deterministic case of the property: round two's prompts hit the tier."""
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32")
    cfg = plan_kv_cache({"l0": spec}, 40 * spec.page_size_bytes, max_model_len=MAX_MODEL_LEN)
    tier = FakeTier(4, random.Random(1))
    kv = KVCacheManager(cfg, enable_prefix_caching=False)  # every hit is the tier's
    sched = Scheduler(
        kv, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, connector=tier
    )
    prompt = list(range(1, 22))  # 5 full blocks + 1 token
    for r in range(2):
        seq = Sequence(Request(f"r{r}", prompt), SamplingParams(max_new_tokens=3), prompt_len=21)
        run(sched, tier, [seq])
        assert seq.output_token_ids == reference(prompt, 3)
    assert sched.stats.external_hit_tokens == 20 and sched.stats.prefix_hit_tokens == 0
