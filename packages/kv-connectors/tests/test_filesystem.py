"""FilesystemConnector: byte-exact round trips across a restart for every layout; corrupt,
truncated, foreign-layout and hanging files each end in a reported load error within the
timeout, and the next request succeeds."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connectors import FilesystemConfig, FilesystemConnector
from kv_connectors.testing import block_bytes, make_layout, random_cache, standard_layouts
from kv_spec import KVCacheLayout

LAYOUTS = standard_layouts(num_blocks=10)


def _conn(
    root: Path, layout: KVCacheLayout, seed: int, **kw: Any
) -> tuple[FilesystemConnector, Any]:
    conn = FilesystemConnector(
        FilesystemConfig(root=root, model_fingerprint="model-a", fsync=False, **kw),
        block_size=layout.block_size,
    )
    cache = random_cache(layout, seed=seed)
    conn.register_kv_caches(cache, layout)
    return conn, cache


def _save(conn: FilesystemConnector, req: Any, block_ids: list[int]) -> None:
    assert conn.request_finished(req, block_ids) == (True, None)
    meta = conn.build_connector_meta()
    conn.start_load_kv(meta)
    conn.wait_for_save()
    assert conn.get_finished() == ({req.request_id}, set())
    conn.flush()


def _load(conn: FilesystemConnector, req: Any, block_ids: list[int]) -> int:
    tokens, async_load = conn.get_num_new_matched_tokens(req, 0)
    assert not async_load
    conn.update_state_after_alloc(req, block_ids, tokens)
    conn.start_load_kv(conn.build_connector_meta())
    return tokens


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_survives_restart(
    name: str, tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    layout = LAYOUTS[name]
    bs = layout.block_size
    writer, cache = _conn(tmp_path, layout, seed=1)
    want = [block_bytes(cache, layout, b) for b in (2, 6)]
    _save(writer, make_request("a", 2, bs, seed=3), [2, 6])
    writer.close()
    reader, other = _conn(tmp_path, layout, seed=2)  # a new process: fresh connector and cache
    assert _load(reader, make_request("b", 2, bs, seed=3), [0, 9]) == 2 * bs
    assert reader.get_block_ids_with_load_errors() == set()
    assert torch.equal(block_bytes(other, layout, 0), want[0])
    assert torch.equal(block_bytes(other, layout, 9), want[1])
    reader.close()


def _two_block_store(
    tmp_path: Path, make_request: Callable[..., Any]
) -> tuple[Any, Any, list[Path]]:
    layout = make_layout("BLNHC", num_blocks=8)
    conn, cache = _conn(tmp_path, layout, seed=5)
    req = make_request("a", 2, layout.block_size, seed=11)
    _save(conn, req, [1, 2])
    return conn, cache, [conn.path_of(h) for h in req.block_hashes]


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "foreign", "garbage"])
def test_damaged_file_is_a_load_error_then_next_request_succeeds(
    fault: str, tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    conn, cache, paths = _two_block_store(tmp_path, make_request)
    layout = conn.kv.layouts[0]
    bs = layout.block_size
    target = paths[1]
    data = bytearray(target.read_bytes())
    if fault == "corrupt":
        data[-5] ^= 0x40  # one flipped bit in the payload
        target.write_bytes(bytes(data))
    elif fault == "truncate":
        target.write_bytes(bytes(data[: len(data) // 2]))
    elif fault == "garbage":
        target.write_bytes(b"not a block")
    else:  # a file written for another layout, dropped under this name
        other_layout = make_layout("BLNHC", num_blocks=8, dtype="bfloat16")
        other, _ = _conn(tmp_path / "other", other_layout, seed=9)
        req = make_request("x", 2, bs, seed=11)
        _save(other, req, [1, 2])
        target.write_bytes(other.path_of(req.block_hashes[1]).read_bytes())
    before = block_bytes(cache, layout, 6)
    want0 = block_bytes(cache, layout, 1)
    assert _load(conn, make_request("b", 2, bs, seed=11), [5, 6]) == 2 * bs
    assert conn.get_block_ids_with_load_errors() == {6}
    assert conn.get_block_ids_with_load_errors() == set()  # reported once
    assert torch.equal(block_bytes(cache, layout, 6), before)  # never wrong KV
    assert torch.equal(block_bytes(cache, layout, 5), want0)  # the good block still loads
    assert "b" in conn.load_error_reasons
    # the connector stays usable: rewrite the damaged block and load again
    target.unlink()
    _save(conn, make_request("c", 2, bs, seed=11), [1, 2])
    assert _load(conn, make_request("d", 2, bs, seed=11), [3, 4]) == 2 * bs
    assert conn.get_block_ids_with_load_errors() == set()
    assert torch.equal(block_bytes(cache, layout, 4), block_bytes(cache, layout, 2))


def test_hanging_read_times_out(tmp_path: Path, make_request: Callable[..., Any]) -> None:
    layout = make_layout("LBNHC", num_blocks=8)
    conn, _cache = _conn(tmp_path, layout, seed=5, timeout_s=0.5)
    req = make_request("a", 1, layout.block_size, seed=3)
    path = conn.path_of(req.block_hashes[0])
    path.parent.mkdir(parents=True)
    os.mkfifo(path)  # opening it for reading blocks until a writer appears: a hung mount
    try:
        start = time.monotonic()
        assert _load(conn, req, [4]) == layout.block_size
        assert time.monotonic() - start < 5
        assert conn.get_block_ids_with_load_errors() == {4}
        assert "timeout_s=0.5" in conn.load_error_reasons["a"]
    finally:
        threading.Thread(target=lambda: open(path, "wb").close(), daemon=True).start()  # unblock
    time.sleep(0.1)
    path.unlink()
    _save(conn, make_request("b", 1, layout.block_size, seed=3), [1])
    assert _load(conn, make_request("c", 1, layout.block_size, seed=3), [2]) == layout.block_size
    assert conn.get_block_ids_with_load_errors() == set()
    conn.close()


def test_no_temp_file_is_left_and_writes_are_atomic(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    conn, _cache, paths = _two_block_store(tmp_path, make_request)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p not in paths]
    assert leftovers == []
    conn.close()
