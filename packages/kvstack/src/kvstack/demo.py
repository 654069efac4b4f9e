"""``kvstack demo``: the whole stack on a small random-weight model, on the CPU (or a GPU).

1. Plans: the KV cache of every catalogue model for a memory budget (kv-spec).
2. A small Qwen3-architecture model with **random weights** (no download): full-attention and
   sliding-window layers (two KV groups), GQA, q/k norms. Written as a Hugging Face checkpoint
   (``config.json`` + safetensors) by our own writer, so transformers is not needed.
3. The engine serves a batch of requests with shared system prompts: continuous batching, chunked
   prefill, prefix caching (kv-blocktable), paged attention through the backend the selector picks
   per KV group (kv-backends), the cache planned by kv-spec. Throughput, KV memory, hit rate.
4. Every request's tokens are checked against the dense reference (the same weights without a
   cache) and, when transformers is installed, against transformers itself.
5. One request is handed from a "prefill" process to a "decode" process through a kv-connectors
   connector (see :mod:`kvstack.handoff`), and the continued tokens are checked.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_spec import CATALOGUE
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from kvstack._hints import install_hint
from kvstack.planning import plan_model, plan_table
from kvstack.units import format_bytes

__all__ = ["DEMO_CONFIG", "GreedyCheck", "check_greedy", "run", "write_random_checkpoint"]

#: The demo model: Qwen3's architecture (q/k RMSNorm, GQA, tied embeddings) with its sliding
#: window turned on for the upper half of the layers, so the cache has two KV groups (full and
#: sliding) sharing one block pool — scaled down to run in seconds on two CPU cores.
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "use_sliding_window": True,
    "sliding_window": 32,
    "max_window_layers": 2,
    "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "eos_token_id": None,
    "bos_token_id": None,
}
NUM_SYSTEM_PROMPTS, REQUESTS_PER_PROMPT, SYSTEM_LEN, MAX_NEW = 4, 4, 32, 16
#: The demo's KV pool: 80 blocks of 16 tokens, fewer than the 16 requests hold at once, so the
#: batch preempts and resumes from the prefix cache (what a pool under pressure does).
DEMO_KV_BYTES = 5 * 2**18
#: Random weights make near-ties between the two best logits happen now and then; within this
#: (float32, ~1e-5 relative) either token is a correct greedy choice, and the demo says so.
TIE_ATOL = 1e-3


def write_random_checkpoint(path: str | Path, config: dict[str, Any], *, seed: int = 0) -> Path:
    """Write ``config.json`` and random weights (``model.safetensors``) for ``config``.

    Weights are N(0, 0.2) (large enough that attention is far from uniform, so a wrong page or
    position changes the tokens) and norm gains U(0.5, 1.5). Needs only torch and safetensors.
    """
    from kvstack.engine.testing import write_checkpoint

    return write_checkpoint(config, path, seed=seed)


@dataclass(frozen=True)
class GreedyCheck:
    """How a request's generated tokens compare with a reference's logits (teacher-forced)."""

    exact: bool  # every token is the reference's argmax
    near_ties: int  # tokens that are not the argmax but within TIE_ATOL of it (either is right)
    ok: bool  # every token is within TIE_ATOL of the reference's best logit


def check_greedy(ref_logits: Any, tokens: list[int], atol: float = TIE_ATOL) -> GreedyCheck:
    """``ref_logits`` ``[n, vocab]``: the reference's logits before each of the ``n`` tokens.

    Teacher forcing: feeding the engine's own tokens to the reference and checking each one is
    the reference's argmax is the same test as comparing greedy sequences, in one forward pass.
    """
    import torch

    t = torch.tensor(tokens)
    best = ref_logits.max(dim=-1).values  # [n]
    chosen = ref_logits.gather(1, t[:, None])[:, 0]  # [n]
    exact = bool((ref_logits.argmax(dim=-1) == t).all())
    gap = best - chosen  # >= 0; 0 where the token is an argmax
    return GreedyCheck(exact, int(((gap > 0) & (gap <= atol)).sum()), bool((gap <= atol).all()))


def _dense_logits(model: Any, prompt: list[int], tokens: list[int]) -> Any:
    """The dense (cache-free) reference's logits before each generated token ``[n, vocab]``."""
    import torch

    device = next(model.parameters()).device  # (the model may live on a GPU)
    seq = torch.tensor(prompt + tokens[:-1], dtype=torch.int64, device=device)
    return model.forward_dense(seq)[len(prompt) - 1 :].float().cpu()


def _workload(vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    systems = [
        torch.randint(0, vocab, (SYSTEM_LEN,), generator=g).tolist()
        for _ in range(NUM_SYSTEM_PROMPTS)
    ]
    prompts = []
    for _r in range(REQUESTS_PER_PROMPT):
        for s in systems:
            n = int(torch.randint(8, 40, (1,), generator=g))
            prompts.append(s + torch.randint(0, vocab, (n,), generator=g).tolist())
    return prompts


def _serve(
    console: Console, model_dir: Path, device: str
) -> tuple[Any, list[list[int]], list[Any]]:
    from kvstack.engine.engine import LLMEngine
    from kvstack.engine.sampling import SamplingParams

    warm = LLMEngine(
        model_dir,
        device=device,
        block_size=16,
        kv_cache_memory=DEMO_KV_BYTES,  # 80 blocks: tight enough that the batch preempts
        max_model_len=256,
        max_num_batched_tokens=512,
        max_num_seqs=16,
    )
    prompts = _workload(warm.runner.arch.vocab_size)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    # An untimed run of the same requests first: first calls pay one-time costs (lazy init,
    # allocator growth; on a GPU Triton compiles each kernel variant the batch shapes need and
    # CUDA graphs are captured per batch size), and only the same schedule meets every variant
    # the timed run will. Then a fresh engine (empty prefix cache, zeroed stats) on the same
    # runner serves them again, timed: what every rerun measures.
    warm.generate(prompts, params)
    engine = LLMEngine(runner=warm.runner, max_num_seqs=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    total = len(prompts) * MAX_NEW
    with Progress(
        TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
        console=console, transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("tokens", total=total)
        while engine.has_unfinished:
            bar.advance(task, len(engine.step()))
    completions = [engine.completion(str(i)) for i in range(len(prompts))]
    return engine, prompts, completions


def _report_engine(console: Console, engine: Any) -> None:
    from kv_backends import backend_names, get_backend

    st = engine.stats()
    sched = st.scheduler
    cfg = engine.runner.kv_cache_config
    table = Table(title="the engine, over the whole stack", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "throughput",
        f"{st.tokens_per_second:,.0f} generated tokens/s ({st.num_generated_tokens} tokens, "
        f"{st.num_computed_tokens} tokens computed, {sched.num_steps} steps, {st.wall_seconds:.2f} s)"
        + "; timed after an untimed warm-up run of the same requests that paid the first "
        "calls' one-time costs"
        + (
            " (Triton compilation, CUDA-graph capture)"
            if engine.runner.device.type == "cuda"
            else ""
        ),
    )
    table.add_row(
        "KV memory",
        f"planned {format_bytes(cfg.total_bytes)} = {cfg.num_blocks} blocks x "
        f"{format_bytes(cfg.page_size_bytes)} pages x {cfg.num_layer_slots} layer slots; "
        f"peak use {sched.max_usage:.0%} = {format_bytes(sched.max_usage * cfg.total_bytes)}; "
        "the pool is small on purpose, fewer blocks than the batch holds at once, so the "
        "scheduler must preempt and resume",
    )
    table.add_row(
        "prefix cache",
        f"hit rate {sched.prefix_hit_rate:.0%} ({sched.prefix_hit_tokens:,} of "
        f"{sched.prefix_query_tokens:,} prompt tokens served from cached blocks)",
    )
    table.add_row("preemptions", f"{sched.num_preemptions} (resumed {sched.num_resumes}, "
                  f"{sched.resume_hit_tokens} tokens back from the prefix cache; expected with "
                  "the small pool)")  # fmt: skip
    graphs = engine.runner.graphs
    replays = f"; {graphs.num_replays} decode steps replayed" if graphs is not None else ""
    table.add_row("CUDA graphs", engine.runner.cuda_graphs_reason + replays)
    console.print(table)
    groups = Table(title="attention backend per KV group (kv-backends' selector)")
    for col in ("group", "layers", "spec", "backend", "why"):
        groups.add_column(col, overflow="fold")
    for g in cfg.groups:
        sel = engine.runner.selections[g.group_id]
        why = [f"first usable in {sel.platform.label}'s priority order"]
        why += [f"{r.name} rejected: {'; '.join(r.reasons)}" for r in sel.rejected]
        why += list(sel.notes)
        # Backends the walk never reached or never tries here: what they would say.
        for name in backend_names():
            if name != sel.name and name not in {r.name for r in sel.rejected}:
                reasons = get_backend(name).validate(sel.config, sel.platform)
                why.append(f"{name}: {'; '.join(reasons) if reasons else 'usable, lower priority'}")
        window = getattr(g.spec, "sliding_window", None)
        spec = f"{g.spec.kind}" + (f" {window}" if window else "") + f", block {g.spec.block_size}"
        groups.add_row(str(g.group_id), str(len(g.layer_names)), spec, sel.name, "\n".join(why))
    console.print(groups)


def _check(
    console: Console, engine: Any, prompts: list[list[int]], completions: list[Any], model_dir: Path
) -> bool:
    """Every request against the dense reference and, when installed, transformers."""
    model = engine.runner.model
    dense = [
        check_greedy(_dense_logits(model, p, list(c.token_ids)), list(c.token_ids))
        for p, c in zip(prompts, completions, strict=True)
    ]
    hf = _transformers_check(model_dir, prompts, completions)
    table = Table(title="generated tokens vs references (teacher-forced greedy check)")
    for col in ("reference", "requests", "match"):
        table.add_column(col)
    table.add_row("dense: same weights, no cache, no batching", str(len(dense)), _summary(dense))
    if hf is None:
        hint = escape(install_hint("hf", "kvstack demo"))
        table.add_row("transformers", "-", f"not installed ({hint} to compare)")
    else:
        table.add_row("transformers (eager attention)", str(len(hf)), _summary(hf))
    console.print(table)
    return all(c.ok for c in dense) and (hf is None or all(c.ok for c in hf))


def _summary(checks: list[GreedyCheck]) -> str:
    exact = sum(c.exact for c in checks)
    ties = sum(c.near_ties for c in checks if not c.exact and c.ok)
    bad = sum(not c.ok for c in checks)
    text = f"{exact}/{len(checks)} token for token"
    if ties:
        text += f"; {ties} near-tie token(s) (top-2 logits within {TIE_ATOL:g}: either is greedy)"
    return _mark(bad == 0, text if not bad else f"{text}; {bad} WRONG")


def _transformers_check(
    model_dir: Path, prompts: list[list[int]], completions: list[Any]
) -> list[GreedyCheck] | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            toks = list(c.token_ids)
            logits = model(torch.tensor([p + toks[:-1]])).logits[0, len(p) - 1 :].float()
            out.append(check_greedy(logits, toks))
    return out


def _mark(ok: bool, text: str) -> str:
    return f"[green]✓ {text}[/green]" if ok else f"[red]✗ {text}[/red]"


def run(
    console: Console,
    *,
    memory: int,
    device: str | None = None,
    handoff: bool = True,
    keep: str | Path | None = None,
) -> int:
    """The tour; ``keep``: write the model there and leave it (else a temporary directory)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    reports = [plan_model(m, memory) for m in CATALOGUE.values()]
    console.print(
        plan_table(
            f"1. KV-cache plans for {format_bytes(memory)} of KV memory per GPU (block 16, TP 1)",
            reports,
        )
    )
    with contextlib.ExitStack() as stack:
        if keep is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstack-demo-"))
            model_dir = write_random_checkpoint(Path(tmp) / "tiny-qwen3", DEMO_CONFIG)
            where = "deleted at the end; kvstack demo --keep DIR keeps it for kvstack generate"
        else:
            model_dir = write_random_checkpoint(keep, DEMO_CONFIG)
            where = "kept"
        c = DEMO_CONFIG
        console.print(
            f"\n[bold]2. A tiny Qwen3-architecture model with RANDOM weights[/bold] (nothing is "
            "downloaded; its text would be gibberish, so we show token ids): "
            f"{c['num_hidden_layers']} layers (2 full attention, 2 with a {c['sliding_window']}-token "
            f"sliding window), {c['num_attention_heads']} q / {c['num_key_value_heads']} kv heads of "
            f"{c['head_dim']}, q/k RMSNorm, on {device}. Written as a Hugging Face checkpoint "
            f"(config.json + safetensors) to {model_dir} ({where})."
        )
        console.print(
            f"\n[bold]3. Serving {NUM_SYSTEM_PROMPTS * REQUESTS_PER_PROMPT} requests[/bold] ({NUM_SYSTEM_PROMPTS} shared "
            f"{SYSTEM_LEN}-token system prompts + different questions, {MAX_NEW} new tokens each) with continuous batching"
        )
        engine, prompts, completions = _serve(console, model_dir, device)
        _report_engine(console, engine)
        console.print("\n[bold]4. Checking the tokens[/bold]")
        ok = _check(console, engine, prompts, completions, model_dir)
        if handoff:
            console.print("\n[bold]5. Prefill in one process, decode in another[/bold]")
            from kvstack import handoff as handoff_mod

            # The connector contract carries one block list per request, so one KV group: the
            # demo model with its sliding window off, checked against its own one-process run.
            console.print(
                "(the demo model with its sliding window off: a connector moves one KV group)"
            )
            full = {**DEMO_CONFIG, "use_sliding_window": False, "layer_types": None}
            full_dir = write_random_checkpoint(Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="kvstack-handoff-"))) / "tiny-qwen3-full", full
            )  # fmt: skip
            hand_device = device
            if device == "cuda" and torch.cuda.device_count() < 2:
                # two processes on one GPU: NCCL refuses ("Duplicate GPU detected")
                console.print(
                    "(one GPU here, and NCCL needs a GPU per process: both processes run on the "
                    "CPU, checked against a one-process run on the CPU)"
                )
                hand_device = "cpu"
            ok &= handoff_mod.run_demo(console, full_dir, prompts[0], MAX_NEW, None, hand_device)
    elapsed = time.perf_counter() - start
    verdict = "[green]all tokens match[/green]" if ok else "[red]MISMATCH: see above[/red]"
    console.print(f"\n{verdict} — demo took {elapsed:.1f} s")
    if keep is not None:
        console.print(
            f"The model is in {model_dir}; next: kvstack generate {model_dir} --prompt-ids 1,2,3 "
            "(random weights, no tokenizer: token ids in and out)"
        )
    return 0 if ok else 1
