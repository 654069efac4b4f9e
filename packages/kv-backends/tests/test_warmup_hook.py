"""``AttentionImpl.warmup``: the TRITON impl builds its kernels ahead with the options its
``forward`` launches them with (so the warmed variants are the ones a step needs); every other
backend compiles nothing ahead and says so with ``{}``."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends import triton_attn
from kv_backends.testing import make_batch_impl, make_paged_batch


def _batch() -> Any:
    return make_paged_batch(
        query_lens=[5, 1], seq_lens=[20, 9], num_q_heads=8, num_kv_heads=2, head_size=32,
        sliding_window=7, has_sinks=True, softcap=3.0, dtype="float16",
    )  # fmt: skip


def test_triton_warmup_launches_with_forwards_options(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _batch()
    impl = make_batch_impl(get_backend("TRITON"), b, num_splits=3)
    seen: dict[str, Any] = {}

    def fake_paged_attention(*args: Any, **kw: Any) -> None:
        seen["forward"] = kw

    def fake_warm(cache: torch.Tensor, layout: Any, **kw: Any) -> dict[str, float]:
        seen["warmup"] = (cache, layout, kw)
        return {"x": 0.0}

    import kv_kernels.warmup as wu

    # (the package's name is shadowed by the function it exports: take the module itself)
    pa = sys.modules["kv_kernels.paged_attention"]
    real_paged_attention = pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", fake_paged_attention)
    monkeypatch.setattr(wu, "warm_paged_ops", fake_warm)
    # (the CPU stands in for CUDA here: the warmup compiles only on CUDA)
    monkeypatch.setattr(triton_attn, "_compiles_ahead", lambda device: True)
    builder = get_backend("TRITON").make_builder(b.config, b.layout, device=b.q.device)
    impl.forward(None, b.q, b.kv_cache, builder.build(b.common))
    assert impl.warmup(b.kv_cache, block_table_width=9, block_table_stride=12) == {"x": 0.0}
    cache, layout, kw = seen["warmup"]
    assert layout == impl.kernel_cache(b.kv_cache)[1] and cache.shape == b.kv_cache.shape
    assert (kw["block_table_width"], kw["block_table_stride"]) == (9, 12)
    assert kw["num_q_heads"] == 8 and kw["q_dtype"] == torch.float16
    # forward leaves out options at paged_attention's defaults (the same call): fill them in.
    defaults = inspect.signature(real_paged_attention).parameters
    fwd = {n: p.default for n, p in defaults.items()} | seen["forward"]
    for name in ("scale", "causal", "num_splits", "sliding_window", "softcap"):
        assert kw[name] == fwd[name], name
    for name in ("sinks", "alibi_slopes", "k_scale", "v_scale"):
        a, f = kw[name], fwd[name]
        assert (a is None and f is None) or torch.equal(a, f), name


def test_no_warmup_off_cuda_or_for_other_backends() -> None:
    b = _batch()
    assert make_batch_impl(get_backend("TRITON"), b).warmup(b.kv_cache) == {}
    sdpa = make_batch_impl(get_backend("TORCH_SDPA"), b)
    assert sdpa.warmup(b.kv_cache, block_table_width=4) == {}
