"""The ``kvstack`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kv_spec import CATALOGUE, KVCacheConfig, LayoutOrder, get_model, plan_kv_cache
from rich.console import Console
from rich.table import Table

from kvstack.units import format_bytes, parse_bytes

__all__ = ["main"]


def _plan_row(
    name: str,
    memory: int,
    block_size: int,
    tp: int,
    dtype: str | None,
    layout: str,
    batched: int = 8192,
) -> list[str]:
    """One table row: the plan of catalogue model ``name`` within ``memory`` bytes."""
    model = get_model(name)
    specs = model.kv_specs(block_size=block_size, tensor_parallel_size=tp, dtype=dtype)
    try:
        cfg = plan_kv_cache(
            specs,
            memory,
            max_model_len=model.max_model_len,
            max_num_batched_tokens=batched,
            layout_order=layout,
        )
    except ValueError:
        # Too small for one request at max_model_len: say how much would do.
        big = plan_kv_cache(specs, 2**62, max_num_batched_tokens=batched, layout_order=layout)
        need = (
            big.blocks_per_request(model.max_model_len) * big.page_size_bytes * big.num_layer_slots
        )
        return [
            model.name,
            format_bytes(big.page_size_bytes),
            str(big.num_layer_slots),
            "-",
            f"{model.max_model_len:,}",
            f"[red]0 (one request needs {format_bytes(need)})[/red]",
            _groups(big),
        ]
    return [
        model.name,
        format_bytes(cfg.page_size_bytes),
        str(cfg.num_layer_slots),
        f"{cfg.num_blocks:,}",
        f"{model.max_model_len:,}",
        f"{cfg.max_concurrency():.2f}",
        _groups(cfg),
    ]


def _groups(cfg: KVCacheConfig) -> str:
    counts: dict[tuple[str, int], int] = {}
    for g in cfg.groups:
        key = (g.spec.kind, g.spec.block_size)
        counts[key] = counts.get(key, 0) + len(g.layer_names)
    return (
        ", ".join(f"{n} {kind} (block {bs})" for (kind, bs), n in counts.items())
        + f" in {len(cfg.groups)} group(s)"
    )


def _plan_table(title: str) -> Table:
    table = Table(title=title)
    for col in (
        "model",
        "page",
        "layer slots",
        "blocks",
        "max_model_len",
        "requests at max len",
        "groups",
    ):
        table.add_column(col, overflow="fold")
    return table


def cmd_models(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="Model catalogue (kv_spec.CATALOGUE)")
    for col in (
        "model",
        "layers",
        "q/kv heads",
        "head (k/v)",
        "attention",
        "max_model_len",
        "source",
    ):
        table.add_column(col)
    for m in CATALOGUE.values():
        attn = (
            "MLA"
            if m.mla
            else (
                f"sliding {m.sliding_window}"
                + (
                    " (all layers)"
                    if m.sliding_layers is None
                    else f" on {len(m.sliding_layers)} layers"
                )
                if m.sliding_window
                else "full"
            )
        )
        if m.has_sinks:
            attn += ", sinks"
        kv = f"{m.num_kv_heads}" + (f"/{m.swa_num_kv_heads} swa" if m.swa_num_kv_heads else "")
        table.add_row(
            m.name,
            str(m.num_layers),
            f"{m.num_q_heads}/{kv}",
            f"{m.head_size}/{m.head_size_v or m.head_size}",
            attn,
            f"{m.max_model_len:,}",
            m.source,
        )
    console.print(table)
    return 0


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    memory = parse_bytes(args.memory)
    table = _plan_table(
        f"KV-cache plan: {format_bytes(memory)} for KV, block {args.block_size}, TP {args.tp}, {args.layout}"
    )
    names = args.model or list(CATALOGUE)
    for name in names:
        table.add_row(
            *_plan_row(
                name,
                memory,
                args.block_size,
                args.tp,
                args.dtype,
                args.layout,
                args.max_num_batched_tokens,
            )
        )
    console.print(table)
    return 0


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from kvstack import demo

    return demo.run(console, memory=parse_bytes(args.memory))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstack", description="The paged KV-cache layer of LLM inference."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="plan KV caches for the catalogue and run paged attention end to end on the CPU",
    )
    demo.add_argument(
        "--memory", default="40GiB", help="bytes for the KV cache per GPU (default 40GiB)"
    )
    demo.set_defaults(func=cmd_demo)
    plan = sub.add_parser("plan", help="plan the KV cache of catalogue models")
    plan.add_argument(
        "model", nargs="*", help=f"catalogue models (default: all of {', '.join(CATALOGUE)})"
    )
    plan.add_argument(
        "--memory", default="40GiB", help="bytes for the KV cache per GPU (default 40GiB)"
    )
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--dtype", default=None, help="cache dtype (default: the model's)")
    plan.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens scheduled per step (sizes sliding windows)",
    )
    plan.add_argument("--layout", default="LBNHC", choices=[o.value for o in LayoutOrder])
    plan.set_defaults(func=cmd_plan)
    models = sub.add_parser("models", help="list the model catalogue")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # pipes and CI logs: don't fold tables to 80 columns
    try:
        return int(args.func(args, console))
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
