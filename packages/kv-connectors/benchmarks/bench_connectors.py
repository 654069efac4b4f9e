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
4. p2p / nixl: two processes (two GPUs when there are two; gloo / DRAM on the CPU smoke run): a pull
   of ``n`` blocks through ``P2pConnector`` (NCCL) and ``NixlConnector`` (VRAM), against a raw
   ``torch.distributed`` send/recv of the same bytes.

Throughput is bytes / wall time with the device synchronized (the connector's host work counts:
that is what an engine pays). Medians over ``--iters`` after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[3]


@dataclass
class _Req:
    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], None], device: torch.device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _device_s(fn: Callable[[], None], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Seconds of device time per call: ``iters`` calls back to back between two CUDA events, so a
    call's host work overlaps the previous call's kernel (the host cost is measured apart, by
    :func:`_median_s`). On the CPU this is wall time."""
    if device.type != "cuda":
        return _median_s(fn, device, iters, warmup)
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / iters


class Results:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.errors: list[dict[str, str]] = []
        self.notes: list[str] = []

    def add(
        self, section: str, case: str, nbytes: int, t: float, base: str, t_base: float, **extra: Any
    ) -> None:
        gbps, base_gbps = nbytes / t / 1e9, nbytes / t_base / 1e9
        rec = {
            "section": section,
            "case": case,
            "bytes": nbytes,
            "ms": t * 1e3,
            "GB/s": gbps,
            "baseline": base,
            "baseline_ms": t_base * 1e3,
            "baseline_GB/s": base_gbps,
            "ratio": gbps / base_gbps,
            **extra,
        }
        self.records.append(rec)
        print(json.dumps(rec), flush=True)

    def run(self, section: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # record and go on: one broken section must not hide the rest
            self.errors.append(
                {
                    "section": section,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(),
                }
            )
            print(f"[{section}] FAILED: {exc}", flush=True)


def _layout(order: str, shape: dict[str, Any]) -> Any:
    from kv_spec import KVCacheLayout

    return KVCacheLayout(order=order, **shape)


def _cache(order: str, shape: dict[str, Any], device: torch.device) -> tuple[Any, Any, int]:
    """``(layout, storage, row bytes)``: a freshly allocated cache of ``shape`` in ``order``."""
    from kv_kernels import allocate_kv_cache

    layout = _layout(order, shape)
    return layout, allocate_kv_cache(layout, device), layout.num_layers * layout.page_bytes


ORDERS = ("LBNHC", "BLNHC")  # the offload and gather sections measure both


# -- 1. offload ---------------------------------------------------------------------------------


def bench_offload(
    res: Results, device: torch.device, shape: dict[str, Any], n: int, iters: int
) -> None:
    for order in ORDERS:
        _offload_order(res, device, shape, n, iters, order)


def _offload_order(
    res: Results, device: torch.device, shape: dict[str, Any], n: int, iters: int, order: str
) -> None:
    from kv_connectors import OffloadingConfig, OffloadingConnector

    layout, storage, row = _cache(order, shape, device)
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=n * row), block_size=layout.block_size)
    conn.register_kv_caches(storage, layout)
    gen = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(layout.num_blocks, generator=gen)[: 2 * n].tolist()
    save_ids, load_ids = src_ids[:n], src_ids[n:]
    counter = iter(range(10**9))
    last: list[_Req] = []

    def save() -> None:
        i = next(counter)
        req = _Req(f"s{i}", [i.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(n)])
        conn.request_finished(req, save_ids)
        meta = conn.build_connector_meta()
        conn.start_load_kv(meta)
        conn.wait_for_save()
        conn.get_finished()
        last[:] = [req]

    def load() -> None:
        req = _Req(f"l{next(counter)}", last[0].block_hashes)
        tokens, _ = conn.get_num_new_matched_tokens(req, 0)
        assert tokens == n * layout.block_size, "the saved blocks must hit"
        conn.update_state_after_alloc(req, load_ids, tokens)
        conn.start_load_kv(conn.build_connector_meta())
        for layer in range(layout.num_layers):
            conn.wait_for_layer_load(layer)

    dev_buf = torch.empty(n * row, dtype=torch.uint8, device=device)
    host = torch.empty(n * row, dtype=torch.uint8, pin_memory=device.type == "cuda")
    t_save = _median_s(save, device, iters)
    t_d2h = _median_s(lambda: host.copy_(dev_buf, non_blocking=True), device, iters)
    t_load = _median_s(load, device, iters)
    t_h2d = _median_s(lambda: dev_buf.copy_(host, non_blocking=True), device, iters)
    block = layout.block_bytes  # contiguous bytes of one block in its allocation
    extra = {"order": order, "physical_block_bytes": block, "blocks": n, "row_bytes": row}
    res.add(
        "offload", f"save GPU->CPU {order}", n * row, t_save, "pinned copy_ D2H", t_d2h, **extra
    )
    res.add(
        "offload", f"load CPU->GPU {order}", n * row, t_load, "pinned copy_ H2D", t_h2d, **extra
    )
    conn.close()


# -- 2. overlap ---------------------------------------------------------------------------------


def bench_overlap(
    res: Results, device: torch.device, shape: dict[str, Any], n: int, iters: int
) -> None:
    from kv_connectors import OffloadingConfig, OffloadingConnector

    layout, storage, row = _cache("LBNHC", shape, device)
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
            req = _Req(
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
            conn.get_finished()

    t_compute = _median_s(lambda: step(True, False), device, iters)
    t_save = _median_s(lambda: step(False, True), device, iters)
    t_both = _median_s(lambda: step(True, True), device, iters)
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

    layout, storage, row = _cache(order, shape, device)
    ids = torch.randperm(layout.num_blocks, device=device)[:n]
    out = torch.empty(n, row, dtype=torch.uint8, device=device)

    def gather() -> None:
        gather_blocks(storage, layout, ids, out)

    # GPU time back to back (the ratio), and the wall time of one synced call (host cost included:
    # gather_blocks validates its inputs on the host, which a 0.3 ms copy does not hide).
    t_gather = _device_s(gather, device, iters)
    t_gather_wall = _median_s(gather, device, iters)
    if order == "LBNHC":
        views = [
            t.view(-1).view(torch.uint8).view(layout.num_blocks, layout.page_bytes) for t in storage
        ]

        def index_select() -> None:
            for v in views:
                torch.index_select(v, 0, ids)
    else:
        slab = storage.view(-1).view(torch.uint8).view(layout.num_blocks, row)  # type: ignore[union-attr]

        def index_select() -> None:
            torch.index_select(slab, 0, ids)

    t_base = _device_s(index_select, device, iters)
    t_base_wall = _median_s(index_select, device, iters)
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


# -- 4. two processes ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peer(
    rank: int, transport: str, layout_json: str, n: int, iters: int, port: int, q: Any, out: Any
) -> None:
    """Rank 0 produces (``iters + 2`` finished requests), rank 1 pulls and times; then raw send/recv."""
    import torch.distributed as dist
    from kv_kernels import allocate_kv_cache
    from kv_spec import KVCacheLayout

    layout = KVCacheLayout.from_json(layout_json)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    storage = allocate_kv_cache(layout, device)
    row = layout.num_layers * layout.page_bytes
    if transport == "p2p":
        from kv_connectors import P2pConfig, P2pConnector

        conn: Any = P2pConnector(
            P2pConfig(buffer_bytes=max(256 * 2**20, row), timeout_s=60),
            block_size=layout.block_size,
        )
    else:
        from kv_connectors import NixlConfig
        from kv_connectors.nixl import NixlConnector

        conn = NixlConnector(
            NixlConfig(timeout_s=60, progress_thread=cuda), block_size=layout.block_size
        )
    conn.register_kv_caches(storage, layout)
    ids = list(range(n))
    total = iters + 2
    if rank == 0:
        for i in range(total):
            _delay, params = conn.request_finished(_Req(f"r{i}", [b"h"] * n), ids)
            q.put(params)
        deadline = time.monotonic() + 600
        sent = 0
        while sent < total and time.monotonic() < deadline:
            sent += len(conn.get_finished()[0])
            time.sleep(0.001)
    else:
        times = []
        for i in range(total):
            params = q.get(timeout=120)
            req = _Req(f"c{i}", [b"x"] * n)
            conn.add_remote_request(req.request_id, params)
            t0 = time.perf_counter()
            tokens, _ = conn.get_num_new_matched_tokens(req, 0)
            conn.update_state_after_alloc(req, ids, tokens)
            conn.start_load_kv(conn.build_connector_meta())
            done: set[str] = set()
            while req.request_id not in done:
                done |= conn.get_finished()[1]
                time.sleep(5e-5)  # an engine polls once per step; a hot loop would starve the GIL
            _sync(device)
            times.append(time.perf_counter() - t0)
            errors = conn.get_block_ids_with_load_errors()
            if errors:
                raise RuntimeError(f"pull failed: {conn.load_error_reasons}")
        out.put(("connector", statistics.median(times[2:])))
    conn.close()
    # raw baseline: one contiguous tensor of the same bytes
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    buf = torch.empty(n * row, dtype=torch.uint8, device=device)
    times = []
    for _ in range(iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        _sync(device)
        times.append(time.perf_counter() - t0)
    if rank == 1:
        out.put(("raw", statistics.median(times[2:])))
    dist.destroy_process_group()


def bench_two_process(
    res: Results, transport: str, shape: dict[str, Any], n: int, iters: int
) -> None:
    layout = _layout("BLNHC", shape)
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_peer, args=(r, transport, layout.to_json(), n, iters, port, q, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got: dict[str, float] = {}
    try:
        while len(got) < 2:
            kind, t = out.get(timeout=600)
            got[kind] = t
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    row = layout.num_layers * layout.page_bytes
    base = "torch.distributed send/recv (" + ("NCCL" if torch.cuda.is_available() else "gloo") + ")"
    res.add(
        transport,
        f"{transport} pull BLNHC",
        n * row,
        got["connector"],
        base,
        got["raw"],
        physical_block_bytes=layout.block_bytes,
    )


# -- output -------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("kv-connectors", "kv-kernels", "kv-spec", "triton", "nixl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


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
        f"Shape: {meta['shape']}, {meta['blocks']} blocks per transfer; generated by "
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
    if cuda:  # Llama-3-8B-like: 32 layers, 8 kv heads, 128 head dim, bf16, 16-token blocks
        shape = {
            "num_layers": 32,
            "num_blocks": 2048,
            "num_kv_heads": 8,
            "block_size": 16,
            "head_size": 128,
            "head_size_v": 128,
            "dtype": "bfloat16",
        }
        n, iters = 256, args.iters or 10
    else:
        shape = {
            "num_layers": 4,
            "num_blocks": 64,
            "num_kv_heads": 2,
            "block_size": 4,
            "head_size": 16,
            "head_size_v": 16,
            "dtype": "float16",
        }
        n, iters = 16, args.iters or 3
    res = Results()
    sections: dict[str, Callable[[], None]] = {
        "offload": lambda: bench_offload(res, device, shape, n, iters),
        "overlap": lambda: bench_overlap(res, device, shape, n, iters),
        "gather": lambda: bench_gather(res, device, shape, n, iters),
    }
    two = (torch.cuda.device_count() >= 2) if cuda else True
    if two:
        sections["p2p"] = lambda: bench_two_process(res, "p2p", shape, n, iters)
        try:
            import nixl._api  # noqa: F401

            sections["nixl"] = lambda: bench_two_process(res, "nixl", shape, n, iters)
        except ImportError:
            res.notes.append("NIXL is not installed on this machine: no NIXL numbers.")
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
        "iters": iters,
        "smoke": args.smoke,
    }
    write(res, out_dir, meta)
    print(f"wrote {out_dir}/connectors.{{json,md,png}}")


if __name__ == "__main__":
    main()
