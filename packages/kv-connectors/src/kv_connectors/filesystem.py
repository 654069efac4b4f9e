"""``FilesystemConnector``: blocks as files keyed by block hash; prefix reuse across restarts.

Layout on disk: ``<root>/<layout key>/<hash[:2]>/<hash>.kvblock``, where the layout key is a
digest of the config's ``model_fingerprint`` and the registered caches' compatibility hashes:
two models never read each other's files, even with the same layout (KV depends on the
weights, not only on the layout). One file holds one block's row (every registered cache and layer
slot, inline scales included) behind a fixed header::

    magic "KVSTACKB" | format u32 | layout key (16 B) | hash length u16 | block hash (64 B, padded)
    | payload bytes u64 | blake2b-128 of the payload (16 B)

A file is written to a temporary name in the same directory
(``.<name>~<host>~<pid>~<random>.tmp``), flushed, ``fsync``-ed and renamed into place
(``os.replace`` is atomic on POSIX), so a reader sees a whole file or none. A writer killed
mid-save leaves its temporary behind; :meth:`FilesystemConnector.clean_stale_temporaries` (run at
registration, on the writer thread) removes those that provably belong to no live writer.

The root must be a usable directory: the connector creates it and probes that it can write there
at construction, and refuses (``ValueError`` naming the root and the reason) otherwise. A
running request's blocks are saved as they fill (``blocks_computed``), the rest at its finish.
Saves are written behind ``wait_for_save``: it gathers the blocks into pinned host rows on a
side stream that starts after the compute stream's work so far, without waiting (a CUDA event
marks the rows complete; the writer thread waits for it, never the engine's host), and the
request is reported in ``done_sending`` once every save of it is on the host, so its blocks may
be freed. The gather writes host memory over PCIe from the SMs: on the compute stream it held
the next step back for its whole length. ``handle_preemptions`` makes the compute stream wait
for a preempted request's gathers before its blocks are written. A save that cannot be written is
reported through :meth:`~kv_connectors.KVConnector.get_request_ids_with_save_errors` with its
reason in ``save_error_reasons``, never only logged. On load the
header (magic, format, layout key, block hash, size) and the checksum are verified: a corrupt,
truncated or foreign-layout file is a load error for that block, never wrong KV. Loads run on a
reader thread bounded by ``timeout_s``; a load that overruns is reported as failed (its late bytes
are discarded).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import socket
import struct
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from kv_connectors._save_tracking import SaveTracker, TrackedSaves
from kv_connectors.base import (
    ConnectorCapabilities,
    ConnectorMetadata,
    KVConnector,
    LoadSpec,
    RequestLike,
    SaveSpec,
    log,
)
from kv_connectors.config import FilesystemConfig, check_timeout
from kv_connectors.views import RegisteredKV

__all__ = [
    "BlockFileError",
    "FilesystemConnector",
    "is_stale_temporary",
    "read_block_file",
    "write_block_file",
]

_MAGIC = b"KVSTACKB"
_FORMAT = 1
_HEADER = struct.Struct("<8sI16sH64sQ16s")  # see the module docstring


_HOST = socket.gethostname().replace("~", "-")


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a reused pid reads as alive: the safe way)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale_temporary(path: Path, *, max_age_s: float, now: float | None = None) -> bool:
    """Whether ``path`` (a block file's temporary) belongs to no live writer: written on this
    host by a process that no longer exists, or not modified for ``max_age_s`` seconds (a writer
    on another host sharing the root, whose pid cannot be checked from here). A live writer
    renames its temporary within seconds; one stalled past the bound loses it, and its rename
    then fails: a reported save error, never a torn block file."""
    parts = path.name.removesuffix(".tmp").split("~")
    mine = len(parts) == 4 and parts[1] == _HOST and parts[2].isascii() and parts[2].isdigit()
    if mine and not _pid_alive(int(parts[2])):
        return True
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return False  # renamed into place or removed meanwhile
    return (time.time() if now is None else now) - mtime > max_age_s


#: pinned slabs of ``FilesystemConfig.staging_bytes``: saves in flight to disk at once
_SLABS = 4


class BlockFileError(ValueError):
    """A block file cannot be used (missing, truncated, corrupt or written for another layout)."""


def _checksum(payload: memoryview | bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def write_block_file(
    path: Path, layout_key: bytes, block_hash: bytes, payload: bytes | memoryview, *, fsync: bool
) -> None:
    """Write one block file atomically (temp file in the same directory, fsync, rename)."""
    if len(block_hash) > 64:
        raise ValueError(f"block hash has {len(block_hash)} bytes; at most 64 fit the header")
    header = _HEADER.pack(
        _MAGIC, _FORMAT, layout_key, len(block_hash), block_hash, len(payload), _checksum(payload)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}~{_HOST}~{os.getpid()}~{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_block_file(path: Path, layout_key: bytes, block_hash: bytes, nbytes: int) -> bytes:
    """Read and verify one block file; raise :class:`BlockFileError` saying what is wrong."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BlockFileError(f"{path}: cannot read ({exc.strerror})") from exc
    if len(data) < _HEADER.size:
        raise BlockFileError(f"{path}: truncated header ({len(data)} < {_HEADER.size} bytes)")
    magic, fmt, key, hlen, hpad, size, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC or fmt != _FORMAT:
        raise BlockFileError(f"{path}: not a kvstack block file (magic {magic!r}, format {fmt})")
    if key != layout_key:
        raise BlockFileError(
            f"{path}: written for layout key {key.hex()}, this cache is {layout_key.hex()}"
        )
    if hpad[:hlen] != block_hash:
        raise BlockFileError(f"{path}: holds block {hpad[:hlen].hex()}, not {block_hash.hex()}")
    payload = memoryview(data)[_HEADER.size :]
    if size != nbytes or len(payload) != nbytes:
        raise BlockFileError(
            f"{path}: payload is {len(payload)} bytes (header says {size}); a block row is {nbytes}"
        )
    if _checksum(payload) != digest:
        raise BlockFileError(f"{path}: checksum mismatch (corrupt payload)")
    return bytes(payload)


def _check_root(root: Path) -> None:
    """Create ``root`` if needed and prove a file can be written there; refuse otherwise."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".kvstack-probe-"):
            pass
    except OSError as exc:
        what = "is not a directory" if root.exists() and not root.is_dir() else "is not usable"
        raise ValueError(
            f"FilesystemConfig.root={str(root)!r} {what} ({exc.strerror or exc}); no block could "
            "be saved there: give a writable directory path (it is created if missing)"
        ) from exc


class FilesystemConnector(TrackedSaves, KVConnector):
    """Disk tier keyed by block hash; see the module docstring."""

    CAPABILITIES = ConnectorCapabilities(kind="store", load_async=False, faults=("corrupt_block",))

    def __init__(self, config: FilesystemConfig, *, block_size: int) -> None:
        if not isinstance(config, FilesystemConfig):
            raise TypeError(f"config must be a FilesystemConfig, got {type(config).__name__}")
        super().__init__(block_size=block_size)
        self.config = config
        _check_root(Path(config.root))
        self._layout_key = b""
        self._dir: Path | None = None
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-fs-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-fs-write")
        self._writes: list[Future[None]] = []
        self._saving: set[bytes] = set()
        self._pending_saves: list[SaveSpec] = []
        self._tracker = SaveTracker()  # saves of running and finished requests
        self._copying: list[tuple[str, Any]] = []  # (request id, event) of gathers in flight
        self._stream: Any = None  # the gathers' side stream (CUDA caches)
        self._slabs: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()  # free pinned slabs
        self._slab_rows = 0  # block rows a slab holds (0: no slabs)
        self._slab_width = 0  # bytes of a slab's row: the registered row's
        #: saves that found every slab writing and took fresh pinned memory (a host stop each)
        self.staging_misses = 0

    def _on_register(self, kv: RegisteredKV) -> None:
        hashes = ",".join(lay.compatibility_hash() for lay in kv.layouts)
        key = f"model={self.config.model_fingerprint}\nlayouts={hashes}"
        self._layout_key = hashlib.sha256(key.encode()).digest()[:16]
        self._dir = Path(self.config.root) / self._layout_key.hex()
        self._writes.append(self._writer.submit(self._clean_quietly))
        kv.load_copy_kernels(host=True, segments=False)  # (none compiles while serving)
        if kv.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(kv.device)
        if kv.device.type == "cuda" and self.config.staging_bytes:
            self._make_slabs(kv)

    def _make_slabs(self, kv: RegisteredKV) -> None:
        """The pinned slabs for ``kv``'s rows (again when a registration changes the row width:
        slabs of the old width still writing are dropped as they come back, see
        :meth:`_host_rows`)."""
        if self._slab_rows and self._slab_width == kv.row_bytes:
            return
        rows = self.config.staging_bytes // (_SLABS * kv.row_bytes)
        if rows < 1:
            raise ValueError(
                f"FilesystemConfig.staging_bytes={self.config.staging_bytes} holds no block "
                f"row in each of its {_SLABS} slabs (a row is {kv.row_bytes} bytes); give "
                f"staging_bytes >= {_SLABS * kv.row_bytes}, or 0 for no slabs"
            )
        self._slab_rows, self._slab_width = rows, kv.row_bytes
        for _ in range(_SLABS):
            self._slabs.put(kv.new_rows(rows, pin=True))

    def _clean_quietly(self) -> None:
        try:
            self.clean_stale_temporaries()
        except OSError as exc:  # a sweep that cannot list the directory is only a leak
            log.warning("filesystem: sweeping stale temporaries failed: %s", exc)

    def clean_stale_temporaries(self) -> int:
        """Remove the temporaries of dead writers under this layout's directory; returns how many.

        Safe against live writers: a temporary is removed only if its writer ran on this host and
        its pid no longer exists, or if it was not modified for ``FilesystemConfig.stale_tmp_s``
        (default an hour; writers on other hosts sharing the root). See
        :func:`is_stale_temporary`."""
        if self._dir is None or not self._dir.is_dir():
            return 0
        removed = 0
        for path in self._dir.glob("*/.*.tmp"):
            if is_stale_temporary(path, max_age_s=self.config.stale_tmp_s):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
        if removed:
            log.warning("filesystem: removed %d stale temporaries under %s", removed, self._dir)
        return removed

    def path_of(self, block_hash: bytes) -> Path:
        """Where the file of ``block_hash`` lives for the registered layout."""
        if self._dir is None:
            raise RuntimeError(
                "FilesystemConnector keys files by the registered layouts: call "
                "register_kv_caches before scheduling"
            )
        name = block_hash.hex()
        return self._dir / name[:2] / f"{name}.kvblock"

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._check_computed(num_computed_tokens)
        first = num_computed_tokens // self.block_size
        hits = 0
        for h in request.block_hashes[first:]:
            if not self.path_of(h).exists():
                break
            hits += 1
        first, tokens = self._matched_blocks(num_computed_tokens, hits)
        if tokens:
            self._matched[request.request_id] = (first, hits)
        return tokens, False

    def _plan_save(self, request: RequestLike, block_ids: Sequence[int], start: int) -> None:
        """Plan the save of ``request``'s blocks from ``start`` on that have no file (and are not
        being saved)."""
        ids: list[int] = []
        hashes: list[bytes] = []
        pairs = zip(request.block_hashes[start:], block_ids[start:], strict=False)
        for h, b in pairs:
            if h in self._saving or self.path_of(h).is_file():
                continue
            ids.append(b)
            hashes.append(h)
            self._saving.add(h)
        if ids:
            self._tracker.opened(request.request_id)
            self._saves.append(SaveSpec(request.request_id, tuple(ids), tuple(hashes)))

    def _drop_save(self, spec: SaveSpec) -> None:
        self._saving.difference_update(spec.block_hashes)
        self._close_save(spec.request_id)

    def handle_preemptions(self, request_ids: Iterable[str]) -> None:
        """Gathers of these requests' blocks still running are waited for by the compute stream
        (a device-side wait) before the engine writes the blocks."""
        ids = set(request_ids)
        self._preempted(ids)
        for rid, event in self._copying:
            if rid in ids and event is not None:
                torch.cuda.current_stream(self.kv.device).wait_event(event)

    # -- worker side ---------------------------------------------------------------------------

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        self._pending_saves.extend(meta.saves)
        for spec in meta.loads:
            if spec.block_ids:
                self._load(spec)

    def _read_all(self, spec: LoadSpec) -> tuple[torch.Tensor, list[int], dict[int, str]]:
        kv = self.kv
        rows = kv.new_rows(len(spec.block_ids), pin=True)  # [n, row_bytes]
        good: list[int] = []
        bad: dict[int, str] = {}
        for i, h in enumerate(spec.block_hashes):
            try:
                data = read_block_file(self.path_of(h), self._layout_key, h, kv.row_bytes)
            except BlockFileError as exc:
                bad[spec.block_ids[i]] = str(exc)
                continue
            rows[i].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            good.append(i)
        return rows, good, bad

    def _load(self, spec: LoadSpec) -> None:
        future = self._reader.submit(self._read_all, spec)
        try:
            rows, good, bad = future.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            # The reader is stuck (a hung mount, a FIFO): abandon it, the next load gets a new one.
            self._reader.shutdown(wait=False, cancel_futures=True)
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-fs-read")
            self._fail_load(
                spec,
                f"reading {len(spec.block_ids)} block files exceeded "
                f"timeout_s={self.config.timeout_s}",
                async_load=False,
            )
            return
        if bad:
            failed = LoadSpec(spec.request_id, tuple(bad), ())
            self._fail_load(failed, "; ".join(bad.values()), async_load=False)
        if good:
            kv = self.kv
            ids = kv.ids_tensor([spec.block_ids[i] for i in good])
            kv.scatter(kv.select_rows(rows, good) if len(good) < len(rows) else rows, ids)
            kv.host_sync()  # the kernels read the pinned rows directly: keep them until done

    def wait_for_save(self, meta: ConnectorMetadata | None = None) -> None:
        """Gather this step's saved blocks into host rows (on CUDA without waiting: an event
        marks them complete), write the files behind."""
        kv = self.kv
        saves = self._pending_saves if meta is None else [*self._pending_saves, *meta.saves]
        self._pending_saves = []
        for spec in saves:
            event = None
            step = self._slab_rows or len(spec.block_ids)
            for a in range(0, len(spec.block_ids), step):
                part = SaveSpec(
                    spec.request_id, spec.block_ids[a : a + step], spec.block_hashes[a : a + step]
                )
                slab, rows = self._host_rows(len(part.block_ids))
                ids = kv.ids_tensor(part.block_ids)  # (uploaded on the compute stream)
                if self._stream is None:
                    kv.gather(ids, rows)
                else:
                    self._stream.wait_stream(torch.cuda.current_stream(kv.device))
                    ids.record_stream(self._stream)  # (read there after the plan is dropped)
                    with torch.cuda.stream(self._stream):
                        kv.gather(ids, rows)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                self._writes.append(self._writer.submit(self._write_all, part, rows, event, slab))
            self._copying.append((spec.request_id, event))  # (the last part's: the stream's order)
        self._collect()

    def _host_rows(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(slab, rows)``: ``n`` pinned rows from a free slab, or fresh ones (slab None)."""
        while self._slab_rows:
            try:
                slab = self._slabs.get_nowait()
            except queue.Empty:
                self.staging_misses += 1
                break
            if slab.shape[1] == self._slab_width:  # (else a slab of a layout registered before)
                return slab, slab[:n]
        return None, self.kv.new_rows(n, pin=True)

    def _collect(self) -> None:
        """Saves whose rows are on the host: their blocks may be freed."""
        left = []
        for rid, event in self._copying:
            if event is not None and not event.query():
                left.append((rid, event))
            else:
                self._close_save(rid)
        self._copying = left

    def _write_all(
        self, spec: SaveSpec, rows: torch.Tensor, event: Any = None, slab: Any = None
    ) -> None:
        try:
            if event is not None:
                event.synchronize()  # (this thread waits for the gather, never the engine's)
            for i, h in enumerate(spec.block_hashes):
                # (a view, not a copy: tobytes held the GIL ~0.2 ms a 2 MiB block, against the
                # engine's thread; the checksum and the write release it)
                payload = rows[i].numpy().data
                write_block_file(
                    self.path_of(h), self._layout_key, h, payload, fsync=self.config.fsync
                )
        except (OSError, ValueError) as exc:
            self._fail_save(spec.request_id, f"{type(exc).__name__}: {exc}")
        finally:
            self._saving.difference_update(spec.block_hashes)
            if slab is not None:
                self._slabs.put(slab)  # (written or failed: the rows are free)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued file write is on disk (bounded by ``timeout_s``)."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        timeout = check_timeout("FilesystemConnector.flush", "timeout_s", timeout)
        for f in self._writes:
            f.result(timeout=timeout)
        self._writes.clear()

    def _poll(self) -> None:
        self._collect()
        self._writes = [f for f in self._writes if not f.done()]

    def close(self) -> None:
        """Flush queued writes (bounded by ``timeout_s``; a write still hanging after that is
        left to finish on its thread — its temp file never becomes a block file) and stop."""
        try:
            self.flush()
        except FutureTimeout:
            log.warning(
                "filesystem: writes still pending after %.1fs at close", self.config.timeout_s
            )
        self._writer.shutdown(wait=False)
        self._reader.shutdown(wait=False, cancel_futures=True)
