"""Every backend that runs on the CPU against the float64 oracle and TORCH_SDPA, on mixed
prefill/decode batches with padding, empty requests and shuffled block tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_backends import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    MetadataBuilder,
    get_backend,
)
from kv_backends.backends.flex.entries import build_flex_block_indices
from kv_backends.backends.flex.options import FlexOptions
from kv_backends.registry import BACKEND_CLASSES
from kv_backends.testing import make_paged_batch, oracle_attention, run_backend

# Mixed batch: decodes, a chunked prefill, a full prefill, an empty request, odd lengths.
QUERY_LENS = [1, 7, 1, 20, 0, 3]
SEQ_LENS = [9, 30, 17, 20, 5, 41]

FEATURES = {
    "gqa": {},
    "window": {"sliding_window": 5},
    "sinks": {"has_sinks": True},
    "softcap": {"softcap": 4.0},
    "alibi": {"use_alibi": True},
    "diffkv": {"head_size": 48, "head_size_v": 32},  # 192/128 scaled down
    "window_sinks_diffkv": {
        "sliding_window": 9,
        "has_sinks": True,
        "head_size": 48,
        "head_size_v": 32,
    },
}
ALL_ORDERS = ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"]

# float32 everywhere on the CPU; differences are summation order only.
TOL = {"atol": 2e-5, "rtol": 1e-4}


def _batch(**kw):
    kw.setdefault("query_lens", QUERY_LENS)
    kw.setdefault("seq_lens", SEQ_LENS)
    kw.setdefault("pad_tokens", 3)
    if kw.get("order", "LBNHC")[0] == "B":
        kw.setdefault("num_layers", 3)
        kw.setdefault("layer", 1)
    return make_paged_batch(**kw)


def _check(out: torch.Tensor, b) -> None:
    ref = oracle_attention(b)
    t = b.common.num_actual_tokens
    torch.testing.assert_close(out[:t].double(), ref[:t], **TOL)
    assert torch.all(out[t:] == 0), "padding rows must be zero"


# -- TORCH_SDPA: the oracle backend itself against float64 ------------------------------------


@pytest.mark.parametrize("feature", list(FEATURES))
def test_sdpa_matches_float64(feature: str) -> None:
    b = _batch(**FEATURES[feature])
    _check(run_backend("TORCH_SDPA", b), b)


@pytest.mark.parametrize("order", ALL_ORDERS)
def test_sdpa_every_layout_order(order: str) -> None:
    b = _batch(order=order, sliding_window=11)
    _check(run_backend("TORCH_SDPA", b), b)


@pytest.mark.parametrize(("block_size", "kernel_block_size"), [(64, 16), (64, 64), (16, 16)])
def test_sdpa_kernel_blocks(block_size: int, kernel_block_size: int) -> None:
    b = _batch(block_size=block_size, kernel_block_size=kernel_block_size)
    _check(run_backend("TORCH_SDPA", b), b)


def test_sdpa_non_causal() -> None:
    b = _batch()
    b.config = dataclasses.replace(b.config, causal=False)
    out = run_backend("TORCH_SDPA", b)
    _check(out, b)


def test_sdpa_whole_prompt_groups_use_sdpas_own_causal_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill group of whole prompts (q_len == seq_len, causal, no window) calls SDPA with
    is_causal and no mask tensor; a group with cached context keeps the explicit mask. Planted
    bug: the flag forced on for every prefill group misplaces the chunked requests' causal
    diagonal (SDPA's is top-left), which the float64 oracle check catches."""
    import torch.nn.functional as F
    from kv_backends.backends import _torch_masks

    calls: list[bool] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        calls.append(bool(kw.get("is_causal")))
        return real(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    # a decode, a whole 20-token prompt (padded shape 64 x 64) and a 7-token chunk over a
    # 100-token context (64 x 128): two prefill groups, one of each kind
    b = _batch(query_lens=[1, 20, 7], seq_lens=[9, 20, 100])
    _check(run_backend("TORCH_SDPA", b), b)
    assert sorted(calls) == [False, True]
    b = _batch()  # whole prompts and chunks sharing one padded shape: the explicit mask
    calls.clear()
    _check(run_backend("TORCH_SDPA", b), b)
    assert calls == [False]
    b = _batch(query_lens=[20, 33], seq_lens=[20, 33])  # whole prompts only
    calls.clear()
    _check(run_backend("TORCH_SDPA", b), b)
    assert calls and all(calls)
    b = _batch(sliding_window=5)  # a window: never SDPA's causal mask
    calls.clear()
    _check(run_backend("TORCH_SDPA", b), b)
    assert not any(calls)

    real_mask = _torch_masks.padded_mask

    def forced(*args, **kw):  # type: ignore[no-untyped-def]
        return real_mask(*args, **{**kw, "whole_prompts": True})

    monkeypatch.setattr("kv_backends.backends.torch_sdpa_plan.padded_mask", forced)
    b = _batch()
    with pytest.raises(AssertionError):
        _check(run_backend("TORCH_SDPA", b), b)


@pytest.mark.parametrize("name", ["TORCH_SDPA", "FLEX_ATTENTION"])
def test_runs_under_inference_mode(name: str) -> None:
    """Engines often run under torch.inference_mode, where the metadata (and the cache) are
    inference tensors with no version counter; TORCH_SDPA once keyed its step plan on the
    block table's, and raised. The same batch must give the same output, and a block table
    edited in place between two layers' calls must not reuse the first call's plan."""
    b = _batch(sliding_window=11)
    want = run_backend(name, b)
    backend = get_backend(name)
    with torch.inference_mode():
        q, cache = b.q.clone(), b.kv_cache.clone()
        md = backend.make_builder(b.config, b.layout).build(b.common)
        impl = backend.make_impl(b.config, b.layout)
        torch.testing.assert_close(impl.forward(None, q, cache, md), want, rtol=0, atol=0)
        if name == "TORCH_SDPA":  # (FLEX's metadata holds its own block indices)
            rows = md.block_table[1].clone()
            md.block_table[1] = md.block_table[3]  # request 1 now reads request 3's blocks
            edited = impl.forward(None, q, cache, md)
            assert not torch.equal(edited[1:8], want[1:8])
            md.block_table[1] = rows
            torch.testing.assert_close(impl.forward(None, q, cache, md), want, rtol=0, atol=0)


# -- FLEX_ATTENTION -----------------------------------------------------------------------------


@pytest.mark.parametrize("feature", list(FEATURES))
def test_flex_eager_matches(feature: str) -> None:
    b = _batch(**FEATURES[feature])
    _check(run_backend("FLEX_ATTENTION", b), b)


@pytest.mark.parametrize(
    ("order", "block_size", "kernel_block_size", "kv_block_size"),
    [
        ("LBNHC", 16, 16, 16),  # kernel block 16: one cache block per KV tile
        ("LBNHC", 16, 16, 64),  # a KV tile spans 4 blocks of (possibly) different requests
        ("LBNHC", 64, 16, 32),  # manager 64 split into kernel blocks of 16
        ("LBNHC", 64, 64, 64),
        ("BLNHC", 16, 16, 16),  # cross-layer: block stride = layers x block tokens
    ],
)
def test_flex_geometries(
    order: str, block_size: int, kernel_block_size: int, kv_block_size: int
) -> None:
    b = _batch(
        order=order, block_size=block_size, kernel_block_size=kernel_block_size, sliding_window=13
    )
    _check(run_backend("FLEX_ATTENTION", b, builder_options={"kv_block_size": kv_block_size}), b)


def test_flex_splits_large_caches_into_windows() -> None:
    # max_view_elements stands in for 2^31: each window holds 2 blocks, so the batch spans
    # several windows whose results are merged by log-sum-exp (sinks applied after the merge).
    b = _batch(has_sinks=True, num_blocks=40)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(b.config, b.layout, kv_block_size=16, max_view_elements=5000)
    md = builder.build(b.common)
    assert len(md.windows) > 1
    assert all(w.length * b.kv_cache.stride(2) <= 5000 for w in md.windows)
    impl = backend.make_impl(b.config, b.layout, sinks=b.sinks)
    _check(impl.forward(None, b.q, b.kv_cache, md), b)


def test_flex_compiled_matches() -> None:
    # One compiled case (inductor's CPU template compiles in ~30 s): GQA, window, prefill + decode.
    b = _batch(sliding_window=7, num_q_heads=8)
    _check(run_backend("FLEX_ATTENTION", b, impl_options={"compiled": True}), b)


def test_flex_compiled_cpu_refuses_lse_needs() -> None:
    b = _batch(has_sinks=True)
    with pytest.raises(
        ValueError, match="compiled FlexAttention on the CPU cannot return the log-sum-exp"
    ):
        run_backend("FLEX_ATTENTION", b, impl_options={"compiled": True})


def test_flex_rejects_head_major_layouts() -> None:
    b = _batch(order="LBHNC")
    reasons = get_backend("FLEX_ATTENTION").validate(b.config)
    assert any("layout LBHNC not supported" in r for r in reasons)
    with pytest.raises(ValueError, match="FLEX_ATTENTION cannot serve this layer: .*LBHNC"):
        get_backend("FLEX_ATTENTION").make_impl(b.config, b.layout)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_block_size": 24}, "flex kv_block_size=24 must be a power of 2"),
        ({"q_block_size": 8}, "flex q_block_size=8 must be a power of 2 >= 16"),
        (
            {"kv_block_size": 128, "batch_invariant": True},
            "kv_block_size=128 must be <= the kernel block size 16",
        ),
        ({"kv_block_size": 16, "block_n": 32}, "flex block_n=32 must divide kv_block_size=16"),
        ({"q_block_size": 16, "block_m": 64}, "flex block_m=64 must divide q_block_size=16"),
    ],
)
def test_flex_options_are_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FlexOptions.resolve(16, **kwargs)


def test_flex_kv_block_must_nest_with_the_kernel_block() -> None:
    with pytest.raises(ValueError, match="kv_block_size=32 must divide the kernel block size 48"):
        FlexOptions.resolve(48, kv_block_size=32)


def test_flex_buffers_are_sized_by_batched_tokens() -> None:
    b = _batch()
    builder = get_backend("FLEX_ATTENTION").make_builder(
        b.config, b.layout, max_num_batched_tokens=64, q_block_size=16
    )
    # Rows of the persistent index buffers: query blocks of the largest batch, nothing else.
    assert builder.kv_num_blocks.shape == (4,)
    assert builder.kv_indices.shape[0] == 4
    assert builder.q_req.shape == (64,) and builder.q_pos.shape == (64,)
    # physical->logical is one entry per cache block, never batch x blocks.
    assert builder.phys_to_logical.shape == (b.layout.num_blocks,)
    big = make_paged_batch(query_lens=[70], seq_lens=[70])
    small_builder = get_backend("FLEX_ATTENTION").make_builder(
        big.config, big.layout, max_num_batched_tokens=64
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens=64"):
        small_builder.build(big.common)


@pytest.mark.parametrize(
    ("n", "kv_block", "window"), [(16, 16, None), (16, 64, 5), (32, 16, 40), (16, 32, 1)]
)
def test_flex_block_indices_match_brute_force(n: int, kv_block: int, window: int | None) -> None:
    gen = torch.Generator().manual_seed(n + kv_block)
    seq_lens = [13, 1, 40, 33, 7]
    query_lens = [13, 1, 2, 33, 0]
    nblocks = sum(-(-s // n) for s in seq_lens) + 4
    perm = torch.randperm(nblocks, generator=gen)
    rows, c = [], 0
    for s in seq_lens:
        k = -(-s // n)
        rows.append(perm[c : c + k].tolist() + [0] * (3 - k if k < 3 else 0))
        c += k
    width = max(len(r) for r in rows)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    qsl = torch.tensor([0, 13, 14, 16, 49, 49], dtype=torch.int32)
    tpb, q_block = n, 16
    _, _, e_qb, e_f = build_flex_block_indices(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=bt,
        num_tokens=49,
        n=n,
        tpb=tpb,
        q_block_size=q_block,
        kv_block_size=kv_block,
        causal=True,
        sliding_window=window,
    )
    got = set(zip(e_qb.tolist(), e_f.tolist(), strict=True))
    want = set()
    for r, (ql, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for i in range(ql):
            t = int(qsl[r]) + i
            pos = s - ql + i
            for kv in range(pos + 1):
                if window is not None and kv <= pos - window:
                    continue
                phys_tok = int(bt[r, kv // n]) * tpb + kv % n
                want.add((t // q_block, phys_tok // kv_block))
    assert got == want
    assert len(e_qb) == len(got), "entries must be unique (a KV tile visited twice double-counts)"


# -- FLEX_ATTENTION decode call: one batch row per query_len == 1 request ------------------------

# Pure decode with an empty request (seq_len 0) among them; decodes at odd lengths.
DECODE_SEQ_LENS = [9, 33, 1, 0, 17, 64, 40]
DECODE_QUERY_LENS = [1 if s else 0 for s in DECODE_SEQ_LENS]


def _decode_rows(md) -> set[tuple[int, int]]:
    """(batch row, KV block) pairs of the decode block mask, partial and full tiles."""
    bm = md.decode.block_mask
    out = set()
    for nums, idxs in (
        (bm.kv_num_blocks, bm.kv_indices),
        (bm.full_kv_num_blocks, bm.full_kv_indices),
    ):
        if nums is None:
            continue
        num, idx = nums[:, 0, 0], idxs[:, 0, 0]
        out |= {(r, int(idx[r, j])) for r in range(num.numel()) for j in range(int(num[r]))}
    return out


@pytest.mark.parametrize(
    ("feature", "block_size", "kernel_block_size", "kv_block_size"),
    [
        ("gqa", 16, 16, 16),
        ("gqa", 16, 16, 64),  # a KV tile spans 4 blocks of (possibly) different requests
        ("window", 64, 16, 32),  # manager 64 split into kernel blocks of 16
        ("window_sinks_diffkv", 64, 64, 64),
        ("sinks", 16, 16, None),
        ("softcap", 16, 16, None),
        ("alibi", 64, 64, None),
    ],
)
def test_flex_decode_call_matches(
    feature: str, block_size: int, kernel_block_size: int, kv_block_size: int | None
) -> None:
    b = _batch(
        query_lens=DECODE_QUERY_LENS,
        seq_lens=DECODE_SEQ_LENS,
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        num_q_heads=8,
        **FEATURES[feature],
    )
    backend = get_backend("FLEX_ATTENTION")
    opts = {} if kv_block_size is None else {"kv_block_size": kv_block_size}
    md = backend.make_builder(b.config, b.layout, **opts).build(b.common)
    # The decode call serves every request: batch dim = decode requests, no flattened call.
    assert md.decode is not None and md.windows == ()
    assert md.decode.block_mask.kv_num_blocks.shape == (sum(DECODE_QUERY_LENS), 1, 1)
    assert md.decode.contiguous
    impl = backend.make_impl(b.config, b.layout, sinks=b.sinks, alibi_slopes=b.alibi_slopes)
    out = impl.forward(None, b.q, b.kv_cache, md)
    _check(out, b)
    torch.testing.assert_close(out, run_backend("TORCH_SDPA", b), **TOL)


@pytest.mark.parametrize(("decode_tiles", "kv_block"), [("kv", 32), ("auto", 16)])
def test_flex_decode_rows_list_only_their_own_blocks(decode_tiles: str, kv_block: int) -> None:
    # Row r holds exactly the KV tiles of decode request r's window (no union over requests);
    # with decode_tiles="auto" the tiles of a layer at kv_block_size 32 are the pages (16).
    n, window = 16, 20
    b = _batch(
        query_lens=DECODE_QUERY_LENS, seq_lens=DECODE_SEQ_LENS, sliding_window=window, seed=3
    )
    md = (
        get_backend("FLEX_ATTENTION")
        .make_builder(b.config, b.layout, kv_block_size=32, decode_tiles=decode_tiles)
        .build(b.common)
    )
    assert md.decode is not None and md.decode.kv_block_size == kv_block
    assert md.decode.block_mask.BLOCK_SIZE[1] == kv_block
    bt = b.common.block_table
    want = set()
    row = 0
    for r, s in enumerate(DECODE_SEQ_LENS):
        if not s:
            continue
        for pos in range(max(0, s - window), s):
            want.add((row, (int(bt[r, pos // n]) * n + pos % n) // kv_block))
        row += 1
    assert _decode_rows(md) == want


def test_flex_mixed_batch_takes_both_calls() -> None:
    # Decodes interleaved with prefills: the decode call gathers its queries, the flattened call
    # serves the rest and lists none of the decode requests' tiles.
    b = _batch(sliding_window=6, has_sinks=True)
    backend = get_backend("FLEX_ATTENTION")
    md = backend.make_builder(b.config, b.layout, kv_block_size=16).build(b.common)
    assert md.decode is not None and len(md.windows) == 1
    assert md.decode.block_mask.kv_num_blocks.shape[0] == QUERY_LENS.count(1)
    assert not md.decode.contiguous and md.decode.tok.tolist() == [0, 8]
    # Query block 0 (tokens 0..15) holds both decodes and prefill tokens of requests 1 and 3;
    # with one block per KV tile, its row lists none of the decode requests' blocks.
    bm = md.windows[0].block_mask
    row0 = {int(x) for x in bm.kv_indices[0, 0, 0, : int(bm.kv_num_blocks[0, 0, 0])]}
    n = b.layout.block_size
    decode_blocks = {
        int(x) for r in (0, 2) for x in b.common.block_table[r, : -(-SEQ_LENS[r] // n)]
    }
    assert row0 and not row0 & decode_blocks
    impl = backend.make_impl(b.config, b.layout, sinks=b.sinks)
    _check(impl.forward(None, b.q, b.kv_cache, md), b)


def test_flex_decode_non_causal() -> None:
    b = _batch(query_lens=DECODE_QUERY_LENS, seq_lens=DECODE_SEQ_LENS)
    b.config = dataclasses.replace(b.config, causal=False)
    md = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout).build(b.common)
    assert md.decode is not None
    out = run_backend("FLEX_ATTENTION", b)
    torch.testing.assert_close(out, run_backend("TORCH_SDPA", b), **TOL)


@pytest.mark.parametrize("decodes_span_windows", [True, False])
def test_flex_decode_and_cache_windows(decodes_span_windows: bool) -> None:
    # Windows of 2 blocks (max_view_elements stands in for 2^31). Decodes whose blocks lie in
    # several windows run through the flattened call (merged by log-sum-exp); decodes inside one
    # window take the decode call, based on that window, beside a flattened call elsewhere.
    # Windows hold blocks (0, 1), (2, 3), ...; the requests get one, one and two blocks.
    b = _batch(
        query_lens=[1, 1, 30],
        seq_lens=[12, 9, 30],
        has_sinks=True,
        num_blocks=8,
        blocks=[0, 5, 2, 3] if decodes_span_windows else [4, 5, 0, 1],
        pad_tokens=0,
    )
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(b.config, b.layout, kv_block_size=16, max_view_elements=5000)
    md = builder.build(b.common)
    if decodes_span_windows:
        assert md.decode is None and len(md.windows) > 1
    else:
        assert md.decode is not None and md.decode.base_token == 64 and len(md.windows) == 1
        assert md.decode.block_mask.kv_num_blocks.shape[0] == 2
    impl = backend.make_impl(b.config, b.layout, sinks=b.sinks)
    _check(impl.forward(None, b.q, b.kv_cache, md), b)


def test_flex_decode_buffers_are_sized_by_max_num_seqs() -> None:
    b = _batch(query_lens=DECODE_QUERY_LENS, seq_lens=DECODE_SEQ_LENS)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(b.config, b.layout, max_num_seqs=8)
    assert builder.dec_num_blocks.shape == (8,) and builder.dec_indices.shape[0] == 8
    assert builder.build(b.common).decode is not None
    small = backend.make_builder(b.config, b.layout, max_num_seqs=4)
    with pytest.raises(ValueError, match="6 decode requests; .*max_num_seqs=4"):
        small.build(b.common)


# -- TRITON through the interpreter -------------------------------------------------------------


@pytest.mark.parametrize("feature", ["gqa", "window_sinks_diffkv", "softcap", "alibi"])
def test_triton_interpreter_matches(feature: str, triton_interpreter: None) -> None:
    b = _batch(**FEATURES[feature])
    _check(run_backend("TRITON", b), b)


@pytest.mark.parametrize(
    ("order", "block_size", "kernel_block_size"),
    [("LBHNC", 16, 16), ("BHLNC", 16, 16), ("LBNHC", 64, 16), ("LHBNC", 64, 64)],
)
def test_triton_orders_and_kernel_blocks(
    order: str, block_size: int, kernel_block_size: int, triton_interpreter: None
) -> None:
    b = _batch(
        order=order, block_size=block_size, kernel_block_size=kernel_block_size, sliding_window=10
    )
    _check(run_backend("TRITON", b), b)


def test_triton_cache_update_matches_sdpa(triton_interpreter: None) -> None:
    b = _batch(fill=False, head_size=48, head_size_v=32)
    slots = b.all_slots.clone()
    slots[::5] = -1  # padding slots are skipped
    for name in ("TRITON", "TORCH_SDPA"):
        cache = torch.zeros_like(b.kv_cache)
        impl = get_backend(name).make_impl(b.config, b.layout)
        impl.do_kv_cache_update(None, b.key, b.value, cache, slots)
        if name == "TRITON":
            triton_cache = cache
    torch.testing.assert_close(triton_cache, cache, atol=0, rtol=0)
    assert triton_cache.abs().sum() > 0


# -- cache writes, metadata, per-layer state ------------------------------------------------------


def test_sdpa_cache_update_roundtrip() -> None:
    b = _batch(fill=False, order="LBHNC")
    impl = get_backend("TORCH_SDPA").make_impl(b.config, b.layout)
    slots = b.all_slots.clone()
    skipped = slots[3].item()
    slots[3] = -1
    impl.do_kv_cache_update(None, b.key, b.value, b.kv_cache, slots)
    n = b.layout.block_size
    for i in (0, 7, len(slots) - 1):
        s = int(slots[i])
        torch.testing.assert_close(b.kv_cache[s // n, :, s % n, : b.config.head_size], b.key[i])
    assert b.kv_cache[skipped // n, :, skipped % n].abs().sum() == 0


def test_two_diffkv_impls_coexist() -> None:
    # Two layers with different head_size_v live side by side: nothing is class-global.
    b1 = _batch(head_size=48, head_size_v=32, seed=1)
    b2 = _batch(head_size=48, head_size_v=16, seed=2)
    be = get_backend("TORCH_SDPA")
    i1 = be.make_impl(b1.config, b1.layout)
    i2 = be.make_impl(b2.config, b2.layout)
    assert (i1.head_size_v, i2.head_size_v) == (32, 16)
    md1 = be.make_builder(b1.config, b1.layout).build(b1.common)
    md2 = be.make_builder(b2.config, b2.layout).build(b2.common)
    for _ in range(2):  # interleaved calls
        o1 = i1.forward(None, b1.q, b1.kv_cache, md1)
        o2 = i2.forward(None, b2.q, b2.kv_cache, md2)
        assert o1.shape[-1] == 32 and o2.shape[-1] == 16
    _check(o1, b1)
    _check(o2, b2)
    flex = get_backend("FLEX_ATTENTION")
    f1, f2 = flex.make_impl(b1.config, b1.layout), flex.make_impl(b2.config, b2.layout)
    _check(
        f1.forward(
            None, b1.q, b1.kv_cache, flex.make_builder(b1.config, b1.layout).build(b1.common)
        ),
        b1,
    )
    _check(
        f2.forward(
            None, b2.q, b2.kv_cache, flex.make_builder(b2.config, b2.layout).build(b2.common)
        ),
        b2,
    )


def _mutable(value: object) -> bool:
    return isinstance(value, (list, dict, set, bytearray, torch.Tensor))


def test_no_class_level_mutable_state() -> None:
    import kv_backends.base as base_mod

    classes: set[type] = {AttentionBackend, AttentionImpl, MetadataBuilder}
    for name in BACKEND_CLASSES:
        backend = get_backend(name)
        classes |= {backend, backend.impl_cls, backend.builder_cls}
    offenders = []
    for cls in classes:
        for klass in cls.__mro__:
            if not klass.__module__.startswith("kv_backends"):
                continue
            for attr, value in vars(klass).items():
                if not attr.startswith("__") and _mutable(value):
                    offenders.append(f"{klass.__name__}.{attr}")
    assert not offenders, f"class-level mutable state: {offenders}"
    assert base_mod  # imported for its classes
    with pytest.raises(TypeError, match="has no instances"):
        AttentionBackend()


def test_impl_checks_its_inputs() -> None:
    b = _batch(has_sinks=True)
    be = get_backend("TORCH_SDPA")
    with pytest.raises(ValueError, match="config.has_sinks=True but sinks is None"):
        be.make_impl(b.config, b.layout)
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\); expected \(4,\)"):
        be.make_impl(b.config, b.layout, sinks=torch.zeros(3))
    impl = be.make_impl(b.config, b.layout, sinks=b.sinks)
    md = be.make_builder(b.config, b.layout).build(b.common)
    with pytest.raises(ValueError, match="q has shape"):
        impl.forward(None, b.q[:, :2], b.kv_cache, md)
    with pytest.raises(ValueError, match="kv_cache has shape"):
        impl.forward(None, b.q, b.kv_cache[:-1], md)
    other = make_paged_batch(query_lens=[1], seq_lens=[4], num_kv_heads=4)
    with pytest.raises(
        ValueError, match="layout does not match the attention config: num_kv_heads 4 vs 2"
    ):
        be.make_impl(b.config, other.layout, sinks=b.sinks)


@pytest.mark.parametrize(
    ("q_lens", "want"),
    [
        ([1, 1, 1, 9, 1], 3),  # a decode after the prefill is not in the leading run
        ([9, 1, 1], 0),
        ([1, 1, 1], 3),  # pure decode: known without a look at the offsets
        ([1, 0, 1], 1),  # an empty row ends the run
    ],
)
def test_leading_decodes_counts_the_first_run_of_one_token_rows(
    q_lens: list[int], want: int
) -> None:
    md = CommonAttentionMetadata.from_lists(
        query_lens=q_lens, seq_lens=[max(q, 1) + 3 for q in q_lens],
        block_table=[[i] for i in range(len(q_lens))], block_size=16,
    )  # fmt: skip
    assert md.leading_decodes() == want
    # without the host copy a mixed batch's count would need a sync: 0, a true value
    blind = dataclasses.replace(md, query_start_loc_cpu=None)
    assert blind.leading_decodes() == (want if max(q_lens) <= 1 and 0 not in q_lens else 0)


def test_common_metadata_is_validated() -> None:
    ok = CommonAttentionMetadata.from_lists(
        query_lens=[2, 1], seq_lens=[5, 3], block_table=[[0], [1]], block_size=16
    )
    assert ok.num_reqs == 2 and ok.num_actual_tokens == 3 and not ok.is_pure_decode
    with pytest.raises(ValueError, match="slot_mapping has dtype torch.int32; expected int64"):
        dataclasses.replace(ok, slot_mapping=ok.slot_mapping.int())
    with pytest.raises(ValueError, match=r"seq_lens has shape \(3,\); expected \(2,\)"):
        dataclasses.replace(ok, seq_lens=torch.tensor([5, 3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_len=6 must be in"):
        CommonAttentionMetadata.from_lists(
            query_lens=[6], seq_lens=[5], block_table=[[0]], block_size=16
        )
    with pytest.raises(ValueError, match="needs 2 blocks of 16; block_table has 1 columns"):
        CommonAttentionMetadata.from_lists(
            query_lens=[1], seq_lens=[17], block_table=[[0]], block_size=16
        )


def test_flex_dynamo_limits_are_scoped_to_our_calls() -> None:
    """Every Flex user shares flex_attention's Dynamo cache: 8 graphs (fp16 + bf16 x a hybrid
    model's layer kinds) would make fullgraph=True a hard failure (seen on the GPU). The limits
    are raised while our compiled call runs and restored afterwards: no process-wide change."""
    from kv_backends.backends.flex.compiled import (
        FLEX_RECOMPILE_LIMIT,
        compiled_flex,
        flex_dynamo_limits,
    )

    cfg = torch._dynamo.config
    before = (cfg.recompile_limit, cfg.accumulated_recompile_limit)
    compiled_flex()  # building the compiled callable changes nothing either
    assert (cfg.recompile_limit, cfg.accumulated_recompile_limit) == before
    with flex_dynamo_limits():
        assert cfg.recompile_limit >= FLEX_RECOMPILE_LIMIT
        assert cfg.accumulated_recompile_limit >= 8 * FLEX_RECOMPILE_LIMIT
    assert (cfg.recompile_limit, cfg.accumulated_recompile_limit) == before
    # A process that already allows more keeps its own (higher) values untouched.
    old = cfg.recompile_limit
    cfg.recompile_limit = 10 * FLEX_RECOMPILE_LIMIT
    try:
        with flex_dynamo_limits():
            assert cfg.recompile_limit == 10 * FLEX_RECOMPILE_LIMIT
        assert cfg.recompile_limit == 10 * FLEX_RECOMPILE_LIMIT
    finally:
        cfg.recompile_limit = old
    # Restored even when the call raises.
    with pytest.raises(RuntimeError, match="boom"), flex_dynamo_limits():
        raise RuntimeError("boom")
    assert (cfg.recompile_limit, cfg.accumulated_recompile_limit) == before


def test_layer_params_go_to_the_device_once() -> None:
    """Sinks, slopes and scales are float32 tensors made once per device and reused every step
    (no per-forward host->device copy: what CUDA-graph capture needs)."""
    b = make_paged_batch(
        query_lens=[1], seq_lens=[9], has_sinks=True, use_alibi=True, kv_cache_dtype="fp8_e4m3"
    )
    be = get_backend("TORCH_SDPA")
    impl = be.make_impl(
        b.config,
        b.layout,
        sinks=b.sinks.half(),
        alibi_slopes=b.alibi_slopes,
        k_scale=b.k_scale,
        v_scale=b.v_scale,
        device="cpu",
    )
    dev = torch.device("cpu")
    p1 = impl.device_params(dev)
    assert p1.sinks is not None and p1.sinks.dtype == torch.float32
    assert p1.k_scale is not None and float(p1.k_scale) == b.k_scale
    md = be.make_builder(b.config, b.layout).build(b.common)
    impl.forward(None, b.q, b.kv_cache, md)
    p2 = impl.device_params(dev)
    assert p2 is p1 and p2.sinks is p1.sinks  # cached, not rebuilt per forward
    # The layer's own (dynamic) scales still win over the impl's.
    layer = type("L", (), {"k_scale": 2.0, "v_scale": torch.tensor(4.0)})()
    k, v = impl.scales(layer, dev)
    assert float(k) == 2.0 and float(v) == 4.0
