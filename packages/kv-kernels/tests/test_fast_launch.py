"""kv_kernels._launch: the bound-launcher path (with a stand-in kernel on the CPU), its fallback
to the plain ``kernel[grid]`` launch, the check mode, and the keys the launch sites build,
held against Triton's own specializer (the C one both supported versions share)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kv_kernels import _launch
from kv_kernels._launch import FastLauncher, LaunchMismatch, align_bits, int_class


class _Param:
    def __init__(self, name: str, constexpr: bool = False, default: Any = None) -> None:
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _Launcher:
    """Stands in for triton's CudaLauncher: the leading parameters both versions name."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        if self.fail:
            raise TypeError("function takes exactly 20 arguments (21 given)")
        self.calls.append((gridX, gridY, gridZ, stream, function, *args))


class _Kernel:
    """A JITFunction stand-in: ``kernel[grid](...)`` records a plain launch and returns a
    compiled-kernel stand-in; ``device_caches[d][4]`` is a binder giving a specialization."""

    def __init__(self, compiled: Any) -> None:
        self.params = [_Param("x"), _Param("n"), _Param("B", True), _Param("C", True, 7)]
        self.pre_run_hooks: list[Any] = []
        self.plain: list[tuple[Any, ...]] = []
        self.compiled = compiled
        self.spec: Any = ("i32",)
        binder = lambda *a, **kw: ({}, [self.spec], {})  # noqa: E731
        self.device_caches = {0: (None, None, None, None, binder)}
        self.__name__ = "stand_in"

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.plain.append((grid, args, kwargs))
            return self.compiled

        return launch


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 0 and stream 1234, as Triton's driver would give them on a GPU."""
    monkeypatch.setattr(_launch, "_driver_functions", lambda: ((lambda: 0), (lambda d: 1234)))
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "CHECK", False)


def _compiled(fail: bool = False, **drop: Any) -> Any:
    fields = {"run": _Launcher(fail), "function": "fn", "packed_metadata": ("pm",)}
    for name in drop:
        fields.pop(name)
    return SimpleNamespace(**fields)


def test_second_launch_calls_the_compiled_launcher_with_every_argument(driver: None) -> None:
    compiled = _compiled()
    kernel = _Kernel(compiled)
    fast = FastLauncher(kernel)
    fast("k", (3, 2), ("ptr", 5), {"B": 16, "num_warps": 4})
    assert len(kernel.plain) == 1 and compiled.run.calls == []
    fast("k", (4,), ("ptr2", 6), {"B": 16, "num_warps": 4})
    assert len(kernel.plain) == 1
    # grid padded to 3-D, the driver's stream, no launch metadata or hooks, then every parameter
    # in signature order: the positional ones, the constexpr B and C's default
    assert compiled.run.calls == [
        (4, 1, 1, 1234, "fn", ("pm",), None, None, None, "ptr2", 6, 16, 7)
    ]
    fast("other", (1,), ("ptr", 5), {"B": 32})  # another key: plain first
    assert len(kernel.plain) == 2


@pytest.mark.parametrize("drop", ["function", "packed_metadata", "run"])
def test_a_compiled_kernel_without_the_expected_attributes_stays_on_the_plain_path(
    driver: None, drop: str
) -> None:
    kernel = _Kernel(_compiled(**{drop: True}))
    fast = FastLauncher(kernel)
    for _ in range(3):
        fast("k", (1,), ("p", 1), {"B": 1})
    assert len(kernel.plain) == 3


def test_a_launcher_that_rejects_the_call_falls_back_once_without_an_error(driver: None) -> None:
    compiled = _compiled(fail=True)
    kernel = _Kernel(compiled)
    fast = FastLauncher(kernel)
    fast("k", (1,), ("p", 1), {"B": 1})
    fast("k", (1,), ("p", 1), {"B": 1})  # the bound call raises TypeError: plain, then for good
    assert len(kernel.plain) == 2 and fast.plain
    fast("k", (1,), ("p", 1), {"B": 1})
    assert len(kernel.plain) == 3


def test_runtime_arguments_passed_by_keyword_are_not_bound(driver: None) -> None:
    compiled = _compiled()
    kernel = _Kernel(compiled)
    fast = FastLauncher(kernel)
    for _ in range(2):
        fast("k", (1,), ("p",), {"n": 3, "B": 1})
    assert len(kernel.plain) == 2 and compiled.run.calls == []


def test_launch_hooks_take_the_plain_path(driver: None, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _compiled()
    kernel = _Kernel(compiled)
    fast = FastLauncher(kernel)
    fast("k", (1,), ("p", 1), {"B": 1})
    monkeypatch.setattr(_launch, "_hooks_idle", lambda: False)  # a profiler's hook
    fast("k", (1,), ("p", 1), {"B": 1})
    assert len(kernel.plain) == 2 and compiled.run.calls == []


def test_interpreted_kernels_and_the_switch_launch_the_plain_way(
    driver: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = _Kernel(_compiled())
    del kernel.device_caches  # an InterpretedFunction has none
    fast = FastLauncher(kernel)
    for _ in range(2):
        fast("k", (1,), ("p", 1), {"B": 1})
    assert len(kernel.plain) == 2
    kernel2 = _Kernel(_compiled())
    monkeypatch.setattr(_launch, "ENABLED", False)
    fast2 = FastLauncher(kernel2)
    for _ in range(2):
        fast2("k", (1,), ("p", 1), {"B": 1})
    assert len(kernel2.plain) == 2


def test_check_mode_raises_when_a_key_covers_two_specializations(
    driver: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_launch, "CHECK", True)
    kernel = _Kernel(_compiled())
    fast = FastLauncher(kernel)
    fast("k", (1,), ("p", 1), {"B": 1})
    fast("k", (1,), ("p", 1), {"B": 1})  # same specialization: fine
    kernel.spec = ("constexpr", 1)
    with pytest.raises(LaunchMismatch, match="misses a value Triton specializes on"):
        fast("k", (1,), ("p", 1), {"B": 1})


# ---- the keys, against Triton's specializer ---------------------------------------------------


def _triton_spec(arg: Any) -> Any:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, arg, False, True, True)


_INTS = [0, 1, 2, 15, 16, 17, 32, 48, 4096, 4097, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40]


@pytest.mark.parametrize("a", _INTS)
@pytest.mark.parametrize("b", _INTS)
def test_int_class_separates_what_triton_specializes(a: int, b: int) -> None:
    if int_class(a) == int_class(b):
        assert _triton_spec(a) == _triton_spec(b)


def test_align_bits_follow_the_pointer_specialization() -> None:
    base = torch.empty(256, dtype=torch.bfloat16)
    views = [base[i:] for i in range(24)]
    for v in views:
        aligned = _triton_spec(v)[1] == "D"
        assert bool(align_bits(v)) is not aligned
    assert align_bits(views[0], views[1], views[8]) == 0b010


def test_paged_attention_call_keys_separate_alignment_option_types_and_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kv_kernels.paged_attention._fast import cached_call

    q = torch.empty(64 * 32 * 128 + 8, dtype=torch.bfloat16)
    kv = torch.empty(8, 2, 16, 256, dtype=torch.bfloat16)
    bt = torch.zeros(4, 2, dtype=torch.int32)
    sl, qsl = torch.ones(4, dtype=torch.int32), torch.arange(5, dtype=torch.int32)
    layout = object()

    def key(qv: torch.Tensor, options: tuple[Any, ...] = (True, bool), **kw: Any) -> Any:
        args: dict[str, Any] = dict(
            sinks=None, alibi_slopes=None, k_scale=None, v_scale=None, out=None, error_flag=None
        )
        args.update(kw)
        # (no entry holds this layout: the call's key comes back with no result)
        result, k = cached_call(qv, kv, layout, bt, sl, qsl, 1, options, **args, max_seq_len=None)
        assert result is None
        return k

    aligned = q[: 4 * 32 * 128].view(4, 32, 128)
    shifted = q[8 : 8 + 4 * 32 * 128].view(4, 32, 128)  # 16 bytes on: still aligned
    odd = q[1 : 1 + 4 * 32 * 128].view(4, 32, 128)  # 2 bytes on
    assert key(aligned) == key(shifted)
    assert key(aligned) != key(odd)
    assert key(aligned) != key(aligned, (1, int))  # causal=1 is not causal=True
    assert key(aligned) != key(aligned[:2])  # another batch
    assert key(aligned) != key(aligned, k_scale=0.5) != key(aligned, k_scale=0.25)
    assert key(aligned, sinks=torch.zeros(32)) != key(aligned, sinks=torch.zeros(33)[1:])
    assert key(aligned, sinks="not a tensor") is None  # the full path raises its error
    before = key(aligned)
    monkeypatch.setenv("KV_KERNELS_SM90_DECODE", "0")  # the Gluon switch, read per call
    assert key(aligned) != before
    monkeypatch.delenv("KV_KERNELS_SM90_DECODE")
    assert key(aligned) == before
