"""``rope_and_cache``: RoPE fused into the cache write. Its definition is the two ops in a row
(``rotary_embedding`` then ``reshape_and_cache``, the reference path); the Triton kernel is held
to that pair run as two Triton launches (bit for bit under the interpreter, which does not fuse
multiply-adds), to the reference, and to a float64 oracle with the parity rule; a planted bug
(the position off by one, K left unrotated) must fail that rule."""

from __future__ import annotations

import pytest
import torch
from kv_kernels import layer_view, reshape_and_cache
from kv_kernels.fused import rope_and_cache, rope_cos_sin_cache, rotary_embedding
from kv_kernels.testing_cache import make_slots, random_storage, raw_bytes, small_layout

INTERPRETING = not torch.cuda.is_available()
TOLERANCE = {torch.float32: (2.0, 1e-5), torch.float16: (2.0, 4e-3), torch.bfloat16: (2.0, 3e-2)}


def _inv_freq(rotary_dim: int) -> torch.Tensor:
    return 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def _rope_oracle(x, positions, inv_freq, is_neox, rotary_dim):
    """float64: pair (a, b) as a + ib, times e^(i p f); the other columns as they are."""
    out = x.double().clone()
    half = rotary_dim // 2
    angle = positions.double()[:, None] * inv_freq[None, :]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]
    cols = torch.arange(half)
    c1, c2 = (cols, cols + half) if is_neox else (2 * cols, 2 * cols + 1)
    z = torch.complex(out[:, :, c1], out[:, :, c2]) * rot
    out[:, :, c1], out[:, :, c2] = z.real, z.imag
    return out


def _case(order, dtype, head, head_v, rotary_dim, seed, heads=3, q_heads=5, tokens=9):
    layout = small_layout(
        order, dtype=dtype, heads=heads, head_size=head, head_size_v=head_v, num_blocks=6,
        block_size=4,
    )  # fmt: skip
    torch_dtype = layer_view(random_storage(layout), layout, 0).dtype
    g = torch.Generator().manual_seed(seed)
    # q, k, v as slices of one qkv projection output (strided tokens), one padded token T' = T + 1
    width = q_heads * head + heads * head + heads * head_v
    qkv = (torch.randn(tokens + 1, width, generator=g) * 2).to(torch_dtype)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = make_slots(tokens, layout, seed, pad_every=4)
    cache = rope_cos_sin_cache(_inv_freq(rotary_dim).float(), 64)
    return layout, qkv, positions, slots, cache, (q_heads, heads, head, head_v)


def _split(qkv, dims):
    q_heads, heads, head, head_v = dims
    t = qkv.shape[0]
    q = qkv[:, : q_heads * head].view(t, q_heads, head)
    k = qkv[:, q_heads * head : (q_heads + heads) * head].view(t, heads, head)
    v = qkv[:, (q_heads + heads) * head :].view(t, heads, head_v)
    return q, k, v


def _run(mode, device, layout, qkv, positions, slots, cache, dims, neox, rotary_dim):
    storage = random_storage(layout, device, seed=3)
    view = layer_view(storage, layout, 1)
    buf = qkv.clone().to(device)
    q, k, v = _split(buf, dims)
    pos, sl, tab = positions.to(device), slots.to(device), cache.to(device)
    if mode == "pair":  # the two Triton ops, one after the other
        rotary_embedding(pos, q, k, tab, is_neox=neox, rotary_dim=rotary_dim, impl="triton")
        reshape_and_cache(k, v, view, sl, layout, impl="triton")
    else:
        rope_and_cache(
            pos, q, k, v, tab, view, sl, layout, is_neox=neox, rotary_dim=rotary_dim, impl=mode
        )
    return buf.cpu(), raw_bytes(storage), layer_view(storage, layout, 1).cpu()


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BHLNC"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(
    ("head", "head_v", "rotary_dim", "neox"),
    [(16, 16, 16, True), (16, 12, 16, False), (24, 8, 8, True), (32, 32, 16, False)],
)
def test_fused_write_matches_the_two_ops(
    order, dtype, head, head_v, rotary_dim, neox, triton_device
) -> None:
    layout, qkv, positions, slots, cache, dims = _case(order, dtype, head, head_v, rotary_dim, 7)
    args = (layout, qkv, positions, slots, cache, dims, neox, rotary_dim)
    ref_qkv, _, ref_view = _run("reference", "cpu", *args)
    tri_qkv, tri_bytes, tri_view = _run("triton", triton_device, *args)
    pair_qkv, pair_bytes, _ = _run("pair", triton_device, *args)
    if INTERPRETING:
        assert torch.equal(tri_qkv, pair_qkv)
        for a, b in zip(tri_bytes, pair_bytes, strict=True):
            assert torch.equal(a, b)
    atol = 1e-5 if dtype == "float32" else 4e-3
    torch.testing.assert_close(tri_qkv, ref_qkv, rtol=0, atol=atol)
    torch.testing.assert_close(tri_view, ref_view, rtol=0, atol=atol)
    # slots the batch does not write, and the other layer, are untouched bit for bit
    written = torch.zeros(layout.num_blocks * layout.block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = ~written.view(layout.num_blocks, 1, layout.block_size, 1)
    before = layer_view(random_storage(layout, "cpu", seed=3), layout, 1)
    assert torch.equal(
        torch.where(untouched, tri_view, 0).view(torch.uint8),
        torch.where(untouched, before, 0).view(torch.uint8),
    )
    # K in the cache against the float64 oracle, held by the parity rule
    _, k0, v0 = _split(qkv, dims)
    t = positions.numel()
    oracle = _rope_oracle(k0[:t], positions, _inv_freq(rotary_dim), neox, rotary_dim)
    live = slots >= 0
    blk, off = slots[live] // layout.block_size, slots[live] % layout.block_size
    got = tri_view[blk, :, off, :head]
    lowprec = ref_view[blk, :, off, :head]  # the torch ops in the cache dtype
    rtol, a = TOLERANCE[got.dtype]
    err = lambda x: (x.double() - oracle[live]).abs().max().item()  # noqa: E731
    assert err(got) <= rtol * err(lowprec) + a
    assert torch.equal(tri_view[blk, :, off, head:], v0[:t][live])  # V copied as it is


def test_planted_bugs_fail_the_rule(triton_device) -> None:
    """K written unrotated (every position 0) and the position off by one: the kernel's own
    outputs, rejected by the rule the parity test applies."""
    layout, qkv, positions, slots, cache, dims = _case("LBNHC", "float16", 32, 32, 32, 9)
    positions = positions.clamp(1, 62)
    _, k0, _ = _split(qkv, dims)
    t = positions.numel()
    oracle = _rope_oracle(k0[:t], positions, _inv_freq(32), True, 32)
    live = slots >= 0
    blk, off = slots[live] // layout.block_size, slots[live] % layout.block_size
    ref_view = _run("reference", "cpu", layout, qkv, positions, slots, cache, dims, True, 32)[2]

    def within(pos: torch.Tensor) -> bool:
        view = _run("triton", triton_device, layout, qkv, pos, slots, cache, dims, True, 32)[2]
        got, lowprec = view[blk, :, off, :32], ref_view[blk, :, off, :32]
        err = lambda x: (x.double() - oracle[live]).abs().max().item()  # noqa: E731
        return err(got) <= 2.0 * err(lowprec) + 4e-3

    assert within(positions)
    assert not within(torch.zeros_like(positions))
    assert not within(positions + 1)


def test_error_flag_counts_bad_positions_and_slots(triton_device) -> None:
    from kv_kernels.fused.triton import rope_and_cache_triton

    layout, qkv, _, _, cache, dims = _case("LBNHC", "float32", 16, 16, 16, 1, tokens=3)
    storage = random_storage(layout, triton_device, seed=3)
    view = layer_view(storage, layout, 0)
    before = raw_bytes(storage)
    q, k, v = _split(qkv.to(triton_device), dims)
    flag = torch.zeros(1, dtype=torch.int32, device=triton_device)
    positions = torch.tensor([1, 64, 2], device=triton_device)  # 64: past the table
    slots = torch.tensor([0, 1, 10**6], device=triton_device)  # 10**6: past the cache
    rope_and_cache_triton(
        positions, q, k, v, cache.to(triton_device), view, slots, 16, True, 16, flag
    )
    assert int(flag.item()) == 2
    changed = [(a != b).any().item() for a, b in zip(raw_bytes(storage), before, strict=True)]
    assert any(changed)  # slots 0 and 1 were written (slot 1 with K unrotated)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dtype": "int8", "kv_quant": "int8_per_token_head"}, "call rotary_embedding then"),
        ({"dtype": "float32", "is_mla": True, "heads": 1, "head_size_v": 0}, "is_mla=True"),
    ],
)
def test_layouts_the_fused_write_refuses(kw, match) -> None:
    layout = small_layout("LBNHC", head_size=16, **kw)
    view = layer_view(random_storage(layout), layout, 0)
    k = torch.randn(2, layout.num_kv_heads, 16)
    v = None if layout.is_mla else torch.randn(2, layout.num_kv_heads, layout.head_size_v)
    cache = rope_cos_sin_cache(_inv_freq(16).float(), 8)
    with pytest.raises(ValueError, match=match):
        rope_and_cache(
            torch.arange(2), torch.randn(2, 4, 16), k, v, cache, view, torch.arange(2), layout
        )


def test_counts_must_agree() -> None:
    layout = small_layout("LBNHC", head_size=16, head_size_v=16)
    view = layer_view(random_storage(layout), layout, 0)
    cache = rope_cos_sin_cache(_inv_freq(16).float(), 8)
    k, v = torch.randn(3, 3, 16), torch.randn(3, 3, 16)
    with pytest.raises(ValueError, match="one slot and one position per token"):
        rope_and_cache(
            torch.arange(3), torch.randn(3, 4, 16), k, v, cache, view, torch.arange(2), layout
        )
