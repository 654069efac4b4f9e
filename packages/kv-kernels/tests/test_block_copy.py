"""gather_blocks / scatter_blocks / copy_blocks: reference vs a logical oracle built from layer views,
Triton vs reference, round trips, validation and addressing past 2**31 bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_kernels import allocate_kv_cache, layer_view
from kv_kernels.block_copy import copy_blocks, gather_blocks, page_geometry, scatter_blocks
from kv_kernels.testing_cache import storage_bytes, with_page_padding
from kv_spec import KVCacheLayout, LayoutOrder

ORDERS = [o.value for o in LayoutOrder]


def make_layout(order: str, *, dtype: str = "float16", pad: int = 0, **kw) -> KVCacheLayout:
    fields = dict(
        order=order,
        num_layers=3,
        num_blocks=9,
        num_kv_heads=2,
        block_size=4,
        head_size=6,
        head_size_v=5,
        dtype=dtype,
    )
    fields.update(kw)
    return with_page_padding(KVCacheLayout(**fields), pad)


def random_cache(layout: KVCacheLayout, device: str = "cpu", seed: int = 0):
    storage = allocate_kv_cache(layout, device)
    g = torch.Generator().manual_seed(seed)
    for raw in storage_bytes(storage):
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g).to(raw.device))
    return storage


def page_oracle(storage, layout: KVCacheLayout, layer: int, block: int) -> torch.Tensor:
    """The bytes of page (layer, block) in the layout's physical order, from the logical view.

    Padding is not part of the logical view, so this covers the real page bytes; the tests
    compare the first ``real_page_size_bytes`` of each page and check padding separately.
    """
    view = layer_view(storage, layout, layer)[block]  # [H, N, C]
    inner = [d for d in layout.order.value if d not in "LB"]  # physical order of H, N, C
    perm = ["HNC".index(d) for d in inner]
    return view.permute(perm).contiguous().view(torch.uint8).reshape(-1).cpu()


def test_gather_reference_matches_logical_oracle_every_order() -> None:
    for order in ORDERS:
        pad = 24 if LayoutOrder(order).page_contiguous else 0
        layout = make_layout(order, pad=pad)
        storage = random_cache(layout, seed=1)
        ids = [7, 0, 3, 3, 8]  # shuffled, with a repeat (allowed for a gather)
        out = torch.zeros(len(ids), layout.num_layers * layout.page_bytes, dtype=torch.uint8)
        gather_blocks(storage, layout, ids, out, impl="reference")
        real = layout.real_page_size_bytes
        for i, b in enumerate(ids):
            for layer in range(layout.num_layers):
                page = out[i, layer * layout.page_bytes : (layer + 1) * layout.page_bytes]
                assert torch.equal(page[:real], page_oracle(storage, layout, layer, b)), (
                    order,
                    i,
                    layer,
                )


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_triton_matches_reference(order: str, dtype: str, triton_device: str) -> None:
    pad = 32 if LayoutOrder(order).page_contiguous else 0
    kw = {"kv_quant": "int8_per_token_head"} if dtype == "int8" else {}
    layout = make_layout(order, dtype=dtype, pad=pad, **kw)
    ids = torch.tensor([5, 0, 8, 2])
    dst = torch.tensor([1, 6, 4, 7])
    results = []
    for impl, device in (("reference", "cpu"), ("triton", triton_device)):
        storage = random_cache(layout, device, seed=2)
        out = torch.zeros(
            4, layout.num_layers * layout.page_bytes, dtype=torch.uint8, device=device
        )
        gather_blocks(storage, layout, ids, out, impl=impl)
        buf = torch.randint(
            0, 256, out.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
        scatter_blocks(buf.to(device), storage, layout, dst, impl=impl)
        copy_blocks(storage, layout, [4, 1], [3, 0], impl=impl)
        results.append((out.cpu(), [r.cpu().clone() for r in storage_bytes(storage)]))
    (out_ref, raw_ref), (out_tri, raw_tri) = results
    assert torch.equal(out_ref, out_tri)
    for a, b in zip(raw_ref, raw_tri, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("order", ORDERS)
def test_round_trip_moves_exactly_the_blocks(order: str, triton_device: str) -> None:
    """gather from one cache, scatter into another at other ids: those pages (padding included)
    match and every other byte of the destination is untouched."""
    pad = 8 if LayoutOrder(order).page_contiguous else 0
    layout = make_layout(order, pad=pad)
    src = random_cache(layout, triton_device, seed=4)
    dst = random_cache(layout, triton_device, seed=5)
    pristine = random_cache(layout, triton_device, seed=5)  # what dst holds before the scatter
    src_ids, dst_ids = [2, 8, 5], [0, 7, 3]
    buf = torch.empty(
        3, layout.num_layers * layout.page_bytes, dtype=torch.uint8, device=triton_device
    )
    gather_blocks(src, layout, src_ids, buf, impl="triton")
    scatter_blocks(buf, dst, layout, dst_ids, impl="triton")
    for layer in range(layout.num_layers):
        a = layer_view(src, layout, layer)[src_ids]
        b = layer_view(dst, layout, layer)[dst_ids]
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        others = [i for i in range(layout.num_blocks) if i not in dst_ids]
        now = layer_view(dst, layout, layer)[others]
        assert torch.equal(
            now.view(torch.int16), layer_view(pristine, layout, layer)[others].view(torch.int16)
        )


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    order=st.sampled_from(ORDERS),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    block_size=st.integers(1, 5),
    head_size=st.integers(1, 7),
    dtype=st.sampled_from(["float32", "float16", "int8"]),
    n=st.integers(0, 4),
    seed=st.integers(0, 1000),
)
def test_reference_gather_scatter_property(
    order: str,
    layers: int,
    heads: int,
    block_size: int,
    head_size: int,
    dtype: str,
    n: int,
    seed: int,
) -> None:
    kw = {"kv_quant": "int8_per_token_head"} if dtype == "int8" else {}
    layout = make_layout(
        order, dtype=dtype, num_layers=layers, num_kv_heads=heads, block_size=block_size,
        head_size=head_size, head_size_v=head_size + 1, num_blocks=6, **kw,
    )  # fmt: skip
    storage = random_cache(layout, seed=seed)
    ids = torch.randperm(6, generator=torch.Generator().manual_seed(seed))[:n]
    out = torch.empty(n, layers * layout.page_bytes, dtype=torch.uint8)
    gather_blocks(storage, layout, ids, out, impl="reference")
    for i, b in enumerate(ids.tolist()):
        for layer in range(layers):
            page = out[i, layer * layout.page_bytes : (layer + 1) * layout.page_bytes]
            assert torch.equal(page, page_oracle(storage, layout, layer, b))
    fresh = allocate_kv_cache(layout)
    scatter_blocks(out, fresh, layout, ids, impl="reference")
    for layer in range(layers):
        got = layer_view(fresh, layout, layer)[ids].contiguous().view(torch.uint8)
        want = layer_view(storage, layout, layer)[ids].contiguous().view(torch.uint8)
        assert torch.equal(got, want)


def test_buffer_rows_may_be_strided(triton_device: str) -> None:
    layout = make_layout("BLNHC")
    storage = random_cache(layout, triton_device, seed=6)
    row = layout.num_layers * layout.page_bytes
    big = torch.zeros(3, row + 64, dtype=torch.uint8, device=triton_device)
    out = big[:, :row]  # rows of a larger pool
    gather_blocks(storage, layout, [4, 1, 2], out, impl="triton")
    expect = torch.zeros(3, row, dtype=torch.uint8, device=triton_device)
    gather_blocks(storage, layout, [4, 1, 2], expect, impl="reference")
    assert torch.equal(out, expect)
    assert int(big[:, row:].count_nonzero()) == 0


# ---- validation ------------------------------------------------------------------------------------


def test_validation_errors() -> None:
    layout = make_layout("LBNHC")
    storage = allocate_kv_cache(layout)
    row = layout.num_layers * layout.page_bytes
    out = torch.empty(2, row, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"block id 9, outside \[0, num_blocks=9\)"):
        gather_blocks(storage, layout, [0, 9], out)
    with pytest.raises(ValueError, match="block id -1"):
        gather_blocks(storage, layout, [-1, 2], out)
    with pytest.raises(ValueError, match=r"expected uint8 \[2, "):
        gather_blocks(storage, layout, [0, 1], torch.empty(2, row, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"expected uint8 \[3, "):
        gather_blocks(storage, layout, [0, 1, 2], out)
    with pytest.raises(ValueError, match="duplicate"):
        scatter_blocks(out, storage, layout, [3, 3])
    with pytest.raises(ValueError, match="duplicate"):
        copy_blocks(storage, layout, [1, 2], [4, 4])
    with pytest.raises(ValueError, match="both sources and destinations"):
        copy_blocks(storage, layout, [1, 2], [2, 5])
    with pytest.raises(ValueError, match="pair them"):
        copy_blocks(storage, layout, [1, 2], [5])
    with pytest.raises(ValueError, match="list of 3 per-layer tensors"):
        gather_blocks(storage[0], layout, [0, 1], out)
    with pytest.raises(ValueError, match="3 layer slots"):
        gather_blocks(storage[:2], layout, [0, 1], out)
    transposed = torch.empty(layout.layer_shape[::-1], dtype=torch.float16).permute(3, 2, 1, 0)
    with pytest.raises(ValueError, match="not a layer view"):
        gather_blocks([transposed] * 3, layout, [0, 1], out)
    slab_layout = make_layout("BLHNC")
    with pytest.raises(ValueError, match="cross-layer"):
        gather_blocks(storage, slab_layout, [0, 1], out)
    with pytest.raises(ValueError, match="is not a valid implementation"):
        gather_blocks(storage, layout, [0, 1], out, impl="fast")


def test_triton_refuses_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = make_layout("LBNHC")
    storage = allocate_kv_cache(layout)
    out = torch.empty(1, layout.num_layers * layout.page_bytes, dtype=torch.uint8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gather_blocks(storage, layout, [0], out, impl="triton")


# ---- 64-bit addressing -----------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_offsets_past_2_31_bytes(order: str, impl: str, request: pytest.FixtureRequest) -> None:
    """Blocks whose byte offsets pass 2**31 (a lazily backed ``torch.empty`` allocation)."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    if device != "cpu":
        pytest.skip("the real >2**31 allocation runs in the gpu test")
    page = 16 * 2 * 64  # bytes: N x H x C x 1
    num_blocks = 2**31 // page + 4
    layers = 1 if order == "LBNHC" else 2
    layout = KVCacheLayout(
        order=order, num_layers=layers, num_blocks=num_blocks, num_kv_heads=2, block_size=16,
        head_size=32, head_size_v=24, dtype="int8", kv_quant="int8_per_token_head",
    )  # fmt: skip
    assert layout.num_blocks * layout.block_stride_bytes > 2**31
    storage = allocate_kv_cache(layout, zero=False)
    last = [num_blocks - 1, num_blocks - 3]
    src = torch.randint(-128, 127, (2, layers * layout.page_bytes), dtype=torch.int8).view(
        torch.uint8
    )
    scatter_blocks(src, storage, layout, last, impl=impl)
    back = torch.zeros_like(src)
    gather_blocks(storage, layout, last, back, impl=impl)
    assert torch.equal(back, src)
    copy_blocks(storage, layout, [last[0]], [5], impl=impl)
    one = torch.zeros(1, src.shape[1], dtype=torch.uint8)
    gather_blocks(storage, layout, [5], one, impl="reference")
    assert torch.equal(one[0], src[0])


# ---- GPU: pinned host <-> GPU, GPU <-> GPU, real large allocation -----------------------------


def _gpu_layout(order: str) -> KVCacheLayout:
    return KVCacheLayout(
        order=order, num_layers=4, num_blocks=64, num_kv_heads=8, block_size=16, head_size=128,
        head_size_v=128, dtype="bfloat16",
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("order", ORDERS)
def test_gpu_pinned_host_gather_scatter(order: str) -> None:
    layout = _gpu_layout(order)
    storage = random_cache(layout, "cuda", seed=1)
    ids = torch.tensor([63, 0, 17, 5, 40])
    row = layout.num_layers * layout.page_bytes
    pinned = torch.zeros(5, row, dtype=torch.uint8, pin_memory=True)
    gather_blocks(storage, layout, ids, pinned)  # auto -> triton, writing host memory over UVA
    torch.cuda.synchronize()
    expected = torch.zeros(5, row, dtype=torch.uint8)
    gather_blocks(storage, layout, ids, expected, impl="reference")
    assert torch.equal(pinned, expected)
    dst = random_cache(layout, "cuda", seed=2)
    dst_ids = torch.tensor([1, 2, 3, 60, 61])
    scatter_blocks(pinned, dst, layout, dst_ids)  # triton, reading host memory over UVA
    for layer in range(layout.num_layers):
        a = layer_view(storage, layout, layer)[ids.cuda()].view(torch.int16)
        b = layer_view(dst, layout, layer)[dst_ids.cuda()].view(torch.int16)
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["LBNHC", "LHBNC", "BLHNC"])
def test_gpu_device_gather_and_copy_blocks(order: str) -> None:
    layout = _gpu_layout(order)
    ids = torch.tensor([9, 3, 33, 12], device="cuda")  # ids on the GPU: no host round trip
    results = []
    for impl in ("reference", "triton"):
        storage = random_cache(layout, "cuda", seed=3)
        out = torch.empty(
            4, layout.num_layers * layout.page_bytes, dtype=torch.uint8, device="cuda"
        )
        gather_blocks(storage, layout, ids, out, impl=impl)
        copy_blocks(storage, layout, [9, 3], [50, 51], impl=impl)
        results.append((out, [r.clone() for r in storage_bytes(storage)]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_pageable_host_buffer_is_refused() -> None:
    layout = _gpu_layout("LBNHC")
    storage = allocate_kv_cache(layout, "cuda")
    out = torch.empty(1, layout.num_layers * layout.page_bytes, dtype=torch.uint8)  # not pinned
    with pytest.raises(ValueError, match="pinned host memory"):
        gather_blocks(storage, layout, [0], out, impl="triton")
    gather_blocks(
        storage, layout, [0], out, impl="reference"
    )  # the reference takes any device pair


@pytest.mark.gpu
def test_gpu_real_allocation_past_2_31_bytes() -> None:
    layout = KVCacheLayout(
        order="BLNHC", num_layers=2, num_blocks=2**31 // (2 * 65536) + 8, num_kv_heads=8, block_size=16,
        head_size=128, head_size_v=128, dtype="bfloat16",
    )  # fmt: skip
    assert layout.total_bytes > 2**31
    storage = allocate_kv_cache(layout, "cuda", zero=False)
    last = [layout.num_blocks - 1, layout.num_blocks - 5]
    src = torch.randint(0, 256, (2, 2 * layout.page_bytes), dtype=torch.uint8, pin_memory=True)
    scatter_blocks(src, storage, layout, last)
    back = torch.zeros(src.shape, dtype=torch.uint8, pin_memory=True)
    gather_blocks(storage, layout, last, back)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    del storage
    torch.cuda.empty_cache()


@pytest.mark.parametrize("order", ["LBNHC", "BLNHC", "LHBNC"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_page_geometry_given_once_copies_the_same_bytes(
    order: str, impl: str, request: pytest.FixtureRequest
) -> None:
    """``page_geometry(kv_cache, layout)`` computed once and passed as ``kv_cache`` (a connector
    copying chunk after chunk from its registered cache) moves exactly the bytes the storage
    does; and it is the geometry's cache that is read (planted: another cache's geometry gives
    that cache's bytes, so a geometry that were ignored would be caught)."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    layout = make_layout(order)
    src, other = random_cache(layout, device, seed=6), random_cache(layout, device, seed=7)
    geo = page_geometry(src, layout)
    row = layout.num_layers * layout.page_bytes
    ids = [4, 0, 7]
    want = torch.empty(3, row, dtype=torch.uint8, device=device)
    gather_blocks(src, layout, ids, want, impl=impl)
    for _ in range(2):  # the same geometry, again
        got = torch.zeros_like(want)
        gather_blocks(geo, layout, ids, got, impl=impl)
        assert torch.equal(got, want)
    from_other = torch.zeros_like(want)
    gather_blocks(page_geometry(other, layout), layout, ids, from_other, impl=impl)
    assert not torch.equal(from_other, want)
    # scatter through the geometry: the blocks land in src, byte for byte
    dst = random_cache(layout, device, seed=8)
    scatter_blocks(want, page_geometry(dst, layout), layout, [1, 2, 3], impl=impl)
    back = torch.empty_like(want)
    gather_blocks(dst, layout, [1, 2, 3], back, impl=impl)
    assert torch.equal(back, want)


def test_a_page_geometry_of_another_layout_is_refused() -> None:
    layout = make_layout("BLNHC")
    geo = page_geometry(random_cache(layout), layout)
    bigger = make_layout("BLNHC", num_blocks=10)
    out = torch.empty(1, layout.num_layers * layout.page_bytes, dtype=torch.uint8)
    with pytest.raises(
        ValueError,
        match=r"PageGeometry given as kv_cache has .*\(3, 9, \d+\) but the layout has \(3, 10, ",
    ):
        gather_blocks(geo, bigger, [0], out)
    with pytest.raises(ValueError, match="layout has"):
        scatter_blocks(out, geo, bigger, [0])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_load_only_copies_nothing(impl: str, request: pytest.FixtureRequest) -> None:
    """``load_only=True`` checks the call and (Triton) loads its kernel over an empty grid, but
    reads and writes no byte: the cache and the buffer stay as they were, where the same calls
    without it (the planted contrast) change both."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    layout = make_layout("LBNHC")
    cache = random_cache(layout, device, seed=9)
    before = [r.clone() for r in storage_bytes(cache)]
    row = layout.num_layers * layout.page_bytes
    buf = torch.full((2, row), 7, dtype=torch.uint8, device=device)
    gather_blocks(cache, layout, [1, 4], buf, impl=impl, load_only=True)
    scatter_blocks(buf, cache, layout, [2, 5], impl=impl, load_only=True)
    assert bool((buf == 7).all())
    assert all(torch.equal(a, b) for a, b in zip(before, storage_bytes(cache), strict=True))
    with pytest.raises(ValueError, match="block_ids"):  # still checked
        scatter_blocks(buf, cache, layout, [2, 99], impl=impl, load_only=True)
    gather_blocks(cache, layout, [1, 4], buf, impl=impl)
    scatter_blocks(buf, cache, layout, [2, 5], impl=impl)
    assert not bool((buf == 7).all())
    assert not all(torch.equal(a, b) for a, b in zip(before, storage_bytes(cache), strict=True))
