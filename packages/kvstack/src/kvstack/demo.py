"""``kvstack demo``: the main job on the CPU.

1. Plan the KV cache of every catalogue model for a memory budget.
2. Say plainly what is not built yet.
"""

from __future__ import annotations

from rich.console import Console

from kv_spec import CATALOGUE

from kvstack.cli import _plan_row, _plan_table
from kvstack.units import format_bytes

__all__ = ["run"]

NOT_BUILT = (
    "kv-blocktable: block pool, prefix cache, block tables (skeleton; issue not filed yet)",
    "kv-connectors: CPU offload, disk, P2P, NIXL (skeleton; issue not filed yet)",
)


def run(console: Console, *, memory: int) -> int:
    table = _plan_table(f"Step 1 — KV-cache plans for {format_bytes(memory)} of KV memory per GPU (block 16, TP 1)")
    for name in CATALOGUE:
        table.add_row(*_plan_row(name, memory, 16, 1, None, "LBNHC"))
    console.print(table)
    console.print("[bold]Not built yet:[/bold]")
    for line in NOT_BUILT:
        console.print(f"  • {line}")
    return 0
