"""``skinny_linear`` on a CUDA GPU (marked ``gpu``; skipped without one): bf16 parity at
Llama-3-8B's projections and every M bucket (each picked config, split and unsplit), a planted
dropped K column the same bound catches (on the cached call path too), bitwise determinism,
CUDA-graph replay, and a weight of more than 2^31 elements (64-bit offsets).

Tolerance: ``err_kernel <= 2 * err_cublas + 1e-3`` against a float32 oracle; both round a
float32 sum to bf16 once, so the kernel sits within a small multiple of cuBLAS's error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kv_kernels.gemm import GemmConfig, pick_config, skinny_linear
from kv_kernels.gemm import triton as gemm_triton

pytestmark = pytest.mark.gpu

LLAMA = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
         "down": (4096, 14336)}  # fmt: skip


def _operands(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
    return x, w


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    oracle = x.float() @ w.float().T
    err = (y.float() - oracle).abs().max().item()
    err_blas = (F.linear(x, w).float() - oracle).abs().max().item()
    assert err <= 2 * err_blas + 1e-3, (
        f"kernel error {err:.3g} > 2 * cuBLAS's {err_blas:.3g} + 1e-3"
    )


@pytest.mark.parametrize("shape", list(LLAMA))
@pytest.mark.parametrize("m", [1, 16, 37, 64, 128, 256])
def test_bf16_parity_llama_shapes(shape: str, m: int) -> None:
    n, k = LLAMA[shape]
    x, w = _operands(m, n, k)
    _check(skinny_linear(x, w), x, w)


def test_planted_dropped_k_column_is_caught(monkeypatch) -> None:
    """K - 1 with ``EVEN_K=False``: at K 4096 every slice is full, the kernel's loop never reads
    K, and K - 1 alone ran the right product (the H200's "DID NOT RAISE"); the masked path
    stops one column short. Through the call cache too: a second, cached call runs the plant."""
    real = gemm_triton._GEMM
    calls: list[object] = []

    def short_k(key, grid, args, kwargs):
        calls.append(key)
        args = (*args[:7], args[7] - 1, *args[8:])  # K -> K - 1
        return real(("planted", key), grid, args, {**kwargs, "EVEN_K": False})

    monkeypatch.setattr(gemm_triton, "_GEMM", short_k)
    x, w = _operands(64, 4096, 4096)
    cfg = GemmConfig(64, 64, 128, 1, 4, 4)
    for _ in range(2):  # the first call validates and caches, the second takes the cached path
        with pytest.raises(AssertionError, match="kernel error"):
            _check(skinny_linear(x, w, config=cfg), x, w)
    assert len(calls) == 2, "the planted launcher did not run on every call"


def test_split_k_is_bitwise_deterministic_and_graph_safe() -> None:
    x, w = _operands(64, 4096, 14336)
    cfg = pick_config(64, 4096, 14336)
    assert cfg.split_k > 1
    first = skinny_linear(x, w)
    for _ in range(3):
        assert torch.equal(skinny_linear(x, w), first)
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny_linear(x, w, out=out)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        skinny_linear(x, w, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


def test_weight_over_2_31_elements() -> None:
    """W of 2^31 + 64 * 4096 elements (4.3 GB): rows past 2^31 / K are addressed with 64-bit
    offsets; the last rows' outputs match a product of those rows alone."""
    k = 4096
    n = 2**31 // k + 64
    w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    w[:-128].zero_()
    g = torch.Generator(device="cuda").manual_seed(1)
    w[-128:] = (torch.randn(128, k, generator=g, device="cuda") * k**-0.5).bfloat16()
    x = torch.randn(16, k, generator=g, device="cuda").bfloat16()
    y = skinny_linear(x, w)
    _check(y[:, -128:].contiguous(), x, w[-128:])
    assert not y[:, :-128].any()
