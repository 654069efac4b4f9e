"""Several layer-wise loads from one producer in one consumer step (issue 30): one pull carries
them segment-major, so ``wait_for_layer_load(i)`` returns once layer ``i`` of *every* request
landed while the producer still computes later layers (over gloo between two processes, the
producer held before its last layer); a plan that skips a request, a producer killed with three
loads under way, a failure reported once per request, and a late chunk that never lands in
blocks already reported as load errors -- each check with its planted twin."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_connectors import P2pConfig, P2pConnector, _streaming
from kv_connectors._p2p_wire import Wire
from kv_connectors._streaming import Arriving
from kv_connectors.testing import make_layout, random_cache

TIMEOUT = 5.0
LAYOUT = make_layout("LBNHC", num_layers=3)
# three requests of one producer step (uneven lengths: a chunk never spans two requests)
THEIRS = [[3, 9, 1, 6], [0, 2], [12, 13, 14]]
MINE = [[7, 2, 11, 5], [0, 15], [8, 9, 10]]
# the planted twin's: equal lengths (gloo aborts the process on a message of the wrong size)
EVEN, MINE_EVEN = [[3, 9, 1], [0, 2, 4], [12, 13, 14]], [[7, 2, 11], [0, 15, 5], [8, 9, 10]]
ROW = LAYOUT.num_layers * LAYOUT.page_bytes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # random bytes hold NaNs: compare bytes, not values


def _exact(dst: Any, src: Any, layer: int, k: int, theirs: Any = THEIRS, mine: Any = MINE) -> bool:
    """Request ``k``'s blocks hold the producer's bytes at ``layer``."""
    pairs = zip(theirs[k], mine[k], strict=True)
    return all(torch.equal(_bytes(dst[layer][m]), _bytes(src[layer][t])) for t, m in pairs)


def _spawn(spawn_peer: Callable[..., Any], theirs: Any = THEIRS) -> Any:
    """A producer process streaming the three requests in one step, its last layer held."""
    producer = {"name": "s", "layout": LAYOUT.to_json(), "seed": 5, "block_ids": theirs[0]}
    cfg = {"transport": "p2p", "timeout_s": TIMEOUT, "producers": [producer]}
    producer.update(stream=True, requests=theirs)
    return spawn_peer(cfg)


def _consumer(timeout_s: float = TIMEOUT) -> tuple[P2pConnector, Any]:
    # chunks of 3 blocks a segment: request 0 takes two messages per layer
    cfg = P2pConfig(timeout_s=timeout_s, role="consumer", layerwise=True, buffer_bytes=2 * ROW)
    conn = P2pConnector(cfg, block_size=LAYOUT.block_size)
    cache = random_cache(LAYOUT, seed=7)
    conn.register_kv_caches(cache, LAYOUT)
    return conn, cache


def _start_step(
    conn: P2pConnector,
    params: list[dict[str, Any]],
    make_request: Callable[..., Any],
    mine: Any = MINE,
) -> None:
    """Admit every request (as the engine does), then one step's metadata: all load in it. The
    session to the producer is made first, as by earlier requests (three pulls racing to make
    it would each make their own, and would not contend)."""
    conn._peer(params[0]["host"], params[0]["port"])
    for k, p in enumerate(params):
        req = make_request(f"c{k}", len(mine[k]), conn.block_size, seed=k)
        conn.add_remote_request(f"c{k}", p)
        tokens, load_async = conn.get_num_new_matched_tokens(req, 0)
        assert (tokens, load_async) == (len(mine[k]) * conn.block_size, False)
        conn.update_state_after_alloc(req, mine[k], tokens)
    conn.start_load_kv(conn.build_connector_meta())


def _pull_ended(conn: P2pConnector) -> None:
    deadline = time.monotonic() + 3 * TIMEOUT
    while conn._in_step and time.monotonic() < deadline:
        conn.get_finished()
        time.sleep(0.01)
    assert not conn._in_step, "the pull thread ends (bounded)"


def test_three_loads_of_one_step_land_layer_by_layer_while_the_producer_computes(
    spawn_peer: Callable[..., Any], make_request: Callable[..., Any]
) -> None:
    """Before issue 30's segment-major pull, requests 1 and 2 queued behind request 0's whole
    pull, which waits for the held last layer: ``wait_for_layer_load(0)`` timed out for them."""
    peer = _spawn(spawn_peer)
    src = random_cache(LAYOUT, seed=5)
    conn, dst = _consumer()
    before = [t.clone() for t in dst]
    assert not any(_exact(before, src, layer, k) for layer in range(3) for k in range(3))
    _start_step(conn, [peer.params[f"s-{k}"] for k in range(3)], make_request)
    for layer in (0, 1):
        conn.wait_for_layer_load(layer)
        assert all(_exact(dst, src, layer, k) for k in range(3)), layer  # byte for byte
    time.sleep(0.2)  # time enough for a stray send of the last layer to land
    assert torch.equal(_bytes(dst[2]), _bytes(before[2]))  # nothing of the held layer yet
    assert peer.proc.stdin is not None
    peer.proc.stdin.write("SAVE_LAST\n")
    peer.proc.stdin.flush()
    conn.wait_for_layer_load(2)
    assert all(_exact(dst, src, layer, k) for layer in range(3) for k in range(3))
    assert conn.get_block_ids_with_load_errors() == set(), conn.load_error_reasons
    mine = {b for part in MINE for b in part}
    for layer in range(3):  # no stray write outside the loaded blocks
        for b in set(range(LAYOUT.num_blocks)) - mine:
            assert torch.equal(_bytes(dst[layer][b]), _bytes(before[layer][b])), (layer, b)
    sent = {peer.expect(("SENT",), timeout_s=30).split()[1] for _ in range(3)}
    assert sent == {f"req-s-{k}" for k in range(3)}  # each freed after its "done"
    _pull_ended(conn)
    conn.close()


def test_a_plan_that_skips_a_request_is_caught(
    spawn_peer: Callable[..., Any],
    make_request: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted bug: the consumer's segment loop skips request 1 in layer 0 (the producer sends
    it): request 1's layer 0 never lands (a load error) and request 2's holds request 1's
    bytes -- the byte and error checks above fail."""
    real = _streaming.plan_layers

    def skipping(counts: list[int], **kw: Any) -> Any:
        return [ch for ch in real(counts, **kw) if (ch.part, ch.segment) != (1, 0)]

    monkeypatch.setattr(_streaming, "plan_layers", skipping)
    peer = _spawn(spawn_peer, EVEN)
    src = random_cache(LAYOUT, seed=5)
    conn, dst = _consumer(timeout_s=2.0)
    _start_step(conn, [peer.params[f"s-{k}"] for k in range(3)], make_request, MINE_EVEN)
    conn.wait_for_layer_load(0)
    errors = conn.get_block_ids_with_load_errors()
    assert not all(_exact(dst, src, 0, k, EVEN, MINE_EVEN) for k in range(3)) or errors
    assert errors == set(MINE_EVEN[1])  # request 1's layer 0 never landed
    assert not _exact(dst, src, 0, 2, EVEN, MINE_EVEN)  # request 2's holds request 1's bytes
    peer.proc.kill()
    _pull_ended(conn)
    conn.close()


def test_producer_killed_with_three_loads_under_way(
    spawn_peer: Callable[..., Any], make_request: Callable[..., Any]
) -> None:
    """Killed before its last layer: each request's blocks are reported once, at once (the group
    broke), never again when the pull thread ends; the landed layers stay byte-exact."""
    peer = _spawn(spawn_peer)
    src = random_cache(LAYOUT, seed=5)
    conn, dst = _consumer()
    _start_step(conn, [peer.params[f"s-{k}"] for k in range(3)], make_request)
    for layer in (0, 1):
        conn.wait_for_layer_load(layer)
    assert all(_exact(dst, src, layer, k) for layer in (0, 1) for k in range(3))
    peer.proc.kill()
    peer.proc.wait(timeout=10)
    start = time.monotonic()
    conn.wait_for_layer_load(2)
    assert time.monotonic() - start < TIMEOUT  # detected when the group broke
    assert conn.get_block_ids_with_load_errors() == {b for part in MINE for b in part}
    assert set(conn.load_error_reasons) == {"c0", "c1", "c2"}
    _pull_ended(conn)
    assert conn.get_block_ids_with_load_errors() == set()  # exactly once
    conn.close()


def _in_process(
    make_request: Callable[..., Any],
    consumer_timeout_s: float,
    num_requests: int,
    forge: int | None = None,
) -> tuple[P2pConnector, P2pConnector, Any, Any, Any, list[Any]]:
    """A producer connector streaming ``num_requests`` requests (layer 0 computed, layer 1
    not) and a layer-wise consumer in this process, its step started (``forge``: that
    request's params name a request the producer does not hold)."""
    layout = make_layout("LBNHC", num_layers=2)
    prod = P2pConnector(P2pConfig(timeout_s=TIMEOUT), block_size=layout.block_size)
    src = random_cache(layout, seed=5)
    prod.register_kv_caches(src, layout)
    cfg = P2pConfig(timeout_s=consumer_timeout_s, role="consumer", layerwise=True)
    cons = P2pConnector(cfg, block_size=layout.block_size)
    dst = random_cache(layout, seed=7)
    cons.register_kv_caches(dst, layout)
    reqs = [make_request(f"p{k}", len(THEIRS[k]), 4, seed=k) for k in range(num_requests)]
    params = [prod.stream_request(r, THEIRS[k]) for k, r in enumerate(reqs)]
    if forge is not None:
        params[forge] = {**params[forge], "request_id": "gone"}
    meta = prod.build_connector_meta()
    prod.start_load_kv(meta)
    prod.save_kv_layer(0, meta)
    _start_step(cons, params, make_request)
    return prod, cons, src, dst, meta, reqs


@pytest.mark.parametrize("bug", [None, "report_again"])
def test_a_failed_load_is_reported_once(
    bug: str | None, make_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 1 never comes: both loads are reported at its wait, and not again when the pull
    thread ends (planted bug: every end reports)."""
    if bug:
        monkeypatch.setattr(Arriving, "claim_report", lambda self: True)
    prod, cons, _src, _dst, _meta, _reqs = _in_process(make_request, 1.0, 2)
    cons.wait_for_layer_load(0)
    cons.wait_for_layer_load(1)  # bounded: returns at the timeout
    assert cons.get_block_ids_with_load_errors() == set(MINE[0]) | set(MINE[1])
    _pull_ended(cons)
    assert (cons.get_block_ids_with_load_errors() == set()) is (bug is None)
    prod.close()
    cons.close()


@pytest.mark.parametrize("bug", [None, "no_gate"])
def test_a_late_chunk_never_lands_in_reported_blocks(
    bug: str | None, make_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's old "Not yet": a layer-wise load times out in ``wait_for_layer_load`` and is
    reported; the engine recomputes into its blocks (here: zeros); then the producer computes
    the layer after all and its chunk reaches the consumer's pull thread (held, then let go).
    It must not land (planted bug: the gate lets it -- the recomputed bytes are overwritten)."""
    if bug:
        monkeypatch.setattr(Arriving, "land", lambda self, write: write() or True)
    original = Wire.wait
    posted, release = threading.Event(), threading.Event()
    waits: list[Wire] = []

    def wait(wire: Wire, work: Any, deadline: float | None = None) -> None:
        if deadline is None:  # (whole-rows transfers, the producer's sends)
            return original(wire, work)
        waits.append(wire)
        if len(waits) == 2:  # the consumer's wait for layer 1's message (it is posted)
            posted.set()
            assert release.wait(30)
            deadline = time.monotonic() + TIMEOUT  # the late chunk is received after all
        return original(wire, work, deadline)

    monkeypatch.setattr(Wire, "wait", wait)
    prod, cons, src, dst, meta, _reqs = _in_process(make_request, 1.0, 1)
    cons.wait_for_layer_load(0)
    assert posted.wait(10)
    cons.wait_for_layer_load(1)  # times out: reported, the engine will recompute
    assert cons.get_block_ids_with_load_errors() == set(MINE[0])
    for m in MINE[0]:
        dst[1][m].zero_()  # the recomputed KV
    prod.save_kv_layer(1, meta)  # the producer computes layer 1 late and sends it
    prod.wait_for_save()
    deadline = time.monotonic() + 10
    while prod._sendable["p0"].pulls and time.monotonic() < deadline:  # its send ended
        time.sleep(0.01)
    release.set()
    _pull_ended(cons)
    late = [m for m in MINE[0] if bool(dst[1][m].ne(0).any())]
    assert (late == []) is (bug is None), late
    if bug:  # the twin's overwrite is the producer's layer 1, byte for byte
        pairs = zip(THEIRS[0], MINE[0], strict=True)
        assert all(torch.equal(_bytes(dst[1][m]), _bytes(src[1][t])) for t, m in pairs)
    prod.close()
    cons.close()


@pytest.mark.parametrize("bug", [None, "refuse_all"])
def test_a_refused_pull_fails_only_its_own_load(
    bug: str | None, make_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer refuses one request of the step's pull (not held): that load is reported
    at once, the other two load byte for byte (planted bug: one refusal refuses the whole
    pull, as one ``pull`` a request once did -- every load fails)."""
    if bug:
        real = _streaming.request

        def refuse_all(sock: Any, msg: dict[str, Any]) -> dict[str, Any]:
            reply = real(sock, msg)
            bad = [a for a in reply.get("pulls", []) if not a.get("ok")]
            return {"ok": False, "error": bad[0]["error"]} if bad else reply

        monkeypatch.setattr(_streaming, "request", refuse_all)
    prod, cons, src, dst, meta, _reqs = _in_process(make_request, TIMEOUT, 3, forge=1)
    prod.save_kv_layer(1, meta)
    prod.wait_for_save()
    for layer in (0, 1):
        cons.wait_for_layer_load(layer)
    errors = cons.get_block_ids_with_load_errors()
    good = all(_exact(dst, src, layer, k) for layer in (0, 1) for k in (0, 2))
    assert (good and errors == set(MINE[1])) is (bug is None), errors
    if bug is None:
        assert "not held" in cons.load_error_reasons["c1"]
    _pull_ended(cons)
    prod.close()
    cons.close()
