"""FLEX_ATTENTION against torch's own paged-Flex recipe and dense Flex, in one process.

Cases (bf16, 32 query / 8 KV heads, head size 128, shuffled pages):

- decode 64 x 4096 and 8 x 32768 at pages of 16 and 128 tokens: the FLEX_ATTENTION backend
  (``impl.forward`` with prebuilt metadata), torch's paged-Flex recipe (see ``_flex_recipe.py``; timed in a child process),
  dense ``flex_attention`` over contiguous K/V of the same lengths, and the copy bandwidth of
  this GPU (a ``copy_`` of 2 GiB) as the roofline.
- prefill 4 x 4096 causal at pages of 16 and 128: the backend against dense causal
  ``flex_attention`` over the same tokens (each request its own batch row).
- mixed: 2 prefills of 2048 + 32 decodes of 4096 at pages 16 and 128 (its TFLOP/s counts the
  prefills' causal FLOPs plus ``2 * Hq * (D + Dv) * S`` per decode), against dense Flex doing
  the same work in two calls: causal over the prefills (a batch row each) and the decodes over
  contiguous K/V.
- prefill and mixed again with the builder option ``prefill="gather"`` (the flattened call over a
  gathered contiguous copy of the visible context, see ``flex_gather``).
- ``--decode-tiles auto|kv`` (default ``auto``): the builder's ``decode_tiles`` for the
  FLEX_ATTENTION rows (issue 11: ``auto`` gives the decode call one-page KV tiles where the
  layer's tiles are wider than a page; ``kv`` is the behaviour before). ``--legacy-decode`` adds
  a row ``FLEX_ATTENTION decode_tiles=kv`` to every decode and mixed case, measured in the same
  process, for an A/B on one GPU. ``--decode-kernel-options JSON`` passes the impl's
  ``decode_kernel_options`` (e.g. ``'{"num_stages": 3}'``); ``--only TEXT`` keeps the cases whose
  name contains TEXT (repeatable).
- ``--legacy-mask``: adds rows ``FLEX_ATTENTION mask=table`` and ``FLEX_ATTENTION prefill=gather
  mask=table`` to every prefill and mixed case: the flattened call with the block-table mask mod
  (one table load per (query, key) pair of a partial tile; the behaviour before issue 11's
  owner mask, see ``flex_windows``), measured in the same process for an A/B on one GPU.
- ``--decodes-first``: the mixed cases put their decodes before the prefills, as a scheduler
  orders a batch; the prefills' query blocks then straddle requests (more partial tiles).
- ``--fa4``: the backend's flattened call on Flex's FlashAttention-4 (CuTe) kernel
  (``kernel_options={"BACKEND": "FLASH"}``), where torch has the option and ``flash_attn.cute``
  is installed; skipped with the reason otherwise.

Formulas (bytes and FLOPs count what attention must touch, not what a kernel happens to read):

- decode bytes: ``sum(seq_lens) * H * (D + Dv) * 2`` (K and V, bf16) ``+ R * Hq * (D + Dv) * 2``
  (Q in, O out); TB/s = bytes / seconds / 1e12.
- prefill FLOPs: ``sum_r 2 * Hq * (D + Dv) * L_r * (L_r + 1) / 2`` (QK^T and PV, two FLOPs per
  multiply-add, the causal half); TFLOP/s = FLOPs / seconds / 1e12.
- copy bandwidth: ``2 * bytes`` (read + write) / seconds.

Times are CUDA-event medians of ``triton.testing.do_bench`` (25 warm-up, 200 ms of repeats).
Beside each in-process row, ``host ms``: the host time of a call (20 back-to-back calls without a
sync); where it nears ``ms`` the row is host-bound.

The FLEX_ATTENTION rows call ``impl.forward`` without ``out``, as the engine does (the backend then
returns Flex's own output where it can, no copy). Their builders are made with
``static_shapes=True`` on CUDA (the backend's CUDA default, passed explicitly: padded rows and
decode batches, impl compiled with ``dynamic=False``), so no case compiles a dynamic graph that a
later one could reuse. Dynamo is reset between cases all the same (``torch._dynamo.reset()``):
one process compiles Flex for every case, and a case's time should not depend on which graphs
earlier cases left on ``flex_attention``'s code object (8 x 32k decode at page 128 read 2.05 TB/s
in a whole-script run and 2.76-2.85 alone, H100, before the reset). Each case then starts from
an empty Dynamo cache (inductor's compiled kernels stay cached, so recompiling is quick).

Usage::

    python packages/kv-backends/benchmarks/bench_flex.py            # GPU: writes docs/benchmarks/flex.*
    python packages/kv-backends/benchmarks/bench_flex.py --smoke    # CPU: tiny shapes, eager Flex,
                                                                    # checks the script end to end

Writes ``flex.json`` (records), ``flex.md`` (table) and ``flex.png`` (ratios) under ``--out``
(default ``docs/benchmarks``; ``--smoke`` defaults to a temp dir so it never overwrites results).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _flex_recipe import recipe_fn
from _provenance import provenance

HQ, H, D = 32, 8, 128


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "decode" | "prefill" | "mixed"
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block: int


@dataclass
class Record:
    case: str
    impl: str
    ms: float
    value: float
    metric: str
    note: str = ""
    #: host time a call: wall time of back-to-back calls without a sync (GPU); nan where not
    #: measured (the recipe's child process, the copy)
    host_ms: float = float("nan")


def _cases(smoke: bool, decodes_first: bool = False) -> list[Case]:
    if smoke:
        dec = [(4, 64), (2, 160)]
        pre, mixed_pre, mixed_dec = (2, 48), (1, 32), (3, 64)
    else:
        dec = [(64, 4096), (8, 32768)]
        pre, mixed_pre, mixed_dec = (4, 4096), (2, 2048), (32, 4096)
    out = []
    for block in (16, 128):
        for r, s in dec:
            out.append(Case(f"decode {r}x{s} block {block}", "decode", (1,) * r, (s,) * r, block))
    for block in (16, 128):
        r, s = pre
        out.append(
            Case(f"prefill {r}x{s} causal block {block}", "prefill", (s,) * r, (s,) * r, block)
        )
    for block in (16, 128):
        (pr, ps), (dr, ds) = mixed_pre, mixed_dec
        if decodes_first:
            name = f"mixed {dr}x{ds} decode + {pr}x{ps} prefill block {block}"
            ql, sl = (1,) * dr + (ps,) * pr, (ds,) * dr + (ps,) * pr
        else:
            name = f"mixed {pr}x{ps} prefill + {dr}x{ds} decode block {block}"
            ql, sl = (ps,) * pr + (1,) * dr, (ps,) * pr + (ds,) * dr
        out.append(Case(name, "mixed", ql, sl, block))
    return out


def _timer(device: str) -> Callable[[Callable[[], Any]], float]:
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def cpu(fn: Callable[[], Any]) -> float:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cpu


def _host_ms(fn: Callable[[], Any], device: str, calls: int = 20) -> float:
    """Host milliseconds a call: ``calls`` back-to-back calls timed on the host without a sync
    (on a GPU the launches queue up; where the host is the slower side this is the call's
    rate). Next to the GPU time it says whether a row is host-bound: the mixed FLEX forward
    took 0.46 ms of host time a call against 0.50 ms of GPU work before its host path was cut."""
    if device != "cuda":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return ms


def _decode_bytes(c: Case) -> float:
    return sum(c.seq_lens) * H * 2 * D * 2 + len(c.query_lens) * HQ * 2 * D * 2


def _prefill_flops(lens: tuple[int, ...]) -> float:
    return sum(2 * HQ * 2 * D * n * (n + 1) / 2 for n in lens)


def _metric(c: Case, ms: float) -> tuple[float, str]:
    if c.kind == "decode":
        return _decode_bytes(c) / (ms * 1e-3) / 1e12, "TB/s"
    # prefill and mixed: FLOPs of the prefills plus the decodes' (2 * Hq * (D + Dv) * S each)
    flops = _prefill_flops(tuple(q for q in c.query_lens if q > 1)) + sum(
        2 * HQ * 2 * D * s for q, s in zip(c.query_lens, c.seq_lens, strict=True) if q == 1
    )
    return flops / (ms * 1e-3) / 1e12, "TFLOP/s"


def _batch(c: Case, device: str) -> Any:
    from kv_backends.testing import make_paged_batch

    return make_paged_batch(
        query_lens=list(c.query_lens),
        seq_lens=list(c.seq_lens),
        num_q_heads=HQ,
        num_kv_heads=H,
        head_size=D,
        block_size=c.block,
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        make_kv=device != "cuda",  # on the GPU the cache is filled below, on the device
    )


def _backend(
    c: Case,
    b: Any,
    device: str,
    compiled: bool,
    kernel_options: Any = None,
    decode_kernel_options: Any = None,
    **builder_options: Any,
) -> Callable[[], Any]:
    from kv_backends import get_backend

    if device == "cuda":
        b.kv_cache.normal_()
    # The backend's CUDA default, passed explicitly: padded (static) shapes and a dynamic=False
    # compile, so this case's graphs stay static whatever compiled before it.
    builder_options.setdefault("static_shapes", device == "cuda")
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(
        b.config,
        b.layout,
        device=device,
        max_num_batched_tokens=max(sum(c.query_lens), 16),
        max_num_seqs=len(c.query_lens),
        **builder_options,
    )
    md = builder.build(b.common)
    assert md.static_shapes == (device == "cuda"), "the CUDA rows must run static shapes"
    impl = backend.make_impl(
        b.config,
        b.layout,
        compiled=compiled,
        kernel_options=kernel_options,
        decode_kernel_options=decode_kernel_options,
    )
    # No out: the engine passes none (the backend returns Flex's own output where it can).
    return lambda: impl.forward(None, b.q, b.kv_cache, md)


def _flex_fn(device: str, compiled: bool) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    # One process compiles flex_attention for every case's shapes (a dozen and more): past
    # Dynamo's default limit of 8 per function the mixed case's dense baseline failed
    # (FailOnRecompileLimitHit on an H200). Serving compiles a few shapes; a benchmark many.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def _dense_decode(c: Case, device: str, compiled: bool) -> Callable[[], Any]:
    """Dense flex_attention over contiguous ``[R, H, S, D]`` K/V (equal lengths), no mask."""
    r, s = len(c.seq_lens), max(c.seq_lens)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    k = torch.randn(r, H, s, D, dtype=dt, device=device)
    v = torch.randn_like(k)
    q = torch.randn(r, HQ, 1, D, dtype=dt, device=device)
    fn = _flex_fn(device, compiled)
    return lambda: fn(q, k, v, enable_gqa=True)


def _dense_causal(lens: tuple[int, ...], device: str, compiled: bool) -> Callable[[], Any]:
    """Dense causal flex_attention, one batch row per request (equal lengths)."""
    from torch.nn.attention.flex_attention import create_block_mask

    r, s = len(lens), max(lens)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(r, HQ, s, D, dtype=dt, device=device)
    k = torch.randn(r, H, s, D, dtype=dt, device=device)
    v = torch.randn_like(k)

    def causal(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return kv_idx <= q_idx

    bm = create_block_mask(causal, None, None, s, s, device=device)
    fn = _flex_fn(device, compiled)
    return lambda: fn(q, k, v, block_mask=bm, enable_gqa=True)


def _dense_mixed(c: Case, device: str, compiled: bool) -> Callable[[], Any]:
    """Dense Flex over a mixed case's work: causal over the prefills, then the decodes."""
    pre = tuple(s for q, s in zip(c.query_lens, c.seq_lens, strict=True) if q > 1)
    dec = tuple(s for q, s in zip(c.query_lens, c.seq_lens, strict=True) if q == 1)
    causal = _dense_causal(pre, device, compiled)
    decode = _dense_decode(Case(c.name, "decode", (1,) * len(dec), dec, c.block), device, compiled)
    return lambda: (causal(), decode())


def _copy_bandwidth(device: str, timer: Callable[[Callable[[], Any]], float], smoke: bool) -> float:
    n = (1 << 20) if smoke else (1 << 30)  # bf16 elements: 2 GiB on the GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12


def _fa4_options() -> tuple[dict[str, Any] | None, str]:
    import importlib.util

    from kv_backends.backends.flex.options import flex_has_backend_option

    if not flex_has_backend_option():
        return None, "this torch has no kernel_options BACKEND"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return None, "flash_attn.cute (flash-attn-4) is not installed"
    return {"BACKEND": "FLASH"}, ""


def run(args: argparse.Namespace) -> list[Record]:
    device = "cpu" if args.smoke else "cuda"
    compiled = not args.smoke
    timer = _timer(device)
    records: list[Record] = []

    def add(
        case: str, impl: str, fn: Callable[[], Any] | None, c: Case | None, note: str = ""
    ) -> None:
        if fn is None or c is None:
            records.append(Record(case, impl, float("nan"), float("nan"), "", note))
        else:
            ms = timer(fn)
            value, metric = _metric(c, ms)
            records.append(Record(case, impl, ms, value, metric, note, _host_ms(fn, device)))
        print(json.dumps(asdict(records[-1])), flush=True)

    copy = _copy_bandwidth(device, timer, args.smoke)
    records.append(Record("copy", "torch copy_ (read + write)", float("nan"), copy, "TB/s"))
    print(json.dumps(asdict(records[-1])), flush=True)
    fa4, fa4_reason = _fa4_options() if args.fa4 else (None, "not requested (--fa4)")
    dko = json.loads(args.decode_kernel_options) if args.decode_kernel_options else None
    ours = {"decode_tiles": args.decode_tiles, "decode_kernel_options": dko}
    for c in _cases(args.smoke, args.decodes_first):
        if args.only and not any(t in c.name for t in args.only):
            continue
        if compiled:
            # Each case from an empty Dynamo cache (see the module docstring).
            torch._dynamo.reset()
        b = _batch(c, device)
        add(c.name, "FLEX_ATTENTION", _backend(c, b, device, compiled, **ours), c)
        if args.legacy_decode and c.kind != "prefill":
            legacy = _backend(c, b, device, compiled, decode_tiles="kv")
            add(c.name, "FLEX_ATTENTION decode_tiles=kv", legacy, c)
        if c.kind == "decode":
            if args.skip_recipe:
                add(c.name, "torch paged-Flex recipe", None, c, "skipped (--skip-recipe)")
            else:
                _add_recipe(add, records, c, args.smoke)
            add(c.name, "dense flex_attention", _dense_decode(c, device, compiled), c)
        elif c.kind == "prefill":
            add(
                c.name,
                "dense causal flex_attention",
                _dense_causal(c.seq_lens, device, compiled),
                c,
            )
        elif c.kind == "mixed":
            add(
                c.name,
                "dense flex_attention (causal + decode)",
                _dense_mixed(c, device, compiled),
                c,
            )
        if args.legacy_mask and c.kind != "decode":
            table = _backend(c, b, device, compiled, mask="table", **ours)
            add(c.name, "FLEX_ATTENTION mask=table", table, c)
        if c.kind != "decode":
            gather = _backend(c, b, device, compiled, prefill="gather", **ours)
            add(c.name, "FLEX_ATTENTION prefill=gather", gather, c)
        if args.legacy_mask and c.kind != "decode":
            table = _backend(c, b, device, compiled, prefill="gather", mask="table", **ours)
            add(c.name, "FLEX_ATTENTION prefill=gather mask=table", table, c)
        if args.fa4 and c.kind != "decode":
            if fa4 is None:
                add(c.name, "FLEX_ATTENTION (FA4 backend)", None, None, fa4_reason)
            else:
                try:
                    add(
                        c.name,
                        "FLEX_ATTENTION (FA4 backend)",
                        _backend(c, b, device, compiled, fa4),
                        c,
                    )
                except Exception as e:  # report what FA4-through-Flex refuses, keep measuring
                    add(
                        c.name,
                        "FLEX_ATTENTION (FA4 backend)",
                        None,
                        None,
                        f"{type(e).__name__}: {e}"[:200],
                    )
        del b
    return records


def _add_recipe(add: Callable[..., None], records: list[Record], c: Case, smoke: bool) -> None:
    """torch's paged-Flex recipe for ``c``, timed in a child process (``--recipe-case``): on
    torch 2.11 / H200 the recipe itself hit a device-side assert at decode 64 x 4096 block 16,
    which poisons the CUDA context of the process that hits it; in a child the other cases (and
    the backend's rows) still run, and the failure is recorded with its last line."""
    cmd = [sys.executable, __file__, "--recipe-case", c.name] + (["--smoke"] if smoke else [])
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        add(c.name, "torch paged-Flex recipe", None, None, "timed out in its child process")
        return
    line = next((x for x in res.stdout.splitlines() if x.startswith("RECIPE_MS ")), None)
    if res.returncode or line is None:
        err = [x.strip() for x in (res.stderr + res.stdout).splitlines() if x.strip()]
        # a device-side assert prints its kernel-side "Assertion ... failed" line first; the
        # Python error after it only says to compile with TORCH_USE_CUDA_DSA
        why = next((x for x in err if "Assertion" in x), None) or next(
            (x for x in reversed(err) if "Error" in x), err[-1] if err else ""
        )
        print(f"recipe {c.name} failed:\n" + "\n".join(err[-12:]), file=sys.stderr, flush=True)
        add(c.name, "torch paged-Flex recipe", None, None, f"failed: {why}"[:240])
        return
    ms = float(line.split()[1])
    value, metric = _metric(c, ms)
    records.append(Record(c.name, "torch paged-Flex recipe", ms, value, metric, "child process"))
    print(json.dumps(asdict(records[-1])), flush=True)


def _recipe_child(name: str, smoke: bool) -> int:
    """``--recipe-case NAME``: time the recipe of one case and print ``RECIPE_MS <ms>``."""
    device = "cpu" if smoke else "cuda"
    (c,) = [c for c in _cases(smoke) if c.name == name]
    ms = _timer(device)(recipe_fn(c, HQ, H, D, device, _flex_fn(device, not smoke)))
    print(f"RECIPE_MS {ms}", flush=True)
    return 0


def _ratios(records: list[Record]) -> list[dict[str, Any]]:
    """Per case: the backend's value over each other impl's (higher is better for both metrics)."""
    by_case: dict[str, dict[str, Record]] = {}
    for r in records:
        by_case.setdefault(r.case, {})[r.impl] = r
    copy = next((r.value for r in records if r.case == "copy"), float("nan"))
    rows = []
    for case, impls in by_case.items():
        for mine, ours in impls.items():
            if not mine.startswith("FLEX_ATTENTION") or ours.value != ours.value:
                continue
            label = (
                ""
                if mine == "FLEX_ATTENTION"
                else f" [{mine.removeprefix('FLEX_ATTENTION').strip()}]"
            )
            for name, other in impls.items():
                if not name.startswith("FLEX_ATTENTION") and other.value == other.value:
                    rows.append(
                        {"case": case + label, "vs": name, "ratio": ours.value / other.value}
                    )
            if ours.metric == "TB/s":
                rows.append(
                    {"case": case + label, "vs": "copy bandwidth", "ratio": ours.value / copy}
                )
    return rows


def _write(out: Path, records: list[Record], smoke: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dev = "CPU (smoke)" if smoke else torch.cuda.get_device_name()
    meta = {
        "device": dev,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **provenance("torch", "triton"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "heads": {"q": HQ, "kv": H, "head_size": D},
        "dtype": "float32 (smoke)" if smoke else "bfloat16",
    }
    ratios = _ratios(records)
    (out / "flex.json").write_text(
        json.dumps(
            {"meta": meta, "records": [asdict(r) for r in records], "ratios": ratios}, indent=1
        )
    )
    lines = [
        "# flex",
        "",
        f"Written by `packages/kv-backends/benchmarks/bench_flex.py` on {dev} (torch {meta['torch']}), "
        f"{meta['date']}; {meta['dtype']}, {HQ} q / {H} kv heads, head size {D}. Formulas in the script's docstring.",
        "",
        "| case | impl | ms | value | metric | host ms | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r.case} | {r.impl} | {r.ms:.4g} | {r.value:.4g} | {r.metric} | "
            f"{r.host_ms:.3g} | {r.note} |"
        )
    lines += ["", "| case | FLEX_ATTENTION / | ratio |", "|---|---|---|"]
    lines += [f"| {x['case']} | {x['vs']} | {x['ratio']:.3g} |" for x in ratios]
    lines += ["", "![flex](flex.png)", ""]
    (out / "flex.md").write_text("\n".join(lines))
    _plot(out / "flex.png", ratios, dev)


def _plot(path: Path, ratios: list[dict[str, Any]], dev: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{x['case']}\nvs {x['vs']}" for x in ratios]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.5))
    ax.barh(range(len(labels)), [x["ratio"] for x in ratios], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(0.9, color="tab:red", lw=0.8, ls="--", label="0.9 (prefill goal)")
    ax.axvline(0.6, color="tab:orange", lw=0.8, ls=":", label="0.6 (decode / copy goal)")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("FLEX_ATTENTION value / other (higher is better)")
    ax.set_title(f"FLEX_ATTENTION ratios, {dev}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke",
        "--quick",
        action="store_true",
        help="tiny CPU run (eager Flex) to check the script",
    )
    p.add_argument("--fa4", action="store_true", help="also try Flex's FlashAttention-4 backend")
    p.add_argument(
        "--skip-recipe",
        action="store_true",
        help="leave out the paged-Flex recipe baseline (it hits a device-side assert on torch 2.11 "
        "/ H200 at decode 64x4096 block 16; under investigation)",
    )
    p.add_argument(
        "--decode-tiles",
        choices=("auto", "kv"),
        default="auto",
        help="builder decode_tiles of the FLEX_ATTENTION rows (default auto)",
    )
    p.add_argument(
        "--legacy-decode",
        action="store_true",
        help="also measure decode_tiles=kv (the old decode tiles) on decode and mixed cases",
    )
    p.add_argument(
        "--legacy-mask",
        action="store_true",
        help="also measure mask=table (the block-table mask mod) on prefill and mixed cases",
    )
    p.add_argument(
        "--decodes-first",
        action="store_true",
        help="mixed cases put their decodes before the prefills (a scheduler's order)",
    )
    p.add_argument(
        "--decode-kernel-options",
        default=None,
        help="JSON dict of extra decode-call kernel_options, e.g. '{\"num_stages\": 3}'",
    )
    p.add_argument(
        "--only", action="append", default=[], help="keep cases whose name contains this"
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (default docs/benchmarks)")
    p.add_argument("--recipe-case", default=None, help=argparse.SUPPRESS)  # the child's job
    args = p.parse_args(argv)
    if args.recipe_case:
        return _recipe_child(args.recipe_case, args.smoke)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_flex needs CUDA; use --smoke on the CPU", file=sys.stderr)
        return 2
    out = args.out
    if out is None:
        out = (
            Path(tempfile.mkdtemp(prefix="bench_flex_")) if args.smoke else Path("docs/benchmarks")
        )
    records = run(args)
    _write(out, records, args.smoke)
    print(f"wrote {out / 'flex.json'}, flex.md, flex.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
