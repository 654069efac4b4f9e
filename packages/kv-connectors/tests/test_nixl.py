"""NixlConnector between two real processes (UCX over loopback, DRAM): byte-exact READs for every
block-addressing shape (per-layer, cross-layer, per-head ranges, quantized, DiffKV, padded pages),
converting READs through the staging buffer (order, block size, TP head split); a killed producer,
a stalled producer, a wrong-layout handshake — each a reported load error within the timeout, and
the next request succeeds; an impossible conversion is refused with a reason."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_connectors import KVTransferParams, NixlConfig
from kv_connectors.testing import block_bytes, make_layout, random_cache
from kv_spec import KVCacheLayout

pytest.importorskip("nixl._api", reason="the nixl extra is not installed")
from kv_connectors.nixl import NixlConnector

TIMEOUT = 5.0
BASE = make_layout("LBNHC")
LAYOUTS: dict[str, KVCacheLayout] = {
    "LBNHC": BASE,
    "BLNHC": make_layout("BLNHC"),
    "LHBNC": make_layout("LHBNC"),  # a block is one range per head
    "BHLNC": make_layout("BHLNC"),
    "fp8_pth": make_layout("BLNHC", dtype="fp8_e4m3", kv_quant="fp8_per_token_head"),
    "diffkv": make_layout("LBNHC", head_size=192, head_size_v=128, num_kv_heads=1),
    "padded": make_layout("LBNHC", page_size_bytes=BASE.page_bytes + 96),
    "after_die": BASE,
    "after_stall": BASE,
    "wrong_layout": make_layout("LBNHC", dtype="bfloat16"),
    "hnd": make_layout("LBHNC"),
    "bs4": make_layout("LHBNC", block_size=4),
    "tp1_h4": make_layout("BHLNC", num_kv_heads=4),
    "runs": BASE,  # consecutive producer blocks: READs of whole runs
    "runs_bs4": make_layout("BLNHC", block_size=4),
}
# producer name -> (consumer layout, consumer TP (rank, size))
CONVERSIONS: dict[str, tuple[KVCacheLayout, tuple[int, int]]] = {
    "hnd": (BASE, (0, 1)),
    "bs4": (make_layout("BLNHC", block_size=8), (0, 1)),
    "tp1_h4": (make_layout("LBHNC", num_kv_heads=2), (1, 2)),
}
PRODUCER_BLOCKS = [3, 9, 1, 6]
RUN_BLOCKS = [4, 5, 6, 10]  # with local [7, 8, 9, 2]: two runs on both sides


def _producers(names: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": n,
            "layout": LAYOUTS[n].to_json(),
            "seed": 10 + list(LAYOUTS).index(n),
            "block_ids": RUN_BLOCKS if n.startswith("runs") else PRODUCER_BLOCKS,
        }
        for n in names
    ]


@pytest.fixture(scope="module")
def healthy(spawn_peer: Callable[..., Any]) -> Any:
    return spawn_peer(
        {"transport": "nixl", "timeout_s": TIMEOUT, "producers": _producers(list(LAYOUTS))}
    )


def _consumer(
    layout: KVCacheLayout, tp: tuple[int, int] = (0, 1), **cfg: Any
) -> tuple[NixlConnector, Any]:
    conn = NixlConnector(
        NixlConfig(timeout_s=TIMEOUT, progress_thread=False, **cfg),
        block_size=layout.block_size,
        tp_rank=tp[0],
        tp_size=tp[1],
    )
    cache = random_cache(layout, seed=100)
    conn.register_kv_caches(cache, layout)
    return conn, cache


@pytest.mark.parametrize(
    "name", ["LBNHC", "BLNHC", "LHBNC", "BHLNC", "fp8_pth", "diffkv", "padded"]
)
def test_read_between_two_processes_is_byte_exact(
    name: str, healthy: Any, remote_load: Any
) -> None:
    conn, cache = _consumer(LAYOUTS[name])
    _read_and_check(conn, cache, name, [7, 2, 11, 5], PRODUCER_BLOCKS, healthy, remote_load)
    healthy.expect((f"SENT req-{name}",), timeout_s=10)  # the notification freed the producer
    conn.close()


def _read_and_check(
    conn: NixlConnector,
    cache: Any,
    name: str,
    local: list[int],
    remote: list[int],
    healthy: Any,
    remote_load: Any,
) -> None:
    """Load producer ``name``'s blocks ``remote`` into ``local``: every byte as the producer's,
    and block 0 (no request's) untouched."""
    layout = LAYOUTS[name]
    src = random_cache(layout, seed=10 + list(LAYOUTS).index(name))
    untouched = block_bytes(cache, layout, 0)
    got = remote_load.start(conn, healthy.params[name], local, f"c-{name}")
    assert got == len(local) * layout.block_size
    _elapsed, errors = remote_load.finish(conn, f"c-{name}", 30)
    assert errors == set(), conn.load_error_reasons
    for b, p in zip(local, remote, strict=True):
        assert torch.equal(block_bytes(cache, layout, b), block_bytes(src, layout, p))
    assert torch.equal(block_bytes(cache, layout, 0), untouched)


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_converting_read_is_exact(name: str, healthy: Any, remote_load: Any) -> None:
    prod = LAYOUTS[name]
    layout, (rank, size) = CONVERSIONS[name]
    # a staging buffer of two producer rows: the request moves in pieces
    conn, cache = _consumer(
        layout, (rank, size), staging_bytes=2 * prod.num_layers * prod.page_bytes
    )
    src = random_cache(prod, seed=10 + list(LAYOUTS).index(name))
    want = remote_load.expected(src, prod, layout, PRODUCER_BLOCKS, rank)
    local = [7, 2, 11, 5][: len(want)]
    assert (
        remote_load.start(conn, healthy.params[name], local, f"c-{name}")
        == len(want) * layout.block_size
    )
    _elapsed, errors = remote_load.finish(conn, f"c-{name}", 30)
    assert errors == set(), conn.load_error_reasons
    for b, w in zip(local, want, strict=True):
        assert torch.equal(block_bytes(cache, layout, b), w)
    healthy.expect((f"SENT req-{name}",), timeout_s=10)
    conn.close()


def test_impossible_conversion_is_refused_with_a_reason(healthy: Any, remote_load: Any) -> None:
    conn, _ = _consumer(make_layout("LBNHC", block_size=6))
    assert remote_load.start(conn, healthy.params["bs4"], [1, 2, 3, 4], "c-bs6") == 0
    assert "do not divide" in conn.load_error_reasons["c-bs6"]
    conn.close()


def test_live_handshake_mismatch_is_a_load_error(healthy: Any, remote_load: Any) -> None:
    conn, cache = _consumer(BASE)
    forged = dict(healthy.params["wrong_layout"])
    keep = {k: v for k, v in forged.items() if k not in ("layouts_json", "compatibility_hashes")}
    forged = KVTransferParams.for_layouts([BASE], **keep).to_dict()
    before = block_bytes(cache, BASE, 2)
    assert remote_load.start(conn, forged, [2, 3, 4, 5], "c-forged") == 4 * BASE.block_size
    _elapsed, errors = remote_load.finish(conn, "c-forged", 30)
    assert errors == {2, 3, 4, 5} and "now serves layouts" in conn.load_error_reasons["c-forged"]
    assert torch.equal(block_bytes(cache, BASE, 2), before)
    conn.close()


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_dead_or_stalled_producer_is_a_load_error_then_next_succeeds(
    fault: str, spawn_peer: Callable[..., Any], healthy: Any, remote_load: Any
) -> None:
    bad = spawn_peer(
        {
            "transport": "nixl",
            "timeout_s": TIMEOUT,
            "fault": fault,
            "producers": _producers(["LBNHC"]),
        }
    )
    conn, cache = _consumer(BASE)
    assert (
        remote_load.start(conn, bad.params["LBNHC"], [4, 5, 6, 7], f"c-{fault}")
        == 4 * BASE.block_size
    )
    if fault == "die":
        bad.expect(("CHUNK",), timeout_s=30)
        bad.proc.kill()
    elapsed, errors = remote_load.finish(conn, f"c-{fault}", TIMEOUT + 30)
    assert errors == {4, 5, 6, 7}
    assert elapsed < TIMEOUT + 10
    bad.proc.kill()
    name = f"after_{fault}"
    assert (
        remote_load.start(conn, healthy.params[name], [8, 9, 10, 11], f"c-next-{fault}")
        == 4 * BASE.block_size
    )
    _elapsed, errors = remote_load.finish(conn, f"c-next-{fault}", 30)
    assert errors == set()
    src = random_cache(BASE, seed=10 + list(LAYOUTS).index(name))
    for b, p in zip([8, 9, 10, 11], PRODUCER_BLOCKS, strict=True):
        assert torch.equal(block_bytes(cache, BASE, b), block_bytes(src, BASE, p))
    conn.close()


def _held_pair(
    make_request: Callable[..., Any],
) -> tuple[NixlConnector, NixlConnector, Any, dict[str, Any]]:
    """A producer holding request "p" (blocks 3, 9, 1, 6; abandon_after_s=1.5) and a consumer,
    in this process (two NIXL agents over UCX loopback)."""
    prod = NixlConnector(
        NixlConfig(timeout_s=TIMEOUT, abandon_after_s=1.5, progress_thread=False),
        block_size=BASE.block_size,
    )
    prod.register_kv_caches(random_cache(BASE, seed=1), BASE)
    cons, cache = _consumer(BASE)
    _delay, params = prod.request_finished(make_request("p", 4, BASE.block_size), PRODUCER_BLOCKS)
    assert params is not None
    return prod, cons, cache, params


def _stall_first_read(cons: NixlConnector, then: Callable[[], None] = lambda: None) -> Any:
    """Stop the consumer's first READ after the producer accepted the pull (blocks pinned) and
    before it is posted; ``then`` runs when it resumes."""
    import threading

    mid, resume = threading.Event(), threading.Event()
    original = cons._read

    def stalled(*args: Any) -> None:
        if not mid.is_set():
            mid.set()
            assert resume.wait(30)
            then()
        original(*args)

    cons._read = stalled  # type: ignore[method-assign]
    return mid, resume


def _finish_both(
    prod: NixlConnector, cons: NixlConnector, rid: str, sent: set[str] | None = None
) -> set[int]:
    """Poll both sides (in one process without progress threads, the producer's agent progresses
    only when polled) until the consumer's load of ``rid`` ended; its blocks with errors (the
    producer's ``done_sending`` is collected into ``sent``)."""
    deadline = time.monotonic() + 30
    recving: set[str] = set()
    while rid not in recving:
        assert time.monotonic() < deadline, f"{rid} never reported in done_recving"
        recving |= cons.get_finished()[1]
        (sent if sent is not None else set()).update(prod.get_finished()[0])
        time.sleep(0.005)
    return cons.get_block_ids_with_load_errors()


def test_read_outliving_abandon_keeps_blocks_pinned_until_notified(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    """Issue 28: the abandon timer fires while a READ is in flight. Without the pin the producer's
    poll lists "p" in done_sending here and the engine reuses the blocks the READ reads."""
    prod, cons, cache, params = _held_pair(make_request)
    src = random_cache(BASE, seed=1)
    mid, resume = _stall_first_read(cons)
    assert remote_load.start(cons, params, [4, 5, 6, 7], "c") == 4 * BASE.block_size
    assert mid.wait(30)
    prod._clock = lambda: time.monotonic() + 3  # past abandon_after_s, within the READ's lease
    assert prod.get_finished()[0] == set()
    resume.set()
    sent: set[str] = set()
    assert _finish_both(prod, cons, "c", sent) == set(), cons.load_error_reasons
    for b, p in zip([4, 5, 6, 7], PRODUCER_BLOCKS, strict=True):
        assert torch.equal(block_bytes(cache, BASE, b), block_bytes(src, BASE, p))
    deadline = time.monotonic() + 30
    while "p" not in sent:  # the READ's notification releases the blocks
        assert time.monotonic() < deadline
        sent |= prod.get_finished()[0]
        time.sleep(0.005)
    prod.close()
    cons.close()


def test_read_finishing_after_its_lease_is_a_load_error(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    """A consumer that stalls past its lease: the producer frees the blocks at the lease's end
    (the consumer may be dead), so the consumer must not report that READ a success."""
    prod, cons, _cache, params = _held_pair(make_request)

    def lease_over() -> None:
        cons._clock = lambda: time.monotonic() + 3600

    mid, resume = _stall_first_read(cons, lease_over)
    assert remote_load.start(cons, params, [4, 5, 6, 7], "c") == 4 * BASE.block_size
    assert mid.wait(30)
    prod._clock = lambda: time.monotonic() + 3600  # the lease ended on the producer too
    assert prod.get_finished()[0] == {"p"}  # freed: nothing may trust a READ of it any more
    resume.set()
    start = time.monotonic()
    assert _finish_both(prod, cons, "c") == {4, 5, 6, 7}
    assert time.monotonic() - start < TIMEOUT  # refused at once, not at a timeout
    assert "lease" in cons.load_error_reasons["c"]
    prod.close()
    cons.close()


def test_producer_restarted_with_another_layout_gets_a_fresh_session(
    spawn_peer: Callable[..., Any], remote_load: Any
) -> None:
    """Issue 28: a new producer on the same port serves another layout (HND, converted): the
    cached remote agent of the dead one is dropped and the handshake made again."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg: dict[str, Any] = {"transport": "nixl", "timeout_s": TIMEOUT, "port": port}
    conn, cache = _consumer(BASE)
    first = spawn_peer({**cfg, "producers": _producers(["LBNHC"])})
    assert remote_load.start(conn, first.params["LBNHC"], [1, 2, 3, 4], "r1") > 0
    assert remote_load.finish(conn, "r1", 30)[1] == set(), conn.load_error_reasons
    first.stop()
    second = spawn_peer({**cfg, "producers": _producers(["hnd"])})
    assert remote_load.start(conn, second.params["hnd"], [5, 6, 7, 8], "r2") > 0
    assert remote_load.finish(conn, "r2", 30)[1] == set(), conn.load_error_reasons
    src = random_cache(LAYOUTS["hnd"], seed=10 + list(LAYOUTS).index("hnd"))
    want = remote_load.expected(src, LAYOUTS["hnd"], BASE, PRODUCER_BLOCKS)
    for b, w in zip([5, 6, 7, 8], want, strict=True):
        assert torch.equal(block_bytes(cache, BASE, b), w)
    conn.close()


def test_failed_read_unpins_the_producer_before_its_lease_ends(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    """A READ that ended in ERR (no READ in flight) tells the producer ("kv-end"), which frees the
    blocks at once instead of holding them to the lease's end; the consumer reports a load error.
    The producer's clock is frozen past abandon_after_s and before the lease's end, so without the
    notification the request is never released here."""
    prod, cons, _cache, params = _held_pair(make_request)

    def read_fails() -> None:  # the READ ended in state ERR
        raise ConnectionError("NIXL READ failed (peer gone or memory unregistered)")

    mid, resume = _stall_first_read(cons, read_fails)
    assert remote_load.start(cons, params, [4, 5, 6, 7], "c") == 4 * BASE.block_size
    assert mid.wait(30)
    frozen = time.monotonic() + 3  # > abandon deadline (1.5 s), < lease end (timeout_s = 5 s)
    prod._clock = lambda: frozen
    resume.set()
    sent: set[str] = set()
    assert _finish_both(prod, cons, "c", sent) == {4, 5, 6, 7}
    deadline = time.monotonic() + 10
    while "p" not in sent:
        assert time.monotonic() < deadline, "the failed pull never unpinned the blocks"
        cons.get_finished()  # (without progress threads, polling progresses both agents)
        sent |= prod.get_finished()[0]
        time.sleep(0.005)
    prod.close()
    cons.close()


def test_descriptor_indices_are_every_range_of_every_block_in_order() -> None:
    """A pull's descriptor indices (``b * R + r``: block ``b``'s ranges in row order), built as
    one int32 array (issue 30: the Python list took ~1 ms a pull for 16k descriptors); an index
    past int32 is refused, never wrapped."""
    ids = [7, 0, 3]
    got = NixlConnector._indices(ids, 4)
    assert got.dtype.name == "int32"
    assert got.tolist() == [b * 4 + r for b in ids for r in range(4)]
    assert NixlConnector._indices([], 4).tolist() == []
    with pytest.raises(ValueError, match="exceeds int32"):
        NixlConnector._indices([2**29], 8)


def test_descriptor_index_check_can_fail() -> None:
    """Planted bug: indices built block-minor (``r * B + b``) differ from the row order, so the
    comparison above would catch a transposed build."""
    ids = [7, 0, 3]
    transposed = [r * 16 + b for b in ids for r in range(4)]
    assert NixlConnector._indices(ids, 4).tolist() != transposed


@pytest.mark.parametrize("name", ["runs", "runs_bs4"])
def test_consecutive_blocks_are_read_in_runs_byte_exact(
    name: str, healthy: Any, remote_load: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks consecutive on both sides go as one descriptor per run and range (NIXL's
    ``initialize_xfer`` over merged spans, not the per-block prepared lists): 2 runs here, and
    every byte lands where it should (a run read short or at the wrong start fails the check)."""
    conn, cache = _consumer(LAYOUTS[name])
    seen: list[int] = []
    original = conn._agent.initialize_xfer

    def counting(op: str, local: Any, remote: Any, *rest: Any) -> Any:
        seen.append(local.descCount())
        return original(op, local, remote, *rest)

    monkeypatch.setattr(conn._agent, "initialize_xfer", counting)
    _read_and_check(conn, cache, name, [7, 8, 9, 2], RUN_BLOCKS, healthy, remote_load)
    assert seen == [2 * conn._ranges_per_block], seen  # two runs, every range once per run
    conn.close()


def test_runs_pair_both_sides_consecutive_stretches() -> None:
    from kv_connectors.nixl import _run_descs, _runs, _spans

    assert _runs([7, 8, 9, 2, 3], [4, 5, 6, 10, 12]) == [(7, 4, 3), (2, 10, 1), (3, 12, 1)]
    assert _runs([], []) == []
    pattern = [{"base": 1000, "block_stride": 64, "ranges": [[0, 64]]}]
    assert _spans(pattern) and not _spans([{"base": 0, "block_stride": 96, "ranges": [[0, 64]]}])
    got = _run_descs(pattern, [(2, 3), (9, 1)], 5, num_blocks=10)
    assert got.tolist() == [[1128, 192, 5], [1576, 64, 5]]
    with pytest.raises(
        ValueError, match=r"blocks \[8, 11\) lies outside the cache's num_blocks=10"
    ):
        _run_descs(pattern, [(8, 3)], 5, num_blocks=10)
