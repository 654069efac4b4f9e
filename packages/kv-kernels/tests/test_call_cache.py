"""The call caches of reshape_and_cache and the fused ops (kv_kernels._call_cache), on the CPU:
tensors seen as ``cuda:0`` and Triton launches stubbed (kv_kernels.testing_launch).

A cached call must launch exactly what the full path launches; any change of a key field
must send the call back through the checks (a bad input raises the same error as on its
first call); ``KV_KERNELS_VALIDATE=1`` and ``_call_cache.ENABLED = False`` bypass the cache.
A planted bug (a key that drops the dtype) must be caught by the same test."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_kernels import _call_cache, testing_launch
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.fused import rms_norm, rope_and_cache, rotary_embedding, silu_and_mul
from kv_kernels.reshape_and_cache import reshape_and_cache
from kv_kernels.testing_launch import fake_cuda, stubbed_cuda
from kv_spec import KVCacheLayout, LayoutOrder

rc_api = importlib.import_module("kv_kernels.reshape_and_cache.api")
fused_api = importlib.import_module("kv_kernels.fused.api")
fused_fast = importlib.import_module("kv_kernels.fused._fast")

H, D, BLOCK = 2, 16, 4


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Stubbed CUDA, fresh caches, launches recorded, and a count of full-path checks."""
    monkeypatch.delenv("KV_KERNELS_VALIDATE", raising=False)
    monkeypatch.setattr(_call_cache, "ENABLED", True)
    for cache in (rc_api._CALLS, fused_fast.NORM, fused_fast.ACT, fused_fast.ROPE):
        cache.clear()
    fused_fast.ROPE_CACHE.clear()
    checks = {"n": 0}
    real_rc, real_fused = rc_api._resolve_impl, fused_api.resolve_impl

    def rc_counted(*a: Any, **kw: Any) -> Any:
        checks["n"] += 1
        return real_rc(*a, **kw)

    def fused_counted(*a: Any, **kw: Any) -> Any:
        checks["n"] += 1
        return real_fused(*a, **kw)

    monkeypatch.setattr(rc_api, "_resolve_impl", rc_counted)
    monkeypatch.setattr(fused_api, "resolve_impl", fused_counted)
    monkeypatch.setattr(testing_launch, "LAUNCHES", [])
    with stubbed_cuda():
        yield checks


def _layout(dtype: str = "bfloat16") -> KVCacheLayout:
    return KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=8, num_kv_heads=H, block_size=BLOCK,
        head_size=D, head_size_v=D, dtype=dtype,
    )  # fmt: skip


def _inputs(t: int = 3) -> dict[str, Any]:
    bf = torch.bfloat16
    layout = _layout()
    return dict(
        layout=layout,
        kv=fake_cuda(layer_view(allocate_kv_cache(layout, "cpu", zero=True), layout, 0)),
        key=fake_cuda(torch.randn(t, H, D, dtype=bf)),
        value=fake_cuda(torch.randn(t, H, D, dtype=bf)),
        q=fake_cuda(torch.randn(t, 2 * H, D, dtype=bf)),
        slots=fake_cuda(torch.tensor([0, 5, -1, 9, 12, 3][:t], dtype=torch.int64)),
        positions=fake_cuda(torch.arange(t, dtype=torch.int64)),
        cos_sin=fake_cuda(torch.randn(64, D)),
        x=fake_cuda(torch.randn(t, 32, dtype=bf)),
        res=fake_cuda(torch.randn(t, 32, dtype=bf)),
        w=fake_cuda(torch.randn(32, dtype=bf)),
        gate_up=fake_cuda(torch.randn(t, 64, dtype=bf)),
        y=fake_cuda(torch.empty(t, 32, dtype=bf)),
        h=fake_cuda(torch.empty(t, 32, dtype=bf)),
    )


def _ops(i: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """Each op's call over ``i`` (so a test can swap one input; outputs given, so that two
    calls launch on the same tensors)."""
    return {
        "reshape_and_cache": lambda **o: reshape_and_cache(
            o.get("key", i["key"]), i["value"], o.get("kv", i["kv"]), o.get("slots", i["slots"]),
            i["layout"],
        ),
        "rms_norm": lambda **o: rms_norm(
            o.get("x", i["x"]), i["w"], 1e-6, residual=i["res"], out=i["y"], residual_out=i["h"]
        ),
        "silu_and_mul": lambda **o: silu_and_mul(o.get("x", i["gate_up"]), out=i["y"]),
        "rotary_embedding": lambda **o: rotary_embedding(
            o.get("positions", i["positions"]), o.get("q", i["q"]), i["key"], i["cos_sin"]
        ),
        "rope_and_cache": lambda **o: rope_and_cache(
            o.get("positions", i["positions"]), o.get("q", i["q"]), o.get("key", i["key"]),
            i["value"], i["cos_sin"], o.get("kv", i["kv"]), o.get("slots", i["slots"]),
            i["layout"],
        ),
    }  # fmt: skip


OPS = ["reshape_and_cache", "rms_norm", "silu_and_mul", "rotary_embedding", "rope_and_cache"]


def _same_launch(a: Any, b: Any) -> bool:
    """Two recorded launches alike: kernel, grid, and each argument (tensors by identity)."""
    if a[0] != b[0] or a[1] != b[1] or len(a[2]) != len(b[2]):
        return False
    for x, y in zip(a[2], b[2], strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.data_ptr() != y.data_ptr() or x.dtype != y.dtype or x.stride() != y.stride():
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


@pytest.mark.parametrize("op", OPS)
def test_a_repeated_call_skips_the_checks_and_launches_the_same(stub: Any, op: str) -> None:
    call = _ops(_inputs())[op]
    call()
    assert stub["n"] == 1
    call()
    call()
    assert stub["n"] == 1  # the second and third calls were hits
    launches = testing_launch.LAUNCHES
    assert launches is not None and len(launches) == 3
    # the first launch went the plain way (kernel[grid]), the others through the bound launcher
    # with the cached plan: the same kernel, grid and arguments
    assert _same_launch(launches[0], launches[1]) and _same_launch(launches[1], launches[2])


# A bad variant of one input per key field: each must miss and raise the full path's error.
_BAD: dict[str, list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], str]]] = {
    "reshape_and_cache": [
        ("dtype", lambda i: {"key": fake_cuda(i["key"].float())}, "dtype"),
        ("shape", lambda i: {"key": fake_cuda(i["key"][:2])}, "tokens"),
        ("slot dtype", lambda i: {"slots": fake_cuda(i["slots"].int())}, "int64"),
        ("cache", lambda i: {"kv": fake_cuda(i["kv"][:4])}, "layer view"),
    ],
    "rms_norm": [
        ("dtype", lambda i: {"x": fake_cuda(i["x"].float())}, "must match x"),
        ("shape", lambda i: {"x": fake_cuda(i["x"][:, :16])}, "weight has shape"),
        ("stride", lambda i: {"x": fake_cuda(i["x"].t().contiguous().t())}, "stride"),
    ],
    "silu_and_mul": [
        ("dtype", lambda i: {"x": fake_cuda(i["gate_up"].int())}, "not supported"),
        ("shape", lambda i: {"x": fake_cuda(i["gate_up"][:, :63])}, "even width"),
        ("stride", lambda i: {"x": fake_cuda(i["gate_up"].t().contiguous().t())}, "stride"),
    ],
    "rotary_embedding": [
        ("dtype", lambda i: {"q": fake_cuda(i["q"].float())}, "share dtype"),
        ("positions", lambda i: {"positions": fake_cuda(i["positions"].float())}, "int64"),
        ("address", lambda i: {"q": i["key"]}, "same element"),
    ],
    "rope_and_cache": [
        ("dtype", lambda i: {"key": fake_cuda(i["key"].half())}, "dtype"),
        ("slot dtype", lambda i: {"slots": fake_cuda(i["slots"].int())}, "int64"),
        ("slot count", lambda i: {"slots": fake_cuda(i["slots"][:2])}, "tokens"),
    ],
}


def _bad_inputs_raise(op: str) -> bool:
    """After a validated call, each bad variant raises its error (a cached key that ignored the
    changed field would launch it instead)."""
    i = _inputs()
    call = _ops(i)[op]
    call()
    call()
    for _, change, message in _BAD[op]:
        try:
            call(**change(i))
        except (ValueError, TypeError) as e:
            if message not in str(e):
                raise
            continue
        return False
    return True


@pytest.mark.parametrize("op", OPS)
def test_any_changed_key_field_misses_and_raises_the_full_paths_error(stub: Any, op: str) -> None:
    assert _bad_inputs_raise(op)


def test_a_planted_key_without_the_dtype_is_caught(
    stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _call_cache.tensor_key

    def no_dtype(t: Any) -> Any:
        k = real(t)
        return None if k is None else (*k[:3], *k[4:])

    for module in (rc_api, fused_fast):
        monkeypatch.setattr(module, "tensor_key", no_dtype)
    assert not _bad_inputs_raise("reshape_and_cache")
    assert not _bad_inputs_raise("rms_norm")


@pytest.mark.parametrize("op", OPS)
def test_validate_mode_and_the_switch_take_the_full_path(
    stub: Any, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = _ops(_inputs())[op]
    monkeypatch.setenv("KV_KERNELS_VALIDATE", "1")
    call()
    call()
    assert stub["n"] == 2
    monkeypatch.setenv("KV_KERNELS_VALIDATE", "0")
    call()
    call()
    assert stub["n"] == 3
    monkeypatch.setattr(_call_cache, "ENABLED", False)
    call()
    assert stub["n"] == 4


def test_address_checks_run_on_every_cached_call(stub: Any) -> None:
    i = _inputs()
    x, res = i["x"], i["res"]
    out = fake_cuda(torch.empty_like(x))
    rms_norm(x, i["w"], 1e-6, residual=res, out=out, residual_out=res)
    rms_norm(x, i["w"], 1e-6, residual=res, out=out, residual_out=res)
    assert stub["n"] == 1
    # same shapes, strides, dtypes and alignment, but out and residual_out now share memory
    with pytest.raises(ValueError, match="share memory"):
        rms_norm(x, i["w"], 1e-6, residual=res, out=res, residual_out=res)
    gate_up = i["gate_up"]
    y = fake_cuda(torch.empty(3, 32, dtype=torch.bfloat16))
    silu_and_mul(gate_up, out=y)
    silu_and_mul(gate_up, out=y)
    with pytest.raises(ValueError, match="overlaps x"):
        silu_and_mul(gate_up, out=fake_cuda(gate_up[:, :32]))


def test_a_float_scale_is_keyed_by_value(stub: Any) -> None:
    """fp8 per-tensor: a scale's check reads its value, so another value is another key."""
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=8, num_kv_heads=H, block_size=BLOCK,
        head_size=D, head_size_v=D, dtype="float8_e5m2", kv_quant="fp8_per_tensor",
    )  # fmt: skip
    kv = fake_cuda(layer_view(allocate_kv_cache(layout, "cpu", zero=True), layout, 0))
    k, v = (fake_cuda(torch.randn(3, H, D)) for _ in range(2))
    slots = fake_cuda(torch.tensor([0, 1, 2]))
    reshape_and_cache(k, v, kv, slots, layout, 0.5, 0.5)
    reshape_and_cache(k, v, kv, slots, layout, 0.5, 0.5)
    assert stub["n"] == 1
    with pytest.raises(ValueError, match="finite and > 0"):
        reshape_and_cache(k, v, kv, slots, layout, -0.5, 0.5)
    launches = testing_launch.LAUNCHES
    assert launches is not None
    scale = launches[-1][2][5]  # the k_scale tensor of the last (cached) launch
    assert float(scale[0]) == 0.5
