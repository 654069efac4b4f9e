"""``tools/bench_provenance.source_sha1``: the digest of the code a benchmark ran."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "bench_provenance.py"
_spec = importlib.util.spec_from_file_location("bench_provenance", _PATH)
assert _spec is not None and _spec.loader is not None
prov = importlib.util.module_from_spec(_spec)
sys.modules["bench_provenance"] = prov
_spec.loader.exec_module(prov)


def _tree(root: Path, body: str) -> Path:
    for rel in ("packages/a/src/a/x.py", "packages/a/benchmarks/bench.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    (root / "packages/a/src/a/__pycache__").mkdir()
    (root / "packages/a/src/a/__pycache__/x.py").write_text("ignored")
    (root / "packages/a/README.py").write_text("outside src and benchmarks: ignored")
    return root


def test_source_sha1_names_the_files_and_their_bytes(tmp_path: Path) -> None:
    one = _tree(tmp_path / "one", "x = 1\n")
    two = _tree(tmp_path / "two", "x = 1\n")
    assert prov.source_sha1(one) == prov.source_sha1(two)  # (the root's path is no part)
    (two / "packages/a/src/a/x.py").write_text("x = 2\n")
    assert prov.source_sha1(two) != prov.source_sha1(one)
    before = prov.source_sha1(one)
    (one / "packages/a/README.py").write_text("changed")
    (one / "packages/a/src/a/__pycache__/x.py").write_text("changed")
    assert prov.source_sha1(one) == before


def test_provenance_carries_it() -> None:
    assert prov.provenance()["source_sha1"] == prov.source_sha1()


def _export(root: Path) -> Path:
    """A copy of this module at ``root/tools`` (an exported tree's layout)."""
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "bench_provenance.py").write_bytes(_PATH.read_bytes())
    return root


def _git_state_of(root: Path) -> dict[str, object]:
    import json
    import subprocess

    code = "import json, bench_provenance as b; print(json.dumps(b.git_state()))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root / "tools", capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_an_exported_tree_names_its_commit_file_not_the_enclosing_checkout(
    tmp_path: Path,
) -> None:
    import subprocess

    outer = tmp_path / "outer"  # a checkout with a commit of its own
    outer.mkdir()
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    inner = _export(outer / "clean")
    # no COMMIT file: unknown, never the enclosing checkout's commit
    assert _git_state_of(inner) == {"git_commit": None, "git_dirty": None}
    (inner / "COMMIT").write_text("not a commit\n")  # never reported as one
    assert _git_state_of(inner) == {"git_commit": None, "git_dirty": None}
    (inner / "COMMIT").write_text("abc1234\n")
    assert _git_state_of(inner) == {"git_commit": "abc1234", "git_dirty": False, "exported": True}
    assert _git_state_of(_export(tmp_path / "bare")) == {"git_commit": None, "git_dirty": None}
