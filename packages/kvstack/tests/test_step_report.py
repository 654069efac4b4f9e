"""``benchmarks/_step_report.py``: a run of some cases merged into an entry keeps the other cases'
own sources (their run's ``source_sha1`` and commit) and names them under the table, instead of
showing them under the new run's header as if measured there."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _record(batch: int, phase: str) -> dict[str, Any]:
    return {"batch": batch, "context": 1024, "phase": phase, "ms_per_step": 10.0,
            "roofline_ms": 6.0, "value": 0.6}  # fmt: skip


def _meta(sha: str) -> dict[str, Any]:
    return {"device": "GPU", "shape": "llama3-8b", "layers": 32, "torch": "2.11",
            "copy_bytes_per_s": 4e12, "matmul_flops_per_s": 8e14, "git_commit": f"c-{sha}",
            "source_sha1": sha}  # fmt: skip


def test_merged_cases_keep_their_own_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("_step_report", None)
    report = pytest.importorskip("_step_report")
    report.write(tmp_path, [_record(64, "decode_graphs"), _record(64, "mixed")], _meta("old"))
    report.write(tmp_path, [_record(64, "decode_graphs")], _meta("new"))
    run = json.loads((tmp_path / "engine_gpu.json").read_text())["runs"][
        "GPU / llama3-8b / 32 layers"
    ]
    assert run["meta"]["source_sha1"] == "new"
    by_phase = {r["phase"]: r for r in run["records"]}
    assert by_phase["decode_graphs"]["source_sha1"] == "new"
    assert by_phase["mixed"]["source_sha1"] == "old"  # kept, with the sources it was measured at
    assert by_phase["mixed"]["git_commit"] == "c-old"
    md = (tmp_path / "engine_gpu.md").read_text()
    assert "other sources than the header's (an earlier run): 64 x 1024 mixed (c-old" in md
    assert "decode_graphs (c-" not in md  # the new run's own rows are not listed


def test_the_whole_mixed_load_is_said_under_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mixed row is the steps that prefill; the whole load (its decode steps too) is a line
    under the table, without the phase-by-phase figure (taken over the median step, a decode
    step, it does not describe the load), from records with one or without (older ones)."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("_step_report", None)
    report = pytest.importorskip("_step_report")
    every = {"ms_per_step": 11.65, "value": 0.69, "steps": 64}
    new = {**_record(64, "mixed"), "all_steps": {**every, "phase_fraction": 0.55}}
    old = {**_record(256, "mixed"), "all_steps": every}
    report.write(tmp_path, [new, old], _meta("x"))
    md = (tmp_path / "engine_gpu.md").read_text()
    assert (
        "64 x 1024 mixed, the whole load (its decode steps between arrivals too, 64 steps): "
        "11.65 ms a step, fraction 0.69\n"
    ) in md
    assert (
        "256 x 1024 mixed, the whole load (its decode steps between arrivals too, 64 steps): "
        "11.65 ms a step, fraction 0.69\n" in md
    )


def test_a_run_with_kernel_switches_gets_its_own_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with ``KV_KERNELS_*`` set (a kernel turned off for an A/B) is not merged into the
    default kernels' entry of the same shape, and its meta says which switches it ran with."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("_step_report", None)
    report = pytest.importorskip("_step_report")
    report.write(tmp_path, [_record(64, "decode_graphs")], _meta("a"))
    off = dict(_meta("b"), kernel_switches={"KV_KERNELS_SM90_MLA": "0"})
    report.write(tmp_path, [_record(64, "decode_graphs")], off)
    runs = json.loads((tmp_path / "engine_gpu.json").read_text())["runs"]
    assert set(runs) == {
        "GPU / llama3-8b / 32 layers",
        "GPU / llama3-8b / 32 layers / KV_KERNELS_SM90_MLA=0",
    }
    assert runs["GPU / llama3-8b / 32 layers"]["meta"]["source_sha1"] == "a"


def test_a_run_with_async_scheduling_set_gets_its_own_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--async-scheduling true`` (every step one ahead, eager ones too) is an A/B against the
    engine's default: its records go to their own entry, named by the value; the default run
    (``async_scheduling`` None in meta) keeps the plain key."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("_step_report", None)
    report = pytest.importorskip("_step_report")
    assert [report.async_option(v) for v in (None, "graphs", "true", "false")] == [
        None, "graphs", True, False,
    ]  # fmt: skip
    report.write(tmp_path, [_record(64, "mixed")], dict(_meta("a"), async_scheduling=None))
    report.write(tmp_path, [_record(64, "mixed")], dict(_meta("b"), async_scheduling=True))
    runs = json.loads((tmp_path / "engine_gpu.json").read_text())["runs"]
    assert set(runs) == {
        "GPU / llama3-8b / 32 layers",
        "GPU / llama3-8b / 32 layers / async_scheduling=True",
    }
    assert runs["GPU / llama3-8b / 32 layers"]["meta"]["source_sha1"] == "a"
