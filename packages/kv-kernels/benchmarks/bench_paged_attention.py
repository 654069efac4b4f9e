"""Paged attention on a CUDA GPU: our Triton kernel against FA4 (when importable), FlexAttention
over the same paged cache, and torch SDPA on dense K/V, all measured in this process.

Cases (bf16, 32 q heads / 8 kv heads, head size 128, LBNHC cache, shuffled block tables):

- decode: batch 64 x 4k context and batch 8 x 32k context, kernel block 16 and 128. Metric:
  TB/s of K+V bytes read, ``bytes = batch * ctx * H * (head_size + head_size_v) * 2``
  (the query, output and block table are < 0.1% of that and not counted).
- prefill: 4 x 4096 tokens, causal, block 16. Metric: TFLOP/s,
  ``flops = 2 * B * Hq * L^2 * (Dk + Dv) / 2`` (QK^T and PV, half the square under the causal
  mask). Variants: fp16; a mixed step; an fp8 per-tensor cache (``_fp8kv``); DiffKV 192 / 128
  (``_diffkv``).
  Where an sm_90 Gluon kernel serves our prefill or decode (its records say ``prefill_kernel``
  / ``decode_kernel``; the decode one serves fp8 pages, and per-token-head ones on cards of 4+
  TB/s, e.g. the ``fp8pt`` / ``pth`` cases; the MLA one MLA at 64 / 128 heads), the Triton
  kernel runs beside it in the same process as impl ``triton_kernel``
  (``KV_KERNELS_SM90_PREFILL=0``, ``KV_KERNELS_SM90_DECODE=0``, ``KV_KERNELS_SM90_MLA=0``).

- issue 12 paths (``_attention_cases.py``, decode, each against the copy bandwidth measured in
  this process): per-token-head int8 / fp8 caches (bytes = data + inline scales), MLA absorbed
  decode (DeepSeek-V3: 128 heads over a 512 + 64 latent, page 64, 64 x 4k and 8 x 32k) and
  DiffKV 192/128 without padding.
- FlashMLA (``deepseek-ai/FlashMLA``'s sm_90 dense decode, when ``flash_mla`` is importable: see
  ``tools/flashmla/README.md`` for building it on the GPU machine) runs as a peer of the MLA cases
  at page 64 (128 and 16 heads, 64 x 4k and 8 x 32k) over the same cache (its ``[blocks, 64, 1,
  576]`` layout is ours with two unit axes swapped), block table, lengths, query and softmax
  scale. Its output (V = the latent's first 512 dims) is compared with ours (``max_abs_diff``,
  ``outputs_match``: ``allclose`` at atol = rtol = 1e-2); its records are impl ``flashmla`` (TB/s
  vs the copy and TFLOP/s), and ours' TFLOP/s records then carry ``"baseline": "flashmla"`` with
  the ratio and ``flashmla_commit``. Not importable: one line says so and the peer is skipped.

``--cases PATTERNS`` (comma-separated ``fnmatch`` patterns over case names, e.g. ``'mla*,pth*'``)
picks cases; ``--only mla`` is ``--cases 'mla*'`` (every MLA case), ``--only flashmla`` the four
that FlashMLA serves (``'mla*_n64'``), ``--only mixed`` the mixed-step cases of
``_mixed_split.py`` (64 / 256 decodes of 1k beside a 1k prompt: one call vs two); ``--smoke`` (``--quick``) runs the issue-12 cases at tiny
shapes under the Triton interpreter on the CPU (checks that the script works; no meaningful
numbers; no FlashMLA). ``--tune`` also sweeps tile configs
and split counts of our kernel (printing the best) before the main run. Writes
``DIR/paged_attention.json`` (list of records, see the repo's benchmark format), ``.md`` and
``.png``, and prints one JSON line per record. Times (``_timing.py``): ``ms`` is GPU time from a
CUDA-graph replay, with ``eager_ms`` (``do_bench``) and ``host_ms`` (enqueueing one call) beside.

    PYTHONPATH=packages/kv-spec/src:packages/kv-kernels/src python3 \\
        packages/kv-kernels/benchmarks/bench_paged_attention.py --out /tmp/bench [--tune]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if {"--smoke", "--quick"} & set(sys.argv):
    # before the first import of the Triton kernels: the interpreter decides at definition time
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from kv_kernels.testing_attention import counting_gluon_launches

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _attention_cases import new_cases
from _mixed_split import run_mixed_split
from _paged_case import DTYPE, Case, D, triton_kernel_only
from _records import _versions  # this folder's record fields
from _timing import copy_limit, gpu_ms, timed


def _bench(fn: Callable[[], Any], *, warmup: int = 15, rep: int = 60) -> float:
    """GPU ms of one call (CUDA-graph replay; ``_timing`` says why)."""
    return gpu_ms(fn, warmup=warmup, rep=rep)[0]


def _gluon_served(fn: Callable[[], Any], kind: str = "prefill") -> bool:
    """Whether one call of ``fn`` launched the sm_90 Gluon ``kind`` kernel (prefill / decode /
    mla)."""
    with counting_gluon_launches(kind) as calls:
        fn()
    torch.cuda.synchronize()
    return bool(calls)


def _measure(
    name: str, make: Callable[[], Callable[[], Any]], check: torch.Tensor | None
) -> tuple[dict[str, Any] | None, str | None]:
    """``(_timing.timed(fn), None)`` of the call ``make()`` returns, after checking its output
    against ``check`` (ours), or ``(None, why)``."""
    try:
        fn = make()
        res = fn()
        res = res[0] if isinstance(res, tuple) else res
        if check is not None and res is not None:
            # SDPA / Flex give [batch, Hq, q_len, D]; ours and FA4 give [T, Hq, D]
            got = res.transpose(1, 2) if res.dim() == 4 else res
            err = (got.reshape(check.shape).float() - check.float()).abs().max().item()
            if not err < 5e-2:
                return None, f"{name}: max abs error {err:.3g} vs our kernel"
        torch.cuda.synchronize()
        return timed(fn), None
    except Exception as e:  # a baseline that fails is recorded, not fatal
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def flashmla_commit() -> str | None:
    """FlashMLA's commit when ``flash_mla`` (and its built extension) imports, else ``None`` after
    one line saying why. The commit is read from the ``COMMIT`` file that
    ``tools/flashmla/build_on_device.sh`` puts in the package (``"unknown"`` without it)."""
    try:
        import flash_mla
        import flash_mla.cuda  # (the built extension, not only the Python wrapper)
    except Exception as e:
        print(
            f"# flashmla: not importable ({type(e).__name__}: {str(e)[:120]}); skipping the "
            "FlashMLA peer (tools/flashmla/README.md builds it)",
            file=sys.stderr,
            flush=True,
        )
        return None
    path = os.path.join(os.path.dirname(flash_mla.__file__), "COMMIT")
    commit = "unknown"
    if os.path.exists(path):
        with open(path) as f:
            first = f.readline().split()
        commit = first[-1] if first else commit
    print(f"# flashmla: {flash_mla.__file__} at commit {commit}", file=sys.stderr, flush=True)
    return commit


def run_new_cases(
    records: list[dict],
    limit: float,
    *,
    smoke: bool,
    keep: Callable[[str], bool],
    flashmla: str | None = None,
) -> None:
    """The issue-12 decode cases, each as TB/s of its stored bytes against the copy limit;
    ``flashmla`` (FlashMLA's commit, ``None``: not importable) adds FlashMLA beside the MLA cases
    it serves."""
    device = "cpu" if smoke else "cuda"
    for make in new_cases(device=device, smoke=smoke, keep=keep):
        case = make()
        gluon = ""  # which sm_90 Gluon kernel serves the case, if one does
        if not smoke:
            gluon = next((k for k in ("decode", "mla") if _gluon_served(case.run, k)), "")
        peer = None
        if flashmla and case.flashmla is not None and not smoke:
            peer = _run_flashmla(records, limit, case, flashmla)
        _run_new_case(records, limit, case, smoke, "triton", case.run, gluon, peer)
        if gluon:
            # the Triton kernel on the same case, in the same process (KV_KERNELS_SM90_*=0)
            _run_new_case(records, limit, case, smoke, "triton_kernel",
                          triton_kernel_only(case.run), "", peer)  # fmt: skip
        del case
        if not smoke:
            torch.cuda.empty_cache()


def _run_flashmla(
    records: list[dict], limit: float, case: Any, commit: str
) -> dict[str, Any] | None:
    """FlashMLA on ``case`` (after our kernel's output is compared with its): its TB/s record
    against the copy and its TFLOP/s, or an error record. Returns the fields that ours' TFLOP/s
    record takes as its FlashMLA baseline (``None`` when FlashMLA failed)."""
    base = {"bench": "paged_attention", "case": case.name, "impl": "flashmla",
            "flashmla_commit": commit, "bytes": case.nbytes, "smoke": False}  # fmt: skip
    try:
        case.run()  # ours, into case.out
        torch.cuda.synchronize()
        ours = case.out.clone()
        fn = case.flashmla()
        got = fn()  # [batch, 1, heads, 512]
        torch.cuda.synchronize()
        got = got.reshape(ours.shape).float()
        ref = ours.float()
        diff = (got - ref).abs().max().item()
        match = bool(torch.allclose(got, ref, atol=1e-2, rtol=1e-2))
        check = {"max_abs_diff": diff, "ref_abs_max": ref.abs().max().item(),
                 "outputs_match": match}  # fmt: skip
        if not match:
            print(f"# {case.name} flashmla: OUTPUTS DIFFER from ours (max abs diff {diff:.3g})",
                  file=sys.stderr, flush=True)  # fmt: skip
        del got, ref, ours
        times = timed(fn)
    except Exception as e:  # recorded, not fatal
        rec = {**base, "ms": None, "metric": "TB/s", "value": None, "baseline": "copy",
               "baseline_value": limit, "ratio": None,
               "error": f"{type(e).__name__}: {str(e)[:300]}"}  # fmt: skip
        records.append(rec)
        print(json.dumps(rec), flush=True)
        return None
    ms = times["ms"]
    tbs = case.nbytes / ms / 1e9
    rec = {**base, **times, "metric": "TB/s", "value": tbs, "baseline": "copy",
           "baseline_value": limit, "ratio": tbs / limit, "copy_limit": limit, **check}  # fmt: skip
    tflops = case.flops / ms / 1e9
    flop_rec = {**rec, "metric": "TFLOP/s", "value": tflops, "baseline": None,
                "baseline_value": None, "ratio": None}  # fmt: skip
    for r in (rec, flop_rec):
        records.append(r)
        print(json.dumps(r), flush=True)
    return {"baseline": "flashmla", "baseline_value": tflops, "flashmla_commit": commit,
            "flashmla_ms": ms, **check}  # fmt: skip


def _run_new_case(
    records: list[dict], limit: float, case: Any, smoke: bool, impl: str,
    run: Callable[[], Any], gluon: str, peer: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """One timed record of ``run`` (``case.run`` or its Triton-kernel twin) against the copy;
    with ``peer`` (``_run_flashmla``'s), its TFLOP/s record is read against FlashMLA's."""
    try:
        run()
        if smoke:
            t0 = time.perf_counter()
            run()
            ms = (time.perf_counter() - t0) * 1e3
            times: dict[str, Any] = {"ms": ms, "timing": "interpreter"}
        else:
            torch.cuda.synchronize()
            times = timed(run)
            ms = times["ms"]
        value, err = case.nbytes / ms / 1e9, None
    except Exception as e:  # recorded, not fatal: the other cases still run
        ms, value, err, times = None, None, f"{type(e).__name__}: {str(e)[:300]}", {}
    rec = {
        "bench": "paged_attention", "case": case.name, "impl": impl, "ms": ms,
        "metric": "TB/s", "value": value, "baseline": "copy", "baseline_value": limit,
        "ratio": value / limit if value is not None else None, "copy_limit": limit,
        "bytes": case.nbytes, "smoke": smoke, **times,
    }  # fmt: skip
    if err:
        rec["error"] = err
    if impl == "triton" and not smoke:
        # which kernel served the decode (sm_90 fp8 pages: the Gluon decode kernel, see
        # kv_kernels.paged_attention._sm90_decode; MLA at 64 / 128 heads: _sm90_mla's;
        # elsewhere the Triton kernel)
        rec["decode_kernel"] = {"decode": "gluon_sm90", "mla": "gluon_sm90_mla"}.get(
            gluon, "triton"
        )
    records.append(rec)
    print(json.dumps(rec), flush=True)
    if case.flops and value is not None:
        if ms is None:  # value is computed from ms, so this cannot happen
            raise RuntimeError(f"{case.name}: a value was measured without its time in ms")
        # MLA's compute rate beside its bandwidth: at 128 heads the MMA, not HBM, is the roof
        flop_rec = {**rec, "metric": "TFLOP/s", "value": case.flops / ms / 1e9,
                    "baseline": None, "baseline_value": None, "ratio": None}  # fmt: skip
        if peer:  # FlashMLA on the same case, same process: ours / FlashMLA's TFLOP/s
            flop_rec.update(peer, ratio=flop_rec["value"] / peer["baseline_value"])
        records.append(flop_rec)
        print(json.dumps(flop_rec), flush=True)


def _provenance() -> dict[str, str | bool | None]:
    """The card and versions a sweep ran on (its JSON carries them, as every record does)."""
    return {"device": torch.cuda.get_device_name(), **_versions()}


def write_report(records: list[dict], out: str, device: str) -> None:
    """``paged_attention.json``, ``.md`` (the table printed below too) and ``.png`` (ratio of
    each record to its baseline, one bar per record)."""
    for r in records:
        r.setdefault("device", device)
        for key, version in _versions().items():
            r.setdefault(key, version)
    with open(os.path.join(out, "paged_attention.json"), "w") as f:
        json.dump(records, f, indent=1)
    lines = [
        f"# paged attention on {device}",
        "",
        "Values from GPU time (CUDA-graph replay); eager ms (do_bench) and host ms (enqueueing one "
        "call) beside it.",
        "",
        "| case | impl | metric | value | vs | ratio | GPU ms | eager ms | host ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        v = "—" if r["value"] is None else f"{r['value']:.3f}"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        ms = [f"{r[k]:.4f}" if r.get(k) is not None else "—" for k in ("ms", "eager_ms", "host_ms")]
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['metric']} | {v} | {r['baseline']} | {ratio} | "
            + " | ".join(ms)
            + " |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "paged_attention.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return
    shown = [
        r for r in records if r["ratio"] is not None and r["impl"] in ("triton", "triton_kernel")
    ]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(shown) + 1.5))
    labels = [
        f"{r['case']} vs {r['baseline']}" + (" (Triton kernel)" if r["impl"] != "triton" else "")
        for r in shown
    ]
    colors = ["tab:blue" if r["impl"] == "triton" else "tab:gray" for r in shown]
    ax.barh(labels, [r["ratio"] for r in shown], color=colors)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("ours / baseline (TB/s vs copy limit, or vs the named kernel)")
    ax.set_title(f"paged attention, {device}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "paged_attention.png"), dpi=120)
    plt.close(fig)


DECODE = [(64, 4096, 16), (64, 4096, 128), (8, 32768, 16), (8, 32768, 128)]
#: ``--only NAME``: named ``--cases`` patterns
ONLY = {"mla": "mla*", "flashmla": "mla*_n64", "mixed": "mixed_split*"}
#: the case names that FlashMLA serves (whether to look for it at all)
_MLA_PEERED = [
    f"{tag}_decode_b{b}_ctx{c}_n64"
    for tag in ("mla", "mla_h16")
    for b, c in ((64, 4096), (8, 32768))
]
PREFILL = [(4, 4096, 16), (4, 4096, 128)]
#: (name suffix, dtype, q_lens of 4k-context sequences): prefill in fp16 as well as bf16, and a
#: mixed step of 4 chunked prefills (1024 new tokens over 3072 cached) and 32 decodes
PREFILL_VARIANTS = [
    ("", torch.bfloat16, None),
    ("_fp16", torch.float16, None),
    ("_mixed", torch.bfloat16, [1024] * 4 + [1] * 32),
    ("_fp8kv", torch.bfloat16, None),
    ("_diffkv", torch.bfloat16, None),
]
#: prefill variants whose cache is not the query's dtype: fp8 e4m3 per tensor (the issue's "fp8
#: prefill vs FA4 with fp8 K/V if FA4 takes it"; the Triton kernel serves it)
KV_DTYPES = {"_fp8kv": torch.float8_e4m3fn}
#: prefill variants with K / V head sizes other than 128 / 128: DiffKV 192 / 128 (the issue's
#: "prefill >= 0.8x FA4 (FLASH_ATTN_DIFFKV) on the same shapes")
HEADS = {"_diffkv": (192, 128)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for paged_attention.json")
    ap.add_argument("--tune", action="store_true", help="sweep our tile configs / splits first")
    ap.add_argument(
        "--tune-paths",
        action="store_true",
        help="sweep decode configs of the issue-12 cases (--cases picks them) first",
    )
    ap.add_argument(
        "--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)"
    )
    ap.add_argument(
        "--cases", default="*", help="comma-separated fnmatch patterns of case names to run"
    )
    ap.add_argument(
        "--only",
        choices=sorted(ONLY),
        help="a named set of cases instead of --cases: mla (every MLA case), flashmla (the MLA "
        "cases FlashMLA serves: page 64), mixed (decodes beside a prompt in one call vs two: "
        "_mixed_split.py)",
    )
    ap.add_argument(
        "--smoke",
        "--quick",
        action="store_true",
        help="issue-12 cases, tiny, interpreted on the CPU",
    )
    args = ap.parse_args()
    cases = ONLY[args.only] if args.only else args.cases
    patterns = [p.strip() for p in cases.split(",") if p.strip()]

    def keep(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    os.makedirs(args.out, exist_ok=True)
    records: list[dict] = []
    if args.smoke:
        limit = copy_limit("cpu")
        run_new_cases(records, limit, smoke=True, keep=keep)
        write_report(records, args.out, "cpu (smoke, Triton interpreter)")
        return 0 if all(r["value"] is not None for r in records) else 1
    if not torch.cuda.is_available():
        print("bench_paged_attention needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    if args.tune:
        from _tune_tiles import tune

        best = tune(Case, _bench, DECODE, PREFILL, keep)
        with open(os.path.join(args.out, "paged_attention_tune.json"), "w") as f:
            json.dump({**_provenance(), "best": best}, f, indent=1)
    if args.tune_paths:
        from _tune_paths import tune_paths

        best = tune_paths(lambda fn: _bench(fn, warmup=5, rep=25), keep)
        with open(os.path.join(args.out, "paged_attention_tune_paths.json"), "w") as f:
            json.dump({**_provenance(), "best": best}, f, indent=1)
    limit = copy_limit()
    print(
        json.dumps(
            {"bench": "paged_attention", "case": "copy_limit", "value": limit, "metric": "TB/s"}
        ),
        flush=True,
    )
    try:
        import flash_attn.cute  # noqa: F401

        have_fa4 = True
    except Exception:
        have_fa4 = False
    # FlashMLA's commit, or None (said in one line): the MLA cases' peer
    have_flashmla = flashmla_commit() if any(keep(n) for n in _MLA_PEERED) else None

    def emit(
        case: str,
        metric: str,
        values: dict[str, float | None],
        errors: dict[str, str],
        ms: dict[str, dict[str, Any]],
    ) -> None:
        primary = "fa4" if values.get("fa4") else "torch_sdpa"
        for impl, val in values.items():
            if val is None:
                rec = {
                    "bench": "paged_attention",
                    "case": case,
                    "impl": impl,
                    "ms": None,
                    "metric": metric,
                    "value": None,
                    "baseline": primary,
                    "baseline_value": values.get(primary),
                    "ratio": None,
                    "error": errors.get(impl),
                }
                records.append(rec)
                print(json.dumps(rec), flush=True)
                continue
            bases = (
                [primary]
                if impl != "triton"
                else [b for b in ("fa4", "flex_attention", "torch_sdpa") if values.get(b)]
            )
            for base in bases or [primary]:
                bv = values.get(base)
                rec = {
                    "bench": "paged_attention",
                    "case": case,
                    "impl": impl,
                    **ms[impl],  # GPU ms, timing, eager and host ms (_timing)
                    "metric": metric,
                    "value": val,
                    "baseline": base,
                    "baseline_value": bv,
                    "ratio": (val / bv) if bv else None,
                }
                if metric == "TB/s":
                    rec["copy_limit"] = limit
                records.append(rec)
                print(json.dumps(rec), flush=True)

    runs = [("decode", shape, "", DTYPE, None) for shape in DECODE] + [
        ("prefill", shape, *variant) for variant in PREFILL_VARIANTS for shape in PREFILL
    ]
    for kind, (batch, ctx, block), suffix, dtype, q_lens in runs:
        q_len = 1 if kind == "decode" else ctx
        name = f"{kind}_b{batch}_ctx{ctx}_n{block}{suffix}"
        if q_lens:
            batch = len(q_lens)
            name = f"mixed_{q_lens.count(1)}dec_{batch - q_lens.count(1)}x{max(q_lens)}_ctx{ctx}_n{block}"
        if not keep(name):
            continue
        case = Case(
            batch=batch, ctx=ctx, block=block, q_len=q_len, dtype=dtype, q_lens=q_lens,
            kv_dtype=KV_DTYPES.get(suffix), heads=HEADS.get(suffix, (D, D)),
        )  # fmt: skip
        ours = case.ours()
        ref = ours().clone()
        work = case.kv_bytes() if kind == "decode" else case.causal_flops()
        metric = "TB/s" if kind == "decode" else "TFLOP/s"
        scale = 1e9  # bytes / ms / 1e9 = TB/s; flops / ms / 1e9 = TFLOP/s
        makers: dict[str, Callable[[], Callable[[], Any]]] = {"triton": case.ours}
        gluon = _gluon_served(ours, kind)
        if gluon:
            makers["triton_kernel"] = case.ours_triton_kernel
        if have_fa4:
            makers["fa4"] = case.fa4
        if case.uniform:  # the dense baselines take one length for all sequences
            if not args.no_flex:
                makers["flex_attention"] = case.flex
            makers["torch_sdpa"] = case.sdpa
        values: dict[str, float | None] = {}
        errors: dict[str, str] = {}
        ms_of: dict[str, dict[str, Any]] = {}
        for impl, make in makers.items():
            t0 = time.time()
            t, err = _measure(impl, make, None if impl == "triton" else ref)
            if t is None:
                values[impl] = None
                errors[impl] = err or "failed"
            else:
                values[impl] = work / t["ms"] / scale
                ms_of[impl] = t
            print(
                f"# {name} {impl}: {t} ({time.time() - t0:.0f}s wall) {err or ''}",
                file=sys.stderr,
                flush=True,
            )
        n_before = len(records)
        emit(name, metric, values, errors, ms_of)
        for r in records[n_before:]:
            if r["impl"] == "triton":
                # which kernel served the case's class (sm_90: the Gluon kernels, see kv_kernels.
                # paged_attention._sm90_prefill / _sm90_decode; elsewhere the Triton kernel)
                r[f"{kind}_kernel"] = "gluon_sm90" if gluon else "triton"
        del case, ours, ref
        torch.cuda.empty_cache()
    run_new_cases(records, limit, smoke=False, keep=keep, flashmla=have_flashmla)
    run_mixed_split(records, limit, keep)
    write_report(records, args.out, torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
