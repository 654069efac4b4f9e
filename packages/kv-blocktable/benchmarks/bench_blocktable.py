"""kv-blocktable's scheduler side against vLLM 0.33's own BlockPool / KVCacheManager, one run.

    .venv/bin/python packages/kv-blocktable/benchmarks/bench_blocktable.py \\
        [--vllm-python /tmp/vllm-env/bin/python] [--device cpu|cuda] [--quick]

Workloads (the same on both sides, same machine, same job; vLLM runs in its own interpreter
through ``_vllm_side.py`` because it is installed outside this workspace — see the ``how`` fields):

1. allocate + free, batches of 16 blocks, caching off: ``allocate(16)`` then ``free`` them.
2. allocate + free with caching on: ``allocate(16)`` (evicting 16 cached blocks once the pool has
   gone round), enter 16 fresh hashes in the prefix cache, ``free``: a full prefix-cached pool.
3. chained hashing of 16-token blocks: a request's whole chain (256 blocks), sha256 and xxhash-128.
4. a decode step of 256 running requests (prompts of 500..515 tokens, so 1/16 of the requests
   cross a block boundary each step): each appends one token and gets its slot (a new block
   every 16 steps). ``manager``: the KV manager alone, one ``append_token_ids`` and one
   ``allocate_slots`` call per request (what vLLM's number covers). ``full step`` (issue 32's
   figure): ``allocate_decode_slots`` for the batch, ``BlockTables.append_rows`` of the rows
   that got a block, ``commit`` and ``build_common_metadata`` (slot mapping, positions, lengths: the
   metadata every attention backend takes; ``kv_blocktable.block_table``, torch, on
   ``--device`` — host time, CUDA work is async), after the step's sampled tokens are appended
   (``append_decode_tokens``, the engine's update; timed apart, and reported with them too).
   ``full step, per-request calls``: the same with ``append_token_ids`` and the manager called
   per request, run interleaved with it.

The two sides alternate run by run (vLLM's interpreter stays up and runs one workload per
request), so load on the shared machine falls on both alike. Throughputs are the best of
``repeats`` runs (the least disturbed one); step times are medians over all steps.

Writes ``blocktable.json`` and ``.md`` into the folder ``--out`` names (default: a fresh temp
folder, printed; pass ``--out docs/benchmarks`` to replace the committed results), and
``blocktable.png`` when matplotlib is installed (the ``bench`` group); it prints one line for
each thing it skipped and why (no vLLM interpreter, no xxhash, no matplotlib). The record carries
the package versions and the git commit the numbers came from (``_provenance.py``). Not
collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kv_blocktable
import kv_spec
from _provenance import provenance
from kv_blocktable import BlockHasher, BlockPool, KVCacheManager, Request, append_decode_tokens

NAME = "blocktable"  # <out>/blocktable.json, .md, .png
VLLM_SIDE = Path(__file__).with_name("_vllm_side.py")
TARGETS = {"ratio": 1.5, "decode_full_step_us": 200.0}

PARAMS: dict[str, Any] = {
    "num_blocks": 16384,
    "batch": 16,
    "alloc_iters": 20000,
    "repeats": 7,
    "hash_blocks": 256,
    "hash_iters": 100,
    "num_reqs": 256,
    "prompt_len": 500,
    "decode_chunk": 16,  # decode steps per run; `repeats` runs alternate with vLLM's
    "max_model_len": 4096,
}


def fresh_hashes(n: int, batch: int) -> list[list[bytes]]:
    # Same scheme as _vllm_side.py: distinct 32-byte hashes for twice the pool.
    return [
        [i.to_bytes(4, "little") + j.to_bytes(28, "little") for j in range(batch)]
        for i in range(2 * n // batch)
    ]


def ours_alloc_free(p: dict[str, Any], caching: bool) -> tuple[Callable[[], float], str]:
    n, batch, iters = p["num_blocks"], p["batch"], p["alloc_iters"]
    pool = BlockPool(n, enable_caching=caching)
    hashes = fresh_hashes(n, batch)
    state = {"i": 0}

    def run() -> float:
        alloc, free, cache = pool.allocate, pool.free, pool.cache_block
        t0 = time.perf_counter()
        if caching:
            i0 = state["i"]
            for i in range(i0, i0 + iters):
                ids = alloc(batch)
                for b, h in zip(ids, hashes[i % len(hashes)], strict=True):
                    cache(0, b, h)
                free(ids)
            state["i"] = i0 + iters
        else:
            for _ in range(iters):
                free(alloc(batch))
        return time.perf_counter() - t0

    how = f"BlockPool(num_blocks, enable_caching={caching}); loop: ids = allocate(16); " + (
        "cache_block(0, b, h) for 16 fresh hashes; " if caching else ""
    )
    return run, how + "free(ids)"


def xxhash_missing() -> str | None:
    """Why the xxhash-128 workload cannot run here (None: it can)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return (
            "xxhash is not installed, so the xxhash-128 hashing workload was skipped (sha256, "
            "the default, was measured): add it with `uv sync --group xxhash` or "
            "`pip install 'kv-blocktable[xxhash]'`"
        )
    return None


def ours_hashing(p: dict[str, Any], algo: str) -> tuple[Callable[[], float], str]:
    hasher = BlockHasher(16, algo)
    tokens = list(range(p["hash_blocks"] * 16))

    def run() -> float:
        total = 0.0
        for r in range(p["hash_iters"]):
            req = Request(f"h{r}", tokens)
            t0 = time.perf_counter()
            req.bind_hasher(hasher)
            total += time.perf_counter() - t0
            assert len(req.block_hashes) == p["hash_blocks"]
        return total

    how = (
        f"Request(id, {p['hash_blocks'] * 16} tokens).bind_hasher(BlockHasher(16, {algo!r})): "
        "the whole chain (only the bind call is timed)"
    )
    return run, how


class OursDecode:
    """256 running requests; ``manager()`` runs steps of the KV manager alone, ``full()`` steps
    with the block-table update and slot mapping as well (when the torch extra is usable)."""

    def __init__(self, p: dict[str, Any], device: str) -> None:
        spec = kv_spec.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
        cfg = kv_spec.plan_kv_cache(
            {"layers.0": spec},
            p["num_blocks"] * spec.page_size_bytes,
            max_model_len=p["max_model_len"],
        )
        self.p = p
        self.mgr = KVCacheManager(cfg)
        self.reqs = []
        for i in range(p["num_reqs"]):
            req = Request(f"r{i}", [i] * 8 + list(range(p["prompt_len"] - 8 + i % 16)))
            hit, n_hit = self.mgr.get_computed_blocks(req)
            assert self.mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit) is not None
            self.reqs.append(req)
        self.cfg, self.device, self.step = cfg, device, 0
        self.tables: Callable[[list[int], list[Any], list[int]], None] | None = None
        self.after_tokens: dict[str, list[float]] = {}
        self.table_error: str | None = None
        self.how = (
            "KVCacheManager(plan of FullAttentionSpec(16, 8, 128, bf16), prefix caching on, "
            "sha256); per step and request: append_token_ids(tok); allocate_slots(req, 1)"
        )

    def _steps(self, kind: str) -> list[float]:
        """Host seconds per step, the token appends included; the full steps also record their
        time after the appends (the manager's allocation, tables and metadata) in
        ``self.after_tokens[kind]``."""
        times = []
        mgr, reqs = self.mgr, self.reqs
        n = len(reqs)
        after = self.after_tokens.setdefault(kind, [])
        for _ in range(self.p["decode_chunk"]):
            tok = self.step % 100
            self.step += 1
            toks = [tok] * n  # the last step's sampled tokens, as the engine's update has them
            t0 = time.perf_counter()
            if kind == "full":  # the engine's update: one batched call (hashing filled blocks)
                append_decode_tokens(reqs, toks)
            else:
                for req in reqs:  # one call per request (hashing the blocks they fill)
                    req.append_token_ids(tok)
            t1 = time.perf_counter()
            if kind == "full":
                got = mgr.allocate_decode_slots(reqs)
                assert got.num_scheduled == n  # the pool holds every step of the run
                assert self.tables is not None
                self.tables(got.rows, got.new_block_ids, got.num_computed_tokens)
            else:
                alloc = mgr.allocate_slots
                news = [alloc(req, 1) for req in reqs]
                if kind == "full_per_request":
                    assert self.tables is not None
                    rows = [i for i, new in enumerate(news) if new]
                    self.tables(
                        rows,
                        [news[i].get_block_ids() for i in rows],  # type: ignore[union-attr]
                        [len(req.token_ids) for req in reqs],  # seq_len: every token has a slot
                    )
            t2 = time.perf_counter()
            times.append(t2 - t0)
            after.append(t2 - t1)
        return times

    def manager(self) -> list[float]:
        return self._steps("manager")

    def full(self, kind: str = "full") -> list[float]:
        """``kind``: ``"full"`` (``allocate_decode_slots``) or ``"full_per_request"``."""
        if self.tables is None and self.table_error is None:
            self.tables, self.table_error = _block_tables(
                self.cfg, self.p, self.device, self.mgr, self.reqs
            )
        return self._steps(kind) if self.tables is not None else []


def running_tables(
    cfg: kv_spec.KVCacheConfig,
    p: dict[str, Any],
    device: str,
    mgr: KVCacheManager,
    reqs: list[Request],
) -> Any:
    """``BlockTables`` of the running requests, one row each, committed (pinned staging on
    CUDA, as the engine makes them). Needs the torch extra."""
    from kv_blocktable.block_table import BlockTables

    bt = BlockTables.from_config(
        cfg,
        max_num_reqs=len(reqs),
        max_model_len=p["max_model_len"],
        max_num_batched_tokens=max(len(reqs), 8192),
        device=device,
        pin_memory=device == "cuda",
    )
    for row, req in enumerate(reqs):
        bt.add_row(row, mgr.get_block_ids(req))
    bt.commit(len(reqs))
    return bt


def _block_tables(
    cfg: kv_spec.KVCacheConfig,
    p: dict[str, Any],
    device: str,
    mgr: KVCacheManager,
    reqs: list[Request],
) -> tuple[Callable[[list[int], list[Any], list[int]], None] | None, str | None]:
    """The worker-side part of the step, if the torch extra is importable here: the rows that
    got blocks appended, one commit, the step's metadata (what the engine calls)."""
    try:
        import torch

        if device == "cpu":
            # On the CPU the "device" work is host work too; one thread keeps torch's idle
            # workers from spinning against this process on a small shared machine.
            torch.set_num_threads(1)

        n = len(reqs)
        bt = running_tables(cfg, p, device, mgr, reqs)
        ones = [1] * n

        def step(rows: list[int], new_ids: list[Any], seq_lens: list[int]) -> None:
            bt.append_rows(rows, new_ids)  # one scatter
            bt.commit(n)
            bt.build_common_metadata(n, ones, seq_lens)

        # Warm up (first-call costs out of the timing): the current lengths, nothing appended.
        step([], [], [mgr.num_computed_tokens(r.request_id) for r in reqs])
        return step, None
    except Exception as e:  # torch extra missing, or its API moved: the manager part still runs
        return None, f"{type(e).__name__}: {e}"


class VllmSide:
    """vLLM in its own interpreter (``_vllm_side.py``), asked for one run of a workload at a time."""

    def __init__(self, vllm_python: str, p: dict[str, Any]) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        if not Path(vllm_python).exists():
            self.info = {"error": f"no vLLM interpreter at {vllm_python} (pass --vllm-python)"}
            return
        self.proc = subprocess.Popen(
            [vllm_python, str(VLLM_SIDE), json.dumps(p)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd="/tmp",  # keep the workspace's packages off vLLM's path
        )
        line = self._readline()
        if line is None:
            self.info = {"error": "the vLLM side exited before it was ready (run it by hand)"}
            self.proc = None
        else:
            self.info = json.loads(line)

    def _readline(self) -> str | None:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return line or None

    def usable(self, key: str) -> bool:
        return self.proc is not None and "how" in self.info.get(key, {})

    def run(self, key: str) -> Any:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(key + "\n")
        self.proc.stdin.flush()
        line = self._readline()
        if line is None:
            raise RuntimeError(f"the vLLM side died running {key}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(
    p: dict[str, Any], device: str, vside: VllmSide
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Alternate the two sides run by run (best of ``repeats`` each), so load on the shared
    machine falls on both alike."""
    ours: dict[str, Any] = {}
    vllm: dict[str, Any] = dict(vside.info)
    units = {
        "alloc_free_nocache": p["alloc_iters"] * p["batch"],
        "alloc_free_cache": p["alloc_iters"] * p["batch"],
        "hash_sha256": p["hash_iters"] * p["hash_blocks"],
        "hash_xxhash128": p["hash_iters"] * p["hash_blocks"],
    }
    builders = {
        "alloc_free_nocache": lambda: ours_alloc_free(p, caching=False),
        "alloc_free_cache": lambda: ours_alloc_free(p, caching=True),
        "hash_sha256": lambda: ours_hashing(p, "sha256"),
        "hash_xxhash128": lambda: ours_hashing(p, "xxhash128"),
    }
    skip_xx = xxhash_missing()
    if skip_xx is not None:
        del builders["hash_xxhash128"]
        ours["hash_xxhash128"] = {"skipped": skip_xx}
        vllm.setdefault("hash_xxhash128", {}).setdefault("error", "not run (ours skipped)")
    try:
        for key, build in builders.items():
            run, how = build()
            mine, theirs = [], []
            for _ in range(p["repeats"]):
                mine.append(run())
                if vside.usable(key):
                    theirs.append(vside.run(key))
            ours[key] = {"blocks_per_s": units[key] / min(mine), "how": how}
            if theirs:
                vllm[key]["blocks_per_s"] = units[key] / min(theirs)
        dec = OursDecode(p, device)
        m_t: list[float] = []
        v_t: list[float] = []
        for _ in range(p["repeats"]):
            m_t += dec.manager()
            if vside.usable("decode_step"):
                v_t += vside.run("decode_step")
        # The two full steps alternate chunk by chunk: the batched manager call against the
        # per-request calls, same tables, same load on the shared machine.
        f_t: list[float] = []
        fp_t: list[float] = []
        for _ in range(p["repeats"]):
            f_t += dec.full("full")
            fp_t += dec.full("full_per_request")
    finally:
        vside.close()
    d: dict[str, Any] = {
        "manager_median_us": median(m_t) * 1e6,
        "manager_min_us": min(m_t) * 1e6,
        "steps": len(m_t),
        "how": dec.how,
    }
    if f_t:
        # Issue 32's figure: the manager's allocation for the new tokens, the tables and the
        # metadata (the tokens appended before it, with their block hashes, reported beside).
        fa, fpa = dec.after_tokens["full"], dec.after_tokens["full_per_request"]
        d["full_step_median_us"] = median(fa) * 1e6
        d["full_step_min_us"] = min(fa) * 1e6
        d["full_step_per_request_median_us"] = median(fpa) * 1e6
        d["full_step_per_request_min_us"] = min(fpa) * 1e6
        d["full_step_with_token_appends_median_us"] = median(f_t) * 1e6
        d["full_step_with_token_appends_min_us"] = min(f_t) * 1e6
        d["full_step_per_request_with_token_appends_median_us"] = median(fp_t) * 1e6
        d["full_step_steps"] = len(f_t)
        d["full_step_device"] = device
        d["full_step_how"] = (
            "then (separately, after the manager-only steps) per step: "
            "append_decode_tokens(requests, tokens), the engine's batched append (the "
            "per-request variant: append_token_ids(tok) per request), timed apart: the "
            "'_with_token_appends' figures include it; "
            "then, timed: got = allocate_decode_slots(requests); "
            "BlockTables.append_rows(got.rows, got.new_block_ids); commit(256); "
            "build_common_metadata(256, [1] * 256, got.num_computed_tokens) — alternating "
            "chunk by chunk with the same step through allocate_slots(req, 1) per request "
            "(rows and seq_lens from its results)"
        )
    else:
        d["full_step_error"] = dec.table_error
    ours["decode_step"] = d
    if v_t:
        vllm["decode_step"].update(
            median_us=median(v_t) * 1e6, min_us=min(v_t) * 1e6, steps=len(v_t)
        )
    return ours, vllm


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2]


def summarize(ours: dict[str, Any], vllm: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, label in (
        ("alloc_free_nocache", "allocate+free, batches of 16, caching off (blocks/s)"),
        ("alloc_free_cache", "allocate+free+cache, batches of 16, caching on (blocks/s)"),
        ("hash_sha256", "chained hashing, 16-token blocks, sha256 (blocks/s)"),
        ("hash_xxhash128", "chained hashing, 16-token blocks, xxhash-128 (blocks/s)"),
    ):
        if "blocks_per_s" not in ours[key]:
            continue  # skipped (the record's "ours" entry says why)
        o = ours[key]["blocks_per_s"]
        v = vllm.get(key, {}).get("blocks_per_s")
        rows.append(
            {
                "key": key,
                "what": label,
                "ours": o,
                "vllm": v,
                "ratio": None if v is None else o / v,
                "target": f">= {TARGETS['ratio']}x vLLM",
            }
        )
    d, vd = ours["decode_step"], vllm.get("decode_step", {})
    v_us = vd.get("median_us")
    rows.append(
        {
            "key": "decode_manager",
            "what": "decode step, 256 requests: KV manager alone (host us, median)",
            "ours": d["manager_median_us"],
            "vllm": v_us,
            "ratio": None if v_us is None else v_us / d["manager_median_us"],
            "target": "(vLLM's KV manager alone, for the ratio)",
        }
    )
    if "full_step_median_us" in d:
        for key, what, us in (
            ("decode_full_step", "allocate_decode_slots", d["full_step_median_us"]),
            (
                "decode_full_step_per_request",
                "allocate_slots per request",
                d["full_step_per_request_median_us"],
            ),
            (
                "decode_full_step_with_tokens",
                "the 256 token appends (append_decode_tokens) + allocate_decode_slots",
                d["full_step_with_token_appends_median_us"],
            ),
        ):
            rows.append(
                {
                    "key": key,
                    "what": f"decode step, 256 requests: manager ({what}) + block table + "
                    f"metadata (host us, median, {d['full_step_device']})",
                    "ours": us,
                    "vllm": None,  # vLLM's number covers its KV manager only: not like for like
                    "ratio": None,
                    "target": f"<= {TARGETS['decode_full_step_us']:.0f} us host time",
                }
            )
    return rows


def fmt(x: float | None, key: str) -> str:
    if x is None:
        return "n/a"
    if key.startswith("decode"):
        return f"{x:,.0f} us"
    return f"{x / 1e6:.2f} M/s" if x >= 1e6 else f"{x / 1e3:,.0f} k/s"


def write_md(path: Path, record: dict[str, Any]) -> None:
    lines = [
        "# kv-blocktable vs vLLM: scheduler-side host costs",
        "",
        f"One run of `packages/kv-blocktable/benchmarks/bench_blocktable.py` on {record['cpu']} "
        f"({record['cpu_count']} cores, shared), Python {record['python']}; kv-blocktable "
        f"{record['kv_blocktable']}, vLLM {record['vllm'].get('vllm_version', 'n/a')} (same "
        "machine, same job, its own interpreter). Ratio > 1: kv-blocktable is faster.",
        "",
        "| workload | kv-blocktable | vLLM | ratio | target |",
        "|---|---:|---:|---:|---|",
    ]
    for r in record["rows"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(
            f"| {r['what']} | {fmt(r['ours'], r['key'])} | {fmt(r['vllm'], r['key'])} | "
            f"{ratio} | {r['target']} |"
        )
    lines += ["", "How each side was called:", ""]
    for key in ("alloc_free_nocache", "alloc_free_cache", "hash_sha256", "hash_xxhash128"):
        o = record["ours"][key]
        lines.append(f"- `{key}` — ours: {o.get('how', o.get('skipped'))}.")
        v = record["vllm"].get(key, {})
        lines.append(f"  vLLM: {v.get('how', v.get('error', 'not run'))}.")
    d = record["ours"]["decode_step"]
    lines.append(
        f"- `decode_step` — ours: {d['how']}; {d.get('full_step_how', d.get('full_step_error'))}."
    )
    vd = record["vllm"].get("decode_step", {})
    lines.append(f"  vLLM: {vd.get('how', vd.get('error', 'not run'))}.")
    d = record["ours"]["decode_step"]
    if "full_step_median_us" in d:
        lines += [
            "",
            f"The full decode step ran its block tables on `{d['full_step_device']}`. On the CPU "
            "the block-table update, the slot mapping and the metadata are torch CPU work done "
            "on the host (issue 32's CPU figure, <= 200 us); `--device cuda` measures the same "
            "step's host time on a GPU machine (CUDA work is asynchronous there). Full step: "
            f"median {d['full_step_median_us']:.0f} us, min {d['full_step_min_us']:.0f} us over "
            f"{d['full_step_steps']} steps; with per-request manager calls, interleaved: median "
            f"{d['full_step_per_request_median_us']:.0f} us, min "
            f"{d['full_step_per_request_min_us']:.0f} us. With the step's 256 token appends "
            "(append_decode_tokens, which hashes the blocks the tokens fill) before it: median "
            f"{d['full_step_with_token_appends_median_us']:.0f} us (per-request appends and "
            "manager calls: "
            f"{d['full_step_per_request_with_token_appends_median_us']:.0f} us).",
        ]
    if "error" in record["vllm"]:
        lines += ["", f"vLLM side skipped: {record['vllm']['error']}."]
    prov = record.get("provenance", {})
    if prov:
        dirty = " (with uncommitted changes)" if prov.get("git_dirty") else ""
        lines += [
            "",
            f"Measured at commit `{prov.get('git_commit')}`{dirty}; versions: "
            + ", ".join(f"{k} {v}" for k, v in prov.items() if not k.startswith("git_"))
            + ".",
        ]
    path.write_text("\n".join(lines) + "\n")


def write_png(path: Path, rows: list[dict[str, Any]]) -> bool:
    """The ratio plot (or, with no vLLM numbers, our own figures); False if matplotlib is
    missing (the caller says so)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {
        "alloc_free_nocache": "allocate+free, caching off",
        "alloc_free_cache": "allocate+cache+free, caching on",
        "hash_sha256": "chained hashing, sha256",
        "hash_xxhash128": "chained hashing, xxhash-128",
        "decode_manager": "decode step x256, KV manager",
    }
    shown = [r for r in rows if r["ratio"] is not None]
    if not shown:  # no vLLM numbers: plot ours alone
        _plot_ours(plt, path, rows, short)
        return True
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(shown) + 1.6))
    ax.barh([short.get(r["key"], r["key"]) for r in shown], [r["ratio"] for r in shown])
    ax.set_xlim(0, max(r["ratio"] for r in shown) * 1.18)
    ax.set_title("kv-blocktable vs vLLM 0.33, same machine, same run (CPU host time)")
    ax.axvline(1.0, color="gray", lw=1)
    ax.axvline(TARGETS["ratio"], color="#c44e52", lw=1, ls="--", label="1.5x target")
    for i, r in enumerate(shown):
        ax.text(r["ratio"], i, f" {r['ratio']:.2f}x", va="center")
    ax.set_xlabel("speed-up over vLLM (higher is better)")
    ax.invert_yaxis()
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_ours(plt: Any, path: Path, rows: list[dict[str, Any]], short: dict[str, str]) -> None:
    """kv-blocktable's own figures (no vLLM side): throughputs and decode-step times."""
    rates = [r for r in rows if not r["key"].startswith("decode")]
    steps = [r for r in rows if r["key"].startswith("decode")]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 0.5 * len(rows) + 2.4))
    a.barh([short.get(r["key"], r["key"]) for r in rates], [r["ours"] / 1e6 for r in rates])
    a.set_xlabel("M blocks/s (higher is better)")
    a.invert_yaxis()
    labels = {
        "decode_full_step": "decode step x256, full (batched manager)",
        "decode_full_step_per_request": "decode step x256, full (per-request manager)",
        "decode_full_step_with_tokens": "decode step x256, full + token appends",
    }
    b.barh([labels.get(r["key"], short.get(r["key"], r["key"])) for r in steps],
           [r["ours"] for r in steps])  # fmt: skip
    b.set_xlabel("host us per step, median (lower is better)")
    b.invert_yaxis()
    a.set_title("kv-blocktable scheduler side (CPU host time; vLLM side not run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    out: Path, record: dict[str, Any], *, write_json: bool = True, name: str = NAME
) -> list[Path]:
    """``out/blocktable.{json,md,png}``; returns the files written (the PNG only with
    matplotlib, which is said in one line when missing)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    js = out / f"{name}.json"
    if write_json:
        js.write_text(json.dumps(record, indent=1) + "\n")
        written.append(js)
    md = out / f"{name}.md"
    write_md(md, record)
    written.append(md)
    png = out / f"{name}.png"
    if write_png(png, record["rows"]):
        written.append(png)
    else:
        print(
            f"matplotlib is not installed: {png} not written (add it with `uv sync --group "
            "bench` or `pip install matplotlib`)"
        )
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--vllm-python", default=os.environ.get("KVSTACK_VLLM_PYTHON", "/tmp/vllm-env/bin/python")
    )
    ap.add_argument("--device", default="cpu", help="device of the block tables (cpu or cuda)")
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder for {NAME}.json/.md/.png (default: a fresh temp folder, printed; pass "
        "--out docs/benchmarks to replace the committed results)",
    )
    ap.add_argument(
        "--render-only", action="store_true", help="redraw .md and .png from --out's .json"
    )
    ap.add_argument(
        "--name",
        default=NAME,
        help=f"file stem of the outputs (default {NAME}; e.g. blocktable_cpu_step for a record "
        "beside the committed ones)",
    )
    args = ap.parse_args(argv)
    if args.render_only:
        if args.out is None:
            ap.error("--render-only reads <out>/blocktable.json: pass --out FOLDER")
        saved: dict[str, Any] = json.loads((args.out / f"{args.name}.json").read_text())
        written = write_outputs(args.out, saved, write_json=False, name=args.name)
        print("wrote " + ", ".join(str(f) for f in written))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="kvstack-bench-blocktable-"))
    p = dict(PARAMS)
    if args.quick:
        p.update(alloc_iters=2000, repeats=2, hash_iters=3, decode_chunk=4)

    vside = VllmSide(args.vllm_python, p)
    if "error" in vside.info:
        print(f"vLLM side skipped: {vside.info['error']}; its column reads n/a")
    if (why := xxhash_missing()) is not None:
        print(why)
    ours, vllm = measure(p, args.device, vside)
    record: dict[str, Any] = {
        "benchmark": "kv-blocktable scheduler side vs vLLM",
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "kv_blocktable": kv_blocktable.__version__,
        "provenance": provenance(),
        "params": p,
        "ours": ours,
        "vllm": vllm,
    }
    record["rows"] = summarize(ours, vllm)
    written = write_outputs(out, record, name=args.name)
    for r in record["rows"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(
            f"{r['what']:<90} ours {fmt(r['ours'], r['key']):>12}  vLLM "
            f"{fmt(r['vllm'], r['key']):>12}  {ratio}"
        )
    print("wrote " + ", ".join(str(f) for f in written))


if __name__ == "__main__":
    main()
