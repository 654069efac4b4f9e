"""FLEX_ATTENTION in bfloat16 with attention sinks (gpt-oss: one logit per query head added to the
softmax denominator), head size 16, on the CPU (eager) and, marked gpu, on CUDA (compiled):
prefill, chunked prefill, decode and mixed batches, through the flattened call, the decode call, static (padded) shapes, the gathered
prefill and a batch split over several cache windows.

Flex cannot take a sink, so the backend folds it in after the call from the log-sum-exp Flex
returns (natural log): ``out * sigmoid(lse - sink)`` in float32, then the input dtype. Two checks:

- against the float64 oracle by kv-kernels' parity rule (``err <= 2 * err_lowprec + atol * row``,
  ``err_lowprec`` a plain bf16 torch run) and against TORCH_SDPA on the same inputs;
- the sink arithmetic alone, sharply: with and without sinks the backend runs the same Flex call,
  so its sink output must equal its own no-sink output times the exact gate
  ``sigmoid(lse64 - sink)`` (``lse64`` the float64 oracle's log-sum-exp) up to the final bf16
  rounding. A log2 LSE, a flipped sign or a path (decode / flattened / merged windows) that
  forgets the sink is off by many bf16 ulps there (an LSE rounded to bf16 by a few), while the
  oracle bound, which must absorb Flex's bf16 ``P`` and output roundings, can let small ones
  through. (Rounding the gate or the rescale to bf16 stays within 2u: not distinguishable from
  the backend's own two roundings, and not caught.)

Sinks are drawn around the rows' log-sum-exps (not N(0, 1), which leaves every gate near 1 and
hides the sink arithmetic): gates then span roughly (0.1, 0.95).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.testing import (
    PagedBatch,
    lowprec_reference,
    make_paged_batch,
    oracle_attention,
    run_backend,
)
from kv_kernels.testing import assert_close_to_oracle, attention_oracle

BF16_U = 2.0**-8  # bf16's unit roundoff (half an ulp at 1): one rounding moves x by <= u * |x|

CASES: dict[str, dict[str, Any]] = {
    "prefill": {"query_lens": [20, 13], "seq_lens": [20, 13]},
    "chunked": {"query_lens": [7, 5, 16], "seq_lens": [30, 17, 40]},
    "decode": {"query_lens": [1, 1, 1, 1], "seq_lens": [9, 30, 17, 1]},
    # decodes not leading the batch (the decode call gathers its rows), an empty request
    "mixed": {"query_lens": [7, 1, 1, 20, 0, 3], "seq_lens": [9, 30, 17, 20, 5, 41]},
}
BUILDERS: dict[str, dict[str, Any]] = {
    "default": {},
    "static": {"static_shapes": True},  # the CUDA default: padded rows and decode batch
    "gather": {"prefill": "gather"},
    # Windows of 2 blocks (max_view_elements stands in for 2^31: 32 tokens x 64 elements): the
    # batch spans several, merged through their log-sum-exps before the sink is applied.
    "windows": {"kv_block_size": 16, "max_view_elements": 2100},
}
# The CPU runs eager Flex; on CUDA (marked gpu) the backend's defaults: compiled Flex, static
# shapes, the split-KV decoding kernel for decodes, the log2 LSE torch converts to natural log.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


#: (case, window, builder): every case with every builder; the window alternates so each case
#: and each builder also runs with and without one. That half (16 of 32) runs by default; the
#: other half is marked slow (``-m slow`` runs it): the same paths, the other window.
MATRIX = [
    pytest.param(
        case,
        window,
        builder,
        marks=[pytest.mark.slow] if (window is None) == bool((i + j) % 2) else [],
    )
    for i, case in enumerate(CASES)
    for j, builder in enumerate(BUILDERS)
    for window in (None, 6)
]


def _batch(
    case: str, *, has_sinks: bool = True, seed: int = 1, device: str = "cpu", **kw: Any
) -> PagedBatch:
    b = make_paged_batch(
        **CASES[case],
        num_q_heads=4,
        num_kv_heads=2,
        head_size=16,
        block_size=16,
        dtype="bfloat16",
        has_sinks=has_sinks,
        pad_tokens=2,
        seed=seed,
        device=device,
        **kw,
    )
    if b.sinks is not None:
        # Around the rows' log-sum-exps (~1-3 here), so gates are far from 1.
        b.sinks = b.sinks + 2.0
    return b


def _num(b: PagedBatch) -> int:
    return b.common.num_actual_tokens


def _run_flex(b: PagedBatch, builder: str) -> torch.Tensor:
    backend = get_backend("FLEX_ATTENTION")
    md = backend.make_builder(b.config, b.layout, device=b.q.device, **BUILDERS[builder]).build(
        b.common
    )
    if builder == "windows":
        assert len(md.windows) > 1 or md.decode is not None
    impl = backend.make_impl(b.config, b.layout, sinks=b.sinks)
    return impl.forward(None, b.q, b.kv_cache, md)


def _row_max(x: torch.Tensor) -> torch.Tensor:  # [T, Hq, D] -> [T, Hq]
    return x.double().abs().amax(-1)


@pytest.mark.parametrize(("case", "window", "builder"), MATRIX)
@pytest.mark.parametrize("device", DEVICES)
def test_flex_bf16_sinks_match_float64_oracle_and_sdpa(
    device: str, case: str, window: int | None, builder: str
) -> None:
    b = _batch(case, sliding_window=window, device=device)
    t = _num(b)
    out = _run_flex(b, builder)
    assert out.dtype == torch.bfloat16
    ref = oracle_attention(b)[:t]
    assert_close_to_oracle(out[:t], ref, lowprec_reference=lowprec_reference(b)[:t])
    assert torch.all(out[t:] == 0), "padding rows must be zero"
    # TORCH_SDPA (float32 math, one rounding) on the same inputs: the two differ by Flex's bf16
    # P and its rounding before the sink gate, a few units of bf16 roundoff of the row at most.
    sdpa = run_backend("TORCH_SDPA", b)[:t].double().cpu()
    diff = (out[:t].double().cpu() - sdpa).abs().amax(-1)
    bound = 4 * BF16_U * _row_max(ref) + 1e-4
    assert bool((diff <= bound).all()), (
        f"FLEX vs TORCH_SDPA: worst {float((diff / bound).max()):.2f}x the bound"
    )


@pytest.mark.parametrize(("case", "window", "builder"), MATRIX)
@pytest.mark.parametrize("device", DEVICES)
def test_flex_bf16_sink_gate_is_exact(
    device: str, case: str, window: int | None, builder: str
) -> None:
    # Same K/V/q with and without sinks: the sink output is the no-sink output times
    # sigmoid(lse - sink), the lse being the no-sink rows' (float64 oracle), up to one rounding.
    with_sinks = _batch(case, sliding_window=window, device=device)
    no_sinks = _batch(case, sliding_window=window, has_sinks=False, device=device)
    assert torch.equal(with_sinks.q, no_sinks.q) and torch.equal(with_sinks.key, no_sinks.key)
    t = _num(with_sinks)
    got = _run_flex(with_sinks, builder)[:t].double().cpu()
    base = _run_flex(no_sinks, builder)[:t].double().cpu()
    ks, vs = no_sinks.request_kv()
    qsl = no_sinks.common.host_query_start_loc().tolist()
    _, lse = attention_oracle(
        no_sinks.q,
        ks,
        vs,
        [qsl[r + 1] - qsl[r] for r in range(len(ks))],
        scale=16**-0.5,
        sliding_window=window,
    )
    assert with_sinks.sinks is not None
    gate = torch.sigmoid(lse[:t] - with_sinks.sinks.double().cpu()[None])  # [T, Hq]
    assert float(gate.min()) < 0.5 and float(gate.max()) > 0.7, "sinks must move the gates"
    want = base * gate[..., None]
    # ``got`` is bf16(gate * o) and ``want`` gate * bf16(o) (o: the no-sink output in float32,
    # merged over windows or straight from Flex): two roundings apart, <= 2u of the row. A gate
    # off by a few percent (a log2 LSE, a dropped sink) is several times that.
    err = (got - want).abs().amax(-1)
    bound = 2 * BF16_U * _row_max(want) + 1e-6
    worst = torch.unravel_index((err / bound).argmax(), err.shape)
    assert bool((err <= bound).all()), (
        f"{int((err > bound).sum())} rows off; worst (token, head) {tuple(int(i) for i in worst)}: "
        f"err {float(err[worst]):.3g} vs bound {float(bound[worst]):.3g}, gate {float(gate[worst]):.3f}"
    )


@pytest.mark.slow
def test_flex_bf16_compiled_cpu_matches_oracle_without_sinks() -> None:
    # Compiled Flex on the CPU cannot return the log-sum-exp (torch 2.15), so sinks are refused
    # there (test_backends_cpu); the compiled bf16 path itself is held to the same rule. One case
    # (inductor's CPU template compiles in ~45 s): decodes, a chunked prefill, window, padding.
    # Slow: the default run compiles the same calls in float32 (test_backends_cpu's
    # test_flex_compiled_matches, test_flex_output's test_compiled_result_is_flex_output).
    b = _batch("mixed", has_sinks=False, sliding_window=6)
    t = _num(b)
    out = run_backend("FLEX_ATTENTION", b, impl_options={"compiled": True})
    ref = oracle_attention(b)[:t]
    assert_close_to_oracle(out[:t], ref, lowprec_reference=lowprec_reference(b)[:t])
