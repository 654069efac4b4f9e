"""``AttentionImpl.plain_cache_write``: where a layer's cache write is exactly kv-kernels'
``reshape_and_cache`` with no scales, it says with which ``impl`` and ``error_flag``, so a caller
that fuses work into the write (RoPE: ``kv_kernels.fused.rope_and_cache``) writes the same bytes;
everywhere else (a quantized or MLA cache, a backend whose write is its own) it says ``None``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_backends import AttentionImpl, get_backend
from kv_backends.backends.triton_attn import TritonImpl
from kv_backends.impl import PlainCacheWrite
from kv_backends.testing import make_batch_impl, make_latent_batch, make_paged_batch
from kv_kernels.reshape_and_cache import reshape_and_cache

CPU = torch.device("cpu")


def _batch(**kw: Any) -> Any:
    return make_paged_batch(query_lens=[3, 1], seq_lens=[9, 5], **kw)


def _new_kv(b: Any, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    h, d, dv = b.layout.num_kv_heads, b.layout.head_size, b.layout.head_size_v
    key = torch.randn(n, h, d, generator=g)
    value = torch.randn(n, h, dv, generator=g)
    slots = b.common.slot_mapping[:n].clone()
    slots[1] = -1  # a padding token: skipped by both
    return key, value, slots


@pytest.mark.parametrize(
    ("backend", "kw"),
    [
        ("FLEX_ATTENTION", {}),
        ("FLEX_ATTENTION", {"order": "BLNHC", "num_layers": 2, "layer": 1, "head_size_v": 16}),
    ],
    ids=["flex LBNHC", "flex BLNHC layer 1 diff-kv"],
)
def test_plain_write_gives_do_kv_cache_updates_bytes(backend: str, kw: dict[str, Any]) -> None:
    b = _batch(**kw)
    impl = make_batch_impl(get_backend(backend), b)
    plain = impl.plain_cache_write(CPU)
    assert plain == PlainCacheWrite("auto", None)
    key, value, slots = _new_kv(b, 4)
    by_impl, by_plan = b.kv_cache.clone(), b.kv_cache.clone()
    impl.do_kv_cache_update(None, key, value, by_impl, slots)
    reshape_and_cache(
        key, value, by_plan, slots, impl.layout, impl=plain.impl, error_flag=plain.error_flag
    )
    assert torch.equal(by_impl, by_plan)
    assert not torch.equal(by_impl, b.kv_cache)  # (the write wrote something)


def test_triton_reports_its_impl_and_metadata_counter() -> None:
    b = _batch()
    impl = make_batch_impl(get_backend("TRITON"), b, check_metadata=True)
    assert isinstance(impl, TritonImpl)
    plain = impl.plain_cache_write(CPU)
    assert plain is not None and plain.impl == "triton"
    assert plain.error_flag is impl.metadata_errors(CPU)  # bad slots counted where they were
    unchecked = make_batch_impl(get_backend("TRITON"), b).plain_cache_write(CPU)
    assert unchecked == PlainCacheWrite("triton", None)


def test_no_plain_write_where_the_write_is_not_reshape_and_cache_alone() -> None:
    b = _batch()
    # TORCH_SDPA writes its own way (the reference on every device, index_copy_ on the CPU)
    assert make_batch_impl(get_backend("TORCH_SDPA"), b).plain_cache_write(CPU) is None
    # fp8: the write needs the layer's scales
    fp8 = _batch(kv_cache_dtype="fp8_e4m3")
    assert make_batch_impl(get_backend("TRITON"), fp8).plain_cache_write(CPU) is None
    # MLA: one latent row per token
    latent = make_latent_batch(query_lens=[2], seq_lens=[6])
    assert make_batch_impl(get_backend("TRITON_MLA"), latent).plain_cache_write(CPU) is None


def test_a_subclass_with_its_own_write_is_not_plain() -> None:
    """The twin of the FLEX case: the same backend, its write overridden, must say None (a
    fused write would skip whatever the override does)."""
    b = _batch()
    flex = get_backend("FLEX_ATTENTION")
    seen: list[int] = []

    class Counting(flex.impl_cls):  # type: ignore[name-defined]
        def do_kv_cache_update(self, *a: Any) -> None:
            seen.append(1)
            super().do_kv_cache_update(*a)

    impl = Counting(b.config, b.layout)
    assert isinstance(impl, AttentionImpl)
    assert impl.plain_cache_write(CPU) is None
