"""Layer-wise P2P streaming (issue 30): a producer serves a request while its layers are computed
(``stream_request`` + ``save_kv_layer``), a ``layerwise`` consumer loads it inside its step and
``wait_for_layer_load(i)`` waits for layer ``i`` only. Over gloo between two processes (the
producer holds its last layer back until the consumer has read layer 0) and in one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_connectors import P2pConfig, P2pConnector
from kv_connectors._p2p_wire import Wire
from kv_connectors._streaming import _STREAM_DRAIN_POLL_S
from kv_connectors.testing import make_layout, random_cache
from kv_connectors.views import RegisteredKV

TIMEOUT = 5.0
THEIRS, MINE = [3, 9, 1, 6], [7, 2, 11, 5]


def _layerwise_consumer(layout: Any, **cfg: Any) -> tuple[P2pConnector, Any]:
    conn = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, role="consumer", layerwise=True, **cfg),
        block_size=layout.block_size,
    )
    cache = random_cache(layout, seed=7)
    conn.register_kv_caches(cache, layout)
    return conn, cache


def _start(conn: P2pConnector, params: dict[str, Any], make_request: Callable[..., Any]) -> None:
    req = make_request("c", len(MINE), conn.block_size)
    conn.add_remote_request("c", params)
    tokens, load_async = conn.get_num_new_matched_tokens(req, 0)
    assert tokens == len(MINE) * conn.block_size
    assert load_async is False  # identical layouts: the load runs inside the step
    conn.update_state_after_alloc(req, MINE, tokens)
    conn.start_load_kv(conn.build_connector_meta())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # random bytes hold NaNs: compare bytes, not values


def _layer_exact(dst: Any, src: Any, layer: int) -> bool:
    pairs = zip(THEIRS, MINE, strict=True)
    return all(torch.equal(_bytes(dst[layer][m]), _bytes(src[layer][t])) for t, m in pairs)


def test_consumer_reads_layer_0_before_the_producer_computed_the_last(
    spawn_peer: Callable[..., Any],
    make_request: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = make_layout("LBNHC", num_layers=3)
    uploads: list[int] = []  # the consumer's block-id uploads (one a pull, sliced per layer)
    ids_tensor = RegisteredKV.ids_tensor

    def counted(self: RegisteredKV, block_ids: Any) -> Any:
        uploads.append(len(block_ids))
        return ids_tensor(self, block_ids)

    monkeypatch.setattr(RegisteredKV, "ids_tensor", counted)
    peer = spawn_peer(
        {
            "transport": "p2p",
            "timeout_s": TIMEOUT,
            "producers": [
                {
                    "name": "s",
                    "layout": layout.to_json(),
                    "seed": 5,
                    "block_ids": THEIRS,
                    "stream": True,
                }
            ],
        }
    )
    src = random_cache(layout, seed=5)
    conn, dst = _layerwise_consumer(layout)
    before = [t.clone() for t in dst]
    # the "not arrived" check below can fail: the old bytes differ from the producer's
    assert not _layer_exact(before, src, 2)
    _start(conn, peer.params["s"], make_request)
    conn.wait_for_layer_load(0)
    assert _layer_exact(dst, src, 0)  # layer 0 is in place, byte for byte
    conn.wait_for_layer_load(1)
    assert _layer_exact(dst, src, 1)
    time.sleep(0.2)  # time enough for a stray send of the last layer to land
    for m in MINE:  # the producer has not computed its last layer: nothing of it arrived
        assert torch.equal(_bytes(dst[2][m]), _bytes(before[2][m]))
    assert peer.proc.stdin is not None
    peer.proc.stdin.write("SAVE_LAST\n")
    peer.proc.stdin.flush()
    conn.wait_for_layer_load(2)
    assert all(_layer_exact(dst, src, layer) for layer in range(3))
    assert conn.get_block_ids_with_load_errors() == set(), conn.load_error_reasons
    assert uploads == [len(MINE)], uploads  # three layers landed from one upload
    peer.expect(("SAVED",), timeout_s=30)
    peer.expect(("SENT req-s",), timeout_s=30)  # freed after request_finished and the "done"
    deadline = time.monotonic() + 5
    recving: set[str] = set()
    while conn._in_step and time.monotonic() < deadline:  # the pull thread ends
        recving |= conn.get_finished()[1]
        time.sleep(0.01)
    assert "c" not in recving  # a load inside the step never goes through done_recving
    conn.close()


def _producer(layout: Any) -> tuple[P2pConnector, Any]:
    prod = P2pConnector(P2pConfig(timeout_s=TIMEOUT), block_size=layout.block_size)
    src = random_cache(layout, seed=5)
    prod.register_kv_caches(src, layout)
    return prod, src


@pytest.mark.parametrize("order", ["LBNHC", "BLNHC"])
def test_streamed_blocks_are_held_until_request_finished(
    order: str, make_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer's "done" may come before the engine finished the request on the producer:
    its blocks are still the request's then, never reported in done_sending. A cross-layer
    layout streams as one segment (all layers at once)."""
    layout = make_layout(order, num_layers=2)
    prod, src = _producer(layout)
    conn, dst = _layerwise_consumer(layout)
    polls: list[float] = []  # each drain's longest poll interval
    drain = Wire.drain
    monkeypatch.setattr(Wire, "drain", lambda w, d, p=2e-5: (polls.append(p), drain(w, d, p)))
    req = make_request("p", len(THEIRS), layout.block_size)
    params = prod.stream_request(req, THEIRS)
    meta = prod.build_connector_meta()
    assert [s.request_id for s in meta.saves] == ["p"]
    prod.start_load_kv(meta)
    _start(conn, params, make_request)
    for layer in range(2):
        prod.save_kv_layer(layer, meta)
    prod.wait_for_save()
    for layer in range(2):
        conn.wait_for_layer_load(layer)
    assert all(_layer_exact(_layers(dst, layout), _layers(src, layout), i) for i in range(2))
    deadline = time.monotonic() + 5
    while conn._in_step and time.monotonic() < deadline:
        conn.get_finished()
        time.sleep(0.01)
    time.sleep(0.1)
    assert prod.get_finished()[0] == set()  # the consumer is done, the engine is not
    assert prod.request_finished(req, THEIRS) == (True, params)
    assert "p" in prod.get_finished()[0]
    # both sides' last waits poll coarsely (no step waits for them; see Wire.drain)
    assert polls.count(_STREAM_DRAIN_POLL_S) == 2, polls
    prod.close()
    conn.close()


def _layers(cache: Any, layout: Any) -> list[torch.Tensor]:
    """Per-layer tensors ``[B, ...]`` of a per-layer list or a cross-layer slab."""
    if isinstance(cache, list):
        return cache
    return [cache[:, i] for i in range(layout.num_layers)]


def test_producer_that_never_computes_the_layer_is_a_load_error(
    make_request: Callable[..., Any],
) -> None:
    # (2.5 s: at 1 s a busy 2-core machine missed layer 0, the session's gloo group being made
    # inside the same bound)
    limit = 2.5
    layout = make_layout("LBNHC", num_layers=2)
    prod = P2pConnector(P2pConfig(timeout_s=limit), block_size=layout.block_size)
    prod.register_kv_caches(random_cache(layout, seed=5), layout)
    conn = P2pConnector(
        P2pConfig(timeout_s=limit, role="consumer", layerwise=True), block_size=layout.block_size
    )
    conn.register_kv_caches(random_cache(layout, seed=7), layout)
    params = prod.stream_request(make_request("p", len(THEIRS), layout.block_size), THEIRS)
    meta = prod.build_connector_meta()
    prod.start_load_kv(meta)
    prod.save_kv_layer(0, meta)  # layer 1 never comes
    _start(conn, params, make_request)
    conn.wait_for_layer_load(0)
    start = time.monotonic()
    conn.wait_for_layer_load(1)  # bounded: returns at the timeout, the blocks reported
    assert time.monotonic() - start < limit + 3
    assert conn.get_block_ids_with_load_errors() == set(MINE)
    assert "layer-wise load" in conn.load_error_reasons["c"]
    prod.close()
    conn.close()


def test_stream_request_refuses_what_it_cannot_stream(make_request: Callable[..., Any]) -> None:
    layout = make_layout("LBNHC")
    cons, _ = _layerwise_consumer(layout)
    with pytest.raises(ValueError, match="role is 'consumer'"):
        cons.stream_request(make_request("x", 2, layout.block_size), [1, 2])
    prod, _ = _producer(layout)
    prod.stream_request(make_request("x", 2, layout.block_size), [1, 2])
    with pytest.raises(ValueError, match="already streamed"):
        prod.stream_request(make_request("x", 2, layout.block_size), [1, 2])
    with pytest.raises(TypeError, match="layerwise='yes'"):
        P2pConfig(layerwise="yes")  # type: ignore[arg-type]
    prod.close()
    cons.close()


class _Event:
    """A CUDA event stand-in: ``done`` says whether its work ran."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_step_settles_its_load_by_landed_bytes_not_by_marks() -> None:
    """On CUDA a segment is marked when its landing is enqueued: the step's end waits for the
    landings to run (or the pull to verify) and reports a failure set meanwhile."""
    from kv_connectors._streaming import Arriving

    soon = time.monotonic() + 0.3
    a = Arriving(2, soon)
    events = [_Event(), _Event()]
    a.mark(0, events[0])
    a.mark(1, events[1])  # every segment marked, nothing landed yet
    assert a.settle(time.monotonic() + 0.05) == "its bytes did not land in time"
    events[0].done = events[1].done = True
    assert a.settle(soon) is None  # both landings ran
    b = Arriving(2, soon)
    b.mark(0, _Event(True))
    b.mark(1, _Event())

    def fail_then_abort() -> None:
        time.sleep(0.05)
        b.fail("ConnectionError: the producer went away")  # before the abort completes events

    threading.Thread(target=fail_then_abort).start()
    assert b.settle(time.monotonic() + 5) == "ConnectionError: the producer went away"
    assert b.claim_report()  # every segment marked: reported all the same
    c = Arriving(1, soon)
    c.verify()  # the pull's receive returned (CPU: marks follow the bytes)
    assert c.settle(soon) is None and not c.claim_report()


def test_a_failed_layerwise_receive_fails_its_loads_before_the_session_is_released(
    make_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The abort that frees a dropped NCCL session ends its pending receives and completes
    their landing events: the loads must be failed before it, or a step settling on those
    events takes them for landed bytes. Planted: failing them after the release (as before)."""
    layout = make_layout("LBNHC", num_layers=2)
    prod, _src = _producer(layout)
    conn, _dst = _layerwise_consumer(layout)
    at_release: list[str | None] = []

    def broken_recv(self: Wire, *a: Any, **kw: Any) -> None:
        raise ConnectionError("the producer went away")

    release = P2pConnector._release_peer

    def recording(self: P2pConnector, sess: Any) -> None:
        at_release.extend(a.failed for a in self._arriving.values())
        release(self, sess)

    monkeypatch.setattr(Wire, "recv", broken_recv)
    monkeypatch.setattr(P2pConnector, "_release_peer", recording)
    req = make_request("p", len(THEIRS), layout.block_size)
    params = prod.stream_request(req, THEIRS)
    _start(conn, params, make_request)
    for layer in range(2):
        conn.wait_for_layer_load(layer)
    conn.wait_for_save()
    assert conn.get_block_ids_with_load_errors() == set(MINE)
    deadline = time.monotonic() + 5
    while not at_release and time.monotonic() < deadline:  # the pull thread ends
        conn.get_finished()
        time.sleep(0.01)
    assert at_release and all(f is not None and "went away" in f for f in at_release), at_release
    prod.close()
    conn.close()


def test_closing_the_consumer_mid_load_fails_the_load_first(
    spawn_peer: Callable[..., Any], make_request: Callable[..., Any]
) -> None:
    """A consumer closed while an in-step load waits for its producer's last layer: the load
    is failed before its session is dropped (whose abort, on NCCL, completes the landing
    events), so the step's settle reports it instead of taking it for landed."""
    layout = make_layout("LBNHC", num_layers=3)
    peer = spawn_peer(
        {"transport": "p2p", "timeout_s": TIMEOUT, "producers": [
            {"name": "s", "layout": layout.to_json(), "seed": 5, "block_ids": THEIRS,
             "stream": True}]}
    )  # fmt: skip
    conn, _dst = _layerwise_consumer(layout)
    _start(conn, peer.params["s"], make_request)
    conn.wait_for_layer_load(0)  # layer 0 landed; the producer holds the last
    (arriving,) = conn._arriving.values()
    conn.close()
    assert arriving.failed is not None and "closed" in arriving.failed
    assert arriving.settle(time.monotonic() + 1) == arriving.failed
