"""Backend overhead on the GPU: each backend's ``forward`` against calling its kernel directly.

For every backend the same inputs are timed twice in one process: through the backend
(``impl.forward`` with prebuilt metadata: what an engine pays per layer) and through the
underlying kernel called by hand (the baseline). ``ratio = value / baseline_value``; the target is
>= 0.95 (backend overhead <= 5%) at batch-64 decode. Metadata build time (once per step, shared
by all layers of a group) is reported separately as ``build_ms``.

Both sides are timed eagerly (``do_bench``: host and GPU together), on purpose: the backend's
cost over its kernel is host work (metadata views, argument checks), which a CUDA-graph replay
would hide. So these figures are what a caller without CUDA graphs waits, and for short decode
kernels they include the launch's host time on both sides; the kernel's own GPU time is in
``kv-kernels``' graph-timed ``bench_paged_attention.py``.

Formulas:

- decode, KV bytes read: ``sum(seq_lens) * H * (D + Dv) * 2`` (bf16) plus Q and O
  (``T * Hq * (D + Dv) * 2``); metric TB/s = bytes / seconds / 1e12.
- prefill (causal), FLOPs: ``sum_r Hq * 2 * (D + Dv) * L_r * (L_r + 1) / 2`` (QK^T and PV, two
  FLOPs per multiply-add, the causal half); metric TFLOP/s.

Usage (CUDA only)::

    python packages/kv-backends/benchmarks/bench_backends.py --out DIR [--quick]

Writes ``DIR/backends.json`` (a list of records) and prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _direct import direct_flash_attn, direct_paged_attention
from _provenance import provenance


def _bench(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200))


def _batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    head_size: int,
    head_size_v: int,
    block: int,
    hq: int,
    h: int,
) -> Any:
    from kv_backends.testing import make_paged_batch

    b = make_paged_batch(
        query_lens=query_lens,
        seq_lens=seq_lens,
        num_q_heads=hq,
        num_kv_heads=h,
        head_size=head_size,
        head_size_v=head_size_v,
        block_size=block,
        dtype="bfloat16",
        device="cuda",
        fill=False,
        make_kv=False,
    )
    for t in b.storage if isinstance(b.storage, list) else [b.storage]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cache storage holds a {type(t).__name__}, not a torch.Tensor")
        t.normal_()
    return b


def _direct(name: str, b: Any, md: Any, impl: Any, out: torch.Tensor) -> Callable[[], Any]:
    """The kernel the backend wraps, called by hand with the same inputs."""
    cfg = b.config
    if name == "TRITON":
        return direct_paged_attention(b, md, out)
    if name == "FLEX_ATTENTION":
        from kv_backends.backends.flex.compiled import compiled_flex as _compiled_flex

        _, sh, sn, _ = b.kv_cache.stride()
        h = b.kv_cache.shape[1]
        dec = md.decode
        if dec is not None and not md.windows:
            # Pure decode: one batch row per request (the backend's decode call).
            base, length, mask = dec.base_token, dec.length, dec.block_mask
            qx = b.q[: dec.tok.numel()].unsqueeze(2)  # [R, Hq, 1, D]
            opts = impl._kernel_options(md, b.q.device, decode=True)
        else:
            (win,) = md.windows
            base, length, mask = win.base_token, win.length, win.block_mask
            qx = b.q.transpose(0, 1)[None]  # [1, Hq, T, D]
            opts = impl._kernel_options(md, b.q.device)
        off = b.kv_cache.storage_offset() + base * sn
        k = b.kv_cache.as_strided((1, h, length, cfg.head_size), (0, sh, sn, 1), off)
        v = b.kv_cache.as_strided(
            (1, h, length, cfg.head_size_v), (0, sh, sn, 1), off + cfg.head_size
        )
        fn = _compiled_flex()
        return lambda: fn(
            qx,
            k,
            v,
            block_mask=mask,
            scale=impl.scale,
            enable_gqa=True,
            kernel_options=opts,
        )
    if name in ("FLASH_ATTN", "FLASH_ATTN_DIFFKV"):
        return direct_flash_attn(b, md, impl)
    raise ValueError(name)


def _case(
    bench: str, case: str, name: str, b: Any, work: float, metric: str
) -> dict[str, Any] | None:
    from kv_backends import get_backend

    backend = get_backend(name)
    reasons = backend.validate(b.config)
    if reasons:
        print(f"# skip {name} {case}: {reasons}", file=sys.stderr)
        return None
    try:
        builder = backend.make_builder(
            b.config, b.layout, device="cuda", max_num_batched_tokens=max(8192, b.q.shape[0])
        )
        impl = backend.make_impl(b.config, b.layout)
    except (ImportError, ValueError) as e:
        print(f"# skip {name} {case}: {e}", file=sys.stderr)
        return None
    md = builder.build(b.common)
    out = torch.empty(
        b.q.shape[0], b.config.num_q_heads, b.config.head_size_v, dtype=b.q.dtype, device="cuda"
    )
    try:
        direct = _direct(name, b, md, impl, out)
        direct()
    except ImportError as e:
        print(f"# skip {name} {case}: {e}", file=sys.stderr)
        return None
    # TRITON writes into a caller buffer (as the direct call does); Flex and FA return their own.
    out_arg = out if name == "TRITON" else None
    via_backend = lambda: impl.forward(None, b.q, b.kv_cache, md, out=out_arg)  # noqa: E731
    via_backend()
    torch.cuda.synchronize()
    ms_backend = _bench(via_backend)
    ms_direct = _bench(direct)
    ms_build = _bench(lambda: builder.build(b.common))
    value = work / (ms_backend * 1e-3) / 1e12
    base = work / (ms_direct * 1e-3) / 1e12
    return {
        "bench": bench,
        "case": case,
        "impl": name,
        "ms": ms_backend,
        "metric": metric,
        "value": value,
        "baseline": f"{name} kernel called directly",
        "baseline_value": base,
        "ratio": value / base,
        "build_ms": ms_build,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke test)")
    parser.add_argument(
        "--backends",
        default="TRITON,FLEX_ATTENTION,FLASH_ATTN,FLASH_ATTN_DIFFKV",
        help="comma-separated backends to measure (default: all GPU backends)",
    )
    args = parser.parse_args()
    wanted = {n.strip().upper() for n in args.backends.split(",")}
    if not torch.cuda.is_available():
        print("bench_backends needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    batch, ctx = (8, 1024) if args.quick else (64, 4096)
    hq, h = 32, 8
    records: list[dict[str, Any]] = []
    prov = provenance("torch", "triton", "flash-attn", "flash-attn-4")

    def add(r: dict[str, Any] | None) -> None:
        if r is not None:
            r.update(prov)  # the versions and commit the numbers came from
            print(json.dumps(r), flush=True)
            records.append(r)

    for block in (16, 128):
        for name, d, dv in (
            ("TRITON", 128, 128),
            ("FLEX_ATTENTION", 128, 128),
            ("FLASH_ATTN", 128, 128),
            ("FLASH_ATTN_DIFFKV", 192, 128),
        ):
            if name not in wanted:
                continue
            b = _batch(
                [1] * batch, [ctx] * batch, head_size=d, head_size_v=dv, block=block, hq=hq, h=h
            )
            kv_bytes = batch * ctx * h * (d + dv) * 2 + batch * hq * (d + dv) * 2
            add(_case("decode", f"b{batch}x{ctx} page{block} d{d}/{dv}", name, b, kv_bytes, "TB/s"))
            del b
            torch.cuda.empty_cache()
    plen, preqs = (1024, 2) if args.quick else (4096, 4)
    for name, d, dv in (
        ("TRITON", 128, 128),
        ("FLEX_ATTENTION", 128, 128),
        ("FLASH_ATTN", 128, 128),
        ("FLASH_ATTN_DIFFKV", 192, 128),
    ):
        if name not in wanted:
            continue
        b = _batch(
            [plen] * preqs, [plen] * preqs, head_size=d, head_size_v=dv, block=128, hq=hq, h=h
        )
        flops = preqs * hq * 2 * (d + dv) * plen * (plen + 1) / 2
        add(_case("prefill", f"{preqs}x{plen} causal page128 d{d}/{dv}", name, b, flops, "TFLOP/s"))
        del b
        torch.cuda.empty_cache()
    (args.out / "backends.json").write_text(json.dumps(records, indent=1))
    print(f"# wrote {args.out / 'backends.json'} ({len(records)} records)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
