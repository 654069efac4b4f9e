"""``benchmarks/bench_host.py --cpu --quick``: TRITON's forward over a stub kernel on the CPU
(issue 32's host bound, measured without a GPU; numbers: no claim), and the stub binds what
``paged_attention`` binds (same parameter names, kinds and order)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_cpu_run_writes_one_record_per_batch(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(BENCH / "bench_host.py"), "--cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "backends_host_cpu.json").read_text())
    assert [r["batch"] for r in record["records"]] == [1, 64, 256]
    for r in record["records"]:
        assert r["backend"] == "TRITON" and r["kernel"] == "stub (CPU)"
        assert r["forward_us"] > 0 and r["kernel_us"] > 0 and r["build_us"] > 0


def test_stub_has_the_kernel_signature() -> None:
    from kv_kernels.paged_attention import paged_attention

    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("_bench_host", BENCH / "bench_host.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    stub = mod._stub_paged_attention()
    want = [(p.name, p.kind) for p in inspect.signature(paged_attention).parameters.values()]
    got = [(p.name, p.kind) for p in inspect.signature(stub).parameters.values()]
    assert got == want
