"""kv-blocktable is a skeleton until its issue lands: check what exists — it imports, its version matches its
pyproject, and it respects the layers (it imports nothing above itself)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import kv_blocktable

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_matches_pyproject() -> None:
    assert kv_blocktable.__version__ == tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_exports_are_declared() -> None:
    assert set(kv_blocktable.__all__) <= set(dir(kv_blocktable))


def test_imports_nothing_above_itself() -> None:
    code = "import sys, kv_blocktable; print(' '.join(m for m in ('kvstack', 'kv_connectors') if m in sys.modules and m != 'kv_blocktable'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == ""
