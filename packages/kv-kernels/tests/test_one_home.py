"""Each rule has one home: a source scan that fails when a second copy appears (the implementation
resolver, the TRITON_INTERPRET rule, the custom-op layout JSON, scale checking), and one import
direction between the api modules and the custom-op registrations."""

from __future__ import annotations

import ast
import pathlib

import kv_kernels

SRC = pathlib.Path(kv_kernels.__file__).parent
HOME = SRC / "_common.py"


def _sources() -> dict[pathlib.Path, str]:
    return {p: p.read_text() for p in SRC.rglob("*.py")}


def test_rules_live_only_in_common() -> None:
    for path, text in _sources().items():
        if path == HOME:
            continue
        rel = path.relative_to(SRC)
        assert 'TRITON_INTERPRET", ' not in text and 'environ.get("TRITON_INTERPRET"' not in text, (
            f"{rel} reads TRITON_INTERPRET itself; use kv_kernels._common.triton_interpreting"
        )
        assert '"auto", "reference", "triton"' not in text, f"{rel} lists the impls again"
        assert 'f\'{{"order":' not in text and '\'{"order"' not in text, f"{rel} writes layout JSON"
        tree = ast.parse(text)
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not defined & {"_layout_json", "layout_json", "resolve_impl", "check_scale"}, (
            f"{rel} defines its own copy of {defined & {'_layout_json', 'layout_json', 'resolve_impl', 'check_scale'}}"
        )


def test_api_modules_never_import_the_registrations() -> None:
    for path, text in _sources().items():
        if path.name != "api.py":
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {a.name for a in node.names}
                assert node.module != "kv_kernels._ops" and not (
                    node.module == "kv_kernels" and "_ops" in names
                ), f"{path.relative_to(SRC)} imports kv_kernels._ops (an import cycle)"
