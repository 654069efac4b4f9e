"""``--tune-paths`` of ``bench_paged_attention.py``: a sweep of decode tile configs (and KV split
counts) of the unified kernel over the issue-12 cases (per-token-head, MLA, DiffKV), each timed
against the same case under the launcher's own heuristic, so a better config found here can be
written into :func:`kv_kernels.paged_attention._tiles.select_config` with its measurement."""

from __future__ import annotations

import fnmatch
import functools
import json
from collections.abc import Callable
from typing import Any

import torch
from _attention_cases import new_cases
from kv_kernels.paged_attention import triton as pa_triton

__all__ = ["tune_paths"]

#: (block_m, tile_n, num_warps, num_stages[, max_registers[, kv_upcast[, k_direct, v_direct]]])
#: per case family; block_m is the GQA rows of a program (pth / DiffKV: 16 = 4 heads x 4 tokens;
#: MLA: 32 or 64 of the 128 heads). kv_upcast (1-byte pages, ``AttentionConfig.kv_upcast``): 1
#: upcasts the tiles with fp16 MMAs, 0 the plain upcast; k_direct / v_direct (with kv_upcast): 1
#: reads K / V from shared memory as bytes in the MMA operand's layout (select_config's choice,
#: from compile-time proxies), 0 through an fp16 copy (the earlier kv_upcast path); all timed
#: beside each other in the same process.
SWEEP: dict[str, list[tuple[int, ...]]] = {
    "pth_*": [
        (16, 64, 4, 2, 128, 0), (16, 64, 4, 2, 128, 1, 0, 0), (16, 64, 4, 2, 128, 1, 1, 0),
        (16, 64, 4, 2, 128, 1, 1, 1), (16, 64, 4, 3, 128, 1, 1, 1), (16, 64, 4, 4, 128, 1, 1, 1),
        (16, 64, 4, 2, 168, 1, 1, 1), (16, 32, 4, 3, 128, 1, 1, 1),
    ],
    "mla_h16_*": [
        (16, 32, 4, 3, 128), (16, 32, 4, 2, 128), (16, 32, 4, 4, 128), (16, 64, 4, 2, 128),
        (16, 16, 4, 4, 128), (16, 32, 4, 3), (16, 64, 4, 2), (16, 64, 8, 2), (16, 32, 8, 3),
        (16, 16, 4, 4),
    ],
    # issue 31: the fp8 latent at 16 heads. select_config's pick (32-token tiles, 2 stages, no
    # register cap, K's fp16 copy) beside deeper pipelines, 64-token tiles (one program an SM by
    # shared memory), 8 warps, K read as bytes, the plain upcast and the 1-byte pages' cap
    "mla8_h16_*": [
        (16, 32, 4, 2, 0, 1, 0, 0), (16, 32, 4, 3, 0, 1, 0, 0), (16, 16, 4, 4, 0, 1, 0, 0),
        (16, 64, 4, 1, 0, 1, 0, 0), (16, 64, 4, 2, 0, 1, 0, 0), (16, 64, 8, 2, 0, 1, 0, 0),
        (16, 32, 4, 2, 0, 1, 1, 0), (16, 32, 4, 2, 0, 0), (16, 32, 4, 2, 128, 1, 0, 0),
    ],
    "mla_*": [
        (32, 32, 8, 3), (64, 16, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 1),
        (64, 64, 8, 2),
    ],
    "fp8pt_*": [
        (16, 64, 4, 2, 128, 0), (16, 64, 4, 2, 128, 1, 0, 0), (16, 64, 4, 2, 128, 1, 1, 0),
        (16, 64, 4, 2, 128, 1, 1, 1), (16, 64, 4, 3, 128, 1, 1, 1), (16, 64, 4, 4, 128, 1, 1, 1),
        (16, 64, 4, 2, 0, 1, 1, 1), (16, 32, 4, 3, 128, 1, 1, 1),
    ],
    "diffkv_*": [(16, 32, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4), (16, 64, 8, 3), (16, 128, 8, 2)],
}  # fmt: skip


def tune_paths(bench: Callable[[Callable[[], Any]], float], keep: Callable[[str], bool]) -> dict:
    """Best ``(ms, config, splits)`` per case; prints one ``TUNE`` line per measurement."""
    orig = pa_triton.select_config
    best: dict[str, Any] = {}
    for make in new_cases(device="cuda", smoke=False, keep=keep):
        case = make()
        family = next((f for f in SWEEP if fnmatch.fnmatch(case.name, f)), None)
        if family is None:
            continue
        heur = bench(case.run)
        rows: list[tuple[float, tuple, int | None]] = [(heur, ("heuristic",), None)]
        print(f"TUNE {case.name} heuristic {heur:.4f} ms {case.nbytes / heur / 1e9:.3f} TB/s")
        for entry in SWEEP[family]:
            # (missing fields are 0: no cap, no kv_upcast, and so no byte operands)
            bm, tn, w, st, regs, up, kd, vd = (*entry, 0, 0, 0, 0)[:8]

            def patched(kind: str, _c: tuple = (bm, tn, w, st, regs, up, kd, vd), **kw: Any) -> Any:
                base = orig(kind, **kw)
                if kind != "decode":
                    return base
                heads = min(_c[0], kw["group"])
                return pa_triton.AttentionConfig(
                    _c[0], _c[0] // heads, _c[1], _c[2], _c[3], heads, max_registers=_c[4],
                    kv_upcast=bool(_c[5]), k_direct=bool(_c[6]), v_direct=bool(_c[7]),
                )  # fmt: skip

            pa_triton.select_config = patched
            for splits in (None, 1, 2, 4, 8, 16):
                try:
                    ms = bench(functools.partial(case.run, num_splits=splits))
                except Exception as e:  # a config that does not fit: reported, not fatal
                    print(f"TUNE {case.name} {entry} S={splits}: {type(e).__name__} "
                          f"{str(e)[:160]}", flush=True)  # fmt: skip
                    break
                rows.append((ms, entry, splits))
                print(f"TUNE {case.name} bm={bm} tn={tn} w={w} st={st} regs={regs} up={up} "
                      f"kd={kd} vd={vd} S={splits}: "
                      f"{ms:.4f} ms {case.nbytes / ms / 1e9:.3f} TB/s", flush=True)  # fmt: skip
        pa_triton.select_config = orig
        rows.sort(key=lambda r: r[0])
        best[case.name] = {"heuristic_ms": heur, "best": rows[:3], "bytes": case.nbytes}
        print("TUNE-BEST", json.dumps({case.name: best[case.name]}), flush=True)
        del case
        torch.cuda.empty_cache()
    return best
