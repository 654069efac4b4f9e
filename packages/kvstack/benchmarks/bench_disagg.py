"""Disaggregated prefill -> decode against one colocated engine, through the engine's connector path.

A *prefill* engine in a child process (``--prefill-device``; a producer connector) computes each
prompt and its first token; a *decode* engine here (``--decode-device``; a consumer connector)
takes the request with the producer's ``kv_transfer_params``, waits out of the batch while the
connector pulls the prompt's full blocks, computes the rest and decodes. The colocated baseline is
one engine on ``--decode-device`` running the same prompts. Requests run one at a time, so each
time is that request's alone.

Reported per request and as medians: the colocated time to first token; the disaggregated one
split into prefill (the child's own clock, in the child), transfer (``add_request`` until the
request left ``Scheduler.loading``) and the decode side's first step; the transfer's share of the
colocated TTFT (the issue's goal: <= 10% for 8k-token prompts on two GPUs); decode tokens/s on
both sides; whether every token equals the colocated run's. JSON with provenance.

    python packages/kvstack/benchmarks/bench_disagg.py --quick                       # CPU, gloo
    python packages/kvstack/benchmarks/bench_disagg.py --prefill-device cuda:0 \\
        --decode-device cuda:1 --prompt-tokens 8192 --transport nixl --out docs/benchmarks

``--layerwise`` (P2P) adds layer-wise streaming: the child adds each prompt with
``LLMEngine.stream_kv`` and sends its params the moment the prompt is scheduled, before the
prefill's forward pass; a second decode engine (``P2pConfig(layerwise=True)``) adds the bare
prompt with them at once and loads it inside its step, layer by layer, while the child computes.
For both disaggregated modes ``ttft_at_decode_s`` is the time from the child reading the prompt
(the prefill engine's receipt, the colocated TTFT's start too; the harness's pipe to it is
left out, and so is the byte check's digest) until the decode engine sampled its first token
(whole-request: the token after the prefill's; layer-wise: the first token), beside the
colocated TTFT. The params' way back to this process is counted, as a router's would be.

CPU numbers are no performance claim. NIXL needs the ``nixl`` package on both sides.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _provenance import provenance

_MARK = "BENCH-DISAGG "


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": max(1, args.heads // 4), "head_dim": args.hidden // args.heads,
        "vocab_size": 1024, "max_position_embeddings": args.max_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "eos_token_id": None,
    }  # fmt: skip


def _connector(
    transport: str, role: str, fingerprint: str, block_size: int, layerwise: bool = False
) -> Any:
    from kv_connectors import P2pConfig, P2pConnector

    if transport == "nixl":
        from kv_connectors import NixlConfig
        from kv_connectors.nixl import NixlConnector

        cfg = NixlConfig(role=role, model_fingerprint=fingerprint, timeout_s=120.0)
        return NixlConnector(cfg, block_size=block_size)
    p2p = P2pConfig(role=role, model_fingerprint=fingerprint, timeout_s=120.0, layerwise=layerwise)
    return P2pConnector(p2p, block_size=block_size)


def _engine(
    model_dir: Path, device: str, args: argparse.Namespace, connector: Any, **more: Any
) -> Any:
    from kvstack.engine.engine import LLMEngine

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return LLMEngine(
        model_dir, device=device, dtype=dtype, block_size=args.block_size,
        max_model_len=args.max_len, max_num_batched_tokens=args.max_len, max_num_seqs=4,
        num_blocks=4 * (args.max_len // args.block_size) + 1, kv_connector=connector, **more,
    )  # fmt: skip


def _trace_install() -> None:
    """``--trace``: timestamps on the connector's host path and the engine's connector calls."""
    from kv_connectors import host_trace
    from kvstack.engine.connector_driver import KVConnectorDriver
    from kvstack.engine.engine import LLMEngine
    from kvstack.engine.scheduler import Scheduler

    host_trace.install_transfer()
    for name in ("match", "allocated", "start_step", "idle_step", "poll", "end_forward"):
        host_trace.wrap(KVConnectorDriver, name)
    # layer-wise streaming: when the producer's host reached each layer (save_kv_layer) against
    # when its session thread served it (_serve_layers' sends), and the consumer's layer waits
    from kv_connectors._streaming import LayerStreaming

    for name in ("save_kv_layer", "wait_for_layer_load", "_serve_layers"):
        host_trace.wrap(LayerStreaming, name)
    # the step's parts before its first layer, and the collector's pauses
    import gc

    from kv_blocktable.block_table import BlockTables
    from kvstack.engine._rows import BatchRows
    from kvstack.engine._staging import StepStager
    from kvstack.engine.runner import ModelRunner

    for owner, name in (
        (BatchRows, "prepare"),
        (BlockTables, "build_common_metadata"),
        (StepStager, "stage"),
        (ModelRunner, "execute_trusted"),
    ):
        host_trace.wrap(owner, name)
    gc.callbacks.append(
        lambda phase, info: host_trace.mark(
            f"gc{info['generation']} {'>' if phase == 'start' else '<'}"
        )
    )
    host_trace.wrap(LLMEngine, "step")
    host_trace.wrap(Scheduler, "kv_loaded")


def _busy(events: list[Any], min_s: float = 2e-4) -> list[Any]:
    """``events`` without the engine calls (on the main thread) that took under ``min_s``: an
    idle engine polls its connector every millisecond, which would bury the transfer."""
    calls = ("step", "start_step", "idle_step", "end_forward", "poll", "start_load_kv")
    drop: set[int] = set()
    open_at: dict[tuple[str, str], list[int]] = {}
    for i, (t, thread, event) in enumerate(events):
        name, _, edge = event.rpartition(" ")
        if name not in calls:
            continue
        stack = open_at.setdefault((thread, name), [])
        if edge == ">":
            stack.append(i)
        elif edge == "<" and stack:
            j = stack.pop()
            if t - events[j][0] < min_s:
                drop.update((i, j))
    return [e for i, e in enumerate(events) if i not in drop]


def _trace_print(child_file: Path, out: Path | None) -> None:
    """The last request's merged timeline, from its prompt's send to each first token."""
    from kv_connectors import host_trace

    theirs = json.loads(child_file.read_text()) if child_file.exists() else []
    sides = [("decode", _busy(host_trace.EVENTS)), ("prefill", _busy(theirs))]
    lines, on = [], False
    for line in host_trace.timeline(sides):
        on = on or line.endswith("sent")
        if on:
            lines.append(line)
        on = on and not line.endswith("first token")
    print("\n".join(["== trace of the last request (ms)", *lines]))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "disagg_trace.txt").write_text("\n".join(lines) + "\n")


def _child(args: argparse.Namespace) -> None:
    """The prefill process: for each prompt on stdin, prefill and publish; serve while stepping."""
    from kvstack.engine.connector_driver import model_fingerprint
    from kvstack.engine.sampling import SamplingParams

    if args.trace:
        _trace_install()
    conn = _connector(args.transport, "producer", model_fingerprint(args.model), args.block_size)
    # no prefix cache: each mode prefills the same prompts, and a hit would skip the compute
    engine = _engine(args.model, args.prefill_device, args, conn, enable_prefix_caching=False)
    engine.generate([[1, 2, 3, 4] * 8], SamplingParams(max_new_tokens=1))  # warm-up
    print(_MARK + "READY", flush=True)
    import select

    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.001)
        if ready:
            line = sys.stdin.readline()
            received = time.time()  # (one clock for the host's processes)
            if not line.strip():
                break
            msg = json.loads(line)
            stream = isinstance(msg, dict) and msg["stream"]
            if args.trace and not stream:  # (a pair starts: keep only the last pair's events)
                from kv_connectors import host_trace

                host_trace.EVENTS.clear()
            prompt = msg["prompt"] if isinstance(msg, dict) else msg
            one = SamplingParams(max_new_tokens=1, ignore_eos=True)
            t0 = time.perf_counter()
            if stream:  # the params leave before the forward pass; the consumer starts at once
                rid = engine.add_request(None, prompt, one)
                engine.stream_kv(
                    rid,
                    lambda r, p, at=received: print(
                        _MARK + json.dumps({"params": p, "received": at}), flush=True
                    ),
                )
                while not any(e.request_id == rid for e in engine.step()):
                    pass
                done = engine.completion(rid)
            else:
                done = engine.generate([prompt], one)[0]
            if engine.runner.device.type == "cuda":
                torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            # (blocks a consumer loads in both modes: the prompt's full blocks but the last)
            digest = _held_digest(engine, done.request_id, len(prompt) // args.block_size)
            out = {
                "first": done.token_ids[0],
                "params": done.kv_transfer_params,
                "prefill_s": prefill_s,
                "kv_digest": digest,
                "received": received,
                "digest_s": time.perf_counter() - t0 - prefill_s,  # (left out of at_decode_s)
            }
            print(_MARK + json.dumps(out), flush=True)
        engine.step()  # polls the connector: serves pulls' completions, frees their blocks
    conn.close()
    if args.trace:
        from kv_connectors import host_trace

        Path(args.trace).write_text(json.dumps(host_trace.EVENTS))


def _read(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill process exited ({proc.wait()})")
        if line.startswith(_MARK):
            return line[len(_MARK) :].strip()


def _kv_digest(engine: Any, rid: str, num_blocks: int) -> list[int]:
    """A position-weighted checksum of the first ``num_blocks`` blocks of request ``rid``, every
    layer, per KV group: equal on both sides when the decode engine holds the prefill engine's
    KV byte for byte (a wrong, dropped or reordered page changes it), computed on the device."""
    from kv_kernels.block_copy import gather_blocks
    from kvstack.engine._device import device_context

    with device_context(engine.runner.device):  # (Triton launches on the current device)
        return _kv_digest_here(engine, rid, num_blocks, gather_blocks)


def _kv_digest_here(engine: Any, rid: str, num_blocks: int, gather_blocks: Any) -> list[int]:
    sums = []
    for gid, ids in enumerate(engine.block_ids(rid)):
        layout, storage = engine.runner.layouts[gid], engine.runner.kv_caches[gid]
        ids = ids[:num_blocks]
        row = layout.num_layers * layout.page_bytes
        buf = torch.empty(len(ids), row, dtype=torch.uint8, device=engine.runner.device)
        gather_blocks(storage, layout, ids, buf)
        words = buf.view(-1).view(torch.int32).to(torch.int64)  # (int64 arithmetic wraps)
        weight = torch.arange(words.numel(), device=words.device) % 65521 + 1
        sums.append(int((words * weight).sum()))
    return sums


def _since(wall: float) -> float:
    """The ``time.perf_counter()`` reading at wall-clock time ``wall`` (``time.time()``, which
    the host's processes share): the prefill process's receipt of a prompt, as this process's
    start of its time to first token."""
    return time.perf_counter() - (time.time() - wall)


def _mark(name: str) -> None:
    """A ``--trace`` mark (kept only where the tracer is installed)."""
    from kv_connectors import host_trace

    host_trace.mark(name)


def _held_digest(engine: Any, rid: str, full_blocks: int) -> list[int] | None:
    """The producer's :func:`_kv_digest` of the blocks a consumer loads in both modes (the
    prompt's full blocks but the last), or ``None`` where the request's blocks were already
    let go (a consumer's pull may end before the producer's next step)."""
    try:
        return _kv_digest(engine, rid, full_blocks - 1)
    except (KeyError, ValueError):
        return None


def _same(here: list[int] | None, there: list[int] | None) -> bool | None:
    """Digests equal (``None``: not known on one side)."""
    return None if here is None or there is None else here == there


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (or the shorter's length), else None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _decode(
    engine: Any,
    rid: str,
    prompt: list[int],
    n: int,
    params: Any = None,
    sent: float | None = None,
    digest_blocks: int = 0,
) -> dict[str, Any]:
    """Run one request to completion: its tokens, time to its first token here, and how long it
    waited for KV (``transfer_s``) before its first step; ``at_decode_s``: from ``sent`` (when
    the prompt went to the prefill process) to the first token here. ``digest_blocks``: once the
    load has landed, the :func:`_kv_digest` of that many loaded blocks (``kv_digest``; its own
    time is left out of every figure)."""
    from kvstack.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    sent = t0 if sent is None else sent
    _mark("add_request")
    engine.add_request(
        rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), kv_transfer_params=params
    )
    transfer = first = digest = None
    tokens: list[int] = []
    while engine.has_unfinished:
        events = engine.step()
        now = time.perf_counter()
        if transfer is None and rid not in engine.scheduler.loading:
            transfer = now - t0
            _mark("loaded")
            if digest_blocks and params is not None:
                t_digest = time.perf_counter()
                if engine.runner.device.type == "cuda":
                    torch.cuda.synchronize(engine.runner.device)  # (the step's landings too)
                digest = _kv_digest(engine, rid, digest_blocks)
                spent = time.perf_counter() - t_digest
                t0, sent = t0 + spent, sent + spent
        for ev in events:
            if first is None:
                if engine.runner.device.type == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
                _mark("first token")
            tokens.append(ev.token_id)
    total = time.perf_counter() - t0
    engine.completion(rid)
    assert first is not None and transfer is not None
    return {
        "tokens": tokens,
        "ttft_s": first,
        "at_decode_s": first + (t0 - sent),
        "transfer_s": transfer if params is not None else 0.0,
        "decode_tok_s": (len(tokens) - 1) / (total - first) if total > first else None,
        "kv_digest": digest,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model and prompts (CPU, CI)")
    ap.add_argument("--transport", choices=("p2p", "nixl"), default="p2p")
    ap.add_argument(
        "--layerwise",
        action="store_true",
        help="also stream layer by layer (P2P): stream_kv on the prefill side, a layerwise consumer",
    )
    ap.add_argument("--prefill-device", default="cpu")
    ap.add_argument("--decode-device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--trace",
        nargs="?",
        const="1",
        default=None,
        help="print (and write disagg_trace.txt) the last request's host timeline on both sides",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.requests = 100, 8, 2
        args.hidden, args.layers, args.heads = 64, 2, 4
    if not args.max_len:
        bs = args.block_size
        args.max_len = -(-(args.prompt_tokens + args.decode_tokens + 1) // bs) * bs
    if args.child:
        _child(args)
        return
    if args.layerwise and args.transport != "p2p":
        ap.error(
            f"--layerwise streams over P2P only; --transport={args.transport} moves whole requests"
        )
    from kv_connectors.host_trace import EVENTS
    from kvstack.demo import write_random_checkpoint
    from kvstack.engine.connector_driver import model_fingerprint
    from kvstack.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 1024, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory(prefix="kvstack-disagg-") as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "llama", _config(args))
        colocated = _engine(model_dir, args.decode_device, args, None)
        # warm-up at full length (reversed: no prefix hit), so no kernel compiles in a timed TTFT
        colocated.generate([prompts[0][::-1]], SamplingParams(max_new_tokens=2))
        # and twice a request the way the timed ones run: the first two timed colocated TTFTs
        # on 2 x H200 read 119-209 ms against ~28 for the rest with the warm-up above alone
        for k in range(2):
            _decode(colocated, f"warm{k}", prompts[k][::-1], args.decode_tokens)
        base = [_decode(colocated, f"c{i}", p, args.decode_tokens) for i, p in enumerate(prompts)]
        del colocated
        trace_file = Path(tmp) / "prefill_trace.json"
        if args.trace:
            _trace_install()
        conn = _connector(args.transport, "consumer", model_fingerprint(model_dir), args.block_size)
        decode = _engine(model_dir, args.decode_device, args, conn)
        lw_conn = lw = None
        if args.layerwise:
            fp = model_fingerprint(model_dir)
            lw_conn = _connector("p2p", "consumer", fp, args.block_size, layerwise=True)
            lw = _engine(model_dir, args.decode_device, args, lw_conn)
        child_args = [a for a in sys.argv[1:] if a not in ("--quick", "--layerwise", "--trace")]
        cmd = [sys.executable, __file__, *child_args, "--child", "--model", str(model_dir)]
        cmd += ["--trace", str(trace_file)] if args.trace else []
        cmd += ["--max-len", str(args.max_len), "--prompt-tokens", str(args.prompt_tokens)]
        cmd += ["--decode-tokens", str(args.decode_tokens), "--hidden", str(args.hidden)]
        cmd += ["--layers", str(args.layers), "--heads", str(args.heads)]
        child = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True
        )
        rows = []
        try:
            assert _read(child) == "READY"
            assert child.stdin is not None
            # the first round warms each side's session (an NCCL communicator takes long to
            # make) and is not reported
            pairs = list(enumerate(zip(prompts, base, strict=True)))
            for i, (p, b) in [(-1, (prompts[0][::-1], base[0])), *pairs]:
                if i == len(prompts) - 1:  # (--trace: the last pair's events only)
                    EVENTS.clear()
                _mark("sent")
                sent = time.perf_counter()
                child.stdin.write(json.dumps(p) + "\n")
                child.stdin.flush()
                msg = json.loads(_read(child))
                sent = _since(msg["received"]) + msg["digest_s"]
                first = int(msg["first"])
                nfull = len(p) // args.block_size - 1
                d = _decode(
                    decode, f"d{i}", [*p, first], args.decode_tokens - 1, msg["params"], sent,
                    digest_blocks=nfull,
                )  # fmt: skip
                row = {
                    "colocated_ttft_s": b["ttft_s"],
                    "prefill_s": msg["prefill_s"],
                    "transfer_s": d["transfer_s"],
                    "decode_first_step_s": d["ttft_s"] - d["transfer_s"],
                    "transfer_share_of_colocated_ttft": d["transfer_s"] / b["ttft_s"],
                    "ttft_at_decode_s": d["at_decode_s"],
                    "colocated_decode_tok_s": b["decode_tok_s"],
                    "disagg_decode_tok_s": d["decode_tok_s"],
                    "tokens_equal": [first, *d["tokens"]] == b["tokens"],
                    "first_divergence": _first_divergence([first, *d["tokens"]], b["tokens"]),
                    "kv_equal": _same(d["kv_digest"], msg["kv_digest"]),
                }
                if lw is not None:  # the same prompt streamed layer by layer
                    _mark("sent")
                    sent = time.perf_counter()
                    child.stdin.write(json.dumps({"prompt": p, "stream": True}) + "\n")
                    child.stdin.flush()
                    started = json.loads(_read(child))  # (the params leave before the forward)
                    params, sent = started["params"], _since(started["received"])
                    ls = _decode(
                        lw, f"s{i}", p, args.decode_tokens, params, sent, digest_blocks=nfull
                    )
                    done = json.loads(_read(child))
                    row["layerwise_ttft_at_decode_s"] = ls["at_decode_s"]
                    row["layerwise_prefill_s"] = done["prefill_s"]
                    row["layerwise_decode_tok_s"] = ls["decode_tok_s"]
                    row["tokens_equal"] = row["tokens_equal"] and ls["tokens"] == b["tokens"]
                    row["layerwise_first_divergence"] = _first_divergence(ls["tokens"], b["tokens"])
                    row["layerwise_kv_equal"] = _same(ls["kv_digest"], done["kv_digest"])
                if i >= 0:
                    rows.append(row)
            stats = decode.stats().kv_connector
            lw_stats = None if lw is None else lw.stats().kv_connector
        finally:
            if child.stdin is not None:
                child.stdin.close()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
            conn.close()
            if lw_conn is not None:
                lw_conn.close()
        if args.trace:
            _trace_print(trace_file, args.out)
    flags = ("tokens_equal", "kv_equal", "layerwise_kv_equal")
    numbers = [k for k in rows[0] if k not in flags and "divergence" not in k]
    med = {k: statistics.median(r[k] for r in rows) for k in numbers}
    record = {
        "benchmark": "disagg",
        "devices": {"prefill": args.prefill_device, "decode": args.decode_device},
        "device_name": (
            torch.cuda.get_device_name(args.decode_device)
            if args.decode_device.startswith("cuda")
            else platform.processor() or "cpu"
        ),
        "note": "CPU runs are no performance claim; the issue's goal is measured on two GPUs",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "per_request": rows,
        "median": med,
        "all_tokens_equal": all(r["tokens_equal"] for r in rows),
        # the KV the decode engine reported loaded is the prefill engine's, byte for byte
        # (whole-request and, with --layerwise, layer-wise): the check that must hold; tokens
        # of a random bf16 model may still part at a near-tie between the two engines' kernels
        "all_kv_equal": all(
            r[k] is not False for r in rows for k in ("kv_equal", "layerwise_kv_equal") if k in r
        ),
        "kv_checks": sum(
            r[k] is not None for r in rows for k in ("kv_equal", "layerwise_kv_equal") if k in r
        ),
        "loaded_tokens": None if stats is None else stats.loaded_tokens,
        "load_failures": None if stats is None else stats.num_load_failures,
        "layerwise": None
        if lw_stats is None
        else {
            "loaded_tokens": lw_stats.loaded_tokens,
            "load_failures": lw_stats.num_load_failures,
            "note": "ttft_at_decode_s: prompt read by the prefill process -> the decode engine's "
            "first sampled token; whole-request vs layer-wise streaming vs colocated TTFT",
        },
        **provenance("torch"),
    }
    text = json.dumps(record, indent=2)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"disagg_{args.transport}_{args.decode_device.split(':')[0]}.json"
        path.write_text(text + "\n")
        from _disagg_report import write_report

        for p in [path, *write_report(record, path)]:
            print(f"wrote {p}")
    divergences = [r["first_divergence"] for r in rows]
    if lw_stats is not None:
        lw_div = [r["layerwise_first_divergence"] for r in rows]
        divergences_text = f"whole-request {divergences}, layer-wise {lw_div}"
    else:
        divergences_text = str(divergences)
    print(
        f"{args.transport}: colocated TTFT {med['colocated_ttft_s'] * 1e3:.1f} ms; disaggregated "
        f"prefill {med['prefill_s'] * 1e3:.1f} ms + transfer {med['transfer_s'] * 1e3:.1f} ms "
        f"({med['transfer_share_of_colocated_ttft']:.0%} of colocated TTFT); tokens equal: "
        f"{record['all_tokens_equal']} (first divergences: {divergences_text}); loaded KV "
        "equal to the producer's: "
        f"{record['all_kv_equal']} ({record['kv_checks']} checks); loaded "
        f"{record['loaded_tokens']} tokens"
    )
    if lw_stats is not None:
        print(
            f"time to the decode engine's first token: whole-request "
            f"{med['ttft_at_decode_s'] * 1e3:.1f} ms, layer-wise "
            f"{med['layerwise_ttft_at_decode_s'] * 1e3:.1f} ms; colocated TTFT "
            f"{med['colocated_ttft_s'] * 1e3:.1f} ms; layer-wise loaded "
            f"{lw_stats.loaded_tokens} tokens, {lw_stats.num_load_failures} load failures"
        )


if __name__ == "__main__":
    main()
