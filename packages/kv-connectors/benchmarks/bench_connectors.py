"""Connector benchmarks: each number against its raw baseline, measured in the same process.

    python packages/kv-connectors/benchmarks/bench_connectors.py            # GPU: writes docs/benchmarks/connectors.*
    python packages/kv-connectors/benchmarks/bench_connectors.py --smoke    # CPU, seconds, writes to /tmp

Sections (each one independent; a failure is recorded in the JSON, the rest still runs):

1. offload: ``OffloadingConnector`` save (GPU -> pinned CPU tier) and load (tier -> GPU) of ``n``
   blocks, per-layer ``LBNHC`` and cross-layer ``BLNHC``, against one plain pinned ``copy_`` of the
   same bytes (``n * row_bytes``: the best a copy engine does). The *physical block size* (bytes a
   block occupies contiguously: one page per layer for LBNHC, all layers' pages for BLNHC) is
   reported beside the throughput: that is why cross-layer storage moves faster.
2. overlap: a per-layer save (``save_kv_layer`` after each layer's "compute", a matmul) against the
   compute alone and the save alone: ``overlap = (t_compute + t_save - t_both) / min(...)``.
3. gather: GPU -> GPU ``kv_kernels.gather_blocks`` of ``n`` blocks (per-layer and cross-layer)
   against ``torch.index_select`` of the same bytes.
4. p2p / nixl: two processes (two GPUs when there are two; gloo / DRAM on the CPU smoke run), see
   ``_two_process.py``: P2P pull (consecutive and shuffled block ids, cross-layer and per-layer),
   push and layer-wise streaming of ``n``-block requests (8k tokens on the GPU), NIXL READ (VRAM),
   each against a raw ``torch.distributed`` send/recv of the same bytes in the same process pair
   (one message, and messages of the connector's chunk size).

Throughput is bytes / wall time with the device synchronized (the connector's host work counts:
that is what an engine pays). Medians over ``--iters`` after warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _connector_common import Req, Results, device_s, make_cache, median_s, transfer_shape
from _provenance import provenance
from _two_process import bench_two_process

REPO = Path(__file__).resolve().parents[3]


ORDERS = ("LBNHC", "BLNHC")  # the offload and gather sections measure both


# -- 1. offload ---------------------------------------------------------------------------------


def bench_offload(
    res: Results, device: torch.device, shape: dict[str, Any], n: int, iters: int
) -> None:
    for order in ORDERS:
        for kind in ("shuffled", "consecutive"):
            _offload_order(res, device, shape, n, iters, order, kind)


def saved(conn: Any, request_id: str, timeout_s: float = 30.0) -> None:
    """Until ``get_finished`` reports ``request_id``'s save done: ``wait_for_save`` only hands a
    save off, so its copies' end is where the engine would free the blocks."""
    deadline = time.monotonic() + timeout_s
    while request_id not in conn.get_finished()[0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the save of {request_id} did not finish in {timeout_s} s")


def _offload_order(
    res: Results,
    device: torch.device,
    shape: dict[str, Any],
    n: int,
    iters: int,
    order: str,
    kind: str,
) -> None:
    """``kind``: block ids ``shuffled`` (gathered through staging, pipelined with the host
    copies) or ``consecutive`` (rows that are the cache's own memory: copied directly)."""
    from kv_connectors import OffloadingConfig, OffloadingConnector

    layout, storage, row = make_cache(order, shape, device)
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=n * row), block_size=layout.block_size)
    conn.register_kv_caches(storage, layout)
    gen = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(layout.num_blocks, generator=gen)[: 2 * n].tolist()
    if kind == "consecutive":
        src_ids = list(range(2 * n))
    save_ids, load_ids = src_ids[:n], src_ids[n:]
    counter = iter(range(10**9))
    last: list[Req] = []

    def save() -> None:
        i = next(counter)
        req = Req(f"s{i}", [i.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(n)])
        conn.request_finished(req, save_ids)
        meta = conn.build_connector_meta()
        conn.start_load_kv(meta)
        conn.wait_for_save()
        saved(conn, req.request_id)
        last[:] = [req]

    def load() -> None:
        req = Req(f"l{next(counter)}", last[0].block_hashes)
        tokens, _ = conn.get_num_new_matched_tokens(req, 0)
        assert tokens == n * layout.block_size, "the saved blocks must hit"
        conn.update_state_after_alloc(req, load_ids, tokens)
        conn.start_load_kv(conn.build_connector_meta())
        for layer in range(layout.num_layers):
            conn.wait_for_layer_load(layer)

    dev_buf = torch.empty(n * row, dtype=torch.uint8, device=device)
    host = torch.empty(n * row, dtype=torch.uint8, pin_memory=device.type == "cuda")
    t_save = median_s(save, device, iters)
    t_d2h = median_s(lambda: host.copy_(dev_buf, non_blocking=True), device, iters)
    t_load = median_s(load, device, iters)
    t_h2d = median_s(lambda: dev_buf.copy_(host, non_blocking=True), device, iters)
    block = layout.block_bytes  # contiguous bytes of one block in its allocation
    extra = {"order": order, "physical_block_bytes": block, "blocks": n, "row_bytes": row}
    res.add(
        "offload",
        f"save GPU->CPU {order} {kind} ids",
        n * row,
        t_save,
        "pinned copy_ D2H",
        t_d2h,
        **extra,
    )
    res.add(
        "offload",
        f"load CPU->GPU {order} {kind} ids",
        n * row,
        t_load,
        "pinned copy_ H2D",
        t_h2d,
        **extra,
    )
    conn.close()


# -- 2. overlap ---------------------------------------------------------------------------------


def bench_overlap(
    res: Results, device: torch.device, shape: dict[str, Any], n: int, iters: int
) -> None:
    from kv_connectors import OffloadingConfig, OffloadingConnector

    layout, storage, row = make_cache("LBNHC", shape, device)
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=n * row), block_size=layout.block_size)
    conn.register_kv_caches(storage, layout)
    dim = 4096 if device.type == "cuda" else 128
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(dim, dim, device=device, dtype=dtype)
    counter = iter(range(10**9))

    def compute_layer() -> None:
        for _ in range(4):
            torch.mm(a, a)

    def step(with_compute: bool, with_save: bool) -> None:
        i = next(counter)
        meta = None
        if with_save:
            req = Req(
                f"o{i}", [i.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(n)]
            )
            conn.request_finished(req, list(range(n)))
            meta = conn.build_connector_meta()
            conn.start_load_kv(meta)
        for layer in range(layout.num_layers):
            if with_compute:
                compute_layer()
            if meta is not None:
                conn.save_kv_layer(layer, meta)  # copies layer `layer` while the next one computes
        if meta is not None:
            conn.wait_for_save()
            saved(conn, f"o{i}")

    t_compute = median_s(lambda: step(True, False), device, iters)
    t_save = median_s(lambda: step(False, True), device, iters)
    t_both = median_s(lambda: step(True, True), device, iters)
    overlap = (t_compute + t_save - t_both) / min(t_compute, t_save)
    res.add(
        "overlap",
        "per-layer save during compute",
        n * row,
        t_both,
        "compute + save, serial",
        t_compute + t_save,
        compute_ms=t_compute * 1e3,
        save_ms=t_save * 1e3,
        overlap=overlap,
    )
    conn.close()


# -- 3. gather ----------------------------------------------------------------------------------


def bench_gather(
    res: Results, device: torch.device, shape: dict[str, Any], n: int, iters: int
) -> None:
    for order in ORDERS:
        _gather_order(res, device, shape, n, iters, order)


def _gather_order(
    res: Results, device: torch.device, shape: dict[str, Any], n: int, iters: int, order: str
) -> None:
    from kv_kernels import gather_blocks

    layout, storage, row = make_cache(order, shape, device)
    ids = torch.randperm(layout.num_blocks, device=device)[:n]
    out = torch.empty(n, row, dtype=torch.uint8, device=device)

    def gather() -> None:
        gather_blocks(storage, layout, ids, out)

    # GPU time back to back (the ratio), and the wall time of one synced call (host cost included:
    # gather_blocks validates its inputs on the host, which a 0.3 ms copy does not hide).
    t_gather = device_s(gather, device, iters)
    t_gather_wall = median_s(gather, device, iters)
    if order == "LBNHC":
        views = [
            t.view(-1).view(torch.uint8).view(layout.num_blocks, layout.page_bytes) for t in storage
        ]

        def index_select() -> None:
            for v in views:
                torch.index_select(v, 0, ids)
    else:
        slab = storage.view(-1).view(torch.uint8).view(layout.num_blocks, row)

        def index_select() -> None:
            torch.index_select(slab, 0, ids)

    t_base = device_s(index_select, device, iters)
    t_base_wall = median_s(index_select, device, iters)
    res.add(
        "gather",
        f"gather_blocks {order} (GPU time)",
        n * row,
        t_gather,
        "torch.index_select",
        t_base,
        order=order,
        wall_ms=t_gather_wall * 1e3,
        baseline_wall_ms=t_base_wall * 1e3,
        physical_block_bytes=layout.block_bytes,
    )


# -- output -------------------------------------------------------------------------------------


def _versions() -> dict[str, str | bool | None]:
    """Python, the workspace packages', torch's, triton's and NIXL's versions as installed, and
    the git commit (and whether the tree was dirty) the numbers came from."""
    return provenance("torch", "triton", "nixl")


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return ""
    return f"{nbytes / 1024:.0f} KiB" if nbytes >= 1024 else f"{nbytes} B"


def write(res: Results, out_dir: Path, meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "results": res.records, "errors": res.errors, "notes": res.notes}
    (out_dir / "connectors.json").write_text(json.dumps(doc, indent=1))
    lines = [
        "# kv-connectors benchmarks",
        "",
        f"Device: {meta['device']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + ".",
        f"Shape: {meta['shape']}, {meta['blocks']} blocks per transfer in one process "
        f"(offload, overlap, gather), {meta.get('two_process_blocks', '?')} between two "
        "(p2p, nixl); generated by "
        "`packages/kv-connectors/benchmarks/bench_connectors.py`"
        + (" --smoke (CPU smoke run: not performance numbers)" if meta["smoke"] else "")
        + ".",
        "",
        "| section | case | physical block | MB | connector GB/s | baseline | baseline GB/s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res.records:
        block = r.get("physical_block_bytes")
        lines.append(
            f"| {r['section']} | {r['case']} | {_size(block)} | {r['bytes'] / 1e6:.1f} | "
            f"{r['GB/s']:.2f} | {r['baseline']} | {r['baseline_GB/s']:.2f} | {r['ratio']:.2f} |"
        )
    for r in res.records:
        if "overlap" in r:
            lines.append(
                f"\nOverlap: compute {r['compute_ms']:.2f} ms, save {r['save_ms']:.2f} ms, both {r['ms']:.2f} ms -> overlap {r['overlap']:.2f} of the shorter."
            )
    for r in res.records:
        if "ratio_to_chunked" in r:
            lines.append(
                f"\n{r['case']}: {r['ratio_to_chunked']:.2f}x of raw send/recv in messages of "
                f"{r['chunk_bytes'] / 2**20:.1f} MiB (the connector's chunk), {r['raw_chunked_ms']:.3f} ms."
            )
        if "ratio_to_raw_nixl" in r:
            lines.append(
                f"\n{r['case']}: {r['ratio_to_raw_nixl']:.2f}x of one raw NIXL READ of the same "
                f"bytes ({r['raw_nixl_ms']:.3f} ms): the rest of the gap to NCCL is the transport's."
            )
        if "tail_ms" in r:
            lines.append(
                f"\n{r['case']}: the consumer has every layer {r['tail_ms']:.3f} ms after the "
                f"producer's last layer was computed (producer compute {r['compute_ms']:.2f} ms, "
                f"{r['message_bytes'] / 2**20:.1f} MiB messages; raw send/recv of all layers' messages "
                f"{r['raw_layer_messages_ms']:.3f} ms); without streaming the whole pull starts "
                "only then (see the pull LBNHC row)."
            )
    for r in res.records:
        if "wall_ms" in r:
            lines.append(
                f"\n{r['case']}: one synced call takes {r['wall_ms']:.3f} ms of wall time (host "
                f"checks included) vs {r['baseline_wall_ms']:.3f} ms for the baseline; the table's "
                "ratio is GPU time of back-to-back calls."
            )
    for e in res.errors:
        lines.append(f"\n**{e['section']} failed**: `{e['error']}`")
    for note in res.notes:
        lines.append(f"\n{note}")
    (out_dir / "connectors.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # Ratios, not GB/s: offload (~50 GB/s), gathers (~2 TB/s) and NCCL (~350 GB/s) share no
        # scale; each bar is the connector over its own raw baseline measured in the same run.
        recs = res.records
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(recs) + 1.5))
        ax.barh([r["case"] for r in recs], [r["ratio"] for r in recs], color="#4c72b0")
        for i, r in enumerate(recs):
            ax.text(
                r["ratio"], i, f" {r['ratio']:.2f}x of {r['baseline']}", va="center", fontsize=7
            )
        ax.axvline(1.0, color="gray", lw=1)
        ax.axvline(0.9, color="#c44e52", lw=1, ls="--", label="0.9x target (offload, gather)")
        ax.invert_yaxis()
        ax.set_xlim(0, max([1.6, *(r["ratio"] * 1.6 for r in recs)]))
        ax.set_xlabel("connector / raw baseline (same run)")
        ax.set_title(f"kv-connectors on {meta['device']}")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "connectors.png", dpi=120)
    except ImportError:
        res.notes.append("matplotlib not installed: no PNG")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--smoke",
        "--quick",
        action="store_true",
        help="tiny sizes on the CPU: checks the script, not performance",
    )
    ap.add_argument(
        "--out-dir",
        "--out",
        type=Path,
        default=None,
        help="default: docs/benchmarks (GPU) or a temp dir (--smoke)",
    )
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="redraw connectors.md and .png from connectors.json in --out (no measurement)",
    )
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=["offload", "overlap", "gather", "p2p", "nixl"]
    )
    args = ap.parse_args()
    if args.render_only:
        out = args.out_dir or Path("docs/benchmarks")
        doc = json.loads((out / "connectors.json").read_text())
        res = Results()
        res.records, res.errors, res.notes = doc.pop("results"), doc.pop("errors"), doc.pop("notes")
        write(res, out, doc)
        return
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    shape, tn = transfer_shape(not cuda)
    if cuda:
        n, iters = 256, args.iters or 10
    else:
        n, iters = 16, args.iters or 3
    res = Results()
    sections: dict[str, Callable[[], None]] = {
        "offload": lambda: bench_offload(res, device, shape, n, iters),
        "overlap": lambda: bench_overlap(res, device, shape, n, iters),
        "gather": lambda: bench_gather(res, device, shape, n, iters),
    }
    two = (torch.cuda.device_count() >= 2) if cuda else True
    if two:
        sections["p2p"] = lambda: bench_two_process(res, "p2p", shape, tn, iters, args.smoke)
        try:
            import nixl._api  # noqa: F401

            sections["nixl"] = lambda: bench_two_process(res, "nixl", shape, tn, iters, args.smoke)
        except ImportError as exc:
            res.notes.append(f"NIXL does not import here ({exc}): no NIXL numbers.")
    else:
        res.notes.append("Fewer than 2 GPUs: no P2P/NIXL numbers.")
    for name, fn in sections.items():
        if name not in args.skip:
            res.run(name, fn)
    name = (
        torch.cuda.get_device_name(device)
        if cuda
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    out_dir = args.out_dir or (
        Path(tempfile.gettempdir()) / "kvstack-bench-smoke"
        if args.smoke
        else REPO / "docs" / "benchmarks"
    )
    meta = {
        "device": name,
        "versions": _versions(),
        "shape": shape,
        "blocks": n,
        "two_process_blocks": tn,
        "iters": iters,
        "smoke": args.smoke,
    }
    write(res, out_dir, meta)
    print(f"wrote {out_dir}/connectors.{{json,md,png}}")


if __name__ == "__main__":
    main()
