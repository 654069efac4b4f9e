"""``kvstack demo``: the main job, on the CPU.

1. Plan the KV cache of every catalogue model for a memory budget (kv-spec).
2. Serve a tiny gpt-oss-shaped model (alternating sliding-window / full layers with sinks, GQA)
   for a few continuous-batching steps over one paged cache: prefills, a chunked prefill and
   decodes in the same batch; the selector picks each group's backend on this CPU and says why;
   K/V go into the cache through the backend's ``do_kv_cache_update`` (kv-kernels'
   ``reshape_and_cache``); attention runs through every backend that runs on a CPU and is held to
   a float64 dense oracle computed from the K/V history.
3. Say plainly what is not built yet.

Q/K/V are random (there are no model weights here); everything else is the real stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv_spec import CATALOGUE
from rich.console import Console
from rich.table import Table

from kvstack.cli import _plan_row, _plan_table
from kvstack.units import format_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["run"]

NOT_BUILT = (
    "kv-blocktable: block pool, prefix cache, block tables — the demo hands out blocks from a plain "
    "free list (skeleton; its issue is not filed yet)",
    "kv-connectors: CPU offload, disk, P2P, NIXL (skeleton; its issue is not filed yet)",
    "the reference engine (continuous batching with a scheduler) — this demo drives the steps by hand",
)

# The tiny model: gpt-oss's attention shape, scaled down to run in a second on a CPU.
NUM_LAYERS, Q_HEADS, KV_HEADS, HEAD, WINDOW, BLOCK = 4, 8, 2, 64, 32, 16
CPU_BACKENDS = ("TORCH_SDPA", "FLEX_ATTENTION")
GPU_BACKENDS = ("TRITON", "FLASH_ATTN")


@dataclass
class Request:
    name: str
    prompt_len: int
    chunk: int  # prefill chunk size (chunked prefill when < prompt_len)
    decode_steps: int
    computed: int = 0
    blocks: dict[int, list[int]] = field(default_factory=dict)  # group id -> manager blocks

    def next_query_len(self) -> int:
        if self.computed < self.prompt_len:
            return min(self.chunk, self.prompt_len - self.computed)
        return 1 if self.computed < self.prompt_len + self.decode_steps else 0


def _oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """float64 dense attention of one request: q [Tq, Hq, D], k/v [S, H, D]; the last Tq positions."""
    import torch

    tq, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # [S, Hq, D]
    vv = v.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q.double(), kk) * scale  # [Hq, Tq, S]
    pos = torch.arange(s - tq, s)[:, None]
    kv_pos = torch.arange(s)[None, :]
    ok = kv_pos <= pos
    if window is not None:
        ok &= kv_pos > pos - window
    logits = logits.masked_fill(~ok, float("-inf"))
    sink = sinks.double()[:, None, None].expand(-1, tq, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hts,shd->thd", probs, vv)


def _serve_tiny_model(console: Console) -> bool:
    import torch
    from kv_backends import (
        AttentionConfig,
        CommonAttentionMetadata,
        Platform,
        get_backend,
        select_backend,
    )
    from kv_kernels import allocate_kv_cache, layer_view
    from kv_spec import FullAttentionSpec, SlidingWindowSpec, plan_kv_cache

    torch.manual_seed(0)
    common_kw: dict[str, Any] = dict(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype="float32"
    )
    specs = {
        f"layers.{i}": SlidingWindowSpec(sliding_window=WINDOW, **common_kw)
        if i % 2 == 0
        else FullAttentionSpec(**common_kw)
        for i in range(NUM_LAYERS)
    }
    plan = plan_kv_cache(specs, 2 * 2**20, max_model_len=256, max_num_batched_tokens=128)
    console.print(
        f"\n[bold]Step 2 — a tiny gpt-oss-shaped model on this CPU[/bold]: {NUM_LAYERS} layers "
        f"(sliding window {WINDOW} / full, alternating), {Q_HEADS} q / {KV_HEADS} kv heads, head {HEAD}, sinks; "
        f"plan: {plan.num_blocks} blocks of {format_bytes(plan.page_size_bytes)} × {plan.num_layer_slots} layer slots, "
        f"{len(plan.groups)} groups sharing one block-id space"
    )
    # Layer slots are shared by the groups: same page format, so one storage serves both.
    layouts = {g.group_id: plan.layout(g.group_id) for g in plan.groups}
    storage = allocate_kv_cache(layouts[0])
    platform = Platform.cpu()
    impls: dict[str, dict[str, Any]] = {name: {} for name in CPU_BACKENDS}
    builders: dict[tuple[str, int], Any] = {}
    sinks = {name: torch.randn(Q_HEADS) for name in specs}
    for g in plan.groups:
        config = AttentionConfig.from_spec(g.spec, num_q_heads=Q_HEADS, has_sinks=True)
        console.print(str(select_backend(config, platform)))
        for gpu_backend in GPU_BACKENDS:
            reasons = get_backend(gpu_backend).validate(config, platform)
            console.print(f"  {gpu_backend} here: {'; '.join(reasons) or 'usable'}")
        for backend_name in CPU_BACKENDS:
            backend = get_backend(backend_name)
            reasons = backend.validate(config, platform)
            if reasons:
                raise RuntimeError(f"{backend_name} cannot serve the demo model: {reasons}")
            builders[backend_name, g.group_id] = backend.make_builder(
                config, layouts[g.group_id], max_num_batched_tokens=128
            )
            for layer_name in g.layer_names:
                impls[backend_name][layer_name] = backend.make_impl(
                    config, layouts[g.group_id], sinks=sinks[layer_name]
                )

    requests = [Request("A", 45, 64, 3), Request("B", 7, 64, 4), Request("C", 80, 40, 2)]
    free = list(range(plan.num_blocks - 1, -1, -1))  # stand-in for kv-blocktable's BlockPool
    history: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    table = Table(
        title="continuous batching over one paged cache (max |error| vs a float64 dense oracle)"
    )
    for col in ("step", "batch", "tokens", *CPU_BACKENDS):
        table.add_column(col)
    scale = 1 / math.sqrt(HEAD)
    ok = True
    for step in range(1, 8):
        active = [(r, r.next_query_len()) for r in requests if r.next_query_len() > 0]
        if not active:
            break
        query_lens = [n for _, n in active]
        seq_lens = [r.computed + n for r, n in active]
        per_group_md: dict[int, CommonAttentionMetadata] = {}
        for g in plan.groups:
            for r, _ in active:
                have = r.blocks.setdefault(g.group_id, [])
                while len(have) * BLOCK < r.computed + r.next_query_len():
                    have.append(free.pop())
            width = max(len(r.blocks[g.group_id]) for r, _ in active)
            rows = [
                r.blocks[g.group_id] + [0] * (width - len(r.blocks[g.group_id])) for r, _ in active
            ]
            per_group_md[g.group_id] = CommonAttentionMetadata.from_lists(
                query_lens=query_lens, seq_lens=seq_lens, block_table=rows, block_size=BLOCK
            )
        errors = dict.fromkeys(CPU_BACKENDS, 0.0)
        num_tokens = sum(query_lens)
        for g in plan.groups:
            common = per_group_md[g.group_id]
            window = getattr(g.spec, "sliding_window", None)
            for layer_name in g.layer_names:
                slot = plan.layer_slot(layer_name)
                kv_cache = layer_view(storage, layouts[g.group_id], slot)
                q = torch.randn(num_tokens, Q_HEADS, HEAD)
                k = torch.randn(num_tokens, KV_HEADS, HEAD)
                v = torch.randn(num_tokens, KV_HEADS, HEAD)
                # One backend writes the cache (they share it); every backend then reads it.
                impls["TORCH_SDPA"][layer_name].do_kv_cache_update(
                    None, k, v, kv_cache, common.slot_mapping
                )
                expected = []
                start = 0
                for (r, n), _s in zip(active, seq_lens, strict=True):
                    hk, hv = history.get((r.name, layer_name), (k[:0], v[:0]))
                    hk, hv = (
                        torch.cat([hk, k[start : start + n]]),
                        torch.cat([hv, v[start : start + n]]),
                    )
                    history[r.name, layer_name] = (hk, hv)
                    expected.append(
                        _oracle(q[start : start + n], hk, hv, sinks[layer_name], window, scale)
                    )
                    start += n
                want = torch.cat(expected)
                for backend_name in CPU_BACKENDS:
                    md = builders[backend_name, g.group_id].build(common)
                    got = impls[backend_name][layer_name].forward(None, q, kv_cache, md)
                    errors[backend_name] = max(
                        errors[backend_name], (got.double() - want).abs().max().item()
                    )
        for r, n in active:
            r.computed += n
        kinds = ", ".join(
            f"{r.name}:{'decode' if r.computed > r.prompt_len else ('prefill' if n == r.prompt_len else 'chunk')}({n})"
            for r, n in active
        )
        cells = []
        for name in CPU_BACKENDS:
            good = errors[name] < 1e-4
            ok &= good
            cells.append(f"[{'green' if good else 'red'}]{errors[name]:.1e}[/]")
        table.add_row(str(step), kinds, str(num_tokens), *cells)
    console.print(table)
    console.print(
        "On a GPU the same code runs with TRITON (kv-kernels' unified kernel) or FLASH_ATTN, "
        "which `select_backend` picks there."
    )
    return ok


def run(console: Console, *, memory: int) -> int:
    table = _plan_table(
        f"Step 1 — KV-cache plans for {format_bytes(memory)} of KV memory per GPU (block 16, TP 1)"
    )
    for name in CATALOGUE:
        table.add_row(*_plan_row(name, memory, 16, 1, None, "LBNHC"))
    console.print(table)
    ok = _serve_tiny_model(console)
    console.print("\n[bold]Step 3 — not built yet:[/bold]")
    for line in NOT_BUILT:
        console.print(f"  • {line}")
    if not ok:
        console.print("[red]a backend disagreed with the oracle[/red]")
        return 1
    return 0
