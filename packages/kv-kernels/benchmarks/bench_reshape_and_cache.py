"""reshape_and_cache on a CUDA GPU: the Triton kernel against torch baselines in this process.

Case (the issue's target): 64k tokens (65536), bf16, 8 kv heads, head size 128 (K and V), block 16,
slots = whole blocks of a shuffled block table (what a prefill batch writes), LBNHC and LBHNC caches.
Extra cases: fp8_e4m3 per-tensor, int8 per-token-head and fp8_e4m3 per-token-head caches (bf16 in,
1-byte out).

Effective bandwidth, bytes counted once each way::

    bytes = T * H * (head_size + head_size_v) * (in_bytes + cache_bytes)   # K+V read + written
          (+ T * H * 8 scale bytes written for per-token-head)

The slot mapping (8 bytes/token) is not counted. Baselines, same cache, same slots:

- ``torch index_copy_``: the cache viewed as ``[B*N, H, C]`` slots (NHD only), ``index_copy_`` of
  K into ``[..., :head_size]`` and of V into ``[..., head_size:]`` (the issue's 1.29 TB/s baseline);
- ``torch index_put``: advanced-index assignment ``cache[blk, :, off, k_range] = key`` (and V), any order;
- our ``impl="reference"`` (torch, with quantization) for the quantized cases.

A device-to-device copy of the same number of bytes (``torch.Tensor.copy_``, half read, half
written) is measured first and printed as ``copy``: the issue's target is >= 0.88 of it for every
quantized case (each record line carries ``of_copy``).

Target: >= 2.5 TB/s for bf16. Writes ``DIR/reshape_and_cache.json`` and prints one JSON line per record::

    PYTHONPATH=packages/kv-spec/src:packages/kv-kernels/src python3 \\
        packages/kv-kernels/benchmarks/bench_reshape_and_cache.py --out /tmp/bench

``--tune`` sweeps the Triton launch parameters (:class:`~kv_kernels.reshape_and_cache.triton.WriteConfig`:
tokens per program, warps, row split) over the three quantized LBNHC cases instead, checks that each
config writes the same bytes as the launcher's own choice, and prints one ``TUNE`` JSON line per config
and a ``TUNE-BEST`` line per case (about 3 minutes on an H100/H200)::

    ... bench_reshape_and_cache.py --out /tmp/bench --tune
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
from _records import BandwidthRecorder  # this folder's shared record writer
from _timing import gpu_ms, timed
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.reshape_and_cache import reshape_and_cache
from kv_kernels.reshape_and_cache import triton as rc_triton
from kv_spec import KVCacheLayout, KVQuantMode, LayoutOrder

TOKENS, H, D, BLOCK = 65536, 8, 128, 16


def _bench(fn: Callable[[], Any], rep: int = 200) -> float:
    """GPU ms of one call, by CUDA-graph replay (``_timing``: an eager timing of a short call
    measures the host's launch too)."""
    return gpu_ms(fn, warmup=25, rep=rep)[0]


def _case_layout(order: str, dtype: str, kv_quant: str) -> KVCacheLayout:
    """``kv_quant`` may end in ``":plane"``: the per-token-head scales in each page's plane."""
    kv_quant, _, plane = kv_quant.partition(":")
    return KVCacheLayout(
        order=LayoutOrder.parse(order),
        num_layers=1,
        num_blocks=2 * TOKENS // BLOCK,  # the batch fills half the cache, in shuffled blocks
        num_kv_heads=H,
        block_size=BLOCK,
        head_size=D,
        head_size_v=D,
        dtype=dtype,
        kv_quant=KVQuantMode.parse(kv_quant),
        scale_plane=plane == "plane",
    )


def _case(order: str, dtype: str, kv_quant: str) -> dict[str, Any]:
    layout = _case_layout(order, dtype, kv_quant)
    num_blocks = layout.num_blocks
    view = layer_view(allocate_kv_cache(layout, "cuda"), layout, 0)
    blocks = torch.randperm(num_blocks, device="cuda")[: TOKENS // BLOCK]
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).reshape(-1)  # [T] int64
    key = torch.randn(TOKENS, H, D, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(TOKENS, H, D, device="cuda", dtype=torch.bfloat16)
    return {"layout": layout, "view": view, "slots": slots, "key": key, "value": value}


def _bytes(layout: KVCacheLayout) -> int:
    # K+V read (bf16) + written (cache dtype), plus the inline scales written
    n = TOKENS * H * (layout.head_size + layout.head_size_v) * (2 + layout.element_bytes)
    if layout.num_scales:
        n += TOKENS * H * 4 * layout.num_scales
    return n


def _run_case(order: str, dtype: str, kv_quant: str, record: Callable[..., None]) -> None:
    c = _case(order, dtype, kv_quant)
    layout, view, slots, key, value = c["layout"], c["view"], c["slots"], c["key"], c["value"]
    name = f"64k tok {order} {dtype}{'' if kv_quant == 'none' else ' ' + kv_quant}"
    nbytes = _bytes(layout)
    scales: tuple[Any, Any] = (0.05, 0.02) if kv_quant == "fp8_per_tensor" else (None, None)

    def ours(impl: str = "triton") -> None:
        reshape_and_cache(key, value, view, slots, layout, *scales, impl=impl)

    baselines: dict[str, float] = {}
    if kv_quant == "none":
        blk, off = slots // BLOCK, slots % BLOCK
        if order == "LBNHC":
            # NHD: the layer is a [B*N, H, C] array of slots
            flat = view.permute(0, 2, 1, 3).view(-1, H, 2 * D)  # a view: writes land in the cache
            k_dst, v_dst = flat[:, :, :D], flat[:, :, D:]

            def index_copy() -> None:
                k_dst.index_copy_(0, slots, key)
                v_dst.index_copy_(0, slots, value)

            baselines["torch index_copy_"] = _bench(index_copy)

        def index_put() -> None:
            view[blk, :, off, :D] = key
            view[blk, :, off, D:] = value

        baselines["torch index_put"] = _bench(index_put)
    else:
        baselines["reference (torch)"] = _bench(lambda: ours("reference"))
    primary = next(iter(baselines))
    for impl_name, ms in baselines.items():
        record(name, impl_name, ms, nbytes, None, None)
    ours()
    torch.cuda.synchronize()
    t = timed(ours)
    record(
        name, "triton", t["ms"], nbytes, primary, baselines[primary],
        timing=t["timing"], eager_ms=t["eager_ms"], host_ms=t["host_ms"],
    )  # fmt: skip


def _copy_bytes() -> int:
    """Bytes one side of the copy moves: half the int8 case's read + written bytes."""
    return _bytes(_case_layout("LBNHC", "int8", "int8_per_token_head")) // 2


def _copy_tbps() -> float:
    """TB/s of a device-to-device copy moving as many bytes (read + written) as the int8 case."""
    n = _copy_bytes()
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # eager: captured in a graph, a copy runs on the copy engines, not the SMs (see _timing)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * n / ms / 1e9


#: (block_t, num_warps, row_split) swept per case; configs outside 4..64 elements per thread and
#: tensor are skipped (too little work per thread, or too many registers)
_SWEEP = {
    "fp8_per_tensor": list(itertools.product((1, 2, 4, 8), (2, 4, 8), (1,))),
    "int8_per_token_head": list(itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2, 4))),
    "fp8_per_token_head": list(itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2, 4))),
}


def _tune_case(dtype: str, kv_quant: str, copy_tbps: float) -> None:
    c = _case("LBNHC", dtype, kv_quant)
    layout, view, slots, key, value = c["layout"], c["view"], c["slots"], c["key"], c["value"]
    scales: tuple[Any, Any] = (0.05, 0.02) if kv_quant == "fp8_per_tensor" else (None, None)
    nbytes = _bytes(layout)
    orig = rc_triton.launch_config
    default = orig(layout, layout.element_bytes)

    def run() -> None:
        reshape_and_cache(key, value, view, slots, layout, *scales, impl="triton")

    run()
    expected = view.clone()
    rows: list[tuple[float, dict[str, object]]] = []  # (ms, record): sorted by ms
    for block_t, warps, split in [(0, 0, 0), *_SWEEP[kv_quant]]:
        cfg = default
        if block_t:
            per_thread = block_t * default.block_h * default.block_d // (32 * warps)
            cfg = default._replace(block_t=block_t, num_warps=warps, row_split=split)
            if not 4 <= per_thread <= 64 or cfg == default:
                continue
        rc_triton.launch_config = lambda *_a, _c=cfg, **_k: _c
        try:
            view.zero_()
            run()
            same = bool(torch.equal(view, expected))
            ms = _bench(run, rep=100)
        except Exception as e:  # a config that does not compile or fit: reported, not fatal
            print(f"TUNE {kv_quant} {cfg}: {type(e).__name__} {str(e)[:160]}", flush=True)
            continue
        finally:
            rc_triton.launch_config = orig
        tbps = nbytes / ms / 1e9
        rec = {
            "case": f"64k tok LBNHC {dtype} {kv_quant}", "config": cfg._asdict(),
            "default": cfg == default, "ms": ms, "TB/s": tbps, "of_copy": tbps / copy_tbps,
            "same_bytes": same,
        }  # fmt: skip
        rows.append((ms, rec))
        print("TUNE", json.dumps(rec), flush=True)
    rows.sort(key=lambda r: r[0])
    print("TUNE-BEST", json.dumps([rec for _, rec in rows[:3]]), flush=True)


def _tune(copy_tbps: float) -> None:
    for dtype, kv_quant in (
        ("fp8_e4m3", "fp8_per_tensor"),
        ("int8", "int8_per_token_head"),
        ("fp8_e4m3", "fp8_per_token_head"),
    ):
        _tune_case(dtype, kv_quant, copy_tbps)
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for reshape_and_cache.json")
    ap.add_argument("--tune", action="store_true", help="sweep the Triton launch configs instead")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name()
    copy_tbps = _copy_tbps()
    print(json.dumps({"copy": "torch copy_", "TB/s": copy_tbps, "device": device}), flush=True)
    if args.tune:
        _tune(copy_tbps)
        return
    record = BandwidthRecorder("reshape_and_cache", device)
    # the copy of the same bytes, as a record: the quantized cases' target is >= 0.88 of it
    n = _copy_bytes()
    record("copy, int8 case bytes", "torch copy_", 2 * n / copy_tbps / 1e9, 2 * n, None, None)

    for order, dtype, kv_quant in (
        ("LBNHC", "bfloat16", "none"),
        ("LBHNC", "bfloat16", "none"),
        ("LBNHC", "fp8_e4m3", "fp8_per_tensor"),
        ("LBNHC", "int8", "int8_per_token_head"),
        ("LBNHC", "fp8_e4m3", "fp8_per_token_head"),
        ("LBNHC", "int8", "int8_per_token_head:plane"),
    ):
        _run_case(order, dtype, kv_quant, record)
        print(json.dumps({"of_copy": record.records[-1]["value"] / copy_tbps}), flush=True)
        torch.cuda.empty_cache()

    record.write(args.out)


if __name__ == "__main__":
    main()
