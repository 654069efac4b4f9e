"""TRITON's ``forward`` host path (issue 32: <= 5 us over the direct kernel call): what it hands
the kernel, checked on the CPU with ``paged_attention`` replaced by a recorder — the same
arguments as before the fast path (defaults left out mean the same call), a layer's own scales
still win, and bad inputs still raise check_forward_inputs' / empty_output's named errors."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.testing import make_paged_batch


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    import kv_kernels.paged_attention  # noqa: F401  (the package, not its function)

    got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def record(*args: Any, **kw: Any) -> None:
        got.append((args, kw))

    monkeypatch.setattr(sys.modules["kv_kernels.paged_attention"], "paged_attention", record)
    return got


def _impl_and_batch(**impl_kw: Any) -> tuple[Any, Any, Any]:
    b = make_paged_batch(
        query_lens=[1, 1, 1], seq_lens=[5, 17, 33], num_q_heads=4, num_kv_heads=2, head_size=16
    )
    backend = get_backend("TRITON")
    md = backend.make_builder(b.config, b.layout, device="cpu").build(b.common)
    return backend.make_impl(b.config, b.layout, device="cpu", **impl_kw), b, md


def test_forward_passes_the_batch_and_only_non_default_options(calls: list[Any]) -> None:
    impl, b, md = _impl_and_batch()
    out = torch.empty(3, 4, 16, dtype=b.q.dtype)
    assert impl.forward(None, b.q, b.kv_cache, md, out=out) is out
    impl.forward(None, b.q, b.kv_cache, md, out=out)  # the per-device dict, reused
    assert len(calls) == 2
    args, kw = calls[1]
    assert args[0] is b.q and args[1] is b.kv_cache and args[2] is b.layout
    assert args[3] is md.block_table and args[4] is md.seq_lens and args[5] is md.query_start_loc
    assert args[6] == md.max_query_len
    assert kw == {"max_seq_len": md.max_seq_len, "out": out, "scale": impl.scale, "impl": "triton"}
    # Without out: a [T, Hq, Dv] output of q's dtype, passed to the kernel, which writes every
    # real row (this stub writes none: nothing is zeroed for it, there being no padding).
    res = impl.forward(None, b.q, b.kv_cache, md)
    assert res.shape == (3, 4, 16) and res.dtype == b.q.dtype
    assert calls[-1][1]["out"] is res


def test_forward_zeroes_only_the_padding_rows_of_its_output(
    calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Padding rows (past ``num_actual_tokens``: they see no key) are zeros before the kernel
    runs; the real rows are the kernel's to write, and with no padding nothing is filled.
    Planted: zeroing from row 0 (the whole output) or not at all both fail the fill count or
    the rows' values below."""
    b = make_paged_batch(
        query_lens=[1, 1, 1], seq_lens=[5, 17, 33], num_q_heads=4, num_kv_heads=2, head_size=16,
        pad_tokens=2,
    )  # fmt: skip
    backend = get_backend("TRITON")
    md = backend.make_builder(b.config, b.layout, device="cpu").build(b.common)
    impl = backend.make_impl(b.config, b.layout, device="cpu")
    assert md.num_actual_tokens == 3 and b.q.shape[0] == 5
    fills: list[int] = []
    zero_ = torch.Tensor.zero_

    def counted(self: torch.Tensor) -> torch.Tensor:
        fills.append(self.shape[0])
        return zero_(self)

    monkeypatch.setattr(torch.Tensor, "zero_", counted)
    empty = torch.empty

    def poisoned(*a: Any, **k: Any) -> torch.Tensor:  # the allocator's garbage, made visible
        return empty(*a, **k).fill_(7.0)

    monkeypatch.setattr(torch, "empty", poisoned)
    res = impl.forward(None, b.q, b.kv_cache, md)
    assert fills == [2]  # the two padding rows, once
    assert not res[3:].any() and bool((res[:3] == 7).all())  # real rows: the kernel's (a stub)


def test_options_off_their_defaults_are_passed(calls: list[Any]) -> None:
    impl, b, md = _impl_and_batch(num_splits=2, check_metadata=True)
    impl.forward(None, b.q, b.kv_cache, md)
    _, kw = calls[-1]
    assert kw["num_splits"] == 2
    assert kw["error_flag"] is impl.metadata_errors("cpu")


def test_a_layer_with_its_own_scales_is_not_cached(calls: list[Any]) -> None:
    impl, b, md = _impl_and_batch()

    class Layer:
        k_scale = torch.tensor(0.5)
        v_scale = torch.tensor(0.25)

    impl.forward(Layer(), b.q, b.kv_cache, md)
    _, kw = calls[-1]
    assert float(kw["k_scale"]) == 0.5 and float(kw["v_scale"]) == 0.25
    impl.forward(None, b.q, b.kv_cache, md)
    assert "k_scale" not in calls[-1][1] and "v_scale" not in calls[-1][1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b, md: (b.q[:, :2], b.kv_cache, md, None), "expected \\[num_tokens, 4, 16\\]"),
        # a wrong rank fails forward's shape unpacking first; the same named error
        (lambda b, md: (b.q[:, 0], b.kv_cache, md, None), "expected \\[num_tokens, 4, 16\\]"),
        (lambda b, md: (b.q[None], b.kv_cache, md, None), "expected \\[num_tokens, 4, 16\\]"),
        (lambda b, md: (b.q[:, :, :8], b.kv_cache, md, None), "expected \\[num_tokens, 4, 16\\]"),
        (lambda b, md: (b.q[:2], b.kv_cache, md, None), "num_actual_tokens=3"),
        (lambda b, md: (b.q.double(), b.kv_cache, md, None), "this layer computes in"),
        (lambda b, md: (b.q, b.kv_cache[:1], md, None), "kv_cache has shape"),
        (lambda b, md: (b.q, b.kv_cache.double(), md, None), "kv_cache has dtype"),
        (lambda b, md: (b.q, b.kv_cache, md, torch.empty(3, 4, 8)), "out has shape"),
        (lambda b, md: (b.q, b.kv_cache, md, torch.empty(3, 4, 16).double()), "out has shape"),
        (lambda b, md: (b.q, b.kv_cache, md, torch.empty(2, 4, 16)), "out has shape"),
        (lambda b, md: (b.q, b.kv_cache, md, torch.empty(3, 4, 16, 1)), "out has shape"),
        (lambda b, md: (b.q, b.kv_cache.half(), md, None), "kv_cache has dtype"),
    ],
)
def test_bad_inputs_still_name_the_field(calls: list[Any], change: Any, message: str) -> None:
    impl, b, md = _impl_and_batch()
    q, kv, md2, out = change(b, md)
    with pytest.raises(ValueError, match=message):
        impl.forward(None, q, kv, md2, out=out)
    assert not calls


def test_a_mixed_batch_hands_the_kernel_its_leading_decodes(calls: list[Any]) -> None:
    """The builder counts the leading decodes on the host copy of ``query_start_loc``; forward
    passes them (``num_decodes``) where a prefill class runs, and a decode step never does."""
    backend = get_backend("TRITON")
    for q_lens, want in (([1, 1, 1, 7, 1], 3), ([4, 1, 1], 0), ([1, 1, 1], None)):
        b = make_paged_batch(
            query_lens=q_lens, seq_lens=[20] * len(q_lens), num_q_heads=4, num_kv_heads=2,
            head_size=16,
        )  # fmt: skip
        md = backend.make_builder(b.config, b.layout, device="cpu").build(b.common)
        assert md.num_decodes == (len(q_lens) if want is None else want)
        impl = backend.make_impl(b.config, b.layout, device="cpu")
        impl.forward(None, b.q, b.kv_cache, md)
        assert calls[-1][1].get("num_decodes") == (want or None), q_lens
