"""``benchmarks/bench_disagg.py --quick`` on the CPU: a prefill process and this decode process
through the engines' connector path (P2P over gloo), against one colocated engine (numbers: no
claim; the tokens must be the colocated run's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_disagg.py"


def test_quick_run_moves_the_prompts_and_keeps_the_tokens(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--layerwise", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "disagg_p2p_cpu.json").read_text())
    assert record["all_tokens_equal"] and record["load_failures"] == 0
    # two 100-token prompts and a warm-up round: 6 full blocks of 16 each
    assert record["loaded_tokens"] == 3 * 96
    assert len(record["per_request"]) == 2 and record["median"]["transfer_s"] > 0
    # layer-wise streaming moved the same blocks, inside the decode engine's steps
    assert record["layerwise"]["loaded_tokens"] == 3 * 96
    assert record["layerwise"]["load_failures"] == 0
    assert record["median"]["layerwise_ttft_at_decode_s"] > 0
