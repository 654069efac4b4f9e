"""TORCH_SDPA's batched path: requests grouped by padded shape, one gather and one attention call
per group. Checked against the per-request loop it replaced (``gather_request_kv`` +
``attend_one_request``, kept as the by-eye reference), against the float64 oracle, for bitwise
batch invariance across padding buckets, and for its step-plan cache and input errors."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_backends import CommonAttentionMetadata, get_backend
from kv_backends.backends import torch_sdpa
from kv_backends.backends._torch_ops import (
    attend_one_request,
    dequant,
    gather_padded_kv,
    gather_request_kv,
    padded_length,
    plan_padded_groups,
)
from kv_backends.testing import PagedBatch, make_paged_batch, oracle_attention, run_backend

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "60"))

# Lengths that straddle the padding buckets (64, 128, 192, ...) and the query-length buckets, with
# an empty request, so one batch makes several groups of different shapes.
QUERY_LENS = [1, 7, 1, 70, 0, 3, 1, 65]
SEQ_LENS = [9, 30, 64, 70, 5, 129, 200, 140]

FEATURES = {
    "plain": {},
    "window": {"sliding_window": 5},
    "non_causal_window": {"causal": False, "sliding_window": 7},
    "sinks": {"has_sinks": True},
    "softcap": {"softcap": 4.0},
    "alibi": {"use_alibi": True},
    "alibi_sinks": {"use_alibi": True, "has_sinks": True},
    "mqa_diffkv": {"num_kv_heads": 1, "head_size": 48, "head_size_v": 32},
    "kernel_blocks": {"block_size": 32, "kernel_block_size": 8},
    "fp8": {"kv_cache_dtype": "fp8_e4m3"},
}

# float32 on both sides; only the summation order differs (SDPA vs explicit softmax, padding).
TOL = {"atol": 2e-5, "rtol": 1e-4}


def _per_request(b: PagedBatch) -> torch.Tensor:
    """The loop TORCH_SDPA ran before batching: one gather and one attention call per request."""
    impl = get_backend("TORCH_SDPA").make_impl(
        b.config, b.layout, sinks=b.sinks, alibi_slopes=b.alibi_slopes,
        k_scale=b.k_scale, v_scale=b.v_scale,
    )  # fmt: skip
    cache, klayout = impl.kernel_cache(b.kv_cache)
    params = impl.device_params(b.q.device)
    qsl = b.common.host_query_start_loc().tolist()
    seq = b.common.host_seq_lens().tolist()
    out = torch.zeros(b.q.shape[0], impl.num_q_heads, impl.head_size_v, dtype=b.q.dtype)
    for r, s in enumerate(seq):
        if qsl[r + 1] == qsl[r]:
            continue
        k, v = gather_request_kv(cache, b.common.block_table[r], s, klayout)
        out[qsl[r] : qsl[r + 1]] = attend_one_request(
            b.q[qsl[r] : qsl[r + 1]], dequant(k, params.k_scale), dequant(v, params.v_scale),
            scale=impl.scale, causal=impl.causal, sliding_window=impl.sliding_window,
            sinks=params.sinks, softcap=impl.softcap, alibi_slopes=params.alibi_slopes,
        ).to(out.dtype)  # fmt: skip
    return out


def _batch(**kw: object) -> PagedBatch:
    kw.setdefault("query_lens", QUERY_LENS)
    kw.setdefault("seq_lens", SEQ_LENS)
    kw.setdefault("pad_tokens", 2)
    return make_paged_batch(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_batched_matches_per_request_loop_and_oracle(feature: str) -> None:
    b = _batch(**FEATURES[feature])
    out = run_backend("TORCH_SDPA", b)
    t = b.common.num_actual_tokens
    torch.testing.assert_close(out[:t], _per_request(b)[:t], **TOL)
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)
    assert torch.all(out[t:] == 0), "padding rows must be zero"


def test_groups_cover_every_query_row_once() -> None:
    qsl = [0]
    for n in QUERY_LENS:
        qsl.append(qsl[-1] + n)
    groups = plan_padded_groups(qsl, SEQ_LENS, 16, torch.device("cpu"))
    rows = torch.cat([g.q_index[g.q_valid] for g in groups]).sort().values
    assert rows.tolist() == list(range(qsl[-1]))
    for g in groups:  # every request in a group pads to the group's shape
        for n, s in zip(g.q_lens.tolist(), g.seq_lens.tolist(), strict=True):
            assert padded_length(n) == g.query_len
            assert g.seq_len == -(-padded_length(s) // 16) * 16
    assert len(groups) > 3, "the fixture should exercise several padded shapes"


def test_one_request_per_group_keeps_the_padded_shapes() -> None:
    qsl = [0]
    for n in QUERY_LENS:
        qsl.append(qsl[-1] + n)
    cpu = torch.device("cpu")
    shared = plan_padded_groups(qsl, SEQ_LENS, 16, cpu)
    alone = plan_padded_groups(qsl, SEQ_LENS, 16, cpu, one_request_per_group=True)
    assert [len(g.reqs) for g in alone] == [1] * sum(n > 0 for n in QUERY_LENS)
    shape = {int(r): (g.query_len, g.seq_len) for g in shared for r in g.reqs}
    assert {int(g.reqs[0]): (g.query_len, g.seq_len) for g in alone} == shape


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 20))
def test_padded_length_bounds(n: int) -> None:
    p = padded_length(n)
    assert p >= n
    assert p == n if n <= 1 else p % 64 == 0
    assert p - n < max(64, n / 4), "padding wastes less than one quantum"
    assert padded_length(n + 1) >= p, "monotone: a longer context never pads shorter"


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Invariance bugs of threaded kernels (SDPA's one-query path splits KV across threads by
    batch size) show only with more than one thread; pin two whatever the machine has."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("feature", ["plain", "sinks", "alibi", "non_causal_window"])
def test_bitwise_invariant_to_neighbours_in_other_buckets(feature: str) -> None:
    """A request alone, next to neighbours in other buckets, or next to same-bucket neighbours
    with longer contexts gets bitwise the same rows (its padded shape is its own), for decodes
    and prefill chunks."""
    _check_invariance(FEATURES[feature], device="cpu", dtype="float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("feature", ["plain", "sinks"])
def test_bitwise_invariant_on_cuda(feature: str) -> None:
    """Off the CPU each request keeps a call of its own; it must stay invariant there too."""
    _check_invariance(FEATURES[feature], device="cuda", dtype="bfloat16")


def _check_invariance(feature: dict[str, object], *, device: str, dtype: str) -> None:
    qlens = [1, 1, 1, 5, 1, 1, 40, 30]
    seqs = [40, 300, 63, 150, 2, 64, 100, 120]
    b = _batch(query_lens=qlens, seq_lens=seqs, pad_tokens=0, device=device, dtype=dtype, **feature)
    full = run_backend("TORCH_SDPA", b)
    cases = [(0, [0]), (0, [2, 0, 5]), (2, [1, 2]), (3, [3]), (3, [4, 3, 1]), (6, [6])]
    cases.append((6, [3, 7, 6]))
    for target, reqs in cases:
        out = run_backend("TORCH_SDPA", _sub_batch(b, reqs, qlens, seqs))
        sq = [0]
        for r in reqs:
            sq.append(sq[-1] + qlens[r])
        j = reqs.index(target)
        q0 = sum(qlens[:target])
        assert torch.equal(out[sq[j] : sq[j + 1]], full[q0 : q0 + qlens[target]]), (target, reqs)


def _sub_batch(b: PagedBatch, reqs: list[int], qlens: list[int], seqs: list[int]) -> PagedBatch:

    starts = [sum(qlens[:r]) for r in reqs]
    rows = [i for r, s in zip(reqs, starts, strict=True) for i in range(s, s + qlens[r])]
    common = CommonAttentionMetadata.from_lists(
        query_lens=[qlens[r] for r in reqs],
        seq_lens=[seqs[r] for r in reqs],
        block_table=b.common.block_table[reqs].cpu(),
        block_size=b.config.kernel_block_size,
        device=b.q.device,
    )
    return dataclasses.replace(b, common=common, q=b.q[rows])


def test_block_table_edited_in_place_is_not_served_from_a_stale_plan() -> None:
    """Layers of one step share a plan keyed on the block table; an in-place edit must rebuild it."""
    b = _batch(query_lens=[1, 1], seq_lens=[20, 33], pad_tokens=0)
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    md = (
        get_backend("TORCH_SDPA")
        .builder_cls(
            b.config,
            b.layout,
            device=torch.device("cpu"),
            max_num_batched_tokens=64,
            max_num_seqs=4,
        )
        .build(b.common)
    )
    first = impl.forward(None, b.q, b.kv_cache, md)
    md.block_table[[0, 1]] = md.block_table[[1, 0]]  # swap the requests' pages, same object
    md.block_table[0, 2:] = md.block_table[1, 2:]  # so request 0 (20 tokens) stays in range
    second = impl.forward(None, b.q, b.kv_cache, md)
    assert not torch.equal(first, second), "the edit changed the pages but not the output"
    fresh = impl.forward(None, b.q, b.kv_cache, md)
    assert torch.equal(second, fresh)
    md.plans.clear()
    assert torch.equal(impl.forward(None, b.q, b.kv_cache, md), second)


def test_plans_live_on_the_step_metadata() -> None:
    # No module state: each step's metadata keeps its own plan (one per cache geometry and table
    # version), so plans die with the step and two steps never share one.
    b = _batch(query_lens=[1, 3], seq_lens=[20, 30], pad_tokens=0)
    md = _metadata(b)
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    impl.forward(None, b.q, b.kv_cache, md)
    impl.forward(None, b.q, b.kv_cache, md)  # a second layer of the same step reuses it
    assert isinstance(md, torch_sdpa.TorchSDPAMetadata) and len(md.plans) == 1
    assert not hasattr(torch_sdpa, "_PLANS")
    assert not _metadata(b).plans


def _metadata(b: PagedBatch):  # type: ignore[no-untyped-def]
    return (
        get_backend("TORCH_SDPA")
        .builder_cls(
            b.config,
            b.layout,
            device=torch.device("cpu"),
            max_num_batched_tokens=256,
            max_num_seqs=8,
        )
        .build(b.common)
    )


def test_block_outside_the_cache_is_named() -> None:
    b = _batch(query_lens=[1, 1], seq_lens=[20, 33], pad_tokens=0)
    md = _metadata(b)
    md.block_table[1, 2] = b.kv_cache.shape[0] + 5
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    with pytest.raises(ValueError, match=rf"block {b.kv_cache.shape[0] + 5} outside"):
        impl.forward(None, b.q, b.kv_cache, md)


def test_block_table_too_narrow_is_named() -> None:
    b = _batch(query_lens=[1, 1], seq_lens=[20, 33], pad_tokens=0)
    md = _metadata(b)
    md = dataclasses.replace(md, block_table=md.block_table[:, :2])  # request 1 needs 3 of 16
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    with pytest.raises(ValueError, match=r"request 1: seq_len=33 needs 3 blocks .* 2 columns"):
        impl.forward(None, b.q, b.kv_cache, md)


def test_query_longer_than_context_is_named() -> None:
    with pytest.raises(ValueError, match=r"request 1: query_len=5 exceeds seq_len=4"):
        plan_padded_groups([0, 1, 6], [3, 4], 16, torch.device("cpu"))


def test_idle_request_pages_are_not_read() -> None:
    """A request with no query rows reads nothing, so a stale row of its block table is fine."""
    b = _batch(query_lens=[1, 0], seq_lens=[20, 33], pad_tokens=0)
    md = _metadata(b)
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    want = impl.forward(None, b.q, b.kv_cache, md)
    md.block_table[1, 0] = b.kv_cache.shape[0] + 5
    assert torch.equal(impl.forward(None, b.q, b.kv_cache, md), want)


# -- the CPU cache write: one index_copy_ where slots are one strided axis ------------------------


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"])
@pytest.mark.parametrize("head_size_v", [32, 24])
def test_cache_write_gives_the_reference_bytes(order: str, head_size_v: int) -> None:
    """Every order (the fast path where slots are one strided axis, the reference elsewhere)
    writes the reference's bytes into the whole storage (so nothing lands in another layer's
    slot), with K/V a few tokens longer than the slots (CUDA-graph padding)."""
    from kv_kernels.reshape_and_cache import reshape_and_cache

    def batch() -> PagedBatch:
        return make_paged_batch(
            query_lens=[1], seq_lens=[70], order=order, num_layers=2, layer=1, fill=False,
            head_size_v=head_size_v, num_blocks=9,
        )  # fmt: skip

    def storage_bytes(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())

    want, got = batch(), batch()
    slots = want.all_slots[torch.randperm(want.all_slots.numel())]
    key = torch.randn(slots.numel() + 3, 2, 32)
    value = torch.randn(slots.numel() + 3, 2, head_size_v)
    reshape_and_cache(key, value, want.kv_cache, slots, want.layout, impl="reference")
    impl = get_backend("TORCH_SDPA").make_impl(got.config, got.layout)
    impl.do_kv_cache_update(None, key, value, got.kv_cache, slots)
    assert torch.equal(storage_bytes(got.kv_cache), storage_bytes(want.kv_cache))
    assert got.kv_cache.abs().sum() > 0


def test_cache_write_fast_path_applies_where_it_should() -> None:
    """``write_kv_slots`` takes unpadded, in-range, unquantized writes to a slot-strided cache
    and declines the rest (which the reference then skips or rejects)."""
    from kv_backends.backends._torch_ops import write_kv_slots

    def batch(order: str = "LBNHC", kv_cache_dtype: str | None = None) -> PagedBatch:
        return make_paged_batch(
            query_lens=[1], seq_lens=[40], fill=False, num_blocks=5, num_layers=2,
            order=order, kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip

    b = batch()
    k, v = torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    assert write_kv_slots(k, v, b.kv_cache, b.all_slots, b.layout)
    padded = b.all_slots.clone()
    padded[3] = -1
    assert not write_kv_slots(k, v, b.kv_cache, padded, b.layout)
    past = b.all_slots.clone()
    past[0] = 5 * 16
    assert not write_kv_slots(k, v, b.kv_cache, past, b.layout)
    with pytest.raises(ValueError, match="slot"):
        get_backend("TORCH_SDPA").make_impl(b.config, b.layout).do_kv_cache_update(
            None, k, v, b.kv_cache, past
        )
    assert not write_kv_slots(k, v, batch(order="BLNHC").kv_cache, b.all_slots, b.layout)
    fp8 = batch(kv_cache_dtype="fp8_e4m3")
    assert not write_kv_slots(k, v, fp8.kv_cache, fp8.all_slots, fp8.layout)


# -- the row gather: K/V rows of D elements in one index_select, where the layout allows -------


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"kv_cache_dtype": "bfloat16"}, {"kv_cache_dtype": "fp8_e4m3"}, {"head_size_v": 24}],
    ids=["float32", "bf16_cache", "fp8", "diffkv"],
)
def test_row_gather_gives_the_page_gather_bytes(order: str, kw: dict[str, object]) -> None:
    """``gather_kv_rows`` (one index_select of D-element rows) then ``split_kv_rows``
    return the page gather's bytes in every layout order, on the second layer of a two-layer
    storage (so the index is relative to the layer view); V narrower than K has no row array
    and falls back (``None``)."""
    from kv_backends.backends._torch_ops import gather_kv_rows, split_kv_rows
    from kv_backends.backends.torch_sdpa import kv_row_array, kv_row_index, kv_row_offsets

    b = make_paged_batch(
        query_lens=[1, 1, 1], seq_lens=[9, 40, 33], order=order, num_layers=2, layer=1, **kw
    )  # type: ignore[arg-type]
    impl = get_backend("TORCH_SDPA").make_impl(
        b.config, b.layout, k_scale=b.k_scale, v_scale=b.v_scale
    )
    k_scale, v_scale = impl.scales(None, b.q.device)
    rows = torch.tensor([[3, 0, 0], [1, 4, 2], [2, 5, 0]])  # [G, nblk], shuffled, 0 = padding
    want = gather_padded_kv(b.kv_cache, rows, b.layout, k_scale, v_scale)
    index = kv_row_index(b.kv_cache, rows, b.layout)
    if b.layout.head_size_v != b.layout.head_size:
        assert index is None
        return
    assert index is not None
    geometry = kv_row_offsets(b.kv_cache, b.layout)
    assert geometry is not None and geometry[1].shape[0] == 2  # K rows, then V rows
    array = kv_row_array(b.kv_cache, b.layout)
    got = split_kv_rows(
        gather_kv_rows(array, index.view(-1)), (3, b.kv_cache.shape[1], 48), 32, k_scale, v_scale
    )
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous() and g.dtype == torch.float32
        assert torch.equal(g, w)


def test_the_engine_layout_takes_the_row_gather() -> None:
    """The default float32 LBNHC cache (kvstack's engine) is a row array: the step plan holds one
    row index per group, shared by the layers of one storage."""
    b = _batch(query_lens=[1, 1, 5], seq_lens=[20, 130, 70], pad_tokens=0)
    md = _metadata(b)
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    impl.forward(None, b.q, b.kv_cache, md)
    (plan,) = md.plans.values()
    assert len(plan.kv_rows) == 1
    assert all(index is not None for index in next(iter(plan.kv_rows.values())))


# -- the batch-wide decode plan: masks and row indices built once per step ----------------------

# Decode lengths across three padding buckets (64, 128, 192) and a prefill chunk, so a step has
# several decode groups next to a prefill group.
DECODE_QLENS = [1, 1, 1, 1, 1, 1, 9, 1, 1]
DECODE_SEQS = [5, 64, 65, 70, 128, 129, 90, 190, 33]


@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1), (6, 3), (2, 2)])
def test_decode_masks_equal_the_per_group_masks(
    window: int | None, heads: int, kv_heads: int
) -> None:
    """``decode_masks`` (one batch-wide tensor per rule) gives every decode group the mask
    ``padded_mask`` gives it alone, causal or not; its ``[G*H, 1, Sb]`` additive term broadcasts
    to the materialized ``[G*H, rep, Sb]`` one, and ``baddbmm`` over it gives the same bits."""
    from kv_backends.backends._torch_ops import decode_masks, padded_mask

    qsl = [0]
    for n in DECODE_QLENS:
        qsl.append(qsl[-1] + n)
    groups = plan_padded_groups(qsl, DECODE_SEQS, 16, torch.device("cpu"))
    decode = [g for g in groups if g.query_len == 1]
    assert len(decode) == 3 and len(groups) == 4
    seq = torch.cat([g.seq_lens for g in decode])
    rep = heads // kv_heads
    masks = decode_masks(seq, [(g.reqs.numel(), g.seq_len) for g in decode], window, kv_heads, rep)
    gen = torch.Generator().manual_seed(0)
    for causal in (True, False):
        for g, got in zip(decode, masks, strict=True):
            want = padded_mask(g, causal, window, kv_heads, rep)
            assert torch.equal(got.allowed, want.allowed)
            assert torch.equal(got.q_pos, want.q_pos) and torch.equal(got.kv_pos, want.kv_pos)
            full = want.additive  # [G*H, rep, Sb], materialized
            assert got.additive.shape == (full.shape[0], 1, full.shape[2])
            assert torch.equal(got.additive.expand_as(full), full)
            q = torch.randn(full.shape[0], rep, 32, generator=gen)
            k = torch.randn(full.shape[0], full.shape[2], 32, generator=gen)
            before = torch.get_num_threads()
            try:
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    a = torch.baddbmm(full, q, k.transpose(1, 2), alpha=0.3)
                    b = torch.baddbmm(got.additive, q, k.transpose(1, 2), alpha=0.3)
                    assert torch.equal(a, b)
            finally:
                torch.set_num_threads(before)


@pytest.mark.parametrize("feature", ["plain", "window", "sinks", "softcap", "alibi", "mqa_diffkv"])
@pytest.mark.parametrize("order", ["LBNHC", "LHBNC", "BHLNC"])
def test_batch_wide_decode_plan_gives_the_per_group_bits(feature: str, order: str) -> None:
    """The step plan's batch-wide pieces (decode masks, one row multiply plus a broadcast add per
    group) against the per-group construction they replaced (``padded_mask`` per group,
    ``kv_row_index`` of each group's block rows): bitwise the same output, and the same row
    index, over several layouts and features."""
    from kv_backends.backends._torch_ops import padded_mask
    from kv_backends.backends.torch_sdpa import kv_row_index

    b = _batch(query_lens=DECODE_QLENS, seq_lens=DECODE_SEQS, order=order, **FEATURES[feature])
    impl = get_backend("TORCH_SDPA").make_impl(
        b.config, b.layout, sinks=b.sinks, alibi_slopes=b.alibi_slopes
    )
    md = _metadata(b)
    got = impl.forward(None, b.q, b.kv_cache, md)
    (plan,) = md.plans.values()
    assert plan.num_decode_groups == 3
    for rule in list(plan.masks):  # the per-group masks, as before
        plan.masks[rule] = [padded_mask(g, *rule) for g in plan.groups]
    for index in plan.kv_rows.values():
        assert (index is None) == (feature == "mqa_diffkv")  # V narrower than K: page gather
        if index is None:
            continue
        old = [kv_row_index(b.kv_cache, rows, b.layout) for rows in plan.rows]
        assert all(
            i is not None and torch.equal(i.view(-1), n) for i, n in zip(old, index, strict=True)
        )
    assert torch.equal(impl.forward(None, b.q, b.kv_cache, md), got)


# -- the decode-only step: DecodeRun's buffers shared by the step's layers ----------------------


def _decode_batch(**kw: object) -> PagedBatch:
    # Decode lengths across three padding buckets and a request with no query rows.
    return _batch(
        query_lens=[1, 1, 1, 0, 1, 1], seq_lens=[5, 64, 70, 9, 129, 190], pad_tokens=0, **kw
    )


@pytest.mark.parametrize("feature", ["plain", "window", "non_causal_window", "mqa_diffkv"])
def test_decode_run_gives_the_general_path_bits(
    feature: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode-only step takes ``DecodeRun`` (where it applies: not for V narrower than K) and
    gives the general path's output bit for bit, two layers sharing the step's plan, with and
    without ``out=``."""
    b = _decode_batch(**FEATURES[feature])  # type: ignore[arg-type]
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    md = _metadata(b)
    got = impl.forward(None, b.q, b.kv_cache, md)
    (plan,) = md.plans.values()
    assert bool(plan.decode_runs) == (feature != "mqa_diffkv")
    out = torch.full_like(got, float("nan"))
    assert impl.forward(None, b.q, b.kv_cache, md, out=out) is out
    assert torch.equal(out, got)
    monkeypatch.setattr(torch_sdpa.TorchSDPAImpl, "_decode_only", lambda self, *a: False)
    want = impl.forward(None, b.q, b.kv_cache, _metadata(b))
    assert torch.equal(got, want)
    assert torch.equal(got, _per_request(b)) or torch.allclose(got, _per_request(b), **TOL)


def test_decode_run_outputs_are_not_overwritten_by_the_next_layer() -> None:
    """The step's layers share one DecodeRun's buffers: each layer's output must be its own
    tensor, so a later layer (other K/V, other queries) leaves an earlier output as it was."""
    b = _decode_batch()
    md = _metadata(b)
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    first = impl.forward(None, b.q, b.kv_cache, md)
    kept = first.clone()
    other = make_paged_batch(
        query_lens=[1, 1, 1, 0, 1, 1], seq_lens=[5, 64, 70, 9, 129, 190], seed=7
    )
    second = impl.forward(None, other.q, other.kv_cache, md)  # same plan, new values
    (plan,) = md.plans.values()
    assert len(plan.decode_runs) == 1
    assert torch.equal(first, kept), "a later layer changed an earlier layer's output"
    assert not torch.equal(second, first)


def test_decode_run_is_not_taken_where_the_general_path_is_needed() -> None:
    """Mixed steps, sinks, softcap, ALiBi, fp8 caches and padded query rows keep the general
    path (no DecodeRun is made)."""
    cases = [
        _batch(query_lens=[1, 3], seq_lens=[20, 30], pad_tokens=0),  # a prefill chunk
        _decode_batch(has_sinks=True),
        _decode_batch(softcap=4.0),
        _decode_batch(use_alibi=True),
        _decode_batch(kv_cache_dtype="fp8_e4m3"),
        _batch(query_lens=[1, 1], seq_lens=[20, 30], pad_tokens=2),  # CUDA-graph padding
    ]
    for b in cases:
        impl = get_backend("TORCH_SDPA").make_impl(
            b.config, b.layout, sinks=b.sinks, alibi_slopes=b.alibi_slopes,
            k_scale=b.k_scale, v_scale=b.v_scale,
        )  # fmt: skip
        md = _metadata(b)
        impl.forward(None, b.q, b.kv_cache, md)
        (plan,) = md.plans.values()
        assert not plan.decode_runs


def test_prefill_float_mask_gives_the_boolean_mask_bits() -> None:
    """Prefill groups hand SDPA the float ``0 / -inf`` mask made once per step instead of the
    boolean one SDPA converts on every call: the same attention bits."""
    import torch.nn.functional as F

    b = _batch(query_lens=[7, 70], seq_lens=[30, 140], pad_tokens=0)
    md = _metadata(b)
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    impl.forward(None, b.q, b.kv_cache, md)
    (plan,) = md.plans.values()
    gen = torch.Generator().manual_seed(0)
    for mask in next(iter(plan.masks.values())):
        g, lb, sb = mask.allowed.shape
        q = torch.randn(g, 4, lb, 32, generator=gen)
        k, v = torch.randn(g, 2, sb, 32, generator=gen), torch.randn(g, 2, sb, 32, generator=gen)
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.allowed[:, None], scale=0.2, enable_gqa=True
        )
        f = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.sdpa_bias, scale=0.2, enable_gqa=True
        )
        assert torch.equal(a, f)


def test_cache_write_checks_many_slots_too() -> None:
    """``write_kv_slots`` checks a few slots on the host and many with one reduction: both
    decline padding and slots past the cache."""
    from kv_backends.backends._torch_ops import write_kv_slots

    b = make_paged_batch(query_lens=[1], seq_lens=[300], fill=False, num_blocks=20)
    k, v = torch.randn(300, 2, 32), torch.randn(300, 2, 32)
    assert b.all_slots.numel() == 300
    assert write_kv_slots(k, v, b.kv_cache, b.all_slots, b.layout)
    for bad in (-1, 20 * 16):
        slots = b.all_slots.clone()
        slots[250] = bad
        assert not write_kv_slots(k, v, b.kv_cache, slots, b.layout)
