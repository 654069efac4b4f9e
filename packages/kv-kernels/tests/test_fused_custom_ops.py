"""The fused ops as torch custom ops: ``torch.library.opcheck`` (schema, fake, mutations) on the
CPU, the public functions under ``torch.compile(fullgraph=True)`` giving the eager bits, and
CUDA-graph capture on the GPU."""

from __future__ import annotations

import pytest
import torch
from kv_kernels.fused import (
    gelu_tanh_and_mul,
    rms_norm,
    rope_cos_sin_cache,
    rotary_embedding,
    silu_and_mul,
)


def _cache(d: int = 16, n: int = 32) -> torch.Tensor:
    return rope_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), n)


def test_ops_are_registered() -> None:
    for name in ("rms_norm", "act_and_mul", "rotary_embedding", "rope_and_cache"):
        assert hasattr(torch.ops.kv_kernels, name)


def test_opcheck_rms_norm() -> None:
    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    op = torch.ops.kv_kernels.rms_norm.default
    torch.library.opcheck(
        op, (x, w, 1e-6, r, torch.empty(3, 32), torch.empty(3, 32), 0.0, False, "reference")
    )
    torch.library.opcheck(op, (x, w, 1e-6, None, torch.empty(3, 32), None, 1.0, True, "reference"))


def test_opcheck_act_and_mul() -> None:
    x = torch.randn(4, 24)
    for act in ("silu", "gelu_tanh"):
        torch.library.opcheck(
            torch.ops.kv_kernels.act_and_mul.default, (x, torch.empty(4, 12), act, "reference")
        )


def test_opcheck_rotary_embedding() -> None:
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    args = (torch.tensor([0, 3, 7, 1, 30]), q, k, _cache(), True, 16, "reference", None)
    torch.library.opcheck(torch.ops.kv_kernels.rotary_embedding.default, args)
    args = (
        torch.tensor([2, 2, 9]),
        torch.randn(3, 2, 16),
        None,
        _cache(8),
        False,
        8,
        "reference",
        None,
    )
    torch.library.opcheck(torch.ops.kv_kernels.rotary_embedding.default, args)


def test_opcheck_rope_and_cache() -> None:
    from kv_kernels import allocate_kv_cache, layer_view
    from kv_kernels._common import layout_json
    from kv_spec import KVCacheLayout

    layout = KVCacheLayout(
        order="LBHNC", num_layers=2, num_blocks=4, num_kv_heads=2, block_size=4, head_size=16,
        head_size_v=8, dtype="float32",
    )  # fmt: skip
    view = layer_view(allocate_kv_cache(layout), layout, 1)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 8)
    args = (
        torch.tensor([1, 2, 3]), q, k, v, _cache(), view, torch.tensor([5, -1, 12]),
        layout_json(layout), True, 16, "reference", None,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.kv_kernels.rope_and_cache.default, args)


def _layer(x, residual, w, qkv, positions, cache, gate_up):
    """A decoder layer's elementwise calls, as the engine would make them."""
    y, h = rms_norm(x, w, 1e-6, residual=residual, residual_out=residual)
    q, k = qkv[:, :4], qkv[:, 4:6]
    rotary_embedding(positions, q, k, cache)
    a = silu_and_mul(gate_up)
    g = gelu_tanh_and_mul(gate_up)
    return y, h, a, g


def test_public_functions_compile_fullgraph() -> None:
    """One graph (no break at validation or launch) with the eager results, the in-place
    residual update and q/k rotation included."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 32), torch.rand(32) + 0.5
    qkv = torch.randn(3, 8, 16)
    positions, cache = torch.tensor([1, 5, 9]), _cache()
    gate_up = torch.randn(3, 40)
    residual0 = torch.randn(3, 32)
    results = []
    for fn in (_layer, torch.compile(_layer, backend="aot_eager", fullgraph=True)):
        residual, qkv_i = residual0.clone(), qkv.clone()
        out = fn(x, residual, w, qkv_i, positions, cache, gate_up)
        results.append((*out, residual, qkv_i))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][-1], qkv)  # rotated in place
    assert torch.equal(results[0][-1][:, 6:], qkv[:, 6:])  # v untouched


@pytest.mark.gpu
def test_cuda_graph_capture() -> None:
    x, w = torch.randn(64, 4096, device="cuda").bfloat16(), torch.rand(4096, device="cuda")
    residual = torch.randn(64, 4096, device="cuda").bfloat16()
    qkv = torch.randn(64, 48, 128, device="cuda").bfloat16()
    positions = torch.arange(64, device="cuda")
    cache = _cache(128, 128).cuda()
    gate_up = torch.randn(64, 2 * 1024, device="cuda").bfloat16()
    y, act = torch.empty_like(x), torch.empty(64, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        rms_norm(x, w, 1e-6, residual=residual, out=y, residual_out=residual)
        rotary_embedding(positions, qkv[:, :32], qkv[:, 32:40], cache)
        silu_and_mul(gate_up, out=act)

    step()  # build the kernels outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    before = residual.clone()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(residual, (before.float() + x.float()).bfloat16())
