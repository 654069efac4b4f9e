"""Where issue 32's decode step spends its host time: ``bench_blocktable.py``'s full step (256
requests, prompts of 500..515 tokens, block size 16), timed phase by phase and under cProfile.

    .venv/bin/python packages/kv-blocktable/benchmarks/profile_decode_step.py \\
        [--device cpu|cuda] [--rounds 6] [--top 25] [--no-profile]

Each round builds a fresh manager and tables (the bench's own ``OursDecode`` and the same
``BlockTables.from_config`` call), then runs ``decode_chunk * repeats * 2`` steps (what the bench
times, so the pool and rows see the same fills). Per step, timed apart: ``append``
(``append_decode_tokens``), ``alloc`` (``allocate_decode_slots``), ``rows``
(``BlockTables.append_rows``), ``commit`` and ``meta`` (``build_common_metadata``). Prints each
phase's median in us over all rounds, then (unless ``--no-profile``) the cProfile of the same
steps sorted by own time. Not collected by pytest; numbers are host time (CUDA work is async).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_blocktable as bb
from kv_blocktable import append_decode_tokens

PHASES = ("append", "alloc", "rows", "commit", "meta", "total")


def _round(device: str, prof: cProfile.Profile | None) -> dict[str, list[float]]:
    import torch

    if device == "cpu":
        torch.set_num_threads(1)  # as the bench does
    p = dict(bb.PARAMS)
    dec = bb.OursDecode(p, device)
    mgr, reqs = dec.mgr, dec.reqs
    n = len(reqs)
    bt = bb.running_tables(dec.cfg, p, device, mgr, reqs)
    ones = [1] * n
    bt.build_common_metadata(n, ones, [mgr.num_computed_tokens(r.request_id) for r in reqs])
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    clock = time.perf_counter
    for step in range(p["decode_chunk"] * p["repeats"] * 2):
        toks = [step % 100] * n
        if prof is not None:
            prof.enable()
        t0 = clock()
        append_decode_tokens(reqs, toks)
        t1 = clock()
        got = mgr.allocate_decode_slots(reqs)
        t2 = clock()
        bt.append_rows(got.rows, got.new_block_ids)
        t3 = clock()
        bt.commit(n)
        t4 = clock()
        bt.build_common_metadata(n, ones, got.num_computed_tokens)
        t5 = clock()
        if prof is not None:
            prof.disable()
        assert got.num_scheduled == n
        for k, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t0), (t1, t2, t3, t4, t5, t5), strict=True):
            times[k].append(b - a)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args(argv)
    allt: dict[str, list[float]] = {k: [] for k in PHASES}
    for _ in range(args.rounds):
        for k, v in _round(args.device, None).items():
            allt[k] += v

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] * 1e6

    print(
        f"device={args.device} steps={len(allt['total'])} median us: "
        + "  ".join(f"{k} {med(v):.1f}" for k, v in allt.items())
    )
    if not args.no_profile:
        prof = cProfile.Profile()
        for _ in range(max(1, args.rounds // 2)):
            _round(args.device, prof)
        stats: Any = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
