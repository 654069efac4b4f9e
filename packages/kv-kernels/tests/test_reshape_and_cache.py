"""reshape_and_cache: reference vs a float64 per-token oracle, Triton vs reference, validation,
quantized modes, and addressing past 2**31 elements."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_kernels import allocate_kv_cache, layer_view
from kv_kernels.reshape_and_cache import read_kv, reshape_and_cache
from kv_spec import KVCacheLayout, LayoutOrder

ORDERS = [o.value for o in LayoutOrder]


def make_layout(
    order: str = "LBNHC",
    *,
    num_layers: int = 2,
    num_blocks: int = 7,
    heads: int = 3,
    block_size: int = 4,
    head_size: int = 8,
    head_size_v: int = 6,
    dtype: str = "float32",
    kv_quant: str = "none",
    is_mla: bool = False,
    pad: int = 0,
) -> KVCacheLayout:
    base = KVCacheLayout(
        order=order,
        num_layers=num_layers,
        num_blocks=num_blocks,
        num_kv_heads=heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=0 if is_mla else head_size_v,
        dtype=dtype,
        kv_quant=kv_quant,
        is_mla=is_mla,
    )
    if not pad:
        return base
    d = base.to_dict()
    d["page_size_bytes"] = base.page_bytes + pad
    return KVCacheLayout.from_dict(d)


def random_storage(layout: KVCacheLayout, device: str = "cpu", seed: int = 0):
    """A cache whose every byte (padding included) is random, so stray writes show."""
    storage = allocate_kv_cache(layout, device)
    tensors = [storage] if isinstance(storage, torch.Tensor) else storage
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        raw.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),), (1,))
        noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g)
        if layout.dtype in ("float32", "float16", "bfloat16"):
            # keep floats finite and moderate: random high bytes would be NaN/inf
            noise = torch.randn(raw.numel() // layout.element_bytes, generator=g)
            noise = noise.to(tensors[0].dtype).view(torch.uint8)
        raw.copy_(noise.to(raw.device))
    return storage


def raw_bytes(storage) -> list[torch.Tensor]:
    tensors = [storage] if isinstance(storage, torch.Tensor) else storage
    out = []
    for t in tensors:
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        raw.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),), (1,))
        out.append(raw.cpu().clone())
    return out


def make_slots(
    num_tokens: int, layout: KVCacheLayout, seed: int, pad_every: int = 3
) -> torch.Tensor:
    """Distinct shuffled slots over all blocks, with every ``pad_every``-th token -1."""
    g = torch.Generator().manual_seed(seed)
    total = layout.num_blocks * layout.block_size
    slots = torch.randperm(total, generator=g)[:num_tokens].to(torch.int64)
    if pad_every:
        slots[::pad_every] = -1
    return slots


def oracle_write(
    before: torch.Tensor,  # [B, H, N, C] float64 copy of the layer view
    key: torch.Tensor,
    value: torch.Tensor | None,
    slots: torch.Tensor,
    layout: KVCacheLayout,
) -> torch.Tensor:
    """The obvious per-token loop, in float64."""
    out = before.clone()
    k0, k1 = layout.k_range
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, layout.block_size)
        out[block, :, offset, k0:k1] = key[t].double()
        if value is not None:
            v0, v1 = layout.v_range
            out[block, :, offset, v0:v1] = value[t].double()
    return out


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
# pad_every=0: no -1 slot, the reference's path without a padding mask (a decode step's usual batch)
@pytest.mark.parametrize("pad_every", [3, 0], ids=["padded", "unpadded"])
def test_reference_matches_oracle(order: str, dtype: str, pad_every: int) -> None:
    pad = 32 if LayoutOrder(order).page_contiguous else 0
    layout = make_layout(order, dtype=dtype, pad=pad)
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
    layout = make_layout(
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


def hard_rows(num_tokens: int, heads: int, size: int, seed: int) -> torch.Tensor:
    """float32 ``[T, H, size]`` rows that stress the quantizer's two division paths: normal rows,
    rows spanning many binades, halfway quotients, -0.0, subnormals, all-zero and all -0.0 rows,
    and (in some tokens) rows whose absmax is below 2**-40 (subnormal rows among them: their
    reciprocal overflows) or above 2**60, which send their whole program to the per-element
    ``div_rn`` path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, heads, size, generator=g)
    x = x * torch.exp2(torch.randint(-30, 30, (num_tokens, heads, 1), generator=g).float())
    wide = torch.exp2(torch.randint(-60, 8, (num_tokens, heads, size), generator=g).float())
    x[::3] = (x[::3].sign() * wide[::3]).float()  # 68 binades inside a row
    x[:, :, 0] = -0.0
    x[1::4, 0, 1] = 1e-41  # a float32 subnormal
    x[2::5, -1] = 0.0
    x[3::5, 0] = -0.0
    if size > 2:  # halfway points of int8: absmax 127 makes the step exactly 1
        x[4::6, 0, 1], x[4::6, 0, 2] = 127.0, -2.5
    small = torch.randn(x[5::7, 0].shape, generator=g) * 1e-20  # absmax below 2**-40
    big = torch.randn(x[6::11, -1].shape, generator=g) * 1e25  # absmax above 2**60
    x[5::7, 0], x[6::11, -1] = small, big
    x[7::13, 1] = torch.randn(x[7::13, 1].shape, generator=g) * 1e-39  # subnormal rows
    return x


@pytest.mark.parametrize(
    ("head_size", "head_size_v", "word"),
    # C = head_size + head_size_v + 8 bytes; the scales start at head_size + head_size_v
    [(10, 6, 8), (6, 6, 4), (9, 6, 1), (128, 128, 8)],
)
def test_triton_int8_hard_values_and_scale_stores(
    head_size: int, head_size_v: int, word: int, triton_device: str
) -> None:
    """Bitwise parity with the reference on values that stress the reciprocal division path and
    its per-program fallback, for each inline-scale store width (8: K and V scale in one store;
    4: one per scale; 1: byte by byte)."""
    from kv_kernels.reshape_and_cache import triton as rc_triton

    layout = make_layout(
        "LBNHC", num_layers=1, num_blocks=12, heads=3, block_size=4, head_size=head_size,
        head_size_v=head_size_v, dtype="int8", kv_quant="int8_per_token_head",
    )  # fmt: skip
    n = 41  # not a multiple of any BLOCK_T
    key = hard_rows(n + 3, 3, head_size, seed=1)
    value = hard_rows(n + 3, 3, head_size_v, seed=2)
    slots = make_slots(n, layout, seed=6, pad_every=5)
    results = []
    for impl, device in (("reference", "cpu"), ("triton", triton_device)):
        storage = random_storage(layout, device, seed=9)
        view = layer_view(storage, layout, 0)
        if impl == "triton":
            assert rc_triton.scale_word(layout, view) == word
        reshape_and_cache(
            key.to(device), value.to(device), view, slots.to(device), layout, impl=impl
        )
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
            layout = make_layout(
                heads=heads, head_size=head, head_size_v=head_v, dtype=dtype, kv_quant=kv_quant
            )
            cfg = launch_config(layout, layout.element_bytes)
            for v in (cfg.block_t, cfg.block_h, cfg.num_warps, cfg.row_split):
                assert v >= 1 and v & (v - 1) == 0, cfg
            assert cfg.block_d >= head and cfg.block_d % cfg.row_split == 0, cfg


def test_triton_skips_padding_and_only_writes_its_slots(triton_device: str) -> None:
    layout = make_layout(
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
    layout = make_layout(
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


# ---- quantized caches (reference on the CPU; the Triton fp8 path is tested on the GPU) ------------


def test_int8_per_token_head_scales_and_error() -> None:
    layout = make_layout(
        "BLNHC", dtype="int8", kv_quant="int8_per_token_head", head_size=16, head_size_v=12
    )
    storage = allocate_kv_cache(layout)
    view = layer_view(storage, layout, 1)
    key = torch.randn(6, 3, 16, dtype=torch.float64) * 3
    value = torch.randn(6, 3, 12, dtype=torch.float64)
    key[2, 1] = 0  # an all-zero row stores scale 1.0
    slots = torch.tensor([0, 5, 9, 27, 14, 3])
    reshape_and_cache(key.float(), value.float(), view, slots, layout)
    k, v = read_kv(view, layout, slots)
    k_scale = key.abs().amax(-1) / 127  # float64 oracle of the scale
    v_scale = value.abs().amax(-1) / 127
    # dequantized error is at most half a quantization step (plus float32 rounding)
    assert ((k.double() - key).abs() <= k_scale[..., None] * 0.5 + 1e-6).all()
    assert ((v.double() - value).abs() <= v_scale[..., None] * 0.5 + 1e-6).all()
    assert torch.equal(k[2, 1], torch.zeros(16))
    raw = view.view(torch.uint8)[slots // 4, :, slots % 4]  # [T, H, C]
    scales = raw[..., 28:36].contiguous().view(torch.float32)  # [T, H, 2]
    assert scales[2, 1, 0].item() == 1.0
    torch.testing.assert_close(scales[..., 1].double(), v_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_per_tensor_reference(fp8: str, per_head: bool) -> None:
    layout = make_layout("LBNHC", dtype=fp8, kv_quant="fp8_per_tensor", head_size=8, head_size_v=8)
    storage = allocate_kv_cache(layout)
    view = layer_view(storage, layout, 0)
    key = torch.randn(5, 3, 8) * 4
    value = torch.randn(5, 3, 8)
    k_scale = torch.tensor([0.5, 0.25, 2.0]) if per_head else 0.5
    v_scale = torch.tensor([0.125]) if not per_head else torch.tensor([1.0, 0.5, 0.25])
    slots = torch.tensor([1, 2, 3, -1, 8])
    reshape_and_cache(key, value, view, slots, layout, k_scale, v_scale)
    keep = slots >= 0
    k, v = read_kv(view, layout, slots[keep], k_scale, v_scale)
    rel = 2.0**-4 if fp8 == "fp8_e4m3" else 2.0**-3  # half an ulp of the format, relative
    torch.testing.assert_close(k, key[keep], rtol=rel, atol=1e-2)
    torch.testing.assert_close(v, value[keep], rtol=rel, atol=1e-2)
    stored = view[slots[keep] // 4, :, slots[keep] % 4, :8].float()
    ks = k_scale if isinstance(k_scale, float) else k_scale[None, :, None]
    torch.testing.assert_close(stored, (key[keep] / ks).to(view.dtype).float())


def test_fp8_per_token_head_reference_and_mla() -> None:
    layout = make_layout(
        "LBHNC", dtype="fp8_e4m3", kv_quant="fp8_per_token_head", is_mla=True, heads=1, head_size=24
    )
    storage = allocate_kv_cache(layout)
    view = layer_view(storage, layout, 0)
    latent = torch.randn(7, 1, 24) * 10
    slots = torch.arange(7) * 3
    reshape_and_cache(latent, None, view, slots, layout)
    k, v = read_kv(view, layout, slots)
    assert v is None
    torch.testing.assert_close(k, latent, rtol=2.0**-4, atol=1e-3)
    raw = view.view(torch.uint8)[slots // 4, :, slots % 4]
    scale = raw[..., 24:28].contiguous().view(torch.float32)[..., 0]  # [T, 1]
    torch.testing.assert_close(scale, latent.abs().amax(-1) / 448.0)


# ---- validation ------------------------------------------------------------------------------------


def _good():
    layout = make_layout("LBNHC", num_layers=1)
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
    layout = make_layout("LBNHC", num_layers=1, dtype="fp8_e4m3", kv_quant="fp8_per_tensor")
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
    mla = make_layout("LBNHC", num_layers=1, heads=1, is_mla=True)
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


# ---- GPU (bf16 / fp8 numerics, real large allocation) -------------------------------------------


def _gpu_case(
    order: str, dtype: str, kv_quant: str = "none", *, num_tokens: int = 1000, seed: int = 0
):
    layout = make_layout(
        order, num_layers=2, num_blocks=96, heads=8, block_size=16, head_size=128, head_size_v=128,
        dtype=dtype, kv_quant=kv_quant,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    in_dtype = torch.bfloat16
    key = (torch.randn(num_tokens + 7, 8, 128, generator=g) * 3).to(in_dtype).cuda()
    value = torch.randn(num_tokens + 7, 8, 128, generator=g).to(in_dtype).cuda()
    slots = make_slots(num_tokens, layout, seed, pad_every=7).cuda()
    return layout, key, value, slots


def _write_both(layout, key, value, slots, k_scale=None, v_scale=None):
    out = []
    for impl in ("reference", "triton"):
        storage = random_storage(layout, "cuda", seed=11)
        reshape_and_cache(
            key, value, layer_view(storage, layout, 1), slots, layout, k_scale, v_scale, impl=impl
        )
        out.append(storage)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_parity_unquantized(order: str, dtype: str) -> None:
    layout, key, value, slots = _gpu_case(order, dtype)
    key, value = key.to(getattr(torch, dtype)), value.to(getattr(torch, dtype))
    ref, tri = _write_both(layout, key, value, slots)
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)
    keep = slots >= 0
    k, v = read_kv(layer_view(tri, layout, 1), layout, slots[keep])
    assert torch.equal(k, key[: slots.numel()][keep].float())
    assert torch.equal(v, value[: slots.numel()][keep].float())


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BHLNC"])
@pytest.mark.parametrize(
    ("dtype", "kv_quant", "scales"),
    [
        ("fp8_e4m3", "fp8_per_tensor", "float"),
        ("fp8_e4m3", "fp8_per_tensor", "per_head"),
        ("fp8_e5m2", "fp8_per_tensor", "tensor1"),
        ("fp8_e4m3", "fp8_per_token_head", None),
        ("fp8_e5m2", "fp8_per_token_head", None),
        ("int8", "int8_per_token_head", None),
    ],
)
def test_gpu_parity_quantized(order: str, dtype: str, kv_quant: str, scales: str | None) -> None:
    layout, key, value, slots = _gpu_case(order, dtype, kv_quant, seed=3)
    k_scale = v_scale = None
    # |k| < ~16, |v| < ~5.5: scales keep x / scale inside e4m3's 448 (values past it saturate)
    if scales == "float":
        k_scale, v_scale = 0.05, 0.02
    elif scales == "per_head":
        k_scale = torch.linspace(0.04, 0.1, 8, device="cuda")
        v_scale = torch.linspace(0.015, 0.05, 8, device="cuda")
    elif scales == "tensor1":
        k_scale, v_scale = torch.tensor(0.05, device="cuda"), torch.tensor([0.02], device="cuda")
    ref, tri = _write_both(layout, key, value, slots, k_scale, v_scale)
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)  # IEEE division and round-to-nearest-even casts on both sides
    keep = slots >= 0
    k, v = read_kv(layer_view(tri, layout, 1), layout, slots[keep], k_scale, v_scale)
    k_in, v_in = key[: slots.numel()][keep].float(), value[: slots.numel()][keep].float()
    # relative half-ulp of the format (int8: half a step of absmax / 127 per row)
    if dtype == "int8":
        step = k_in.abs().amax(-1, keepdim=True) / 127
        assert ((k - k_in).abs() <= step * 0.5 + 1e-6).all()
    else:
        rel = 2.0**-4 if dtype == "fp8_e4m3" else 2.0**-3
        torch.testing.assert_close(
            k, k_in, rtol=rel, atol=0.05 if kv_quant == "fp8_per_tensor" else 1e-2
        )
        torch.testing.assert_close(
            v, v_in, rtol=rel, atol=0.05 if kv_quant == "fp8_per_tensor" else 1e-2
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "kv_quant"),
    [
        ("fp8_e4m3", "fp8_per_tensor"),
        ("fp8_e5m2", "fp8_per_tensor"),
        ("fp8_e4m3", "fp8_per_token_head"),
        ("fp8_e5m2", "fp8_per_token_head"),
        ("int8", "int8_per_token_head"),
    ],
)
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
def test_gpu_parity_quantized_hard_values(dtype: str, kv_quant: str, in_dtype: str) -> None:
    """Bitwise parity on values that stress the reciprocal division (many binades in a row, -0.0,
    subnormals, halfway points, zero rows, inf and NaN for per-tensor) and the per-program
    fallback to ``div_rn`` (tiny and huge rows; per-head scales of 1e-25 and 1e25)."""
    layout = make_layout(
        "LBNHC", num_layers=2, num_blocks=96, heads=8, block_size=16, head_size=128,
        head_size_v=128, dtype=dtype, kv_quant=kv_quant,
    )  # fmt: skip
    n = 1001
    to = getattr(torch, in_dtype)
    key = hard_rows(n, 8, 128, seed=3).to(to)
    value = hard_rows(n, 8, 128, seed=4).to(to)
    k_scale = v_scale = None
    if kv_quant == "fp8_per_tensor":
        key[7, 2, 5], key[8, 3, 6], value[9, 1, 2] = float("inf"), float("-inf"), float("nan")
        k_scale = torch.tensor([0.05, 1e-3, 3.0, 1e-25, 0.5, 1e4, 2.0**-60, 7.0], device="cuda")
        v_scale = torch.tensor([0.02, 1e25, 1.0, 0.3, 2.0**60, 1e-2, 4.0, 0.125], device="cuda")
    slots = make_slots(n, layout, seed=5, pad_every=9).cuda()
    ref, tri = _write_both(layout, key.cuda(), value.cuda(), slots, k_scale, v_scale)
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)


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
