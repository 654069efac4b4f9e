"""Cheap Triton launches: after the first launch of a specialization, call its compiled launcher.

``kernel[grid](*args, **kwargs)`` costs tens of microseconds of host time a call (H200 host,
triton 3.6): Triton binds every argument, asks its C specializer about each one (type, 16-byte
alignment of pointers, integers equal to 1 or divisible by 16), builds a string key, looks the
variant up, then builds launch metadata. A launch site of ours already knows most of that: the
few values that pick the variant (shapes, strides, dtypes, constexprs, pointer alignment) are
a small key it computes anyway. :class:`FastLauncher` keeps, per ``(key, current device)``, the
:class:`triton.compiler.CompiledKernel` the first launch returned, and later calls its launcher
directly, as ``JITFunction.run`` does at its end (the same call in triton 3.6 and 3.9)::

    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *every_argument)

``every_argument``: all parameters in signature order, constexprs included (the launcher skips
them). ``launch_metadata`` and the hooks are ``None``: the fast path runs only while Triton's
launch hooks are empty (a profiler that adds one gets the plain path, and its metadata). A
pointer may be passed as an int (its ``data_ptr()``): the launcher takes an int as the address
and skips the ``data_ptr()`` call and the driver's pointer query it makes for a tensor
(``paged_attention/_bound.py`` launches that way, from :meth:`FastLauncher.bound`).

The contract of ``key``: equal keys (on the same device) give Triton the same specialization
(argument types, alignments, integer classes) and the same keyword arguments (constexprs and
options). A site that cannot promise it for an argument leaves it out of the fast path (plain
launch). ``KV_KERNELS_CHECK_LAUNCH=1`` (or :data:`CHECK` set to True) makes every fast launch
also run Triton's own binder and raise if its specialization differs from the bound one: the GPU
tests run that way.

Fallback: if the compiled kernel lacks the attributes above, or its launcher rejects the call
(``TypeError`` from argument parsing, before anything runs), the kernel goes back to the plain
``kernel[grid]`` path for good, without an error. ``KV_KERNELS_FAST_LAUNCH=0`` turns the fast
path off. Under ``TRITON_INTERPRET=1`` kernels are interpreted and always launch the plain way.
"""

from __future__ import annotations

import inspect
import os
import weakref
from typing import Any, NamedTuple

__all__ = [
    "CHECK",
    "ENABLED",
    "EPOCH",
    "FastLauncher",
    "LaunchMismatch",
    "align_bits",
    "int_class",
    "reset_all",
]

ENABLED = os.environ.get("KV_KERNELS_FAST_LAUNCH", "1").strip().lower() not in ("0", "false", "off")
CHECK = os.environ.get("KV_KERNELS_CHECK_LAUNCH", "0").strip().lower() in ("1", "true", "on", "yes")
#: bumped by every :meth:`FastLauncher.reset`: what holds a bound launch of its own (a paged
#: attention call bound per shape class) compares it per call and forgets its binding on a change
EPOCH = 0

#: the launcher's leading parameters, as both supported triton versions name them
_LAUNCHER_HEAD = ("gridX", "gridY", "gridZ", "stream", "function")


class LaunchMismatch(AssertionError):
    """A fast launch's key matched a bound variant whose specialization differs (check mode)."""


class _Bound(NamedTuple):
    run: Any  # the compiled kernel's launcher (CudaLauncher)
    function: Any  # CUfunction handle
    packed: Any  # packed metadata
    tail: tuple[Any, ...]  # parameters after the positional ones (constexprs), in order
    stream: Any  # get_current_stream(device) of the driver
    spec: Any  # Triton's specialization at bind time (check mode), else None


def align_bits(*tensors: Any) -> int:
    """Bit ``i`` set when ``tensors[i]``'s address is not a multiple of 16 bytes: Triton
    specializes pointers on that (``tt.divisibility = 16``), so a key must carry it."""
    bits = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() & 15:
            bits |= 1 << i
    return bits


def int_class(n: int) -> int:
    """What Triton's specializer sees of a specialized integer argument: 1 (a constexpr), a
    multiple of 16 (``tt.divisibility``), and its width (i32 / i64); equal classes, equal
    variants. (Conservative: a negative value counts as wide, which only splits a key.)"""
    return 1 if n == 1 else ((n & 15) == 0) * 2 + (n >> 31 != 0) * 4


def _hooks_idle() -> bool:
    """Whether Triton's launch hooks are empty (``HookChain`` with no calls, or ``None``)."""
    rt = _RUNTIME[0]
    if rt is None:
        from triton import knobs

        rt = _RUNTIME[0] = knobs.runtime
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (
        exit_ is None or not getattr(exit_, "calls", True)
    )


_RUNTIME: list[Any] = [None]  # triton.knobs.runtime, once imported


class FastLauncher:
    """Launches of one ``@triton.jit`` kernel, bound per ``(key, device)`` (module notes)."""

    __slots__ = ("__weakref__", "_bound", "_device", "hits", "kernel", "plain")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.hits = 0  # launches through a bound launcher (tests and benchmarks read it)
        _ALL.add(self)
        self._bound: dict[tuple[Any, int], _Bound | None] = {}
        # interpreted kernels (TRITON_INTERPRET=1) have no compiled variants
        self.plain = not hasattr(kernel, "device_caches")
        self._device: Any = None

    def __call__(
        self, key: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """``kernel[grid](*args, **kwargs)``, through the bound launcher when ``key`` was seen;
        returns whether it went that way."""
        if self.plain or not ENABLED:
            self.kernel[grid](*args, **kwargs)
            return False
        device = self._device() if self._device is not None else _current_device()
        slot = (key, device)
        bound = self._bound.get(slot, _MISSING)
        if bound is not _MISSING and bound is not None and _hooks_idle():
            if CHECK:
                self._check(bound, key, args, kwargs, device)
            n = len(grid)
            try:
                bound.run(
                    grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                    bound.stream(device), bound.function, bound.packed, None, None, None,
                    *args, *bound.tail,
                )  # fmt: skip
                self.hits += 1
                return True
            except TypeError:
                # the launcher parses its arguments before launching: a TypeError means this
                # triton's launcher takes another call; use the plain path from now on
                self.plain = True
        compiled = self.kernel[grid](*args, **kwargs)
        if bound is _MISSING and not self.plain:
            if len(self._bound) >= 1024:  # (a sweep of shapes; a serving process has a few)
                self._bound.clear()
            self._bound[slot] = self._bind(compiled, args, kwargs, device)
        return False

    def bound(self, key: Any, device: int) -> _Bound | None:
        """The bound launch of ``key`` on ``device`` (None before its first launch, or where it
        cannot be bound): what a caller that binds a whole call at once reads (its run,
        function, packed metadata, constexpr tail and stream getter)."""
        got = self._bound.get((key, device))
        return got if isinstance(got, _Bound) and not self.plain else None

    def current_device(self) -> int:
        """The device a launch goes to now (Triton's driver's current device, as ``__call__``
        reads it)."""
        return self._device() if self._device is not None else _current_device()

    def reset(self) -> None:
        """Forget every bound launch (the next call of each key launches the plain way)."""
        global EPOCH
        EPOCH += 1
        self._bound.clear()
        self.hits = 0

    def _bind(
        self, compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: int
    ) -> _Bound | None:
        """The bound launch of ``compiled`` (the first launch's return), or None when this
        triton's objects are not the ones the fast path expects (then always the plain path)."""
        kernel = self.kernel
        try:
            run = compiled.run  # (initializes the module and function handles)
            function, packed = compiled.function, compiled.packed_metadata
            names = [p.name for p in kernel.params]
            head = _launcher_head(type(run))
            if function is None or head != _LAUNCHER_HEAD or getattr(kernel, "pre_run_hooks", None):
                return None
            tail = []
            for p in kernel.params[len(args) :]:
                if not p.is_constexpr:
                    return None  # a runtime argument passed by keyword: not bound
                tail.append(kwargs.get(p.name, p.default))
            if any(k in names[: len(args)] for k in kwargs):
                return None
            get_device, stream = _driver_functions()
            if self._device is None:
                self._device = get_device
            spec = _specialization(kernel, args, kwargs, device) if CHECK else None
        except Exception:
            return None
        return _Bound(run, function, packed, tuple(tail), stream, spec)

    def check(
        self, bound: _Bound, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: int
    ) -> None:
        """Raise :class:`LaunchMismatch` when Triton's binder specializes ``args`` / ``kwargs``
        otherwise than the launch ``bound`` was bound with (check mode)."""
        self._check(bound, key, args, kwargs, device)

    def _check(
        self, bound: _Bound, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: int
    ) -> None:
        spec = _specialization(self.kernel, args, kwargs, device)
        if bound.spec is not None and spec != bound.spec:
            raise LaunchMismatch(
                f"{getattr(self.kernel, '__name__', self.kernel)}: fast-launch key {key!r} was "
                f"bound to specialization {bound.spec} but this call specializes as {spec}; "
                "the launch site's key misses a value Triton specializes on"
            )


_MISSING: Any = object()
_ALL: weakref.WeakSet[FastLauncher] = weakref.WeakSet()
_HEADS: dict[type, tuple[str, ...]] = {}


def _launcher_head(launcher: type) -> tuple[str, ...]:
    """The first five parameter names of a compiled launcher type's ``__call__`` (read once a
    type: ``inspect.signature`` took ~0.3 ms of each bind on a slow CPU, and a step of a new
    token count binds each op anew)."""
    head = _HEADS.get(launcher)
    if head is None:
        head = _HEADS[launcher] = tuple(inspect.signature(launcher.__call__).parameters)[1:6]
    return head


def reset_all() -> list[FastLauncher]:
    """:meth:`FastLauncher.reset` every launcher of the process; returns them."""
    launchers = list(_ALL)
    for launcher in launchers:
        launcher.reset()
    return launchers


def _driver_functions() -> tuple[Any, Any]:
    """Triton's active driver's ``(get_current_device, get_current_stream)``: the device and
    stream ``JITFunction.run`` launches on (torch's current ones)."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.get_current_stream


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


def _specialization(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: int) -> Any:
    """Triton's own specialization of a call (its binder, as ``JITFunction.run`` computes it)."""
    binder = kernel.device_caches[device][4]
    _, spec, options = binder(*args, **kwargs)
    return tuple(spec), tuple(sorted((k, repr(v)) for k, v in options.items()))
