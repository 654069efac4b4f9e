"""``benchmarks/bench_blocktable.py`` end to end at toy sizes (issue 27): ``--out`` is a folder,
a missing xxhash or matplotlib is skipped and said (never claimed), the vLLM side's absence is
said with its reason, and the record carries versions and the git commit."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = {
    "num_blocks": 256, "batch": 4, "alloc_iters": 20, "repeats": 1, "hash_blocks": 4,
    "hash_iters": 1, "num_reqs": 4, "prompt_len": 40, "decode_chunk": 2, "max_model_len": 256,
}  # fmt: skip


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its siblings by plain name
    mod = importlib.import_module("bench_blocktable")
    monkeypatch.setattr(mod, "PARAMS", dict(TINY))
    return mod


def _run(bench: ModuleType, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    bench.main(["--out", str(out), "--vllm-python", str(out / "no-such-python")])
    text = capsys.readouterr().out
    return json.loads((out / "blocktable.json").read_text()), text


def test_out_is_a_folder_and_every_file_claimed_exists(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "res"
    record, text = _run(bench, out, capsys)
    assert sorted(p.name for p in out.iterdir()) == [
        "blocktable.json", "blocktable.md", "blocktable.png",
    ]  # fmt: skip
    assert not (tmp_path / "res.json").exists()  # --out used to be a file stem
    wrote = next(ln for ln in text.splitlines() if ln.startswith("wrote "))
    for name in wrote.removeprefix("wrote ").split(", "):
        assert Path(name).exists(), name
    assert "vLLM side skipped: no vLLM interpreter at" in text
    assert "vLLM side skipped: no vLLM interpreter" in (out / "blocktable.md").read_text()
    prov = record["provenance"]
    assert prov["kv-blocktable"] != "not installed" and len(prov["git_commit"]) == 40
    assert isinstance(prov["git_dirty"], bool)


def test_without_xxhash_and_matplotlib_it_says_so_and_claims_nothing(
    bench: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash now fails
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "res"
    record, text = _run(bench, out, capsys)
    assert sorted(p.name for p in out.iterdir()) == ["blocktable.json", "blocktable.md"]
    assert "matplotlib is not installed" in text and "blocktable.png not written" in text
    wrote = next(ln for ln in text.splitlines() if ln.startswith("wrote "))
    assert ".png" not in wrote
    assert "xxhash is not installed" in text and "uv sync --group xxhash" in text
    assert "xxhash is not installed" in record["ours"]["hash_xxhash128"]["skipped"]
    assert [r["key"] for r in record["rows"]][:3] == [
        "alloc_free_nocache", "alloc_free_cache", "hash_sha256",
    ]  # fmt: skip
    assert record["ours"]["hash_sha256"]["blocks_per_s"] > 0
