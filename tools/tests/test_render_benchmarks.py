"""tools/render_benchmarks.py: a folder renders its lists of records and skips other scripts'
JSON; a file named on the command line must be a list of records."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "render_benchmarks", TOOLS / "render_benchmarks.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["render_benchmarks"] = mod
    spec.loader.exec_module(mod)
    return mod


render = _load_tool()

RECORD = {
    "bench": "b", "case": "c1", "impl": "triton", "ms": 0.5, "metric": "TB/s", "value": 3.0,
    "baseline": "copy", "baseline_value": 4.0, "ratio": 0.75, "device": "H200",
}  # fmt: skip


def test_folder_renders_lists_and_skips_other_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.json").write_text(json.dumps([RECORD]))
    (tmp_path / "own.json").write_text(json.dumps({"runs": {}}))
    assert render.main([str(tmp_path)]) == 0
    md = (tmp_path / "a.md").read_text()
    assert "measured on H200" in md and "| c1 | triton |" in md
    assert not (tmp_path / "own.md").exists()
    assert "skipped" in capsys.readouterr().err


def test_named_file_renders_only_it_and_must_be_a_list(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([RECORD]))
    (tmp_path / "b.json").write_text(json.dumps([RECORD]))
    assert render.main([str(tmp_path / "a.json")]) == 0
    assert (tmp_path / "a.md").exists() and not (tmp_path / "b.md").exists()
    (tmp_path / "own.json").write_text(json.dumps({"runs": {}}))
    with pytest.raises(ValueError, match="must hold a list of records"):
        render.main([str(tmp_path / "own.json")])
