"""The connector contract suite: one set of tests every connector runs, driven only through the
contract (as an engine drives it) and read back through the layout descriptor.

- a save -> load round trip is byte-exact for every standard layout (every physical order, DiffKV,
  per-token-head int8 / fp8 with their scales, a padded page), into other block ids, and touches
  no other block;
- where a connector declares ``converts_layouts``: another order, a block-size merge and split,
  and a TP head split are exact;
- a different layout never loads (a store finds no hit, a transfer's handshake refuses with a
  reason);
- each fault of the failure model the connector declares (``CAPABILITIES.faults``,
  ``kv_connectors.FAULTS``) ends in a reported load error for exactly the blocks it hit, whose
  bytes stay as they were (never wrong KV);
- ``abort_request`` of planned work is reported;
- a store told of a running request's blocks (``blocks_computed``) before it finishes round-trips
  the same bytes, and frees the request's blocks only once every save of it landed.

A new connector is its module plus one line in :data:`CONNECTORS` (a factory from the context: a
temporary root, the role a transfer side plays, its TP rank and the block size).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kv_connectors import (
    FAULTS,
    ConnectorCapabilities,
    FilesystemConfig,
    FilesystemConnector,
    KVConnector,
    MultiConnector,
    OffloadingConfig,
    OffloadingConnector,
    P2pConfig,
    P2pConnector,
)
from kv_connectors.testing import block_bytes, make_layout, random_cache, standard_layouts
from kv_spec import KVCacheLayout

TIMEOUT = 10.0


@dataclass(frozen=True)
class Ctx:
    root: Path
    block_size: int
    role: str = "both"  # a transfer's side: "producer" or "consumer"
    tp: tuple[int, int] = (0, 1)


def _nixl(c: Ctx) -> KVConnector:
    pytest.importorskip("nixl")
    from kv_connectors import NixlConfig
    from kv_connectors.nixl import NixlConnector

    cfg = NixlConfig(timeout_s=TIMEOUT, role=c.role, progress_thread=False)
    return NixlConnector(cfg, block_size=c.block_size, tp_rank=c.tp[0], tp_size=c.tp[1])


def _fs(c: Ctx) -> FilesystemConnector:
    cfg = FilesystemConfig(root=c.root, model_fingerprint="model-a", fsync=False)
    return FilesystemConnector(cfg, block_size=c.block_size)


def _offload(c: Ctx) -> OffloadingConnector:
    return OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 22), block_size=c.block_size)


#: Every connector, as a factory of one worker's connector. One line per connector.
CONNECTORS: dict[str, Callable[[Ctx], KVConnector]] = {
    "offloading": _offload,
    "filesystem": _fs,
    "multi": lambda c: MultiConnector([_offload(c), _fs(c)]),
    "p2p": lambda c: P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, role=c.role, buffer_bytes=1 << 16),
        block_size=c.block_size,
        tp_rank=c.tp[0],
        tp_size=c.tp[1],
    ),
    "nixl": _nixl,
}

LAYOUTS = standard_layouts(num_blocks=12)
SRC_IDS = [3, 9, 1, 6]
DST_IDS = [7, 2, 10, 5]
UNTOUCHED = 4  # a block no transfer names


def _workers(conn: KVConnector) -> list[KVConnector]:
    return list(conn.connectors) if isinstance(conn, MultiConnector) else [conn]


@dataclass
class Moved:
    """What one save -> load (store) or produce -> pull (transfer) left behind."""

    tokens: int
    errors: set[int]
    src: Any  # the source cache
    dst: Any  # the destination cache
    before: dict[int, torch.Tensor]  # destination blocks' bytes before the load
    loader: KVConnector
    loaded: bool = True  # the request ended in the loader (async: done_recving)


class Harness:
    """Drives one connector kind through the contract, as an engine would."""

    def __init__(self, name: str, tmp_path: Path, make_request: Callable[..., Any]) -> None:
        self.name, self.root, self.make_request = name, tmp_path, make_request
        self.opened: list[KVConnector] = []

    def connector(self, block_size: int, **kw: Any) -> KVConnector:
        conn = CONNECTORS[self.name](Ctx(self.root, block_size, **kw))
        self.opened.append(conn)
        return conn

    @property
    def capabilities(self) -> ConnectorCapabilities:
        return self.connector(4).capabilities

    def move(
        self,
        src: KVCacheLayout,
        dst: KVCacheLayout,
        *,
        src_tp: tuple[int, int] = (0, 1),
        dst_tp: tuple[int, int] = (0, 1),
        src_ids: list[int] = SRC_IDS,
        dst_ids: list[int] = DST_IDS,
        fault: str | None = None,
        told_running: int = 0,
    ) -> Moved:
        src_cache = random_cache(src, seed=1)
        dst_cache = random_cache(dst, seed=2)
        before = {b: block_bytes(dst_cache, dst, b) for b in [*dst_ids, UNTOUCHED]}
        req = self.make_request("a", len(src_ids), src.block_size, seed=7)
        if self.capabilities.kind == "store":
            conn = self.connector(src.block_size)
            conn.register_kv_caches(src_cache, src)
            self._save(conn, req, src_ids, told_running)
            if fault is not None:
                INJECT[fault](self, conn)
            conn.register_kv_caches(dst_cache, dst)  # the GPU side restarted with a fresh cache
            loader, params, producer = conn, None, None
        else:
            producer = self.connector(src.block_size, role="producer", tp=src_tp)
            producer.register_kv_caches(src_cache, src)
            delay, params = producer.request_finished(req, src_ids)
            assert delay and params is not None
            loader = self.connector(dst.block_size, role="consumer", tp=dst_tp)
            loader.register_kv_caches(dst_cache, dst)
            if fault is not None:
                INJECT[fault](self, producer)
        n_dst = len(dst_ids)
        req2 = self.make_request("b", n_dst, dst.block_size, seed=7)
        if params is not None:
            loader.add_remote_request("b", params)  # type: ignore[attr-defined]
        tokens, load_async = loader.get_num_new_matched_tokens(req2, 0)
        assert load_async == loader.capabilities.load_async or tokens == 0
        moved = Moved(tokens, set(), src_cache, dst_cache, before, loader)
        if not tokens:
            return moved
        loader.update_state_after_alloc(req2, dst_ids, tokens)
        meta = loader.build_connector_meta()
        loader.start_load_kv(meta)
        for layer in range(loader.kv.num_layers):
            loader.wait_for_layer_load(layer)
        if load_async:
            deadline = time.monotonic() + 3 * TIMEOUT
            recving: set[str] = set()
            while "b" not in recving and time.monotonic() < deadline:
                recving |= loader.get_finished()[1]
                if producer is not None:
                    producer.get_finished()  # progress the producer (NIXL: no progress thread)
                time.sleep(0.002)
            moved.loaded = "b" in recving
        moved.errors = loader.get_block_ids_with_load_errors()
        return moved

    def _save(self, conn: KVConnector, req: Any, block_ids: list[int], told: int = 0) -> None:
        """``req`` saved: told of its first ``told`` blocks while running (one step: nothing
        may be reported sent, the request still uses them), then finished."""
        if told:
            conn.blocks_computed(
                SimpleNamespace(request_id=req.request_id, block_hashes=req.block_hashes[:told]),
                block_ids,
            )
            meta = conn.build_connector_meta()
            conn.start_load_kv(meta)
            for layer in range(conn.kv.num_layers):
                conn.save_kv_layer(layer, meta)
            conn.wait_for_save()
            assert conn.get_finished() == (set(), set())
        delay, params = conn.request_finished(req, block_ids)
        assert delay and params is None
        meta = conn.build_connector_meta()
        conn.start_load_kv(meta)
        for layer in range(conn.kv.num_layers):
            conn.save_kv_layer(layer, meta)
        conn.wait_for_save()
        assert conn.get_finished() == ({req.request_id}, set())
        for w in _workers(conn):
            if isinstance(w, FilesystemConnector):
                w.flush()
        assert conn.get_request_ids_with_save_errors() == set()

    def close(self) -> None:
        for c in self.opened:
            c.close()


def _corrupt_block(h: Harness, conn: KVConnector) -> None:
    """Damage the stored bytes of the request's second block (``SRC_IDS[1]``) in every store."""
    req = h.make_request("a", len(SRC_IDS), conn.block_size, seed=7)
    for w in _workers(conn):
        path = w.path_of(req.block_hashes[1])  # type: ignore[attr-defined]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def _peer_gone(h: Harness, producer: KVConnector) -> None:
    producer.close()  # the producer process went away after publishing its params


#: One injector per fault of :data:`kv_connectors.FAULTS` (a new fault: an entry here).
INJECT: dict[str, Callable[[Harness, KVConnector], None]] = {
    "corrupt_block": _corrupt_block,
    "peer_gone": _peer_gone,
}


@pytest.fixture(params=sorted(CONNECTORS))
def harness(
    request: pytest.FixtureRequest, tmp_path: Path, make_request: Callable[..., Any]
) -> Any:
    h = Harness(request.param, tmp_path, make_request)
    yield h
    h.close()


def test_every_fault_has_an_injector() -> None:
    assert set(INJECT) == set(FAULTS)


def test_capabilities_are_declared(harness: Harness) -> None:
    caps = harness.capabilities
    assert isinstance(caps, ConnectorCapabilities)
    assert set(caps.faults) <= set(FAULTS)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_is_byte_exact(harness: Harness, name: str) -> None:
    layout = LAYOUTS[name]
    moved = harness.move(layout, layout)
    assert moved.tokens == len(DST_IDS) * layout.block_size and moved.loaded
    assert moved.errors == set()
    for s, d in zip(SRC_IDS, DST_IDS, strict=True):
        assert torch.equal(block_bytes(moved.dst, layout, d), block_bytes(moved.src, layout, s))
    assert torch.equal(block_bytes(moved.dst, layout, UNTOUCHED), moved.before[UNTOUCHED])


def test_a_store_told_of_running_blocks_round_trips(harness: Harness) -> None:
    if harness.capabilities.kind != "store":
        pytest.skip(f"{harness.name} is a transfer: it moves a request's KV once it finished")
    layout = make_layout("LBNHC")
    moved = harness.move(layout, layout, told_running=2)
    assert moved.tokens == len(DST_IDS) * layout.block_size and moved.errors == set()
    for s, d in zip(SRC_IDS, DST_IDS, strict=True):
        assert torch.equal(block_bytes(moved.dst, layout, d), block_bytes(moved.src, layout, s))


CONVERSIONS = {
    "order_LBHNC_to_BHLNC": (make_layout("LBHNC"), make_layout("BHLNC"), (0, 1), 4),
    "merge_bs4_to_bs8": (make_layout("LBNHC"), make_layout("BLNHC", block_size=8), (0, 1), 2),
    "split_bs8_to_bs4": (
        make_layout("BLNHC", block_size=8, num_blocks=12),
        make_layout("LBNHC", num_blocks=12),
        (0, 1),
        8,
    ),
    "tp1_to_tp2_rank1": (make_layout("LBNHC", num_kv_heads=4), make_layout("LBHNC"), (1, 2), 4),
}


@pytest.mark.parametrize("case", sorted(CONVERSIONS))
def test_declared_conversions_are_exact(harness: Harness, case: str, remote_load: Any) -> None:
    if not harness.capabilities.converts_layouts:
        pytest.skip(f"{harness.name} declares no layout conversion (a store loads its own)")
    src, dst, dst_tp, n_dst = CONVERSIONS[case]
    moved = harness.move(src, dst, dst_tp=dst_tp, dst_ids=[7, 2, 10, 5, 8, 11, 0, 6][:n_dst])
    assert moved.tokens == n_dst * dst.block_size and moved.errors == set() and moved.loaded
    want = remote_load.expected(moved.src, src, dst, SRC_IDS, dst_tp[0])
    got = [block_bytes(moved.dst, dst, d) for d in [7, 2, 10, 5, 8, 11, 0, 6][:n_dst]]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_different_layout_never_loads(harness: Harness) -> None:
    src = make_layout("LBNHC")
    other = make_layout("LBNHC", dtype="bfloat16")  # same shape and bytes, another meaning
    moved = harness.move(src, other)
    assert moved.tokens == 0  # planted bug (a store keyed by block hash only) loads here
    assert torch.equal(block_bytes(moved.dst, other, DST_IDS[0]), moved.before[DST_IDS[0]])
    if harness.capabilities.kind == "transfer":
        assert "handshake refused" in moved.loader.load_error_reasons["b"]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_declared_fault_is_a_load_error_never_wrong_kv(harness: Harness, fault: str) -> None:
    if fault not in harness.capabilities.faults:
        pytest.skip(f"{harness.name} does not declare {fault!r}")
    layout = make_layout("LBNHC")
    moved = harness.move(layout, layout, fault=fault)
    assert moved.tokens and moved.loaded  # every load ends, failed or not
    hit = {"corrupt_block": {DST_IDS[1]}, "peer_gone": set(DST_IDS)}[fault]
    assert moved.errors == hit
    for b in hit:  # a failed block keeps its bytes: never partial or wrong KV passed as loaded
        assert torch.equal(block_bytes(moved.dst, layout, b), moved.before[b])
    assert moved.loader.load_error_reasons.get("b")


def test_abort_reports_planned_work(harness: Harness) -> None:
    layout = make_layout("LBNHC")
    conn = harness.connector(layout.block_size, role="producer")
    conn.register_kv_caches(random_cache(layout, seed=1), layout)
    req = harness.make_request("a", 2, layout.block_size, seed=3)
    delay, _params = conn.request_finished(req, [3, 9])
    assert delay
    conn.abort_request("a")
    deadline = time.monotonic() + TIMEOUT
    sending: set[str] = set()
    while "a" not in sending and time.monotonic() < deadline:
        sending |= conn.get_finished()[0]
    assert "a" in sending  # the engine may free blocks 3 and 9
