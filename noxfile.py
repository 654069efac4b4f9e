"""kvstack's checks. `uvx nox` runs every session a change must pass on a CPU machine.

Sessions install from the committed lock (`uv sync --locked`) into the session's own venv, so a
green run means the lock is current and each package's declared dependencies are enough.
GPU and benchmark sessions are `default=False`: run them on a GPU machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
# Bottom to top: the layer order of the house.
PACKAGES = ("kv-spec", "kv-kernels", "kv-backends", "kv-blocktable", "kv-connectors", "kvstack")
IMPORT_NAMES = {p: p.replace("-", "_") for p in PACKAGES}
# Extras a package's tests need (kv-blocktable's block tables are its `torch` extra).
TEST_EXTRAS = {"kv-blocktable": ("torch",)}
# Extras that `isolated` leaves out: modules needing them are not imported there, and the package
# must install and import without them (a scheduler installs kv-blocktable without torch).
EXTRA_MODULES = {
    "kv-blocktable": (
        "kv_blocktable.block_table",
        "kv_blocktable.attn_metadata",
        "kv_blocktable._block_ids",
        "kv_blocktable._table_exports",
        "kv_blocktable._kernel_exports",
        "kv_blocktable._table_commit",
        "kv_blocktable._host_decode",
    )
}
# Dependency groups a package's tests need beyond `test` (optional extras that install on a CPU).
TEST_GROUPS = {
    "kv-blocktable": ("xxhash",),
    "kv-connectors": ("nixl", "blocktable"),
    "kvstack": ("nixl", "hf"),
}


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into this session's venv (fails if the lock is stale)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _workers() -> str:
    """Test processes a CPU session runs (pytest-xdist's ``-n``): one a core up to 4 (CI's
    machine has 2); ``KVSTACK_TEST_WORKERS`` overrides it, ``0`` runs the tests in-process."""
    workers = os.environ.get("KVSTACK_TEST_WORKERS", str(min(4, os.cpu_count() or 1)))
    if not workers.isdigit():
        raise ValueError(f"KVSTACK_TEST_WORKERS={workers!r} must be a count (0: in-process)")
    return workers


def _per_package() -> list[object]:
    """One parameter per package, tagged with its name (`nox -t kv-backends`)."""
    return [nox.param(p, id=p, tags=[p]) for p in PACKAGES]


def _pytest(session: nox.Session, package: str, marks: str, **kw: object) -> None:
    """A package's tests selected by ``marks``, in an env with only that package, its
    dependencies and the test groups it needs."""
    extra = [a for g in TEST_GROUPS.get(package, ()) for a in ("--group", g)]
    extra += [a for e in TEST_EXTRAS.get(package, ()) for a in ("--extra", e)]
    _sync(session, "--package", package, "--group", "test", *extra)
    # --dist loadfile: a module's tests share a process (its fixtures, e.g. a compiled kernel,
    # are built once)
    session.run(
        "python", "-m", "pytest", f"packages/{package}/tests", "-m", marks, "-q",
        "-n", _workers(), "--dist", "loadfile", *session.posargs, **kw,
    )  # fmt: skip


@nox.session(tags=["tests"])
@nox.parametrize("package", _per_package())
def tests(session: nox.Session, package: str) -> None:
    """A package's CPU tests (the default run: CI-sized; ``slow`` has the longer ones)."""
    _pytest(session, package, "not gpu and not slow")


@nox.session(default=False, tags=["slow"])
@nox.parametrize("package", _per_package())
def slow(session: nox.Session, package: str) -> None:
    """The tests marked slow (larger matrices and longer property runs than CI's default run,
    whose CI-sized cases stay in ``tests``); KVSTACK_HYPOTHESIS_EXAMPLES lengthens the property
    runs further."""
    _pytest(session, package, "slow and not gpu", success_codes=[0, 5])  # 5: none marked


@nox.session(tags=["tests"])
def tools(session: nox.Session) -> None:
    """Unit tests of the maintainer tools (stdlib only)."""
    _sync(session, "--group", "test")
    session.run("python", "-m", "pytest", "tools/tests", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    _sync(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy: strict for kv_spec, the default rules for the packages above it."""
    _sync(session, "--all-packages", "--group", "typecheck")
    # One cache for every run: each benchmarks folder is its own run, and without it each one
    # analysed torch anew (40 s a folder on CI's machine, 2 s with the shared cache).
    cache = ("--cache-dir", str(ROOT / ".mypy_cache"))
    session.run("mypy", *cache, "--strict", "packages/kv-spec/src/kv_spec")
    session.run(
        "mypy",
        *cache,
        *(f"packages/{p}/src/{IMPORT_NAMES[p]}" for p in PACKAGES[1:]),
    )
    # The benchmark scripts import their siblings by plain name (`from _timing import gpu_ms`), so
    # each benchmarks folder is checked from inside itself, with the same default rules.
    try:
        for p in PACKAGES:
            bench_dir = ROOT / "packages" / p / "benchmarks"
            if bench_dir.is_dir():
                session.chdir(bench_dir)
                session.run("mypy", *cache, "--explicit-package-bases", ".")
    finally:
        session.chdir(ROOT)


@nox.session
def imports(session: nox.Session) -> None:
    """import-linter: the layers contract (no upward imports) and kv_spec's no-torch rule."""
    _sync(session, "--all-packages", "--group", "imports")
    session.run("lint-imports")


@nox.session
def readme(session: nox.Session) -> None:
    """The README's first command, `uv run kvstack demo`, in a fresh project environment.

    `uv run` from the root installs what a newcomer gets: the root's dependencies and its default
    `dev` group from the lock (no `hf` group, so no transformers), so this proves the demo needs
    nothing more.
    """
    env_dir = Path(tempfile.mkdtemp(prefix="kvstack-readme-"))
    try:
        session.run(
            "uv",
            "run",
            "--locked",
            "kvstack",
            "demo",
            env={"UV_PROJECT_ENVIRONMENT": str(env_dir / "venv")},
            external=True,
        )
    finally:
        shutil.rmtree(env_dir, ignore_errors=True)


@nox.session(name="docs-check")
def docs_check(session: nox.Session) -> None:
    """Regenerate docs/attention_backends.md from the backends' CAPABILITIES; fail on drift."""
    session.run("python", "tools/generate_backend_docs.py", "--check", external=True)


@nox.session
@nox.parametrize("package", _per_package())
def isolated(session: nox.Session, package: str) -> None:
    """Release gate: build the wheel with --no-sources, install it alone (its declared
    dependencies only, siblings from freshly built wheels, versions held to the lock), import it."""
    tmp = Path(tempfile.mkdtemp(prefix="kvstack-isolated-"))
    try:
        dist = tmp / "dist"
        for p in PACKAGES:  # siblings are not on an index: build them all from this tree
            session.run(
                "uv",
                "build",
                "--package",
                p,
                "--no-sources",
                "--wheel",
                "--out-dir",
                str(dist),
                "-q",
                external=True,
            )
        constraints = tmp / "constraints.txt"
        session.run(
            "uv",
            "export",
            "--frozen",
            "--all-packages",
            "--no-emit-workspace",
            "--no-dev",
            "--all-extras",
            "--no-hashes",
            "-q",
            "-o",
            str(constraints),
            external=True,
        )
        venv = tmp / "venv"
        session.run(
            "uv",
            "venv",
            "-q",
            "--python",
            session.virtualenv.interpreter or "python3",
            str(venv),
            external=True,
        )
        py = str(venv / "bin" / "python")
        session.run(
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            py,
            "--find-links",
            str(dist),
            "-c",
            str(constraints),
            package,
            external=True,
        )
        mod = IMPORT_NAMES[package]
        # Import every module of the package, so a dependency used only in a submodule counts too.
        skip = EXTRA_MODULES.get(package, ())
        walk = (
            f"import importlib, pkgutil, {mod}; "
            f"names = [m.name for m in pkgutil.walk_packages({mod}.__path__, '{mod}.') "
            f"if m.name not in {skip!r} and not m.name.endswith('__main__')]; "
            "[importlib.import_module(n) for n in names]; "
            f"print('{package}', {mod}.__version__, 'imports alone with', len(names), 'submodules')"
        )
        session.run(py, "-c", walk, external=True)
        if package in ("kv-spec", "kv-blocktable"):
            # The bottom layer, and the scheduler side of kv-blocktable, install and import with
            # no torch anywhere in the env.
            session.run(
                py,
                "-c",
                "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)",
                external=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """The tests marked gpu (run on a CUDA machine)."""
    _sync(session, "--all-packages", "--group", "test")
    session.run(
        "python",
        "-m",
        "pytest",
        *(f"packages/{p}/tests" for p in PACKAGES),
        "-m",
        "gpu",
        "-q",
        *session.posargs,
    )


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every benchmark script (CUDA only); JSON lands in docs/benchmarks/."""
    _sync(session, "--all-packages")
    out = os.environ.get("BENCH_OUT", str(ROOT / "docs" / "benchmarks"))
    for script in sorted(ROOT.glob("packages/*/benchmarks/bench_*.py")):
        session.run("python", str(script), "--out", out)
