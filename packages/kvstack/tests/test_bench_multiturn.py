"""``benchmarks/bench_multiturn.py --quick`` on the CPU: conversations whose history outgrows the
pool come back from the CPU tier, with the replies of the run without it (numbers: no claim)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_multiturn.py"


def test_quick_run_hits_the_tier_with_unchanged_replies(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "multiturn_cpu.json").read_text())
    assert record["git_commit"] is None or len(record["git_commit"]) == 40  # provenance
    off, on = record["results"]["no_tier"], record["results"]["cpu_tier"]
    assert off["tier_loaded_tokens"] == 0 and on["tier_loaded_tokens"] > 0
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
    assert on["replies_equal_no_tier"] and on["tier_load_failures"] == 0
    assert set(on["ttft_s_by_turn"]) == {"0", "1", "2"}
