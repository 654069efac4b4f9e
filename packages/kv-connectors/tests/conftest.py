"""Shared fixtures for kv-connectors tests.

- ``@pytest.mark.gpu`` tests are skipped when no CUDA device is present.
- ``make_request(request_id, num_blocks, block_size, seed, prefix)``: kv-blocktable's ``Request``
  with its ``BlockHasher``: real chained block hashes (the connectors read only ``request_id`` and
  ``block_hashes``).
- ``spawn_peer(cfg)``: a producer process (``peer.py``), stopped at the end of the module.
- ``remote_load``: drives a disaggregated consumer (P2P, NIXL) through loads of producer params, as
  the engine does, and says which bytes the consumer's blocks should then hold.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from kv_blocktable import BlockHasher, Request
from kv_connectors.testing import block_bytes
from kv_spec import KVCacheLayout

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _build(request_id: str, token_ids: list[int], block_size: int) -> Any:
    return Request(request_id, list(token_ids), block_hasher=BlockHasher(block_size))


@pytest.fixture
def make_request() -> Callable[..., Any]:
    def make(
        request_id: str,
        num_blocks: int,
        block_size: int,
        *,
        seed: int = 0,
        prefix: list[int] | None = None,
    ) -> Any:
        rng = random.Random(seed)
        tokens = list(prefix or [])
        tokens += [rng.randrange(32000) for _ in range(num_blocks * block_size - len(tokens))]
        return _build(request_id, tokens, block_size)

    return make


PEER = __import__("pathlib").Path(__file__).with_name("peer.py")


class Peer:
    """A producer process (``peer.py``) with bounded reads of its stdout lines."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import json
        import queue
        import subprocess
        import sys
        import threading

        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.params: dict[str, dict[str, Any]] = {}
        while True:
            line = self.expect(("PARAMS", "READY"), timeout_s=90)
            if line.startswith("READY"):
                break
            _tag, name, text = line.split(" ", 2)
            self.params[name] = json.loads(text)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line.rstrip("\n"))
        self.lines.put("EOF")

    def expect(self, prefixes: tuple[str, ...], *, timeout_s: float) -> str:
        import queue
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"peer printed no {prefixes} in {timeout_s}s: {''.join(self.log)[-3000:]}"
                ) from None
            if line.startswith(prefixes):
                return line
            if line == "EOF":
                raise RuntimeError(f"peer exited: {''.join(self.log)[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def spawn_peer() -> Any:
    peers: list[Peer] = []

    def spawn(cfg: dict[str, Any]) -> Peer:
        peer = Peer(cfg)
        peers.append(peer)
        return peer

    yield spawn
    for p in peers:
        p.stop()


class RemoteLoad:
    """One consumer-side load of producer ``params`` at a time, driven as the engine drives it."""

    def __init__(self, make_request: Callable[..., Any]) -> None:
        self._make_request = make_request

    def start(self, conn: Any, params: dict[str, Any], local_ids: list[int], rid: str) -> int:
        """Match, allocate ``local_ids`` and start the load; returns the matched tokens (0: the
        connector refused, nothing started)."""
        req = self._make_request(rid, len(local_ids), conn.block_size)
        conn.add_remote_request(rid, params)
        tokens, async_load = conn.get_num_new_matched_tokens(req, 0)
        if tokens:
            assert async_load
            conn.update_state_after_alloc(req, local_ids, tokens)
            conn.start_load_kv(conn.build_connector_meta())
        return int(tokens)

    def finish(
        self, conn: Any, rid: str, limit_s: float, *, poll_s: float = 0.005
    ) -> tuple[float, set[int]]:
        """Poll until ``rid`` is in ``done_recving``: ``(seconds waited, blocks with errors)``."""
        start = time.monotonic()
        recving: set[str] = set()
        while rid not in recving and time.monotonic() - start < limit_s:
            recving |= conn.get_finished()[1]
            time.sleep(poll_s)
        assert rid in recving, "every load ends in done_recving, failed or not"
        return time.monotonic() - start, conn.get_block_ids_with_load_errors()

    @staticmethod
    def expected(
        src: Any,
        prod: KVCacheLayout,
        cons: KVCacheLayout,
        producer_blocks: Sequence[int],
        tp_rank: int = 0,
    ) -> list[torch.Tensor]:
        """The logical bytes (``[L, H, N, Cb]`` each) the consumer's blocks hold after loading
        ``producer_blocks`` of cache ``src``: merged or split to the consumer's block size, its TP
        heads."""
        blocks = [block_bytes(src, prod, b) for b in producer_blocks]
        if cons.block_size > prod.block_size:  # merged: k producer blocks per consumer block
            k = cons.block_size // prod.block_size
            blocks = [torch.cat(blocks[i : i + k], dim=2) for i in range(0, len(blocks), k)]
        elif cons.block_size < prod.block_size:  # split: each producer block into k
            n = cons.block_size
            k = prod.block_size // n
            blocks = [b[:, :, i * n : (i + 1) * n] for b in blocks for i in range(k)]
        if cons.num_kv_heads != prod.num_kv_heads:
            h = cons.num_kv_heads
            blocks = [b[:, tp_rank * h : (tp_rank + 1) * h] for b in blocks]
        return blocks


@pytest.fixture
def remote_load(make_request: Callable[..., Any]) -> RemoteLoad:
    return RemoteLoad(make_request)
