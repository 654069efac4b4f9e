"""The cyclic collector's pauses inside the engine's steps, with the startup heap frozen
(``LLMEngine(freeze_gc=True)``, the default) and without.

Each round runs two child processes of this script on the same random-weight model
(``--shape``: ``llama-tiny`` on the CPU; a real shape with ``--layers`` on a GPU), ``freeze_gc``
off, then on (alternating, so a machine's drift hits both alike). A child imports, builds the
engine and serves ``--waves`` waves of ``--requests`` requests (prompts of ``--prompt`` tokens,
``--new-tokens`` greedy tokens each), as a serving process does, recording every collection that
starts inside a step (``gc.callbacks``): count and milliseconds by generation, the longest
pause, and the steps' median and 99th-percentile time. Children, not one process: when the
collector's oldest generation runs depends on the process's whole history (imports and startup
included), so each engine starts from a fresh one.

    python packages/kvstack/benchmarks/bench_gc.py --out DIR [--device cpu] [--rounds 3]

Writes ``DIR/gc_<device>.json`` (provenance included) and ``gc_<device>.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _provenance import provenance
from _step_bench import SHAPES

_CONFIG_KEYS = ("shape", "layers", "rounds", "waves", "requests", "prompt", "new_tokens", "blocks")


class _Pauses:
    """``gc.callbacks`` hook: each collection's generation and length, kept only while
    ``active`` (inside a step)."""

    def __init__(self) -> None:
        self.active = False
        self.pauses: list[tuple[int, float, int]] = []  # (generation, seconds, collected)
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.active:
            gen, took = int(info["generation"]), time.perf_counter() - self._t0
            self.pauses.append((gen, took, int(info["collected"])))


def _serve(engine: Any, args: argparse.Namespace, vocab: int, seed: int) -> list[float]:
    """Step times (s) of ``args.waves`` waves of requests, the collector's pauses recorded."""
    from kvstack.engine.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    times: list[float] = []
    for wave in range(args.waves):
        ids = [f"w{wave}r{i}" for i in range(args.requests)]
        for rid in ids:
            engine.add_request(
                rid, torch.randint(0, vocab, (args.prompt,), generator=g).tolist(), params
            )
        while engine.has_unfinished:
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        for rid in ids:
            engine.completion(rid)
    return times


def _round(model_dir: Path, args: argparse.Namespace, vocab: int, freeze: bool) -> dict[str, Any]:
    """One engine's run, in this process (the child's job)."""
    from kvstack.engine import LLMEngine

    hook = _Pauses()
    gc.callbacks.append(hook)
    engine = LLMEngine(
        model_dir, freeze_gc=freeze, max_num_seqs=args.requests, num_blocks=args.blocks,
        max_model_len=args.prompt + args.new_tokens + 16, device=args.device,
    )  # fmt: skip
    hook.active = True
    try:
        times = _serve(engine, args, vocab, seed=0)
    finally:
        hook.active = False
        gc.callbacks.remove(hook)
    by_gen: dict[str, dict[str, float]] = {}
    for gen, s, collected in hook.pauses:
        d = by_gen.setdefault(str(gen), {"count": 0, "ms": 0.0, "max_ms": 0.0, "collected": 0})
        d["count"] += 1
        d["ms"] += s * 1e3
        d["max_ms"] = max(d["max_ms"], s * 1e3)
        d["collected"] += collected  # (objects the passes freed: cyclic garbage found)
    total = sum(s for _, s, _ in hook.pauses)
    q = statistics.quantiles(times, n=100)
    return {
        "freeze_gc": freeze,
        "steps": len(times),
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_p99": q[98] * 1e3,
        "gc_ms_per_step": total * 1e3 / len(times),
        "gc_max_ms": max((s for _, s, _ in hook.pauses), default=0.0) * 1e3,
        "gc_by_generation": by_gen,
    }


def _child(model_dir: Path, args: argparse.Namespace, freeze: bool) -> dict[str, Any]:
    """:func:`_round` in a fresh process of this script; its JSON line back."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--child", str(model_dir), "--freeze", str(int(freeze))]
    for k in ("device", "waves", "requests", "prompt", "new_tokens", "blocks"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"child failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def _summary(rounds: list[dict[str, Any]], freeze: bool) -> dict[str, float]:
    mine = [r for r in rounds if r["freeze_gc"] is freeze]
    return {
        k: statistics.median(r[k] for r in mine)
        for k in ("step_ms_median", "step_ms_p99", "gc_ms_per_step", "gc_max_ms")
    }


def write_md(path: Path, data: dict[str, Any]) -> None:
    c = data["config"]
    lines = [
        f"# The collector's pauses inside the engine's steps ({data['device']})",
        "",
        f"Written by `packages/kvstack/benchmarks/bench_gc.py`: {c['shape']}, {c['rounds']} rounds "
        f"of two fresh serving processes (`freeze_gc` off, then on), each serving {c['waves']} "
        f"waves of {c['requests']} requests ({c['prompt']}-token prompts, {c['new_tokens']} "
        f"tokens each); every collection that started inside a step is counted. torch "
        f"{data['torch']}, commit {data.get('git_commit')}.",
        "",
        "| freeze_gc | step ms (median) | step ms (p99) | collection ms a step | longest pause ms |",
        "|---|---|---|---|---|",
    ]
    for freeze in (False, True):
        s = data["summary"]["on" if freeze else "off"]
        lines.append(
            f"| {'on' if freeze else 'off'} | {s['step_ms_median']:.2f} | {s['step_ms_p99']:.2f} | "
            f"{s['gc_ms_per_step']:.3f} | {s['gc_max_ms']:.1f} |"
        )
    lines.append("")
    for freeze in (False, True):
        gen2 = [r["gc_by_generation"].get("2") for r in data["rounds"] if r["freeze_gc"] is freeze]
        passes = sum(g["count"] for g in gen2 if g)
        freed = sum(g["collected"] for g in gen2 if g)
        lines.append(
            f"- freeze_gc {'on' if freeze else 'off'}: {passes} oldest-generation passes inside "
            f"steps over the rounds, freeing {freed} objects."
        )
    lines += ["", "Medians over the rounds. Per round and generation: the JSON."]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # (a round's model dir)
    ap.add_argument("--freeze", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="llama-tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=4096)
    args = ap.parse_args()
    if args.child is not None:
        vocab = json.loads((args.child / "config.json").read_text())["vocab_size"]
        print(json.dumps(_round(args.child, args, int(vocab), bool(args.freeze))))
        return
    if args.out is None:
        raise SystemExit("--out DIR is required")
    if args.shape not in SHAPES:
        raise SystemExit(f"--shape {args.shape!r}: known shapes are {sorted(SHAPES)}")
    from kvstack.engine.testing import write_checkpoint

    config = dict(SHAPES[args.shape])
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(config, Path(tmp) / "model")
        for _ in range(args.rounds):
            for freeze in (False, True):
                rounds.append(_child(model_dir, args, freeze))
                print(json.dumps(rounds[-1]))
    cuda = args.device.startswith("cuda")
    data = {
        "benchmark": "gc_pauses",
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "torch": torch.__version__,
        **provenance("torch"),
        "config": {k: getattr(args, k) for k in _CONFIG_KEYS},
        "rounds": rounds,
        "summary": {"off": _summary(rounds, False), "on": _summary(rounds, True)},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"gc_{'cuda' if cuda else 'cpu'}"
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=2))
    write_md(args.out / f"{name}.md", data)
    print(f"wrote {args.out / name}.json and .md")


if __name__ == "__main__":
    main()
