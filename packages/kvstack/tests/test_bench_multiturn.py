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
    # the reference engine keeps every history: all hits in its own pool, the tier's replies
    ref = record["results"]["gpu_prefix_cache"]
    assert ref["tier_loaded_tokens"] == 0 and ref["pool_hit_tokens"] > on["pool_hit_tokens"]
    assert on["replies_equal_gpu_prefix_cache"]
    assert set(on["ttft_s_by_turn"]) == {"0", "1", "2"}
    # each turn resends the history: 0, then the first turn's prompt and reply, and so on
    assert on["history_tokens_by_turn"] == {"0": [0] * 3, "1": [56] * 3, "2": [112] * 3}
    assert on["goal"]["ratio"] is None  # no 4k-token history in the quick run: no verdict
    # the connector's worker-side host time, kept and reported a request
    assert on["connector_load_host_s"] > 0 and on["connector_save_host_s"] > 0
    assert off["connector_load_host_s"] == 0 and on["requests"] == 9
    report = (tmp_path / "multiturn_cpu.md").read_text()
    assert "| 2 | 112 |" in report and "no verdict" in report
    assert "connector host time a request" in report
    # each request's time in the queue (Completion.metrics), kept and tabled
    assert all(q >= 0 for v in on["queued_s_by_turn"].values() for q in v)
    assert len(on["queued_s_by_turn"]["2"]) == 3 and "time in the queue" in report
    # the report script re-renders a record as the run wrote it (it once ran main() before
    # its helpers were defined, and raised NameError as a script)
    (tmp_path / "multiturn_cpu.md").unlink()
    again = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("_multiturn_report.py")),
         str(tmp_path / "multiturn_cpu.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "multiturn_cpu.md").read_text() == report


def test_goal_verdict_takes_only_turns_past_the_goal_prefix() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_multiturn import GOAL_PREFIX, goal_verdict

    def mode(ttft: list[float]) -> dict[str, object]:
        hist = {"0": [0, 0], "1": [GOAL_PREFIX - 1, GOAL_PREFIX]}
        return {"history_tokens_by_turn": hist, "ttft_s_by_turn": {"0": [9.0, 9.0], "1": ttft}}

    # turn 1's first conversation resent one token too few: only the second one is judged
    off = mode([1.0, 0.9])
    got = goal_verdict({"no_tier": off, "cpu_tier": mode([0.05, 0.2])}, "cpu_tier")
    assert got["turns"] == 1 and abs(got["ratio"] - 0.2 / 0.9) < 1e-12 and got["met"] is True
    # (judged on the first conversation too, 0.05 / 1.0 would have pulled the median under)
    got = goal_verdict({"no_tier": off, "cpu_tier": mode([0.05, 0.45])}, "cpu_tier")
    assert abs(got["ratio"] - 0.5) < 1e-12 and got["met"] is False
