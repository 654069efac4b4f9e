"""Shared fixtures for kv-kernels tests.

- ``@pytest.mark.gpu`` tests are skipped when no CUDA device is present.
- Triton kernels: without a GPU, this conftest turns on the Triton interpreter (``TRITON_INTERPRET=1``)
  before any test module imports a kernel (``triton.jit`` decides at decoration time), so the same
  parity tests run interpreted on the CPU and compiled on a GPU. Tests that run a Triton kernel ask
  for the ``triton_device`` fixture: ``"cuda"`` on a GPU machine, ``"cpu"`` under the interpreter.
- ``aot_compile_checks`` compiles kernels for sm_90 / sm_80 in a subprocess without the interpreter
  (an interpreted kernel object cannot be compiled), returning per-case results.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
HAS_NUMPY = importlib.util.find_spec("numpy") is not None  # the Triton interpreter needs numpy


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_device() -> str:
    """Where Triton kernels run in this session: ``"cuda"``, or ``"cpu"`` under the interpreter."""
    if HAS_CUDA:
        return "cuda"
    if not INTERPRETING:
        pytest.skip("no GPU and TRITON_INTERPRET is off: Triton kernels cannot run here")
    if not HAS_NUMPY:
        pytest.skip(
            "the Triton interpreter needs numpy, which is not installed in this environment"
        )
    return "cpu"


_AOT_SCRIPT = textwrap.dedent(
    """
    import importlib, json, os, re, subprocess, sys, tempfile, traceback
    from kv_kernels.aot import aot_compile

    def spill_bytes(ptx, arch):
        # ptxas -v over the build's PTX with the flags Triton 3.9 passes: the bytes a thread
        # spills (stores), or None where this triton's ptxas cannot be found or run
        try:
            from triton.backends.nvidia.compiler import get_ptxas
            path = get_ptxas(arch).path
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "k.ptx")
                with open(src, "w") as f:
                    f.write(ptx)
                log = subprocess.run(
                    [path, "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{arch}a", src, "-o",
                     os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True,
                ).stderr
            return int(re.search(r"(\\d+) bytes spill stores", log).group(1))
        except Exception:
            return None

    results = {}
    for case in json.load(sys.stdin):
        kernel = getattr(importlib.import_module(case["module"]), case["kernel"])
        try:
            compiled = aot_compile(
                kernel, case["signature"], case["constexprs"], arch=case["arch"],
                num_warps=case.get("num_warps", 4), num_stages=case.get("num_stages", 3),
                divisible_by_16=tuple(case.get("divisible_by_16", ())),
            )
            ptx = compiled.asm["ptx"]
            results[case["id"]] = {
                "ok": True, "ptx_bytes": len(ptx), "cubin_bytes": len(compiled.asm["cubin"]),
                # 16-byte vector accesses, the sign that loads/stores were vectorized
                "ld_v4": len(re.findall(r"ld\\.global[^\\n]*\\.v4", ptx)),
                "st_v4": len(re.findall(r"st\\.global[^\\n]*\\.v4", ptx)),
                "st_v2": len(re.findall(r"st\\.global[^\\n]*\\.v2", ptx)),
                "shared": compiled.metadata.shared,
                # the case's own PTX patterns, counted: {"name": regex}
                "counts": {k: len(re.findall(p, ptx)) for k, p in case.get("count", {}).items()},
            }
            if case.get("spills"):
                results[case["id"]]["spill_bytes"] = spill_bytes(ptx, case["arch"])
        except Exception:
            results[case["id"]] = {"ok": False, "error": traceback.format_exc()[-4000:]}
    print("AOT-RESULTS" + json.dumps(results))
    """
)


@pytest.fixture(scope="session")
def aot_compile_checks() -> Callable[[list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Compile cases for real GPU targets in one subprocess with the interpreter off.

    Each case: ``{"id", "module", "kernel", "signature", "constexprs", "arch", "num_warps"?,
    "num_stages"? (3 if absent), "divisible_by_16"?, "count"?, "spills"?}``; returns ``{id: {"ok":
    bool, "error"?: str, "ptx_bytes"?, "cubin_bytes"?, "ld_v4"?, "st_v4"?, "st_v2"?, "shared"?,
    "counts"?, "spill_bytes"?}}`` (``ld_v4`` / ``st_v4`` count 16-byte vector loads / stores in
    the PTX, ``shared`` is the kernel's shared memory in bytes, ``counts`` the matches of each
    ``count`` regex in the PTX; with ``spills``, ``spill_bytes`` is what ptxas -v reports a
    thread spills, None where it could not be run).
    """

    def run(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run(
            [sys.executable, "-c", _AOT_SCRIPT],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        marker = "AOT-RESULTS"
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(marker)), None)
        if line is None:
            raise AssertionError(
                f"AOT subprocess failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
            )
        return json.loads(line[len(marker) :])

    return run


@pytest.fixture
def count_gluon_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], list[int]]]:
    """``count("prefill" | "decode" | "mla")``: the list :func:`kv_kernels.testing_attention.
    counting_gluon_launches` keeps for that sm_90 Gluon kernel until the test ends, with the
    kernel's environment switch cleared."""
    from kv_kernels.testing_attention import counting_gluon_launches

    with contextlib.ExitStack() as stack:

        def count(kind: str) -> list[int]:
            monkeypatch.delenv(f"KV_KERNELS_SM90_{kind.upper()}", raising=False)
            return stack.enter_context(counting_gluon_launches(kind))

        yield count
