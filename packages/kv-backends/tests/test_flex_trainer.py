"""Rollout equals trainer: in batch-invariant mode every request's rows from the paged backend
equal a dense call over that request alone — the call an RL trainer makes
(:mod:`kv_backends.backends.flex.trainer`).

What the CPU can and cannot check:
- The trainer's block mask (tiles listed, logical order) and its semantics against the float64
  oracle: yes.
- FLEX_ATTENTION paged rows against the trainer on the CPU: close (float32 summation order),
  not bitwise — eager Flex is dense masked math over the whole cache view, and inductor's CPU
  Flex template ignores BLOCK_M / BLOCK_N and picks its own KV split (measured: 1 ulp apart).
- TRITON paged rows against its trainer under the Triton interpreter: bitwise (the interpreter
  runs the same tiles in the same order).
- FLEX_ATTENTION and TRITON bitwise in bf16 on CUDA: the ``gpu``-marked tests below.
"""

from __future__ import annotations

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends.flex.options import FlexOptions
from kv_backends.backends.flex.trainer import (
    flex_trainer_attention,
    flex_trainer_block_mask,
    triton_trainer_attention,
)
from kv_backends.testing import make_paged_batch, oracle_attention

# float32 on the CPU; differences are summation order only.
TOL = {"atol": 2e-5, "rtol": 1e-4}

# Batch compositions: prefills, chunked prefills and decodes in different mixes and orders, an
# empty request among them.
COMPOSITIONS = [
    ([1, 20, 7, 1], [33, 20, 40, 17]),
    ([7, 1, 0, 1, 20], [40, 18, 5, 34, 20]),
    ([33], [33]),
    ([1, 1, 1], [64, 2, 19]),
]


def _requests(b):
    """Per request with queries: (query rows slice, q, K, V)."""
    ks, vs = b.request_kv()
    qsl = b.common.host_query_start_loc().tolist()
    for r in range(len(ks)):
        if qsl[r + 1] > qsl[r]:
            yield slice(qsl[r], qsl[r + 1]), b.q[qsl[r] : qsl[r + 1]], ks[r], vs[r]


@pytest.mark.parametrize(
    ("length", "seq_len", "causal", "window"),
    [(40, 40, True, None), (3, 70, True, 20), (17, 50, False, None), (16, 33, False, 9)],
)
def test_trainer_block_mask_lists_every_visible_tile_in_order(
    length: int, seq_len: int, causal: bool, window: int | None
) -> None:
    opts = FlexOptions.resolve(16, batch_invariant=True)
    bm = flex_trainer_block_mask(length, seq_len, opts, causal=causal, sliding_window=window)
    num, idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    assert bm.full_kv_num_blocks is None, "no full-block fast path: the paged call has none"
    for qb in range(num.numel()):
        row = idx[qb, : int(num[qb])].tolist()
        assert row == sorted(set(row)), "tiles must be visited once each, in logical order"
        want = set()
        for i in range(qb * 16, min((qb + 1) * 16, length)):
            p = seq_len - length + i
            for k in range(seq_len):
                ok = (not causal or k <= p) and (window is None or abs(p - k) < window)
                if ok:
                    want.add(k // opts.kv_block_size)
        assert want <= set(row)


@pytest.mark.parametrize(
    "feature",
    [
        {},
        {"sliding_window": 9},
        {"softcap": 4.0},
        {"has_sinks": True},
        {"use_alibi": True},
        {"causal": False, "sliding_window": 7},
    ],
    ids=["causal", "window", "softcap", "sinks", "alibi", "noncausal_window"],
)
def test_flex_trainer_matches_the_oracle_and_the_paged_rows(feature: dict) -> None:
    ql, sl = COMPOSITIONS[0]
    b = make_paged_batch(query_lens=ql, seq_lens=sl, batch_invariant=True, seed=3, **feature)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(b.config, b.layout)
    impl = backend.make_impl(
        b.config, b.layout, sinks=b.sinks, alibi_slopes=b.alibi_slopes, options=builder.options
    )
    paged = impl.forward(None, b.q, b.kv_cache, builder.build(b.common))
    ref = oracle_attention(b)
    for rows, q, k, v in _requests(b):
        got = flex_trainer_attention(
            q,
            k,
            v,
            options=builder.options,
            causal=b.config.causal,
            sliding_window=b.config.sliding_window,
            softcap=b.config.softcap,
            sinks=b.sinks,
            alibi_slopes=b.alibi_slopes,
        )
        torch.testing.assert_close(got.double(), ref[rows], **TOL)
        torch.testing.assert_close(got, paged[rows], **TOL)


def test_flex_trainer_full_forward_covers_the_rollout_rows() -> None:
    # The trainer's one L = S call: its last q_len rows are the rollout's rows of that step.
    ql, sl = COMPOSITIONS[1]
    b = make_paged_batch(query_lens=ql, seq_lens=sl, batch_invariant=True, sliding_window=11)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(b.config, b.layout)
    paged = backend.make_impl(b.config, b.layout).forward(
        None, b.q, b.kv_cache, builder.build(b.common)
    )
    for rows, q, k, v in _requests(b):
        # Queries of earlier positions are not in the batch: make them up, only the last rows count.
        q_full = torch.cat([torch.randn(k.shape[0] - q.shape[0], *q.shape[1:]), q])
        full = flex_trainer_attention(
            q_full, k, v, options=builder.options, sliding_window=b.config.sliding_window
        )
        torch.testing.assert_close(full[-q.shape[0] :], paged[rows], **TOL)


def test_batch_invariant_rows_are_in_logical_order() -> None:
    # Shuffled blocks: physical order differs from logical; each request's tiles must still be
    # listed in logical order (what the dense call visits).
    ql, sl = [20, 7], [20, 70]
    b = make_paged_batch(query_lens=ql, seq_lens=sl, batch_invariant=True, seed=11)
    md = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout).build(b.common)
    bm = md.windows[0].block_mask
    bt = b.common.block_table
    n = b.config.kernel_block_size
    num, idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    logical = {int(bt[r, c]): c for r in range(2) for c in range(-(-sl[r] // n))}
    saw_shuffle = False
    for qb in range(num.numel()):
        cols = [logical[int(f)] for f in idx[qb, : int(num[qb])].tolist()]
        assert cols == sorted(cols)
        phys = idx[qb, : int(num[qb])].tolist()
        saw_shuffle |= phys != sorted(phys)
    assert saw_shuffle, "the fixture should shuffle blocks so physical and logical orders differ"


def test_tile_options_flow_from_the_layer_config() -> None:
    b = make_paged_batch(query_lens=[5], seq_lens=[40], block_size=64, batch_invariant=True)
    opts = FlexOptions.resolve(64, batch_invariant=True, q_block_size=32, kv_block_size=32)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(b.config, b.layout, options=opts)
    assert builder.options == opts
    assert opts.kernel_options(main_template=True) == {
        "BLOCK_M": 32,
        "BLOCK_N": 32,
        "FORCE_USE_FLEX_ATTENTION": True,
    }
    md = builder.build(b.common)
    # What the paged calls pass on CUDA is exactly what the trainer passes (checked without a
    # GPU: the options are plain data), IS_DIVISIBLE pinned so both run one kernel variant.
    trainer_opts = opts.kernel_options(main_template=True, batch_invariant=True)
    assert trainer_opts["IS_DIVISIBLE"] is False
    impl_bi = backend.make_impl(b.config, b.layout, options=opts)
    cuda = torch.device("cuda")
    assert impl_bi._kernel_options(md, cuda) == trainer_opts
    assert impl_bi._kernel_options(md, cuda, decode=True) == trainer_opts
    # A layer pinned to other tiles refuses metadata built with these.
    other = FlexOptions.resolve(64, batch_invariant=True, q_block_size=16)
    impl = backend.make_impl(b.config, b.layout, options=other)
    with pytest.raises(ValueError, match="differ from the metadata's"):
        impl.forward(None, b.q, b.kv_cache, md)
    with pytest.raises(ValueError, match="not both"):
        backend.make_builder(b.config, b.layout, options=opts, q_block_size=16)
    # A value resolved for a bigger block is checked against this layer's block size.
    b16 = make_paged_batch(query_lens=[5], seq_lens=[40], batch_invariant=True)
    with pytest.raises(ValueError, match="kv_block_size=32 must be <= the kernel block size 16"):
        backend.make_impl(b16.config, b16.layout, options=opts)


@pytest.mark.parametrize(
    ("n", "kwargs", "message"),
    [
        (16, {"kv_block_size": 48}, r"power of 2 >= 16; nearest valid: \[32, 64\]"),
        (64, {"kv_block_size": 128, "batch_invariant": True}, r"valid: \[16, 32, 64\]"),
        (48, {"kv_block_size": 32}, r"valid: \[16\]"),
        (64, {"kv_block_size": 32, "block_n": 64}, r"valid: \[16, 32\]"),
        (16, {"block_m": True}, "must be an int"),
    ],
)
def test_tile_errors_say_what_would_be_valid(n: int, kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        FlexOptions.resolve(n, **kwargs)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("window", [None, 13])
def test_triton_rollout_equals_trainer_bitwise_interpreted(window: int | None) -> None:
    # fp32 under the interpreter (it computes bf16 wrongly, see DESIGN.md); small shapes.
    if torch.cuda.is_available():  # CPU tensors need the interpreter, which a GPU machine lacks
        pytest.skip("on a GPU, test_triton_rollout_equals_trainer_bitwise_gpu covers this")
    ql, sl = [1, 9, 1], [21, 9, 35]
    b = make_paged_batch(
        query_lens=ql, seq_lens=sl, batch_invariant=True, sliding_window=window, seed=4
    )
    out = (
        get_backend("TRITON")
        .make_impl(b.config, b.layout)
        .forward(
            None,
            b.q,
            b.kv_cache,
            get_backend("TRITON").make_builder(b.config, b.layout).build(b.common),
        )
    )
    for rows, q, k, v in _requests(b):
        ref = triton_trainer_attention(
            q, k, v, kernel_block_size=b.config.kernel_block_size, sliding_window=window
        )
        assert torch.equal(ref, out[rows])


# -- GPU: bitwise, bf16 -----------------------------------------------------------------------

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# Prefill, chunked prefill and decode rows, in several batch compositions (the same shapes in
# other mixes and orders, and alone).
GPU_COMPOSITIONS = [
    ([300], [300]),
    ([1, 1, 1, 1], [513, 1000, 77, 200]),
    ([37, 1, 130, 1], [37, 513, 300, 1000]),
    ([1, 64, 1, 0, 5], [200, 700, 513, 17, 77]),
]


def _gpu_batch(ql, sl, *, window, block_size, seed):
    return make_paged_batch(
        query_lens=ql,
        seq_lens=sl,
        num_q_heads=16,
        num_kv_heads=4,
        head_size=128,
        block_size=block_size,
        dtype="bfloat16",
        sliding_window=window,
        batch_invariant=True,
        device="cuda",
        seed=seed,
    )


@pytest.mark.parametrize("trainer_len", ["step", "full"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("comp", range(len(GPU_COMPOSITIONS)))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_rollout_equals_trainer_bitwise_gpu(
    comp: int, window: int | None, block_size: int, trainer_len: str
) -> None:
    """``step``: the trainer called with the step's queries (L = q_len); ``full``: one training
    forward over the whole request (L = S), last q_len rows compared."""
    ql, sl = GPU_COMPOSITIONS[comp]
    b = _gpu_batch(ql, sl, window=window, block_size=block_size, seed=comp)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(b.config, b.layout, device="cuda")
    impl = backend.make_impl(b.config, b.layout, options=builder.options)
    paged = impl.forward(None, b.q, b.kv_cache, builder.build(b.common))
    gen = torch.Generator(device="cuda").manual_seed(7)
    for rows, q, k, v in _requests(b):
        if trainer_len == "full":
            extra = torch.randn(
                k.shape[0] - q.shape[0], *q.shape[1:], generator=gen, device="cuda"
            ).to(q.dtype)
            q_in = torch.cat([extra, q])
        else:
            q_in = q
        ref = flex_trainer_attention(q_in, k, v, options=builder.options, sliding_window=window)[
            -q.shape[0] :
        ]
        diff = (ref.float() - paged[rows].float()).abs().max().item()
        assert torch.equal(ref, paged[rows]), f"rows {rows}: max |diff| {diff}"


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("comp", range(len(GPU_COMPOSITIONS)))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_rollout_equals_trainer_bitwise_gpu(
    comp: int, window: int | None, block_size: int
) -> None:
    ql, sl = GPU_COMPOSITIONS[comp]
    b = _gpu_batch(ql, sl, window=window, block_size=block_size, seed=comp)
    backend = get_backend("TRITON")
    md = backend.make_builder(b.config, b.layout, device="cuda").build(b.common)
    out = backend.make_impl(b.config, b.layout).forward(None, b.q, b.kv_cache, md)
    for rows, q, k, v in _requests(b):
        ref = triton_trainer_attention(q, k, v, kernel_block_size=block_size, sliding_window=window)
        diff = (ref.float() - out[rows].float()).abs().max().item()
        assert torch.equal(ref, out[rows]), f"rows {rows}: max |diff| {diff}"
