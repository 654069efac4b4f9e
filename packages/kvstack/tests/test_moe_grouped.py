"""The grouped (sync-free) expert path against SparseMoE's expert loop, on the CPU where torch's
``_grouped_mm`` runs there (its CUDA kernel is checked by the GPU engine tests): every routing
kind, experts that get no token, one token, and a planted bug (group ends shifted by one row)
that the comparison must catch."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from kvstack.engine.layers import SparseMoE
from torch import nn


def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(
            torch.ones(2, 16), torch.ones(1, 16, 16), offs=torch.tensor([2], dtype=torch.int32)
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _cpu_grouped_mm(), reason="torch._grouped_mm has no CPU path here"
)


def _moe(kind: str, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    m = SparseMoE(
        kind, 64, 32, 8, 2, n_group=2 if kind == "grouped_sigmoid" else 1, topk_group=1,
        routed_scaling_factor=1.5, shared_intermediate=16 if kind == "grouped_sigmoid" else 0,
    )  # fmt: skip
    for p in m.parameters():
        nn.init.normal_(p, 0.0, 0.2)
    return m


@pytest.mark.parametrize("kind", ["mixtral", "softmax_topk", "grouped_sigmoid"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_equal_the_loop(kind: str, tokens: int) -> None:
    m = _moe(kind)
    x = torch.randn(tokens, 64)
    loop = m(x)
    before = {n: p.clone() for n, p in m.named_parameters()}
    m.stack_experts()
    assert m.grouped is not None and m.grouped.intact()
    for n, p in m.named_parameters():  # names, shapes and values as the checkpoint gave them
        assert torch.equal(p, before[n]), n
    _, ids = m.route(x)
    if tokens == 1:
        assert len(ids.unique()) < m.num_experts  # experts without a token are groups of 0 rows
    torch.testing.assert_close(m(x), loop, rtol=1e-5, atol=1e-5)


def test_grouped_experts_share_the_stack_storage() -> None:
    m = _moe("softmax_topk")
    m.stack_experts()
    g = m.grouped
    assert g is not None
    w = cast(torch.Tensor, m.experts[3].get_submodule("down_proj").weight)
    assert w.data_ptr() == g.w2[3].data_ptr()  # a view of the stack: no weight held twice


def test_replaced_parameters_fall_back_to_the_loop() -> None:
    m = _moe("mixtral")
    x = torch.randn(5, 64)
    m.stack_experts()
    assert m.grouped is not None
    _double_w1(m)
    assert not m.grouped.intact()
    got = m(x)  # the loop over the new parameter, not the stale stack
    m2 = _moe("mixtral")
    _double_w1(m2)
    torch.testing.assert_close(got, m2(x))


def _double_w1(m: SparseMoE) -> None:
    w1 = m.experts[0].get_submodule("w1")
    w1.weight = nn.Parameter(cast(torch.Tensor, w1.weight).detach() * 2)


def test_planted_bug_shifted_group_ends_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _moe("softmax_topk")
    x = torch.randn(40, 64)
    loop = m(x)
    m.stack_experts()
    real = torch.Tensor.cumsum

    def shifted(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        out = real(self, *a, **k)
        if out.dtype == torch.int32 and out.numel() == m.num_experts:
            out = out.clone()
            out[0] = max(int(out[0]) - 1, 0)  # one row handed to the wrong expert
        return out

    monkeypatch.setattr(torch.Tensor, "cumsum", shifted)
    assert not torch.allclose(m(x), loop, rtol=1e-5, atol=1e-5)
