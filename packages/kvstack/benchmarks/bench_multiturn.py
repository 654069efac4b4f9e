"""Multi-turn conversations whose history outgrows the KV pool: the engine with and without a CPU
tier (``OffloadingConnector``) behind its prefix cache, in one process, on the same workload.

Workload: ``--conversations`` conversations take turns (round robin), ``--turns`` turns each; a turn
sends the whole history so far plus ``--user-tokens`` new tokens and generates ``--reply-tokens``
(greedy, no EOS), and the reply joins the history. The pool (``--pool-blocks``) holds fewer blocks
than the conversations' histories together, so by the time a conversation comes back, the pool
has evicted its history: without a tier every turn recomputes it; with the tier the history's full
blocks come back from host memory (``--disk`` adds a ``FilesystemConnector`` behind it, in a
temporary directory, through a ``MultiConnector``).

A third engine, ``gpu_prefix_cache``, has a pool that holds every history: each turn's history
is a hit in the GPU prefix cache, the floor a tier approaches. It is also the reference for the
tiers' replies: a tier hands back the bytes that engine keeps, and the new tokens are computed
the same way, so their greedy replies must be equal token for token. Against ``no_tier`` they may
differ on a GPU: recomputing a history in one prefill rounds its replies' KV differently from the
decode steps that wrote it (bf16), and random weights leave near-ties.

Reported per mode: time to first token of every turn (add_request to the first token: the prefill
of the history and the new tokens, loads included) by turn index, its median over turns >= 1 (those
that can hit), tokens generated per second over the whole run, prompt tokens computed vs loaded,
and whether every reply equals the no-tier run's (greedy; a tier must not change a token).

The issue's goal (a CPU-tier hit on a >= 4k-token prefix: TTFT <= 1/3 of recomputing it) is for
GPUs, on a real model's shape (``--device cuda --shape llama3-8b --user-tokens 1024 --turns 5``:
turn 4 resends a 4,224-token history); the verdict compares the two modes' median TTFT over the
turns whose history (the prefix a tier can serve) is at least ``GOAL_PREFIX`` tokens. Each
record is written with its report beside it (``_multiturn_report.py``: a table by turn and a
plot); numbers from a CPU run are no performance claim.

    python packages/kvstack/benchmarks/bench_multiturn.py [--quick] [--device cuda]
        [--shape llama3-8b [--layers N]] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _multiturn_report import write_report
from _provenance import provenance

#: the model's fields the record keeps
_MODEL_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "vocab_size")  # fmt: skip
#: the goal's prefix: turns whose history is at least this many tokens are judged
GOAL_PREFIX = 4096
#: the goal: a tier hit's TTFT at most this share of recomputing the prefix
GOAL_RATIO = 1 / 3


def _config(args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    """The model's ``config.json``: ``--shape``'s (``_step_bench.SHAPES``, ``--layers`` cutting
    it) or a small Llama of ``--hidden`` / ``--layers`` / ``--heads``."""
    if args.shape:
        from _step_bench import SHAPES

        config = dict(SHAPES[args.shape])
        if args.layers_given:
            config["num_hidden_layers"] = args.layers
        config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
        return config
    hidden, heads = args.hidden, args.heads
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
        "head_dim": hidden // heads, "vocab_size": 1024, "max_position_embeddings": max_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "eos_token_id": None,
    }  # fmt: skip


def _checkpoint(root: Path, config: dict[str, Any], args: argparse.Namespace) -> Path:
    if args.shape:
        from _step_bench import random_checkpoint  # drawn on the device: an 8B shape in seconds

        return random_checkpoint(config, root / "model", args.device)
    from kvstack.demo import write_random_checkpoint

    return write_random_checkpoint(root / "model", config)


def goal_verdict(results: dict[str, Any], mode: str) -> dict[str, Any]:
    """The goal's figure for ``mode`` against ``no_tier``: the median TTFT over the turns (>= 1)
    whose history reached :data:`GOAL_PREFIX` tokens in both runs, and their ratio."""
    on, off = results[mode], results["no_tier"]
    pairs = [
        (a, b)
        for t, hs in on["history_tokens_by_turn"].items()
        if int(t) >= 1
        for h, a, b in zip(hs, on["ttft_s_by_turn"][t], off["ttft_s_by_turn"][t], strict=True)
        if h >= GOAL_PREFIX
    ]
    if not pairs:
        return {"prefix_tokens": GOAL_PREFIX, "turns": 0, "ratio": None, "met": None}
    a = statistics.median(p[0] for p in pairs)
    b = statistics.median(p[1] for p in pairs)
    return {
        "prefix_tokens": GOAL_PREFIX, "turns": len(pairs), "ttft_s": a, "no_tier_ttft_s": b,
        "ratio": a / b, "goal_ratio": GOAL_RATIO, "met": a / b <= GOAL_RATIO,
    }  # fmt: skip


def _run(engine: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from kvstack.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    params = SamplingParams(max_new_tokens=args.reply_tokens, ignore_eos=True)
    ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    queued: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    history: dict[int, list[int]] = {t: [] for t in range(args.turns)}
    replies: list[list[int]] = []
    generated = 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = (
                histories[c] + torch.randint(0, vocab, (args.user_tokens,), generator=g).tolist()
            )
            rid = engine.add_request(f"c{c}t{turn}", prompt, params)
            t0 = time.perf_counter()
            first: float | None = None
            tokens: list[int] = []
            while engine.has_unfinished:
                for ev in engine.step():
                    if ev.request_id == rid:
                        if first is None:
                            # (the token is on the host: no device sync, which would also wait
                            # for a tier's saves still copying on their own streams)
                            first = time.perf_counter() - t0
                        tokens.append(ev.token_id)
            metrics = engine.completion(rid).metrics
            assert first is not None and metrics is not None
            ttft[turn].append(first)
            # (waiting for a batch slot or for blocks, e.g. ones a tier's save still holds)
            queued[turn].append(metrics.time_in_queue or 0.0)
            history[turn].append(len(histories[c]))
            replies.append(tokens)
            generated += len(tokens)
            histories[c] = prompt + tokens
    wall = time.perf_counter() - start
    stats = engine.stats()
    later = [s for t in range(1, args.turns) for s in ttft[t]]
    kvc = stats.kv_connector
    return {
        "ttft_s_by_turn": {str(t): v for t, v in ttft.items()},
        "queued_s_by_turn": {str(t): v for t, v in queued.items()},
        "history_tokens_by_turn": {str(t): v for t, v in history.items()},
        "ttft_median_s_turns_ge_1": statistics.median(later) if later else None,
        "tokens_per_s": generated / wall,
        "wall_s": wall,
        "prompt_tokens_computed": stats.num_computed_tokens,
        "pool_hit_tokens": stats.scheduler.prefix_hit_tokens,
        "tier_loaded_tokens": 0 if kvc is None else kvc.loaded_tokens,
        "tier_load_failures": 0 if kvc is None else kvc.num_load_failures,
        # host time in the connector's worker side (inside the steps, between their launches)
        "connector_load_host_s": 0.0 if kvc is None else kvc.load_host_s,
        "connector_save_host_s": 0.0 if kvc is None else kvc.save_host_s,
        "requests": len(replies),
        "final_history_tokens": [len(h) for h in histories],
        "_replies": replies,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model and workload (CI, CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=512)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="8, or the shape's (cut to N)")
    ap.add_argument("--shape", default=None, help="a real model's shape: llama3-8b")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=0, help="0: 1.5 conversations' histories")
    ap.add_argument("--disk", action="store_true", help="a filesystem tier behind the CPU tier")
    ap.add_argument("--out", type=Path, default=None, help="write multiturn_<device>.json here")
    args = ap.parse_args()
    args.layers_given = args.layers is not None
    if args.layers is None:
        args.layers = 8
    if args.quick:
        args.conversations, args.turns, args.user_tokens, args.reply_tokens = 3, 3, 48, 8
        args.hidden, args.layers, args.heads = 64, 2, 4
    from kv_connectors import (
        FilesystemConfig,
        FilesystemConnector,
        MultiConnector,
        OffloadingConfig,
        OffloadingConnector,
    )
    from kvstack.engine.connector_driver import model_fingerprint
    from kvstack.engine.engine import LLMEngine

    bs = args.block_size
    final = args.turns * (args.user_tokens + args.reply_tokens)
    max_len = -(-(final + bs) // bs) * bs
    pool = args.pool_blocks or max(-(-max_len // bs) + 1, 3 * final // (2 * bs))
    big_pool = args.conversations * (-(-final // bs)) + -(-max_len // bs) + 1  # every history
    config = _config(args, max_len)
    vocab = config["vocab_size"]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    # The tier holds every conversation's history twice over: this measures hits, not eviction.
    kv_heads, head = config["num_key_value_heads"], config["head_dim"]
    row = config["num_hidden_layers"] * bs * kv_heads * 2 * head * (dtype.itemsize)
    tier_bytes = 2 * args.conversations * (-(-final // bs)) * row
    results: dict[str, Any] = {}
    shm = "/dev/shm" if Path("/dev/shm").is_dir() and args.device != "cpu" else None
    with tempfile.TemporaryDirectory(prefix="kvstack-multiturn-", dir=shm) as tmp:
        model_dir = _checkpoint(Path(tmp), config, args)
        modes = ["no_tier", "gpu_prefix_cache", "cpu_tier"]
        modes += ["cpu_and_disk_tier"] if args.disk else []
        for mode in modes:
            connector: Any = None
            blocks = pool
            if mode == "gpu_prefix_cache":  # every history stays: a hit in the pool each turn
                blocks = big_pool
            elif mode != "no_tier":
                tier = OffloadingConnector(OffloadingConfig(cpu_bytes=tier_bytes), block_size=bs)
                connector = tier
                if mode == "cpu_and_disk_tier":
                    disk = FilesystemConnector(
                        FilesystemConfig(
                            root=Path(tmp) / "disk", model_fingerprint=model_fingerprint(model_dir)
                        ),
                        block_size=bs,
                    )
                    connector = MultiConnector([tier, disk])
            engine = LLMEngine(
                model_dir, device=args.device, dtype=dtype, block_size=bs, num_blocks=blocks,
                max_model_len=max_len, max_num_batched_tokens=max_len, max_num_seqs=4,
                kv_connector=connector,
            )  # fmt: skip
            results[mode] = _run(engine, args, vocab)
            if connector is not None:
                connector.close()
            del engine
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    replies = {mode: results[mode].pop("_replies") for mode in modes}
    for mode in modes[1:]:
        results[mode]["replies_equal_no_tier"] = replies[mode] == replies["no_tier"]
        if mode != "gpu_prefix_cache":  # (the tier's bytes are that engine's: equal replies)
            results[mode]["replies_equal_gpu_prefix_cache"] = (
                replies[mode] == replies["gpu_prefix_cache"]
            )
        a = results[mode]["ttft_median_s_turns_ge_1"]
        b = results["no_tier"]["ttft_median_s_turns_ge_1"]
        results[mode]["ttft_ratio_vs_no_tier"] = a / b if a and b else None
        results[mode]["goal"] = goal_verdict(results, mode)
    record = {
        "benchmark": "multiturn",
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "note": "CPU runs are no performance claim; the issue's goal is measured on GPUs",
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "layers_given")}
        | {
            "model": {k: config[k] for k in _MODEL_FIELDS},
            "pool_blocks": pool,
            "gpu_prefix_cache_pool_blocks": big_pool,
            "max_model_len": max_len,
            "dtype": str(dtype),
            "tier_bytes": tier_bytes,
        },
        "results": results,
        **provenance("torch"),
    }
    text = json.dumps(record, indent=2)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"multiturn_{args.device.split(':')[0]}.json"
        path.write_text(text + "\n")
        print(f"wrote {path} and its report ({', '.join(write_report(path))})")
    for mode, r in results.items():
        print(
            f"{mode:>18}: TTFT median (turns >= 1) {r['ttft_median_s_turns_ge_1'] * 1000:8.1f} ms, "
            f"{r['tokens_per_s']:7.1f} tok/s, computed {r['prompt_tokens_computed']}, "
            f"loaded {r['tier_loaded_tokens']}"
            + "".join(
                f", replies equal to {ref}'s: {r[key]}"
                for ref in ("gpu_prefix_cache", "no_tier")
                if (key := f"replies_equal_{ref}") in r
            )
        )
        goal = r.get("goal")
        if goal and goal["ratio"] is not None:
            print(
                f"{'':>18}  history >= {goal['prefix_tokens']} tokens ({goal['turns']} turns): "
                f"TTFT {goal['ttft_s'] * 1e3:.1f} vs {goal['no_tier_ttft_s'] * 1e3:.1f} ms "
                f"recomputed = {goal['ratio']:.2f} (goal <= {GOAL_RATIO:.2f}: "
                f"{'met' if goal['met'] else 'NOT met'})"
            )


if __name__ == "__main__":
    main()
