"""The block copies' bound launch (``block_copy.triton._COPY``, a ``FastLauncher``): its key must
hold every value Triton specializes a copy on, or a bound launch would run another call's variant.

- Over gathers, scatters and copies of per-layer and cross-layer caches, buffers at aligned and
  unaligned addresses, row counts of each integer class, with and without an error flag: calls
  with equal keys specialize alike under a model of Triton's binder
  (``kv_kernels.testing_launch``), and a planted key without the pointers' alignment is caught.
- With Triton stubbed, a bound launch passes the kernel what the plain launch passed.
(On a GPU, ``KV_KERNELS_CHECK_LAUNCH=1`` checks every bound copy against Triton's own binder.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_kernels import _launch, testing_launch
from kv_kernels.block_copy import page_geometry
from kv_kernels.cache import allocate_kv_cache
from kv_kernels.testing_cache import small_layout
from kv_kernels.testing_launch import stubbed_cuda

tri = importlib.import_module("kv_kernels.block_copy.triton")


#: a per-layer (L-outer, a layer-address table) and a cross-layer cache
LAYOUTS = {o: small_layout(o, num_blocks=40, dtype="float16") for o in ("LBNHC", "BLNHC")}


def _buffer(rows: int, width: int, offset: int) -> torch.Tensor:
    """uint8 ``[rows, width]`` rows starting ``offset`` bytes into a 64-byte aligned block."""
    raw = torch.zeros(rows * width + 64 + offset, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 64 + offset
    return raw[skip : skip + rows * width].view(rows, width)


def _calls() -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """``(key, args, kwargs)`` of copies over every shape this test varies."""
    out = []
    for layout in LAYOUTS.values():
        geo = page_geometry(allocate_kv_cache(layout, "cpu", zero=True), layout)
        width = layout.num_layers * layout.page_bytes
        for rows, shift in ((1, 0), (2, 1), (16, 0), (16, 1), (17, 0), (32, 1)):
            # shift 1: the ids start 8 bytes into their allocation (not 16-byte aligned)
            ids = (torch.arange(rows + shift, dtype=torch.int64) + 3)[shift:]
            for offset in (0, 16, 8, 1):
                buf = _buffer(rows, width, offset)
                for flag in (None, torch.zeros(1, dtype=torch.int32)):
                    gather = (tri._cache_side(geo, ids), tri._buffer_side(buf, geo))
                    scatter = (tri._buffer_side(buf, geo), tri._cache_side(geo, ids))
                    both = (tri._cache_side(geo, ids), tri._cache_side(geo, ids + 1))
                    for src, dst in (gather, scatter, both):
                        key, _grid, args, kwargs = tri._launch_call(
                            src, dst, geo, rows, flag, False
                        )
                        out.append((key, args, kwargs))
    return out


def _spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _, spec, options = testing_launch._binder(*args, **kwargs)
    return tuple(spec), tuple(sorted(options.items()))


def _clashes(keyed: list[tuple[Any, Any]]) -> list[Any]:
    """Keys under which calls specialize differently."""
    seen: dict[Any, Any] = {}
    bad = []
    for key, spec in keyed:
        if seen.setdefault(key, spec) != spec:
            bad.append(key)
    return bad


def test_equal_keys_specialize_alike() -> None:
    calls = _calls()
    keyed = [(key, _spec(args, kwargs)) for key, args, kwargs in calls]
    assert not _clashes(keyed)
    assert len({key for key, _s in keyed}) > 20  # the shapes above do reach many variants


@pytest.mark.parametrize("drop", [0, 2], ids=["alignment", "integer classes"])
def test_a_planted_key_without_a_field_is_caught(drop: int) -> None:
    """Drop the pointers' alignment bits (ids 8 bytes into their allocation share a key with
    aligned ones; the buffers' own alignment is also in ALIGN) or the integers' classes (16 and
    17 rows) from the key: calls then share keys but not specializations, which the check above
    reports."""
    keyed = [(key[:drop] + key[drop + 1 :], _spec(a, kw)) for key, a, kw in _calls()]
    assert _clashes(keyed)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(testing_launch, "LAUNCHES", [])
    with stubbed_cuda():
        yield testing_launch.LAUNCHES


def test_a_bound_copy_passes_what_the_plain_one_passed(launches: list[Any]) -> None:
    layout = LAYOUTS["LBNHC"]
    geo = page_geometry(allocate_kv_cache(layout, "cpu", zero=True), layout)
    buf = _buffer(17, layout.num_layers * layout.page_bytes, 0)
    ids = torch.arange(17, dtype=torch.int64)
    call: Callable[[], Any] = lambda: tri._COPY(  # noqa: E731
        *tri._launch_call(
            tri._cache_side(geo, ids), tri._buffer_side(buf, geo), geo, 17, None, False
        )
    )
    hits = tri._COPY.hits
    call()  # plain: binds
    call()  # bound
    assert tri._COPY.hits == hits + 1
    (name0, grid0, args0), (name1, grid1, args1) = launches[-2:]
    assert name0 == name1 and grid0 == grid1 and len(args0) == len(args1)
    for a, b in zip(args0, args1, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
        else:
            assert a == b
    assert _launch.ENABLED
