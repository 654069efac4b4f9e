"""The one command that adds an optional dependency, as the user can run it where they stand.

kvstack is not on PyPI: from a checkout of the workspace (the package imported from
``<root>/packages/kvstack/src`` of a tree whose ``pyproject.toml`` declares the uv workspace and the
dependency group), the command is ``uv run --group hf kvstack ...``; from an installed wheel it is
``pip install 'kvstack[hf]'``. Every hint kvstack prints comes from :func:`install_hint`.
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path

__all__ = ["OPTIONAL", "install_hint", "workspace_root"]

#: optional feature -> (distribution extra that adds it, root dependency group that adds it)
OPTIONAL: dict[str, tuple[str, str]] = {
    "hf": ("kvstack[hf]", "hf"),
    "nixl": ("kv-connectors[nixl]", "nixl"),
}


@functools.cache
def _workspace_groups(root: Path) -> frozenset[str]:
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return frozenset()
    if "workspace" not in data.get("tool", {}).get("uv", {}):
        return frozenset()
    return frozenset(data.get("dependency-groups", {}))


def workspace_root(package_file: str | Path | None = None) -> Path | None:
    """The root of the uv workspace kvstack is imported from (an editable checkout), or None.

    ``package_file`` is ``kvstack/__init__.py``'s path (tests pass another)."""
    if package_file is None:
        import kvstack

        package_file = kvstack.__file__
    pkg = Path(package_file).resolve().parent  # .../packages/kvstack/src/kvstack
    if len(pkg.parents) < 4 or pkg.parent.name != "src" or pkg.parents[2].name != "packages":
        return None
    root = pkg.parents[3]
    if not (pkg.parents[1] / "pyproject.toml").is_file() or not _workspace_groups(root):
        return None
    return root


def install_hint(feature: str, command: str = "kvstack ...", *, cwd: Path | None = None) -> str:
    """How to get ``feature`` (``"hf"``: transformers; ``"nixl"``: the NIXL transport).

    From a workspace checkout: ``uv run --group hf <command>`` (with ``--project ROOT`` when the
    current directory is outside the checkout); otherwise ``pip install 'kvstack[hf]'``."""
    extra, group = OPTIONAL[feature]
    root = workspace_root()
    if root is None or group not in _workspace_groups(root):
        return f"pip install '{extra}'"
    try:
        here = (cwd or Path.cwd()).resolve()
    except OSError:  # the working directory was removed
        here = Path("/")
    project = "" if here == root or root in here.parents else f" --project {root}"
    return f"uv run{project} --group {group} {command}"
