"""``kvstack demo`` (issue 27): it warms up before timing and says so, says its pool is small on
purpose, and ``--keep DIR`` leaves the model where ``kvstack generate DIR`` reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvstack import demo
from kvstack.cli import main
from rich.console import Console

pytestmark = pytest.mark.usefixtures("one_thread")


def test_keep_refuses_a_directory_with_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x").write_text("mine")
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["demo", "--keep", str(tmp_path)]))
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"--keep={str(tmp_path)!r} exists and is not an empty directory" in err
    assert (tmp_path / "x").read_text() == "mine"  # nothing written


def test_demo_keeps_its_model_for_generate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = tmp_path / "tiny-qwen3"
    console = Console(width=400, force_terminal=False)
    assert demo.run(console, memory=2**30, device="cpu", handoff=False, keep=keep) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (keep / "config.json").is_file() and (keep / "model.safetensors").is_file()
    # the timing excludes a warm-up pass, and the output says so
    assert "256 tokens," in out and "timed after an untimed warm-up run" in out
    # peak use 100% and preemptions are the point of the small pool, and it says so
    assert "the pool is small on purpose" in out and "expected with the small pool" in out
    assert f"next: kvstack generate {keep} --prompt-ids 1,2,3" in out
    code = main(["generate", str(keep), "--prompt-ids", "1,2,3", "--max-new-tokens", "3"])
    assert code == 0
    assert len(capsys.readouterr().out.split()) == 3
