"""gather_blocks / scatter_blocks on a CUDA GPU against plain torch copies in this process.

Cache: 32 layer slots, 2048 blocks of 16 tokens, 8 kv heads, head size 128, bf16 (64 KiB pages,
2 MiB per block of all layers, 4 GiB in all); per-layer LBNHC (a list of 32 tensors) and the
cross-layer slab BLNHC. Each call moves ``n = 256`` shuffled blocks (512 MiB).

Offload (GPU cache <-> pinned host buffer), ``bytes = n * L * page_bytes`` moved once:

- ``triton``: one kernel that reads the cache and writes the pinned buffer (or the reverse)
  through unified virtual addressing;
- ``staged``: our gather into a GPU staging buffer, then one ``copy_`` to the pinned buffer (the
  reverse for scatter): costs a staging buffer as large as the transfer;
- ``reference``: per layer ``index_select`` + ``copy_`` (torch);
- baseline ``pinned copy_``: a plain ``copy_`` of the same bytes between a contiguous GPU tensor and
  the pinned buffer (target: ``triton`` >= 90% of it).

GPU <-> GPU gather, ``bytes = 2 * n * L * page_bytes`` (read + write): ``triton`` vs
``torch.index_select`` on a ``[B, L * page_bytes]`` byte view of a block-contiguous slab (the same
bytes as one op), and our per-layer torch reference.

Metric TB/s. Writes ``DIR/block_copy.json`` and prints one JSON line per record::

    PYTHONPATH=packages/kv-spec/src:packages/kv-kernels/src python3 \\
        packages/kv-kernels/benchmarks/bench_block_copy.py --out /tmp/bench
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
from _records import BandwidthRecorder  # this folder's shared record writer
from kv_kernels.block_copy import gather_blocks, scatter_blocks
from kv_kernels.cache import allocate_kv_cache
from kv_spec import KVCacheLayout, LayoutOrder

LAYERS, BLOCKS, H, D, N, MOVED = 32, 2048, 8, 128, 16, 256


def _bench(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=300, return_mode="median"))


def _layout(order: str) -> KVCacheLayout:
    return KVCacheLayout(
        order=LayoutOrder.parse(order),
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        num_kv_heads=H,
        block_size=N,
        head_size=D,
        head_size_v=D,
        dtype="bfloat16",
    )


def _run_layout(
    order: str,
    pinned: torch.Tensor,
    staging: torch.Tensor,
    d2h_ms: float,
    h2d_ms: float,
    record: Callable[..., None],
) -> None:
    row = pinned.shape[1]
    nbytes = pinned.numel()
    layout = _layout(order)
    storage = allocate_kv_cache(layout, "cuda", zero=False)
    for t in [storage] if isinstance(storage, torch.Tensor) else storage:
        t.normal_()
    ids = torch.randperm(BLOCKS, device="cuda")[:MOVED]
    ids_cpu = ids.cpu()

    # -- offload: GPU cache -> pinned host ------------------------------------------------
    case = f"gather to pinned host, {order}, {MOVED} blocks x {LAYERS} layers"

    def gather_staged() -> None:
        gather_blocks(storage, layout, ids_cpu, staging, impl="triton")
        pinned.copy_(staging, non_blocking=True)

    for impl, fn in (
        # block ids from the host, as a connector passes them (range-checked, copied async)
        ("triton", lambda: gather_blocks(storage, layout, ids_cpu, pinned, impl="triton")),
        ("staged", gather_staged),
        ("reference", lambda: gather_blocks(storage, layout, ids_cpu, pinned, impl="reference")),
    ):
        record(case, impl, _bench(fn), nbytes, "torch copy_", d2h_ms)

    # -- reload: pinned host -> GPU cache -------------------------------------------------
    case = f"scatter from pinned host, {order}, {MOVED} blocks x {LAYERS} layers"

    def scatter_staged() -> None:
        staging.copy_(pinned, non_blocking=True)
        scatter_blocks(staging, storage, layout, ids_cpu, impl="triton")

    for impl, fn in (
        ("triton", lambda: scatter_blocks(pinned, storage, layout, ids_cpu, impl="triton")),
        ("staged", scatter_staged),
        (
            "reference",
            lambda: scatter_blocks(pinned, storage, layout, ids_cpu, impl="reference"),
        ),
    ):
        record(case, impl, _bench(fn), nbytes, "torch copy_", h2d_ms)

    # -- GPU -> GPU gather -----------------------------------------------------------------
    case = f"gather GPU->GPU, {order}, {MOVED} blocks x {LAYERS} layers"
    # the baseline: index_select over a block-contiguous [B, row] byte view (one op, same bytes)
    slab_bytes = torch.empty(BLOCKS, row, dtype=torch.uint8, device="cuda")
    out_base = torch.empty(MOVED, row, dtype=torch.uint8, device="cuda")
    base_ms = _bench(lambda: torch.index_select(slab_bytes, 0, ids, out=out_base))
    record(case, "torch.index_select", base_ms, 2 * nbytes, None, None)
    record(
        case,
        "triton",
        _bench(lambda: gather_blocks(storage, layout, ids, staging, impl="triton")),
        2 * nbytes,
        "torch.index_select",
        base_ms,
    )
    record(
        case,
        "reference",
        _bench(lambda: gather_blocks(storage, layout, ids, staging, impl="reference")),
        2 * nbytes,
        "torch.index_select",
        base_ms,
    )
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for block_copy.json")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name()
    record = BandwidthRecorder("block_copy", device)

    row = LAYERS * _layout("LBNHC").page_bytes
    nbytes = MOVED * row
    pinned = torch.empty(MOVED, row, dtype=torch.uint8, pin_memory=True)
    staging = torch.empty(MOVED, row, dtype=torch.uint8, device="cuda")
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_host = pinned.view(-1)
    # The baseline: a plain pinned copy of the same bytes, each direction.
    d2h_ms = _bench(lambda: flat_host.copy_(flat_dev, non_blocking=True))
    h2d_ms = _bench(lambda: flat_dev.copy_(flat_host, non_blocking=True))
    record("pinned copy_ D2H", "torch copy_", d2h_ms, nbytes, None, None)
    record("pinned copy_ H2D", "torch copy_", h2d_ms, nbytes, None, None)

    for order in ("LBNHC", "BLNHC"):
        _run_layout(order, pinned, staging, d2h_ms, h2d_ms, record)
        torch.cuda.empty_cache()

    record.write(args.out)


if __name__ == "__main__":
    main()
