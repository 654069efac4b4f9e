"""``StackedLinear``: q/k/v (and gate/up) as one matmul must give the separate linears' outputs,
follow in-place edits of the parameters, and never serve a stale stack once a parameter is
replaced. ``Attention.qkv`` norms and rotates q and k heads in one op each, with the bits of one
op per projection."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_rmsnorm_with_a_per_head_weight_equals_one_norm_per_head_group() -> None:
    """One call over q and k heads side by side (a ``[Hq + Hkv, D]`` weight) gives each group's
    own norm, bit for bit (Qwen3's q_norm / k_norm run this way)."""
    from kvstack.engine.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    qn, kn = RMSNorm(32, 1e-6), RMSNorm(32, 1e-6)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(32, generator=g))
        kn.weight.copy_(torch.randn(32, generator=g))
    x = torch.randn(5, 6, 32, generator=g)  # 4 q heads, 2 k heads
    weight = torch.cat([qn.weight.expand(4, 32), kn.weight.expand(2, 32)])
    want = torch.cat([qn(x[:, :4]), kn(x[:, 4:])], dim=1)
    assert torch.equal(qn(x, weight), want)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_qkv_equals_each_projection_normed_and_rotated_alone(tmp_path: Path, family: str) -> None:
    """``Attention.qkv`` norms (Qwen3) and rotates q and k heads in one op each; the result is
    each projection's output normed and rotated on its own, bit for bit, stacked or not."""
    from kvstack.engine.loader import load_model
    from kvstack.engine.testing import make_hf_checkpoint

    model = load_model(make_hf_checkpoint(family, tmp_path / family, seed=3))
    attn = model.decoder_layers()[1].self_attn
    x = torch.randn(7, model.arch.hidden_size)
    cos, sin = model.rotary.cos_sin(torch.arange(3, 10), x.dtype)

    def one_by_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        q, k = q.view(7, attn.num_q_heads, -1), k.view(7, attn.num_kv_heads, -1)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return [
            model.rotary(q, cos, sin),
            model.rotary(k, cos, sin),
            v.view(7, attn.num_kv_heads, -1),
        ]

    with torch.no_grad():
        assert attn.stacked is not None
        stacked_out = attn.stacked(x)
        assert stacked_out is not None
        cases = [(attn.qkv(x, model.rotary, cos, sin), one_by_one(*stacked_out))]
        attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.clone())  # leaves the stack
        alone = one_by_one(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
        cases.append((attn.qkv(x, model.rotary, cos, sin), alone))
    for got, want in cases:
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_qwen3_qk_norm_weight_follows_edits(tmp_path: Path) -> None:
    """The stacked q/k norm weight is kept between no_grad calls: an in-place edit or a new
    parameter must reach the next call, and the result must equal a fresh model's."""
    from kvstack.engine.loader import load_model
    from kvstack.engine.testing import make_hf_checkpoint

    model = load_model(make_hf_checkpoint("qwen3", tmp_path / "qwen3", seed=3))
    attn = model.decoder_layers()[0].self_attn
    assert attn.q_norm is not None and attn.k_norm is not None
    x = torch.randn(5, model.arch.hidden_size)
    cos, sin = model.rotary.cos_sin(torch.arange(5), x.dtype)

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return list(attn.qkv(x, model.rotary, cos, sin))

    def fresh() -> list[torch.Tensor]:
        attn._qk_weight = None
        return run()

    first = run()
    assert all(torch.equal(a, b) for a, b in zip(run(), first, strict=True))
    with torch.no_grad():
        attn.k_norm.weight.mul_(2.0)  # in place: the version counter moves
    edited = run()
    assert not torch.equal(edited[1], first[1]) and torch.equal(edited[0], first[0])
    assert all(torch.equal(a, b) for a, b in zip(edited, fresh(), strict=True))
    attn.q_norm.weight = nn.Parameter(attn.q_norm.weight * 3.0)  # replaced
    replaced = run()
    assert not torch.equal(replaced[0], first[0])
    assert all(torch.equal(a, b) for a, b in zip(replaced, fresh(), strict=True))


@pytest.mark.parametrize("shape", [(7, 32), (1789, 128), (5, 6, 32), (1, 96)])
def test_float32_rmsnorm_gives_the_composite_bits(shape: tuple[int, ...]) -> None:
    """float32 norms run as one ``torch.rms_norm`` call; the bits must be the composite's
    (``x * rsqrt(mean(x^2) + eps) * w``, transformers' formula), with the norm's own weight and
    with a per-row weight (Qwen3's q/k heads), under no_grad (in place) and with grad."""
    from kvstack.engine.layers import RMSNorm

    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = torch.randn(*shape, generator=g) * 3.0

    def composite(w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    weights = [norm.weight.detach()]
    if len(shape) == 3:
        weights.append(torch.randn(shape[1], shape[2], generator=g))
    for w in weights:
        want = composite(w)
        arg = None if w is weights[0] else w
        with torch.no_grad():
            assert torch.equal(norm(x, arg), want)
        assert torch.equal(norm(x, arg).detach(), want)


def test_linear_never_uses_a_stale_transposed_weight() -> None:
    """``Linear`` keeps ``weight.t()`` between calls; an in-place edit must reach it (a view),
    and a replaced parameter or a swapped ``.data`` must not be served the old view."""
    g = torch.Generator().manual_seed(2)
    lin = Linear(8, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 8, generator=g))
    x = torch.randn(3, 8, generator=g)

    def want() -> torch.Tensor:
        return nn.functional.linear(x, lin.weight)

    assert torch.equal(lin(x), want())
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    assert torch.equal(lin(x), want())
    lin.weight.data = torch.randn(4, 8, generator=g)  # same Parameter, new memory
    assert torch.equal(lin(x), want())
    lin.weight = nn.Parameter(torch.randn(4, 8, generator=g))  # a new Parameter
    assert torch.equal(lin(x), want())
