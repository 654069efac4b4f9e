"""``KVConnector.abort_request``: what was planned for a dropped request is undone and reported,
so the engine frees the blocks it kept for it; a transfer under way keeps them until it ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kv_connectors import (
    FilesystemConfig,
    FilesystemConnector,
    MultiConnector,
    OffloadingConfig,
    OffloadingConnector,
    P2pConfig,
    P2pConnector,
)
from kv_connectors.testing import make_layout, random_cache

LAYOUT = make_layout("LBNHC", num_blocks=8)
BS = LAYOUT.block_size


def _offload(blocks: int = 2) -> OffloadingConnector:
    conn = OffloadingConnector(
        OffloadingConfig(cpu_bytes=blocks * LAYOUT.num_layers * LAYOUT.page_bytes), block_size=BS
    )
    conn.register_kv_caches(random_cache(LAYOUT, seed=1), LAYOUT)
    return conn


def test_offload_abort_of_a_planned_save_reports_it_and_frees_its_tier_slots(
    make_request: Callable[..., Any],
) -> None:
    conn = _offload(blocks=2)
    req = make_request("a", 2, BS)
    assert conn.request_finished(req, [3, 4]) == (True, None)
    assert not conn._free  # both slots reserved for "a"
    conn.abort_request("a")
    assert conn.get_finished() == ({"a"}, set())  # the engine may free blocks 3 and 4 now
    assert conn.build_connector_meta().saves == ()
    assert sorted(conn._free) == [0, 1]  # planted bug (slots not given back) fails here
    # the tier is whole again: another request's two blocks are stored
    other = make_request("b", 2, BS, seed=5)
    assert conn.request_finished(other, [5, 6]) == (True, None)
    conn.abort_request("unknown")  # an abort racing a finish is ignored
    with pytest.raises(ValueError, match="abort_request.request_id"):
        conn.abort_request("")


def test_offload_abort_of_a_planned_load_unpins_its_blocks(
    make_request: Callable[..., Any],
) -> None:
    conn = _offload(blocks=2)
    req = make_request("a", 2, BS)
    conn.request_finished(req, [3, 4])
    meta = conn.build_connector_meta()
    conn.start_load_kv(meta)
    conn.wait_for_save()
    conn.get_finished()
    again = make_request("b", 2, BS)  # same tokens: a tier hit
    tokens, _ = conn.get_num_new_matched_tokens(again, 0)
    conn.update_state_after_alloc(again, [6, 7], tokens)
    assert conn._pins  # pinned between planning and copying
    conn.abort_request("b")
    assert not conn._pins and conn.build_connector_meta().loads == ()


def test_filesystem_and_multi_abort_report_dropped_saves(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    fs = FilesystemConnector(
        FilesystemConfig(root=tmp_path, model_fingerprint="m", fsync=False), block_size=BS
    )
    multi = MultiConnector([_offload(), fs])
    multi.register_kv_caches(random_cache(LAYOUT, seed=1), LAYOUT)
    req = make_request("a", 2, BS)
    assert multi.request_finished(req, [3, 4]) == (True, None)
    multi.abort_request("a")
    assert multi.get_finished() == ({"a"}, set())  # every child gave its blocks back
    assert not fs._saving  # a later request may save those hashes again
    multi.close()


def test_p2p_producer_abort_releases_a_held_request_at_once(
    make_request: Callable[..., Any],
) -> None:
    prod = P2pConnector(P2pConfig(timeout_s=10.0, role="producer"), block_size=BS)
    prod.register_kv_caches(random_cache(LAYOUT, seed=1), LAYOUT)
    try:
        delay, params = prod.request_finished(make_request("p", 2, BS), [3, 4])
        assert delay and params is not None
        assert prod.get_finished() == (set(), set())  # held for a consumer (abandon_after_s)
        prod.abort_request("p")
        assert prod.get_finished() == ({"p"}, set())
        with pytest.raises(KeyError, match="not held"):  # a late pull is refused
            prod._start_pull("p", [3, 4], None)
    finally:
        prod.close()


def test_p2p_producer_abort_keeps_blocks_pinned_under_a_pull(
    make_request: Callable[..., Any],
) -> None:
    prod = P2pConnector(P2pConfig(timeout_s=10.0, role="producer"), block_size=BS)
    prod.register_kv_caches(random_cache(LAYOUT, seed=1), LAYOUT)
    try:
        prod.request_finished(make_request("p", 2, BS), [3, 4])
        token = prod._start_pull("p", [3, 4], None)  # a consumer's pull under way
        prod.abort_request("p")
        assert prod.get_finished() == (set(), set())  # planted bug (freed under a pull) fails
        prod._end_pull("p", token)
        assert prod.get_finished() == ({"p"}, set())
    finally:
        prod.close()


def test_p2p_consumer_abort_of_a_planned_pull_reports_it_failed(
    make_request: Callable[..., Any],
) -> None:
    prod = P2pConnector(P2pConfig(timeout_s=10.0, role="producer"), block_size=BS)
    prod.register_kv_caches(random_cache(LAYOUT, seed=1), LAYOUT)
    cons = P2pConnector(P2pConfig(timeout_s=10.0, role="consumer"), block_size=BS)
    cons.register_kv_caches(random_cache(LAYOUT, seed=2), LAYOUT)
    try:
        _d, params = prod.request_finished(make_request("p", 2, BS), [3, 4])
        req = make_request("c", 2, BS)
        cons.add_remote_request("c", params)  # type: ignore[arg-type]
        tokens, load_async = cons.get_num_new_matched_tokens(req, 0)
        assert load_async and tokens == 2 * BS
        cons.update_state_after_alloc(req, [5, 6], tokens)
        cons.abort_request("c")  # before the engine handed the load to the worker side
        assert cons.build_connector_meta().loads == ()
        assert cons.get_finished() == (set(), {"c"})  # the engine frees blocks 5 and 6 now
    finally:
        prod.close()
        cons.close()
