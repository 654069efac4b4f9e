"""``benchmarks/bench_gc.py`` on the CPU, smoke-sized: two fresh serving processes a round
(``freeze_gc`` off, then on), every collection inside a step counted, JSON with provenance and a
markdown table written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gc.py"


def test_bench_gc_writes_both_modes(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--rounds", "1",
         "--waves", "1", "--requests", "4", "--prompt", "16", "--new-tokens", "3",
         "--blocks", "64"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "gc_cpu.json").read_text())
    assert [r["freeze_gc"] for r in data["rounds"]] == [False, True]
    assert all(r["steps"] > 0 and r["gc_ms_per_step"] >= 0 for r in data["rounds"])
    assert set(data["summary"]) == {"off", "on"} and "git_commit" in data
    table = (tmp_path / "gc_cpu.md").read_text()
    assert "| off |" in table and "| on |" in table
