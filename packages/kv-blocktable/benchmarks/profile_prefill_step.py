"""Where a long prompt's step metadata spends its host time (issue 32, issue 30's time to first
token): one request of ``T`` new tokens, ``BlockTables`` set up as the engine sets them up (pinned
staging on CUDA), ``commit`` and ``build_common_metadata`` timed apart, then cProfile of the
largest ``T``.

    .venv/bin/python packages/kv-blocktable/benchmarks/profile_prefill_step.py \\
        [--device cpu|cuda] [--tokens 1024,8192,32768] [--reps 20] [--top 20]

On 2 x H200 (``bench_disagg --trace``) an 8k-token prompt's ``build_common_metadata`` took
9.9-12.1 ms of the prefill engine's host time before its first layer. Alone, this script timed
the same call at 0.41 ms on the H200 host: inside the engine, torch's CPU index and
repeat_interleave of the step's per-token arithmetic entered its OpenMP pool, whose workers
(spinning after every region) held the host back; that arithmetic is numpy now (~1 ms in the
engine, as with one torch thread). A call that is fast here and slow in the engine points at
the process around it, not at the call. Prints
medians in ms (with ``torch.cuda.synchronize`` after each call on CUDA, so a call that waits
for the device shows here too). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch
from kv_blocktable.block_table import BlockTables

BLOCK = 16


def tables(device: str, tokens: int) -> BlockTables:
    """One committed row of ``tokens // 16`` blocks, as the engine builds its tables."""
    blocks = -(-tokens // BLOCK)
    cuda = device.startswith("cuda")
    bt = BlockTables(
        [BLOCK], [BLOCK], 4, [blocks + 1],
        device=device, pin_memory=cuda, max_num_batched_tokens=tokens,
        num_blocks=4 * (blocks + 1) + 1,
    )  # fmt: skip
    bt.add_row(0, (list(range(1, blocks + 1)),))
    bt.commit(1)
    return bt


def time_build(bt: BlockTables, tokens: int, reps: int, device: str) -> dict[str, float]:
    """Median ms of ``commit(1)`` and ``build_common_metadata`` for a ``tokens`` prefill."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict[str, list[float]] = {"commit": [], "build": []}
    for i in range(reps + 3):
        t0 = time.perf_counter()
        bt.commit(1)
        sync()
        t1 = time.perf_counter()
        bt.build_common_metadata(1, [tokens], [tokens])
        sync()
        t2 = time.perf_counter()
        if i >= 3:  # (first calls: kernel compiles and loads)
            out["commit"].append(t1 - t0)
            out["build"].append(t2 - t1)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    for t in sizes:
        ms = time_build(tables(args.device, t), t, args.reps, args.device)
        print(f"device={args.device} tokens={t}: commit {ms['commit']:.3f} ms, "
              f"build_common_metadata {ms['build']:.3f} ms", flush=True)  # fmt: skip
    t = max(sizes)
    bt = tables(args.device, t)
    time_build(bt, t, 1, args.device)  # (warm)
    prof = cProfile.Profile()
    prof.enable()
    time_build(bt, t, args.reps, args.device)
    prof.disable()
    stats: Any = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
