"""Where a benchmark's numbers came from: package versions as installed and the git commit.

Every ``packages/*/benchmarks`` folder reaches this one file through its ``_provenance.py``
(a few lines that put ``tools/`` on ``sys.path``): a script run as ``python
packages/<pkg>/benchmarks/bench_x.py`` has only its own folder there, and the installed packages
are no place for benchmark bookkeeping (benchmarks run from a source checkout only).

``provenance()`` returns flat ``str``/``bool`` fields, ready to merge into a record::

    {"python": "3.12.3", "kv-spec": "0.2.0", ..., "torch": "2.11.0",
     "git_commit": "d62806e...", "git_dirty": True}

A package's version is ``importlib.metadata``'s (what is installed, editable workspace installs
included), else the module's ``__version__`` (a source tree on ``PYTHONPATH``), else
``"not installed"``. ``git_dirty`` says whether tracked files differed from the commit (the
numbers may come from uncommitted code); both git fields are ``None`` outside a git checkout.

A tree exported from a commit (``git archive <commit> packages tools | tar -x -C <dir>``, how
a session sends the committed code to the GPU machine) sits inside some other checkout, whose
git state is not its own: there ``git_commit`` is read from a ``COMMIT`` file at the tree's
root (``git rev-parse <commit> > <dir>/COMMIT``), ``git_dirty`` is ``False`` (an archive of a
commit is that commit) and ``exported`` is ``True``; without the file both git fields are
``None``.

``source_sha1`` is a digest of the code that ran, read from disk: every ``packages/*/src`` and
``packages/*/benchmarks`` Python file, by path and content. It names the code where git cannot:
a copy whose git metadata is older than its files (the GPU machine's copy of a working tree
keeps the session's first commit, marked dirty). ``python tools/bench_provenance.py`` prints it
for the checkout here, so a record can be matched to a commit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata as md
import platform
import re
import subprocess
from pathlib import Path

__all__ = [
    "WORKSPACE_PACKAGES",
    "exported_state",
    "git_state",
    "package_version",
    "provenance",
    "source_sha1",
]

#: distribution name -> import name of the workspace's packages, bottom layer first.
WORKSPACE_PACKAGES = {
    "kv-spec": "kv_spec",
    "kv-kernels": "kv_kernels",
    "kv-backends": "kv_backends",
    "kv-blocktable": "kv_blocktable",
    "kv-connectors": "kv_connectors",
    "kvstack": "kvstack",
}


def package_version(dist: str, module: str | None = None) -> str:
    """``dist``'s installed version, else ``module.__version__``, else ``"not installed"``."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        pass
    try:
        mod = importlib.import_module(module or dist.replace("-", "_"))
    except ImportError:
        return "not installed"
    return str(getattr(mod, "__version__", "unknown (no __version__)"))


@functools.cache
def git_state() -> dict[str, str | bool | None]:
    """``git_commit`` (full hash) and ``git_dirty`` of the checkout holding this file (an
    exported tree's: see the module docstring)."""
    here = Path(__file__).resolve().parent
    try:
        top = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--show-toplevel"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        top = None
    if top is None or Path(top).resolve() != here.parent:
        return exported_state(here.parent)
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
        status = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": bool(status.strip())}


def exported_state(root: Path) -> dict[str, str | bool | None]:
    """The git fields of a tree that is not its own checkout: its ``COMMIT`` file's hash."""
    marker = root / "COMMIT"
    commit = marker.read_text().strip() if marker.is_file() else ""
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):  # (no file, or not a hash: unknown)
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": False, "exported": True}


def source_sha1(root: Path | None = None) -> str:
    """sha1 over the workspace's source and benchmark Python files (sorted paths relative to
    ``root``, then each file's bytes): see the module docstring."""
    root = root or Path(__file__).resolve().parent.parent
    h = hashlib.sha1()
    files = sorted(
        p
        for pattern in ("packages/*/src/**/*.py", "packages/*/benchmarks/*.py")
        for p in root.glob(pattern)
        if "__pycache__" not in p.parts
    )
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _provenance(others: tuple[str, ...]) -> dict[str, str | bool | None]:
    out: dict[str, str | bool | None] = {"python": platform.python_version()}
    for dist, module in WORKSPACE_PACKAGES.items():
        out[dist] = package_version(dist, module)
    for dist in others:
        out[dist] = package_version(dist)
    out.update(git_state())
    out["source_sha1"] = source_sha1()
    return out


def provenance(*others: str) -> dict[str, str | bool | None]:
    """Python, the workspace packages' and ``others``' versions, and the git state (a fresh
    dict each call; computed once per process)."""
    return dict(_provenance(tuple(others)))


if __name__ == "__main__":
    print(source_sha1())
