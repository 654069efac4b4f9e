"""Section 4 of the connector benchmark: a pull of ``n`` blocks between two processes through
``P2pConnector`` or ``NixlConnector``, against a raw ``torch.distributed`` send/recv of the same
bytes (two GPUs with NCCL, or gloo / DRAM between two CPU processes)."""

from __future__ import annotations

import datetime
import socket
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from _connector_common import Req, Results, make_layout, sync

__all__ = ["bench_two_process"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peer(
    rank: int, transport: str, layout_json: str, n: int, iters: int, port: int, q: Any, out: Any
) -> None:
    """Rank 0 produces (``iters + 2`` finished requests), rank 1 pulls and times; then raw send/recv."""
    import torch.distributed as dist
    from kv_kernels import allocate_kv_cache
    from kv_spec import KVCacheLayout

    layout = KVCacheLayout.from_json(layout_json)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    storage = allocate_kv_cache(layout, device)
    row = layout.num_layers * layout.page_bytes
    if transport == "p2p":
        from kv_connectors import P2pConfig, P2pConnector

        conn: Any = P2pConnector(
            P2pConfig(buffer_bytes=max(256 * 2**20, row), timeout_s=60),
            block_size=layout.block_size,
        )
    else:
        from kv_connectors import NixlConfig
        from kv_connectors.nixl import NixlConnector

        conn = NixlConnector(
            NixlConfig(timeout_s=60, progress_thread=cuda), block_size=layout.block_size
        )
    conn.register_kv_caches(storage, layout)
    ids = list(range(n))
    total = iters + 2
    if rank == 0:
        for i in range(total):
            _delay, params = conn.request_finished(Req(f"r{i}", [b"h"] * n), ids)
            q.put(params)
        deadline = time.monotonic() + 600
        sent = 0
        while sent < total and time.monotonic() < deadline:
            sent += len(conn.get_finished()[0])
            time.sleep(0.001)
    else:
        times = []
        for i in range(total):
            params = q.get(timeout=120)
            req = Req(f"c{i}", [b"x"] * n)
            conn.add_remote_request(req.request_id, params)
            t0 = time.perf_counter()
            tokens, _ = conn.get_num_new_matched_tokens(req, 0)
            conn.update_state_after_alloc(req, ids, tokens)
            conn.start_load_kv(conn.build_connector_meta())
            done: set[str] = set()
            while req.request_id not in done:
                done |= conn.get_finished()[1]
                time.sleep(5e-5)  # an engine polls once per step; a hot loop would starve the GIL
            sync(device)
            times.append(time.perf_counter() - t0)
            errors = conn.get_block_ids_with_load_errors()
            if errors:
                raise RuntimeError(f"pull failed: {conn.load_error_reasons}")
        out.put(("connector", statistics.median(times[2:])))
    conn.close()
    # raw baseline: one contiguous tensor of the same bytes
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    buf = torch.empty(n * row, dtype=torch.uint8, device=device)
    times = []
    for _ in range(iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        sync(device)
        times.append(time.perf_counter() - t0)
    if rank == 1:
        out.put(("raw", statistics.median(times[2:])))
    dist.destroy_process_group()


def bench_two_process(
    res: Results, transport: str, shape: dict[str, Any], n: int, iters: int
) -> None:
    layout = make_layout("BLNHC", shape)
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_peer, args=(r, transport, layout.to_json(), n, iters, port, q, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got: dict[str, float] = {}
    try:
        while len(got) < 2:
            kind, t = out.get(timeout=600)
            got[kind] = t
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    row = layout.num_layers * layout.page_bytes
    base = "torch.distributed send/recv (" + ("NCCL" if torch.cuda.is_available() else "gloo") + ")"
    res.add(
        transport,
        f"{transport} pull BLNHC",
        n * row,
        got["connector"],
        base,
        got["raw"],
        physical_block_bytes=layout.block_bytes,
    )
