"""``kvstack plan`` and ``kvstack models``: the memory planner and the catalogue, as tables or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from kv_spec import CATALOGUE, KVQuantMode, LayoutOrder
from rich.console import Console
from rich.table import Table

from kvstack.cli._args import bytes_arg, count_arg
from kvstack.planning import plan_model, plan_table, resolve_model
from kvstack.units import format_bytes

__all__ = ["add_parsers", "cmd_models", "cmd_plan"]

#: ``--scales`` -> ``plan_kv_cache(scale_plane=...)``
_SCALES: dict[str, bool | None] = {"auto": None, "plane": True, "inline": False}

#: Exit status of a plan that cannot hold one request of --max-model-len.
EXIT_DOES_NOT_FIT = 1


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan the KV cache of catalogue models or a config.json",
        description="Groups, page sizes, blocks, tokens and requests that fit in a memory budget, "
        "with the layout and its compatibility hash. Exits 1 when a plan cannot serve one request "
        "of --max-model-len.",
    )
    p.add_argument(
        "model",
        nargs="*",
        help=f"catalogue names, config.json files or checkpoint dirs (default: all of {', '.join(CATALOGUE)})",
    )
    p.add_argument(
        "--memory",
        type=bytes_arg,
        default=bytes_arg("40GiB"),
        help="KV bytes per GPU (default 40GiB)",
    )
    p.add_argument(
        "--max-model-len",
        type=count_arg("--max-model-len"),
        default=None,
        help="tokens per request (default: the model's)",
    )
    p.add_argument(
        "--block-size",
        type=count_arg("--block-size"),
        default=16,
        help="tokens per block (default 16)",
    )
    p.add_argument(
        "--tp",
        type=count_arg("--tp"),
        default=1,
        help="tensor-parallel size; must split the heads evenly",
    )
    p.add_argument(
        "--dtype", default=None, help="cache dtype (default: the model's, or the quant mode's)"
    )
    p.add_argument(
        "--kv-quant", default="none", choices=[m.value for m in KVQuantMode], help="KV quantization"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=count_arg("--max-num-batched-tokens"),
        default=8192,
        help="tokens scheduled per step (sizes sliding windows; default 8192)",
    )
    p.add_argument(
        "--layout",
        default="LBNHC",
        choices=[o.value for o in LayoutOrder],
        help="physical order of the cache (kv-spec's six named orders)",
    )
    p.add_argument(
        "--scales",
        default="auto",
        choices=sorted(_SCALES),
        help="where per-token-head scales sit: 'plane' after each page's data (same bytes, rows of "
        "K + V: the layout decode reads fastest), 'inline' at the end of each row, 'auto' "
        "(default) a plane wherever the layout can take one",
    )
    p.add_argument("--json", action="store_true", help="print the plans as JSON (for scripts)")
    p.set_defaults(func=cmd_plan)
    m = sub.add_parser(
        "models",
        help="list the model catalogue",
        description="The catalogue's models and their attention shape.",
    )
    m.add_argument("--json", action="store_true", help="print the catalogue as JSON (for scripts)")
    m.set_defaults(func=cmd_models)


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    models = [resolve_model(n) for n in (args.model or list(CATALOGUE))]
    reports = [
        plan_model(
            m,
            args.memory,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            tp=args.tp,
            dtype=args.dtype,
            kv_quant=args.kv_quant,
            layout=args.layout,
            max_num_batched_tokens=args.max_num_batched_tokens,
            scale_plane=_SCALES[args.scales],
        )
        for m in models
    ]
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        title = (
            f"KV-cache plan: {format_bytes(args.memory)} for KV, block {args.block_size}, "
            f"TP {args.tp}, {args.kv_quant}{_scales_note(args.kv_quant, reports)}, "
            f"{args.layout}"
        )
        console.print(plan_table(title, reports))
        for r in reports:
            if r.config is None:
                continue
            for g in r.config.groups:
                console.print(
                    f"  {r.model.name} group {g.group_id}: {g.spec.kind}, {len(g.layer_names)} layers, "
                    f"{r.config.num_blocks * g.spec.block_size:,} tokens, layout "
                    f"{r.config.layout_order.value} hash {r.config.layout(g.group_id).compatibility_hash()}"
                )
    short = [r for r in reports if not r.fits]
    for r in short:
        sys.stderr.write(
            f"kvstack plan: {r.model.name}: {format_bytes(r.memory)} cannot hold one request of "
            f"{r.max_model_len:,} tokens (needs {format_bytes(r.bytes_per_request)} plus one "
            "block for the allocator's null block); give more --memory or a smaller "
            "--max-model-len\n"
        )
    return EXIT_DOES_NOT_FIT if short else 0


def cmd_models(args: argparse.Namespace, console: Console) -> int:
    if args.json:
        # kv_spec.ModelConfig's own fields, as the catalogue declares them
        print(json.dumps([dataclasses.asdict(m) for m in CATALOGUE.values()], indent=2))
        return 0
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
        if m.mla:
            attn = "MLA"
        elif m.sliding_window:
            where = (
                " (all layers)"
                if m.sliding_layers is None
                else f" on {len(m.sliding_layers)} layers"
            )
            attn = f"sliding {m.sliding_window}{where}"
        else:
            attn = "full"
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


def _scales_note(kv_quant: str, reports: list[Any]) -> str:
    """Where the plans put per-token-head scales (nothing for other quant modes)."""
    if not KVQuantMode.parse(kv_quant).per_token_head:
        return ""
    planes = {r.config.scale_plane for r in reports if r.config is not None}
    if len(planes) == 2:
        return " (scales in a plane for some models, inline for others)"
    if not planes:  # no plan fits: nothing was placed
        return ""
    return " (scales in a plane)" if planes.pop() else " (scales inline)"
