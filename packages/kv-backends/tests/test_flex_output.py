"""FLEX_ATTENTION's output without a caller ``out`` (what the engine does): Flex's own output,
no copy, where that keeps the contract of ``AttentionImpl.forward`` (a contiguous ``[T, Hq, Dv]``
in q's dtype, rows past ``num_actual_tokens`` zero); and bitwise the output ``out=`` gets.

Flex lays its output out in the query's stride order, so the flattened call's queries (a
transposed ``[T, Hq, D]``) give a row-major ``[T, Hq, Dv]``. The tests check the result *is*
that tensor (same storage) where no copy is needed: a prefill, a mixed batch (the decode call
writes its rows into it), a decode-only batch, eager and compiled.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends.flex.impl import FlexAttentionImpl
from kv_backends.testing import PagedBatch, make_batch_impl, make_paged_batch, oracle_attention

TOL: dict[str, Any] = {"atol": 2e-5, "rtol": 1e-4}

CASES: dict[str, dict[str, Any]] = {
    "prefill": {"query_lens": [40, 23], "seq_lens": [40, 50]},
    # the decode call writes its rows into the flattened call's output
    "mixed": {"query_lens": [1, 1, 23, 40], "seq_lens": [30, 17, 50, 40]},
    "mixed_gathered_rows": {"query_lens": [23, 1, 40, 1], "seq_lens": [50, 30, 40, 17]},
    # decodes after the prefills (one run of rows): read and written as slices
    "mixed_trailing_decodes": {"query_lens": [23, 40, 1, 1], "seq_lens": [50, 40, 30, 17]},
    "decode": {"query_lens": [1, 1, 1], "seq_lens": [30, 17, 50]},
    "decode_after_empty_request": {"query_lens": [0, 1, 1], "seq_lens": [5, 17, 50]},
}
BUILDERS: dict[str, dict[str, Any]] = {
    "default": {},
    "static": {"static_shapes": True},  # rows padded to a power of 2: the CUDA default
    "gather": {"prefill": "gather", "static_shapes": True},
}


class _Recorder(FlexAttentionImpl):
    """The impl, recording the storage of every Flex call's output."""

    storages: list[int]

    def _flex(self, *args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        res = super()._flex(*args, **kw)
        self.storages.append(res[0].untyped_storage().data_ptr())
        return res


def _impl(b: PagedBatch, **kw: Any) -> _Recorder:
    impl = _Recorder(b.config, b.layout, sinks=b.sinks, **kw)
    impl.storages = []
    return impl


def _md(b: PagedBatch, **opts: Any) -> Any:
    return get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout, **opts).build(b.common)


def _check(b: PagedBatch, out: torch.Tensor) -> None:
    t = b.common.num_actual_tokens
    assert out.shape == (b.q.shape[0], b.config.num_q_heads, b.config.head_size_v)
    assert out.dtype == b.q.dtype and out.is_contiguous()
    assert not out[t:].any(), "padding rows must be zero"
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pad", [0, 5])
def test_result_is_flex_output_and_equals_out(case: str, builder: str, pad: int) -> None:
    b = make_paged_batch(pad_tokens=pad, seed=4, **CASES[case])
    md = _md(b, **BUILDERS[builder])
    impl = _impl(b)
    res = impl.forward(None, b.q, b.kv_cache, md)
    _check(b, res)
    out = torch.full_like(res, float("nan"))
    got = impl.forward(None, b.q, b.kv_cache, md, out=out)
    assert got is out
    t = b.common.num_actual_tokens
    assert torch.equal(out[:t], res[:t])
    # No copy: the result is the flattened call's output (the decode call's on a batch of
    # decodes only, whose rows lead it), unless q has more rows than the call.
    first = impl.storages[0]
    rows = md.padded_tokens if md.windows else (md.decode.rows if md.decode else 0)
    own = b.q.shape[0] <= rows and (md.windows or md.decode.contiguous)
    assert (res.untyped_storage().data_ptr() == first) == bool(own)


def test_compiled_result_is_flex_output() -> None:
    # inductor's Flex lowering lays the output out in the query's stride order too.
    b = make_paged_batch(query_lens=[1, 23, 40], seq_lens=[30, 50, 40], seed=4)
    md = _md(b, static_shapes=True)
    impl = _impl(b, compiled=True)
    res = impl.forward(None, b.q, b.kv_cache, md)
    _check(b, res)
    assert res.untyped_storage().data_ptr() == impl.storages[0]


@pytest.mark.parametrize(
    ("case", "start"), [("mixed", 0), ("mixed_trailing_decodes", 63), ("mixed_gathered_rows", -1)]
)
def test_decode_rows_in_one_run_are_a_slice(case: str, start: int) -> None:
    # The decode call reads its queries as q[start : start + rows] and writes its rows as one
    # slice when the decodes' rows are one run; a shifted start reads the neighbours' rows.
    import dataclasses

    b = make_paged_batch(seed=4, **CASES[case])
    md = _md(b, static_shapes=True)
    assert md.decode is not None and md.decode.start == start
    assert md.decode.contiguous == (start == 0)
    _check(b, _impl(b).forward(None, b.q, b.kv_cache, md))
    if start > 0:
        shifted = dataclasses.replace(md, decode=dataclasses.replace(md.decode, start=start - 1))
        bad = _impl(b).forward(None, b.q, b.kv_cache, shifted)
        with pytest.raises(AssertionError):
            _check(b, bad)


def test_q_longer_than_the_call_copies_into_a_new_output() -> None:
    # Rows past the flattened call's (q padded by its caller beyond the captured size): the
    # result cannot be Flex's output, it is a new tensor with zero padding rows.
    b = make_paged_batch(query_lens=[40, 23], seq_lens=[40, 50], pad_tokens=200, seed=4)
    md = _md(b, static_shapes=True)
    assert b.q.shape[0] > md.padded_tokens
    impl = _impl(b)
    res = impl.forward(None, b.q, b.kv_cache, md)
    _check(b, res)
    assert res.untyped_storage().data_ptr() != impl.storages[0]


@pytest.mark.parametrize("builder", ["default", "static"])
def test_sinks_write_the_result_once(builder: str) -> None:
    # The gated output is computed anew; it goes straight into the result (bf16: the gate in
    # float32, one rounding, as out.float() * gate then .to(bf16)).
    b = make_paged_batch(
        query_lens=[20, 1, 13], seq_lens=[20, 30, 40], has_sinks=True, dtype="bfloat16",
        head_size=16, pad_tokens=3, seed=6,
    )  # fmt: skip
    md = _md(b, **BUILDERS[builder])
    impl = make_batch_impl(get_backend("FLEX_ATTENTION"), b)
    res = impl.forward(None, b.q, b.kv_cache, md)
    assert res.is_contiguous() and not res[b.common.num_actual_tokens :].any()
    out = torch.full_like(res, float("nan"))
    impl.forward(None, b.q, b.kv_cache, md, out=out)
    t = b.common.num_actual_tokens
    assert torch.equal(out[:t], res[:t])


def test_autograd_keeps_the_copy() -> None:
    # Writing padding or decode rows into Flex's output in place would break its backward (Flex
    # has no CPU backward: the rule is checked on its own).
    q = torch.zeros(6, 4, 32)
    o = torch.zeros(8, 4, 32, requires_grad=True) * 1.0
    assert FlexAttentionImpl._own_output(q, o, 4) is None
    assert FlexAttentionImpl._own_output(q, o.detach(), 4) is not None
    # Not row-major (a layout Flex did not make): copied too.
    assert (
        FlexAttentionImpl._own_output(q, o.detach().transpose(0, 1).contiguous().transpose(0, 1), 4)
        is None
    )


@pytest.mark.parametrize("case", ["prefill", "mixed", "decode"])
@pytest.mark.parametrize("prefill", ["paged", "gather"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_result_is_flex_output(case: str, prefill: str) -> None:
    # The backend's CUDA defaults: compiled Flex (inductor's Triton templates), static shapes.
    b = make_paged_batch(
        pad_tokens=3, seed=4, device="cuda", dtype="bfloat16", num_q_heads=8, head_size=64,
        **CASES[case],
    )  # fmt: skip
    md = _md(b, device=b.q.device, prefill=prefill)
    impl = _impl(b)
    res = impl.forward(None, b.q, b.kv_cache, md)
    t = b.common.num_actual_tokens
    assert res.is_contiguous() and not res[t:].any()
    if case != "decode":
        # (a decode-only batch runs Flex's decoding kernel with the GQA group packed into its
        # rows, an output layout that is not [T, Hq, Dv]: forward copies it, as it should)
        assert res.untyped_storage().data_ptr() == impl.storages[0]
    out = torch.full_like(res, float("nan"))
    impl.forward(None, b.q, b.kv_cache, md, out=out)
    assert torch.equal(out[:t], res[:t])
    ref = oracle_attention(b)[:t]
    torch.testing.assert_close(res[:t].double().cpu(), ref.cpu(), atol=2e-2, rtol=2e-2)


def test_compiled_cpu_call_over_a_pool_wider_than_its_tiles() -> None:
    # Inductor's C++ Flex template refuses a block mask narrower than the K/V view ("KV seqlen
    # must be smaller than the block_mask size"): eight decodes of 8 pages each over a 75-page
    # pool listed 64 one-page columns (1,024 tokens < 1,200) and failed to compile before the
    # CPU builder widened its tables to the view.
    b = make_paged_batch(
        query_lens=[64, 64] + [1] * 8, seq_lens=[64, 64] + [128] * 8, num_q_heads=8,
        num_kv_heads=2, head_size=32, seed=4,
    )  # fmt: skip
    md = (
        get_backend("FLEX_ATTENTION")
        .make_builder(
            b.config, b.layout, max_num_batched_tokens=256, max_num_seqs=16, static_shapes=True
        )
        .build(b.common)
    )
    assert md.decode is not None
    cols = md.decode.block_mask.kv_indices.shape[-1] * md.decode.block_mask.BLOCK_SIZE[1]
    assert cols >= md.decode.length
    _check(b, _impl(b, compiled=True).forward(None, b.q, b.kv_cache, md))
