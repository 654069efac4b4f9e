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


@pytest.mark.parametrize("kind", ["regular_file", "under_a_file"])
def test_unusable_root_is_refused_at_construction(kind: str, tmp_path: Path) -> None:
    """Issue 28: a root that is a regular file (or cannot be created) used to report every save
    done while nothing reached disk."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"x")
    root = blocker if kind == "regular_file" else blocker / "kv"
    with pytest.raises(ValueError, match=r"FilesystemConfig\.root=.*blocker.*writable directory"):
        FilesystemConnector(FilesystemConfig(root=root, model_fingerprint="model-a"), block_size=4)


def test_failed_save_is_reported_through_the_contract(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    layout = make_layout("BLNHC", num_blocks=8)
    conn, _cache = _conn(tmp_path, layout, seed=5)
    req = make_request("a", 2, layout.block_size, seed=11)
    conn.path_of(req.block_hashes[1]).parent.parent.mkdir(parents=True, exist_ok=True)
    conn.path_of(req.block_hashes[1]).parent.write_bytes(b"a file where a directory must be")
    ok = make_request("b", 1, layout.block_size, seed=12)
    _save(conn, req, [1, 2])  # done_sending: the blocks are on host and may be freed
    _save(conn, ok, [3])
    assert conn.get_request_ids_with_save_errors() == {"a"}
    assert conn.get_request_ids_with_save_errors() == set()  # reported once
    assert conn.path_of(ok.block_hashes[0]).is_file()
    conn.close()


def test_stale_temporaries_of_dead_writers_are_removed_live_ones_kept(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    """A writer killed mid-save leaves ``.<name>~<host>~<pid>~<rand>.tmp``: removed when its pid
    is gone (this host) or when older than stale_tmp_s (any host); a live writer's is kept."""
    import socket
    import subprocess
    import sys

    from kv_connectors.filesystem import _HOST

    layout = make_layout("BLNHC", num_blocks=8)
    conn, _cache = _conn(tmp_path, layout, seed=5, stale_tmp_s=600)
    conn.flush()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    d = conn.path_of(b"\x01" * 32).parent
    d.mkdir(parents=True)
    other = socket.gethostname() + "-elsewhere"
    temps = {
        "dead": d / f".x.kvblock~{_HOST}~{int(dead.stdout)}~a.tmp",
        "live": d / f".x.kvblock~{_HOST}~{os.getpid()}~b.tmp",
        "remote_old": d / f".x.kvblock~{other}~1~c.tmp",
        "remote_new": d / f".x.kvblock~{other}~1~d.tmp",
    }
    for p in temps.values():
        p.write_bytes(b"partial")
    hour_ago = time.time() - 3600
    os.utime(temps["remote_old"], (hour_ago, hour_ago))
    assert conn.clean_stale_temporaries() == 2
    assert {k for k, p in temps.items() if p.exists()} == {"live", "remote_new"}
    conn.close()
    # registration sweeps too (a restarted worker cleans what its killed predecessor left)
    os.utime(temps["remote_new"], (hour_ago, hour_ago))
    again, _ = _conn(tmp_path, layout, seed=5, stale_tmp_s=600)
    again.flush()
    assert {k for k, p in temps.items() if p.exists()} == {"live"}
    again.close()


def test_two_models_with_one_layout_never_read_each_others_kv(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    layout = make_layout("LBNHC", num_blocks=8)
    bs = layout.block_size
    a, _ = _conn(tmp_path, layout, seed=1)  # model-a
    _save(a, make_request("a", 2, bs, seed=3), [1, 2])
    b = FilesystemConnector(
        FilesystemConfig(root=tmp_path, model_fingerprint="model-b", fsync=False), block_size=bs
    )
    b_cache = random_cache(layout, seed=2)
    b.register_kv_caches(b_cache, layout)
    req = make_request("b", 2, bs, seed=3)  # same tokens, same block hashes
    assert b.get_num_new_matched_tokens(req, 0) == (0, False)
    # even a file copied under model-b's name is refused by its header's key
    for h in req.block_hashes:
        b.path_of(h).parent.mkdir(parents=True, exist_ok=True)
        b.path_of(h).write_bytes(a.path_of(h).read_bytes())
    before = block_bytes(b_cache, layout, 5)
    assert _load(b, req, [5, 6]) == 2 * bs
    assert b.get_block_ids_with_load_errors() == {5, 6}
    assert torch.equal(block_bytes(b_cache, layout, 5), before)
    assert _load(a, make_request("a2", 2, bs, seed=3), [5, 6]) == 2 * bs  # model-a still hits
    assert a.get_block_ids_with_load_errors() == set()
    a.close()
    b.close()


def test_filesystem_config_refuses_a_missing_fingerprint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model_fingerprint=None.*pass model_fingerprint="):
        FilesystemConfig(root=tmp_path, model_fingerprint=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        FilesystemConfig(root=tmp_path)  # type: ignore[call-arg]
