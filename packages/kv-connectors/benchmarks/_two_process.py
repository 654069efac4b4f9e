"""Section 4 of the connector benchmark: transfers between two processes (two GPUs with NCCL, or
gloo / DRAM between two CPU processes), each against a raw ``torch.distributed`` send/recv of the
same bytes measured by the same process pair afterwards.

P2P cases (one process pair, rank 0 produces, rank 1 consumes), ``n`` blocks a request:

- ``pull <order> <ids>``: ``P2pConnector`` READ of a finished request, consumer wall time from
  matching to ``done_recving`` (the engine's view); ids ``consecutive`` (a cross-layer cache then
  moves without staging) or ``shuffled`` (gathered and scattered through staging);
- ``push``: WRITE, producer wall time from ``wait_for_save`` to ``done_sending``;
- ``layerwise``: a per-layer cache streamed while the producer "computes" each layer (matmuls):
  the consumer's ``wait_for_layer_load(i)`` for every layer; reported: the streamed bytes over the
  time from the producer's first layer to the consumer's last (throughput) and the *tail*, how
  long after the producer's last layer the consumer has everything, against a whole-request pull
  of the same bytes after the prefill (the non-streaming alternative).

Raw baselines: one message of the request's bytes, and messages of the connector's chunk size
(``buffer_bytes / 2``) and of one layer's pages (the streaming message), back to back. NIXL is
also held to a raw NIXL READ of the same bytes between two fresh agents (one descriptor, memory
registered and lists prepared before the clock, polled without sleeping): the NCCL ratio says
how far the connector is from the fastest way to move the bytes, this one how much of that is
the connector and how much the transport (UCX).
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from _connector_common import Req, Results, make_layout, sync

__all__ = ["bench_two_process"]

BUFFER_BYTES = 256 * 2**20  # P2P staging: two messages of 128 MiB in flight per side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connector(transport: str, layout: Any, cuda: bool, **cfg: Any) -> Any:
    if transport == "p2p":
        from kv_connectors import P2pConfig, P2pConnector

        return P2pConnector(
            P2pConfig(buffer_bytes=BUFFER_BYTES, timeout_s=60, receive_bytes=8 << 30, **cfg),
            block_size=layout.block_size,
        )
    from kv_connectors import NixlConfig
    from kv_connectors.nixl import NixlConnector

    return NixlConnector(
        NixlConfig(timeout_s=60, progress_thread=cuda, **cfg), block_size=layout.block_size
    )


def _wait_sent(conn: Any, count: int, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    sent = 0
    while sent < count and time.monotonic() < deadline:
        sent += len(conn.get_finished()[0])
        time.sleep(1e-4)


def _consume(conn: Any, params: dict[str, Any], rid: str, ids: list[int], device: Any) -> float:
    """One asynchronous load as an engine drives it; seconds to ``done_recving``."""
    req = Req(rid, [b"x"] * len(ids))
    conn.add_remote_request(rid, params)
    t0 = time.perf_counter()
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, ids, tokens)
    conn.start_load_kv(conn.build_connector_meta())
    done: set[str] = set()
    while rid not in done:
        done |= conn.get_finished()[1]
        time.sleep(5e-5)  # an engine polls once per step; a hot loop would starve the GIL
    sync(device)
    t = time.perf_counter() - t0
    if conn.get_block_ids_with_load_errors():
        raise RuntimeError(f"load failed: {conn.load_error_reasons}")
    return t


def _pull_case(ctx: dict[str, Any], transport: str, order: str, kind: str) -> float | None:
    rank, n, iters, q, device = ctx["rank"], ctx["n"], ctx["iters"], ctx["q"], ctx["device"]
    from kv_kernels import allocate_kv_cache

    layout = make_layout(order, ctx["shape"])
    conn = _connector(transport, layout, device.type == "cuda")
    conn.register_kv_caches(allocate_kv_cache(layout, device), layout)
    g = torch.Generator().manual_seed(rank)
    if kind == "consecutive":
        ids = list(range(n))
    else:
        ids = torch.randperm(layout.num_blocks, generator=g)[:n].tolist()
    total = iters + 2
    out = None
    if rank == 0:
        for i in range(total):
            _delay, params = conn.request_finished(Req(f"r{i}", [b"h"] * n), ids)
            q.put(params)
        _wait_sent(conn, total)
    else:
        times = [_consume(conn, q.get(timeout=120), f"c{i}", ids, device) for i in range(total)]
        out = statistics.median(times[2:])
    ctx["barrier"]()
    conn.close()
    return out


def _push_case(ctx: dict[str, Any]) -> float | None:
    rank, n, iters, q, device = ctx["rank"], ctx["n"], ctx["iters"], ctx["q"], ctx["device"]
    from kv_kernels import allocate_kv_cache

    layout = make_layout("BLNHC", ctx["shape"])
    cuda = device.type == "cuda"
    ids = list(range(n))
    total = iters + 2
    if rank == 1:
        conn = _connector("p2p", layout, cuda, mode="write", role="consumer")
        conn.register_kv_caches(allocate_kv_cache(layout, device), layout)
        host, port = conn.address
        q.put(f"{host}:{port}")
        for i in range(total):
            params = ctx["q2"].get(timeout=120)
            _consume(conn, params, f"c{i}", ids, device)  # frees the receive buffer
            q.put("loaded")
        ctx["barrier"]()
        conn.close()
        return None
    push_to = q.get(timeout=120)
    conn = _connector("p2p", layout, cuda, mode="write", role="producer", push_to=push_to)
    conn.register_kv_caches(allocate_kv_cache(layout, device), layout)
    times = []
    for i in range(total):
        _delay, params = conn.request_finished(Req(f"r{i}", [b"h"] * n), ids)
        t0 = time.perf_counter()
        conn.wait_for_save()  # starts the push
        _wait_sent(conn, 1)
        times.append(time.perf_counter() - t0)
        ctx["q2"].put(params)
        assert q.get(timeout=120) == "loaded"
    ctx["barrier"]()
    conn.close()
    return statistics.median(times[2:])


def _layerwise_case(ctx: dict[str, Any]) -> dict[str, float] | None:
    """Per-layer streaming of one request while the producer computes its layers."""
    rank, n, iters, q, device = ctx["rank"], ctx["n"], ctx["iters"], ctx["q"], ctx["device"]
    from kv_kernels import allocate_kv_cache

    layout = make_layout("LBNHC", ctx["shape"])
    cuda = device.type == "cuda"
    ids = list(range(n))
    total = iters + 2
    conn = _connector("p2p", layout, cuda, layerwise=rank == 1)
    conn.register_kv_caches(allocate_kv_cache(layout, device), layout)
    dim = 8192 if cuda else 64
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(dim, 4096 if cuda else 64, device=device, dtype=dtype)
    w = torch.randn(a.shape[1], a.shape[1], device=device, dtype=dtype)
    result: dict[str, list[float]] = {"first": [], "last": [], "done": [], "layer_ms": []}
    for i in range(total):
        if rank == 0:
            req = Req(f"r{i}", [b"h"] * n)
            params = conn.stream_request(req, ids)
            meta = conn.build_connector_meta()
            conn.start_load_kv(meta)
            q.put(params)
            assert ctx["q2"].get(timeout=120) == "started"
            t_first = time.time()
            for layer in range(layout.num_layers):
                for _ in range(2):  # a prefill layer's worth of matmuls (~1 ms on an H200)
                    torch.mm(a, w)
                conn.save_kv_layer(layer, meta)
            sync(device)
            t_last = time.time()
            conn.wait_for_save()
            conn.request_finished(req, ids)
            q.put((t_first, t_last))
            _wait_sent(conn, 1)
        else:
            params = q.get(timeout=120)
            req = Req(f"c{i}", [b"x"] * n)
            conn.add_remote_request(req.request_id, params)
            tokens, load_async = conn.get_num_new_matched_tokens(req, 0)
            assert not load_async, "identical layouts load layer by layer"
            conn.update_state_after_alloc(req, ids, tokens)
            conn.start_load_kv(conn.build_connector_meta())
            ctx["q2"].put("started")
            for layer in range(layout.num_layers):
                conn.wait_for_layer_load(layer)
            sync(device)
            t_done = time.time()
            if conn.get_block_ids_with_load_errors():
                raise RuntimeError(f"layer-wise load failed: {conn.load_error_reasons}")
            t_first, t_last = q.get(timeout=120)
            result["first"].append(t_first)
            result["last"].append(t_last)
            result["done"].append(t_done)
    ctx["barrier"]()
    conn.close()
    if rank == 0:
        return None
    k = slice(2, None)
    span = [d - f for d, f in zip(result["done"][k], result["first"][k], strict=True)]
    tail = [d - lt for d, lt in zip(result["done"][k], result["last"][k], strict=True)]
    compute = [lt - f for lt, f in zip(result["last"][k], result["first"][k], strict=True)]
    return {
        "span": statistics.median(span),
        "tail": statistics.median(tail),
        "compute": statistics.median(compute),
    }


def _raw(ctx: dict[str, Any], port: int, nbytes: int, messages: list[int]) -> dict[int, float]:
    """Raw send/recv of ``nbytes`` as messages of each size in ``messages``, back to back."""
    import torch.distributed as dist

    rank, device, iters = ctx["rank"], ctx["device"], ctx["iters"]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[int, float] = {}
    for size in messages:
        times = []
        for _ in range(iters + 2):
            dist.barrier()
            t0 = time.perf_counter()
            works = []
            for start in range(0, nbytes, size):
                piece = buf[start : start + size]
                works.append(dist.isend(piece, 1) if rank == 0 else dist.irecv(piece, 0))
            for work in works:
                work.wait()  # type: ignore[union-attr]
            sync(device)
            times.append(time.perf_counter() - t0)
        out[size] = statistics.median(times[2:])
    dist.destroy_process_group()
    return out


def _raw_nixl(ctx: dict[str, Any], nbytes: int) -> float | None:
    """One NIXL READ of ``nbytes`` as a single descriptor between two fresh agents (memory
    registered and descriptor lists prepared before the clock starts), polled without sleeping:
    what the transport does with the bytes, apart from any connector. Seconds (rank 1)."""
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    rank, device, iters, q, q2 = ctx["rank"], ctx["device"], ctx["iters"], ctx["q"], ctx["q2"]
    cuda = device.type == "cuda"
    mem, dev = ("VRAM", device.index or 0) if cuda else ("DRAM", 0)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    agent = nixl_agent(f"raw{rank}", nixl_agent_config(enable_prog_thread=cuda, backends=["UCX"]))
    reg = agent.register_memory([(buf.data_ptr(), nbytes, dev, "")], mem)
    if rank == 0:
        q.put((agent.get_agent_metadata(), buf.data_ptr(), dev))
        # keep the memory until the reader ends, progressing this agent as the connector's
        # producer does in _wait_sent (without a progress thread UCX's wireup needs it)
        deadline = time.monotonic() + 300
        while q2.empty() and time.monotonic() < deadline:
            agent.get_new_notifs()
            time.sleep(1e-4)
        assert q2.get(timeout=5) == "raw nixl done"
        agent.deregister_memory(reg)
        return None
    meta, addr, their_dev = q.get(timeout=120)
    remote = agent.add_remote_agent(meta)
    descs = np.array([[buf.data_ptr(), nbytes, dev]], dtype=np.int64)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(descs, mem))
    theirs = np.array([[addr, nbytes, their_dev]], dtype=np.int64)
    handle = agent.prep_xfer_dlist(remote, agent.get_xfer_descs(theirs, mem))
    times = []
    try:
        for _ in range(iters + 2):
            t0 = time.perf_counter()
            xfer = agent.make_prepped_xfer("READ", local, [0], handle, [0], b"")
            state = agent.transfer(xfer)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(xfer)
            sync(device)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(xfer)
            if state == "ERR":
                raise RuntimeError("raw NIXL READ failed")
    finally:
        q2.put("raw nixl done")
    agent.deregister_memory(reg)
    return statistics.median(times[2:])


def _peer(rank: int, cfg: dict[str, Any], port: int, queues: Any, out: Any, barrier: Any) -> None:
    cuda = torch.cuda.is_available() and not cfg["smoke"]
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    q, q2 = queues
    ctx = {
        "rank": rank,
        "n": cfg["n"],
        "iters": cfg["iters"],
        "shape": cfg["shape"],
        "q": q,
        "q2": q2,
        "device": device,
        "barrier": lambda: barrier.wait(timeout=300),
    }

    def report(key: str, fn: Any) -> None:
        try:
            value = fn()
            if value is not None and (rank == 1 or key == "push"):
                out.put((key, value))
        except Exception as exc:  # one broken case must not hide the rest
            out.put((key, f"{type(exc).__name__}: {exc}"))
            raise

    transport = cfg["transport"]
    if transport == "p2p":
        for order, kind in (("BLNHC", "consecutive"), ("BLNHC", "shuffled"), ("LBNHC", "shuffled")):
            report(f"pull {order} {kind}", lambda o=order, k=kind: _pull_case(ctx, "p2p", o, k))
        report("push", lambda: _push_case(ctx))
        report("layerwise", lambda: _layerwise_case(ctx))
    lay = make_layout("LBNHC", cfg["shape"])
    nbytes = cfg["n"] * lay.num_layers * lay.page_bytes
    if transport == "nixl":
        report("pull BLNHC consecutive", lambda: _pull_case(ctx, "nixl", "BLNHC", "consecutive"))
        report("raw_nixl", lambda: _raw_nixl(ctx, nbytes))
    layer_msg = cfg["n"] * lay.page_bytes
    sizes = sorted({nbytes, min(nbytes, BUFFER_BYTES // 2), layer_msg})
    report("raw", lambda: {str(k): v for k, v in _raw(ctx, port, nbytes, sizes).items()})


def bench_two_process(
    res: Results, transport: str, shape: dict[str, Any], n: int, iters: int, smoke: bool = False
) -> None:
    # NVLink SHARP (multicast) off: it is not available on every host and is not what P2P uses
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned peers
    ctx = mp.get_context("spawn")
    queues = (ctx.Queue(), ctx.Queue())
    out = ctx.Queue()
    barrier = ctx.Barrier(2)
    port = _free_port()
    cfg = {"transport": transport, "shape": shape, "n": n, "iters": iters, "smoke": smoke}
    procs = [ctx.Process(target=_peer, args=(r, cfg, port, queues, out, barrier)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[str, Any] = {}
    try:
        while "raw" not in got:
            key, value = out.get(timeout=300)
            got[key] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    _report(res, transport, shape, n, got, "gloo" if smoke else "NCCL")


def _report(
    res: Results, transport: str, shape: dict[str, Any], n: int, got: dict[str, Any], nccl: str
) -> None:
    lay = make_layout("LBNHC", shape)
    row = lay.num_layers * lay.page_bytes
    nbytes = n * row
    raw = got["raw"]
    if isinstance(raw, str):
        raise RuntimeError(f"raw send/recv failed: {raw}")
    one = raw[str(nbytes)]
    chunk = raw[str(min(nbytes, BUFFER_BYTES // 2))]
    base = f"raw send/recv ({nccl}), one {nbytes / 2**20:.1f} MiB message"
    raw_nixl = got.get("raw_nixl")
    if isinstance(raw_nixl, str):
        res.errors.append({"section": transport, "error": f"raw_nixl: {raw_nixl}", "trace": ""})
    if isinstance(raw_nixl, float):  # the transport alone, beside the NCCL baseline (not instead)
        res.add(
            transport,
            "raw NIXL READ, one descriptor (transport alone, no connector)",
            nbytes,
            raw_nixl,
            base,
            one,
        )
    for key, value in got.items():
        if key in ("raw", "raw_nixl"):
            continue
        if isinstance(value, str):
            res.errors.append({"section": transport, "error": f"{key}: {value}", "trace": ""})
            continue
        if key == "layerwise":
            layer_msg = raw[str(n * lay.page_bytes)]
            res.add(
                transport,
                f"{transport} layer-wise stream LBNHC (span: first layer computed -> last landed)",
                nbytes,
                value["span"],
                "producer compute alone + raw per-layer messages",
                value["compute"] + layer_msg / lay.num_layers,
                tail_ms=value["tail"] * 1e3,
                compute_ms=value["compute"] * 1e3,
                raw_layer_messages_ms=layer_msg * 1e3,
                message_bytes=n * lay.page_bytes,
            )
            continue
        extra = {}
        if isinstance(raw_nixl, float):
            extra = {"raw_nixl_ms": raw_nixl * 1e3, "ratio_to_raw_nixl": raw_nixl / value}
        res.add(
            transport,
            f"{transport} {key}",
            nbytes,
            value,
            base,
            one,
            **extra,
            raw_chunked_ms=chunk * 1e3,
            ratio_to_chunked=chunk / value,
            chunk_bytes=min(nbytes, BUFFER_BYTES // 2),
            physical_block_bytes=make_layout(
                key.split()[1] if key.startswith("pull") else "BLNHC", shape
            ).block_bytes,
        )
