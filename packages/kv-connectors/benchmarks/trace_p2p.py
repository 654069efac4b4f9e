"""Where a P2P pull's time goes: one merged host timeline of producer and consumer (issue 30).

    python packages/kv-connectors/benchmarks/trace_p2p.py            # two GPUs (NCCL), 8k tokens
    python packages/kv-connectors/benchmarks/trace_p2p.py --smoke    # CPU, gloo, tiny shapes
    python packages/kv-connectors/benchmarks/trace_p2p.py --deep     # + scheduler calls, polls,
                                                                     #   block-id views and uploads

Runs the benchmark's pull cases (``_two_process``: BLNHC consecutive and shuffled ids, LBNHC
shuffled) with timestamps on the connector's host path -- side-channel messages, the wire's
sends, receives, copies, waits and drains -- and prints, for the last two pulls of each case,
every event of both processes on one clock (``time.time``, shared by processes of one host) in
ms from that pull's start: the one before last as it runs, the last with the CUDA time of each
side's copy and NCCL kernels when the GPUs are there (``torch.profiler`` around that pull; its
CUPTI callbacks slow the CUDA calls down, so read host times off the first). A diagnostic: the
functions are wrapped in place, so the times include the wrappers' few microseconds each.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from _connector_common import Req, make_layout, transfer_shape
from _two_process import _connector, _consume, _wait_sent
from kv_connectors.host_trace import EVENTS, install_transfer, mark, timeline, wrap

PULLS = 4


def _kernel_ms(prof: Any) -> str:
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", 0.0) or 0.0
        if us and ("nccl" in evt.key.lower() or "copy_pages" in evt.key):
            totals[evt.key[:32]] = totals.get(evt.key[:32], 0.0) + us / 1e3
    return ", ".join(f"{k} {v:.3f} ms" for k, v in totals.items()) or "no CUDA kernels"


#: what ``--deep`` wraps beyond :func:`install_transfer`: the scheduler-side calls a load makes,
#: the engine's poll, the pull's planning and the block-id views and uploads of both sides
DEEP = {
    "kv_connectors.transfer:TransferConnector": (
        "add_remote_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "get_finished",
        "_with_peer",
        "_bind_device",
    ),
    "kv_connectors.p2p:P2pConnector": ("_pull_in", "_ask_now"),
    "kv_connectors.views:RegisteredKV": ("contiguous_rows", "ids_tensor", "check_block_ids"),
}


def _install(deep: bool) -> None:
    import importlib

    install_transfer()
    if not deep:
        return
    for where, names in DEEP.items():
        module, owner = where.split(":")
        cls = getattr(importlib.import_module(module), owner)
        for name in names:
            wrap(cls, name)


def _peer(rank: int, smoke: bool, deep: bool, queues: Any, barrier: Any) -> None:
    from kv_kernels import allocate_kv_cache

    _install(deep)
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    shape, n = transfer_shape(smoke)
    q, q2, q3 = queues  # params (to the consumer), results (to it), "last" (to the producer)
    for order, kind in (("BLNHC", "consecutive"), ("BLNHC", "shuffled"), ("LBNHC", "shuffled")):
        layout = make_layout(order, shape)
        conn = _connector("p2p", layout, cuda)
        conn.register_kv_caches(allocate_kv_cache(layout, device), layout)
        gen = torch.Generator().manual_seed(rank)
        ids = list(range(n))
        if kind == "shuffled":
            ids = torch.randperm(shape["num_blocks"], generator=gen)[:n].tolist()
        prof = None
        if rank == 0:
            for i in range(PULLS):
                q.put(conn.request_finished(Req(f"r{i}", [b"h"] * n), ids)[1])
            if cuda:
                assert q3.get(timeout=120) == "last"  # profile the producer for the last pull
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            _wait_sent(conn, PULLS)
            if prof is not None:
                prof.__exit__(None, None, None)
                q2.put(_kernel_ms(prof))
            q2.put(list(EVENTS))
        else:
            times, spans = [], []
            EVENTS.clear()
            for i in range(PULLS):
                last = i == PULLS - 1
                if last and cuda:
                    q3.put("last")
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    prof.__enter__()
                t0 = time.time()
                mark("consume >")
                times.append(_consume(conn, q.get(timeout=120), f"c{i}", ids, device))
                mark("consume <")
                spans.append((t0, time.time()))
            if prof is not None:
                prof.__exit__(None, None, None)
            theirs_kernels = q2.get(timeout=120) if cuda else ""
            theirs = q2.get(timeout=120)
            print(f"== pull {order} {kind}: {[round(t * 1e3, 3) for t in times]} ms", flush=True)
            if prof is not None:
                print(f"   consumer kernels: {_kernel_ms(prof)}", flush=True)
                print(f"   producer kernels: {theirs_kernels}", flush=True)
            # the pull before last without the profiler (its CUPTI callbacks slow CUDA calls
            # down), then the last one under it
            for i in (PULLS - 2, PULLS - 1):
                a, b = spans[i]
                mine = [e for e in EVENTS if a <= e[0] <= b]
                other = [e for e in theirs if a <= e[0] <= b]
                under = "under the profiler" if cuda and i == PULLS - 1 else "no profiler"
                print(f"-- pull {i}, {times[i] * 1e3:.3f} ms, {under}", flush=True)
                for line in timeline([("consumer", mine), ("producer", other)], since=a):
                    print(line, flush=True)
        barrier.wait(timeout=300)
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="CPU processes over gloo, tiny shapes")
    ap.add_argument(
        "--deep",
        action="store_true",
        help="also wrap the scheduler-side calls, the engine's poll and the block-id views",
    )
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    queues = (ctx.Queue(), ctx.Queue(), ctx.Queue())
    barrier = ctx.Barrier(2)
    procs = [
        ctx.Process(target=_peer, args=(r, args.smoke, args.deep, queues, barrier))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)


if __name__ == "__main__":
    main()
