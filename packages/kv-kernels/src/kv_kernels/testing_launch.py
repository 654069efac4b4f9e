"""Host time of the hot ops' CUDA path on a machine without a GPU: CPU tensors that say they are
on ``cuda:0`` and Triton launches stubbed by a no-op compiled kernel.

What it measures: the api's checks, its call cache, the launcher's arguments and keys and
:class:`kv_kernels._launch.FastLauncher`'s bound path, down to the compiled kernel's launcher
(here a Python no-op, on a GPU Triton's C launcher, a few us). What it does not: Triton's C
launcher, CUDA allocations (``torch.empty`` on ``cuda`` allocates on the CPU here), device
properties (an sm_90 card with 132 SMs is assumed). Each attribute read of a :class:`FakeCuda`
tensor (``shape``, ``stride()``, ``dtype``, ``data_ptr()``) costs ~0.1 us more than a plain
tensor's (torch checks the subclass for ``__torch_function__``), so the path reads as slower here
than its share of a GPU host's time. Use it to compare two versions of the host path on the same
machine (GPU numbers come from ``bench_launch.py`` on a GPU), and in CPU tests of the call
caches: :data:`LAUNCHES` records every stubbed launch's arguments, :data:`ALLOCATIONS` every
``torch.empty`` / ``torch.full`` result, and the stub kernels' binder (check mode,
:data:`kv_kernels._launch.CHECK`) specializes arguments as Triton does in kind (dtypes,
16-byte alignment, integer classes).

    python3 packages/kv-kernels/benchmarks/bench_launch.py --stub-cuda [--iters N]

Test scaffolding, like :mod:`kv_kernels.testing`: nothing in the package imports it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["ALLOCATIONS", "LAUNCHES", "FakeCuda", "fake_cuda", "stubbed_cuda"]

_CUDA0 = torch.device("cuda", 0)


class FakeCuda(torch.Tensor):
    """A CPU tensor whose ``device`` is ``cuda:0`` (every other method is the plain tensor's:
    no ``__torch_function__``, so results of ops are plain CPU tensors)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _CUDA0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:
        return 0


def fake_cuda(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor, same storage) seen as a ``cuda:0`` tensor."""
    return torch.Tensor._make_subclass(FakeCuda, t)


#: ``(kernel name, grid, arguments)`` of the stubbed launches, when set to a list (tests)
LAUNCHES: list[tuple[str, tuple[int, ...], tuple[Any, ...]]] | None = None
#: the tensors ``torch.empty`` / ``torch.full`` made for a ``cuda`` device, when set to a list
ALLOCATIONS: list[torch.Tensor] | None = None


class _NoOpLauncher:
    """Triton's compiled launcher, as ``FastLauncher`` binds it (the leading parameters)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        if LAUNCHES is not None:
            # (args: packed metadata, launch metadata, the two hooks, then every argument)
            LAUNCHES.append((self.name, (gridX, gridY, gridZ), args[4:]))


def _params(fn: Any) -> list[Any]:
    """A JITFunction's ``params`` from the Python function (an interpreted kernel has none)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        constexpr = "constexpr" in str(p.annotation)
        default = None if p.default is inspect.Parameter.empty else p.default
        out.append(SimpleNamespace(name=p.name, is_constexpr=constexpr, default=default))
    return out


class _StubKernel:
    """A JITFunction stand-in whose ``kernel[grid](...)`` launches nothing and returns a compiled
    kernel with a no-op launcher (the real kernel's parameters, so binding sees its signature)."""

    def __init__(self, real: Any) -> None:
        self.params = real.params if hasattr(real, "params") else _params(real.fn)
        self.pre_run_hooks: list[Any] = []
        # (device 0's binder at index 4, as JITFunction.device_caches holds it: check mode)
        self.device_caches: dict[int, Any] = {0: (None, None, None, None, _binder)}
        self.__name__ = getattr(real, "__name__", "stub")
        self._compiled = SimpleNamespace(
            run=_NoOpLauncher(self.__name__), function=1, packed_metadata=(0, 0, 0, 0)
        )

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            if LAUNCHES is not None:  # (the plain path: the constexprs as the bound one sees them)
                names = [p.name for p in self.params[len(args) :]]
                tail = tuple(
                    kwargs.get(n, p.default)
                    for n, p in zip(names, self.params[len(args) :], strict=True)
                )
                g = (*grid, 1, 1)[:3]
                LAUNCHES.append((self.__name__, g, (*args, *tail)))
            return self._compiled

        return launch


def _binder(*args: Any, **kwargs: Any) -> tuple[Any, list[Any], dict[str, Any]]:
    """A stand-in of Triton's binder: ``(None, specialization, options)`` with a tensor as its
    dtype and 16-byte alignment, an int as :func:`kv_kernels._launch.int_class`, anything else
    as its type and value (constexprs, floats)."""
    from kv_kernels._launch import int_class

    spec: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append((a.dtype, a.data_ptr() % 16 == 0))
        elif type(a) is int:
            spec.append(("int", int_class(a)))
        else:
            spec.append((type(a).__name__, a if type(a) is not float else "fp32"))
    return None, spec, dict(kwargs)


def _empty_on_cpu(real: Any) -> Any:
    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        on_device = kwargs.get("device") is not None
        if on_device:
            kwargs["device"] = "cpu"
        t = real(*args, **kwargs)
        if on_device and ALLOCATIONS is not None:
            ALLOCATIONS.append(t)
        return t

    return empty


@contextlib.contextmanager
def stubbed_cuda() -> Iterator[None]:
    """Patch Triton's driver, the device queries and every ``FastLauncher``'s kernel for the
    duration (fake-``cuda`` tensors then run the ops' CUDA path to a no-op launch)."""
    from kv_kernels import _launch

    tiles = importlib.import_module("kv_kernels.paged_attention._tiles")
    attn = importlib.import_module("kv_kernels.paged_attention.triton")
    decode = importlib.import_module("kv_kernels.paged_attention._sm90_decode")
    # (every module with a FastLauncher, imported before the launchers are patched: the MLA
    # kernels' are imported by the api at call time, so a test that ran alone reached the real
    # Triton launch through an unpatched one)
    importlib.import_module("kv_kernels.paged_attention._sm90_mla")
    for name in ("reshape_and_cache", "fused", "block_copy", "gemm"):
        importlib.import_module(f"kv_kernels.{name}.triton")
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    patch(_launch, "_driver_functions", lambda: ((lambda: 0), (lambda d: 0)))
    patch(_launch, "_current_device", lambda: 0)
    patch(_launch, "_hooks_idle", lambda: True)
    patch(_launch, "CHECK", False)
    patch(_launch, "ENABLED", True)
    for mod in (tiles, attn):
        patch(mod, "_device_info", lambda index: (90, 132))
    patch(decode, "peak_memory_tbps", lambda index: 4.8)
    patch(torch, "empty", _empty_on_cpu(torch.empty))
    patch(torch, "full", _empty_on_cpu(torch.full))
    for launcher in _launch.reset_all():
        patch(launcher, "kernel", _StubKernel(launcher.kernel))
        patch(launcher, "plain", False)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        _launch.reset_all()
