"""Issue 28, the scheduler side: every public entry point refuses what a caller could get wrong —
values it would silently change, state it would let the caller corrupt — with a ValueError or
TypeError naming the field, the value and the bound, and a refused call changes nothing.

Property tests (hypothesis) per class of fault; ``KVSTACK_HYPOTHESIS_EXAMPLES`` runs more."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_blocktable import (
    BlockHasher,
    BlockPool,
    BlockRemoved,
    BlockStored,
    ExtraKeys,
    KVCacheBlocks,
    KVCacheManager,
    Request,
    encode_block,
    event_from_dict,
    events_from_json,
    hash_block_tokens,
)

from ._configs import CONFIGS, full, plan, sliding
from .conftest import hypothesis_examples

SETTINGS = settings(
    max_examples=hypothesis_examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

#: Values that are not ints but that Python would take as one somewhere (a float truncated, a
#: bool as 0 / 1, a digit string read char by char), and plain junk.
NOT_INTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.just(b"1"),
    st.lists(st.integers(), max_size=2),
)
NOT_HASHES = st.one_of(
    st.none(), st.just(bytearray(b"ab")), st.text(max_size=4), st.integers(), st.floats()
)


def pool_state(pool: BlockPool) -> tuple[object, ...]:
    return (
        list(pool._ref),
        list(pool._hash),
        list(pool._group),
        [dict(c) for c in pool._cache],
        pool.free_queue(),
        pool.num_free_blocks,
        pool.num_cached_blocks,
    )


def busy_pool() -> BlockPool:
    """12 blocks, 2 groups: held cached (1, 2), free cached (3, 4), free uncached (5, 6), held
    uncached (7, 8)."""
    pool = BlockPool(12, num_groups=2, enable_events=True)
    ids = pool.allocate(8)
    for i, b in enumerate(ids[:4]):
        pool.cache_block(i % 2, b, bytes([i + 1]) * 8)
    pool.free(ids[2:6])
    return pool


# -- silently changed values ---------------------------------------------------------------------


@SETTINGS
@given(
    good=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    bad=NOT_INTS.filter(lambda v: not isinstance(v, list)),
    at=st.integers(0, 4),
)
def test_a_token_id_is_never_changed(good: list[int], bad: object, at: int) -> None:
    tokens = [*good[:at], bad, *good[at:]]
    with pytest.raises(TypeError, match="token id") as e:
        Request("a", tokens)  # type: ignore[arg-type]
    assert repr(bad) in str(e.value)
    req = Request("a", list(good))
    with pytest.raises(TypeError, match="token"):
        req.append_token_ids(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token"):
        req.append_token_ids(tokens)  # type: ignore[arg-type]
    assert req.token_ids == good  # a refused append appends nothing
    for call in (
        lambda: encode_block(None, tokens),  # type: ignore[arg-type]
        lambda: hash_block_tokens(None, tokens),  # type: ignore[arg-type]
        lambda: BlockHasher(1).hash_blocks(tokens),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match=r"token_ids\[\d+\]"):
            call()


def test_a_str_is_not_read_as_digits() -> None:
    with pytest.raises(TypeError, match=r"token_ids='12' is a str"):
        Request("a", "12")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token_ids="):
        Request("a", 12)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token_ids='12' is a str"):
        BlockHasher(2).hash_blocks("12")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token_ids"):
        Request("a", [1]).append_token_ids("12")  # type: ignore[arg-type]


@SETTINGS
@given(t=st.one_of(st.integers(max_value=-(2**63) - 1), st.integers(min_value=2**63)))
def test_token_ids_past_int64_name_the_bound(t: int) -> None:
    with pytest.raises(ValueError, match=r"2\*\*63"):
        Request("a", [1, t])
    with pytest.raises(ValueError, match=r"token_ids\[1\].*int64"):
        encode_block(None, [1, t])  # was an OverflowError naming nothing


def test_hasher_arguments() -> None:
    h = BlockHasher(2)
    with pytest.raises(TypeError, match="parent_hash='ab' is a str"):
        h.hash_blocks([1, 2, 3, 4], parent_hash="ab", start_block=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_block=-1"):
        h.hash_blocks([1, 2], start_block=-1)
    with pytest.raises(TypeError, match="start_block=1.0"):
        h.hash_blocks([1, 2], parent_hash=b"x", start_block=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_block=0 has no parent"):
        h.hash_blocks([1, 2], parent_hash=b"x")
    with pytest.raises(TypeError, match="extra_keys is a dict"):
        h.hash_blocks([1, 2], {"cache_salt": "s"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a \\(kind, value\\) pair"):
        encode_block(None, [1], (("a", "b", "c"),))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BlockHasher"):
        Request("a", [1]).bind_hasher("sha256")  # type: ignore[arg-type]
    # the unchecked inner path gives the same chain as the checked one
    req = Request("a", list(range(8)), ExtraKeys(cache_salt="s"), block_hasher=h)
    assert req.block_hashes == h.hash_blocks(list(range(8)), ExtraKeys(cache_salt="s"))


# -- the pool: state the caller could corrupt ------------------------------------------------------


@SETTINGS
@given(bad_hash=NOT_HASHES, group=st.sampled_from([0, 1]))
def test_cache_block_refuses_a_hash_that_is_not_bytes(bad_hash: object, group: int) -> None:
    pool = busy_pool()
    held = next(b for b in range(1, 12) if pool.ref_count(b) and pool.block_hash(b) is None)
    before = pool_state(pool)
    with pytest.raises((TypeError, ValueError), match="block_hash=") as e:
        pool.cache_block(group, held, bad_hash)  # type: ignore[arg-type]
    assert repr(bad_hash) in str(e.value)
    assert pool_state(pool) == before
    with pytest.raises((TypeError, ValueError), match="block_hash="):
        pool.get_cached_block(group, bad_hash)  # type: ignore[arg-type]


def test_a_none_hash_cannot_keep_a_reused_block_findable() -> None:
    # The reported bug: cache_block(0, b, None) entered b under None; b's hash stayed None, so
    # eviction never removed the entry and get_cached_block(0, None) found b under its next owner.
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    with pytest.raises(TypeError, match="block_hash=None"):
        pool.cache_block(0, b, None)  # type: ignore[arg-type]
    pool.free([b])
    assert pool.allocate(3)[0] == b and pool._cache == [{}]


#: cache_block's fast path takes a bool id / group as the index it equals (0 / 1): checking
#: every call's types costs more than the 5% the pool's figures may lose (see pool.py).
NOT_INT_INDICES = NOT_INTS.filter(lambda v: not isinstance(v, bool))


@SETTINGS
@given(
    block_id=st.one_of(st.integers(-3, 0), st.integers(12, 15), NOT_INT_INDICES),
    group=st.sampled_from([0, 1]),
)
def test_cache_block_refuses_ids_outside_the_pool(block_id: object, group: int) -> None:
    pool = busy_pool()
    before = pool_state(pool)
    with pytest.raises((TypeError, ValueError), match=r"block id|block 0|null block") as e:
        pool.cache_block(group, block_id, b"\x99" * 8)  # type: ignore[arg-type]
    assert "BlockPool.cache_block" in str(e.value)
    assert pool_state(pool) == before


@SETTINGS
@given(group=st.one_of(st.integers(-3, -1), st.integers(2, 5), NOT_INT_INDICES))
def test_a_group_index_is_checked(group: object) -> None:
    pool = busy_pool()
    held = next(b for b in range(1, 12) if pool.ref_count(b) and pool.block_hash(b) is None)
    before = pool_state(pool)
    for call in (
        lambda: pool.cache_block(group, held, b"\x99" * 8),  # type: ignore[arg-type]
        lambda: pool.get_cached_block(group, b"\x01" * 8),  # type: ignore[arg-type]
    ):
        with pytest.raises((TypeError, ValueError), match=r"group=.*num_groups=2") as e:
            call()
        assert repr(group) in str(e.value)
    assert pool_state(pool) == before


@SETTINGS
@given(
    bad=st.one_of(st.integers(-3, 0), st.integers(12, 20), NOT_INTS),
    prefix=st.integers(0, 2),
    data=st.data(),
)
def test_free_and_touch_refuse_bad_ids_and_change_nothing(
    bad: object, prefix: int, data: st.DataObject
) -> None:
    pool = busy_pool()
    held = [b for b in range(1, 12) if pool.ref_count(b)]
    ids = [*data.draw(st.permutations(held))[:prefix], bad]
    before = pool_state(pool)
    for op in (pool.free, pool.touch):
        with pytest.raises((TypeError, ValueError), match=r"BlockPool\.(free|touch)"):
            op(ids)  # type: ignore[arg-type]
        assert pool_state(pool) == before


def test_pool_arguments() -> None:
    pool = BlockPool(8)
    for n in (2.5, True, "2", None):
        with pytest.raises(TypeError, match=r"allocate\(n="):
            pool.allocate(n)  # type: ignore[arg-type]
    for op in (pool.free, pool.touch):
        with pytest.raises(TypeError, match="block_ids=3 is a int"):
            op(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True is not block 1"):
        pool.free([True])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="enable_caching=1 must be a bool"):
        BlockPool(8, enable_caching=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="medium=''"):
        BlockPool(8, medium="")
    with pytest.raises(TypeError, match="record_event"):
        pool.record_event("stored")  # type: ignore[arg-type]


def test_events_from_json_name_the_bad_field() -> None:
    good = BlockStored((b"\x01" * 4,), None, (1, 2), 2, 2).to_dict()
    assert event_from_dict(good).block_hashes == (b"\x01" * 4,)
    for change, match in (
        ({"block_hashes": ["zz"]}, r"block_hashes: 'zz' is not .*hex"),
        ({"token_ids": [1, 2.5]}, "token_ids holds 2.5"),
        ({"token_ids": [1]}, "len\\(block_hashes\\) x block_size = 2"),
        ({"block_size": 0}, "block_size=0"),
        ({"group_id": -1}, "group_id=-1"),
        ({"extra_keys": [[["a"]]]}, "extra_keys entry"),
    ):
        with pytest.raises((TypeError, ValueError), match=match):
            event_from_dict({**good, **change})
    missing = dict(good)
    del missing["medium"]
    with pytest.raises(ValueError, match="no 'medium' field"):
        event_from_dict(missing)
    with pytest.raises(TypeError, match="is a dict"):
        events_from_json(json.dumps(["x"]))
    with pytest.raises(TypeError, match="block_hashes"):
        BlockRemoved((None,))  # type: ignore[arg-type]


# -- the manager: ids, hits, counts ----------------------------------------------------------------


def admit(mgr: KVCacheManager, req: Request) -> KVCacheBlocks | None:
    hit, n = mgr.get_computed_blocks(req)
    return mgr.allocate_slots(req, req.num_tokens - n, n, hit)


def mgr_state(mgr: KVCacheManager) -> tuple[object, ...]:
    return (
        pool_state(mgr.pool),
        dict(mgr._computed),
        [({k: list(v) for k, v in m.blocks.items()}, dict(m.num_cached)) for m in mgr.managers],
    )


@SETTINGS
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    n=st.integers(1, 20),
    m=st.integers(1, 20),
    step=st.integers(0, 3),
)
def test_a_second_request_with_a_running_id_is_refused(
    config: str, n: int, m: int, step: int
) -> None:
    mgr = KVCacheManager(CONFIGS[config])
    a = Request("a", list(range(n)))
    assert admit(mgr, a) is not None
    for _ in range(step):
        a.append_token_ids(7)
        assert mgr.allocate_slots(a, 1) is not None
    before = mgr_state(mgr)
    twin = Request("a", list(range(100, 100 + m)))
    for call in (
        lambda: mgr.get_computed_blocks(twin),
        lambda: mgr.allocate_slots(twin, m),  # the decode fast path's shape: used to merge
        lambda: mgr.allocate_slots(twin, 1),
        lambda: admit(mgr, twin),
    ):
        with pytest.raises(ValueError, match="another request with id 'a' is running"):
            call()
        assert mgr_state(mgr) == before
    with pytest.raises(ValueError, match="another Request object"):
        mgr.free(twin)
    mgr.free(a)
    assert admit(mgr, twin) is not None  # the id is free again


def test_a_request_runs_in_one_manager() -> None:
    cfg = CONFIGS["full"]
    one, two = KVCacheManager(cfg), KVCacheManager(cfg)
    r = Request("r", list(range(9)))
    admit(one, r)
    with pytest.raises(ValueError, match="running in another KVCacheManager"):
        two.allocate_slots(r, 1)
    with pytest.raises(ValueError, match="running in another KVCacheManager"):
        two.get_computed_blocks(r)
    assert two.num_running_requests == 0


def _cached_prefix(mgr: KVCacheManager, tokens: list[int]) -> None:
    """Run a request over ``tokens`` and finish it: its full blocks stay cached."""
    r = Request("seed", tokens)
    assert admit(mgr, r) is not None
    mgr.free(r)


@SETTINGS
@given(config=st.sampled_from(sorted(CONFIGS)), length=st.integers(9, 24), data=st.data())
def test_a_forged_hit_is_refused_and_changes_nothing(
    config: str, length: int, data: st.DataObject
) -> None:
    mgr = KVCacheManager(CONFIGS[config])
    tokens = list(range(length))
    _cached_prefix(mgr, tokens)
    other = Request("other", list(range(500, 500 + length)))  # holds uncached blocks of its own
    assert admit(mgr, other) is not None
    req = Request("r", [*tokens, 1])
    hit, n = mgr.get_computed_blocks(req)
    if not n:
        return  # this layout keeps no hit at this length
    groups = [list(g) for g in hit.blocks]
    g = data.draw(st.integers(0, len(groups) - 1))
    m = mgr.managers[g]
    if not groups[g]:
        return
    j = data.draw(st.integers(0, len(groups[g]) - 1))
    theirs = [b for b in mgr.get_block_ids(other)[g] if b]
    forged = data.draw(
        st.sampled_from(
            (["null"] if j >= m.needed_from(n) else [])  # a null before the window is fine
            + (["other's block"] if theirs else [])
            + ["out of range", "float"]
        )
    )
    groups[g][j] = {
        "null": 0,
        "other's block": theirs[0] if theirs else 0,
        "out of range": mgr.pool.num_blocks,
        "float": float(groups[g][j]),
    }[forged]
    before = mgr_state(mgr)
    bad = KVCacheBlocks(tuple(tuple(x) for x in groups))
    with pytest.raises(ValueError, match=rf"request 'r': group {m.group_id} hit (position|block)"):
        mgr.allocate_slots(req, req.num_tokens - n, n, bad)
    assert mgr_state(mgr) == before
    assert mgr.allocate_slots(req, req.num_tokens - n, n, hit) is not None  # the real one


def test_a_hit_for_other_tokens_is_refused() -> None:
    mgr = KVCacheManager(plan({"l": full()}, 20))
    _cached_prefix(mgr, list(range(12)))
    hit, n = mgr.get_computed_blocks(Request("x", list(range(13))))
    assert n == 12
    other = Request("y", [9] * 13)  # different tokens: none of these blocks is its prefix
    with pytest.raises(ValueError, match="not cached for this request's tokens"):
        mgr.allocate_slots(other, 1, n, hit)
    assert mgr.num_running_requests == 0


def test_a_stale_hit_is_refused() -> None:
    # get_computed_blocks, then another admission evicts the hit: the blocks now hold other KV.
    mgr = KVCacheManager(plan({"l": full()}, 5, max_model_len=16))
    _cached_prefix(mgr, list(range(8)))
    r = Request("r", list(range(9)))
    hit, n = mgr.get_computed_blocks(r)
    assert n == 8
    assert admit(mgr, Request("big", [7] * 16)) is not None  # takes every block, evicting
    with pytest.raises(ValueError, match="evicted since get_computed_blocks"):
        mgr.allocate_slots(r, 1, n, hit)


def test_sliding_window_hit_may_hold_null_before_the_window_only() -> None:
    mgr = KVCacheManager(plan({"s": sliding(window=5)}, 30))
    _cached_prefix(mgr, list(range(20)))
    r = Request("r", list(range(21)))
    hit, n = mgr.get_computed_blocks(r)
    (blocks,) = hit.blocks
    assert n == 20 and blocks[0] == 0  # before the window: null is fine
    assert mgr.allocate_slots(r, 1, n, hit) is not None


@SETTINGS
@given(extra=st.integers(1, 5), running=st.booleans())
def test_computed_counts_past_the_request_are_refused(extra: int, running: bool) -> None:
    mgr = KVCacheManager(plan({"l": full()}, 20))
    r = Request("r", list(range(6)))
    if not running:
        with pytest.raises(ValueError, match=r"num_new_computed_tokens=\d+ is more than its 6"):
            mgr.allocate_slots(r, 1, 6 + extra)
        assert mgr.num_running_requests == 0
        return
    admit(mgr, r)
    before = mgr_state(mgr)
    with pytest.raises(ValueError, match=r"num_computed_tokens=\d+ is more than min"):
        mgr.allocate_slots(r, 1, num_computed_tokens=6 + extra)
    assert mgr_state(mgr) == before


def test_manager_arguments_name_the_field() -> None:
    cfg = CONFIGS["full"]
    with pytest.raises(ValueError, match="enable_prefix_caching='yes'"):
        KVCacheManager(cfg, enable_prefix_caching="yes")  # type: ignore[arg-type]
    mgr = KVCacheManager(cfg)
    r = Request("r", [1, 2, 3])
    for bad in (1.0, True, "1", None):
        with pytest.raises(TypeError, match="num_new_tokens="):
            mgr.allocate_slots(r, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request is a str"):
        mgr.allocate_slots("r", 1)  # type: ignore[arg-type]
    for op in (mgr.free, mgr.get_block_ids, mgr.num_computed_tokens):
        with pytest.raises(TypeError, match=r"request=\[1\] is a list"):
            op([1])  # type: ignore[arg-type]


def test_group_manager_entry_points_check_their_arguments() -> None:
    from kv_blocktable.managers import make_group_manager

    pool = BlockPool(10)
    with pytest.raises(
        ValueError, match=r"group_id=1 is not a group of the pool, \[0, num_groups=1\)"
    ):
        make_group_manager(pool, 1, full(), 4, True)
    with pytest.raises(ValueError, match="hash_block_size=3 must be a positive int dividing"):
        make_group_manager(pool, 0, full(), 3, True)
    with pytest.raises(TypeError, match="pool is a str"):
        make_group_manager("pool", 0, full(), 4, True)  # type: ignore[arg-type]
    m = make_group_manager(pool, 0, full(), 4, True)
    with pytest.raises(ValueError, match=r"max_length=-1 must be an int >= 0"):
        m.find_longest_cache_hit([], -1)
    with pytest.raises(TypeError, match="block_hashes is a str"):
        m.find_longest_cache_hit("abc", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block id 10 is not an int in \[0, num_blocks=10\)"):
        m.add_computed_blocks("r", [1, 10])
    with pytest.raises(ValueError, match=r"block id 2\.0"):
        m.add_computed_blocks("r", [2.0])  # type: ignore[list-item]
    assert m.blocks == {}


def test_extra_keys_refuse_a_bare_multimodal_hash() -> None:
    from kv_blocktable import MultiModalHash

    with pytest.raises(TypeError, match="mm_hashes=.* must be a tuple of MultiModalHash"):
        ExtraKeys(mm_hashes=MultiModalHash("img", 0, 2))  # type: ignore[arg-type]


def test_pool_sizes_have_upper_bounds() -> None:
    # (a huge count used to fail as an OverflowError / MemoryError inside the per-block lists)
    with pytest.raises(ValueError, match=r"num_blocks=2361183241434822606848 is past 2147483648"):
        BlockPool(2**71)
    with pytest.raises(ValueError, match="num_groups=8 must be < num_blocks=8"):
        BlockPool(8, num_groups=8)
    with pytest.raises(ValueError, match="num_groups=1180591620717411303424 must be <"):
        BlockPool(8, num_groups=2**70)


# -- errors that name nothing ----------------------------------------------------------------------

JUNK = st.one_of(
    NOT_INTS,
    st.integers(-(2**80), 2**80),
    st.binary(max_size=3),
    st.lists(st.one_of(st.integers(-5, 50), st.floats(), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def _entry_points() -> dict[str, tuple[object, ...]]:
    """name -> default arguments of a call on a fresh pool / manager / request."""
    return {
        "pool.allocate": (2,),
        "pool.free": ([1],),
        "pool.touch": ([1],),
        "pool.cache_block": (0, 2, b"x"),
        "pool.get_cached_block": (0, b"h"),
        "pool.ref_count": (1,),
        "mgr.allocate_slots": ("R", 1, 0, None, 0),
        "mgr.free": ("R",),
        "mgr.get_block_ids": ("R",),
        "mgr.num_computed_tokens": ("r",),
        "req.append_token_ids": ([1],),
        "hash_block_tokens": (None, [1, 2], None),
        "BlockHasher.hash_blocks": ([1, 2, 3, 4], None, None, 0),
        "event_from_dict": ({"type": "AllBlocksCleared", "medium": "GPU"},),
    }


@SETTINGS
@given(name=st.sampled_from(sorted(_entry_points())), data=st.data())
def test_bad_arguments_raise_only_named_value_or_type_errors(
    name: str, data: st.DataObject
) -> None:
    args = list(_entry_points()[name])
    i = data.draw(st.integers(0, len(args) - 1))
    args[i] = data.draw(JUNK)
    pool = BlockPool(10, num_groups=2)
    pool.cache_block(0, pool.allocate(3)[0], b"h")
    mgr = KVCacheManager(CONFIGS["full+sliding"])
    req = Request("r", list(range(20)))
    admit(mgr, req)
    args = [req if a == "R" else a for a in args]
    calls = {
        "pool": pool,
        "mgr": mgr,
        "req": req,
        "hash_block_tokens": hash_block_tokens,
        "BlockHasher": BlockHasher(2),
        "event_from_dict": event_from_dict,
    }
    head, _, meth = name.partition(".")
    fn = getattr(calls[head], meth) if meth else calls[head]
    try:
        if name == "BlockHasher.hash_blocks":
            fn(args[0], args[1], parent_hash=args[2], start_block=args[3])
        else:
            fn(*args)
    except (ValueError, TypeError) as e:
        assert str(e), f"{name}: an error with no message"
