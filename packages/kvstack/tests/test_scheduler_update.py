"""``Scheduler.update`` (one batched ``append_decode_tokens``, then the finish rules) against the
loop it replaced: append one sequence's token, check its stop ids and length, release it if it
finished, next sequence (issue 32). Two schedulers take the same random steps — stop tokens,
length limits, held blocks, a bad token id, a strict zip that runs short — one updated by the
old loop, and must agree on the finished sequences, every token list and block hash, the running
list, the KV manager's blocks and the error raised. A planted off-by-one in the finish rule is
caught by the same comparison.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_blocktable import KVCacheManager, Request
from kv_spec import FullAttentionSpec, plan_kv_cache
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.scheduler import (
    FinishReason,
    Scheduler,
    SchedulerOutput,
    Sequence,
    Status,
)

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "60"))
Update = Callable[[Scheduler, SchedulerOutput, Iterable[tuple[Sequence, int]]], list[Sequence]]


def loop_update(
    sched: Scheduler, output: SchedulerOutput, sampled: Iterable[tuple[Sequence, int]]
) -> list[Sequence]:
    """The update before the batched append, verbatim."""
    finished: list[Sequence] = []
    for seq, token in sampled:
        seq.kv.append_token_ids(token)
        if token in seq.stop_ids:
            seq.finish_reason = FinishReason.STOP
        elif seq.kv.num_tokens - seq.prompt_len >= seq.params.max_new_tokens:
            seq.finish_reason = FinishReason.LENGTH
        else:
            continue
        seq.status = Status.FINISHED
        sched._release(seq)
        finished.append(seq)
    if finished:
        done = {id(s) for s in finished}
        sched.running = [s for s in sched.running if id(s) not in done]
    return finished


def new_update(
    sched: Scheduler, output: SchedulerOutput, sampled: Iterable[tuple[Sequence, int]]
) -> list[Sequence]:
    return sched.update(output, sampled)


def off_by_one_update(
    sched: Scheduler, output: SchedulerOutput, sampled: Iterable[tuple[Sequence, int]]
) -> list[Sequence]:
    """A planted bug: the length rule read before the token is appended (one token late)."""
    pairs = list(sampled)
    finished = []
    for seq, token in pairs:
        if token in seq.stop_ids:
            seq.finish_reason = FinishReason.STOP
        elif seq.kv.num_tokens - seq.prompt_len >= seq.params.max_new_tokens:
            seq.finish_reason = FinishReason.LENGTH
        else:
            seq.kv.append_token_ids(token)
            continue
        seq.kv.append_token_ids(token)
        seq.status = Status.FINISHED
        sched._release(seq)
        finished.append(seq)
    if finished:
        done = {id(s) for s in finished}
        sched.running = [s for s in sched.running if id(s) not in done]
    return finished


def make(case: dict[str, Any]) -> tuple[Scheduler, list[Sequence]]:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32")
    cfg = plan_kv_cache({"l0": spec}, 64 * spec.page_size_bytes, max_model_len=64)
    sched = Scheduler(
        KVCacheManager(cfg), max_num_batched_tokens=256, max_num_seqs=16, max_model_len=64
    )
    seqs = []
    for i, (prompt, max_new, stops, hold) in enumerate(case["seqs"]):
        seq = Sequence(
            Request(f"r{i}", list(prompt)),
            SamplingParams(max_new_tokens=max_new),
            prompt_len=len(prompt),
            stop_ids=frozenset(stops),
            hold_blocks=hold,
        )
        sched.add(seq)
        seqs.append(seq)
    return sched, seqs


def snapshot(sched: Scheduler, seqs: list[Sequence]) -> list[object]:
    return [
        [
            (s.request_id, s.status, s.finish_reason, list(s.token_ids), list(s.kv.block_hashes))
            for s in seqs
        ],
        [s.request_id for s in sched.running],
        sorted(sched.held),
        {
            s.request_id: sched.kv.get_block_ids(s.kv)
            for s in seqs
            if s.request_id in sched.kv._computed
        },
        sched.kv.num_free_blocks,
    ]


def outcome(fn: Callable[[], list[Sequence]]) -> object:
    try:
        return ("ok", [s.request_id for s in fn()])
    except (TypeError, ValueError) as e:
        return (type(e).__name__, str(e))


def run(case: dict[str, Any], update: Update) -> list[Any]:
    """The case's steps through ``update``; the outcome and snapshot after every step."""
    sched, seqs = make(case)
    trace: list[object] = []
    for toks, shape in case["steps"]:
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        live = [c.seq for c in out.chunks if c.samples]
        pairs = [(s, toks[i % len(toks)]) for i, s in enumerate(live)]
        sampled: Iterable[tuple[Sequence, int]] = pairs
        if shape == "zip":
            sampled = zip([s for s, _ in pairs], [t for _, t in pairs], strict=True)
        elif shape == "short zip" and pairs:  # one token short: raises after the others
            sampled = zip([s for s, _ in pairs], [t for _, t in pairs][:-1], strict=True)
        got = outcome(lambda o=out, s=sampled: update(sched, o, s))  # type: ignore[misc]
        trace.append((got, snapshot(sched, seqs)))
        if trace[-1][0][0] != "ok":  # type: ignore[index]
            break  # the scheduler is left as the error left it (the same on both sides)
    return trace


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, Any]:
    token = st.integers(0, 9)
    seqs = [
        (
            draw(st.lists(token, min_size=1, max_size=9)),
            draw(st.integers(1, 6)),
            draw(st.lists(token, max_size=2)),
            draw(st.integers(0, 5)) == 0,
        )
        for _ in range(draw(st.integers(1, 6)))
    ]
    bad = st.sampled_from([True, 1.5, 2**63, "3"])
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        toks: list[object] = draw(st.lists(token, min_size=1, max_size=6))
        if draw(st.integers(0, 12)) == 0:
            toks[draw(st.integers(0, len(toks) - 1))] = draw(bad)
        steps.append((toks, draw(st.sampled_from(("list", "list", "list", "zip", "short zip")))))
    return {"seqs": seqs, "steps": steps}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario())
def test_update_equals_the_loop(case: dict[str, Any]) -> None:
    assert run(case, new_update) == run(case, loop_update)


CASE = {
    "seqs": [([1, 2, 3], 3, [7], False), ([4, 5], 2, [], False), ([6], 5, [], True)],
    "steps": [([1, 2, 3], "list")] * 2 + [([7, 1, 1], "zip"), ([1], "list")] * 3,
}


def test_update_by_example() -> None:
    trace = run(CASE, new_update)
    assert trace == run(CASE, loop_update)
    assert ("ok", ["r0"]) in [r[0] for r in trace]  # r0 hit its stop id


def test_a_planted_off_by_one_is_caught() -> None:
    assert run(CASE, off_by_one_update) != run(CASE, loop_update)


@pytest.mark.parametrize("bad", [True, 2**63, "3"])
def test_a_bad_token_leaves_what_the_loop_left(bad: object) -> None:
    case = {
        "seqs": [([1, 2, 3], 1, [], False), ([4, 5], 3, [], False), ([6], 3, [], False)],
        "steps": [([1, bad, 2], "list")],
    }
    got, want = run(case, new_update), run(case, loop_update)
    assert got == want
    assert "request 'r1'" in got[-1][0][1]
    # r0 appended and finished (its length) before the error; r2 untouched
    assert got[-1][1][0][0][2] == FinishReason.LENGTH


def test_a_short_zip_updates_the_pairs_it_gave_then_raises() -> None:
    case = {
        "seqs": [([1, 2, 3], 1, [], False), ([4, 5], 3, [], False), ([6], 3, [], False)],
        "steps": [([1, 2, 3], "short zip")],
    }
    got = run(case, new_update)
    assert got == run(case, loop_update)
    assert got[-1][0][0] == "ValueError" and "shorter" in got[-1][0][1]
    tokens = [s[3] for s in got[-1][1][0]]
    assert tokens == [[1, 2, 3, 1], [4, 5, 2], [6]]  # r0, r1 updated (r0 finished), r2 not
