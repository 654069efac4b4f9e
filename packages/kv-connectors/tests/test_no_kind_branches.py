"""Connectors read only the layout descriptor: no backend name, model kind or model family appears
in the package's code (identifiers and string literals; prose in comments and docstrings is free)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kv_connectors"
FORBIDDEN = re.compile(
    r"mla|flash|triton|flex|sdpa|xformers|flashinfer|deepseek|llama|qwen|mistral|gpt|gemma|"
    r"backend_name|attn_backend|model_type|architecture",
    re.IGNORECASE,
)


def _docstring_lines(source: str) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                doc = body[0]
                lines.update(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1))
    return lines


def offending_tokens(source: str) -> list[tuple[int, str]]:
    """``(line, token)`` of every identifier or string literal naming a backend or model kind."""
    docs = _docstring_lines(source)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.NAME, tokenize.STRING) or tok.start[0] in docs:
            continue
        if FORBIDDEN.search(tok.string):
            out.append((tok.start[0], tok.string))
    return out


def test_checker_catches_a_planted_branch() -> None:
    planted = 'def f(layout, backend):\n    """FLASH in prose is fine."""\n    if layout.is_mla or backend == "FLASH_ATTN":\n        return 1\n'
    assert [t for _, t in offending_tokens(planted)] == ["is_mla", '"FLASH_ATTN"']


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: p.name)
def test_no_connector_branches_on_a_backend_or_model_kind(path: Path) -> None:
    assert offending_tokens(path.read_text()) == []
