"""tools/bench_provenance.py from this folder (a script has only its own folder on sys.path)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
from bench_provenance import WORKSPACE_PACKAGES, git_state, package_version, provenance

__all__ = ["WORKSPACE_PACKAGES", "git_state", "package_version", "provenance"]
