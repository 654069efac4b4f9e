"""The fused elementwise ops (``kv_kernels.fused``): the reference and the Triton kernel against
float64 oracles written independently of both, with the parity rule
``err_kernel <= rtol * err_torch_lowprec + atol`` (``err_torch_lowprec``: the unfused torch
sequence a model runs in the input dtype, against the same oracle), planted bugs that the rule
must reject, in-place / strided / padded cases, and bad input.

Under the Triton interpreter (CPU) the kernels run in float32 and float16 only: the interpreter
computes bfloat16 arithmetic wrongly (the kernels upcast right after every load, so the GPU run of
the same tests covers bf16, see ``DTYPES``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kv_kernels.fused import (
    gelu_tanh_and_mul,
    rms_norm,
    rope_cos_sin_cache,
    rotary_embedding,
    silu_and_mul,
)

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
IMPLS = ["reference", "triton"]

# Parity tolerances, per dtype: the kernel may be at most RTOL times as far from the float64
# oracle as the unfused torch sequence in the same dtype, plus ATOL. RTOL = 2: the kernel rounds
# once where torch rounds after each op, so it is usually closer, but a last-bit tie can go either
# way. ATOL: float32's torch error can be ~0 (a tiny bound), so a few float32 ulps of the outputs'
# magnitude (~4) are allowed; in 16 bits, one ulp of that magnitude (fp16 ~2e-3, bf16 ~1.6e-2).
TOLERANCE = {
    torch.float32: (2.0, 1e-5),
    torch.float16: (2.0, 4e-3),
    torch.bfloat16: (2.0, 3e-2),
}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _within(kernel: torch.Tensor, lowprec: torch.Tensor, oracle: torch.Tensor) -> bool:
    rtol, atol = TOLERANCE[lowprec.dtype]
    return _err(kernel, oracle) <= rtol * _err(lowprec, oracle) + atol


def _assert_parity(kernel: torch.Tensor, lowprec: torch.Tensor, oracle: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[lowprec.dtype]
    err_k, err_t = _err(kernel, oracle), _err(lowprec, oracle)
    assert err_k <= rtol * err_t + atol, (err_k, err_t, kernel.dtype)


def _device(impl: str, request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("triton_device") if impl == "triton" else "cpu"


# ---- rms_norm -------------------------------------------------------------------------------------


def _rms_oracle(x, w, eps, residual=None, offset=0.0):
    """float64: h = x + residual rounded to x's dtype (the stored stream), then h / rms * gain."""
    h = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    hd = h.double()
    y = hd / torch.sqrt((hd * hd).mean(-1, keepdim=True) + eps) * (w.double() + offset)
    return y, h


def _rms_torch(x, w, eps, residual=None, offset=0.0):
    """The unfused sequence in x's dtype, as transformers' Llama runs it."""
    h = x if residual is None else x + residual
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return n * (w.float() + offset).to(x.dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "with_residual", "offset", "weight_first"),
    [
        ((5, 64), True, 0.0, False),
        ((3, 1000), True, 0.0, False),  # not a power of two: masked columns
        ((2, 4096), True, 0.0, False),  # Llama-3-8B's hidden
        ((2, 8192), False, 0.0, False),
        ((4, 3, 128), False, 0.0, False),  # per-head q/k norm, several rows per program
        ((3, 2304), True, 1.0, True),  # Gemma: (1 + w), gain multiplied in float32
        ((6, 80), False, 0.0, True),  # gpt-oss order
    ],
)
def test_rms_norm_parity(impl, dtype, shape, with_residual, offset, weight_first, request):
    device = _device(impl, request)
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    res = (torch.randn(shape, generator=g) * 3).to(dtype) if with_residual else None
    w = torch.rand(shape[-1], generator=g) + 0.5
    eps = 1e-6
    oracle, h_oracle = _rms_oracle(x, w, eps, res, offset)
    lowprec = _rms_torch(x, w, eps, res, offset)

    def dev(t):
        return None if t is None else t.to(device)

    got = rms_norm(
        dev(x), dev(w), eps, residual=dev(res), weight_offset=offset,
        weight_first=weight_first, impl=impl,
    )  # fmt: skip
    if with_residual:
        y, h = got
        assert torch.equal(h.cpu(), h_oracle)  # one rounding of an exact float32 sum
    else:
        y = got
    assert y.dtype == dtype and y.shape == x.shape
    _assert_parity(y.cpu(), lowprec, oracle)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_per_head_weight(impl, dtype, request) -> None:
    """Qwen3's q/k norm as the engine calls it: the q and k heads of the qkv output ``[T, Hq +
    Hk, D]`` (a strided view) with a ``[Hq + Hk, D]`` gain (q_norm's weight per q head, k_norm's
    per k head), normalized in place; each head row is the bits of a call with its own gain."""
    device = _device(impl, request)
    g = torch.Generator().manual_seed(4)
    hq, hk, d = 4, 2, 64
    qkv = (torch.randn(5, (hq + 2 * hk) * d, generator=g) * 2).to(dtype)
    qw, kw = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    weight = torch.cat([qw.expand(hq, d), kw.expand(hk, d)])  # [Hq + Hk, D]
    buf = qkv.clone().to(device)
    qk = buf[:, : (hq + hk) * d].view(5, hq + hk, d)
    rms_norm(qk, weight.to(device), 1e-6, out=qk, weight_offset=1.0, weight_first=True, impl=impl)
    x = qkv[:, : (hq + hk) * d].view(5, hq + hk, d)
    q_alone = rms_norm(x[:, :hq].to(device), qw.to(device), 1e-6, weight_offset=1.0,
                       weight_first=True, impl=impl)  # fmt: skip
    k_alone = rms_norm(x[:, hq:].to(device), kw.to(device), 1e-6, weight_offset=1.0,
                       weight_first=True, impl=impl)  # fmt: skip
    assert torch.equal(qk[:, :hq].cpu(), q_alone.cpu())
    assert torch.equal(qk[:, hq:].cpu(), k_alone.cpu())
    assert torch.equal(buf[:, (hq + hk) * d :].cpu(), qkv[:, (hq + hk) * d :])  # v untouched
    oracle = torch.cat(
        [_rms_oracle(x[:, :hq], qw, 1e-6, offset=1.0)[0], _rms_oracle(x[:, hq:], kw, 1e-6, offset=1.0)[0]], 1
    )  # fmt: skip
    lowprec = torch.cat(
        [_rms_torch(x[:, :hq], qw, 1e-6, offset=1.0), _rms_torch(x[:, hq:], kw, 1e-6, offset=1.0)], 1
    )  # fmt: skip
    _assert_parity(qk.cpu(), lowprec, oracle)


def test_rms_norm_planted_bugs_fail_the_tolerance(request) -> None:
    """What the parity rule must reject, produced by the kernel itself: the residual not added,
    Gemma's (1 + w) gain read as w, the wrong eps (1e-1 on rows of mean square ~1e-2)."""
    device = request.getfixturevalue("triton_device")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g).to(torch.float16)
    res = torch.randn(4, 256, generator=g).to(torch.float16)
    w = torch.rand(256, generator=g) + 0.5
    oracle, _ = _rms_oracle(x, w, 1e-6, res, 1.0)
    lowprec = _rms_torch(x, w, 1e-6, res, 1.0)
    xd, rd, wd = x.to(device), res.to(device), w.to(device)
    good, _ = rms_norm(xd, wd, 1e-6, residual=rd, weight_offset=1.0, impl="triton")
    assert _within(good.cpu(), lowprec, oracle)
    no_residual = rms_norm(xd, wd, 1e-6, weight_offset=1.0, impl="triton")
    assert not _within(no_residual.cpu(), lowprec, oracle)
    no_offset, _ = rms_norm(xd, wd, 1e-6, residual=rd, impl="triton")
    assert not _within(no_offset.cpu(), lowprec, oracle)
    small = (x * 0.1).to(torch.float16)
    oracle_s, _ = _rms_oracle(small, w, 1e-6)
    wrong_eps = rms_norm(small.to(device), wd, 1e-1, impl="triton")
    assert not _within(wrong_eps.cpu(), _rms_torch(small, w, 1e-6), oracle_s)


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_in_place_and_strided(impl, request) -> None:
    """The engine's calls: h written over the residual stream in place, y over x; a per-head
    norm of q as a strided slice of a fused qkv buffer (token stride 7 * 16, head stride 16)."""
    device = _device(impl, request)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g).to(device)
    res = torch.randn(5, 96, generator=g).to(device)
    w = (torch.rand(96, generator=g) + 0.5).to(device)
    y_ref, h_ref = rms_norm(x, w, 1e-5, residual=res, impl="reference")
    x2, res2 = x.clone(), res.clone()
    y, h = rms_norm(x2, w, 1e-5, residual=res2, out=x2, residual_out=res2, impl=impl)
    assert y.data_ptr() == x2.data_ptr() and h.data_ptr() == res2.data_ptr()
    assert torch.equal(h.cpu(), h_ref.cpu())
    torch.testing.assert_close(y.cpu(), y_ref.cpu(), rtol=0, atol=1e-5)

    qkv = torch.randn(4, 7, 16, generator=g).to(device)  # [T, 4 q + 2 k + 1 v heads, 16]
    q = qkv[:, :4]  # [4, 4, 16], token stride 112
    wq = (torch.rand(16, generator=g) + 0.5).to(device)
    before = qkv.clone()
    yq = rms_norm(q, wq, 1e-6, out=q, impl=impl)  # in place on the slice
    expected = _rms_oracle(before[:, :4].cpu(), wq.cpu(), 1e-6)[0]
    torch.testing.assert_close(yq.cpu().double(), expected, rtol=0, atol=1e-5)
    assert torch.equal(qkv[:, 4:].cpu(), before[:, 4:].cpu())  # k and v untouched


# ---- silu_and_mul / gelu_tanh_and_mul ---------------------------------------------------------


def _act_oracle(x: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = x.double().chunk(2, -1)
    if act == "silu":
        a = gate / (1 + torch.exp(-gate))
    else:
        a = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    return a * up


def _act_torch(x: torch.Tensor, act: str) -> torch.Tensor:
    """The unfused sequence in x's dtype (the engine's GatedMLP)."""
    gate, up = x.chunk(2, -1)
    a = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return a * up


ACTS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


# the interpreter's numpy exp warns on exp(100) = inf, which the kernel relies on (x = -100 below)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("shape", [(5, 2 * 64), (3, 2 * 1000), (2, 2 * 3000), (0, 2 * 8)])
def test_act_and_mul_parity(impl, dtype, act, shape, request) -> None:
    device = _device(impl, request)
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    x[:, 0] = -100.0  # exp(-x) overflows: silu(-100) is -0, not NaN
    y = ACTS[act](x.to(device), impl=impl)
    assert y.shape == (shape[0], shape[1] // 2) and y.dtype == dtype
    assert not y.isnan().any()
    _assert_parity(y.cpu(), _act_torch(x, act), _act_oracle(x, act))


def test_act_planted_bugs_fail_the_tolerance(request) -> None:
    """Gate and up swapped, and the other activation, are caught by the rule."""
    device = request.getfixturevalue("triton_device")
    x = (torch.randn(4, 2 * 200, generator=torch.Generator().manual_seed(2)) * 2).half()
    oracle, lowprec = _act_oracle(x, "silu"), _act_torch(x, "silu")
    xd = x.to(device)
    assert _within(silu_and_mul(xd, impl="triton").cpu(), lowprec, oracle)
    swapped = torch.cat([x[:, 200:], x[:, :200]], dim=1).to(device)
    assert not _within(silu_and_mul(swapped, impl="triton").cpu(), lowprec, oracle)
    assert not _within(gelu_tanh_and_mul(xd, impl="triton").cpu(), lowprec, oracle)


@pytest.mark.parametrize("impl", IMPLS)
def test_act_strided_input_and_out(impl, request) -> None:
    """x as the gate/up columns of a wider buffer (token stride 2d + 6), written into ``out``."""
    device = _device(impl, request)
    buf = torch.randn(5, 2 * 40 + 6, generator=torch.Generator().manual_seed(3)).to(device)
    x = buf[:, 3 : 3 + 80]
    out = torch.full((5, 40), 7.0, device=device)
    y = silu_and_mul(x, out=out, impl=impl)
    assert y.data_ptr() == out.data_ptr()
    expected = _act_oracle(x.cpu(), "silu")
    torch.testing.assert_close(y.cpu().double(), expected, rtol=0, atol=1e-5)


# ---- rotary_embedding ---------------------------------------------------------------------------


def _inv_freq(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def _rope_oracle(x, positions, inv_freq, is_neox, rotary_dim, scaling=1.0):
    """float64, as complex multiplication: pair (a, b) is a + ib, times scaling * e^(i p f)."""
    out = x.double().clone()
    t = positions.numel()
    half = rotary_dim // 2
    angle = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, half]
    rot = torch.polar(torch.full_like(angle, scaling), angle)[:, None, :]  # [T, 1, half]
    cols = torch.arange(half)
    c1, c2 = (cols, cols + half) if is_neox else (2 * cols, 2 * cols + 1)
    z = torch.complex(out[:t, :, c1], out[:t, :, c2]) * rot
    out[:t, :, c1], out[:t, :, c2] = z.real, z.imag
    return out


def _rope_torch(x, positions, cache, is_neox, rotary_dim):
    """The unfused sequence in x's dtype: cos/sin rounded to x's dtype, rotate_half (NeoX) or
    the even/odd split (GPT-J), products and sums each rounded."""
    out = x.clone()
    t = positions.numel()
    cos, sin = cache[positions].to(x.dtype).chunk(2, -1)  # [T, half]
    cos, sin = cos[:, None], sin[:, None]
    rot = x[:t, :, :rotary_dim]
    if is_neox:
        x1, x2 = rot.chunk(2, -1)
        new = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        new = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    out[:t, :, :rotary_dim] = new
    return out


ROPE_CASES = [
    # (q heads, k heads, head size, rotary_dim, is_neox)
    (4, 2, 64, 64, True),  # Llama-like
    (4, 2, 64, 64, False),  # GPT-J interleaved
    (3, 1, 80, 32, True),  # partial rotary (NeoX / Phi: 32 of 80), odd head counts
    (2, 2, 128, 64, False),  # partial interleaved (GLM-style)
    (5, 0, 48, 48, True),  # q only (k=None)
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("hq", "hk", "head", "rdim", "neox"), ROPE_CASES)
def test_rotary_parity(impl, dtype, hq, hk, head, rdim, neox, request) -> None:
    device = _device(impl, request)
    g = torch.Generator().manual_seed(hq * 100 + head + rdim + neox)
    max_pos, tokens = 4096, 9
    inv_freq = _inv_freq(rdim)
    cache = rope_cos_sin_cache(inv_freq.float(), max_pos)  # float32 table
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q = (torch.randn(tokens + 2, hq, head, generator=g) * 2).to(dtype)  # padded: T' = T + 2
    k = (torch.randn(tokens + 2, hk, head, generator=g) * 2).to(dtype) if hk else None
    # (clones: .to("cpu") of a CPU tensor is the tensor itself, and the op rotates in place)
    q_dev, k_dev = q.clone().to(device), None if k is None else k.clone().to(device)
    rotary_embedding(
        positions.to(device), q_dev, k_dev, cache.to(device), is_neox=neox, rotary_dim=rdim,
        impl=impl,
    )  # fmt: skip
    for before, after in ((q, q_dev), (k, k_dev)):
        if before is None:
            continue
        after = after.cpu()
        # past rotary_dim and past T: untouched, bit for bit
        assert torch.equal(after[:, :, rdim:], before[:, :, rdim:])
        assert torch.equal(after[tokens:], before[tokens:])
        oracle = _rope_oracle(before, positions, inv_freq, neox, rdim)
        _assert_parity(after, _rope_torch(before, positions, cache, neox, rdim), oracle)


def test_rotary_planted_bugs_fail_the_tolerance(request) -> None:
    """Halves swapped (GPT-J pairs on a NeoX model), the wrong position (off by one), the
    rotation's sign flipped (sin negated): each a kernel output the rule rejects."""
    device = request.getfixturevalue("triton_device")
    g = torch.Generator().manual_seed(5)
    inv_freq = _inv_freq(64)
    cache = rope_cos_sin_cache(inv_freq.float(), 512)
    positions = torch.randint(1, 500, (6,), generator=g)
    q = torch.randn(6, 2, 64, generator=g).half()
    oracle = _rope_oracle(q, positions, inv_freq, True, 64)
    lowprec = _rope_torch(q, positions, cache, True, 64)

    def run(pos=positions, tab=cache, neox=True):
        out = q.clone().to(device)
        rotary_embedding(pos.to(device), out, None, tab.to(device), is_neox=neox, impl="triton")
        return out.cpu()

    assert _within(run(), lowprec, oracle)
    assert not _within(run(neox=False), lowprec, oracle)
    assert not _within(run(pos=positions + 1), lowprec, oracle)
    flipped = torch.cat([cache[:, :32], -cache[:, 32:]], dim=1)
    assert not _within(run(tab=flipped), lowprec, oracle)


@pytest.mark.parametrize("impl", IMPLS)
def test_rotary_strided_qkv_slices_and_padding(impl, request) -> None:
    """q and k as slices of a fused qkv projection ``[T, (Hq + 2 Hk) * D]``, int32 positions with
    padding (-1): padded tokens and v are left bit for bit."""
    device = _device(impl, request)
    g = torch.Generator().manual_seed(6)
    hq, hk, d = 4, 2, 32
    qkv = torch.randn(7, hq + 2 * hk, d, generator=g).to(device)
    before = qkv.clone().cpu()
    q, k = qkv[:, :hq], qkv[:, hq : hq + hk]
    positions = torch.tensor([3, -1, 0, 17, -1, 63, 8], dtype=torch.int32)
    inv_freq = _inv_freq(d)
    cache = rope_cos_sin_cache(inv_freq.float(), 64).to(device)
    rotary_embedding(positions.to(device), q, k, cache, impl=impl)
    after = qkv.cpu()
    assert torch.equal(after[:, hq + hk :], before[:, hq + hk :])  # v
    pad = positions < 0
    assert torch.equal(after[pad], before[pad])
    live = ~pad
    for sl in (slice(0, hq), slice(hq, hq + hk)):
        oracle = _rope_oracle(before[live][:, sl], positions[live], inv_freq, True, d)
        torch.testing.assert_close(after[live][:, sl].double(), oracle, rtol=0, atol=1e-5)


def test_rotary_error_flag_counts_positions_past_the_table(request) -> None:
    """CUDA positions are not read back: a position past the table is left unrotated and counted
    (tested here under the interpreter, whose CPU positions would raise in the api, by calling
    the launcher directly)."""
    from kv_kernels.fused.triton import rotary_embedding_triton

    device = request.getfixturevalue("triton_device")
    cache = rope_cos_sin_cache(_inv_freq(16).float(), 10).to(device)
    q = torch.randn(3, 2, 16, device=device)
    before = q.clone()
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    positions = torch.tensor([2, 10, 99], device=device)
    rotary_embedding_triton(positions, q, None, cache, True, 16, flag)
    assert int(flag.item()) == 2
    assert torch.equal(q[1:], before[1:])
    assert not torch.equal(q[0], before[0])


def test_rope_cos_sin_cache_matches_the_engine_convention() -> None:
    """Row p: cos(p f) then sin(p f), times YaRN's scaling; float32 like transformers."""
    inv = _inv_freq(8).float()
    table = rope_cos_sin_cache(inv, 5, scaling=1.5)
    assert table.shape == (5, 8) and table.dtype == torch.float32
    freqs = torch.arange(5).float()[:, None] * inv
    assert torch.equal(table, torch.cat([freqs.cos(), freqs.sin()], -1) * 1.5)


# ---- bad input ------------------------------------------------------------------------------------


def _rope_args():
    cache = rope_cos_sin_cache(_inv_freq(16).float(), 32)
    return {
        "positions": torch.arange(3),
        "q": torch.randn(3, 2, 16),
        "k": torch.randn(3, 1, 16),
        "cos_sin_cache": cache,
    }


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(9)), ValueError, r"expected \[8\]"),
        (lambda: rms_norm(torch.randn(2, 3, 8), torch.ones(2, 8)), ValueError, r"or \[3, 8\]"),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(16)[::2]), ValueError, "weight.stride"),
        (lambda: rms_norm(torch.randn(2, 8).double(), torch.ones(8)), TypeError, "x dtype"),
        (lambda: rms_norm(torch.randn(8), torch.ones(8)), ValueError, r"\[T, D\] or \[T, H, D\]"),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(8), -1.0), ValueError, "eps=-1.0"),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(8), float("nan")), ValueError, "eps"),
        (lambda: rms_norm(torch.randn(2, 40000), torch.ones(40000)), ValueError, "32768"),
        (
            lambda: rms_norm(torch.randn(2, 8), torch.ones(8), residual=torch.randn(2, 8).half()),
            ValueError, "residual is torch.float16",
        ),
        (
            lambda: rms_norm(torch.randn(2, 8), torch.ones(8), residual_out=torch.randn(2, 8)),
            ValueError, "without residual",
        ),
        (
            lambda: rms_norm(torch.randn(8, 2).t(), torch.ones(8)), ValueError, "stride",
        ),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(8), impl="cuda"), ValueError, "impl='cuda'"),
        (lambda: silu_and_mul(torch.randn(2, 7)), ValueError, "even width"),
        (lambda: silu_and_mul(torch.randn(2, 3, 8)), ValueError, r"\[T, 2d\]"),
        (lambda: silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 8)), ValueError, r"\[2, 4\]"),
        (lambda: silu_and_mul([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda: rope_cos_sin_cache(_inv_freq(8), 0), ValueError, "max_positions=0"),
    ],
)  # fmt: skip
def test_bad_input(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


def test_rms_norm_rejects_aliased_outputs() -> None:
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    buf = torch.empty(2, 8)
    with pytest.raises(ValueError, match="share memory"):
        rms_norm(x, w, residual=r, out=buf, residual_out=buf)
    base = torch.randn(3, 8)
    with pytest.raises(ValueError, match="partly overlaps x"):
        rms_norm(base[:2], w, out=base[1:])
    rms_norm(base[:2], w, out=base[:2])  # x itself: in place is fine


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"positions": torch.tensor([0, 1, 32])}, ValueError, "past the cos_sin_cache's 32 rows"),
        ({"positions": torch.arange(3).float()}, ValueError, "int64"),
        ({"positions": torch.arange(5)}, ValueError, "never shorter"),
        ({"positions": torch.arange(6)[::2]}, ValueError, "positions.stride"),
        ({"k": torch.randn(3, 1, 8)}, ValueError, r"\[T', H, 16\]"),
        ({"k": torch.randn(3, 1, 16).half()}, ValueError, "share dtype"),
        ({"rotary_dim": 7}, ValueError, "rotary_dim=7 must be even"),
        ({"rotary_dim": 8}, ValueError, "cos_sin_cache has 16 columns"),
        ({"cos_sin_cache": torch.ones(32, 16, dtype=torch.int32)}, ValueError, "float"),
        ({"q": torch.randn(3, 16, 2).transpose(1, 2)}, ValueError, "q.stride"),
        ({"error_flag": torch.zeros(1)}, ValueError, "error_flag must be an int32"),
        ({"impl": "fast"}, ValueError, "impl='fast'"),
    ],
)
def test_rotary_bad_input(change, error, match) -> None:
    args = _rope_args()
    args.update(change)
    with pytest.raises(error, match=match):
        rotary_embedding(
            args.pop("positions"), args.pop("q"), args.pop("k"), args.pop("cos_sin_cache"),
            **args,
        )  # fmt: skip


def test_rotary_rejects_overlapping_q_and_k() -> None:
    args = _rope_args()
    q = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="q and k start at the same element"):
        rotary_embedding(args["positions"], q, q[:, :1], args["cos_sin_cache"])


# ---- past 2**31 elements (GPU) --------------------------------------------------------------------


@pytest.mark.gpu
def test_offsets_past_2_31_elements() -> None:
    """Rows past element 2**31 of the input are read and written where they are (int64 token
    offsets): the last rows of a [T, 2 * 8192] bf16 activation and of a [T, 32, 128] q."""
    d = 8192
    t = 2**31 // (2 * d) + 3
    x = torch.empty(t, 2 * d, dtype=torch.bfloat16, device="cuda")
    x[-4:] = torch.randn(4, 2 * d, device="cuda").bfloat16()
    y = silu_and_mul(x)
    torch.testing.assert_close(y[-4:], silu_and_mul(x[-4:].cpu(), impl="reference").cuda())
    del x, y
    w = torch.rand(d, device="cuda") + 0.5
    h = torch.empty(2**31 // d + 3, d, dtype=torch.bfloat16, device="cuda")
    h[-4:] = torch.randn(4, d, device="cuda").bfloat16()
    y = rms_norm(h, w)
    torch.testing.assert_close(y[-4:], rms_norm(h[-4:].cpu(), w.cpu(), impl="reference").cuda())
    del h, y
    q = torch.zeros(2**31 // (32 * 128) + 3, 32, 128, dtype=torch.bfloat16, device="cuda")
    q[-3:] = torch.randn(3, 32, 128, device="cuda").bfloat16()
    positions = torch.full((q.shape[0],), 7, device="cuda")
    cache = rope_cos_sin_cache(_inv_freq(128).float(), 16).cuda()
    tail = q[-3:].cpu()
    rotary_embedding(positions, q, None, cache)
    rotary_embedding(positions[:3].cpu(), tail, None, cache.cpu(), impl="reference")
    torch.testing.assert_close(q[-3:].cpu(), tail)
