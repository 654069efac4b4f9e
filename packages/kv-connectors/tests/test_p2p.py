"""P2pConnector between two real processes over gloo on 127.0.0.1: byte-exact pulls for several
layouts and conversions (order + block size, TP head split); a producer killed mid-transfer, a
stalled producer, a wrong-layout handshake — each a reported load error within the timeout, and the
next request succeeds."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_connectors import KVTransferParams, P2pConfig, P2pConnector
from kv_connectors._p2p_wire import Wire
from kv_connectors.testing import block_bytes, make_layout, random_cache
from kv_spec import KVCacheLayout

TIMEOUT = 5.0

# name -> (producer layout, producer TP, consumer layout, consumer TP)
CASES: dict[str, tuple[KVCacheLayout, tuple[int, int], KVCacheLayout, tuple[int, int]]] = {
    "LBNHC": (make_layout("LBNHC"), (0, 1), make_layout("LBNHC"), (0, 1)),
    "BLNHC": (make_layout("BLNHC"), (0, 1), make_layout("BLNHC"), (0, 1)),
    "int8_pth": (
        make_layout("BLHNC", dtype="int8", kv_quant="int8_per_token_head"),
        (0, 1),
        make_layout("BLHNC", dtype="int8", kv_quant="int8_per_token_head"),
        (0, 1),
    ),
    "diffkv": (
        make_layout("LBNHC", head_size=192, head_size_v=128, num_kv_heads=1),
        (0, 1),
        make_layout("LBNHC", head_size=192, head_size_v=128, num_kv_heads=1),
        (0, 1),
    ),
    "hnd_bs4_to_nhd_bs8": (
        make_layout("LBHNC", block_size=4),
        (0, 1),
        make_layout("BLNHC", block_size=8),
        (0, 1),
    ),
    "tp1_to_tp2_rank1": (
        make_layout("LBNHC", num_kv_heads=4),
        (0, 1),
        make_layout("LBNHC", num_kv_heads=2),
        (1, 2),
    ),
    "after_die": (make_layout("LBNHC"), (0, 1), make_layout("LBNHC"), (0, 1)),
    "after_stall": (make_layout("LBNHC"), (0, 1), make_layout("LBNHC"), (0, 1)),
    "wrong_layout": (make_layout("LBNHC", dtype="bfloat16"), (0, 1), make_layout("LBNHC"), (0, 1)),
    "restarted_hnd": (make_layout("LBHNC"), (0, 1), make_layout("LBNHC"), (0, 1)),
}
PRODUCER_BLOCKS = [3, 9, 1, 6]


def _producers(names: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": n,
            "layout": CASES[n][0].to_json(),
            "seed": 10 + list(CASES).index(n),
            "block_ids": PRODUCER_BLOCKS,
            "tp": list(CASES[n][1]),
        }
        for n in names
    ]


@pytest.fixture(scope="module")
def healthy(spawn_peer: Callable[..., Any]) -> Any:
    return spawn_peer(
        {"transport": "p2p", "timeout_s": TIMEOUT, "producers": _producers(list(CASES))}
    )


def _consumer(name: str, **cfg: Any) -> tuple[P2pConnector, Any]:
    _prod, _ptp, layout, (rank, size) = CASES[name]
    conn = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, buffer_bytes=cfg.pop("buffer_bytes", 1 << 20), **cfg),
        block_size=layout.block_size,
        tp_rank=rank,
        tp_size=size,
    )
    cache = random_cache(layout, seed=100)
    conn.register_kv_caches(cache, layout)
    return conn, cache


def _pull(
    conn: P2pConnector, params: dict[str, Any], local_ids: list[int], loads: Any, rid: str
) -> tuple[int, set[int]]:
    """Start a load and wait for it: ``(matched tokens, blocks with errors)``."""
    tokens = loads.start(conn, params, local_ids, rid)
    if tokens == 0:
        return 0, set()
    return tokens, loads.finish(conn, rid, 3 * TIMEOUT + 10, poll_s=0.01)[1]


def _want(loads: Any, name: str) -> list[torch.Tensor]:
    """Expected logical bytes of the consumer's blocks, from the producer's cache."""
    prod, _ptp, cons, (rank, _size) = CASES[name]
    src = random_cache(prod, seed=10 + list(CASES).index(name))
    return loads.expected(src, prod, cons, PRODUCER_BLOCKS, rank)


@pytest.mark.parametrize(
    "name", ["LBNHC", "BLNHC", "int8_pth", "diffkv", "hnd_bs4_to_nhd_bs8", "tp1_to_tp2_rank1"]
)
def test_pull_between_two_processes_is_byte_exact(
    name: str, healthy: Any, remote_load: Any
) -> None:
    prod, cons = CASES[name][0], CASES[name][2]
    row = max(prod.num_layers * prod.page_bytes, cons.num_layers * cons.page_bytes)
    conn, cache = _consumer(name, buffer_bytes=4 * row)  # two rows per chunk: several chunks
    want = _want(remote_load, name)
    local = [7, 2, 11, 5][: len(want)]
    untouched = block_bytes(cache, conn.kv.layouts[0], 0)
    tokens, errors = _pull(conn, healthy.params[name], local, remote_load, f"c-{name}")
    assert tokens == len(want) * conn.block_size and errors == set()
    for b, w in zip(local, want, strict=True):
        assert torch.equal(block_bytes(cache, conn.kv.layouts[0], b), w)
    assert torch.equal(block_bytes(cache, conn.kv.layouts[0], 0), untouched)
    healthy.expect((f"SENT req-{name}",), timeout_s=10)  # the producer frees the blocks
    conn.close()


def test_refused_layout_matches_nothing_and_says_why(
    healthy: Any, make_request: Callable[..., Any]
) -> None:
    conn, _cache = _consumer("LBNHC")
    req = make_request("c-refused", 4, conn.block_size)
    conn.add_remote_request(req.request_id, healthy.params["wrong_layout"])
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "token content differs" in conn.load_error_reasons["c-refused"]
    conn.close()


def test_live_handshake_mismatch_is_a_load_error(healthy: Any, remote_load: Any) -> None:
    conn, cache = _consumer("LBNHC")
    forged = dict(healthy.params["wrong_layout"])  # declares our layout, serves bf16
    lay = conn.kv.layouts[0]
    forged.update(
        KVTransferParams.for_layouts(
            [lay],
            **{
                k: v for k, v in forged.items() if k not in ("layouts_json", "compatibility_hashes")
            },
        ).to_dict()
    )
    before = block_bytes(cache, lay, 2)
    tokens, errors = _pull(conn, forged, [2, 3, 4, 5], remote_load, "c-forged")
    assert tokens == 4 * conn.block_size and errors == {2, 3, 4, 5}
    assert "now serves layouts" in conn.load_error_reasons["c-forged"]
    assert torch.equal(block_bytes(cache, lay, 2), before)
    conn.close()


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_dead_or_stalled_producer_is_a_load_error_then_next_succeeds(
    fault: str, spawn_peer: Callable[..., Any], healthy: Any, remote_load: Any
) -> None:
    bad = spawn_peer(
        {
            "transport": "p2p",
            "timeout_s": TIMEOUT,
            "fault": fault,
            "producers": _producers(["LBNHC"]),
        }
    )
    conn, cache = _consumer(
        "LBNHC", buffer_bytes=2 * make_layout().num_layers * make_layout().page_bytes
    )
    tokens = remote_load.start(conn, bad.params["LBNHC"], [4, 5, 6, 7], f"c-{fault}")
    assert tokens == 4 * conn.block_size
    if fault == "die":
        bad.expect(("CHUNK",), timeout_s=30)
        bad.proc.kill()  # mid-transfer: one chunk sent, three to go
    elapsed, errors = remote_load.finish(conn, f"c-{fault}", TIMEOUT + 30, poll_s=0.01)
    assert errors == {4, 5, 6, 7}
    if fault == "stall":
        assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + 10
        bad.proc.kill()
    # the connector stays usable: the next request, from a healthy producer, succeeds
    tokens, errors = _pull(
        conn, healthy.params[f"after_{fault}"], [8, 9, 10, 11], remote_load, f"c-next-{fault}"
    )
    assert errors == set() and tokens == 4 * conn.block_size
    want = _want(remote_load, f"after_{fault}")
    assert all(
        torch.equal(block_bytes(cache, conn.kv.layouts[0], b), w)
        for b, w in zip([8, 9, 10, 11], want, strict=True)
    )
    conn.close()


def _push_consumer(**cfg: Any) -> tuple[P2pConnector, Any]:
    layout = CASES["LBNHC"][2]
    conn = P2pConnector(
        P2pConfig(mode="write", timeout_s=TIMEOUT, **cfg), block_size=layout.block_size
    )
    cache = random_cache(layout, seed=100)
    conn.register_kv_caches(cache, layout)
    return conn, cache


def _push_peer(spawn_peer: Callable[..., Any], conn: P2pConnector, fault: str | None = None) -> Any:
    host, port = conn.address
    layout = CASES["LBNHC"][0]
    return spawn_peer(
        {
            "transport": "p2p",
            "timeout_s": TIMEOUT,
            "mode": "write",
            "push_to": f"{host}:{port}",
            "buffer_bytes": 2 * layout.num_layers * layout.page_bytes,  # one block per chunk
            "fault": fault,
            "producers": _producers(["LBNHC"]),
        }
    )


def test_push_between_two_processes_is_byte_exact(
    spawn_peer: Callable[..., Any], remote_load: Any
) -> None:
    conn, cache = _push_consumer()
    peer = _push_peer(spawn_peer, conn)
    peer.expect(("SENT req-LBNHC",), timeout_s=30)  # pushed (and freed) before decode scheduled it
    tokens, errors = _pull(conn, peer.params["LBNHC"], [7, 2, 11, 5], remote_load, "c-push")
    assert tokens == 4 * conn.block_size and errors == set()
    for b, w in zip([7, 2, 11, 5], _want(remote_load, "LBNHC"), strict=True):
        assert torch.equal(block_bytes(cache, conn.kv.layouts[0], b), w)
    assert conn._staged_bytes == 0  # the receive buffer is released
    conn.close()


def test_push_refused_when_receive_buffer_full_and_producer_killed_mid_push(
    spawn_peer: Callable[..., Any], remote_load: Any
) -> None:
    conn, _cache = _push_consumer(receive_bytes=1024)  # smaller than one request's KV
    peer = _push_peer(spawn_peer, conn)
    start = time.monotonic()
    tokens, errors = _pull(conn, peer.params["LBNHC"], [1, 2, 3, 4], remote_load, "c-full")
    assert tokens == 4 * conn.block_size and errors == {1, 2, 3, 4}
    assert "receive buffer full" in conn.load_error_reasons["c-full"]
    assert time.monotonic() - start < TIMEOUT  # refused pushes fail fast, not at the timeout
    conn.close()
    conn, _cache = _push_consumer()
    bad = _push_peer(spawn_peer, conn, fault="die")
    bad.expect(("CHUNK",), timeout_s=30)
    bad.proc.kill()  # one block pushed, three to go
    tokens, errors = _pull(conn, bad.params["LBNHC"], [1, 2, 3, 4], remote_load, "c-dead")
    assert errors == {1, 2, 3, 4} and "broke" in conn.load_error_reasons["c-dead"]
    assert conn._staged_bytes == 0
    conn.close()


def _pair(**producer_cfg: Any) -> tuple[P2pConnector, P2pConnector, Any]:
    layout = CASES["LBNHC"][0]
    prod = P2pConnector(P2pConfig(timeout_s=TIMEOUT, **producer_cfg), block_size=layout.block_size)
    prod.register_kv_caches(random_cache(layout, seed=1), layout)
    cons = P2pConnector(P2pConfig(timeout_s=TIMEOUT, role="consumer"), block_size=layout.block_size)
    cache = random_cache(layout, seed=2)
    cons.register_kv_caches(cache, layout)
    return prod, cons, cache


def test_roles_and_consumer_requests_are_never_held(make_request: Callable[..., Any]) -> None:
    prod, cons, _cache = _pair(role="producer")
    bs = prod.block_size
    req = make_request("p", 4, bs)
    delay, params = prod.request_finished(req, [3, 9, 1, 6])
    assert delay and params is not None and params["block_ids"] == [3, 9, 1, 6]
    assert cons.request_finished(make_request("own", 2, bs), [0, 1]) == (False, None)  # consumer
    producer_side = make_request("x", 2, bs)
    prod.add_remote_request("x", params)
    assert prod.get_num_new_matched_tokens(producer_side, 0) == (0, False)  # producer never loads
    # the engine may accept fewer tokens than offered: only those producer blocks are pulled
    c = make_request("c", 4, bs)
    cons.add_remote_request("c", params)
    assert cons.get_num_new_matched_tokens(c, 0) == (4 * bs, True)
    cons.update_state_after_alloc(c, [5, 6, 7, 8], 2 * bs)
    (load,) = cons.build_connector_meta().loads
    assert load.block_ids == (5, 6) and load.params is not None and load.params.block_ids == (3, 9)
    assert cons.request_finished(c, [5, 6, 7, 8]) == (False, None)  # loaded, never served on
    prod.close()
    cons.close()


def test_abandoned_request_is_freed_and_later_pulls_are_refused(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    prod, cons, cache = _pair(abandon_after_s=0.2)
    req = make_request("p", 2, prod.block_size)
    _delay, params = prod.request_finished(req, [3, 9])
    assert params is not None
    time.sleep(0.3)
    assert prod.get_finished()[0] == {"p"}  # given up on: the engine frees the blocks
    before = block_bytes(cache, cons.kv.layouts[0], 5)
    tokens, errors = _pull(cons, params, [5, 6], remote_load, "late")
    assert tokens == 2 * prod.block_size and errors == {5, 6}
    assert "not held for sending" in cons.load_error_reasons["late"]
    assert torch.equal(block_bytes(cache, cons.kv.layouts[0], 5), before)
    prod.close()
    cons.close()


@pytest.mark.parametrize("early", [False, True], ids=["answer_first", "early_ask"])
def test_restarted_producer_on_the_same_address_gets_a_fresh_session(
    early: bool, spawn_peer: Callable[..., Any], remote_load: Any
) -> None:
    """``early_ask``: the consumer asks from start_load_kv on its connected session (the order
    NCCL sessions use, here over gloo): the dead session breaks under that ask, and the pull
    goes once more on a fresh session, as a stale cached session does without it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {
        "transport": "p2p",
        "timeout_s": TIMEOUT,
        "port": port,
        "producers": _producers(["LBNHC"]),
    }
    conn, cache = _consumer("LBNHC")
    conn._post_before_ask = early
    first = spawn_peer(cfg)
    assert _pull(conn, first.params["LBNHC"], [1, 2, 3, 4], remote_load, "r1")[1] == set()
    first.stop()  # the cached session now points at a dead process
    second = spawn_peer(cfg)  # same address, new process
    tokens, errors = _pull(conn, second.params["LBNHC"], [5, 6, 7, 8], remote_load, "r2")
    assert tokens == 4 * conn.block_size and errors == set(), conn.load_error_reasons
    for b, w in zip([5, 6, 7, 8], _want(remote_load, "LBNHC"), strict=True):
        assert torch.equal(block_bytes(cache, conn.kv.layouts[0], b), w)
    conn.close()


def test_pull_outliving_abandon_keeps_blocks_pinned_until_it_ends(
    make_request: Callable[..., Any], remote_load: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: the abandon timer fires while a pull is mid-transfer. Forced: the producer's
    sends stop after the first chunks (an event), its clock jumps past abandon_after_s, and its
    poll must not report the request in done_sending (the engine would reuse the blocks under the
    gathers still to come). Without the pin, get_finished returns {"p"} here."""
    import threading

    layout = CASES["LBNHC"][0]
    row = layout.num_layers * layout.page_bytes
    prod = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, abandon_after_s=1.5, buffer_bytes=2 * row),
        block_size=layout.block_size,
    )
    src = random_cache(layout, seed=1)
    prod.register_kv_caches(src, layout)
    cons = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, role="consumer", buffer_bytes=2 * row),
        block_size=layout.block_size,
    )
    cache = random_cache(layout, seed=2)
    cons.register_kv_caches(cache, layout)
    mid, resume = threading.Event(), threading.Event()
    original = Wire.wait

    def stall_once(wire: Wire, work: Any) -> None:  # the producer's first wait: 2 chunks sent
        if wire.kv is prod.kv and not mid.is_set():
            mid.set()
            assert resume.wait(30)
        original(wire, work)

    monkeypatch.setattr(Wire, "wait", stall_once)
    _delay, params = prod.request_finished(make_request("p", 4, prod.block_size), [3, 9, 1, 6])
    assert params is not None
    want = [block_bytes(src, layout, b) for b in (3, 9, 1, 6)]
    assert remote_load.start(cons, params, [4, 5, 6, 7], "c") == 4 * cons.block_size
    assert mid.wait(30)  # mid-transfer
    prod._clock = lambda: time.monotonic() + 3600  # the abandon timer fires
    assert prod.get_finished()[0] == set()  # still pinned: the pull has not ended
    resume.set()
    _elapsed, errors = remote_load.finish(cons, "c", 3 * TIMEOUT + 10, poll_s=0.01)
    assert errors == set(), cons.load_error_reasons
    # listed only once the pull ended (the consumer's "done"); the engine then reuses the blocks
    deadline = time.monotonic() + 30
    while "p" not in prod.get_finished()[0]:
        assert time.monotonic() < deadline, "the request is released once its pull ended"
        time.sleep(0.005)
    for b, w in zip([4, 5, 6, 7], want, strict=True):
        assert torch.equal(block_bytes(cache, layout, b), w)
    prod.close()
    cons.close()


def test_pull_asked_after_abandon_is_refused_even_before_the_poll(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    prod, cons, cache = _pair(abandon_after_s=1.5)
    _delay, params = prod.request_finished(make_request("p", 2, prod.block_size), [3, 9])
    assert params is not None
    prod._clock = lambda: time.monotonic() + 3600  # past abandon_after_s, not yet polled
    before = block_bytes(cache, cons.kv.layouts[0], 5)
    tokens, errors = _pull(cons, params, [5, 6], remote_load, "late")
    assert tokens == 2 * prod.block_size and errors == {5, 6}
    assert "no pull started within abandon_after_s" in cons.load_error_reasons["late"]
    assert torch.equal(block_bytes(cache, cons.kv.layouts[0], 5), before)
    assert prod.get_finished()[0] == {"p"}  # abandoned now: nothing reads its blocks
    prod.close()
    cons.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_producer_restarted_with_another_layout_gets_a_fresh_session(
    spawn_peer: Callable[..., Any], remote_load: Any
) -> None:
    """Issue 28: the producer on port X exits while idle; a new one on port X serves another
    layout the consumer converts. The cached session named the dead producer's layouts, and every
    request was refused ("now serves layouts [...]") until the consumer restarted."""
    port = _free_port()
    cfg: dict[str, Any] = {"transport": "p2p", "timeout_s": TIMEOUT, "port": port}
    conn, cache = _consumer("LBNHC")
    first = spawn_peer({**cfg, "producers": _producers(["LBNHC"])})
    assert _pull(conn, first.params["LBNHC"], [1, 2, 3, 4], remote_load, "r1")[1] == set()
    first.stop()
    second = spawn_peer({**cfg, "producers": _producers(["restarted_hnd"])})
    params = second.params["restarted_hnd"]
    tokens, errors = _pull(conn, params, [5, 6, 7, 8], remote_load, "r2")
    assert tokens == 4 * conn.block_size and errors == set(), conn.load_error_reasons
    for b, w in zip([5, 6, 7, 8], _want(remote_load, "restarted_hnd"), strict=True):
        assert torch.equal(block_bytes(cache, conn.kv.layouts[0], b), w)
    conn.close()


def test_producer_of_another_model_is_refused(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    """model_fingerprint: a consumer never loads another model's KV, whether the params say so
    (refused at planning: zero tokens) or only the live producer does (a load error)."""
    layout = CASES["LBNHC"][0]
    prod = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, model_fingerprint="model-a"), block_size=layout.block_size
    )
    prod.register_kv_caches(random_cache(layout, seed=1), layout)
    cons = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, role="consumer", model_fingerprint="model-b"),
        block_size=layout.block_size,
    )
    cache = random_cache(layout, seed=2)
    cons.register_kv_caches(cache, layout)
    _delay, params = prod.request_finished(make_request("p", 2, prod.block_size), [3, 9])
    assert params is not None and params["model_fingerprint"] == "model-a"
    assert remote_load.start(cons, params, [5, 6], "c") == 0
    assert "model fingerprint 'model-a'" in cons.load_error_reasons["c"]
    assert remote_load.start(cons, {**params, "transport": "nixl"}, [5, 6], "t") == 0
    assert "transport 'nixl'" in cons.load_error_reasons["t"]
    forged = {**params, "model_fingerprint": "model-b"}  # params that lie about the model
    before = block_bytes(cache, layout, 5)
    tokens, errors = _pull(cons, forged, [5, 6], remote_load, "forged")
    assert tokens == 2 * prod.block_size and errors == {5, 6}
    assert "model 'model-a'" in cons.load_error_reasons["forged"]
    assert torch.equal(block_bytes(cache, layout, 5), before)
    prod.close()
    cons.close()


def _held_producer(monkeypatch: pytest.MonkeyPatch, make_request: Callable[..., Any]) -> Any:
    """A producer holding 50 finished requests (abandon_after_s=60), its scans counted."""
    layout = make_layout("BLNHC", num_blocks=64)
    prod = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, abandon_after_s=60.0), block_size=layout.block_size
    )
    prod.register_kv_caches(random_cache(layout, seed=1), layout)
    now = time.monotonic()
    prod._clock = lambda: now
    for i in range(50):
        prod.request_finished(make_request(f"r{i}", 1, layout.block_size), [i])
    prod.scans = 0
    original = type(prod)._release_locked

    def counted(self: Any, *a: Any) -> None:
        self.scans += 1
        original(self, *a)

    monkeypatch.setattr(type(prod), "_release_locked", counted)
    return prod, now


def test_get_finished_scans_held_requests_only_once_a_deadline_passed(
    monkeypatch: pytest.MonkeyPatch, make_request: Callable[..., Any]
) -> None:
    """Issue 30: get_finished runs every engine step, on the thread whose GIL the transfer
    threads wait for, and walked every held request each time. Before the earliest abandon
    deadline a poll touches none; once it passed, one scan releases the abandoned ones."""
    prod, now = _held_producer(monkeypatch, make_request)
    for _ in range(20):
        assert prod.get_finished()[0] == set()
    assert prod.scans == 0
    prod._clock = lambda: now + 61  # every abandon deadline passed
    assert len(prod.get_finished()[0]) == 50  # released by one scan
    assert prod.scans == 50
    assert prod.get_finished()[0] == set() and prod.scans == 50  # nothing held: nothing due
    prod.close()


def test_scan_count_check_can_fail(
    monkeypatch: pytest.MonkeyPatch, make_request: Callable[..., Any]
) -> None:
    """Planted bug: a poll that always scans (the old behaviour) counts every held request on
    every call, so the zero above is a real bound."""
    prod, _now = _held_producer(monkeypatch, make_request)
    for _ in range(3):
        prod._hold_due = float("-inf")
        prod.get_finished()
    assert prod.scans == 3 * 50
    prod.close()


def test_close_ends_the_producers_sessions_and_store(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    """A producer's close() returns with its session threads ended (their process groups gone
    with them) and its store dropped: nothing of the transport is left for interpreter exit to
    destroy, where a process that exited right after close() sometimes aborted ("terminate
    called without an active exception")."""
    prod, cons, _cache = _pair()
    req = make_request("p", 2, prod.block_size)
    _delay, params = prod.request_finished(req, [3, 9])
    assert params is not None
    _tokens, errors = _pull(cons, params, [5, 6], remote_load, "c")
    assert errors == set()

    def sessions() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "kv-p2p-session" and t.is_alive()]

    assert sessions(), "the pull ran on a session thread of the producer"
    prod.close()  # (first: the consumer's end of the session is still open)
    assert sessions() == []
    assert prod._store is None
    cons.close()


def test_side_channel_close_waits_for_its_sessions() -> None:
    """``SideChannelServer.close`` returns once each session's handler returned, a slow
    teardown included (a session's process group is destroyed on its way out). Planted: a close
    that only shuts the sockets returns while the handler still runs."""
    import socket

    from kv_connectors._sidechannel import SideChannelServer

    started, ended = threading.Event(), threading.Event()

    def handler(sock: socket.socket) -> None:
        started.set()
        with contextlib.suppress(OSError):
            sock.recv(1)  # returns when close() shuts the socket down
        time.sleep(0.5)  # a transport's teardown
        ended.set()

    srv = SideChannelServer("127.0.0.1", 0, handler, name="t")
    client = socket.create_connection((srv.host, srv.port))
    assert started.wait(5)
    srv.close()
    assert ended.is_set()
    client.close()
