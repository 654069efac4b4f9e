"""``StackedLinear``: q/k/v (and gate/up) as one matmul must give the separate linears' outputs,
follow in-place edits of the parameters, and never serve a stale stack once a parameter is
replaced."""

from __future__ import annotations

import torch
from kvstack.engine.layers import GatedMLP, Linear, StackedLinear
from torch import nn


def _linears(bias: bool) -> list[nn.Linear]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (48, 16, 24):  # odd sizes: the split points must land on each linear's columns
        lin = Linear(32, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, 32, generator=g))
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        out.append(lin)
    return out


def test_stacked_outputs_equal_the_separate_linears() -> None:
    for bias in (False, True):
        lins = _linears(bias)
        x = torch.randn(7, 32)
        want = [lin(x) for lin in lins]
        stack = StackedLinear(lins)
        got = stack(x)
        assert got is not None
        for a, b, lin in zip(got, want, lins, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            assert torch.equal(lin(x), b), "the parameters' values must be unchanged"
        assert stack.weight.data_ptr() == lins[0].weight.data_ptr(), "parameters are views"


def test_in_place_edit_reaches_the_stack() -> None:
    lins = _linears(True)
    stack = StackedLinear(lins)
    x = torch.randn(5, 32)
    with torch.no_grad():
        lins[1].weight.mul_(-2.0)
        lins[2].bias.add_(1.0)
    got = stack(x)
    assert got is not None
    for a, lin in zip(got, lins, strict=True):
        torch.testing.assert_close(a, lin(x), rtol=1e-6, atol=1e-6)


def test_replaced_parameter_is_never_served_from_the_stack() -> None:
    lins = _linears(False)
    stack = StackedLinear(lins)
    lins[1].weight = nn.Parameter(torch.zeros(16, 32))  # e.g. load_state_dict(assign=True)
    assert stack(torch.randn(3, 32)) is None
    mlp = GatedMLP(32, 16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p))
    mlp.stack_projections()
    x = torch.randn(4, 32)
    before = mlp(x)
    torch.testing.assert_close(
        before, mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    )
    mlp.up_proj.weight = nn.Parameter(torch.zeros(16, 32))  # up(x) = 0: the output is 0
    assert torch.equal(mlp(x), torch.zeros_like(before))
