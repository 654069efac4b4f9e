"""Every ```python block of every README runs as written (issue 27).

READMEs: the root ``README.md`` and ``packages/*/README.md``. A block runs in a fresh namespace,
in an empty temporary directory (a block that needs a checkpoint writes one itself, e.g. with
``kvstack.engine.testing.write_checkpoint`` or ``make_text_checkpoint``). A block that is meant to
be read, not run (a fragment, two-column pseudo-code), is marked by an HTML comment on the line
before its fence::

    <!-- sketch: why it does not run -->

and is skipped by name. Blocks run in this process (torch is already imported): the whole file
takes seconds. kvstack's test env has every package, so this file lives here; ``nox -s
"tests(kvstack)"`` collects it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[3]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_SKETCH = re.compile(r"<!--\s*sketch\b:?\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    name: str  # "packages/kv-spec/README.md:6" (the fence's line)
    source: str
    sketch: str | None  # why it is not run, or None


def parse_blocks(text: str, where: str) -> list[Block]:
    """The ```python blocks of a README's ``text``, named ``where:line``."""
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = [ln for ln in text[: m.start()].splitlines() if ln.strip()]
        marker = _SKETCH.fullmatch(before[-1].strip()) if before else None
        sketch = (marker.group(1) or "sketch") if marker else None
        out.append(Block(f"{where}:{line}", m.group(1), sketch))
    return out


BLOCKS = [b for r in READMES for b in parse_blocks(r.read_text(), str(r.relative_to(ROOT)))]


def test_the_readmes_are_found() -> None:
    assert (ROOT / "pyproject.toml").is_file() and len(READMES) >= 7
    # every block this test cannot see (```py, ```python3) would silently escape it
    for r in READMES:
        assert not re.search(r"^```(py|python3|pycon)\s*$", r.read_text(), re.M), r


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_python_block_runs_as_written(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block.sketch is not None:
        pytest.skip(f"{block.name} is a sketch: {block.sketch}")
    monkeypatch.chdir(tmp_path)
    code = compile(block.source, block.name, "exec")
    exec(code, {"__name__": "__readme__"})


def test_sketch_marker_is_read() -> None:
    text = "x\n\n<!-- sketch: a fragment -->\n```python\nq\n```\n\n```python\nprint(1)\n```\n"
    blocks = parse_blocks(text, "t")
    assert [(b.name, b.source, b.sketch) for b in blocks] == [
        ("t:4", "q\n", "a fragment"),
        ("t:8", "print(1)\n", None),
    ]
