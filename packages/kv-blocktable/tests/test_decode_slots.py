"""``KVCacheManager.allocate_decode_slots`` against the loop of ``allocate_slots`` it replaces
(issue 32): two managers over the same plan run the same random steps, one a call per request,
one a call per batch, and must agree on everything — the blocks handed out (and to whom), the
point where the pool runs out, the counts, the prefix cache, the events, and every error."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_blocktable import DecodeSlots, KVCacheManager, Request

from ._configs import CONFIGS, full, plan

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "0"))
# One full-attention group (the batched fast path) besides every hybrid and window kind.
PLANS = {
    # Small pools: a batch often runs the pool dry part way.
    "one full group": plan({"l0": full()}, 12, max_model_len=24),
    "one full group, bs 8": plan({"l0": full(bs=8)}, 8, max_model_len=40),
    "one full group, 40 blocks": plan({"l0": full()}, 40, max_model_len=40),
    **CONFIGS,
}


def loop(mgr: KVCacheManager, reqs: list[object], n: int) -> object:
    """What allocate_decode_slots promises, written as the caller's loop."""
    rows, ids, counts = [], [], []
    for i, req in enumerate(reqs):
        try:
            got = mgr.allocate_slots(req, n)  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            return ("error", i, type(e).__name__, str(e), rows, ids, counts)
        if got is None:
            return DecodeSlots(i, rows, ids, counts)
        if got:
            rows.append(i)
            ids.append(got.get_block_ids())
        counts.append(mgr.num_computed_tokens(req.request_id))  # type: ignore[attr-defined]
    return DecodeSlots(len(reqs), rows, ids, counts)


def batched(mgr: KVCacheManager, reqs: list[object], n: int) -> object:
    # The error case reports what the loop had done before it, read back from the manager.
    try:
        return mgr.allocate_decode_slots(reqs, n)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        return ("error", type(e).__name__, str(e))


def state(mgr: KVCacheManager, names: list[str]) -> object:
    running = {r: mgr.get_block_ids(r) for r in names if r in mgr._computed}
    return (
        running,
        dict(mgr._computed),
        mgr.pool.free_queue(),
        [dict(c) for c in mgr.pool._cache],
        mgr.take_events(),
    )


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, object]:
    name = draw(st.sampled_from(sorted(PLANS)))
    num = draw(st.integers(1, 6))
    prompts = [
        draw(st.lists(st.integers(0, 3), min_size=1, max_size=14)) for _ in range(num)
    ]  # small vocabulary: prompts share prefixes, so the prefix cache is hit
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(("decode", "decode", "decode", "free", "odd")))
        steps.append(
            (
                kind,
                draw(st.lists(st.integers(0, num - 1), max_size=num + 1)),
                draw(st.sampled_from((1, 1, 1, 0, 2, 3))),
                draw(st.integers(0, 3)),
            )
        )
    return {
        "plan": name,
        "prompts": prompts,
        "steps": steps,
        "caching": draw(st.booleans()),
        "events": draw(st.booleans()),
    }


def _admit(mgr: KVCacheManager, req: Request) -> bool:
    hit, n = mgr.get_computed_blocks(req)
    return mgr.allocate_slots(req, req.num_tokens - n, n, hit) is not None


@settings(
    max_examples=EXAMPLES or 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario())
def test_batched_decode_allocation_equals_the_loop(case: dict[str, object]) -> None:
    cfg = PLANS[case["plan"]]  # type: ignore[index]
    mgrs = [
        KVCacheManager(cfg, enable_prefix_caching=case["caching"], enable_events=case["events"])  # type: ignore[arg-type]
        for _ in range(2)
    ]
    prompts: list[list[int]] = case["prompts"]  # type: ignore[assignment]
    names = [f"r{i}" for i in range(len(prompts))]
    reqs = [[Request(nm, p) for nm, p in zip(names, prompts, strict=True)] for _ in mgrs]
    for i in range(len(prompts)):
        assert _admit(mgrs[0], reqs[0][i]) == _admit(mgrs[1], reqs[1][i])
    for kind, picks, n, tok in case["steps"]:  # type: ignore[attr-defined]
        if kind == "free":
            for m, rs in zip(mgrs, reqs, strict=True):
                for i in set(picks):
                    if rs[i].request_id in m._computed:
                        # by id: an odd step may have admitted a stranger under a freed id
                        m.free(rs[i].request_id)
            continue
        batches = []
        for rs in reqs:
            batch: list[object] = [rs[i] for i in picks]
            if kind == "odd" and batch:  # junk, a stranger with a running id, a new request
                batch.insert(
                    tok % (len(batch) + 1), ["x", Request("r0", [1]), Request("new", [2])][tok % 3]
                )
            batches.append(batch)
        for rs in reqs:  # the sampled tokens of the last step
            for i in set(picks):
                rs[i].append_token_ids(tok)
        want = loop(mgrs[0], batches[0], n)
        got = batched(mgrs[1], batches[1], n)
        if isinstance(want, tuple) and want[0] == "error":
            assert isinstance(got, tuple) and got[0] == "error", (want, got)
            assert got[1:] == want[2:4]
        else:
            assert got == want
        assert state(mgrs[0], [*names, "new"]) == state(mgrs[1], [*names, "new"])


def test_decode_slots_by_example() -> None:
    mgr = KVCacheManager(plan({"l0": full(bs=4)}, 6, max_model_len=20))
    a, b = Request("a", [1, 2, 3, 4]), Request("b", [5, 6, 7])
    assert _admit(mgr, a) and _admit(mgr, b)  # a: block 1, b: block 2
    a.append_token_ids(9)
    b.append_token_ids(9)
    got = mgr.allocate_decode_slots([a, b])
    assert got == DecodeSlots(2, [0], [([3],)], [5, 4])  # a crossed into a new block
    for r in (a, b):
        r.append_token_ids([9, 9, 9, 9])
    # 2 blocks free: b needs one more (8 tokens), a needs one (9 tokens) — then the pool is
    # dry for the third request in the list, a again.
    got = mgr.allocate_decode_slots([b, a, a], 4)
    assert got.num_scheduled == 2 and got.rows == [0, 1] and got.num_computed_tokens == [8, 9]


def test_decode_slots_bad_input() -> None:
    mgr = KVCacheManager(plan({"l0": full(bs=4)}, 6, max_model_len=8))
    a = Request("a", [1, 2, 3])
    assert _admit(mgr, a)
    with pytest.raises(TypeError, match="requests is a generator"):
        mgr.allocate_decode_slots(r for r in [a])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_new_tokens=1.0 must be an int"):
        mgr.allocate_decode_slots([a], 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request is a str"):
        mgr.allocate_decode_slots([a, "a"])  # type: ignore[list-item]
    assert mgr.num_computed_tokens("a") == 4  # the request before the bad one got its slot
    with pytest.raises(ValueError, match="exceeds max_model_len=8"):
        mgr.allocate_decode_slots([a], 5)
    with pytest.raises(ValueError, match="another request with id 'a' is running"):
        mgr.allocate_decode_slots([Request("a", [1])])


@pytest.mark.parametrize("max_model_len", [6, 7, 8])
def test_decode_slots_refuse_a_token_past_max_model_len_inside_a_block(max_model_len: int) -> None:
    """A count inside a block skips the row lookup; the length check must still run where
    max_model_len is not a multiple of the block size (6, 7 with 4-token blocks: the request
    sits at max_model_len mid-block), and at the boundary where it is (8)."""
    mgr = KVCacheManager(plan({"l0": full(bs=4)}, 8, max_model_len=max_model_len))
    a, b = Request("a", [1] * 3), Request("b", list(range(max_model_len)))
    assert _admit(mgr, a) and _admit(mgr, b)
    for r in (a, b):
        r.append_token_ids(5)
    with pytest.raises(ValueError, match=f"exceeds max_model_len={max_model_len}"):
        mgr.allocate_decode_slots([a, b])
    assert mgr.num_computed_tokens("a") == 4  # the request before it got its slot, as the loop
    assert mgr.num_computed_tokens("b") == max_model_len


@pytest.mark.parametrize("tokens_first", [True, False])
def test_decode_marks_step_by_step_equal_the_loop(tokens_first: bool) -> None:
    """Many one-token steps of a few requests, the prefix cache on: the batched call skips the
    checks of a request under its mark (``_kv_due``), and every step must still hand out and
    cache what the loop does — on the step the loop does it. ``tokens_first=False`` allocates
    before the sampled token is appended (the known tokens lag the computed ones, so a block is
    cached a step after it is computed)."""
    cfg = plan({"l0": full(bs=4)}, 64, max_model_len=64)
    mgrs = [KVCacheManager(cfg) for _ in range(2)]
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5], [7] * 8]
    reqs = [[Request(f"r{i}", p) for i, p in enumerate(prompts)] for _ in mgrs]
    for m, rs in zip(mgrs, reqs, strict=True):
        assert all(_admit(m, r) for r in rs)
    names = [r.request_id for r in reqs[0]]
    for step in range(40):
        if tokens_first:
            for rs in reqs:
                for r in rs:
                    r.append_token_ids(step % 3)
        want = loop(mgrs[0], reqs[0], 1)
        got = batched(mgrs[1], reqs[1], 1)
        assert got == want, step
        assert state(mgrs[0], names) == state(mgrs[1], names), step
        if not tokens_first:
            for rs in reqs:
                for r in rs:
                    r.append_token_ids(step % 3)


def test_a_readmitted_request_starts_without_a_mark() -> None:
    """A request that ran long (its mark far ahead), freed and admitted again with a shorter
    row (a chunk of its tokens), must get a block where the new row ends, not where the old
    one did."""
    mgr = KVCacheManager(
        plan({"l0": full(bs=4)}, 32, max_model_len=64), enable_prefix_caching=False
    )
    a = Request("a", [1] * 16)
    assert _admit(mgr, a)
    for _ in range(6):
        a.append_token_ids(2)
        assert mgr.allocate_decode_slots([a]).num_scheduled == 1
    assert a._kv_due > 8
    mgr.free(a)
    assert mgr.allocate_slots(a, 4) is not None  # the first block's tokens only
    got = mgr.allocate_decode_slots([a])
    assert got.rows == [0] and len(mgr.get_block_ids(a)[0]) == 2
    assert got.num_computed_tokens == [5]


@pytest.mark.parametrize("max_model_len", [6, 7])
def test_decode_marks_stop_at_max_model_len(max_model_len: int) -> None:
    """Steps under the mark skip the length check, so the mark must not pass max_model_len:
    one token at a time up to it, then the error, as the loop gives it."""
    mgr = KVCacheManager(plan({"l0": full(bs=4)}, 8, max_model_len=max_model_len))
    a = Request("a", [1] * 4)
    assert _admit(mgr, a)
    for count in range(5, max_model_len + 1):
        a.append_token_ids(3)
        assert mgr.allocate_decode_slots([a]).num_computed_tokens == [count]
    a.append_token_ids(3)
    with pytest.raises(ValueError, match=f"exceeds max_model_len={max_model_len}"):
        mgr.allocate_decode_slots([a])
    assert mgr.num_computed_tokens("a") == max_model_len
