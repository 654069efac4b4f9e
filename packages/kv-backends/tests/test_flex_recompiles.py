"""No recompiles in steady state: a serving loop whose batch size and mix change every step
compiles a handful of Flex graphs in its first steps and none after.

Dynamo's recompiles are decided by its guards (shapes, strides, captured ints), not by the
backend compiler, so the loop counts graphs through a counting ``backend=`` in place of inductor
(the inductor path itself is covered by test_backends_cpu's compiled tests and
``test_static_shapes_compiled_inductor``): the whole loop runs in seconds on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends.flex import impl as flex_module
from kv_backends.testing import make_paged_batch, oracle_attention

TOL = {"atol": 2e-5, "rtol": 1e-4}

# A serving loop: decode batches of 2-4, prefills and chunks of 3-9 tokens joining and leaving.
STEPS = [
    ([1, 1, 1], [30, 12, 50]),
    ([1, 1, 1, 1], [31, 13, 51, 7]),
    ([5, 1, 1], [20, 14, 52]),
    ([1, 9, 1, 1], [33, 9, 53, 8]),
    ([1, 1], [34, 54]),
    ([3, 1, 1, 1], [3, 15, 55, 9]),
    ([1, 1, 1, 1], [4, 16, 56, 10]),
    ([1, 7, 1], [5, 40, 57]),
]
WARMUP = 3  # steps that may compile: every (call, captured size) pair the loop uses appears


def _counting_flex(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Route the backend's compiled Flex through a Dynamo backend that records each graph."""
    from torch.nn.attention.flex_attention import flex_attention

    graphs: list[Any] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False, backend=counting)
    monkeypatch.setattr(flex_module, "compiled_flex", lambda static=False: fn)
    return graphs


def _serve(static_shapes: bool, graphs: list[Any], prefill: str = "paged", **kw: Any) -> list[int]:
    """Run the loop; return the graph count after each step (checking every output)."""
    backend = get_backend("FLEX_ATTENTION")
    first = make_paged_batch(query_lens=[1], seq_lens=[40], num_blocks=64, **kw)
    builder = backend.make_builder(
        first.config,
        first.layout,
        static_shapes=static_shapes,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        prefill=prefill,
    )
    impl = backend.make_impl(first.config, first.layout, compiled=True)
    counts = []
    for i, (ql, sl) in enumerate(STEPS):
        b = make_paged_batch(query_lens=ql, seq_lens=sl, num_blocks=64, seed=i, **kw)
        out = impl.forward(None, b.q, b.kv_cache, builder.build(b.common))
        t = sum(ql)
        torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)
        counts.append(len(graphs))
    return counts


# Each prefill and each feature set once by default; the other two pairs under ``-m slow``.
@pytest.mark.parametrize(
    ("feature", "prefill"),
    [
        ({}, "paged"),
        ({"sliding_window": 9, "softcap": 4.0}, "gather"),
        pytest.param({}, "gather", marks=pytest.mark.slow),
        pytest.param({"sliding_window": 9, "softcap": 4.0}, "paged", marks=pytest.mark.slow),
    ],
)
def test_serving_loop_does_not_recompile(
    monkeypatch: pytest.MonkeyPatch, feature: dict, prefill: str
) -> None:
    graphs = _counting_flex(monkeypatch)
    counts = _serve(True, graphs, prefill=prefill, **feature)
    # Captured sizes the loop uses: flattened call 128 rows (one query block); decode call 2
    # and 4 rows.
    assert counts[-1] <= 3, f"graphs per step: {counts}"
    assert counts[WARMUP - 1] == counts[-1], f"recompiled in steady state: {counts}"


def test_unpadded_shapes_do_recompile(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same loop without padding: every new batch size is a new graph. This is what the
    # padding buys (and shows the counter sees recompiles).
    graphs = _counting_flex(monkeypatch)
    counts = _serve(False, graphs)
    assert counts[-1] > counts[WARMUP - 1] and counts[-1] >= 6, counts


@pytest.mark.slow
def test_static_shapes_compiled_inductor() -> None:
    """The padded calls through inductor's CPU Flex template (one flattened + one decode graph;
    ~40 s of C++ compilation on two cores)."""
    b = make_paged_batch(query_lens=[1, 5, 1], seq_lens=[30, 20, 9], num_blocks=64)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(
        b.config, b.layout, static_shapes=True, max_num_batched_tokens=64, max_num_seqs=8
    )
    md = builder.build(b.common)
    assert md.padded_tokens == builder.options.q_block_size == 128
    assert md.decode is not None and md.decode.rows == 2
    out = backend.make_impl(b.config, b.layout, compiled=True).forward(None, b.q, b.kv_cache, md)
    torch.testing.assert_close(out[:7].double(), oracle_attention(b)[:7], **TOL)


@pytest.mark.parametrize(
    ("static", "heads", "decoding_kernel"), [(True, 8, True), (False, 8, False), (True, 6, False)]
)
def test_decode_call_asks_for_the_decoding_kernel(
    static: bool, heads: int, decoding_kernel: bool
) -> None:
    """Static shapes and a power-of-2 GQA group: the decode call names Flex's split-KV decoding
    kernel (where torch has the BACKEND option; with KV tiles >= 128 it gets there by shape on
    older torch); otherwise it stays on the main kernel. Options are data: no GPU needed."""
    from kv_backends.backends.flex.options import flex_has_backend_option

    b = make_paged_batch(query_lens=[1, 1], seq_lens=[30, 9], num_q_heads=heads, num_kv_heads=2)
    backend = get_backend("FLEX_ATTENTION")
    md = backend.make_builder(b.config, b.layout, static_shapes=static, kv_block_size=128).build(
        b.common
    )
    opts = backend.make_impl(b.config, b.layout)._kernel_options(
        md, torch.device("cuda"), decode=True
    )
    assert opts is not None
    if decoding_kernel:
        assert "FORCE_USE_FLEX_ATTENTION" not in opts
        assert opts.get("BACKEND") == ("TRITON_DECODE" if flex_has_backend_option() else None)
    else:
        assert opts["FORCE_USE_FLEX_ATTENTION"] is True
