#!/usr/bin/env python3
"""Generate ``docs/attention_backends.md`` from the backends' ``CAPABILITIES`` literals.

Stdlib only: the sources are read with ``ast`` (never imported), so this runs without torch. It reads

- ``kv_backends/capabilities.py``: the ``BackendCapabilities`` fields, their order and defaults;
- ``kv_backends/registry.py``: ``BACKEND_CLASSES`` (name -> ``"module:Class"``) and
  ``BACKEND_PRIORITY`` (platform -> names in selection order);
- every backend class named there, its ``NAME`` and its ``CAPABILITIES = BackendCapabilities(...)``
  literal, following base classes (in any module under the package) when a class declares none,
  including its ``version_rules`` (how a multi-version backend picks a version), rendered as a
  section of their own.

The tool names no backend: a new backend (or a new multi-version one) needs no change here.

Anything it cannot parse (a capability that is not a literal, an unknown field, a class it cannot
find) is an error naming the file, line and field: it never guesses.

Usage::

    python tools/generate_backend_docs.py            # (re)write docs/attention_backends.md
    python tools/generate_backend_docs.py --check    # exit 1 with a unified diff when stale
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DocsError", "generate", "main", "read_backends"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SRC = ROOT / "packages" / "kv-backends" / "src"
DEFAULT_OUTPUT = ROOT / "docs" / "attention_backends.md"
PACKAGE = "kv_backends"
_REQUIRED = object()
_NOT_IN_TABLE = ("notes", "version_rules")


class DocsError(Exception):
    """Something in the sources cannot be read as data."""


@dataclass
class _Class:
    name: str
    module: str
    path: Path
    node: ast.ClassDef
    bases: list[str]
    attrs: dict[str, ast.expr] = field(default_factory=dict)


@dataclass
class Backend:
    name: str
    class_name: str
    capabilities: dict[str, Any]
    declared_in: str  # class that holds the CAPABILITIES literal


def _parse(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError) as e:
        raise DocsError(f"{path}: cannot parse: {e}") from e


def _literal(node: ast.expr, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError) as e:
        raise DocsError(
            f"{where}: {ast.unparse(node)!r} is not a literal (only str, int, float, bool, None and "
            f"tuples/lists/dicts of those are allowed)"
        ) from e


def _module_assigns(tree: ast.Module) -> dict[str, ast.expr]:
    out: dict[str, ast.expr] = {}
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            out[stmt.targets[0].id] = stmt.value
        elif (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.value is not None
        ):
            out[stmt.target.id] = stmt.value
    return out


def _class_attrs(node: ast.ClassDef) -> dict[str, ast.expr]:
    out: dict[str, ast.expr] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = stmt.value
        elif (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.value is not None
        ):
            out[stmt.target.id] = stmt.value
    return out


def _capability_fields(src: Path) -> dict[str, Any]:
    """Field name -> default (``_REQUIRED`` when none), in declaration order."""
    path = src / PACKAGE / "capabilities.py"
    tree = _parse(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "BackendCapabilities":
            fields: dict[str, Any] = {}
            module_consts = _module_assigns(tree)
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    ann = ast.unparse(stmt.annotation)
                    if ann.startswith("ClassVar"):
                        continue
                    where = f"{path}:{stmt.lineno}: BackendCapabilities.{stmt.target.id} default"
                    if stmt.value is None:
                        fields[stmt.target.id] = _REQUIRED
                    else:
                        fields[stmt.target.id] = _default_value(stmt.value, module_consts, where)
            if not fields:
                raise DocsError(f"{path}: BackendCapabilities declares no fields")
            return fields
    raise DocsError(f"{path}: no class BackendCapabilities")


def _default_value(node: ast.expr, module_consts: dict[str, ast.expr], where: str) -> Any:
    """A field default: a literal, a module-level literal's name (e.g. the tuple of all orders),
    or ``field(default=<one of those>, ...)``."""
    if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "field":
        default = next((kw.value for kw in node.keywords if kw.arg == "default"), None)
        if default is None:
            raise DocsError(f"{where}: field(...) without default= cannot be read")
        node = default
    if isinstance(node, ast.Name) and node.id in module_consts:
        return _literal(module_consts[node.id], where)
    return _literal(node, where)


def _module_path(src: Path, module: str) -> Path:
    parts = module.split(".")
    base = src.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    raise DocsError(f"module {module!r} not found under {src} (looked for {base}.py)")


def _all_classes(src: Path) -> dict[str, list[_Class]]:
    """Every class under the package, by name (a name may be defined in several modules)."""
    out: dict[str, list[_Class]] = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        tree = _parse(path)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                cls = _Class(node.name, module, path, node, bases, _class_attrs(node))
                out.setdefault(node.name, []).append(cls)
    return out


def _capabilities_literal(cls: _Class, fields: dict[str, Any]) -> dict[str, Any]:
    node = cls.attrs["CAPABILITIES"]
    where = f"{cls.path}:{node.lineno}: {cls.name}.CAPABILITIES"
    if not (
        isinstance(node, ast.Call)
        and ast.unparse(node.func).split(".")[-1] == "BackendCapabilities"
    ):
        raise DocsError(
            f"{where} must be one BackendCapabilities(...) call; got {ast.unparse(node)!r}"
        )
    if node.args:
        raise DocsError(f"{where} must use keyword arguments only")
    values: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise DocsError(f"{where}: **kwargs cannot be read; spell every field out")
        if kw.arg not in fields:
            raise DocsError(
                f"{where}: unknown field {kw.arg!r}; BackendCapabilities has {list(fields)}"
            )
        values[kw.arg] = _literal(kw.value, f"{where}.{kw.arg}")
    out: dict[str, Any] = {}
    for name, default in fields.items():
        if name in values:
            out[name] = values[name]
        elif default is _REQUIRED:
            raise DocsError(f"{where}: required field {name!r} is missing")
        else:
            out[name] = default
    return out


def _resolve(classes: dict[str, list[_Class]], name: str, hint_module: str | None = None) -> _Class:
    found = classes.get(name, [])
    if hint_module is not None:
        found = [c for c in found if c.module == hint_module] or found
    if not found:
        raise DocsError(f"class {name!r} is not defined anywhere under {PACKAGE}")
    if len(found) > 1:
        raise DocsError(
            f"class {name!r} is defined in several modules ({[c.module for c in found]}); "
            "the docs tool cannot tell which base is meant"
        )
    return found[0]


def _lookup_attr(classes: dict[str, list[_Class]], cls: _Class, attr: str) -> _Class | None:
    """The class in ``cls``'s base chain (depth first, left to right) that declares ``attr``."""
    seen: set[str] = set()
    stack = [cls]
    while stack:
        c = stack.pop(0)
        if c.name in seen:
            continue
        seen.add(c.name)
        if attr in c.attrs:
            return c
        for base in c.bases:
            if base in ("object", "Generic", "Protocol"):
                continue
            if base in classes:
                stack.append(_resolve(classes, base))
    return None


def read_backends(src: Path) -> tuple[list[Backend], dict[str, tuple[str, ...]]]:
    """Backends (registry order) and priority lists read from the sources under ``src``."""
    fields = _capability_fields(src)
    reg_path = src / PACKAGE / "registry.py"
    reg = _module_assigns(_parse(reg_path))
    for name in ("BACKEND_CLASSES", "BACKEND_PRIORITY"):
        if name not in reg:
            raise DocsError(f"{reg_path}: no module-level {name}")
    backend_classes = _literal(reg["BACKEND_CLASSES"], f"{reg_path}: BACKEND_CLASSES")
    priority = _literal(reg["BACKEND_PRIORITY"], f"{reg_path}: BACKEND_PRIORITY")
    if not isinstance(backend_classes, dict) or not isinstance(priority, dict):
        raise DocsError(f"{reg_path}: BACKEND_CLASSES and BACKEND_PRIORITY must be dicts")
    classes = _all_classes(src)
    backends: list[Backend] = []
    for name, target in backend_classes.items():
        module, _, cls_name = str(target).partition(":")
        if not cls_name:
            raise DocsError(
                f"{reg_path}: BACKEND_CLASSES[{name!r}]={target!r} must be 'module:Class'"
            )
        _module_path(src, module)
        cls = _resolve(classes, cls_name, hint_module=module)
        holder = _lookup_attr(classes, cls, "CAPABILITIES")
        if holder is None:
            raise DocsError(
                f"{cls.path}: {cls_name} (backend {name}) has no CAPABILITIES, nor does any base"
            )
        caps = _capabilities_literal(holder, fields)
        name_holder = _lookup_attr(classes, cls, "NAME")
        if name_holder is None or name_holder is not cls:
            raise DocsError(f"{cls.path}: {cls_name} must declare its own NAME = {name!r}")
        declared = _literal(cls.attrs["NAME"], f"{cls.path}: {cls_name}.NAME")
        if declared != name:
            raise DocsError(
                f"{cls.path}: {cls_name}.NAME={declared!r} but the registry calls it {name!r}"
            )
        backends.append(Backend(name, cls_name, caps, holder.name))
    for plat, names in priority.items():
        unknown = [n for n in names if n not in backend_classes]
        if unknown:
            raise DocsError(
                f"{reg_path}: BACKEND_PRIORITY[{plat!r}] names unknown backends {unknown}"
            )
    return backends, {k: tuple(v) for k, v in priority.items()}


# -- rendering --------------------------------------------------------------------------------


def _cc(v: Any) -> str:
    return "—" if v is None else f"{v[0]}.{v[1]}"


def _fmt(name: str, caps: dict[str, Any]) -> str:
    v = caps.get(name)
    if name == "head_sizes":
        if caps["head_sizes"] is not None:
            return ", ".join(map(str, caps["head_sizes"]))
        lo, hi, mult = caps["head_size_rule"]
        return f"{lo}–{hi}" + (f", multiple of {mult}" if mult > 1 else "")
    if name == "kernel_block_sizes":
        parts = []
        if caps["kernel_block_sizes"] is not None:
            parts.append(", ".join(map(str, caps["kernel_block_sizes"])))
        m = caps["kernel_block_size_multiple_of"]
        if m is not None and m > 1:
            parts.append(f"multiple of {m}")
        return "; ".join(parts) if parts else "any"
    if name == "compute_capability":
        lo, hi = caps["min_compute_capability"], caps["max_compute_capability"]
        if lo is None and hi is None:
            return "any"
        return f"{_cc(lo)} – {_cc(hi)}" if hi is not None else f"≥ {_cc(lo)}"
    if name == "head_size_v_diff":
        if caps["requires_head_size_v_diff"]:
            return "only"
        return "yes" if caps["supports_head_size_v_diff"] else "no"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v is None:
        return "—"
    if isinstance(v, tuple | list):
        return ", ".join(map(str, v))
    return str(v).replace("|", "\\|")


_ROWS = (
    ("dtypes", "compute dtypes"),
    ("kv_cache_dtypes", "KV-cache dtypes"),
    ("kv_quant_modes", "KV quantization"),
    ("head_sizes", "head sizes"),
    ("head_size_v_diff", "head_size_v ≠ head_size"),
    ("kernel_block_sizes", "kernel block sizes"),
    ("supported_layouts", "layout orders"),
    ("required_layout", "required layout"),
    ("sinks", "attention sinks"),
    ("sliding_window", "sliding window"),
    ("softcap", "logit softcap"),
    ("alibi", "ALiBi"),
    ("mla", "MLA"),
    ("non_causal", "non-causal"),
    ("batch_invariant", "batch-invariant"),
    ("cudagraph_support", "CUDA graphs"),
    ("compute_capability", "compute capability"),
    ("needs_gpu", "needs a GPU"),
)


#: Which capability fields each table row shows; a field in none of them is an error, so a new
#: capability cannot silently miss the docs.
_ROW_FIELDS = {
    "head_sizes": ("head_sizes", "head_size_rule"),
    "head_size_v_diff": ("supports_head_size_v_diff", "requires_head_size_v_diff"),
    "kernel_block_sizes": ("kernel_block_sizes", "kernel_block_size_multiple_of"),
    "compute_capability": ("min_compute_capability", "max_compute_capability"),
}


def _check_rows_cover(fields: list[str]) -> None:
    shown = {f for key, _ in _ROWS for f in _ROW_FIELDS.get(key, (key,))} | set(_NOT_IN_TABLE)
    missing = [f for f in fields if f not in shown]
    if missing:
        raise DocsError(
            f"BackendCapabilities fields {missing} have no row in the docs table; add them to "
            "_ROWS in tools/generate_backend_docs.py"
        )
    unknown = sorted(shown - set(fields))
    if unknown:
        raise DocsError(
            f"the docs table shows fields {unknown} that BackendCapabilities does not have"
        )


def _cell(key: str, val: Any) -> str:
    if key.endswith("compute_capability"):
        return _cc(val)
    if isinstance(val, bool):
        return "yes" if val else "no"
    if val is None:
        return "—"
    return f"`{val}`" if key == "module" else str(val)


def _render_version_rules(b: Backend) -> list[str]:
    """The ``version_rules`` of one backend, rendered from the data alone."""
    rules = b.capabilities["version_rules"]
    where = f"{b.class_name}.CAPABILITIES.version_rules"
    keys_needed = ("title", "label", "config_field", "versions", "preferred", "upgrades")
    missing = [k for k in (*keys_needed, "conditions", "fallback_order") if k not in rules]
    if missing:
        raise DocsError(f"{where} lacks keys {missing}")
    label = str(rules["label"])
    versions = rules["versions"]
    out = ["", f"## {rules['title']} (`{b.name}`)", ""]
    keys: list[str] = []
    for feats in versions.values():
        keys += [k for k in feats if k not in keys]
    out.append("| | " + " | ".join(label.format(v) for v in versions) + " |")
    out.append("|---|" + "---|" * len(versions))
    for k in keys:
        cells = [_cell(k, feats.get(k)) for feats in versions.values()]
        out.append(f"| {k.replace('_', ' ')} | " + " | ".join(cells) + " |")
    out += ["", "Preferred version by compute capability (first row the device meets):", ""]
    out += [f"- major ≥ {major}: {label.format(v)}" for major, v in rules["preferred"]]
    out += ["", "Upgrades of the preference:", ""]
    for rule in rules["upgrades"]:
        cond = rules["conditions"].get(rule["when"])
        if cond is None:
            raise DocsError(
                f"{where}: upgrade names condition {rule['when']!r} that 'conditions' does not explain"
            )
        out.append(
            f"- on compute capability {rule['on_major']}.x, {label.format(rule['from_version'])} → "
            f"{label.format(rule['to_version'])} when {cond}"
        )
    order = " → ".join(label.format(v) for v in rules["fallback_order"])
    out += [
        "",
        "When the preferred version is not installed or cannot serve the layer, the next version",
        f"in the order {order} that is installed and can serve it is used, and the selection says",
        f"so. `AttentionConfig.{rules['config_field']}` forces a version; it is validated like the rest.",
    ]
    return out


def generate(src: Path = DEFAULT_SRC) -> str:
    """The whole markdown document."""
    backends, priority = read_backends(src)
    _check_rows_cover(list(_capability_fields(src)))
    out: list[str] = [
        "<!-- GENERATED FILE: do not edit. Written by tools/generate_backend_docs.py from the",
        "     CAPABILITIES literals of packages/kv-backends; regenerate with",
        "     `python tools/generate_backend_docs.py` (CI runs it with --check). -->",
        "",
        "# Attention backends",
        "",
        "Each backend declares what it serves as one `BackendCapabilities` literal; the selector",
        "(`kv_backends.select_backend`) validates a layer against the same object and reports every",
        "reason a backend was passed over.",
        "",
        "## Features",
        "",
        "| | " + " | ".join(f"`{b.name}`" for b in backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for key, label in _ROWS:
        out.append(f"| {label} | " + " | ".join(_fmt(key, b.capabilities) for b in backends) + " |")
    out += ["", "### Notes", ""]
    for b in backends:
        inherited = (
            ""
            if b.declared_in == b.class_name
            else f" (capabilities inherited from `{b.declared_in}`)"
        )
        note = b.capabilities.get("notes") or ""
        out.append(f"- `{b.name}` (`{b.class_name}`{inherited}): {note}".rstrip())
    out += ["", "## Selection order per platform", ""]
    out.append("The selector tries these in order and takes the first that validates.")
    out.append("")
    for plat, names in priority.items():
        out.append(f"- **{plat}**: " + " → ".join(f"`{n}`" for n in names))
    for b in backends:
        if b.capabilities.get("version_rules"):
            out += _render_version_rules(b)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 with a diff when the file is stale"
    )
    parser.add_argument(
        "--src", type=Path, default=DEFAULT_SRC, help="the kv-backends src/ directory"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the markdown file")
    args = parser.parse_args(argv)
    try:
        text = generate(args.src)
    except DocsError as e:
        print(f"generate_backend_docs: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current == text:
            print(f"{args.output} is up to date")
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=f"{args.output} (checked in)",
            tofile=f"{args.output} (generated)",
        )
        sys.stdout.writelines(diff)
        print(
            f"\n{args.output} is stale: run `python tools/generate_backend_docs.py` and commit it",
            file=sys.stderr,
        )
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
