"""reshape_and_cache: reference vs a float64 per-token oracle, Triton vs reference, validation,
and addressing past 2**31 elements. Quantized modes: ``test_reshape_and_cache_quant.py``; the
builders (layouts, random storages, slots, the write oracle): ``kv_kernels.testing_cache``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_kernels import allocate_kv_cache, layer_view
from kv_kernels.reshape_and_cache import read_kv, reshape_and_cache
from kv_kernels.testing_cache import (
    make_slots,
    oracle_write,
    random_storage,
    raw_bytes,
    small_layout,
    write_case,
    write_with_both_impls,
)
from kv_spec import KVCacheLayout, LayoutOrder

ORDERS = [o.value for o in LayoutOrder]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
# pad_every=0: no -1 slot, the reference's path without a padding mask (a decode step's usual batch)
@pytest.mark.parametrize("pad_every", [3, 0], ids=["padded", "unpadded"])
def test_reference_matches_oracle(order: str, dtype: str, pad_every: int) -> None:
    pad = 32 if LayoutOrder(order).page_contiguous else 0
    layout = small_layout(order, dtype=dtype, pad=pad)
    storage = random_storage(layout)
    torch_dtype = layer_view(storage, layout, 0).dtype
    n = 11
    key = torch.randn(n + 3, layout.num_kv_heads, layout.head_size).to(torch_dtype)  # padded T' > T
    value = torch.randn(n + 3, layout.num_kv_heads, layout.head_size_v).to(torch_dtype)
    slots = make_slots(n, layout, seed=1, pad_every=pad_every)
    view = layer_view(storage, layout, 1)
    expected = oracle_write(view.double(), key, value, slots, layout)
    other_before = layer_view(storage, layout, 0).double().clone()
    reshape_and_cache(key, value, view, slots, layout, impl="reference")
    assert torch.equal(view.double(), expected)
    assert torch.equal(
        layer_view(storage, layout, 0).double(), other_before
    )  # other layer untouched


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    ("dtype", "kv_quant", "is_mla"),
    [
        ("float32", "none", False),
        ("float16", "none", False),
        ("int8", "int8_per_token_head", False),
        ("float16", "none", True),
    ],
)
def test_triton_matches_reference(
    order: str, dtype: str, kv_quant: str, is_mla: bool, triton_device: str
) -> None:
    pad = 16 if LayoutOrder(order).page_contiguous else 0
    layout = small_layout(
        order,
        dtype=dtype,
        kv_quant=kv_quant,
        is_mla=is_mla,
        heads=1 if is_mla else 3,
        head_size=10,
        pad=pad,
    )
    in_dtype = torch.float16 if dtype in ("float16", "int8") else torch.float32
    n = 9
    g = torch.Generator().manual_seed(3)
    # key as a strided slice of a fused qkv-like buffer: non-contiguous token/head strides
    fused = torch.randn(n + 2, layout.num_kv_heads, 2 * layout.head_size + 5, generator=g).to(
        in_dtype
    )
    key = fused[..., 3 : 3 + layout.head_size]
    value = (
        None
        if is_mla
        else torch.randn(n + 2, layout.num_kv_heads, layout.head_size_v, generator=g).to(in_dtype)
    )
    slots = make_slots(n, layout, seed=4)
    results = []
    for impl, device in (("reference", "cpu"), ("triton", triton_device)):
        storage = random_storage(layout, device, seed=7)
        view = layer_view(storage, layout, 1)
        value_d = None if value is None else value.to(device)
        reshape_and_cache(key.to(device), value_d, view, slots.to(device), layout, impl=impl)
        results.append(raw_bytes(storage))
    for ref, tri in zip(*results, strict=True):
        assert torch.equal(ref, tri)


def test_launch_configs_cover_the_tile() -> None:
    """Every config the launcher picks tiles whole rows: powers of two, rows split evenly."""
    from kv_kernels.reshape_and_cache.triton import launch_config

    for kv_quant, dtype in (
        ("none", "bfloat16"), ("fp8_per_tensor", "fp8_e4m3"),
        ("int8_per_token_head", "int8"), ("fp8_per_token_head", "fp8_e4m3"),
    ):  # fmt: skip
        for heads, head, head_v in ((8, 128, 128), (3, 10, 6), (32, 256, 256), (1, 576, 576)):
            layout = small_layout(
                heads=heads, head_size=head, head_size_v=head_v, dtype=dtype, kv_quant=kv_quant
            )
            cfg = launch_config(layout, layout.element_bytes)
            for v in (cfg.block_t, cfg.block_h, cfg.num_warps, cfg.row_split):
                assert v >= 1 and v & (v - 1) == 0, cfg
            assert cfg.block_d >= head and cfg.block_d % cfg.row_split == 0, cfg


def test_triton_skips_padding_and_only_writes_its_slots(triton_device: str) -> None:
    layout = small_layout(
        "LBHNC", num_layers=1, num_blocks=3, heads=2, block_size=4, head_size=5, head_size_v=7
    )
    storage = random_storage(layout, triton_device, seed=5)
    before = raw_bytes(storage)[0]
    key = torch.randn(4, 2, 5, device=triton_device)
    value = torch.randn(4, 2, 7, device=triton_device)
    slots = torch.tensor([-1, -1, -1, -1], dtype=torch.int64, device=triton_device)
    reshape_and_cache(key, value, layer_view(storage, layout, 0), slots, layout, impl="triton")
    assert torch.equal(raw_bytes(storage)[0], before)
    slots = torch.tensor([-1, 9, -1], dtype=torch.int64, device=triton_device)  # T=3 < T'=4
    view = layer_view(storage, layout, 0)
    reshape_and_cache(key, value, view, slots, layout, impl="triton")
    k, v = read_kv(view, layout, torch.tensor([9]))
    assert torch.equal(k[0].cpu(), key[1].cpu())
    assert torch.equal(v[0].cpu(), value[1].cpu())
    changed = (raw_bytes(storage)[0] != before).nonzero().flatten()
    # only slot 9's 2 heads x (5 + 7) float32 elements may change
    assert changed.numel() <= 2 * 12 * 4


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    order=st.sampled_from(ORDERS),
    heads=st.integers(1, 5),
    block_size=st.sampled_from([1, 2, 3, 8]),
    head_size=st.integers(1, 12),
    head_size_v=st.integers(1, 12),
    num_tokens=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_reference_oracle_property(
    order: str,
    heads: int,
    block_size: int,
    head_size: int,
    head_size_v: int,
    num_tokens: int,
    seed: int,
) -> None:
    layout = small_layout(
        order,
        num_layers=1,
        num_blocks=4,
        heads=heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size_v,
    )
    storage = random_storage(layout, seed=seed)
    view = layer_view(storage, layout, 0)
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, heads, head_size, generator=g)
    value = torch.randn(num_tokens, heads, head_size_v, generator=g)
    slots = make_slots(min(num_tokens, layout.num_blocks * block_size), layout, seed, pad_every=2)
    key, value = key[: slots.numel()], value[: slots.numel()]
    expected = oracle_write(view.double(), key, value, slots, layout)
    reshape_and_cache(key, value, view, slots, layout, impl="reference")
    assert torch.equal(view.double(), expected)


# ---- validation ------------------------------------------------------------------------------------


def _good():
    layout = small_layout("LBNHC", num_layers=1)
    storage = allocate_kv_cache(layout)
    view = layer_view(storage, layout, 0)
    key = torch.randn(4, 3, 8)
    value = torch.randn(4, 3, 6)
    slots = torch.tensor([0, 1, 2, 3])
    return layout, view, key, value, slots


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(slots=torch.tensor([0, 28])), "past the cache's 28 slots"),
        (lambda a: a.update(slots=torch.tensor([0, 1], dtype=torch.int32)), "must be torch.int64"),
        (lambda a: a.update(key=torch.randn(1, 3, 8)), "never shorter"),
        (lambda a: a.update(key=torch.randn(4, 3, 9)), r"expected \[T', 3, 8\]"),
        (lambda a: a.update(key=torch.randn(4, 3, 8, dtype=torch.float64)), "never converts"),
        (lambda a: a.update(value=None), "value is None"),
        (lambda a: a.update(k_scale=1.0), "takes no external scale"),
        (lambda a: a.update(view=a["view"][:, :, :2]), "layer view"),
        (lambda a: a.update(impl="cuda"), "is not a valid implementation"),
    ],
)
def test_validation_errors(mutate, match: str) -> None:
    layout, view, key, value, slots = _good()
    args = {
        "view": view,
        "key": key,
        "value": value,
        "slots": slots,
        "k_scale": None,
        "impl": "reference",
    }
    mutate(args)
    with pytest.raises(ValueError, match=match):
        reshape_and_cache(
            args["key"],
            args["value"],
            args["view"],
            args["slots"],
            layout,
            args["k_scale"],
            impl=args["impl"],
        )


def test_fp8_scale_validation() -> None:
    layout = small_layout("LBNHC", num_layers=1, dtype="fp8_e4m3", kv_quant="fp8_per_tensor")
    view = layer_view(allocate_kv_cache(layout), layout, 0)
    key, value, slots = torch.randn(2, 3, 8), torch.randn(2, 3, 6), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="k_scale is required"):
        reshape_and_cache(key, value, view, slots, layout, None, 1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        reshape_and_cache(key, value, view, slots, layout, 0.0, 1.0)
    with pytest.raises(ValueError, match="per-head"):
        reshape_and_cache(key, value, view, slots, layout, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        reshape_and_cache(key, value, view, slots, layout, torch.tensor([1.0, -1.0, 1.0]), 1.0)
    mla = small_layout("LBNHC", num_layers=1, heads=1, is_mla=True)
    view = layer_view(allocate_kv_cache(mla), mla, 0)
    with pytest.raises(ValueError, match="must be None for an MLA layout"):
        reshape_and_cache(torch.randn(2, 1, 8), torch.randn(2, 1, 8), view, slots, mla)


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    layout, view, key, value, slots = _good()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        reshape_and_cache(key, value, view, slots, layout, impl="triton")


# ---- 64-bit addressing -----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_offsets_past_2_31_elements(impl: str, request: pytest.FixtureRequest) -> None:
    """A cache of > 2**31 elements, allocated lazily (``torch.empty`` pages are only backed once
    touched), written at its last blocks: int32 element offsets would wrap."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    if device != "cpu":
        pytest.skip("the real >2**31 allocation runs in the gpu test")
    page = 1 * 16 * 128  # H x N x C elements
    num_blocks = 2**31 // page + 8
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=num_blocks, num_kv_heads=1, block_size=16,
        head_size=64, head_size_v=64, dtype="float16",
    )  # fmt: skip
    assert layout.total_elements > 2**31
    storage = allocate_kv_cache(layout, zero=False)
    view = layer_view(storage, layout, 0)
    last = num_blocks * 16
    slots = torch.tensor([last - 1, last - 20, -1, 5], dtype=torch.int64)
    key = torch.randn(4, 1, 64).half()
    value = torch.randn(4, 1, 64).half()
    reshape_and_cache(key, value, view, slots, layout, impl=impl)
    k, v = read_kv(view, layout, slots[[0, 1, 3]])
    assert torch.equal(k, key[[0, 1, 3]].float())
    assert torch.equal(v, value[[0, 1, 3]].float())


# ---- GPU (bf16 numerics, real large allocation) ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_parity_unquantized(order: str, dtype: str) -> None:
    layout, key, value, slots = write_case(order, dtype)
    key, value = key.to(getattr(torch, dtype)), value.to(getattr(torch, dtype))
    ref, tri = write_with_both_impls(layout, key, value, slots)
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)
    keep = slots >= 0
    k, v = read_kv(layer_view(tri, layout, 1), layout, slots[keep])
    assert torch.equal(k, key[: slots.numel()][keep].float())
    assert torch.equal(v, value[: slots.numel()][keep].float())


@pytest.mark.gpu
def test_gpu_real_allocation_past_2_31_elements() -> None:
    """A real bf16 cache of more than 2**31 elements (~4.3 GB), written at its far end."""
    page = 8 * 16 * 256
    num_blocks = 2**31 // page + 64
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=num_blocks, num_kv_heads=8, block_size=16,
        head_size=128, head_size_v=128, dtype="bfloat16",
    )  # fmt: skip
    assert layout.total_elements > 2**31
    storage = allocate_kv_cache(layout, "cuda", zero=False)
    view = layer_view(storage, layout, 0)
    last = num_blocks * 16
    slots = torch.tensor([last - 1, last - 700, 3, -1, last - 16], dtype=torch.int64, device="cuda")
    key = torch.randn(5, 8, 128, device="cuda").bfloat16()
    value = torch.randn(5, 8, 128, device="cuda").bfloat16()
    reshape_and_cache(key, value, view, slots, layout)  # auto -> triton
    keep = torch.tensor([0, 1, 2, 4], device="cuda")
    k, v = read_kv(view, layout, slots[keep])
    assert torch.equal(k, key[keep].float())
    assert torch.equal(v, value[keep].float())
    del storage, view
    torch.cuda.empty_cache()
