"""OffloadingConnector: prefix hits from the tier, budget and eviction order through the
connector (byte-exact round trips for every layout: the contract suite, ``test_contract.py``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_connectors import OffloadingConfig, OffloadingConnector
from kv_connectors.testing import block_bytes, make_layout, random_cache


def _save(conn: OffloadingConnector, req: Any, block_ids: list[int]) -> None:
    delay, params = conn.request_finished(req, block_ids)
    assert delay and params is None
    meta = conn.build_connector_meta()
    conn.start_load_kv(meta)
    for layer in range(conn.kv.num_layers):
        conn.save_kv_layer(layer, meta)
    conn.wait_for_save()
    sending, recving = conn.get_finished()
    assert sending == {req.request_id} and recving == set()


def _load(conn: OffloadingConnector, req: Any, block_ids: list[int], computed: int = 0) -> int:
    tokens, async_load = conn.get_num_new_matched_tokens(req, computed)
    assert not async_load
    conn.update_state_after_alloc(req, block_ids, tokens)
    meta = conn.build_connector_meta()
    conn.start_load_kv(meta)
    for layer in range(conn.kv.num_layers):
        conn.wait_for_layer_load(layer)
    return tokens


def _tier(seed: int, cpu_bytes: int = 1 << 20) -> tuple[OffloadingConnector, Any, Any]:
    """``(connector, cache, layout)``: a CPU tier registered on a random BLNHC cache of 16 blocks."""
    layout = make_layout("BLNHC", num_blocks=16)
    cache = random_cache(layout, seed=seed)
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=cpu_bytes), block_size=layout.block_size)
    conn.register_kv_caches(cache, layout)
    return conn, cache, layout


def test_prefix_hit_stops_at_first_miss(make_request: Callable[..., Any]) -> None:
    conn, cache, layout = _tier(seed=3)
    bs = layout.block_size
    a = make_request("a", 4, bs, seed=1)
    _save(conn, a, [0, 1, 2, 3])
    shared = list(a.token_ids[: 2 * bs])
    b = make_request("b", 4, bs, seed=2, prefix=shared)
    assert conn.get_num_new_matched_tokens(b, 0) == (2 * bs, False)
    # one block computed locally already: only the second is external
    assert conn.get_num_new_matched_tokens(b, bs) == (bs, False)
    want = block_bytes(cache, layout, 1)
    assert _load(conn, b, [8, 9, 10, 11], computed=bs) == bs
    assert torch.equal(block_bytes(cache, layout, 9), want)
    assert conn.stats.hit_blocks == 1


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_budget_is_whole_blocks_and_never_exceeded(
    policy: str, make_request: Callable[..., Any]
) -> None:
    layout = make_layout("LBNHC", num_blocks=16)
    row = layout.num_layers * layout.page_bytes
    cache = random_cache(layout, seed=4)
    conn = OffloadingConnector(
        OffloadingConfig(cpu_bytes=3 * row + row - 1, policy=policy), block_size=layout.block_size
    )
    conn.register_kv_caches(cache, layout)
    assert conn.capacity_blocks == 3 and conn.tier.numel() == 3 * row
    for i in range(5):
        _save(conn, make_request(f"r{i}", 2, layout.block_size, seed=10 + i), [2 * i, 2 * i + 1])
        assert len(conn.stored_hashes()) <= 3
    assert conn.stats.evicted_blocks == 10 - 3


def test_lru_evicts_least_recently_used(make_request: Callable[..., Any]) -> None:
    layout = make_layout("LBNHC", num_blocks=16)
    row = layout.num_layers * layout.page_bytes
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=2 * row), block_size=layout.block_size)
    conn.register_kv_caches(random_cache(layout, seed=5), layout)
    bs = layout.block_size
    a, b, c = (make_request(n, 1, bs, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3)))
    _save(conn, a, [0])
    _save(conn, b, [1])
    _load(conn, make_request("a2", 1, bs, seed=1), [5])  # a is now most recent
    _save(conn, c, [2])  # evicts b
    assert conn.stored_hashes() == [a.block_hashes[0], c.block_hashes[0]]


def test_arc_keeps_reused_blocks_through_a_scan(make_request: Callable[..., Any]) -> None:
    layout = make_layout("LBNHC", num_blocks=64)
    row = layout.num_layers * layout.page_bytes
    bs = layout.block_size
    conns = {
        p: OffloadingConnector(OffloadingConfig(cpu_bytes=4 * row, policy=p), block_size=bs)
        for p in ("lru", "arc")
    }
    survived = {}
    for p, conn in conns.items():
        conn.register_kv_caches(random_cache(layout, seed=6), layout)
        hot = make_request("hot", 2, bs, seed=99)
        _save(conn, hot, [0, 1])
        _load(conn, make_request("hot2", 2, bs, seed=99), [2, 3])  # reused: frequency list
        for i in range(6):  # a scan of one-time prompts
            _save(conn, make_request(f"scan{i}", 1, bs, seed=200 + i), [10 + i])
        survived[p] = sum(h in conn.stored_hashes() for h in hot.block_hashes)
    assert survived == {"lru": 0, "arc": 2}


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"cpu_bytes=0"):
        OffloadingConfig(cpu_bytes=0)
    with pytest.raises(ValueError, match=r"policy='mru'"):
        OffloadingConfig(cpu_bytes=10, policy="mru")
    with pytest.raises(ValueError, match=r"timeout_s=inf"):
        OffloadingConfig(cpu_bytes=10, timeout_s=float("inf"))
    layout = make_layout("LBNHC")
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=10), block_size=layout.block_size)
    with pytest.raises(ValueError, match=r"holds no block"):
        conn.register_kv_caches(random_cache(layout, seed=0), layout)
    with pytest.raises(ValueError, match=r"block_size"):
        OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=8).register_kv_caches(
            random_cache(layout, seed=0), layout
        )


def test_runs_group_consecutive_slots_in_order() -> None:
    """A save's tier slots in runs of consecutive slots (one copy per run and segment), each
    run keeping its block ids in request order; cut where a slot does not follow the last
    (issue 30: the old copy of each run's list per block was quadratic in a request's blocks,
    its tuple rebuilt per block most of a 256-block plan)."""
    from kv_connectors.offloading import _runs

    got = _runs([4, 5, 6, 9, 10, 2], [40, 7, 3, 11, 12, 1])
    assert got == [(4, 3, [40, 7, 3]), (9, 2, [11, 12]), (2, 1, [1])]
    assert _runs([], []) == []
    long = _runs(list(range(5000)), list(range(5000, 0, -1)))
    assert long == [(0, 5000, list(range(5000, 0, -1)))]
    with pytest.raises(ValueError, match="one slot a block"):
        _runs([1, 2], [3])


def test_a_repeated_hash_in_one_request_is_saved_once(make_request: Callable[..., Any]) -> None:
    """Two blocks of one request with the same hash take one tier slot (the duplicate check is
    a set now, not a scan of the request's list)."""
    layout = make_layout("BLNHC", num_blocks=16)
    conn = OffloadingConnector(
        OffloadingConfig(cpu_bytes=8 * layout.num_layers * layout.page_bytes),
        block_size=layout.block_size,
    )
    conn.register_kv_caches(random_cache(layout, seed=1), layout)
    real = make_request("r", 3, layout.block_size)
    hashes = [real.block_hashes[0], real.block_hashes[1], real.block_hashes[0]]
    req = type("Req", (), {"request_id": "r", "block_hashes": hashes})()
    delay, _ = conn.request_finished(req, [3, 4, 5])
    assert delay
    (save,) = conn._saves
    assert save.block_ids == (3, 4) and len(set(save.block_hashes)) == 2
    conn.close()


def test_spans_cut_runs_at_piece_edges() -> None:
    """A staging piece's rows map to the runs' tier slots: a piece that straddles two runs gets
    one span in each, and a piece past the rows gets none."""
    from kv_connectors._lanes import _spans

    runs = [(0, 3, [9, 8, 7]), (5, 3, [1, 4, 2])]
    assert list(_spans(runs, slice(0, 2))) == [(0, 2, 0)]
    assert list(_spans(runs, slice(2, 4))) == [(0, 1, 2), (1, 2, 5)]
    assert list(_spans(runs, slice(4, 6))) == [(0, 2, 6)]
    assert list(_spans(runs, slice(0, 6))) == [(0, 3, 0), (3, 6, 5)]


@pytest.mark.parametrize(
    ("rows", "sizes"),
    [(264, [132, 132]), (256, [256]), (513, [171, 171, 171]), (1, [1]), (0, [])],
)
def test_pieces_are_even(rows: int, sizes: list[int]) -> None:
    """A segment's rows split evenly over the fewest pieces that fit a staging half, the halves
    alternating: 264 rows in halves of 256 as 256 + 8 put every segment's large piece in one
    half, each waiting for the last one's copy and scatter (the 4k-token tier hit's 69 ms)."""
    from kv_connectors._lanes import Lane

    width = 4
    lane = Lane(None, None, [torch.empty(256 * width, dtype=torch.uint8) for _ in range(2)])
    got = list(lane._pieces(width, rows))
    assert [p[0].stop - p[0].start for p in got] == sizes
    assert [p[1] for p in got] == [i % 2 for i in range(len(sizes))]
    assert all(p[2].shape == (n, width) for p, n in zip(got, sizes, strict=True))
    assert sum(sizes) == rows and (not got or got[-1][0].stop == rows)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 5000), cap=st.integers(1, 600))
def test_pieces_cover_the_rows_evenly_in_the_fewest(rows: int, cap: int) -> None:
    """For any row count and staging size: the pieces tile ``[0, rows)`` in order, each fits a
    half, there are as few as fit (``ceil(rows / cap)``), and all are one size but the last,
    short of it by fewer rows than there are pieces (never 256 + 8)."""
    from kv_connectors._lanes import Lane

    lane = Lane(None, None, [torch.empty(cap, dtype=torch.uint8) for _ in range(2)])
    got = [p[0] for p in lane._pieces(1, rows)]
    assert len(got) == -(-rows // cap)
    assert all(a.stop == b.start for a, b in itertools.pairwise(got))
    assert (not got and rows == 0) or (got[0].start == 0 and got[-1].stop == rows)
    sizes = [p.stop - p.start for p in got]
    assert all(0 < n <= cap for n in sizes)
    assert len(set(sizes[:-1])) <= 1 and (not sizes or sizes[0] - sizes[-1] < len(sizes))


def test_order_runs_puts_consecutive_ids_last() -> None:
    """Runs of consecutive block ids (which a segment may copy directly) come last, so the
    staged runs' ids are one prefix of the concatenation."""
    from kv_connectors._lanes import order_runs

    runs = [(0, 2, [4, 5]), (2, 2, [9, 3]), (4, 1, [7]), (5, 2, [1, 0])]
    ordered, staged = order_runs(runs)
    assert staged == 2 and ordered == [runs[1], runs[3], runs[0], runs[2]]


def test_loads_are_enqueued_ahead_of_the_layer_waited_for(
    make_request: Callable[..., Any],
) -> None:
    """A load's segments are copied ``LOAD_AHEAD`` ahead of the layer the forward waits for (so
    the host launches the forward between them), the rest at ``wait_for_save``; the blocks stay
    pinned in the tier until every segment is enqueued (a save cannot evict them meanwhile)."""
    from kv_connectors.offloading import LOAD_AHEAD

    layout = make_layout("LBNHC", num_layers=6, num_blocks=16)  # a segment a layer
    cache = random_cache(layout, seed=1)
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=layout.block_size)
    conn.register_kv_caches(cache, layout)
    src, dst = [1, 2], [9, 12]
    _save(conn, make_request("a", 2, layout.block_size, seed=2), src)
    want = [block_bytes(cache, layout, b) for b in src]
    b = make_request("b", 2, layout.block_size, seed=2)
    tokens, _ = conn.get_num_new_matched_tokens(b, 0)
    conn.update_state_after_alloc(b, dst, tokens)
    conn.start_load_kv(conn.build_connector_meta())

    def landed() -> list[bool]:  # per layer: both blocks hold a's bytes
        got = [block_bytes(cache, layout, d) for d in dst]
        return [all(torch.equal(g[i], w[i]) for g, w in zip(got, want, strict=True))
                for i in range(layout.num_layers)]  # fmt: skip

    assert landed() == [i < LOAD_AHEAD for i in range(6)]
    assert all(conn._pins.get(h) for h in b.block_hashes)  # pinned until all are enqueued
    conn.wait_for_layer_load(0)
    assert landed() == [i <= LOAD_AHEAD for i in range(6)]
    conn.wait_for_save()  # the rest, though no layer waited for it
    assert landed() == [True] * 6
    assert not any(conn._pins.get(h) for h in b.block_hashes)


def test_a_saved_request_keeps_its_stored_prefix(make_request: Callable[..., Any]) -> None:
    """Saving a request whose first blocks are in the tier already makes them the most recently
    used: its new blocks evict other requests' blocks, never its own prefix (which would leave
    a hole that every later lookup stops at)."""
    layout = make_layout("BLNHC", num_blocks=16)
    bs = layout.block_size
    cache = random_cache(layout, seed=1)
    conn = OffloadingConnector(
        OffloadingConfig(cpu_bytes=4 * layout.num_layers * layout.page_bytes), block_size=bs
    )
    conn.register_kv_caches(cache, layout)
    first = make_request("a", 2, bs, seed=1)
    _save(conn, first, [0, 1])
    _save(conn, make_request("other", 2, bs, seed=2), [2, 3])  # the tier is full
    longer = make_request("b", 4, bs, seed=1)  # a's two blocks, then two new ones
    assert longer.block_hashes[:2] == first.block_hashes
    _save(conn, longer, [0, 1, 4, 5])
    assert _load(conn, make_request("c", 4, bs, seed=1), [8, 9, 10, 11]) == 4 * bs


def test_a_step_left_unfinished_lands_before_the_next_plans(
    make_request: Callable[..., Any],
) -> None:
    """Loads whose step never reached ``wait_for_save`` (only ``LOAD_AHEAD`` segments enqueued)
    land in full when the next step starts, and their blocks are unpinned: nothing counted as
    loaded is left half-copied (planted: without that flush the late layers stay unwritten)."""
    layout = make_layout("LBNHC", num_layers=6, num_blocks=16)
    cache = random_cache(layout, seed=3)
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=layout.block_size)
    conn.register_kv_caches(cache, layout)
    _save(conn, make_request("a", 2, layout.block_size, seed=4), [1, 2])
    want = [block_bytes(cache, layout, b) for b in (1, 2)]
    b = make_request("b", 2, layout.block_size, seed=4)
    tokens, _ = conn.get_num_new_matched_tokens(b, 0)
    conn.update_state_after_alloc(b, [9, 12], tokens)
    conn.start_load_kv(conn.build_connector_meta())  # the forward never waits: an aborted step
    conn.start_load_kv(conn.build_connector_meta())  # the next step
    got = [block_bytes(cache, layout, d) for d in (9, 12)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not any(conn._pins.get(h) for h in b.block_hashes)


def _running(req: Any, num_blocks: int) -> Any:
    """``req`` as the engine shows a running request: its first ``num_blocks`` complete blocks."""
    return SimpleNamespace(request_id=req.request_id, block_hashes=req.block_hashes[:num_blocks])


def _step(conn: OffloadingConnector) -> set[str]:
    """One engine step: the metadata, every layer saved, the saves handed off; ``done_sending``."""
    meta = conn.build_connector_meta()
    conn.start_load_kv(meta)
    for layer in range(conn.kv.num_layers):
        conn.save_kv_layer(layer, meta)
    conn.wait_for_save()
    return conn.get_finished()[0]


def test_blocks_are_saved_while_the_request_runs(make_request: Callable[..., Any]) -> None:
    """``blocks_computed`` saves a running request's complete blocks in the step it is called,
    each block once: a finished request has only its last blocks left to copy (none here, so
    its blocks are not kept), and what the tier holds is the request's KV, byte for byte."""
    conn, cache, layout = _tier(seed=5)
    bs = layout.block_size
    a = make_request("a", 4, bs, seed=6)
    ids = [3, 7, 8, 2]
    want = [block_bytes(cache, layout, b) for b in ids]
    conn.blocks_computed(_running(a, 2), ids)
    assert _step(conn) == set()  # saved, but the request runs: nothing to free
    assert conn.stats.stored_blocks == 2
    conn.blocks_computed(_running(a, 2), ids)  # nothing new: nothing planned
    assert not conn.build_connector_meta().saves
    conn.blocks_computed(_running(a, 4), ids)
    meta = conn.build_connector_meta()
    assert [s.block_ids for s in meta.saves] == [(8, 2)]  # only the two new blocks
    conn.start_load_kv(meta)
    conn.wait_for_save(meta)
    assert conn.request_finished(a, ids) == (False, None)  # every block stored already
    assert _load(conn, make_request("b", 4, bs, seed=6), [12, 13, 14, 15]) == 4 * bs
    assert all(
        torch.equal(block_bytes(cache, layout, d), w)
        for d, w in zip([12, 13, 14, 15], want, strict=True)
    )


def _finished_while_saving(make_request: Callable[..., Any]) -> tuple[OffloadingConnector, Any]:
    """A tier whose request "a" (4 blocks) finished while the save of its first 2, planned as it
    ran, was handed to the worker side and not copied yet; that step's metadata."""
    conn, _, layout = _tier(seed=5)
    a = make_request("a", 4, layout.block_size, seed=6)
    ids = [3, 7, 8, 2]
    conn.blocks_computed(_running(a, 2), ids)
    first = conn.build_connector_meta()
    conn.start_load_kv(first)  # handed to the worker side, not copied yet
    assert conn.request_finished(a, ids) == (True, None)
    return conn, first


def test_done_sending_waits_for_every_save_of_the_request(
    make_request: Callable[..., Any],
) -> None:
    """A request that finishes while a save of its running blocks still copies is reported in
    ``done_sending`` (its blocks freed) only after that save and the finish's own have landed.
    Planted: reported at the first save to land, the engine would free blocks the second still
    reads."""
    conn, first = _finished_while_saving(make_request)
    conn.wait_for_save(first)  # the first save lands
    assert conn.get_finished()[0] == set()
    assert _step(conn) == {"a"}  # the finish's save lands: now the blocks may go
    assert conn.stats.stored_blocks == 4


def test_abort_keeps_a_finished_request_until_its_save_in_flight_lands(
    make_request: Callable[..., Any],
) -> None:
    """Aborting a finished request drops its save not yet handed off (its tier slots freed) but
    reports it only once the save already copying has landed."""
    conn, first = _finished_while_saving(make_request)
    a = make_request("a", 4, conn.block_size, seed=6)
    conn.abort_request("a")
    assert conn.get_finished()[0] == set()  # the first save still reads the blocks
    conn.wait_for_save(first)
    assert conn.get_finished()[0] == {"a"}
    assert sorted(conn.stored_hashes()) == sorted(a.block_hashes[:2])  # the dropped two: gone
    assert len(conn._free) == conn.capacity_blocks - 2


def test_a_preempted_request_is_told_its_blocks_again(make_request: Callable[..., Any]) -> None:
    """After ``handle_preemptions`` a resumed request's blocks are counted from its first again:
    one the tier could not take before (every slot pinned) is saved when the request is told of
    it anew, the ones stored are not copied twice."""
    layout = make_layout("BLNHC", num_blocks=16)
    bs = layout.block_size
    row = layout.num_layers * layout.page_bytes
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=2 * row), block_size=bs)
    conn.register_kv_caches(random_cache(layout, seed=5), layout)
    other = make_request("o", 1, bs, seed=9)
    conn.blocks_computed(_running(other, 1), [9])
    held = conn.build_connector_meta()  # o's save planned, not landed: its slot is pinned
    a = make_request("a", 2, bs, seed=6)
    conn.blocks_computed(_running(a, 2), [3, 7])  # one slot free: a's first block only
    conn.start_load_kv(held)
    conn.wait_for_save(held)
    assert _step(conn) == set() and conn.stats.skipped_saves == 1
    conn.handle_preemptions(["a"])
    conn.blocks_computed(_running(a, 2), [4, 5])  # resumed into other blocks
    meta = conn.build_connector_meta()
    assert [s.block_ids for s in meta.saves] == [(5,)]  # the block skipped before, once


def test_save_tracker_reports_a_finished_request_after_its_last_save() -> None:
    """The accounting both stores share (``_save_tracking.SaveTracker``): blocks shown once each,
    a finished request kept while a save is open and reported at the last one's close, a
    forgotten request shown its blocks again."""
    from kv_connectors._save_tracking import SaveTracker

    t = SaveTracker()
    assert t.new_blocks("a", 2) == 0 and t.new_blocks("a", 2) is None and t.new_blocks("a", 5) == 2
    t.opened("a")
    t.opened("a")
    assert t.finishing("a") == 5 and t.keep("a")
    assert not t.closed("a") and t.closed("a") and not t.is_open("a")
    t.opened("b")
    assert not t.closed("b")  # running: nothing to report
    assert t.finishing("b") == 0 and not t.keep("b")  # nothing open: free at once
    assert t.new_blocks("c", 3) == 0
    t.forget("c")
    assert t.new_blocks("c", 3) == 0


def test_close_finishes_a_step_left_half_done(make_request: Callable[..., Any]) -> None:
    """A step closed between ``start_load_kv`` and ``wait_for_save`` (an engine stopped by an
    error): ``close`` enqueues its saves and returns at once, the blocks stored. Before, it
    waited out ``timeout_s`` (30 s) for saves never enqueued and stored nothing."""
    conn, _, layout = _tier(seed=4)
    a = make_request("a", 2, layout.block_size, seed=3)
    conn.request_finished(a, [5, 6])
    conn.start_load_kv(conn.build_connector_meta())
    t0 = time.monotonic()
    conn.close()
    assert time.monotonic() - t0 < 5 and sorted(conn.stored_hashes()) == sorted(a.block_hashes)
