"""reshape_and_cache into quantized caches: int8 / fp8 per-token-head (scales inline in the page)
and fp8 per-tensor, on the reference against float64 scale oracles, and the Triton kernel bitwise
against the reference on values that stress the quantizer's division paths (interpreted, and on
the GPU for every mode). Builders: ``kv_kernels.testing_cache``."""

from __future__ import annotations

import pytest
import torch
from kv_kernels import allocate_kv_cache, layer_view
from kv_kernels.cache import scale_plane_view
from kv_kernels.reshape_and_cache import read_kv, reshape_and_cache
from kv_kernels.testing_cache import (
    hard_rows,
    make_slots,
    random_storage,
    raw_bytes,
    small_layout,
    write_case,
    write_with_both_impls,
)

# ---- Triton vs reference on hard values (int8 per-token-head, every inline-scale store width) ------


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

    layout = small_layout(
        "LBNHC", num_layers=1, num_blocks=12, heads=3, block_size=4, head_size=head_size,
        head_size_v=head_size_v, dtype="int8", kv_quant="int8_per_token_head",
    )  # fmt: skip
    n = 41  # not a multiple of any BLOCK_T
    key = hard_rows(n + 3, 3, head_size, seed=1)
    value = hard_rows(n + 3, 3, head_size_v, seed=2)
    slots = make_slots(n, layout, seed=6, pad_every=5)
    dev = triton_device
    ref, tri = write_with_both_impls(
        layout, key.to(dev), value.to(dev), slots.to(dev), device=dev, layer=0, seed=9
    )
    assert rc_triton.scale_word(layout, layer_view(tri, layout, 0)) == word
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)


# ---- a scale plane (kv-spec ``scale_plane``: the scales after each page's data) ----------------------


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLNHC"])
@pytest.mark.parametrize("mla", [False, True])
def test_scale_plane_holds_what_inline_scales_hold(order: str, mla: bool) -> None:
    """The reference writes the same quantized values and scales into a scale-plane layout as
    into the inline one (read back through read_kv, which reads either), and the plane's bytes
    are the scales: ``scale_plane_view`` gives K's and V's scale of every written row."""
    kw = dict(num_layers=2, num_blocks=6, heads=1 if mla else 3, block_size=4, head_size=16,
              head_size_v=0 if mla else 8, dtype="int8", kv_quant="int8_per_token_head",
              is_mla=mla)  # fmt: skip
    inline, plane = small_layout(order, **kw), small_layout(order, scale_plane=True, **kw)
    n = 17
    key = hard_rows(n, 3, 16, seed=3)[:, : kw["heads"]].contiguous()
    value = None if mla else hard_rows(n, 3, 8, seed=4)
    slots = make_slots(n, inline, seed=2, pad_every=4)
    keep = slots >= 0
    got = []
    for lay in (inline, plane):
        view = layer_view(random_storage(lay, "cpu", seed=1), lay, 1)
        reshape_and_cache(key, value, view, slots, lay, impl="reference")
        got.append((read_kv(view, lay, slots[keep]), view, lay))
    (k_in, v_in), _, _ = got[0]
    (k_pl, v_pl), view, lay = got[1]
    assert torch.equal(k_in, k_pl)
    assert v_in is None if mla else torch.equal(v_in, v_pl)
    scales = scale_plane_view(view, lay)[slots[keep] // 4, :, slots[keep] % 4]  # [T, H, S]
    amax = key[: slots.numel()][keep].abs().amax(-1)
    assert torch.equal(scales[..., 0], torch.where(amax > 0, amax / 127.0, 1.0))


@pytest.mark.parametrize(
    ("order", "word", "pad"), [("LBNHC", 8, 0), ("BLHNC", 8, 0), ("LBNHC", 4, 0), ("LBHNC", 8, 24)]
)
def test_triton_writes_a_scale_plane_bitwise(
    order: str, word: int, pad: int, triton_device: str
) -> None:
    """The Triton write into a scale-plane layout, bitwise against the reference (data, plane,
    and the padding and other pages untouched), for the 8- and 4-byte scale stores (MLA: one
    scale a row), and with padded pages (the plane right after the data, the padding after it)."""
    from kv_kernels.reshape_and_cache import triton as rc_triton

    mla = word == 4
    layout = small_layout(
        order, num_layers=2, num_blocks=9, heads=1 if mla else 3, block_size=4, head_size=16,
        head_size_v=0 if mla else 16, dtype="int8", kv_quant="int8_per_token_head", is_mla=mla,
        scale_plane=True, pad=pad,
    )  # fmt: skip
    assert layout.page_bytes == layout.real_page_size_bytes + pad
    n = 23
    key = hard_rows(n + 2, 3, 16, seed=5)[:, : layout.num_kv_heads].contiguous()
    value = None if mla else hard_rows(n + 2, 3, 16, seed=6)
    slots = make_slots(n, layout, seed=7, pad_every=6)
    dev = triton_device
    v = None if value is None else value.to(dev)
    ref, tri = write_with_both_impls(layout, key.to(dev), v, slots.to(dev), device=dev, seed=8)
    assert rc_triton.scale_word(layout, layer_view(tri, layout, 1)) == word
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)


# ---- quantized caches (reference on the CPU; the Triton fp8 path is tested on the GPU) -------------


def test_int8_per_token_head_scales_and_error() -> None:
    layout = small_layout(
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
    layout = small_layout("LBNHC", dtype=fp8, kv_quant="fp8_per_tensor", head_size=8, head_size_v=8)
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


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [0.25, "tensor1"])
def test_fp8_per_tensor_mla_latent_reference(fp8: str, scale: float | str) -> None:
    """An MLA latent into an fp8 per-tensor cache (issue 31): each written row is ``latent /
    k_scale`` cast to fp8 (the one scale K and V are read with), padded slots and every other
    byte untouched; ``v_scale`` is refused (the latent has one scale)."""
    layout = small_layout(
        "LBNHC", dtype=fp8, kv_quant="fp8_per_tensor", is_mla=True, heads=1, head_size=24
    )
    k_scale = 0.25 if scale == 0.25 else torch.tensor([0.25])
    storage = random_storage(layout, seed=4)
    before = raw_bytes(storage)[0]
    view = layer_view(storage, layout, 1)
    latent = torch.randn(9, 1, 24, generator=torch.Generator().manual_seed(2)) * 20
    slots = make_slots(9, layout, seed=5, pad_every=4)
    reshape_and_cache(latent, None, view, slots, layout, k_scale)
    keep = slots >= 0
    rows = view[slots[keep] // 4, :, slots[keep] % 4]  # [T, 1, 24] fp8
    want = (latent[keep] / 0.25).to(view.dtype)
    assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))
    k, v = read_kv(view, layout, slots[keep], k_scale)
    assert v is None and torch.equal(k, want.float() * 0.25)
    after = raw_bytes(storage)[0]
    assert int((after != before).sum()) <= int(keep.sum()) * 24  # nothing but those rows moved
    with pytest.raises(ValueError, match="v_scale must be None for an MLA layout"):
        reshape_and_cache(latent, None, view, slots, layout, k_scale, k_scale)


def test_fp8_per_token_head_reference_and_mla() -> None:
    layout = small_layout(
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


# ---- GPU (fp8 / int8 numerics) ---------------------------------------------------------------------


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
    layout, key, value, slots = write_case(order, dtype, kv_quant, seed=3)
    k_scale = v_scale = None
    # |k| < ~16, |v| < ~5.5: scales keep x / scale inside e4m3's 448 (values past it saturate)
    if scales == "float":
        k_scale, v_scale = 0.05, 0.02
    elif scales == "per_head":
        k_scale = torch.linspace(0.04, 0.1, 8, device="cuda")
        v_scale = torch.linspace(0.015, 0.05, 8, device="cuda")
    elif scales == "tensor1":
        k_scale, v_scale = torch.tensor(0.05, device="cuda"), torch.tensor([0.02], device="cuda")
    ref, tri = write_with_both_impls(layout, key, value, slots, k_scale, v_scale)
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
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", ["float", "tensor1"])
def test_gpu_parity_fp8_per_tensor_mla_latent(dtype: str, scale: str) -> None:
    """DeepSeek-V3's 512 + 64 latent (bf16, page 64) into an fp8 per-tensor cache: the Triton
    write bitwise against the reference, hard values included (issue 31)."""
    layout = small_layout(
        "LBNHC", num_layers=2, num_blocks=40, heads=1, block_size=64, head_size=576,
        dtype=dtype, kv_quant="fp8_per_tensor", is_mla=True,
    )  # fmt: skip
    n = 700
    latent = torch.randn(n, 1, 576, generator=torch.Generator().manual_seed(8)) * 30
    latent[::7] = hard_rows(n, 1, 576, seed=8)[::7]  # every 7th row: many binades, -0.0, ...
    latent = latent.bfloat16()
    k_scale = 0.05 if scale == "float" else torch.tensor([0.05], device="cuda")
    slots = make_slots(n, layout, seed=9, pad_every=11).cuda()
    ref, tri = write_with_both_impls(layout, latent.cuda(), None, slots, k_scale)
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)


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
    layout = small_layout(
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
    ref, tri = write_with_both_impls(layout, key.cuda(), value.cuda(), slots, k_scale, v_scale)
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "kv_quant", "plane"),
    [
        ("fp8_e4m3", "fp8_per_tensor", False),
        ("fp8_e5m2", "fp8_per_tensor", False),
        ("fp8_e4m3", "fp8_per_token_head", False),
        ("fp8_e5m2", "fp8_per_token_head", False),
        ("int8", "int8_per_token_head", False),
        # the scales in each page's scale plane
        ("fp8_e4m3", "fp8_per_token_head", True),
        ("int8", "int8_per_token_head", True),
    ],
)
def test_gpu_signed_zeros_on_the_fast_path(dtype: str, kv_quant: str, plane: bool) -> None:
    """-0.0 and +0.0 inputs in rows whose scales all lie in the reciprocal path's range (the hard
    values above send every per-tensor program to ``div_rn``), bitwise against torch. Catches a
    negation written ``0 - x``: it turned -0.0 into +0.0 (fp8 byte 0x00 instead of 0x80) on 22k
    elements of 64k tokens before the kernel negated with ``* -1.0``."""
    layout, key, value, slots = write_case("LBNHC", dtype, kv_quant, seed=6, scale_plane=plane)
    key[::3, 1, 3] = -0.0
    key[1::3, 2, 5] = 0.0
    value[::2, 0, 0] = -0.0
    value[::5, 7] = -0.0  # whole -0.0 rows: absmax 0, scale 1 (per token and head)
    k_scale = v_scale = None
    if kv_quant == "fp8_per_tensor":
        k_scale, v_scale = 0.05, torch.linspace(0.015, 0.05, 8, device="cuda")
    ref, tri = write_with_both_impls(layout, key, value, slots, k_scale, v_scale)
    for a, b in zip(raw_bytes(ref), raw_bytes(tri), strict=True):
        assert torch.equal(a, b)
    if dtype != "int8":  # the zeros kept their sign in the cache (int8 has one zero)
        view = layer_view(tri, layout, 1).view(torch.uint8)
        keep = slots >= 0
        rows = view[slots[keep] // 16, :, slots[keep] % 16]  # [T, H, C] bytes (LBNHC)
        negative_zero_k = rows[(torch.arange(keep.numel(), device="cuda")[keep] % 3 == 0), 1, 3]
        assert (negative_zero_k == 0x80).all()
