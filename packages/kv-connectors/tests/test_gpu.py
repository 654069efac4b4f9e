"""The same round trips on CUDA (marked gpu; skipped on CPU CI): offload through the Triton block
copies and a pinned tier with side-stream events, the disk tier from a GPU cache, P2P over NCCL and
NIXL VRAM <-> VRAM between two GPUs of one host (skipped with fewer than two)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connectors import (
    FilesystemConfig,
    FilesystemConnector,
    OffloadingConfig,
    OffloadingConnector,
    P2pConfig,
    P2pConnector,
)
from kv_connectors.testing import block_bytes, make_layout, random_cache

pytestmark = pytest.mark.gpu
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _load_into(conn: Any, req: Any, dst: list[int]) -> int:
    """``req``'s tier hit loaded into blocks ``dst`` (every layer's load waited for on the
    current stream, then the device synced); the tokens it hit."""
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, dst, tokens)
    conn.start_load_kv(conn.build_connector_meta())
    for layer in range(conn.kv.num_layers):
        conn.wait_for_layer_load(layer)
    torch.cuda.synchronize()
    return int(tokens)


@pytest.mark.parametrize(
    "layout",
    [
        make_layout("LBNHC", num_blocks=64, dtype="bfloat16"),
        make_layout("BLNHC", num_blocks=64, dtype="bfloat16"),
        make_layout("BLHNC", num_blocks=64, dtype="fp8_e4m3", kv_quant="fp8_per_token_head"),
        make_layout("LBNHC", num_blocks=64, head_size=192, head_size_v=128, num_kv_heads=1),
    ],
    ids=["LBNHC", "BLNHC", "fp8_pth", "diffkv"],
)
@pytest.mark.parametrize(
    ("src", "dst"),
    [([5, 17, 3, 40], [60, 61, 0, 9]), ([4, 5, 6, 7], [20, 21, 22, 23])],
    ids=["staged", "consecutive"],  # consecutive: rows copied straight from and into the cache
)
def test_offload_round_trip_on_cuda(
    layout: Any, src: list[int], dst: list[int], make_request: Callable[..., Any]
) -> None:
    cache = random_cache(layout, seed=1, device="cuda")
    row = layout.num_layers * layout.page_bytes
    # a staging buffer of four block rows (a pair of halves for saves, one for loads): the
    # four-block transfers move in pieces
    config = OffloadingConfig(cpu_bytes=1 << 24, staging_bytes=4 * row)
    conn = OffloadingConnector(config, block_size=layout.block_size)
    conn.register_kv_caches(cache, layout)
    assert conn.tier.is_pinned()
    want = [block_bytes(cache, layout, b) for b in src]
    req = make_request("a", 4, layout.block_size, seed=2)
    conn.request_finished(req, src)
    meta = conn.build_connector_meta()
    conn.start_load_kv(meta)
    for layer in range(layout.num_layers):
        conn.save_kv_layer(layer, meta)
    conn.wait_for_save()  # hands the save off; get_finished reports it once copied
    assert _saved(conn) == {"a"}
    _load_into(conn, make_request("b", 4, layout.block_size, seed=2), dst)
    for d, w in zip(dst, want, strict=True):
        assert torch.equal(block_bytes(cache, layout, d), w)


def _hold_back(*streams: Any) -> None:
    """Make ``streams`` wait ~20 ms of device time (a sleeping kernel on a stream of its own),
    so work enqueued on them meanwhile runs after what the test enqueues elsewhere."""
    hold = torch.cuda.Stream()
    with torch.cuda.stream(hold):
        torch.cuda._sleep(40_000_000)
    held = torch.cuda.Event()
    held.record(hold)
    for stream in streams:
        stream.wait_event(held)


def _saved(conn: Any, timeout_s: float = 10.0) -> set[str]:
    """The requests ``get_finished`` reports saved, polled until one is (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while not (done := conn.get_finished()[0]) and time.monotonic() < deadline:
        time.sleep(1e-4)
    return done


@pytest.mark.parametrize(
    "planted", [None, "no-wait", "no-record-stream"], ids=["ordered", "planted-no-wait",
                                                           "planted-no-record-stream"]
)  # fmt: skip
def test_offload_save_reusing_a_loading_slot_waits_for_the_load(
    planted: str | None, make_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's tier slots are unpinned once its copies are enqueued; a save that evicts them
    and writes the same slots runs on the other lane and must start after that load: the loaded
    blocks are the first request's bytes, not the third's. The load lane is held back ~20 ms
    (a sleeping kernel it waits for) so the save is enqueued while the load still waits.

    Planted: the save not told to wait, the loaded blocks are the third request's; the load's
    block ids not recorded on the lane's stream, the third request's id upload takes their
    memory before the held load reads them, and the load scatters into the third request's
    blocks, leaving its own untouched (what the H200 showed before ``_Copies.of`` recorded
    them)."""
    if planted == "no-record-stream":
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    layout = make_layout("LBNHC", num_blocks=32, num_layers=4, num_kv_heads=2, block_size=16,
                         head_size=64, dtype="bfloat16")  # fmt: skip
    cache = random_cache(layout, seed=3, device="cuda")
    row = layout.num_layers * layout.page_bytes
    conn = OffloadingConnector(
        OffloadingConfig(cpu_bytes=4 * row, staging_bytes=4 * row), block_size=layout.block_size
    )
    conn.register_kv_caches(cache, layout)
    src = [1, 3, 5, 7]
    a = make_request("a", 4, layout.block_size, seed=4)
    conn.request_finished(a, src)
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_save()
    assert _saved(conn) == {"a"}
    want = [block_bytes(cache, layout, b).clone() for b in src]
    dst = [16, 18, 20, 22]
    untouched = [block_bytes(cache, layout, d).clone() for d in dst]
    lane = conn._load_lane
    assert lane is not None
    _hold_back(lane.stream, lane.copy_stream)
    b = make_request("b", 4, layout.block_size, seed=4)  # a's prefix: loads a's blocks
    tokens, _ = conn.get_num_new_matched_tokens(b, 0)
    conn.update_state_after_alloc(b, dst, tokens)
    conn.start_load_kv(conn.build_connector_meta())
    # every segment enqueued, so the slots are unpinned (the waits on a side stream: the save
    # must not be ordered after the load by the compute stream it starts from)
    with torch.cuda.stream(torch.cuda.Stream()):
        for layer in range(layout.num_layers):
            conn.wait_for_layer_load(layer)
    if planted == "no-wait":
        conn._loads_enqueued = None
    c = make_request("c", 4, layout.block_size, seed=5)  # evicts a's blocks: their slots
    conn.request_finished(c, [0, 2, 4, 6])
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_save()
    torch.cuda.synchronize()
    loaded = [torch.equal(block_bytes(cache, layout, d), w) for d, w in zip(dst, want, strict=True)]
    assert loaded == [planted is None] * 4
    if planted == "no-record-stream":
        assert all(
            torch.equal(block_bytes(cache, layout, d), u)
            for d, u in zip(dst, untouched, strict=True)
        )
    assert _saved(conn) == {"c"}
    conn.close()


@pytest.mark.parametrize("order", ["LBNHC", "BLNHC"])
def test_offload_history_in_two_runs_of_slots_loads_byte_exact(
    order: str, make_request: Callable[..., Any]
) -> None:
    """A history saved over two turns sits in two runs of tier slots (another request's save in
    between); its load stages both runs through pieces of two rows, one piece straddling them,
    and every block lands byte-exact (shuffled ids: no direct copy)."""
    layout = make_layout(order, num_blocks=64, dtype="bfloat16")
    cache = random_cache(layout, seed=6, device="cuda")
    widest = layout.page_bytes if order == "LBNHC" else layout.num_layers * layout.page_bytes
    conn = OffloadingConnector(
        OffloadingConfig(cpu_bytes=1 << 24, staging_bytes=8 * widest), block_size=layout.block_size
    )
    conn.register_kv_caches(cache, layout)

    def save(req: Any, ids: list[int]) -> None:
        conn.request_finished(req, ids)
        conn.start_load_kv(conn.build_connector_meta())
        conn.wait_for_save()
        assert _saved(conn) == {req.request_id}

    first = make_request("t0", 3, layout.block_size, seed=7)
    save(first, [11, 5, 23])  # slots 0-2
    save(make_request("other", 2, layout.block_size, seed=8), [30, 2])  # slots 3-4
    turn = make_request("t1", 6, layout.block_size, seed=7)  # t0's 3 blocks, then 3 more
    assert turn.block_hashes[:3] == first.block_hashes
    save(turn, [11, 5, 23, 40, 17, 9])  # its new blocks: slots 5-7
    src = [11, 5, 23, 40, 17, 9]
    want = [block_bytes(cache, layout, b).clone() for b in src]
    dst = [50, 44, 61, 33, 48, 57]
    again = make_request("t2", 6, layout.block_size, seed=7)
    assert _load_into(conn, again, dst) == 6 * layout.block_size
    for d, w in zip(dst, want, strict=True):
        assert torch.equal(block_bytes(cache, layout, d), w)
    conn.close()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_offload_transfers_compile_no_kernel_after_register(
    tier: str, tmp_path: Path, make_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saves and loads of 1 to 33 blocks (row counts on and off the multiples of 16 that Triton
    specializes), shuffled (staged) and consecutive (direct), compile no kernel once the tier is
    registered: its copy kernels' variants are loaded then (the CPU tier's segment copies
    through device staging, the disk tier's whole rows into pinned host rows)."""
    knobs = pytest.importorskip("triton").knobs
    layout = make_layout("LBNHC", num_blocks=128, dtype="bfloat16")
    cache = random_cache(layout, seed=9, device="cuda")
    conn: Any
    if tier == "cpu":
        conn = OffloadingConnector(
            OffloadingConfig(cpu_bytes=1 << 26), block_size=layout.block_size
        )
    else:
        cfg = FilesystemConfig(root=tmp_path, model_fingerprint="model-a", fsync=False)
        conn = FilesystemConnector(cfg, block_size=layout.block_size)
    conn.register_kv_caches(cache, layout)
    seen: list[str] = []

    def hook(*, repr: str, **_: Any) -> bool:
        seen.append(repr.split("[", 1)[0])
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    gen = torch.Generator().manual_seed(0)
    for k, n in enumerate([1, 5, 16, 17, 33]):
        ids = torch.randperm(64, generator=gen)[:n].tolist() if k % 2 else list(range(n))
        req = make_request(f"r{k}", n, layout.block_size, seed=20 + k)
        conn.request_finished(req, ids)
        conn.start_load_kv(conn.build_connector_meta())
        conn.wait_for_save()
        assert _saved(conn) == {req.request_id}
        if tier == "disk":
            conn.flush()
        dst = [64 + i for i in range(n)] if k % 2 else torch.randperm(64)[:n].add(64).tolist()
        _load_into(conn, make_request(f"l{k}", n, layout.block_size, seed=20 + k), dst)
        conn.wait_for_save()
    assert seen == [], f"compiled while transferring: {seen}"
    conn.close()


def test_filesystem_round_trip_from_cuda(tmp_path: Path, make_request: Callable[..., Any]) -> None:
    layout = make_layout("BLNHC", num_blocks=32, dtype="bfloat16")
    cache = random_cache(layout, seed=3, device="cuda")
    conn = FilesystemConnector(
        FilesystemConfig(root=tmp_path, model_fingerprint="model-a"), block_size=layout.block_size
    )
    conn.register_kv_caches(cache, layout)
    want = block_bytes(cache, layout, 7)
    conn.request_finished(make_request("a", 1, layout.block_size, seed=4), [7])
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_save()
    conn.flush()
    b = make_request("b", 1, layout.block_size, seed=4)
    tokens, _ = conn.get_num_new_matched_tokens(b, 0)
    conn.update_state_after_alloc(b, [20], tokens)
    conn.start_load_kv(conn.build_connector_meta())
    torch.cuda.synchronize()
    assert torch.equal(block_bytes(cache, layout, 20), want)
    conn.close()


@pytest.mark.parametrize("planted", [False, True], ids=["waited", "planted-no-wait"])
def test_filesystem_save_from_cuda_never_waits_on_the_host(
    planted: bool, tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    """``wait_for_save`` gathers a running request's blocks on a side stream and returns without
    waiting; a finished request is not reported sent before its rows are on the host; a
    preempted request's blocks are written only after its gather (``handle_preemptions``), so
    the file holds its bytes. The side stream is held ~20 ms by a sleeping kernel it waits for.
    Planted: without ``handle_preemptions`` the writes go first and the file holds them.
    (Before: a host sync a save, on the compute stream.)"""
    layout = make_layout("BLNHC", num_blocks=32, dtype="bfloat16")
    cache = random_cache(layout, seed=3, device="cuda")
    conn = FilesystemConnector(
        FilesystemConfig(root=tmp_path, model_fingerprint="model-a", fsync=False),
        block_size=layout.block_size,
    )
    conn.register_kv_caches(cache, layout)
    want = [block_bytes(cache, layout, b) for b in (7, 9)]
    conn.blocks_computed(make_request("a", 2, layout.block_size, seed=4), [7, 9])
    conn.request_finished(make_request("f", 1, layout.block_size, seed=8), [3])  # (finished)
    conn.start_load_kv(conn.build_connector_meta())
    torch.cuda.synchronize()
    _hold_back(conn._stream)
    t0 = time.perf_counter()
    conn.wait_for_save()
    waited = time.perf_counter() - t0
    sent_early = conn.get_finished()[0]
    if not planted:
        conn.handle_preemptions(["a"])
    for t in [cache] if isinstance(cache, torch.Tensor) else cache:
        t.fill_(0)  # the freed blocks written by the next request, on the compute stream
    assert waited < 0.010 and sent_early == set()
    torch.cuda.synchronize()
    assert _saved(conn) == {"f"}  # (not a: it runs, its blocks were never held back)
    conn.flush()
    _load_into(conn, make_request("b", 2, layout.block_size, seed=4), [20, 21])
    got = [block_bytes(cache, layout, d) for d in (20, 21)]
    assert [torch.equal(g, w) for g, w in zip(got, want, strict=True)] == [not planted] * 2
    conn.close()


def test_filesystem_saves_reuse_pinned_slabs(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    """Saves gather into the config's pinned slabs (allocated once; a save larger than a slab in
    parts) and take fresh pinned memory only when every slab is still being written: with the
    writer thread held, a 10-block save over 2-row slabs takes the 4 slabs and 1 fresh buffer
    (``staging_misses``); every block round-trips exactly either way."""
    layout = make_layout("BLNHC", num_blocks=32, dtype="bfloat16")
    cache = random_cache(layout, seed=5, device="cuda")
    row = layout.num_layers * layout.page_bytes
    cfg = FilesystemConfig(
        root=tmp_path, model_fingerprint="model-a", fsync=False, staging_bytes=4 * 2 * row
    )
    conn = FilesystemConnector(cfg, block_size=layout.block_size)
    conn.register_kv_caches(cache, layout)
    src = [3, 1, 4, 15, 9, 2, 6, 5, 30, 7]
    want = [block_bytes(cache, layout, b) for b in src]
    conn.request_finished(make_request("a", 5, layout.block_size, seed=6), src[:5])
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_save()  # 3 parts, 3 slabs
    conn.flush()
    assert conn.staging_misses == 0
    gate = threading.Event()
    conn._writer.submit(gate.wait)  # the writer is busy: no slab comes back
    conn.request_finished(make_request("b", 10, layout.block_size, seed=6), src)
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_save()  # a's five blocks are on disk: b's other five in 3 parts
    gate.set()
    conn.flush()
    assert conn.staging_misses == 0
    c = make_request("c", 10, layout.block_size, seed=7)
    conn.request_finished(c, src)
    gate = threading.Event()
    conn._writer.submit(gate.wait)
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_save()  # 10 new blocks: 5 parts for 4 slabs
    gate.set()
    conn.flush()
    assert conn.staging_misses == 1
    for req in (make_request("b2", 10, layout.block_size, seed=6), c):
        dst = list(range(16, 26))
        assert _load_into(conn, req, dst) == 10 * layout.block_size
        got = [block_bytes(cache, layout, d) for d in dst]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    conn.close()


def test_filesystem_slabs_follow_a_new_layouts_row_width(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    """A connector registered again with a layout of another row width (the GPU side restarted
    with another cache) gathers into slabs of the new width: the old ones are dropped, the save
    round-trips; a staging budget too small for one row a slab is refused, naming the field."""
    small = make_layout("BLNHC", num_blocks=16, dtype="bfloat16")
    wide = make_layout("BLNHC", num_blocks=16, dtype="bfloat16", head_size=128)
    row_wide = wide.num_layers * wide.page_bytes
    assert row_wide != small.num_layers * small.page_bytes
    cfg = FilesystemConfig(
        root=tmp_path, model_fingerprint="model-a", fsync=False, staging_bytes=4 * 2 * row_wide
    )
    conn = FilesystemConnector(cfg, block_size=small.block_size)
    conn.register_kv_caches(random_cache(small, seed=1, device="cuda"), small)
    cache = random_cache(wide, seed=2, device="cuda")
    conn.register_kv_caches(cache, wide)
    want = [block_bytes(cache, wide, b) for b in (3, 4)]
    conn.request_finished(make_request("a", 2, wide.block_size, seed=3), [3, 4])
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_save()
    conn.flush()
    assert _load_into(conn, make_request("b", 2, wide.block_size, seed=3), [10, 11])
    got = [block_bytes(cache, wide, d) for d in (10, 11)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    conn.close()
    tiny = FilesystemConfig(root=tmp_path, model_fingerprint="m", fsync=False, staging_bytes=8)
    with pytest.raises(ValueError, match="staging_bytes=8"):
        FilesystemConnector(tiny, block_size=wide.block_size).register_kv_caches(cache, wide)


def _pull_from_gpu_peer(
    transport: str,
    spawn_peer: Callable[..., Any],
    make_request: Callable[..., Any],
    *,
    order: str = "BLNHC",
    theirs: list[int] | None = None,
    mine: list[int] | None = None,
    stream: bool = False,
) -> None:
    """A pull from a producer on cuda:0 into cuda:1, byte-exact. ``stream``: the producer streams
    (its last layer saved on ``SAVE_LAST``) and this consumer loads layer by layer."""
    theirs, mine = theirs or [3, 9, 1, 6], mine or [7, 2, 11, 5]
    layout = make_layout(order, num_blocks=32, dtype="bfloat16")
    peer = spawn_peer(
        {
            "transport": transport,
            "timeout_s": 30,
            "device": "cuda:0",
            "producers": [
                {
                    "name": "x",
                    "layout": layout.to_json(),
                    "seed": 5,
                    "block_ids": theirs,
                    "stream": stream,
                }
            ],
        }
    )
    torch.cuda.set_device(1)
    if transport == "p2p":
        conn: Any = P2pConnector(
            P2pConfig(timeout_s=30, layerwise=stream), block_size=layout.block_size
        )
    else:
        from kv_connectors import NixlConfig
        from kv_connectors.nixl import NixlConnector

        conn = NixlConnector(NixlConfig(timeout_s=30), block_size=layout.block_size)
    cache = random_cache(layout, seed=100, device="cuda:1")
    conn.register_kv_caches(cache, layout)
    req = make_request("c", 4, layout.block_size)
    conn.add_remote_request("c", peer.params["x"])
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, mine, tokens)
    conn.start_load_kv(conn.build_connector_meta())
    src = random_cache(layout, seed=5)  # the producer's bytes, rebuilt on the CPU
    if stream:
        conn.wait_for_layer_load(0)
        # This stream only: it waits for layer 0. A device-wide synchronize would also wait for
        # the later layers' receives posted on the wire's stream, whose sends the producer holds
        # until SAVE_LAST below: a deadlock (the two-H200 run hung here; gloo has no device).
        torch.cuda.current_stream().synchronize()
        for b, p in zip(mine, theirs, strict=True):  # layer 0 landed before the last is computed
            assert torch.equal(block_bytes(cache, layout, b)[0], block_bytes(src, layout, p)[0])
        assert peer.proc.stdin is not None
        peer.proc.stdin.write("SAVE_LAST\n")
        peer.proc.stdin.flush()
        for layer in range(1, layout.num_layers):
            conn.wait_for_layer_load(layer)
    else:
        deadline = time.monotonic() + 60
        done: set[str] = set()
        while "c" not in done and time.monotonic() < deadline:
            done |= conn.get_finished()[1]
            time.sleep(0.01)
        assert "c" in done
    torch.cuda.synchronize()
    assert conn.get_block_ids_with_load_errors() == set(), conn.load_error_reasons
    for b, p in zip(mine, theirs, strict=True):
        assert torch.equal(block_bytes(cache, layout, b), block_bytes(src, layout, p))
    conn.close()


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_p2p_nccl_between_two_gpus(
    spawn_peer: Callable[..., Any], make_request: Callable[..., Any]
) -> None:
    _pull_from_gpu_peer("p2p", spawn_peer, make_request)
    # consecutive ids: sent from and received into the slab directly
    _pull_from_gpu_peer("p2p", spawn_peer, make_request, theirs=[4, 5, 6, 7], mine=[20, 21, 22, 23])


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_p2p_nccl_refused_pull_ends_its_posted_receive(
    spawn_peer: Callable[..., Any], remote_load: Any
) -> None:
    """On a connected NCCL session a pull's first receive is posted before the ask's answer is
    read. A refused ask (the request was served already) must end that receive: the load fails
    at once with the producer's reason, not at the timeout; nothing is written into its blocks
    after the failure is reported (they go back to the pool then); and the next pull (another
    producer) lands byte-exact. Planted: without the communicator's abort the receive waits out
    ``timeout_s`` (30 s) and the load fails as a timeout."""
    layout = make_layout("BLNHC", num_blocks=32, dtype="bfloat16")
    producers = [
        {"name": n, "layout": layout.to_json(), "seed": seed, "block_ids": [4, 5, 6, 7]}
        for n, seed in (("x", 5), ("y", 6))
    ]  # consecutive ids both sides: the receive lands in the cache itself
    peer = spawn_peer(
        {"transport": "p2p", "timeout_s": 30, "device": "cuda:0", "producers": producers}
    )
    torch.cuda.set_device(1)
    conn = P2pConnector(P2pConfig(timeout_s=30), block_size=layout.block_size)
    cache = random_cache(layout, seed=100, device="cuda:1")
    conn.register_kv_caches(cache, layout)
    mine = [20, 21, 22, 23]
    for rid, name, ok in (("a", "x", True), ("b", "x", False), ("c", "y", True)):
        assert remote_load.start(conn, peer.params[name], mine, rid) == 4 * layout.block_size
        waited, errors = remote_load.finish(conn, rid, 60)
        torch.cuda.synchronize(1)
        if ok:
            assert errors == set(), conn.load_error_reasons
            src = random_cache(layout, seed=5 if name == "x" else 6)
            for b, p in zip(mine, [4, 5, 6, 7], strict=True):
                assert torch.equal(block_bytes(cache, layout, b), block_bytes(src, layout, p))
        else:
            assert errors == set(mine) and "refused" in conn.load_error_reasons[rid]
            assert waited < 10, f"the refused pull took {waited:.1f} s: its receive waited"
            reported = [block_bytes(cache, layout, b) for b in mine]
            time.sleep(0.5)
            torch.cuda.synchronize(1)
            for b, w in zip(mine, reported, strict=True):  # no late write
                assert torch.equal(block_bytes(cache, layout, b), w)
    conn.close()


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_p2p_nccl_layerwise_stream_between_two_gpus(
    spawn_peer: Callable[..., Any], make_request: Callable[..., Any]
) -> None:
    _pull_from_gpu_peer("p2p", spawn_peer, make_request, order="LBNHC", stream=True)
    _pull_from_gpu_peer(
        "p2p", spawn_peer, make_request, order="LBNHC", stream=True, theirs=[4, 5], mine=[8, 9]
    )


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_p2p_nccl_producer_killed_mid_stream_is_a_load_error(
    spawn_peer: Callable[..., Any], make_request: Callable[..., Any]
) -> None:
    """Issue 30's fault on the GPU: the producer (cuda:0) streams layer by layer and is killed
    once layer 0 landed, the receives of the later layers posted on the wire's stream. Within
    its timeout (5 s) the load is a load error of all its blocks; the compute stream and the
    whole device drain (no NCCL receive left hanging: the session's communicator is aborted);
    nothing lands in the blocks after the report; and the same connector then loads from a new
    producer, byte-exact."""
    layout = make_layout("LBNHC", num_blocks=32, dtype="bfloat16")
    theirs, mine = [3, 9, 1, 6], [7, 2, 11, 5]
    spec = {"layout": layout.to_json(), "seed": 5, "block_ids": theirs}
    peer = spawn_peer(
        {"transport": "p2p", "timeout_s": 30, "device": "cuda:0",
         "producers": [{"name": "x", "stream": True, **spec}]}
    )  # fmt: skip
    torch.cuda.set_device(1)
    timeout = 5.0
    conn = P2pConnector(P2pConfig(timeout_s=timeout, layerwise=True), block_size=layout.block_size)
    cache = random_cache(layout, seed=100, device="cuda:1")
    conn.register_kv_caches(cache, layout)
    req = make_request("c", len(mine), layout.block_size)
    conn.add_remote_request("c", peer.params["x"])
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, mine, tokens)
    conn.start_load_kv(conn.build_connector_meta())
    conn.wait_for_layer_load(0)
    torch.cuda.current_stream().synchronize()
    src = random_cache(layout, seed=5)
    for b, p in zip(mine, theirs, strict=True):  # layer 0 landed; the producer holds the last
        assert torch.equal(block_bytes(cache, layout, b)[0], block_bytes(src, layout, p)[0])
    peer.proc.kill()
    peer.proc.wait(timeout=30)
    start = time.monotonic()
    for layer in range(1, layout.num_layers):
        conn.wait_for_layer_load(layer)  # (on CUDA: returns once the landing is enqueued)
    conn.wait_for_save()  # the step's end, where the engine then reads the load errors
    torch.cuda.current_stream().synchronize()
    waited = time.monotonic() - start
    assert waited < timeout + 5, f"the killed producer's load took {waited:.1f} s to fail"
    assert conn.get_block_ids_with_load_errors() == set(mine), conn.load_error_reasons
    reported = [block_bytes(cache, layout, b) for b in mine]
    deadline = time.monotonic() + 30
    while conn._in_step and time.monotonic() < deadline:  # the pull thread ends
        conn.get_finished()
        time.sleep(0.01)
    torch.cuda.synchronize(1)  # every stream of the device, the wire's too
    for b, w in zip(mine, reported, strict=True):  # nothing landed after the report
        assert torch.equal(block_bytes(cache, layout, b), w)
    again = spawn_peer(
        {"transport": "p2p", "timeout_s": 30, "device": "cuda:0",
         "producers": [{"name": "y", **spec}]}
    )  # fmt: skip
    req = make_request("d", len(mine), layout.block_size)  # the same connector, in-step again
    conn.add_remote_request("d", again.params["y"])
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, mine, tokens)
    conn.start_load_kv(conn.build_connector_meta())
    for layer in range(layout.num_layers):
        conn.wait_for_layer_load(layer)
    conn.wait_for_save()
    torch.cuda.synchronize(1)
    assert conn.get_block_ids_with_load_errors() == set(), conn.load_error_reasons
    for b, p in zip(mine, theirs, strict=True):
        assert torch.equal(block_bytes(cache, layout, b), block_bytes(src, layout, p))
    conn.close()


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_nixl_vram_between_two_gpus(
    spawn_peer: Callable[..., Any], make_request: Callable[..., Any]
) -> None:
    pytest.importorskip("nixl._api")
    _pull_from_gpu_peer("nixl", spawn_peer, make_request)


@pytest.mark.parametrize("planted", [False, True], ids=["waited", "planted-no-wait"])
def test_offload_save_of_a_preempted_request_reads_its_blocks_first(
    planted: bool, make_request: Callable[..., Any]
) -> None:
    """A running request's blocks saved while it runs (``blocks_computed``) may still be copying
    when the engine preempts it and writes the freed blocks: ``handle_preemptions`` makes the
    compute stream wait for that save, so the tier holds the request's KV, not the next
    writer's. The save lane is held back ~20 ms (a sleeping kernel it waits for) so the writes
    are enqueued while the save still waits. Planted: without the call, the tier holds the
    overwritten bytes."""
    layout = make_layout("LBNHC", num_blocks=32, num_layers=4, num_kv_heads=2, block_size=16,
                         head_size=64, dtype="bfloat16")  # fmt: skip
    cache = random_cache(layout, seed=3, device="cuda")
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 24), block_size=layout.block_size)
    conn.register_kv_caches(cache, layout)
    src = [1, 3, 5, 7]
    want = [block_bytes(cache, layout, b).clone() for b in src]
    a = make_request("a", 4, layout.block_size, seed=4)
    conn.blocks_computed(a, src)  # (every block complete: the request's view)
    meta = conn.build_connector_meta()
    lane = conn._save_lane
    assert lane is not None
    _hold_back(lane.stream)
    conn.start_load_kv(meta)
    for layer in range(layout.num_layers):
        conn.save_kv_layer(layer, meta)
    conn.wait_for_save()  # handed off; the copies wait behind the sleep
    if not planted:
        conn.handle_preemptions(["a"])
    for t in [cache] if isinstance(cache, torch.Tensor) else cache:
        t.fill_(0)  # the next request writes the freed blocks, on the compute stream
    torch.cuda.synchronize()
    assert conn.get_finished()[0] == set() and conn.stats.stored_blocks == 4  # (running)
    _load_into(conn, make_request("b", 4, layout.block_size, seed=4), [16, 18, 20, 22])
    loaded = [
        torch.equal(block_bytes(cache, layout, d), w)
        for d, w in zip([16, 18, 20, 22], want, strict=True)
    ]
    assert loaded == [not planted] * 4
    conn.close()
