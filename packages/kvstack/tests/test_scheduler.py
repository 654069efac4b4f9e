"""The scheduler over a real ``KVCacheManager``, with a fake model: no torch, fast.

The fake KV cache stores token ids: when a chunk is computed, each of its tokens is written into
its block at its offset. Before every chunk we check that the request's block ids hold exactly its
tokens for every position before the chunk (what attention would read), so a wrong prefix hit, a
chunk that skips or repeats tokens, or a resume from the wrong blocks fails here. The fake model's
next token is a hash of the whole sequence, so the outputs are fixed by the prompts alone and
must equal a run with no contention.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_blocktable import KVCacheManager, Request
from kv_spec import FullAttentionSpec, plan_kv_cache
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.scheduler import FinishReason, Scheduler, Sequence, Status

VOCAB = 97
MAX_MODEL_LEN = 64
EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "60"))


def fake_next(tokens: Seq[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(tokens)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_next(toks))
    return toks[len(prompt) :]


def make_scheduler(num_blocks: int, block_size: int, budget: int, max_seqs: int) -> Scheduler:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32")
    page = spec.page_size_bytes
    cfg = plan_kv_cache({"l0": spec}, num_blocks * page, max_model_len=MAX_MODEL_LEN)
    return Scheduler(
        KVCacheManager(cfg),
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=MAX_MODEL_LEN,
    )


def new_seq(rid: str, prompt: list[int], max_new: int) -> Sequence:
    return Sequence(
        Request(rid, prompt), SamplingParams(max_new_tokens=max_new), prompt_len=len(prompt)
    )


def run(sched: Scheduler, arrivals: list[tuple[int, Sequence]]) -> dict[str, Sequence]:
    """Step to completion, checking every chunk against the fake cache; returns the sequences."""
    bs = sched.kv.kv_cache_config.groups[0].spec.block_size
    cache: dict[int, dict[int, int]] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    done: dict[str, Sequence] = {}
    step = 0
    while pending or sched.has_unfinished:
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        out = sched.schedule()
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert len({c.seq.request_id for c in out.chunks}) == len(out.chunks)
        sampled = []
        for c in out.chunks:
            seq = c.seq
            assert c.num_new_tokens >= 1 and c.end <= seq.num_tokens
            assert seq.num_computed_tokens == c.end
            [blocks] = sched.kv.get_block_ids(seq.kv)
            assert len(blocks) * bs >= c.end
            for pos in range(c.start):  # what attention reads: the cache must hold these tokens
                assert cache[blocks[pos // bs]][pos % bs] == seq.token_ids[pos], (
                    seq.request_id,
                    pos,
                )
            for pos in range(c.start, c.end):
                cache.setdefault(blocks[pos // bs], {})[pos % bs] = seq.token_ids[pos]
            if c.samples:
                sampled.append((seq, fake_next(seq.token_ids)))
        for seq in sched.update(out, sampled):
            done[seq.request_id] = seq
        step += 1
        assert step < 2000, "the scheduler made no progress"
    return done


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Scheduler, list[tuple[int, Sequence]]]:
    block_size = draw(st.sampled_from([2, 4, 8]))
    need = MAX_MODEL_LEN // block_size
    num_blocks = draw(st.integers(need + 1, 3 * need))
    sched = make_scheduler(
        num_blocks, block_size, draw(st.integers(1, 40)), draw(st.integers(1, 6))
    )
    prefixes = [
        draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=20)) for _ in range(2)
    ]
    arrivals = []
    for i in range(draw(st.integers(1, 8))):
        prefix = prefixes[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        max_new = draw(st.integers(1, 12))
        arrivals.append((draw(st.integers(0, 8)), new_seq(str(i), prefix + tail, max_new)))
    return sched, arrivals


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_any_schedule_feeds_every_token_once_over_the_right_blocks(
    case: tuple[Scheduler, list[tuple[int, Sequence]]],
) -> None:
    sched, arrivals = case
    prompts = {s.request_id: list(s.token_ids) for _, s in arrivals}
    done = run(sched, arrivals)
    assert set(done) == set(prompts)
    for rid, seq in done.items():
        assert seq.status is Status.FINISHED and seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == reference(prompts[rid], seq.params.max_new_tokens)
    assert sched.kv.usage == 0.0  # every block went back


def test_preempted_request_resumes_from_a_prefix_hit() -> None:
    # 17 usable blocks of 4 tokens; three 30-token requests growing to 46 need 36 blocks.
    sched = make_scheduler(18, 4, budget=64, max_seqs=4)
    arrivals = [(0, new_seq(str(i), [i + 1] * 30, 16)) for i in range(3)]
    done = run(sched, arrivals)
    s = sched.stats
    assert s.num_preemptions >= 1 and s.num_resumes == s.num_preemptions
    assert s.resume_hit_tokens > 0  # the freed blocks were still cached when it came back
    assert sum(d.num_preemptions for d in done.values()) == s.num_preemptions


def test_shared_prompts_hit_the_prefix_cache() -> None:
    sched = make_scheduler(64, 4, budget=16, max_seqs=4)
    shared = list(range(1, 21))  # 20 tokens = 5 full blocks
    arrivals = [(0, new_seq("a", [*shared, 50], 2)), (3, new_seq("b", [*shared, 60, 61], 2))]
    done = run(sched, arrivals)
    assert done["a"].num_cached_prompt_tokens == 0
    assert done["b"].num_cached_prompt_tokens == 20
    assert sched.stats.prefix_hit_rate == pytest.approx(20 / (21 + 22))


def test_chunked_prefill_respects_the_budget_and_decodes_share_steps() -> None:
    sched = make_scheduler(64, 4, budget=8, max_seqs=4)
    sched.add(new_seq("short", [1, 2, 3], 6))
    first = sched.schedule()
    sched.update(first, [(first.chunks[0].seq, 7)])
    sched.add(new_seq("long", list(range(30)), 2))
    out = sched.schedule()
    # one decode of "short" plus 7 tokens of "long"'s 30-token prompt (the budget's rest)
    assert [(c.seq.request_id, c.start, c.num_new_tokens) for c in out.chunks] == [
        ("short", 3, 1), ("long", 0, 7),
    ]  # fmt: skip
    assert not out.chunks[1].samples


def test_bad_requests_are_refused_with_the_reason() -> None:
    sched = make_scheduler(64, 4, budget=8, max_seqs=4)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        sched.add(new_seq("x", [1] * 60, 5))
    with pytest.raises(ValueError, match="max_num_seqs=0 must be an int >= 1"):
        Scheduler(sched.kv, max_num_batched_tokens=8, max_num_seqs=0, max_model_len=64)
