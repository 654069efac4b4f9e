"""``kv_kernels.gemm.skinny_linear``: the Triton kernel (interpreted on the CPU, compiled on a
GPU) against a float64 oracle, beside torch's own low-precision product, at odd M / N / K (no
multiple of any block), every split-K path (full slices, ragged slices, an empty last slice),
strided and transposed operands, bias and ``out=``; planted bugs the tolerance must catch; and
the refusals of bad input.

Tolerance (``err_kernel <= RTOL * err_torch + ATOL[dtype]``): both round the float32 sum to the
output dtype once, so the kernel's error sits within a small multiple of torch's (the sum
orders differ); the ``ATOL`` floor covers a row whose torch error happens to be ~0. A dropped K
column moves an output by ~|x_k * w_k| ~ 1 / sqrt(K): far above both (the planted tests)."""

from __future__ import annotations

import pytest
import torch
from kv_kernels.gemm import GemmConfig, skinny_linear, supports, unsupported_reason
from kv_kernels.gemm import triton as gemm_triton
from kv_kernels.gemm.configs import (
    M_BUCKETS,
    TABLE,
    check_config,
    default_config,
    m_bucket,
    pick_config,
)

RTOL = 2.0
#: fp16: half an fp16 ulp at |y| ~ 2 is ~1e-3; fp32: IEEE dots in another order, ~1e-6
ATOL = {torch.float16: 2e-3, torch.float32: 2e-5}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(device)  # |y| ~ 1
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, w, b


def _errors(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """``(err_kernel, err_torch)``: max abs error of ``y`` and of torch's product in x's dtype
    against the float64 oracle."""
    oracle = x.double().cpu() @ w.double().cpu().T
    low = x.cpu() @ w.cpu().T
    if b is not None:
        oracle = oracle + b.double().cpu()
        low = low + b.cpu()
    return (y.double().cpu() - oracle).abs().max().item(), (
        low.double() - oracle
    ).abs().max().item()


def _assert_parity(y, x, w, b) -> None:
    err, err_torch = _errors(y, x, w, b)
    bound = RTOL * err_torch + ATOL[x.dtype]
    assert err <= bound, (
        f"kernel error {err:.3g} > {RTOL} * torch's {err_torch:.3g} + {ATOL[x.dtype]}"
    )


# (m, n, k, config): odd sizes; split 1 / full slices / ragged slices / an empty last slice
CASES = [
    (1, 70, 100, GemmConfig(16, 32, 32, 1, 4, 2)),  # M = 1 (batch-1 decode), ragged K
    (5, 33, 77, GemmConfig(16, 16, 16, 1, 4, 2)),  # nothing a multiple of 16
    (17, 50, 300, GemmConfig(32, 32, 64, 3, 4, 2)),  # split 3, ragged last slice
    (40, 33, 256, GemmConfig(16, 16, 32, 4, 4, 2)),  # split 4, full slices, 3 M tiles
    (3, 64, 40, GemmConfig(16, 32, 16, 4, 4, 2)),  # split 4 of 3 K steps: last slice empty
    (33, 96, 130, GemmConfig(32, 64, 32, 2, 4, 3)),  # 2 M tiles, split 2, ragged
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"), CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-s{c[3].split_k}" for c in CASES]
)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_parity_odd_shapes_each_split(m, n, k, cfg, dtype, bias, triton_device) -> None:
    x, w, b = _operands(m, n, k, dtype, triton_device)
    b = b if bias else None
    y = skinny_linear(x, w, b, config=cfg, impl="triton")
    assert y.shape == (m, n) and y.dtype == dtype
    _assert_parity(y, x, w, b)


def test_default_config_path(triton_device) -> None:
    """No config: the heuristic's (here split 2 for 2 N tiles) runs and matches."""
    x, w, b = _operands(2, 96, 1024, torch.float16, triton_device)
    assert pick_config(2, 96, 1024).split_k == 2
    _assert_parity(skinny_linear(x, w, b, impl="triton"), x, w, b)


def test_strided_operands_and_out_view_no_stray_writes(triton_device) -> None:
    """x a column slice of a wider buffer, weight a transposed view (K-stride N), out a strided
    window into a sentinel-filled buffer: the result is right and nothing else is written."""
    m, n, k = 7, 40, 72
    x_full, w, b = _operands(m, n, k + 9, torch.float32, triton_device)
    x = x_full[:, 3 : 3 + k]
    w = w[:, :k].T.contiguous().T  # [N, K] with strides (1, N)
    assert w.stride() == (1, n)
    big = torch.full((m * 2, n + 5), 7.0, dtype=torch.float32, device=triton_device)
    out = big[::2, 2 : 2 + n]
    y = skinny_linear(x, w, b, config=GemmConfig(16, 16, 16, 2, 4, 2), out=out, impl="triton")
    assert y.data_ptr() == out.data_ptr()
    _assert_parity(out, x, w, b)
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[::2, 2 : 2 + n] = False
    assert bool((big[mask] == 7.0).all()), "the kernel wrote outside out's elements"


def test_split_results_match_unsplit(triton_device) -> None:
    """The split paths sum the same products: equal to the unsplit kernel within fp32 rounding."""
    x, w, _ = _operands(9, 48, 200, torch.float32, triton_device)
    one = skinny_linear(x, w, config=GemmConfig(16, 16, 32, 1, 4, 2), impl="triton")
    for split in (2, 3, 7):
        got = skinny_linear(x, w, config=GemmConfig(16, 16, 32, split, 4, 2), impl="triton")
        torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-5)


def test_empty_m_returns_empty(triton_device) -> None:
    x, w, _ = _operands(0, 8, 16, torch.float32, triton_device)
    assert skinny_linear(x, w, impl="triton").shape == (0, 8)


def test_reference_path_matches_torch() -> None:
    x, w, b = _operands(4, 6, 10, torch.float32, "cpu")
    torch.testing.assert_close(skinny_linear(x, w, b, impl="reference"), x @ w.T + b)
    out = torch.empty(4, 6)
    assert skinny_linear(x, w, b, out=out).data_ptr() == out.data_ptr()


# ---- planted bugs: the tolerance above must catch them -------------------------------------


@pytest.mark.parametrize("k", [77, 256], ids=["ragged-k", "even-k"])
def test_planted_dropped_k_column_is_caught(monkeypatch, triton_device, k) -> None:
    """A kernel that stops one column short of K (a dropped tail) fails the parity bound.

    The plant passes K - 1 *and* ``EVEN_K=False``: with even slices the kernel never reads K
    (its loop runs over K_PER_SPLIT unmasked), so K - 1 alone changes nothing there (the
    even-K case; on the H200 the GPU test's 4096 was such a K and the plant was a no-op)."""
    real = gemm_triton._GEMM
    calls: list[object] = []

    def short_k(key, grid, args, kwargs):
        calls.append(key)
        args = (*args[:7], args[7] - 1, *args[8:])  # K -> K - 1
        return real(("planted", key), grid, args, {**kwargs, "EVEN_K": False})

    monkeypatch.setattr(gemm_triton, "_GEMM", short_k)
    x, w, b = _operands(5, 33, k, torch.float16, triton_device)
    y = skinny_linear(x, w, b, config=GemmConfig(16, 16, 16, 1, 4, 2), impl="triton")
    assert len(calls) == 1, "the planted launcher did not run"
    with pytest.raises(AssertionError, match="kernel error"):
        _assert_parity(y, x, w, b)


def test_planted_wrong_split_reduction_is_caught(monkeypatch, triton_device) -> None:
    """A reduction that sums one slice too few fails the parity bound."""
    real = gemm_triton._REDUCE
    calls: list[object] = []

    def drop_slice(key, grid, args, kwargs):
        calls.append(key)
        return real(("planted", key), grid, args, {**kwargs, "SPLIT_K": kwargs["SPLIT_K"] - 1})

    monkeypatch.setattr(gemm_triton, "_REDUCE", drop_slice)
    x, w, b = _operands(17, 50, 300, torch.float16, triton_device)
    y = skinny_linear(x, w, b, config=GemmConfig(32, 32, 64, 3, 4, 2), impl="triton")
    assert len(calls) == 1, "the planted reduction did not run"
    with pytest.raises(AssertionError, match="kernel error"):
        _assert_parity(y, x, w, b)


# ---- configs -------------------------------------------------------------------------------


def test_m_buckets_and_default_configs() -> None:
    assert [m_bucket(m) for m in (1, 16, 17, 64, 65, 200, 256)] == [16, 16, 32, 64, 128, 256, 256]
    with pytest.raises(ValueError, match="257"):
        m_bucket(257)
    # Llama-3-8B at M 64: o_proj (64 tiles) and down split K; gate_up (448 tiles) does not
    assert default_config(64, 4096, 4096).split_k >= 2
    assert default_config(64, 4096, 14336).split_k >= 2
    assert default_config(64, 28672, 4096).split_k == 1
    for m in (1, 16, 64, 128, 256):
        for n, k in ((6144, 4096), (4096, 14336), (128256, 4096)):
            for elem in (2, 4):
                check_config(default_config(m, n, k, elem), elem_bytes=elem)


def test_table_configs_are_valid_and_picked() -> None:
    """The measured table (H200 sweep): keyed by an M bucket, every config passes the checks
    and is what pick_config returns for each M of its bucket."""
    assert TABLE
    for (bucket, n, k), cfg in TABLE.items():
        assert bucket in M_BUCKETS
        check_config(cfg)
        lo = max((b for b in M_BUCKETS if b < bucket), default=0) + 1
        assert pick_config(lo, n, k) == cfg == pick_config(bucket, n, k)
        assert pick_config(bucket, n, k, elem_bytes=4) == default_config(bucket, n, k, 4)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (GemmConfig(8, 64, 64), "block_m=8"),
        (GemmConfig(16, 48, 64), "block_n=48"),
        (GemmConfig(16, 64, 512), "block_k=512"),
        (GemmConfig(16, 64, 64, 0), "split_k=0"),
        (GemmConfig(16, 64, 64, 1, 3), "num_warps=3"),
        (GemmConfig(16, 64, 64, 1, 4, 9), "num_stages=9"),
        (GemmConfig(128, 256, 256, 1, 8, 4), "shared memory"),
    ],
)
def test_bad_config_raises(cfg, match) -> None:
    x, w, _ = _operands(2, 8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=match):
        skinny_linear(x, w, config=cfg)


def test_config_must_be_a_gemm_config() -> None:
    x, w, _ = _operands(2, 8, 16, torch.float32, "cpu")
    with pytest.raises(TypeError, match="GemmConfig"):
        skinny_linear(x, w, config=(16, 64, 64, 1, 4, 3))


# ---- bad input -----------------------------------------------------------------------------


def test_supports_predicate() -> None:
    assert supports(64, 6144, 4096, torch.bfloat16)
    assert supports(256, 4096, 14336, torch.float16)
    assert not supports(257, 4096, 4096, torch.bfloat16)
    assert not supports(64, 4096, 4096, torch.int8)
    assert "matmul" in (unsupported_reason(512, 8, 8, torch.bfloat16) or "")


def test_too_many_tokens_says_use_matmul() -> None:
    x, w, _ = _operands(257, 8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"M=257.*256.*matmul"):
        skinny_linear(x, w)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda x, w, b: skinny_linear(x[0], w), ValueError, "x has shape"),
        (lambda x, w, b: skinny_linear(x, w.T), ValueError, "K="),
        (lambda x, w, b: skinny_linear(x, w.half()), TypeError, "weight dtype"),
        (lambda x, w, b: skinny_linear(x.int(), w.int()), ValueError, "dtype"),
        (lambda x, w, b: skinny_linear(x, w, b[:3]), ValueError, "bias has shape"),
        (lambda x, w, b: skinny_linear(x, w, b.int()), TypeError, "bias dtype"),
        (lambda x, w, b: skinny_linear(x, w, out=torch.empty(4, 7)), ValueError, "out is"),
        (lambda x, w, b: skinny_linear(x, w, out=torch.empty(4, 6).half()), ValueError, "out is"),
        (
            lambda x, w, b: skinny_linear(x, w, out=torch.empty(1, 6).expand(4, 6)),
            ValueError,
            "stride",
        ),
        (lambda x, w, b: skinny_linear(x, w, impl="cuda"), ValueError, "impl='cuda'"),
        (lambda x, w, b: skinny_linear("x", w), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input_raises(make, exc, match) -> None:
    x, w, b = _operands(4, 6, 10, torch.float32, "cpu")
    with pytest.raises(exc, match=match):
        make(x, w, b)


def test_out_overlapping_an_input_raises() -> None:
    buf = torch.randn(4, 16)
    x = buf[:, :10]
    _, w, _ = _operands(4, 6, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match="overlaps x"):
        skinny_linear(x, w, out=buf[:, 10:])


# ---- the call cache (CUDA calls; here forced on for the interpreter's CPU tensors) ---------


def test_call_cache_skips_checks_but_not_overlaps(monkeypatch, triton_device) -> None:
    """A call alike a validated one skips the checks (a spy on them fails if they run) and
    launches the stored config; the address check of ``out`` still runs per call."""
    from kv_kernels.gemm import api

    monkeypatch.setattr(api, "_call_key", api._key_of)
    monkeypatch.setattr(api, "_CALLS", api.CallCache("test"))
    x0, w, b = _operands(5, 33, 77, torch.float16, triton_device)
    # x and out as column windows of one [5, 110] buffer: the overlap call below has the same key
    buf = torch.zeros(5, 110, dtype=torch.float16, device=triton_device)
    other = torch.zeros_like(buf)
    buf[:, :77] = x0
    x, out = buf[:, :77], other[:, 77:]
    cfg = GemmConfig(16, 16, 16, 2, 4, 2)
    first = skinny_linear(x, w, b, config=cfg, impl="triton", out=out).clone()
    assert len(api._CALLS) == 1

    def no_checks(*args: object) -> None:
        raise AssertionError("the checks ran on a cached call")

    monkeypatch.setattr(api, "unsupported_reason", no_checks)
    out.zero_()
    assert torch.equal(skinny_linear(x, w, b, config=cfg, impl="triton", out=out), first)
    with pytest.raises(ValueError, match="overlaps x"):
        skinny_linear(
            x, w, b, config=cfg, impl="triton", out=buf[:, 77:]
        )  # (interleaved spans: refused)
    assert len(api._CALLS) == 1


def test_call_key_separates_int_and_float_configs() -> None:
    from kv_kernels.gemm import api

    x, w, _ = _operands(2, 8, 16, torch.float32, "cpu")
    a = api._key_of(x, w, None, None, GemmConfig(16, 16, 16), "auto")
    b = api._key_of(x, w, None, None, GemmConfig(16.0, 16, 16), "auto")  # type: ignore[arg-type]
    assert a is not None and b is not None and a != b
    with pytest.raises(ValueError, match="block_m=16.0"):
        skinny_linear(x, w, config=GemmConfig(16.0, 16, 16))  # type: ignore[arg-type]
