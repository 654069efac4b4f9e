"""``--tune`` of ``bench_paged_attention.py``: a sweep of the unified kernel's tile configs (and
KV split counts) over the script's bf16 decode and prefill shapes, each config patched into the
launcher's ``select_config`` and timed in the same process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from kv_kernels.paged_attention import triton as pa_triton

__all__ = ["tune"]


def tune(
    case_cls: Any,
    bench: Callable[..., float],
    decode: list[tuple[int, int, int]],
    prefill: list[tuple[int, int, int]],
    keep: Callable[[str], bool],
) -> dict:
    """Sweep tile configs and split counts of our kernel over the script's ``decode`` /
    ``prefill`` shapes (``(batch, ctx, block)``) that ``keep`` names (the ``--cases``
    patterns), each case built by ``case_cls`` and timed by ``bench``; return the best per
    case."""
    orig = pa_triton.select_config
    best: dict[str, Any] = {}
    for batch, ctx, block in decode:
        key = f"decode_b{batch}_ctx{ctx}_n{block}"
        if not keep(key):
            continue
        case = case_cls(batch=batch, ctx=ctx, block=block, q_len=1)
        results: list[tuple[Any, ...]] = []
        for tile_n in (32, 64, 128):
            for warps in (4,):
                for stages in (2, 3, 4):
                    cfg = pa_triton.AttentionConfig(16, 4, tile_n, warps, stages)
                    pa_triton.select_config = lambda kind, _c=cfg, **kw: (
                        _c if kind == "decode" else orig(kind, **kw)
                    )
                    for splits in (1, 2, 4, 8, 16):
                        try:
                            ms = bench(case.ours(num_splits=splits), warmup=5, rep=25)
                        except Exception as e:
                            print(
                                f"tune {key} {cfg} S={splits}: {type(e).__name__} {str(e)[:120]}",
                                flush=True,
                            )
                            break
                        results.append((ms, tile_n, warps, stages, splits))
        pa_triton.select_config = orig
        results.sort()
        for ms, tn, w, st, s in results[:5]:
            print(
                f"TUNE {key} tile_n={tn} warps={w} stages={st} splits={s}: {ms:.3f} ms "
                f"{case.kv_bytes() / ms / 1e9:.3f} TB/s",
                flush=True,
            )
        heur = bench(case.ours())
        print(
            f"TUNE {key} heuristic: {heur:.3f} ms {case.kv_bytes() / heur / 1e9:.3f} TB/s",
            flush=True,
        )
        best[key] = results[0] if results else None
        del case
        torch.cuda.empty_cache()
    for batch, ctx, block in prefill:
        key = f"prefill_b{batch}_ctx{ctx}_n{block}"
        if not keep(key):
            continue
        case = case_cls(batch=batch, ctx=ctx, block=block, q_len=ctx)
        results = []
        for bm, tn, w, st, tma in (
            (128, 64, 4, 2, True),
            (128, 64, 4, 3, True),
            (128, 64, 4, 2, False),
            (128, 64, 4, 3, False),
            (128, 128, 8, 2, True),
            (128, 128, 8, 3, True),
            (128, 64, 8, 2, True),
            (64, 64, 4, 2, True),
            (128, 32, 4, 3, False),
            (128, 64, 4, 4, False),
            (128, 64, 4, 4, True),
            (128, 128, 8, 2, False),
            (64, 64, 4, 3, False),
            # 256 rows over two warpgroups: each KV tile's gathers and copies serve twice the
            # rows (sm_90 build at page 16: 255 registers and no spills, against 224 bytes a
            # thread spilled at 128 rows over one warpgroup)
            (256, 64, 8, 2, True),
            (256, 64, 8, 3, True),
            (256, 32, 8, 3, False),
        ):
            cfg = pa_triton.AttentionConfig(bm, bm // 4, tn, w, st, tma=tma)
            pa_triton.select_config = lambda kind, _c=cfg, **kw: (
                _c if kind == "prefill" else orig(kind, **kw)
            )
            try:
                ms = bench(case.ours(), warmup=5, rep=25)
            except Exception as e:
                print(f"tune {key} {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)
                continue
            results.append((ms, bm, tn, w, st, tma))
            print(
                f"TUNE {key} block_m={bm} tile_n={tn} warps={w} stages={st} tma={tma}: {ms:.3f} ms "
                f"{case.causal_flops() / ms / 1e9:.1f} TFLOP/s",
                flush=True,
            )
        pa_triton.select_config = orig
        results.sort()
        best[key] = results[0] if results else None
        del case
        torch.cuda.empty_cache()
    return best
