"""The README's toy scheduler loop runs as written: shared prefixes hit, memory comes back."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_loop() -> str:
    text = README.read_text()
    m = re.search(r"<!-- toy-scheduler -->\n```python\n(.*?)\n```", text, re.S)
    assert m, "README lost its toy-scheduler snippet"
    return m.group(1)


def test_readme_scheduler_loop() -> None:
    out = io.StringIO()
    scope: dict[str, object] = {}
    with contextlib.redirect_stdout(out):
        exec(compile(readme_loop(), str(README), "exec"), scope)  # its own asserts run too
    assert scope["finished"] and len(scope["finished"]) == 8  # type: ignore[arg-type]
    assert scope["hit_tokens"] >= 7 * 48  # type: ignore[operator]  # each later request hits the system prompt
    assert scope["preemptions"] > 0  # the pool is small on purpose: preemption is exercised
    mgr = scope["mgr"]
    assert mgr.usage == 0.0  # type: ignore[attr-defined]
    assert "requests finished" in out.getvalue()
