"""CUDA graphs: every backend that declares CUDA-graph support is captured and replayed (bf16,
fp8 per-tensor and DiffKV caches where it declares them), and its per-step forward runs without
a host<->device sync (``torch.cuda.set_sync_debug_mode("error")``).

GPU only (marked ``gpu``). The impl is made with ``device="cuda"``, so sinks and scales are on the
device before capture: a host->device copy inside capture fails with "Cannot copy between CPU and
CUDA tensors during CUDA graph capture" (issue 10).
"""

from __future__ import annotations

import pytest
import torch
from kv_backends import Platform, get_backend
from kv_backends.capabilities import CUDAGRAPH_NEVER
from kv_backends.registry import BACKEND_CLASSES
from kv_backends.testing import (
    PagedBatch,
    lowprec_reference,
    make_batch_impl,
    make_paged_batch,
    oracle_attention,
)
from kv_kernels.testing import check_close_to_oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_GRAPH_BACKENDS = [
    n for n in BACKEND_CLASSES if get_backend(n).CAPABILITIES.cudagraph_support != CUDAGRAPH_NEVER
]

#: Cache variants: name -> make_paged_batch kwargs; each runs where the literal declares it.
_CACHES = {
    "bf16": {"dtype": "bfloat16"},
    "fp8_per_tensor": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
    "diffkv_192_128": {"dtype": "bfloat16", "head_size": 192, "head_size_v": 128},
    "bf16_sinks_window": {"dtype": "bfloat16", "has_sinks": True, "sliding_window": 64},
}


def _decode_batch(name: str, cache: str, seed: int = 0) -> PagedBatch:
    kw = dict(_CACHES[cache])
    if get_backend(name).CAPABILITIES.requires_head_size_v_diff and "head_size_v" not in kw:
        pytest.skip(f"{name} serves only head_size_v != head_size")
    kw.setdefault("head_size", 128)
    # A uniform decode batch: what every declared level (uniform_batch and up) can capture.
    return make_paged_batch(
        query_lens=[1] * 8,
        seq_lens=[37, 512, 9, 1000, 64, 300, 17, 777],
        num_q_heads=8,
        num_kv_heads=2,
        device="cuda",
        seed=seed,
        **kw,
    )


def _setup(name: str, b: PagedBatch):
    backend = get_backend(name)
    reasons = backend.validate(b.config, Platform.detect())
    if reasons:
        pytest.skip(f"{name} cannot serve this case here: {reasons}")
    impl = make_batch_impl(backend, b, device="cuda")
    md = backend.make_builder(b.config, b.layout, device="cuda").build(b.common)
    return impl, md


@pytest.mark.parametrize("cache", list(_CACHES))
@pytest.mark.parametrize("name", _GRAPH_BACKENDS)
def test_capture_and_replay(name: str, cache: str) -> None:
    b = _decode_batch(name, cache)
    impl, md = _setup(name, b)
    out = torch.zeros(
        b.q.shape[0], b.config.num_q_heads, b.config.head_size_v, dtype=b.q.dtype, device="cuda"
    )
    # Warm up on a side stream (compiles kernels, allocates nothing inside capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            impl.forward(None, b.q, b.kv_cache, md, out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, b.q, b.kv_cache, md, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), f"{name}/{cache}: replay differs from eager"
    # New queries in the captured buffer: the replay follows them.
    b.q.copy_(torch.randn_like(b.q))
    graph.replay()
    torch.cuda.synchronize()
    fresh = impl.forward(None, b.q, b.kv_cache, md)
    torch.testing.assert_close(out, fresh, atol=0, rtol=0)
    res = check_close_to_oracle(out, oracle_attention(b), lowprec_reference=lowprec_reference(b))
    assert res.ok, f"{name}/{cache}: {res.message}"


@pytest.mark.parametrize("name", _GRAPH_BACKENDS)
def test_forward_does_not_sync(name: str) -> None:
    b = _decode_batch(name, "fp8_per_tensor" if name == "TRITON" else "bf16")
    impl, md = _setup(name, b)
    out = torch.empty(
        b.q.shape[0], b.config.num_q_heads, b.config.head_size_v, dtype=b.q.dtype, device="cuda"
    )
    impl.forward(None, b.q, b.kv_cache, md, out=out)  # first call: params to the device, JIT
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        impl.forward(None, b.q, b.kv_cache, md, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
