"""Unit tests of tools/generate_backend_docs.py on fixture packages (stdlib only, no torch)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent
REPO = TOOLS.parent
REAL_CAPS = REPO / "packages" / "kv-backends" / "src" / "kv_backends" / "capabilities.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "generate_backend_docs", TOOLS / "generate_backend_docs.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["generate_backend_docs"] = mod
    spec.loader.exec_module(mod)
    return mod


gen = _load_tool()

_REGISTRY = """
from typing import Final
BACKEND_CLASSES: Final[dict[str, str]] = {
    "ALPHA": "kv_backends.backends.alpha:AlphaBackend",
    "BETA": "kv_backends.backends.beta:BetaBackend",
}
BACKEND_PRIORITY: Final[dict[str, tuple[str, ...]]] = {"cpu": ("ALPHA",), "cuda": ("BETA", "ALPHA")}
"""

_ALPHA = """
from typing import ClassVar
from kv_backends.capabilities import BackendCapabilities

class Base:
    pass

class AlphaBackend(Base):
    NAME: ClassVar[str] = "ALPHA"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "bfloat16"),
        kv_cache_dtypes=("bfloat16",),
        head_size_rule=(16, 128, 8),
        kernel_block_sizes=(16, 32),
        sinks=True,
        cudagraph_support="always",
        min_compute_capability=(8, 0),
        notes="the alpha backend",
    )
"""

_BETA_INHERITS = """
from typing import ClassVar
from kv_backends.backends.alpha import AlphaBackend

class BetaBackend(AlphaBackend):
    NAME: ClassVar[str] = "BETA"
"""


def _make_src(
    tmp_path: Path,
    *,
    alpha: str = _ALPHA,
    beta: str = _BETA_INHERITS,
    extra: dict[str, str] | None = None,
) -> Path:
    src = tmp_path / "src"
    pkg = src / "kv_backends"
    (pkg / "backends").mkdir(parents=True)
    shutil.copy(REAL_CAPS, pkg / "capabilities.py")
    (pkg / "__init__.py").write_text("")
    (pkg / "backends" / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(textwrap.dedent(_REGISTRY))
    (pkg / "backends" / "alpha.py").write_text(textwrap.dedent(alpha))
    (pkg / "backends" / "beta.py").write_text(textwrap.dedent(beta))
    for name, text in (extra or {}).items():
        (pkg / "backends" / name).write_text(textwrap.dedent(text))
    return src


def test_good_fixture_renders_table_priority_and_header(tmp_path: Path) -> None:
    text = gen.generate(_make_src(tmp_path))
    assert text.startswith("<!-- GENERATED FILE: do not edit.")
    assert "| | `ALPHA` | `BETA` |" in text
    assert "| head sizes | 16–128, multiple of 8 | 16–128, multiple of 8 |" in text
    assert "| kernel block sizes | 16, 32 | 16, 32 |" in text
    assert "| attention sinks | yes | yes |" in text
    assert "| ALiBi | no | no |" in text  # a default of the dataclass
    assert "| compute capability | ≥ 8.0 | ≥ 8.0 |" in text
    assert "- **cuda**: `BETA` → `ALPHA`" in text
    assert "FlashAttention version rules" not in text  # no module defines FA_VERSIONS


def test_inheritance_is_followed_and_reported(tmp_path: Path) -> None:
    backends, _ = gen.read_backends(_make_src(tmp_path))
    beta = next(b for b in backends if b.name == "BETA")
    assert beta.declared_in == "AlphaBackend"
    assert beta.capabilities["notes"] == "the alpha backend"
    text = gen.generate(_make_src(tmp_path / "again"))
    assert "`BETA` (`BetaBackend` (capabilities inherited from `AlphaBackend`))" in text


def test_own_capabilities_override_the_base(tmp_path: Path) -> None:
    beta = """
    from kv_backends.backends.alpha import AlphaBackend
    from kv_backends.capabilities import BackendCapabilities

    class BetaBackend(AlphaBackend):
        NAME = "BETA"
        CAPABILITIES = BackendCapabilities(
            dtypes=("float16",), kv_cache_dtypes=("float16",), head_sizes=(64, 128)
        )
    """
    backends, _ = gen.read_backends(_make_src(tmp_path, beta=beta))
    b = next(b for b in backends if b.name == "BETA")
    assert b.capabilities["head_sizes"] == (64, 128)
    assert b.declared_in == "BetaBackend"
    assert b.capabilities["sinks"] is False  # the dataclass default, not the base's True


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        ('cudagraph_support="always"', "cudagraph_support: 'SOME_LEVEL' is not a literal"),
        ("sinks=True", "unknown field 'sink'"),
        ('dtypes=("float32", "bfloat16"),', "required field 'dtypes' is missing"),
    ],
)
def test_unparsable_capability_is_a_loud_error(tmp_path: Path, replace: str, message: str) -> None:
    bad = {
        'cudagraph_support="always"': "cudagraph_support=SOME_LEVEL",
        "sinks=True": "sink=True",
        'dtypes=("float32", "bfloat16"),': "",
    }[replace]
    src = _make_src(tmp_path, alpha=_ALPHA.replace(replace, bad))
    with pytest.raises(
        gen.DocsError, match=message.replace("(", r"\(").replace(")", r"\)")
    ) as info:
        gen.generate(src)
    assert "alpha.py" in str(info.value)  # the error names the file


def test_capabilities_that_are_not_one_call_are_rejected(tmp_path: Path) -> None:
    alpha = _ALPHA.replace(
        "CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(",
        "CAPABILITIES = make_caps(",
    )
    with pytest.raises(gen.DocsError, match="must be one BackendCapabilities"):
        gen.generate(_make_src(tmp_path, alpha=alpha))


def test_missing_class_and_wrong_name_are_errors(tmp_path: Path) -> None:
    with pytest.raises(gen.DocsError, match="'BetaBackend' is not defined"):
        gen.generate(_make_src(tmp_path, beta="x = 1\n"))
    wrong = _BETA_INHERITS.replace('NAME: ClassVar[str] = "BETA"', 'NAME: ClassVar[str] = "GAMMA"')
    with pytest.raises(gen.DocsError, match="registry calls it 'BETA'"):
        gen.generate(_make_src(tmp_path / "b", beta=wrong))


def test_check_mode_reports_stale_file_with_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _make_src(tmp_path)
    out = tmp_path / "docs" / "backends.md"
    assert gen.main(["--src", str(src), "--output", str(out), "--check"]) == 1  # missing file
    assert gen.main(["--src", str(src), "--output", str(out)]) == 0
    assert gen.main(["--src", str(src), "--output", str(out), "--check"]) == 0
    # Change a capability: the checked-in file is now stale and the diff shows the row.
    alpha = src / "kv_backends" / "backends" / "alpha.py"
    alpha.write_text(alpha.read_text().replace("sinks=True", "sinks=False"))
    capsys.readouterr()
    assert gen.main(["--src", str(src), "--output", str(out), "--check"]) == 1
    diff = capsys.readouterr().out
    assert "-| attention sinks | yes | yes |" in diff
    assert "+| attention sinks | no | no |" in diff


def test_parse_error_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _make_src(tmp_path, alpha="def broken(:\n")
    assert gen.main(["--src", str(src), "--output", str(tmp_path / "x.md")]) == 2
    assert "cannot parse" in capsys.readouterr().err


def test_version_rules_are_rendered_from_the_capabilities(tmp_path: Path) -> None:
    rules = """version_rules={
            "title": "Widget version rules",
            "label": "W{}",
            "config_field": "widget_version",
            "versions": {2: {"module": "widget", "min_compute_capability": (8, 0), "sinks": False},
                         4: {"module": "widget.cute", "min_compute_capability": (9, 0), "sinks": True}},
            "preferred": ((10, 4), (0, 2)),
            "upgrades": ({"on_major": 9, "from_version": 2, "to_version": 4, "when": "big"},),
            "conditions": {"big": "the head is big"},
            "fallback_order": (4, 2),
        },
        notes="the alpha backend","""
    alpha = _ALPHA.replace('notes="the alpha backend",', rules)
    text = gen.generate(_make_src(tmp_path, alpha=alpha))
    assert "## Widget version rules (`ALPHA`)" in text
    assert "## Widget version rules (`BETA`)" in text  # inherited with the literal
    assert "| module | `widget` | `widget.cute` |" in text
    assert "| sinks | no | yes |" in text
    assert "- on compute capability 9.x, W2 → W4 when the head is big" in text
    assert "in the order W4 → W2 that" in text
    assert "`AttentionConfig.widget_version` forces a version" in text
    # A condition without its text is a loud error.
    bad = alpha.replace('"conditions": {"big": "the head is big"}', '"conditions": {}')
    with pytest.raises(gen.DocsError, match="condition 'big'"):
        gen.generate(_make_src(tmp_path / "bad", alpha=bad))


def test_the_tool_names_no_backend() -> None:
    """A new backend needs no change in the tool: no registry name appears in its source."""
    import ast

    registry = REPO / "packages" / "kv-backends" / "src" / "kv_backends" / "registry.py"
    tree = ast.parse(registry.read_text())
    names: list[str] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.AnnAssign) and ast.unparse(stmt.target) == "BACKEND_CLASSES":
            names = list(ast.literal_eval(stmt.value))
    assert names, "BACKEND_CLASSES not found"
    tool = (TOOLS / "generate_backend_docs.py").read_text()
    for name in [*names, "FA_VERSIONS", "flash_attn", "FlashAttention"]:
        assert name not in tool, f"tools/generate_backend_docs.py mentions {name!r}"


def test_checked_in_docs_are_current() -> None:
    # The same check CI's docs-check session runs, so a plain test run catches drift too.
    assert gen.generate() == (REPO / "docs" / "attention_backends.md").read_text()
