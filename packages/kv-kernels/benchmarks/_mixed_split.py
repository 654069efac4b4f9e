"""The mixed-step cases of ``bench_paged_attention.py`` (issue 32, ``--only mixed``): N decodes
over 1k contexts beside one 1k-token prompt in one ``paged_attention`` call (bf16, page 16,
Llama-3-8B heads: 32 q / 8 kv, 128), against the two classes run as separate calls on the same
tensors (a decode-only call over the first N sequences, a prefill-only call over the prompt),
in this process.

Metric: GB/s of K+V read, ``bytes = (N + 1) * 1024 * H * (Dk + Dv) * 2`` (each sequence's pages
once; the prompt's tiles re-read pages per q tile, not counted). Records per case: ``mixed``
(the heuristic: since issue 32 the decode class splits KV, the prompt does not), ``mixed_unsplit``
(``num_splits=1``: what a mixed step ran before), ``decode_only``, ``prefill_only`` and
``separate`` (the two calls in one timed function), each read against the copy; ``mixed`` and
``mixed_unsplit`` also against ``separate`` (GB/s over the same bytes, so the ratio is separate
ms / mixed ms: above 1, the one call beats the two). Each record names the launches' KV split counts (``splits``: decode,
prefill) and the mixed call's largest difference from the separate calls' outputs.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from _paged_case import DTYPE, Case, D, H
from _timing import timed
from kv_kernels.paged_attention import paged_attention

__all__ = ["MIXED", "run_mixed_split"]

#: (decodes, context of every sequence, page): one 1k-token prompt beside them
MIXED = [(64, 1024, 16), (256, 1024, 16)]


def _splits(fn: Callable[[], Any]) -> list[int]:
    """The KV split count (grid axis 2) of each attention launch one call of ``fn`` makes
    (merge launches left out; Gluon launches, which take no grid here, as 0)."""
    tri: Any = importlib.import_module("kv_kernels.paged_attention.triton")
    seen: list[int] = []
    real = tri.describe_launches

    def recording(plan: Any, splits: int, *a: Any, **kw: Any) -> list[Any]:
        got = real(plan, splits, *a, **kw)
        seen.extend(x.grid[2] if len(x.grid) == 3 else 0 for x in got if len(x.grid) != 2)
        return got

    tri.describe_launches = recording
    try:
        from kv_kernels import _call_cache

        old, _call_cache.ENABLED = _call_cache.ENABLED, False  # (describe every launch)
        try:
            fn()
        finally:
            _call_cache.ENABLED = old
        torch.cuda.synchronize()
    finally:
        tri.describe_launches = real
    return seen


def run_mixed_split(records: list[dict], limit: float, keep: Callable[[str], bool]) -> None:
    """Append the mixed cases' records (module notes) to ``records``."""
    for n, ctx, block in MIXED:
        name = f"mixed_split_{n}dec_1x{ctx}_ctx{ctx}_n{block}"
        if keep(name):
            _run_case(records, limit, name, n, ctx, block)
            torch.cuda.empty_cache()


def _run_case(records: list[dict], limit: float, name: str, n: int, ctx: int, block: int) -> None:
    """One mixed case's records (module notes)."""
    case = Case(batch=n + 1, ctx=ctx, block=block, q_len=1, q_lens=[1] * n + [ctx])
    nbytes = case.kv_bytes()  # (n + 1) sequences x ctx tokens x H x (Dk + Dv) x 2 bytes
    dec_out, pre_out = case.out[:n], case.out[n:]
    qsl_pre = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")

    def decode_only() -> Any:
        return paged_attention(
            case.q[:n], case.kv, case.layout, case.block_table[:n], case.seq_lens[:n],
            case.qsl[: n + 1], 1, max_seq_len=ctx, out=dec_out, impl="triton",
        )  # fmt: skip

    def prefill_only() -> Any:
        return paged_attention(
            case.q[n:], case.kv, case.layout, case.block_table[n:], case.seq_lens[n:],
            qsl_pre, ctx, max_seq_len=ctx, out=pre_out, impl="triton",
        )  # fmt: skip

    def separate() -> None:
        decode_only()
        prefill_only()

    separate()
    torch.cuda.synchronize()
    want = case.out.clone()
    fns: dict[str, Callable[[], Any]] = {
        "mixed": case.ours(), "mixed_unsplit": case.ours(num_splits=1),
        "decode_only": decode_only, "prefill_only": prefill_only, "separate": separate,
    }  # fmt: skip
    diffs: dict[str, float] = {}
    for impl in ("mixed", "mixed_unsplit"):
        fns[impl]()
        torch.cuda.synchronize()
        diffs[impl] = (case.out.float() - want.float()).abs().max().item()
    times: dict[str, dict[str, Any]] = {}
    for impl, fn in fns.items():
        try:
            times[impl] = {**timed(fn), "splits": _splits(fn)}
        except Exception as e:  # recorded, not fatal
            times[impl] = {"ms": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    sep_ms = times["separate"].get("ms")
    for impl, t in times.items():
        ms = t.get("ms")
        part = {"decode_only": n / (n + 1), "prefill_only": 1 / (n + 1)}.get(impl, 1.0)
        value = nbytes * part / ms / 1e6 if ms else None  # bytes / ms / 1e6 = GB/s
        rec = {
            "bench": "paged_attention", "case": name, "impl": impl, **t, "metric": "GB/s",
            "value": value, "baseline": "copy", "baseline_value": limit * 1e3,
            "ratio": value / (limit * 1e3) if value else None, "bytes": int(nbytes * part),
            "dtype": str(DTYPE), "heads": [32, H, D], "max_abs_diff_vs_separate":
            diffs.get(impl),
        }  # fmt: skip
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if impl.startswith("mixed") and ms and sep_ms:
            vs = {**rec, "baseline": "separate", "baseline_value": nbytes / sep_ms / 1e6,
                  "ratio": sep_ms / ms}  # fmt: skip
            records.append(vs)
            print(json.dumps(vs), flush=True)
    print(f"# {name}: " + ", ".join(f"{k} {v.get('ms')}" for k, v in times.items()),
          file=sys.stderr, flush=True)  # fmt: skip
