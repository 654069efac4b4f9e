"""``kvstack bench``: where results go, what is refused before starting, and the benchmark
scripts' shared provenance helper (issue 27)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvstack.cli.bench import NEEDS, SUITES, cmd_bench, unmet_needs
from rich.console import Console

REPO = Path(__file__).resolve().parents[3]

TOY = textwrap.dedent(
    """
    import argparse, json, pathlib
    ap = argparse.ArgumentParser(); ap.add_argument("--out"); ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    pathlib.Path(a.out, "toy.json").write_text(json.dumps({"quick": a.quick}))
    """
)


def kvstack(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstack.cli", *argv],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip


def toy_checkout(root: Path, folder: str = "kv-blocktable") -> Path:
    bench_dir = root / "packages" / folder / "benchmarks"
    bench_dir.mkdir(parents=True)
    (root / "packages" / "kvstack").mkdir(exist_ok=True)
    (bench_dir / "bench_toy.py").write_text(TOY)
    return root


def test_out_is_the_folder_named_and_nothing_lands_in_docs(tmp_path: Path) -> None:
    root = toy_checkout(tmp_path / "repo")
    out = tmp_path / "results"
    res = kvstack("bench", "blocktable", "--root", str(root), "--out", str(out), "--args=--quick")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "toy.json").read_text()) == {"quick": True}
    assert not (root / "docs").exists()
    assert "wrote toy.json" in res.stdout
    res = kvstack("bench", "connectors", "--root", str(root))
    assert res.returncode == 2 and "suite 'connectors' has no benchmarks" in res.stderr


def test_kvstack_suites_each_run_their_own_script(tmp_path: Path) -> None:
    """``engine``, ``disagg`` and ``multiturn`` share kvstack's benchmarks folder: each runs its
    own script (``kvstack bench disagg``), and naming none runs every script once."""
    root = tmp_path / "repo"
    bench = root / "packages" / "kvstack" / "benchmarks"
    bench.mkdir(parents=True)
    for name in ("engine", "disagg", "multiturn"):
        (bench / f"bench_{name}.py").write_text(TOY.replace("toy.json", f"{name}.json"))
    out = tmp_path / "out"
    res = kvstack("bench", "disagg", "--root", str(root), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["disagg.json"]
    res = kvstack("bench", "engine", "multiturn", "--root", str(root), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["disagg.json", "engine.json", "multiturn.json"]


def test_default_out_is_a_fresh_temp_folder_never_docs(tmp_path: Path) -> None:
    root = toy_checkout(tmp_path / "repo")
    res = kvstack("bench", "blocktable", "--root", str(root))
    assert res.returncode == 0, res.stderr
    assert not (root / "docs").exists()
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("results go to "))
    out = Path(line.removeprefix("results go to ").split(" (")[0])
    assert out.name.startswith("kvstack-bench-") and (out / "toy.json").exists()
    assert "--out docs/benchmarks" in line  # how to replace the committed results
    shutil.rmtree(out)


def test_help_says_where_results_go() -> None:
    res = kvstack("bench", "--help")
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    assert "fresh temp folder" in text and "--out docs/benchmarks" in text
    assert "CUDA GPU" in text


def test_unmet_needs_name_the_missing_piece_and_the_fix() -> None:
    assert unmet_needs("blocktable", has_cuda=lambda: False, has_module=lambda m: False) is None
    assert unmet_needs("connectors", has_cuda=lambda: False, has_module=lambda m: False) is None
    for suite in ("kernels", "backends"):
        why = unmet_needs(suite, has_cuda=lambda: False)
        assert why is not None and "needs a CUDA GPU" in why and suite in why
        assert unmet_needs(suite, has_cuda=lambda: True) is None
    why = unmet_needs("engine", has_module=lambda m: m != "transformers")
    assert why is not None and "transformers" in why and "--group hf" in why  # (install_hint)
    assert unmet_needs("engine", has_module=lambda m: True) is None
    assert set(NEEDS) <= set(SUITES)


def _args(root: Path, out: Path, *suites: str) -> argparse.Namespace:
    return argparse.Namespace(suites=list(suites), out=out, root=root, args="")


def test_named_suites_that_cannot_run_are_refused_before_anything_starts(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    for folder in ("kv-kernels", "kv-blocktable", "kv-connectors"):
        toy_checkout(root, folder)
    kvstack_bench = root / "packages" / "kvstack" / "benchmarks"
    kvstack_bench.mkdir()
    for name in ("disagg", "multiturn", "gc"):  # (need nothing beyond the default environment)
        (kvstack_bench / f"bench_{name}.py").write_text(TOY.replace("toy.json", f"{name}.json"))
    out = tmp_path / "out"
    console = Console(file=open(tmp_path / "log", "w"))  # noqa: SIM115

    def unmet(s: str) -> str | None:
        return unmet_needs(s, has_cuda=lambda: False, has_module=lambda m: False)

    with pytest.raises(ValueError, match="suite 'kernels' needs a CUDA GPU"):
        cmd_bench(_args(root, out, "blocktable", "kernels"), console, unmet=unmet)
    assert not out.exists()  # refused before the blocktable script ran
    # No suite named: the ones that cannot run are skipped (one line each), the rest run.
    assert cmd_bench(_args(root, out), console, unmet=unmet) == 0
    console.file.close()
    log = (tmp_path / "log").read_text()
    assert "skipping: suite 'kernels' needs a CUDA GPU" in log
    assert "skipping: suite 'backends' needs a CUDA GPU" in log
    assert "skipping: suite 'engine' needs transformers" in log
    assert (out / "toy.json").exists()
    assert (out / "disagg.json").exists() and (out / "multiturn.json").exists()
    assert (out / "gc.json").exists()


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_gpu_suite_on_a_cpu_machine_is_one_clear_line() -> None:
    res = kvstack("bench", "kernels")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "suite 'kernels' needs a CUDA GPU" in res.stderr


def test_provenance_is_one_file_every_benchmarks_folder_reaches() -> None:
    doors = sorted(REPO.glob("packages/*/benchmarks/_provenance.py"))
    folders = {SUITES[s].partition(":")[0] for s in SUITES}
    assert len(doors) == len(folders), doors  # one per benchmarks folder
    for door in doors:
        res = subprocess.run(
            [sys.executable, "-c", "import _provenance as p; print(p.provenance.__code__.co_filename)"],
            cwd=door.parent, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        assert Path(res.stdout.strip()) == REPO / "tools" / "bench_provenance.py", door
    code = (
        "import json, _provenance as p; d = p.provenance('torch', 'no-such-dist'); "
        "print(json.dumps(d))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=doors[0].parent, capture_output=True, text=True,
        check=True, timeout=120,
    )  # fmt: skip
    d = json.loads(res.stdout)
    for dist in ("kv-spec", "kv-kernels", "kv-backends", "kv-blocktable", "kv-connectors"):
        assert d[dist] not in ("not installed", None), (dist, d)
    assert d["no-such-dist"] == "not installed" and d["torch"] != "not installed"
    assert len(d["git_commit"]) == 40 and isinstance(d["git_dirty"], bool)


def test_provenance_falls_back_to_the_module_version(tmp_path: Path) -> None:
    # A source tree on PYTHONPATH with no installed metadata: the module's __version__ is used.
    (tmp_path / "kvfake_pkg").mkdir()
    (tmp_path / "kvfake_pkg" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    helper = REPO / "packages" / "kv-blocktable" / "benchmarks"
    code = "import _provenance as p; print(p.package_version('kvfake-pkg'))"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=helper, capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(tmp_path)}, timeout=120,
    )  # fmt: skip
    assert res.stdout.strip() == "9.9.9"


def test_bench_engine_shape_smoke_runs_on_the_cpu(tmp_path: Path) -> None:
    """``bench_engine.py --shape``'s code path (random checkpoint, prefill / decode / mixed
    records, the profile summary, the report) on the CPU's smoke shape."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    subprocess.run(
        [sys.executable, "bench_engine.py", "--shape", "llama-tiny", "--device", "cpu", "--quick",
         "--out", str(tmp_path)],
        cwd=bench, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    runs = json.loads((tmp_path / "engine_gpu.json").read_text())["runs"]
    (run,) = runs.values()
    phases = [r["phase"] for r in run["records"]]
    assert phases == ["prefill", "decode_eager", "mixed"], phases
    for r in run["records"]:
        assert r["metric"] == "roofline_fraction" and 0 < r["value"] < 1.5, r
        assert r["roofline_ms"] > 0 and r["ms_per_step"] > 0
        # phase by phase: max(a, b) + max(c, d) >= max(a + c, b + d), step by step and so at
        # the median step
        assert r["phase_roofline_ms"] >= r["roofline_ms"] * (1 - 1e-9), r
        assert r["phase_fraction"] == pytest.approx(r["phase_roofline_ms"] / r["ms_per_step"])
    eager = run["records"][1]
    assert eager["profiled_steps"] == 8 and eager["host_ms_per_step"] > 0
    for r in run["records"][1:]:  # the timed steps' garbage collections, measured
        assert 0 <= r["gc_ms_per_step"] <= r["gc_max_ms"] < r["ms_per_step"] * 64, r
    assert (tmp_path / "engine_gpu.md").read_text().count("| 8 x 256 |") == 3
    assert "Phase by phase" in (tmp_path / "engine_gpu.md").read_text()


def test_timed_steps_charge_each_step_its_garbage_collections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``timed_steps(gc_ms=)`` gives each step the time Python's collector ran inside it: a
    step that collects gets it, the others (automatic collections off) get none."""
    import gc
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    step_bench = pytest.importorskip("_step_timing")
    garbage = [[[] for _ in range(1000)] for _ in range(200)]  # (something to traverse)
    calls = {"n": 0}

    def step() -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            gc.collect()

    engine = SimpleNamespace(step=step, runner=SimpleNamespace(device="cpu"))
    was = gc.isenabled()
    gc.disable()
    try:
        gc_ms: list[float] = []
        times = step_bench.timed_steps(engine, 3, gc_ms=gc_ms)
    finally:
        if was:
            gc.enable()
    assert len(times) == len(gc_ms) == 3
    assert gc_ms[0] == gc_ms[2] == 0 and gc_ms[1] > 0
    assert gc_ms[1] <= times[1] * 1e3
    assert step_bench.gc_summary(gc_ms)["gc_max_ms"] == gc_ms[1]
    del garbage


def test_timed_steps_on_a_gpu_charge_a_step_in_flight_its_own_device_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU a step is timed by CUDA events recorded after each call, so a step the engine
    leaves in flight (its call returns at once, the device still busy) gets its own device time,
    and an arrival before a step drains nothing. A fake device: each call queues ``work[k]`` ms
    and returns; an event records the time the queued work ends. Wall stamps would give every
    step about 0 and the drain-free mixed load its true 5 / 40 / 5 ms only through the events."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    timing = pytest.importorskip("_step_timing")
    device = {"end": 0.0, "drains": 0}
    work = [5.0, 40.0, 5.0]

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.t = None

        def record(self) -> None:
            self.t = device["end"]

        def elapsed_time(self, other: Event) -> float:
            return other.t - self.t

    def drain(dev: str) -> None:
        device["drains"] += 1

    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing, "sync", drain)
    calls = {"k": 0}

    def step() -> None:  # one step ahead: queue the work, return without waiting
        device["end"] += work[calls["k"]]
        calls["k"] += 1

    engine = SimpleNamespace(step=step, runner=SimpleNamespace(device="cuda:0"))
    asked: list[int] = []

    def arrive(k: int) -> bool:  # (a request arrives before step 1)
        asked.append(k)
        return k == 1

    times = timing.timed_steps(engine, 3, before=arrive)
    assert times == pytest.approx([w / 1e3 for w in work])
    assert device["drains"] == 2  # before and after the run, none for the arrival
    assert asked == [0, 1, 2]  # the arrivals still happen on the GPU
