"""Packaging checks: kv-connectors imports, its version matches its pyproject, it exports what it
declares, it respects the layers (it imports nothing above itself), and its NIXL extra starts an agent."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import kv_connectors

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_matches_pyproject() -> None:
    assert kv_connectors.__version__ == tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_exports_are_declared() -> None:
    assert set(kv_connectors.__all__) <= set(dir(kv_connectors))


def test_imports_nothing_above_itself() -> None:
    code = "import sys, kv_connectors; print(' '.join(m for m in ('kvstack', 'kv_connectors') if m in sys.modules and m != 'kv_connectors'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == ""


def test_nixl_transport_installs_and_starts_a_ucx_agent() -> None:
    """The `nixl` extra is what the NIXL connector moves DRAM with: prove it starts on a CPU."""
    import pytest

    api = pytest.importorskip("nixl._api", reason="the nixl test group is not installed")
    agent = api.nixl_agent("kvstack-test", api.nixl_agent_config(backends=["UCX"]))
    assert "UCX" in agent.get_plugin_list()
