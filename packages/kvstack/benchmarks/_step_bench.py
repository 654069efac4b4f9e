"""The engine's step at a real model's shape against the memory roofline (``bench_engine.py
--shape``; issue 32's benchmark).

A random-weight checkpoint of the shape is written (weights drawn on the device, saved as
safetensors under ``/dev/shm`` where it exists), served by :class:`~kvstack.engine.LLMEngine`,
and measured per case (batch x context):

- **decode**: after every prompt is prefilled, each decode step's time (on a GPU the device's,
  between CUDA events: :func:`_step_timing.timed_steps`) with CUDA graphs and then without (the
  same requests, the same engine: the graphs are set aside for the eager steps).
  ``roofline_ms`` = (weight bytes read + KV bytes read) / the device-to-device copy
  bandwidth measured in this process; ``value`` (metric ``roofline_fraction``) = roofline_ms /
  ms_per_step. A profile of a few steps gives ``gpu_busy_fraction``, ``host_ms_per_step``,
  ``syncs_per_step`` / ``blocking_syncs_per_step``, ``gpu_gaps`` (idle between steps, launch
  gaps) and ``top_kernels``; a shorter one with Python stacks says where each sync is called
  (``syncs_by_site``) (:mod:`_step_trace`, :mod:`_trace_analysis`).
- **mixed**: the same decode batch while new requests of the context length arrive (one every
  ``ARRIVE_EVERY`` steps), their prompts prefilled in chunks beside the decodes. A step's own
  roofline is max(bytes / copy bandwidth, FLOPs / the dense bf16 matmul peak measured here);
  ``composition`` lists each timed mixed step's decode rows, prefill tokens and roofline. Its
  profile keeps only the steps that prefill (each profiled step is labelled by the chunks it
  scheduled, and a step owns the kernels it launched), so its busy fraction, top kernels and
  host time are the mixed step's; the whole window's are under ``all_steps_profile``.
- every phase also records ``phase_roofline_ms`` / ``phase_fraction``: the bound taken phase by
  phase (the weights' matmuls at max(their bytes, their FLOPs) plus attention at max(KV bytes,
  its FLOPs), ``Cost.phase_roofline``) over the median step. At batch 256 the decode GEMMs are
  compute-bound while attention is not, so the whole step's max(bytes, FLOPs) sits below what
  the hardware can do; this one does not.
- **prefill**: the prompts' steps, FLOPs over the measured peak.

Weight bytes count every parameter once a step except the embedding table (only the batch's rows
are read) and, in mixture-of-experts layers, experts no token picked (the expected number of
distinct experts for the batch's tokens under uniform routing).
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _step_timing import copy_bandwidth, gc_summary, matmul_peak, model_dtype, timed_steps
from _step_trace import host_hotspots, profile_steps, sync_sites

#: Real shapes (transformers ``config.json`` fields; ``num_hidden_layers`` may be cut by
#: ``--layers``).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192 + 1024,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
    },
}
#: MiMo-V2-Flash (catalogue: 48 layers, 64 q heads, 4 KV heads on full layers and 8 on sliding
#: ones, head 192 / V 128, window 128, sinks) with its MoE (256 experts, 8 a token).
SHAPES["mimo-v2-flash"] = {
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash",
    "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 48,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128,
    "vocab_size": 152576, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
    "sliding_window": 128, "attention_value_scale": 0.707, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "tie_word_embeddings": False,
    "bos_token_id": None, "eos_token_id": None,
}  # fmt: skip
#: DeepSeek-V3 (its config.json: MLA with q_lora 1536 / kv_lora 512 / rope 64, YaRN x40, 3 dense
#: layers then MoE of 256 routed + 1 shared expert, 8 a token in 4 of 8 groups).
SHAPES["deepseek-v3"] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "moe_intermediate_size": 2048, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
}  # fmt: skip
#: DeepSeek-V3's attention as one GPU of tensor parallelism 8 serves it: 16 of its 128 heads (the
#: MLA decode of :mod:`kv_kernels.paged_attention._sm90_mla_narrow`). Only the heads are cut: the
#: dense and expert MLPs stay whole (one GPU here holds them all), so its step is not a TP-8
#: rank's step, but its attention is.
SHAPES["deepseek-v3-h16"] = {
    **SHAPES["deepseek-v3"], "num_attention_heads": 16, "num_key_value_heads": 16,
}  # fmt: skip
#: A smoke-test shape (``--quick``, CI on the CPU): the code path of the real ones, in seconds.
SHAPES["llama-tiny"] = {
    **SHAPES["llama3-8b"],
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
}  # fmt: skip
NEW_TOKENS = 64
ARRIVE_EVERY = 4
BLOCK = 16
#: Steps under the profiler with Python stacks (sync sites): the tracer slows the host, so it
#: is a profile of its own, short.
STACK_STEPS = 4
#: Mixed-load steps profiled: 3 arrivals, so 3 mixed steps; and with stacks: 2.
MIXED_PROFILE = 3 * ARRIVE_EVERY
MIXED_STACK = 2 * ARRIVE_EVERY


def random_checkpoint(config: dict[str, Any], path: Path, device: str, seed: int = 0) -> Path:
    """``config.json`` plus random bf16 weights of the engine's own model for ``config``, drawn on
    ``device`` (N(0, 0.02); norm gains in [0.5, 1.5])."""
    from kvstack.engine.hf_config import ArchConfig
    from kvstack.engine.models import CausalLM
    from safetensors.torch import save_file

    arch = ArchConfig.from_hf(config)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in CausalLM(arch).named_parameters()}
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.rand(shape, generator=g, device=device).add_(0.5)
        else:
            t = torch.randn(shape, generator=g, device=device).mul_(0.02)
        tensors[name] = t.to(torch.bfloat16).cpu()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return path


class Cost:
    """Bytes and FLOPs of a step of the served model (module docstring's counting rules)."""

    def __init__(self, engine: Any) -> None:
        model = engine.runner.model
        arch = model.arch
        self.arch = arch
        dense = expert = 0
        self.embed_row = arch.hidden_size * 2
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        for name, p in model.named_parameters():
            nbytes = p.numel() * p.element_size()
            if name.endswith("embed_tokens.weight"):
                if model.lm_head is None:  # tied: the logits read it whole
                    dense += nbytes
                continue
            if ".experts." in name:
                expert += nbytes
            else:
                dense += nbytes
        self.dense_bytes = dense
        self.expert_bytes = expert
        # matmul FLOPs per token: 2 per weight element a token passes through
        self.dense_flops_per_token = 2 * dense / 2  # bf16: 2 bytes an element
        cfg = engine.runner.kv_cache_config
        # per group: bytes a token's K/V takes over the group's layers
        self.kv_bytes_per_token = [
            g.spec.real_page_size_bytes // g.spec.block_size * len(g.layer_names)
            for g in cfg.groups
        ]
        self.windows = [getattr(g.spec, "sliding_window", None) for g in cfg.groups]
        # MLA (DeepSeek-V3): head_dim is qk_nope + qk_rope (192) and v_head_dim 128, the
        # decompressed count the engine's prefill does (kvstack.engine.mla_prefill); absorbed
        # decode does 512 + 64 + 512 a head, but decode is held to the memory roofline.
        self.attn_flops_per_pair = (
            2 * arch.num_q_heads * (arch.head_dim + arch.v_head_dim) * arch.num_layers
        )

    def weights(self, tokens: int) -> float:
        if not self.num_experts:
            return self.dense_bytes + tokens * self.embed_row
        picked = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)
        return (
            self.dense_bytes
            + self.expert_bytes * picked / self.num_experts
            + tokens * self.embed_row
        )

    def step(self, chunks: list[tuple[int, int]]) -> tuple[float, float]:
        """(bytes, FLOPs) of a step computing ``chunks`` = [(start, num_new_tokens)]."""
        weights, matmul, kv, attn = self.parts(chunks)
        return weights + kv, matmul + attn

    def phase_roofline(self, chunks: list[tuple[int, int]], bw: float, peak: float) -> float:
        """Seconds of the step bounded phase by phase: the weights' matmuls at max(their bytes
        / bandwidth, their FLOPs / peak) plus attention at max(KV bytes / bandwidth, its FLOPs /
        peak). At least :meth:`step`'s max(bytes, FLOPs) bound; above it where one phase is
        compute-bound and the other memory-bound (decode at batch 256: the GEMMs at M = 256 are
        compute-bound, attention is not)."""
        weights, matmul, kv, attn = self.parts(chunks)
        return max(weights / bw, matmul / peak) + max(kv / bw, attn / peak)

    def parts(self, chunks: list[tuple[int, int]]) -> tuple[float, float, float, float]:
        """(weight bytes, matmul FLOPs, KV bytes, attention FLOPs) of a step."""
        tokens = sum(n for _, n in chunks)
        kv = 0.0
        pairs = 0.0
        for start, n in chunks:
            end = start + n
            for per_tok, win in zip(self.kv_bytes_per_token, self.windows, strict=True):
                kv += per_tok * (min(end, win) if win else end)
            pairs += n * start + n * (n + 1) / 2  # causal (query, key) pairs
        # a token passes through top_k experts of each MoE layer (2 FLOPs a weight element)
        expert_flops = self.expert_bytes / 2 * 2 * self.top_k / max(self.num_experts, 1)
        matmul = (self.dense_flops_per_token + expert_flops) * tokens
        return self.weights(tokens), matmul, kv, self.attn_flops_per_pair * pairs


def _record_chunks(engine: Any) -> list[list[tuple[int, int]]]:
    """Wrap the scheduler so every step's chunks are recorded (start, num_new_tokens)."""
    log: list[list[tuple[int, int]]] = []
    schedule = engine.scheduler.schedule

    def wrapped(**kw: Any) -> Any:  # (ahead=: the engine one step ahead)
        out = schedule(**kw)
        log.append([(c.start, c.num_new_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = wrapped
    return log


def _fractions(
    times: list[float], chunks: list[list[tuple[int, int]]], cost: Cost, bw: float, peak: float
) -> dict[str, Any]:
    roof, phase = [], []
    for ch in chunks:
        nbytes, flops = cost.step(ch)
        roof.append(max(nbytes / bw, flops / peak))
        phase.append(cost.phase_roofline(ch, bw, peak))
    ms = statistics.median(times) * 1e3
    return {
        "ms_per_step": ms,
        "roofline_ms": statistics.median(roof) * 1e3,
        # the whole run's: sum of the steps' rooflines over the sum of their times
        "value": sum(roof) / sum(times),
        "steps": len(times),
        # the bound phase by phase (Cost.phase_roofline), beside the issue's, over the median
        # step (which compiles inside the run do not drown)
        "phase_roofline_ms": statistics.median(phase) * 1e3,
        "phase_fraction": statistics.median(phase) * 1e3 / ms,
    }


def composition(
    chunks: list[tuple[int, int]], cost: Cost, bw: float, peak: float
) -> dict[str, Any]:
    """What a step computed: decode rows, prefill rows and tokens, the KV tokens it read, and its
    roofline (bytes, FLOPs, ms)."""
    nbytes, flops = cost.step(chunks)
    pre = [n for _, n in chunks if n > 1]
    return {
        "decode_rows": sum(n == 1 for _, n in chunks),
        "prefill_rows": len(pre),
        "prefill_tokens": sum(pre),
        "kv_tokens": sum(s + n for s, n in chunks),
        "bytes": nbytes,
        "flops": flops,
        "roofline_ms": max(nbytes / bw, flops / peak) * 1e3,
        "phase_roofline_ms": cost.phase_roofline(chunks, bw, peak) * 1e3,
    }


def _labeller(log: list[list[tuple[int, int]]], kept: list[list[tuple[int, int]]]) -> Any:
    """A ``label()`` for :func:`profile_steps`: "mixed" when the chunks the step scheduled (what
    ``log`` gained since the last call) prefill a prompt, else "decode"; a mixed step's chunks
    are appended to ``kept``."""
    seen = {"n": len(log)}

    def label() -> str:
        new, seen["n"] = log[seen["n"] :], len(log)
        mixed = [ch for ch in new if any(n > 1 for _, n in ch)]
        kept.extend(mixed)
        return "mixed" if mixed else "decode"

    return label


def _mixed_load(
    engine: Any, log: list[list[tuple[int, int]]], base: dict[str, Any], g: torch.Generator,
    params: Any, roof: tuple[Cost, float, float],
) -> dict[str, Any]:  # fmt: skip
    """The decode batch while a request of the context length arrives every ``ARRIVE_EVERY``
    steps: the steps that prefill beside the decodes, and the whole run."""
    cost, bw, peak = roof
    vocab, context = engine.runner.arch.vocab_size, base["context"]

    def arrive(j: int) -> bool:
        if j % ARRIVE_EVERY:
            return False
        ids = torch.randint(0, vocab, (context,), generator=g).tolist()
        engine.add_request(f"a{j}", ids, params)
        return True

    gc_ms: list[float] = []
    times = timed_steps(engine, NEW_TOKENS, arrive, gc_ms)
    chunks = log[-NEW_TOKENS:]
    # (on the CPU, a step left in flight finishes inside the next call: see timed_steps)
    cpu = engine.runner.device.type != "cuda"
    shift = 1 if cpu and engine.async_scheduling is True else 0
    pick = [i for i, ch in enumerate(chunks[: NEW_TOKENS - shift]) if any(n > 1 for _, n in ch)]
    picked_times = [times[i + shift] for i in pick]
    state = {"k": NEW_TOKENS}  # (request ids past the timed run's)

    def step_with_arrivals() -> None:
        arrive(state["k"])
        state["k"] += 1
        engine.step()

    # where a mixed step's time goes: 12 more steps of the same load (3 arrivals) under the
    # profiler, only the steps that prefill kept; the host's hot spots over 4 (1 arrival); the
    # sync sites over 8 (2 arrivals)
    device = str(engine.runner.device)
    prof_chunks: list[list[tuple[int, int]]] = []
    profiled = profile_steps(
        step_with_arrivals, MIXED_PROFILE, device, _labeller(log, prof_chunks), "mixed"
    )
    hot = host_hotspots(step_with_arrivals, ARRIVE_EVERY)
    stacks = sync_sites(step_with_arrivals, MIXED_STACK, device, _labeller(log, []), "mixed")
    return {
        **base,
        **profiled,
        **stacks,
        "host_hotspots": hot,
        "phase": "mixed",
        "arrive_every": ARRIVE_EVERY,
        "async_scheduling": engine.async_scheduling,
        **_fractions(picked_times, [chunks[i] for i in pick], cost, bw, peak),
        **gc_summary([gc_ms[i + shift] for i in pick]),
        "composition": [
            {**composition(chunks[i], cost, bw, peak), "ms": times[i + shift] * 1e3} for i in pick
        ],
        "profiled_composition": [composition(ch, cost, bw, peak) for ch in prof_chunks],
        "all_steps": _fractions(times, chunks, cost, bw, peak),
    }


def run_case(
    model_dir: Path, batch: int, context: int, device: str, bw: float, peak: float,
    profile: int = 8, mixed: bool = True, backend: str | None = None,
    kv_cache_dtype: str = "auto", async_scheduling: bool | str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """decode (graphs, eager), mixed and prefill records for ``batch`` x ``context``;
    ``async_scheduling``: the engine's (``None``: its default)."""
    from kvstack.engine.engine import LLMEngine
    from kvstack.engine.sampling import SamplingParams

    # the timed mixed run's arrivals, and those of its profiles (see _mixed_load)
    extra = (MIXED_PROFILE + ARRIVE_EVERY + MIXED_STACK) // ARRIVE_EVERY
    arrivals = (NEW_TOKENS // ARRIVE_EVERY + extra) if mixed else 0
    seqs = batch + arrivals
    max_len = context + 4 * NEW_TOKENS
    # (a hybrid model's sliding group takes blocks from the same pool: twice the full need)
    hybrid = "sliding_window" in json.loads((model_dir / "config.json").read_text())
    blocks = (2 if hybrid else 1) * seqs * math.ceil(max_len / BLOCK) + 64
    t0 = time.perf_counter()
    engine = LLMEngine(
        model_dir, device=device, dtype=model_dtype(device), block_size=BLOCK, num_blocks=blocks,
        max_model_len=max_len, max_num_batched_tokens=8192, max_num_seqs=seqs,
        enable_prefix_caching=False, backend=backend, kv_cache_dtype=kv_cache_dtype,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    startup = {"total": time.perf_counter() - t0, **engine.runner.startup_seconds}
    cost = Cost(engine)
    log = _record_chunks(engine)
    g = torch.Generator().manual_seed(0)
    vocab = engine.runner.arch.vocab_size
    params = SamplingParams(max_new_tokens=4 * NEW_TOKENS, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"r{i}", torch.randint(0, vocab, (context,), generator=g).tolist(), params
        )
    base = {
        "batch": batch, "context": context, "startup_s": startup,
        "backends": sorted(set(engine.runner.backends.values())),
        # each captured size's matmul library and (blas "auto") the ms of its timed replays
        "graph_blas": (
            {str(k): v for k, v in engine.runner.graphs.blas.items()}
            if engine.runner.graphs is not None else None
        ),
    }  # fmt: skip
    out: list[dict[str, Any]] = []
    # prefill: until every request decodes
    pre_t: list[float] = []
    while (
        any(s.num_computed_tokens < context for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        pre_t += timed_steps(engine, 1)
    out.append(
        {**base, "phase": "prefill", **_fractions(pre_t, log[-len(pre_t) :], cost, bw, peak)}
    )
    graphs = engine.runner.graphs
    ahead = engine.async_scheduling
    phases = [("decode_graphs", True, ahead), ("decode_eager", False, ahead)]
    if ahead:  # the same steps in lockstep: what running one step ahead buys
        phases.insert(1, ("decode_graphs_lockstep", True, False))
    for phase, on, asynchronous in phases:
        if on and graphs is None:
            continue
        engine.runner.graphs = graphs if on else None
        engine.async_scheduling = asynchronous
        timed_steps(engine, 2)  # capture / settle
        gc_ms: list[float] = []
        t = timed_steps(engine, NEW_TOKENS // 2, gc_ms=gc_ms)
        rec = {**base, "phase": phase, **_fractions(t, log[-len(t) :], cost, bw, peak)}
        rec.update(gc_summary(gc_ms))
        rec.update(profile_steps(engine.step, profile, device))
        rec.update(sync_sites(engine.step, STACK_STEPS, device))
        if not on:  # an eager step: where its host time goes
            rec["host_hotspots"] = host_hotspots(engine.step, 3)
        rec["replays"] = graphs.num_replays if graphs is not None else 0
        rec["async_scheduling"] = asynchronous
        out.append(rec)
    engine.runner.graphs = graphs
    engine.async_scheduling = ahead
    if mixed:
        out.append(_mixed_load(engine, log, base, g, params, (cost, bw, peak)))
    # the runner and its graphs refer to each other: free the cycle before the next case allocates
    engine.runner.graphs = None
    del engine, graphs, cost, log
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def default_backend(shape: str) -> str:
    """The backend a shape's step is measured on: TRITON_MLA for an MLA latent, else TRITON
    (named, so that an installed FlashAttention-4 is not picked behind the figure's back)."""
    return "TRITON_MLA" if "kv_lora_rank" in SHAPES[shape] else "TRITON"


def bench_shape(
    shape: str, layers: int | None, cases: list[tuple[int, int]], device: str, mixed: bool,
    backend: str | None = None, kv_cache_dtype: str = "auto",
    async_scheduling: bool | str | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """``backend``: ``None`` for :func:`default_backend` (on the CPU: the engine's pick);
    ``async_scheduling``: the engine's (``None``: its default), recorded in ``info``."""
    if backend is None and device.startswith("cuda"):
        backend = default_backend(shape)
    config = dict(SHAPES[shape])
    if layers is not None:
        config["num_hidden_layers"] = layers
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    small = not device.startswith("cuda")
    bw = copy_bandwidth(device, 2**26 if small else 2**31)
    peak = matmul_peak(device, 1024 if small else 8192)
    info = {
        "shape": shape,
        "layers": config["num_hidden_layers"],
        "copy_bytes_per_s": bw,
        "matmul_flops_per_s": peak,
        "backend": backend,
        "kv_cache_dtype": kv_cache_dtype,
        "async_scheduling": async_scheduling,
    }
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        t = time.perf_counter()
        model_dir = random_checkpoint(config, Path(tmp) / shape, device)
        info["checkpoint_write_s"] = time.perf_counter() - t
        for batch, context in cases:
            for r in run_case(
                model_dir,
                batch,
                context,
                device,
                bw,
                peak,
                mixed=mixed,
                backend=backend,
                kv_cache_dtype=kv_cache_dtype,
                async_scheduling=async_scheduling,
            ):
                r.update(
                    metric="roofline_fraction", shape=shape, layers=info["layers"],
                    copy_bytes_per_s=bw, matmul_flops_per_s=peak,
                )  # fmt: skip
                print(
                    {
                        k: r[k]
                        for k in (
                            "phase",
                            "batch",
                            "context",
                            "ms_per_step",
                            "roofline_ms",
                            "value",
                        )
                    },
                    flush=True,
                )
                records.append(r)
    return records, info
