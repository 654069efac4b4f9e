"""A paged-attention call bound once per shape class: every launch of the call with all its
arguments fixed but the pointers of the call's tensors (issue 32: a launch <= 20 us of host time).

Why. The api's call cache (:mod:`._fast`) already skipped the checks and the plan for a call alike
an earlier validated one, yet each hit still rebuilt every launch: the split count, the scale and
scratch arguments, two argument tuples of 50 values with the tensors' strides, the keyword
arguments, one :class:`~kv_kernels._launch.FastLauncher` lookup per kernel; and Triton's launcher
then called ``data_ptr()`` and ``cuPointerGetAttribute`` for each of the ~17 tensor arguments.
All of that is a function of the call's key and its split count. So after a call's launches ran
through bound launchers once (:meth:`BoundCall.build`, from :func:`.triton.describe_launches`'
description of them), a later call of the class does only this: read the tensors' ``data_ptr``
(the key reads them anyway), allocate what it returns (``lse``) and, when it splits KV, one
scratch buffer, pick each launch's argument tuple out of one tuple of per-call values and
constants (``operator.itemgetter``), and call each compiled launcher. Pointers go to the launcher
as ints (every Triton launcher takes an int for a pointer, and skips ``data_ptr`` and the driver
query for it).

What keeps it exact. A launch's arguments are the pointers of the call's tensors (each mapped, at
build time, to the input it *is*: ``q``, ``kv_cache``, ..., ``out``, the returned ``lse``, the
scratch) and values the key fixes (shapes, strides, options, the plan's constexprs) or the split
count fixes (the variant is per split count). A build refuses -- the call then takes the
described path every time -- when a launch is not bound (a profiler's hook, the TMA or sm_90
prefill launches Triton binds on their descriptors), when an argument is a tensor it cannot map
(a per-call conversion: a float partner of a tensor scale, a non-float32 scale tensor) or when
two inputs are the same tensor (a later call could pass two). ``KV_KERNELS_CHECK_LAUNCH=1``
(:data:`kv_kernels._launch.CHECK`, the GPU tests) describes every bound call again on the same
tensors and raises :class:`~kv_kernels._launch.LaunchMismatch` unless each launch's arguments are
exactly those of the described path, and runs Triton's binder against the bound
specialization. :func:`kv_kernels._launch.reset_all` drops every bound call (``EPOCH``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from kv_kernels import _launch
from kv_kernels.paged_attention._launch_args import split_scratch, split_views

__all__ = ["SLOTS", "BoundCall", "Launch", "split_steps"]

#: The per-call values a bound launch reads, in this order: the pointers of the api's tensors
#: (0 where absent), of the returned LSE and of the split scratch, then the stream.
SLOTS = (
    "q", "kv_cache", "block_table", "seq_lens", "query_start_loc", "sinks", "alibi_slopes",
    "k_scale", "v_scale", "error_flag", "out", "lse", "part_out", "part_lse", "stream",
)  # fmt: skip
_INPUTS = 11  # q .. out: what the caller passes


class Launch(NamedTuple):
    """One kernel launch of a call: through ``fast`` under ``key`` (bound after its first
    launch), the plain ``kernel[grid]`` way where ``key`` is falsy, or ``plain()`` where ``fast``
    is None (the sm_90 prefill, launched by its own module)."""

    fast: Any
    key: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    plain: Any = None

    def run(self) -> None:
        if self.fast is None:
            self.plain()
        elif self.key:
            self.fast(self.key, self.grid, self.args, self.kwargs)
        else:
            self.fast.kernel[self.grid](*self.args, **self.kwargs)


def split_steps(
    splits_at: Callable[[int], int], hi: int = 2**31 - 1
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lows, values)`` of a split heuristic over ``max_seq_len`` in ``[0, hi]``:
    ``splits_at(m) == values[bisect_right(lows, m)]``. Found by bisection once per shape class,
    so a call reads its split count with one ``bisect`` instead of running the heuristic; exact
    for a heuristic that never decreases as ``m`` grows (more keys never want fewer splits: every
    one of :func:`._tiles.pick_num_splits`' conditions only loosens as the tiles grow;
    ``tests/test_fast_launch_attention.py`` sweeps it)."""
    lows: list[int] = []
    values = [splits_at(0)]
    last = splits_at(hi)
    start = 0
    while values[-1] != last and len(values) < 64:
        lo, top = start + 1, hi
        while lo < top:  # the first m past start whose split count differs
            mid = (lo + top) // 2
            if splits_at(mid) != values[-1]:
                top = mid
            else:
                lo = mid + 1
        lows.append(lo)
        values.append(splits_at(lo))
        start = lo
    return tuple(lows), tuple(values)


class SplitTable:
    """A plan's split count per call: fixed (``lows`` empty), or its heuristic's steps over
    ``max_seq_len`` (:func:`split_steps`), with ``default`` for ``max_seq_len=None`` (the block
    table's width, fixed by the key). ``values[bisect_right(lows, m)]`` is the count at ``m``."""

    __slots__ = ("default", "lows", "values")

    def __init__(self, fixed: int | None, steps: Any = None, default: int = 1) -> None:
        self.lows: tuple[int, ...]
        self.values: tuple[int, ...]
        self.lows, self.values = steps if fixed is None else ((), (fixed,))
        self.default = default if fixed is None else fixed

    def __call__(self, max_seq_len: int | None) -> int:
        if max_seq_len is None:
            return self.default
        return self.values[bisect_right(self.lows, max_seq_len)]


class BoundCall:
    """The launches of one shape class at one split count (module notes). Call it with the
    call's pointers; it returns the call's result, or None where it does not serve the call
    (the launch path is off, a hook is set, another device is current, a
    :func:`~kv_kernels._launch.reset_all` since the build, an inline-scale cache whose storage
    size changes the scale view): the caller then takes the described path."""

    __slots__ = (
        "arguments", "device", "epoch", "fasts", "get_device", "launch", "lse_offset",
        "lse_shape", "runs", "scratch", "split_shape", "storage_mod4", "stream",
    )  # fmt: skip

    def __init__(self) -> None:
        self.launch: Any = None  # launch(*SLOTS values): every launch of the call
        self.arguments: Any = None  # arguments(*SLOTS values): each launch's arguments (check)
        self.runs: list[Any] = []  # each launch's compiled launcher
        self.fasts: list[Any] = []  # each launch's FastLauncher (hit counts, check mode)
        self.device = 0
        self.epoch = _launch.EPOCH
        self.get_device: Any = None
        self.stream: Any = None
        self.lse_shape: tuple[int, int] | None = None
        self.scratch = 0  # float32 elements of the split scratch (0: no split)
        self.lse_offset = 0  # bytes from the scratch to the partial LSEs
        self.split_shape: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.storage_mod4: int | None = None

    @classmethod
    def build(
        cls,
        launches: Sequence[Launch],
        tensors: Sequence[Any],
        splits: int,
        storage_mod4: int | None = None,
    ) -> BoundCall | None:
        """The bound call of ``launches`` (one call's, all run), or None where one cannot be
        made (module notes). ``tensors``: the call's tensors in :data:`SLOTS` order (``lse``,
        ``part_out``, ``part_lse`` as the launcher made them); ``storage_mod4``: for an
        inline-scale cache, its storage's byte size mod 4 (the scale view depends on it)."""
        if not launches or any(x.fast is None or not x.key for x in launches):
            return None
        kv, lse, part_out, part_lse = (tensors[i] for i in (1, 11, 12, 13))
        self = cls()
        fast = launches[0].fast
        self.device = fast.current_device()
        self.get_device = fast._device if fast._device is not None else _launch._current_device
        ids: dict[int, str] = {}
        for name, t in zip(SLOTS[:_INPUTS], tensors[:_INPUTS], strict=True):
            if isinstance(t, torch.Tensor):
                if id(t) in ids:
                    return None  # two inputs are one tensor: a later call may pass two
                ids[id(t)] = name
        if lse is not None:
            ids[id(lse)] = "lse"
            self.lse_shape = (lse.shape[0], lse.shape[1])
        if splits > 1:
            t, hq, s, dv_pad = part_out.shape
            self.scratch, offset = split_scratch(t, hq, s, dv_pad)
            self.lse_offset = 4 * offset
            if part_lse.data_ptr() - part_out.data_ptr() != self.lse_offset:
                return None
            ids[id(part_out)], ids[id(part_lse)] = "part_out", "part_lse"
            self.split_shape = (t, hq, s, dv_pad)
        namespace: dict[str, Any] = {}

        def const(value: Any) -> str:
            name = f"c{len(namespace)}"
            namespace[name] = value
            return name

        calls = []
        for i, launch in enumerate(launches):
            bound = launch.fast.bound(launch.key, self.device)
            if bound is None:
                return None
            args = [const(g) for g in (*launch.grid, 1, 1)[:3]]
            args.append("stream")
            args += [const(v) for v in (bound.function, bound.packed, None, None, None)]
            for arg in launch.args:
                if isinstance(arg, torch.Tensor):
                    slot = ids.get(id(arg))
                    if slot is None and arg.data_ptr() == kv.data_ptr() and _views_cache(arg, kv):
                        slot = "kv_cache"  # the inline-scale view of the cache (its address)
                    if slot is None:
                        return None
                    args.append(slot)
                elif arg is None or type(arg) in (int, float, bool):
                    args.append(const(arg))
                else:
                    return None  # (a TMA descriptor: Triton binds on it, never bound here)
            args += [const(v) for v in bound.tail]
            namespace[f"run{i}"] = bound.run
            calls.append((f"run{i}", ", ".join(args)))
            self.runs.append(bound.run)
            self.fasts.append(launch.fast)
            self.stream = bound.stream
        self.launch, self.arguments = _compile(calls, namespace)
        self.storage_mod4 = storage_mod4
        return self

    def __call__(
        self,
        ptrs: tuple[int, ...],  # the pointers of q .. out (SLOTS[:11]; 0 where absent)
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        describe: Callable[..., list[Launch]] | None = None,  # check mode: the described launches
    ) -> Any:
        """Launch the call; returns ``out`` (``(out, lse)`` with ``return_lse``), or None where
        this bound call does not serve it (class notes)."""
        if (
            self.epoch != _launch.EPOCH
            or not _launch.ENABLED
            or (_launch.CHECK and describe is None)
            or not _launch._hooks_idle()
        ):
            return None
        dev = self.get_device()
        if dev != self.device:
            return None
        if self.storage_mod4 is not None and (
            kv_cache.untyped_storage().nbytes() & 3 != self.storage_mod4
        ):
            return None
        lse = lse_ptr = buf = part_out = part_lse = None
        if self.lse_shape is not None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
            lse_ptr = lse.data_ptr()
        if self.scratch:
            buf = torch.empty((self.scratch,), dtype=torch.float32, device=q.device)
            part_out = buf.data_ptr()
            part_lse = part_out + self.lse_offset
        stream = self.stream(dev)
        if describe is not None:
            got = self.arguments(*ptrs, lse_ptr, part_out, part_lse, stream)
            self._verify(got, describe(lse, *self._views(buf)), stream, dev)
        self.launch(*ptrs, lse_ptr, part_out, part_lse, stream)
        for fast in self.fasts:
            fast.hits += 1
        return out if lse is None else (out, lse)

    def _views(self, buf: torch.Tensor | None) -> tuple[Any, Any]:
        if buf is None:
            return None, None  # (the describer passes out, as the launcher does)
        return split_views(buf, *self.split_shape)

    def _verify(
        self, got: tuple[tuple[Any, ...], ...], launches: list[Launch], stream: Any, dev: int
    ) -> None:
        """Check mode: each launch's arguments equal the described path's, pointer by pointer,
        and Triton's binder specializes the described arguments as the launch was bound."""
        if len(launches) != len(self.runs):
            raise _launch.LaunchMismatch(
                f"bound paged_attention call: {len(self.runs)} launches, the described path has "
                f"{len(launches)}"
            )
        for i, (run, fast, launch, args) in enumerate(
            zip(self.runs, self.fasts, launches, got, strict=True)
        ):
            bound = fast.bound(launch.key, dev) if launch.fast is fast else None
            if bound is None or bound.run is not run:
                raise _launch.LaunchMismatch(
                    f"bound paged_attention call: launch {i} is not the described path's "
                    f"({getattr(launch.fast, 'kernel', None)!r}, key {launch.key!r})"
                )
            grid = (*launch.grid, 1, 1)[:3]
            ptrs = (a.data_ptr() if isinstance(a, torch.Tensor) else a for a in launch.args)
            want = (*grid, stream, bound.function, bound.packed, None, None, None, *ptrs,
                    *bound.tail)  # fmt: skip
            if args != want:
                diff = [j for j, (a, b) in enumerate(zip(args, want, strict=False)) if a != b]
                raise _launch.LaunchMismatch(
                    f"bound paged_attention call: launch {i} ({fast.kernel!r}) differs from the "
                    f"described path at launcher arguments {diff} (of {len(want)}): "
                    f"{[args[j] for j in diff]} != {[want[j] for j in diff]}"
                )
            fast.check(bound, launch.key, launch.args, launch.kwargs, dev)


def _compile(calls: list[tuple[str, str]], namespace: dict[str, Any]) -> tuple[Any, Any]:
    """``(launch, arguments)`` of a bound call, generated once: ``launch(*SLOTS values)`` calls
    each compiled launcher with its arguments written out (per-call values by :data:`SLOTS`
    name, constants as ``namespace`` globals), ``arguments(...)`` returns those argument tuples
    (check mode compares them with the described path's). Why generated: a launch of the
    attention kernel takes 92 arguments; calling with them in place costs one call, where
    picking them out of a tuple of values (``operator.itemgetter``) and unpacking it again cost
    ~1 us more a call on the stubbed CPU path (as Triton generates its own binder). The source
    holds only names: the values stay in ``namespace``."""
    params = ", ".join(SLOTS)
    runs = "".join(f"    {run}({args})\n" for run, args in calls)
    tuples = "".join(f"({args}), " for _, args in calls)
    source = f"def launch({params}):\n{runs}\ndef arguments({params}):\n    return ({tuples})\n"
    # The source is the same for every class of a call's structure (its values are the
    # namespace's), so it is compiled once: ``compile`` took ~1 ms of each build on a slow CPU,
    # and a mixed step (a new token count) builds anew.
    code = _CODE.get(source)
    if code is None:
        if len(_CODE) >= 256:  # (structures are few; a bound on a sweep of odd ones)
            _CODE.clear()
        code = _CODE[source] = compile(source, "<kv_kernels bound paged_attention call>", "exec")
    exec(code, namespace)
    return namespace["launch"], namespace["arguments"]


_CODE: dict[str, Any] = {}


def _views_cache(view: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``view`` is the launcher's inline-scale view of ``kv_cache`` (the same storage
    seen as bytes or float32 words, :func:`._launch_args._inline_scale_args`)."""
    return (
        view.dtype in (torch.uint8, torch.float32)
        and view.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    )
