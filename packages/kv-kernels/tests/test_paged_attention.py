"""Paged attention: torch reference and Triton kernel against the shared float64 dense oracle
(``kv_kernels.testing.attention_oracle``).

The oracle's input is built independently of the paged cache: each test draws every sequence's K/V as
dense ``[H, L, D]`` tensors, writes them into the cache page by page through a shuffled block
table, and the oracle attends over the dense tensors directly. The Triton kernel runs under
``TRITON_INTERPRET=1`` on the CPU (set below before the kernel module is first imported) or
natively when a GPU is present; tests that run it take conftest's ``triton_device`` fixture, which
skips them where neither works (no GPU and no numpy for the interpreter).
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    # conftest does the same; repeated here so the module also runs on its own. Must precede the
    # first import of kv_kernels.paged_attention.triton (imported lazily by the api).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import merge_attn_states, paged_attention
from kv_kernels.testing import assert_close_to_oracle, attention_oracle
from kv_spec import KVCacheLayout, LayoutOrder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_ORDERS = [o.value for o in LayoutOrder]

# Tolerances: kv_kernels.testing.TOLERANCES (per dtype, per output row, with the reason there).


# ------------------------------------------------------------------------------------------
# batch construction and oracle
# ------------------------------------------------------------------------------------------


def make_batch(
    *,
    q_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int = 2,
    group: int = 4,
    head_size: int = 32,
    head_size_v: int | None = None,
    block_size: int = 16,
    order: str = "LBNHC",
    dtype: torch.dtype = torch.float32,
    num_layers: int = 2,
    layer: int = 1,
    seed: int = 0,
    spare_blocks: int = 3,
    device: str = DEVICE,
) -> dict:
    """A varlen batch over a freshly filled paged cache (shuffled pages, -1 padded table tails)."""
    gen = torch.Generator().manual_seed(seed)
    head_size_v = head_size if head_size_v is None else head_size_v
    pages = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    layout = KVCacheLayout(
        order=order,
        num_layers=num_layers,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=str(dtype).removeprefix("torch."),
    )
    storage = allocate_kv_cache(layout, device)
    kv = layer_view(storage, layout, layer)
    # Poison every page first: a kernel that reads outside its sequence sees nan.
    kv.fill_(float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max([*pages, 1]) + 2  # padded tail of -1
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    ks, vs = [], []
    used = 0
    for s, L in enumerate(seq_lens):
        ids = perm[used : used + pages[s]]
        used += pages[s]
        table[s, : pages[s]] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(num_kv_heads, L, head_size, generator=gen).to(dtype)
        v = torch.randn(num_kv_heads, L, head_size_v, generator=gen).to(dtype)
        for p, b in enumerate(ids):
            lo, hi = p * block_size, min(L, (p + 1) * block_size)
            kv[b, :, : hi - lo, 0:head_size] = k[:, lo:hi].to(device)
            kv[b, :, : hi - lo, head_size : head_size + head_size_v] = v[:, lo:hi].to(device)
        ks.append(k.double())
        vs.append(v.double())
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=gen).to(dtype)
    return dict(
        q=q.to(device),
        kv=kv,
        storage=storage,
        layout=layout,
        block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl=qsl.to(device),
        max_query_len=max([*q_lens, 0]),
        ks=ks,
        vs=vs,
        q_lens=q_lens,
        lens=seq_lens,
    )


def oracle(batch: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_kernels.testing's float64 oracle over each sequence's own dense K/V (never the cache)."""
    return attention_oracle(
        batch["q"],
        [k.transpose(0, 1) for k in batch["ks"]],  # [H, L, D] -> [L, H, D]
        [v.transpose(0, 1) for v in batch["vs"]],
        batch["q_lens"],
        **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
    )


def run(batch: dict, impl: str, **kw):
    return paged_attention(
        batch["q"],
        batch["kv"],
        batch["layout"],
        batch["block_table"],
        batch["seq_lens"],
        batch["qsl"],
        batch["max_query_len"],
        impl=impl,
        **kw,
    )


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rows: int | None = None
) -> None:
    """The shared per-row oracle bound (kv_kernels.testing.TOLERANCES[dtype])."""
    assert_close_to_oracle(out.detach().cpu()[:rows], ref[:rows], dtype=dtype)


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor) -> None:
    got, want = lse.detach().cpu().double(), ref.double()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "lse -inf rows differ"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=1e-4)


# A mixed batch: a long prefill, a decode step, an empty sequence, a chunked prefill with context,
# and a speculative step of 3 tokens.
MIXED_Q = [37, 1, 0, 9, 3]
MIXED_L = [37, 45, 0, 70, 19]

FEATURES = {
    "plain": {},
    "window": {"sliding_window": 11},
    "sinks_softcap": {"sinks": "sinks", "softcap": 3.0},
    "alibi": {"alibi_slopes": "alibi"},
    "noncausal": {"causal": False, "scale": 0.2},
    # a window on a non-causal layer bounds both sides (|p - k| < w)
    "noncausal_window": {"causal": False, "sliding_window": 7},
}


def feature_kwargs(name: str, num_q_heads: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    kw = dict(FEATURES[name])
    if kw.get("sinks") == "sinks":
        kw["sinks"] = torch.randn(num_q_heads, generator=gen) * 2
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = torch.rand(num_q_heads, generator=gen) * 0.5
    return kw


def on(device: str, kw: dict) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


# ------------------------------------------------------------------------------------------
# reference vs oracle
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature", list(FEATURES))
def test_reference_matches_oracle(feature: str) -> None:
    b = make_batch(q_lens=MIXED_Q, seq_lens=MIXED_L, device="cpu")
    kw = feature_kwargs(feature, b["q"].shape[1])
    out, lse = run(b, "reference", return_lse=True, **kw)
    ref, ref_lse = oracle(b, **kw)
    assert_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


def test_reference_diffkv_gqa8_block32() -> None:
    b = make_batch(
        q_lens=[5, 1],
        seq_lens=[40, 33],
        group=8,
        num_kv_heads=1,
        head_size=48,
        head_size_v=32,
        block_size=32,
        device="cpu",
    )
    out = run(b, "reference")
    assert_close(out, oracle(b)[0], torch.float32)


def test_reference_rejects_unallocated_block() -> None:
    b = make_batch(q_lens=[1], seq_lens=[20], device="cpu")
    b["block_table"][0, 1] = -1  # position 16..19 would read an unallocated page
    with pytest.raises(ValueError, match="outside"):
        run(b, "reference")


# ------------------------------------------------------------------------------------------
# Triton kernel (interpreter on the CPU) vs oracle / reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature", list(FEATURES))
def test_triton_mixed_batch(feature: str, triton_device: str) -> None:
    b = make_batch(q_lens=MIXED_Q, seq_lens=MIXED_L)
    kw = on(DEVICE, feature_kwargs(feature, b["q"].shape[1]))
    out, lse = run(b, "triton", return_lse=True, **kw)
    ref, ref_lse = oracle(
        b, **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    )
    assert_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


def test_triton_fp16_odd_head_size_and_reference_parity(triton_device: str) -> None:
    # head 40 pads to 64 inside the kernel (masked lanes); block 32 with a 64-token tile spans pages.
    b = make_batch(
        q_lens=[6, 1, 2], seq_lens=[50, 77, 2], head_size=40, block_size=32, dtype=torch.float16
    )
    out = run(b, "triton")
    ref = oracle(b)[0]
    assert out.dtype == torch.float16
    assert_close(out, ref, torch.float16)
    torch.testing.assert_close(
        out.float().cpu(), run(b, "reference").float().cpu(), atol=4e-3, rtol=4e-3
    )


@pytest.mark.parametrize("order", ALL_ORDERS)
def test_triton_every_layout_order(order: str, triton_device: str) -> None:
    b = make_batch(
        q_lens=[4, 1], seq_lens=[21, 30], order=order, num_kv_heads=2, group=2, head_size=16
    )
    assert_close(run(b, "triton"), oracle(b)[0], torch.float32)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_triton_gqa_ratios(group: int, triton_device: str) -> None:
    b = make_batch(q_lens=[20, 1], seq_lens=[20, 26], num_kv_heads=1, group=group, head_size=16)
    assert_close(run(b, "triton"), oracle(b)[0], torch.float32)


def test_triton_diffkv_head_sizes(triton_device: str) -> None:
    # head_size_v != head_size (DiffKV 192/128, scaled down for the interpreter)
    b = make_batch(q_lens=[7, 1], seq_lens=[30, 40], head_size=48, head_size_v=32, group=2)
    out = run(b, "triton")
    assert out.shape[-1] == 32
    assert_close(out, oracle(b)[0], torch.float32)


def test_triton_block_size_64_and_window_skips_tiles(triton_device: str) -> None:
    # A window much shorter than the context: early tiles are never visited (nan poison
    # in unreachable positions would otherwise leak in through 0 * nan).
    b = make_batch(q_lens=[1, 3], seq_lens=[200, 150], block_size=64, head_size=16, group=2)
    first = b["block_table"][0, 0].item()
    b["kv"][first, :, :, :] = float("nan")  # positions 0..63 of sequence 0: outside the window
    out = run(b, "triton", sliding_window=40)
    ref = oracle(b, sliding_window=40)[0]
    assert_close(out, ref, torch.float32)


def _tma_launcher(monkeypatch: pytest.MonkeyPatch, plant=None) -> list[bool]:
    """Spy on the launcher's TMA descriptors (``plant``: replace the cache they address); returns
    the list of calls' ``descriptors made`` flags."""
    launcher = importlib.import_module("kv_kernels.paged_attention.triton")
    made: list[bool] = []
    orig = launcher._tma_descriptors

    def spy(kv_cache, *a, **kw):
        descs = orig(plant(kv_cache) if plant else kv_cache, *a, **kw)
        made.append(descs is not None)
        return descs

    monkeypatch.setattr(launcher, "_tma_descriptors", spy)
    return made


@pytest.mark.parametrize("feature", ["plain", "window", "sinks_softcap", "noncausal"])
@pytest.mark.parametrize("block_size", [64, 128])
def test_prefill_tma_tiles(
    feature: str, block_size: int, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16-bit pages holding whole 64-token prefill tiles: the unmasked tiles are read by TMA
    boxes. They match the oracle (nan-poisoned spare pages catch a wrong page) and equal the
    pointer gathers bit for bit; a descriptor one page off fails the oracle check."""
    b = make_batch(
        q_lens=[150, 1, 70], seq_lens=[150, 90, 260], block_size=block_size, head_size=32,
        group=2, dtype=torch.float16,
    )  # fmt: skip
    kw = on(DEVICE, feature_kwargs(feature, b["q"].shape[1]))
    ref = oracle(b, **kw)[0]
    made = _tma_launcher(monkeypatch)
    out = run(b, "triton", **kw)
    assert made == [True]
    assert_close(out, ref, torch.float16)
    monkeypatch.undo()
    gathered = run(b, "triton", **kw)
    assert torch.equal(out, gathered)
    if feature == "plain":
        _tma_launcher(monkeypatch, plant=lambda kv: kv[1:])  # block b read from b + 1
        with pytest.raises(AssertionError):
            assert_close(run(b, "triton", **kw), ref, torch.float16)


def test_split_kv_with_lse_and_sinks(triton_device: str) -> None:
    b = make_batch(q_lens=[1, 1, 0, 2], seq_lens=[150, 9, 0, 90], head_size=16, group=2)
    sinks = torch.randn(b["q"].shape[1])
    for splits in (3, 8):
        out, lse = run(b, "triton", num_splits=splits, return_lse=True, sinks=sinks.to(DEVICE))
        ref, ref_lse = oracle(b, sinks=sinks)
        assert_close(out, ref, torch.float32)
        assert_lse_close(lse, ref_lse)


def test_empty_rows_and_padding_rows(triton_device: str) -> None:
    # An empty sequence (no query, no keys) in the batch; rows past qsl[-1] stay untouched.
    b = make_batch(q_lens=[0, 2], seq_lens=[0, 5], head_size=16)
    extra = torch.full((3, *b["q"].shape[1:]), 7.0, dtype=b["q"].dtype, device=DEVICE)
    b["q"] = torch.cat([b["q"], extra])
    out = torch.full((b["q"].shape[0], b["q"].shape[1], 16), 5.0, device=DEVICE)
    res, _lse = run(b, "triton", out=out, return_lse=True)
    assert res is out
    assert torch.all(out[2:] == 5.0)
    assert_close(out[:2], oracle(b)[0][:2], torch.float32)


def test_sink_outweighs_a_single_key(triton_device: str) -> None:
    # one key and a large sink: the sink takes most of the denominator, the lse includes it
    b = make_batch(q_lens=[1], seq_lens=[1], head_size=16)
    sinks = torch.full((b["q"].shape[1],), 3.0, device=DEVICE)
    out, lse = run(b, "triton", sinks=sinks, return_lse=True)
    ref, ref_lse = oracle(b, sinks=sinks)
    assert_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_query_longer_than_sequence_is_an_error(impl: str) -> None:
    """q_len > seq_len used to return all-zero rows; it is an input error (DESIGN: attention
    semantics), named with the sequence, both lengths and the fix. Host-side lengths: CPU
    tensors (CUDA calls count it in ``error_flag`` instead, tested below)."""
    if impl == "triton" and DEVICE == "cuda":
        # the Triton kernels take CUDA tensors on a GPU machine (CPU ones only interpreted)
        pytest.skip("host-side length check of CPU tensors; the GPU path is the error flag's")
    b = make_batch(q_lens=[1, 3], seq_lens=[6, 5], head_size=16, device="cpu")
    b["seq_lens"][1] = 2
    with pytest.raises(ValueError, match=r"sequence 1 has query_len=3 > seq_lens\[1\]=2"):
        run(b, impl)


@pytest.mark.parametrize("block_size", [16, 64])  # tiles spanning pages / inside one page
def test_error_flag_counts_bad_metadata_without_host_checks(
    block_size: int, triton_device: str
) -> None:
    """validate=False is what CUDA tensors get by default: the kernel must neither crash nor read
    outside the cache on bad ids / q_len > seq_len, and it counts them in error_flag."""
    b = make_batch(
        q_lens=[1, 2, 1], seq_lens=[140, 20, 30], head_size=16, group=2, block_size=block_size
    )
    nb = b["layout"].num_blocks
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    run(b, "triton", error_flag=flag, validate=False)
    assert int(flag) == 0, "valid metadata must not raise the flag"
    bad = dict(b)
    table = b["block_table"].clone()
    table[0, 1] = nb + 10_000_000  # far past the cache: an unmasked read would fault
    table[2, 0] = -7
    bad["block_table"] = table
    out = run(bad, "triton", error_flag=flag, validate=False)
    assert int(flag) > 0
    assert torch.isfinite(out[1:3]).all()  # the healthy request is untouched by its neighbours
    assert_close(out[1:3], oracle(b)[0][1:3], torch.float32)
    flag.zero_()
    short = dict(b, seq_lens=b["seq_lens"].clone())
    short["seq_lens"][1] = 1  # q_len 2 > seq_len 1
    run(short, "triton", error_flag=flag, validate=False)
    assert int(flag) >= 1
    with pytest.raises(ValueError, match="outside"):
        run(bad, "triton", validate=True)  # the debug mode checks on the host


def test_error_flag_is_validated() -> None:
    b = _small()
    with pytest.raises(ValueError, match="error_flag must be an int32"):
        run(b, "reference", error_flag=torch.zeros(1))


def test_merge_attn_states_cascade(triton_device: str) -> None:
    """Attention over a shared prefix and a suffix, merged, equals attention over both."""
    b = make_batch(q_lens=[3, 2], seq_lens=[64, 48], head_size=16, group=2, block_size=16)
    table = b["block_table"]
    full, full_lse = run(b, "reference", causal=False, return_lse=True)
    # prefix: the first 2 pages of each sequence; suffix: the rest (re-based block table)
    pre_len = torch.tensor([32, 32], dtype=torch.int32, device=DEVICE)
    suf_len = b["seq_lens"] - pre_len
    suf_table = torch.full_like(table, -1)
    suf_table[:, : table.shape[1] - 2] = table[:, 2:]
    common = (b["q"], b["kv"], b["layout"])
    a = paged_attention(
        *common, table, pre_len, b["qsl"], 3, causal=False, return_lse=True, impl="triton"
    )
    s = paged_attention(
        *common, suf_table, suf_len, b["qsl"], 3, causal=False, return_lse=True, impl="triton"
    )
    for impl in ("reference", "triton"):
        out, lse = merge_attn_states(a[0], a[1], s[0], s[1], impl=impl)
        torch.testing.assert_close(out.cpu(), full.cpu(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.cpu(), full_lse.cpu(), atol=2e-5, rtol=2e-5)


def test_merge_attn_states_empty_side(triton_device: str) -> None:
    out_a = torch.randn(2, 3, 8, device=DEVICE)
    lse_a = torch.randn(2, 3, device=DEVICE)
    lse_b = torch.full((2, 3), -math.inf, device=DEVICE)
    lse_b[1, 2] = 0.5
    lse_a[0, 0] = -math.inf
    lse_b[0, 0] = -math.inf  # both empty: zeros, -inf
    out_b = torch.randn(2, 3, 8, device=DEVICE)
    for impl in ("reference", "triton"):
        out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b, impl=impl)
        assert torch.all(out[0, 0] == 0) and lse[0, 0].item() == -math.inf
        torch.testing.assert_close(out[0, 1], out_a[0, 1])
        w = torch.softmax(torch.stack([lse_a[1, 2], lse_b[1, 2]]), 0)
        torch.testing.assert_close(out[1, 2], w[0] * out_a[1, 2] + w[1] * out_b[1, 2])


def test_num_splits_batch_invariance(triton_device: str) -> None:
    """With num_splits fixed, a sequence alone and inside a bigger batch gives identical bits."""
    big = make_batch(
        q_lens=[1, 40, 1, 2], seq_lens=[130, 40, 77, 60], head_size=16, group=2, seed=3
    )
    alone = dict(big)
    s = 2  # the sequence under test: 1 query over 77 keys
    alone["q"] = big["q"][41:42]
    alone["block_table"] = big["block_table"][s : s + 1]
    alone["seq_lens"] = big["seq_lens"][s : s + 1]
    alone["qsl"] = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    alone["max_query_len"] = 1
    for splits in (1, 3):
        o_big = run(big, "triton", num_splits=splits)
        o_alone = run(alone, "triton", num_splits=splits)
        assert torch.equal(o_big[41:42], o_alone), f"num_splits={splits}: batch changed the bits"


@pytest.mark.parametrize("n", [16, 64])  # 64: a prefill whose whole-page tiles TMA reads
def test_offsets_past_2_31_elements(
    n: int, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks whose element offset exceeds 2^31: a 4 GiB cache allocated lazily (torch.empty
    maps pages on first touch), of which only the few pages the batch uses are written."""
    if DEVICE == "cuda":
        pytest.skip("covered by the GPU test with a real allocation")
    head, h = 32, 2
    page = n * h * 2 * head  # elements per page
    num_blocks = 2**31 // page + 64
    layout = KVCacheLayout(
        order="LBNHC",
        num_layers=1,
        num_blocks=num_blocks,
        num_kv_heads=h,
        block_size=n,
        head_size=head,
        head_size_v=head,
        dtype="float16",
    )
    storage = allocate_kv_cache(layout, "cpu", zero=False)  # 4 GiB virtual, untouched
    kv = layer_view(storage, layout, 0)
    assert kv.stride(0) * (num_blocks - 1) > 2**31
    gen = torch.Generator().manual_seed(1)
    if n == 16:
        lens, q_lens = [40, 20], [2, 1]
        ids = [[num_blocks - 1, 3, num_blocks - 5], [num_blocks - 2, 5]]
    else:
        lens, q_lens = [200, 20], [70, 1]
        ids = [[num_blocks - 1, 3, num_blocks - 5, num_blocks - 3], [num_blocks - 2]]
    table = torch.full((2, 4), -1, dtype=torch.int32)
    ks, vs = [], []
    for s, L in enumerate(lens):
        table[s, : len(ids[s])] = torch.tensor(ids[s], dtype=torch.int32)
        k = torch.randn(h, L, head, generator=gen).half()
        v = torch.randn(h, L, head, generator=gen).half()
        for p, blk in enumerate(ids[s]):
            lo, hi = p * n, min(L, (p + 1) * n)
            kv[blk, :, :, :] = 0
            kv[blk, :, : hi - lo, :head] = k[:, lo:hi]
            kv[blk, :, : hi - lo, head:] = v[:, lo:hi]
        ks.append(k.double())
        vs.append(v.double())
    b = dict(
        q=torch.randn(sum(q_lens), 2 * h, head, generator=gen).half(),
        kv=kv,
        layout=layout,
        block_table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        qsl=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32),
        max_query_len=max(q_lens),
        ks=ks,
        vs=vs,
        q_lens=q_lens,
        lens=lens,
    )
    ref = oracle(b)[0]
    assert_close(run(b, "reference"), ref, torch.float16)
    made = _tma_launcher(monkeypatch)
    assert_close(run(b, "triton"), ref, torch.float16)
    assert made == ([True] if n == 64 else [])  # the prefill's TMA boxes address past 2^31 too
    assert_close(run(b, "triton", num_splits=2), ref, torch.float16)


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


def _small() -> dict:
    return make_batch(q_lens=[2], seq_lens=[5], head_size=16, device="cpu")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b.update(q=b["q"][..., :8]), "head_size"),
        (lambda b: b.update(q=b["q"].double()), "float16/bfloat16/float32"),
        (lambda b: b.update(q=b["q"][:, :3]), "multiple"),
        (lambda b: b.update(block_table=b["block_table"].float()), "block_table"),
        (lambda b: b.update(seq_lens=b["seq_lens"][:0]), "seq_lens"),
        (lambda b: b.update(qsl=b["qsl"][:1]), "query_start_loc"),
        (lambda b: b.update(kv=b["kv"][:1]), "layer view"),
        (lambda b: b.update(max_query_len=1), "max_query_len"),
        (lambda b: b.update(seq_lens=torch.tensor([500], dtype=torch.int32)), "columns"),
    ],
)
def test_validation_errors(mutate, match: str) -> None:
    b = _small()
    mutate(b)
    with pytest.raises(ValueError, match=match):
        run(b, "reference")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"impl": "cuda"}, "impl"),
        ({"sinks": torch.zeros(3)}, "sinks"),
        ({"alibi_slopes": torch.zeros(8, dtype=torch.float64)}, "alibi_slopes"),
        ({"softcap": -1.0}, "softcap"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"num_splits": 0}, "num_splits"),
        ({"k_scale": 1.0}, "not quantized"),
        ({"out": torch.empty(2, 8, 15)}, "out must be"),
    ],
)
def test_validation_errors_kwargs(kw: dict, match: str) -> None:
    b = _small()
    impl = kw.pop("impl", "reference")
    with pytest.raises(ValueError, match=match):
        run(b, impl, **kw)


def test_unsupported_layouts_are_named() -> None:
    b = _small()
    mla = KVCacheLayout(
        order="LBNHC",
        num_layers=1,
        num_blocks=4,
        num_kv_heads=1,
        block_size=16,
        head_size=32,
        head_size_v=0,
        dtype="float32",
        is_mla=True,
    )
    with pytest.raises(ValueError, match="MLA layout .* needs kv_lora_rank"):
        paged_attention(b["q"], b["kv"], mla, b["block_table"], b["seq_lens"], b["qsl"], 2)
    # (per-token-head quantized caches are read since issue 12: test_paged_attention_quant.py)
    fp8 = KVCacheLayout(
        order="LBNHC",
        num_layers=1,
        num_blocks=b["layout"].num_blocks,
        num_kv_heads=2,
        block_size=16,
        head_size=16,
        head_size_v=16,
        dtype="fp8_e4m3",
        kv_quant="fp8_per_tensor",
    )
    kv8 = layer_view(allocate_kv_cache(fp8), fp8, 0)
    with pytest.raises(ValueError, match="k_scale is required"):
        paged_attention(b["q"], kv8, fp8, b["block_table"], b["seq_lens"], b["qsl"], 2)
    with pytest.raises(ValueError, match=r"\[2\]"):
        paged_attention(
            b["q"],
            kv8,
            fp8,
            b["block_table"],
            b["seq_lens"],
            b["qsl"],
            2,
            k_scale=torch.ones(3),
            v_scale=1.0,
        )


def test_fp8_reference_dequantizes_per_head() -> None:
    """fp8 per-tensor / per-head scales on the reference path (the kernel's fp8 path is GPU-tested)."""
    b = make_batch(q_lens=[2, 1], seq_lens=[20, 9], head_size=16, group=2, device="cpu")
    layout = b["layout"]
    fp8 = KVCacheLayout(
        order="LBNHC",
        num_layers=1,
        num_blocks=layout.num_blocks,
        num_kv_heads=2,
        block_size=16,
        head_size=16,
        head_size_v=16,
        dtype="fp8_e4m3",
        kv_quant="fp8_per_tensor",
    )
    kv8 = layer_view(allocate_kv_cache(fp8), fp8, 0)
    k_scale = torch.tensor([0.5, 0.25])
    v_scale = 0.125
    src = b["kv"].nan_to_num(0.0)
    kv8[..., :16] = (src[..., :16] / k_scale[None, :, None, None]).to(torch.float8_e4m3fn)
    kv8[..., 16:] = (src[..., 16:] / v_scale).to(torch.float8_e4m3fn)
    got = paged_attention(
        b["q"],
        kv8,
        fp8,
        b["block_table"],
        b["seq_lens"],
        b["qsl"],
        2,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    # oracle over the dequantized fp8 values
    deq = dict(b, kv=kv8)
    for s, _ in enumerate(b["lens"]):
        n_pages = -(-b["lens"][s] // 16)
        pages = kv8[b["block_table"][s, :n_pages].long()].float()  # [p, H, N, C]
        flat = pages.permute(1, 0, 2, 3).reshape(2, -1, 32)[:, : b["lens"][s]]
        deq["ks"][s] = (flat[..., :16] * k_scale[:, None, None]).double()
        deq["vs"][s] = (flat[..., 16:] * v_scale).double()
    assert_close(got, oracle(deq)[0], torch.float32)


# ------------------------------------------------------------------------------------------
# custom op
# ------------------------------------------------------------------------------------------


def test_custom_op_opcheck() -> None:
    b = make_batch(q_lens=[3, 1], seq_lens=[20, 9], head_size=16, device="cpu")
    b["kv"].nan_to_num_(0.0)  # opcheck compares whole tensors across runs
    out = torch.empty(4, 8, 16)
    lse = torch.empty(4, 8)
    args = (
        b["q"],
        b["kv"],
        b["layout"].to_json(),
        b["block_table"],
        b["seq_lens"],
        b["qsl"],
        3,
        -1,
        0.25,
        True,
        -1,
        torch.randn(8),
        0.0,
        None,
        None,
        None,
        0,
        out,
        lse,
        "reference",
        None,  # error_flag: required (nullable), see kv_kernels._ops
    )
    torch.library.opcheck(torch.ops.kv_kernels.paged_attention.default, args)


def test_torch_compile_runs_the_custom_op() -> None:
    b = make_batch(q_lens=[3, 1], seq_lens=[20, 9], head_size=16, device="cpu")

    def step(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return paged_attention(
            q,
            b["kv"],
            b["layout"],
            b["block_table"],
            b["seq_lens"],
            b["qsl"],
            3,
            sliding_window=6,
            return_lse=True,
            impl="reference",
        )

    out, lse = torch.compile(step, backend="eager", fullgraph=True)(b["q"])
    ref, ref_lse = oracle(b, sliding_window=6)
    assert_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "8")), deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=6, max_size=6),
    lens=st.lists(st.integers(1, 90), min_size=2, max_size=2),
)
def test_fuzz_kernel_never_leaves_the_cache(ids: list[int], lens: list[int]) -> None:
    """Any block table (ids anywhere in int32) and any seq_lens up to past the table's width: the
    kernel runs without a fault, writes finite rows, and the flag is nonzero exactly when some
    page under a sequence is invalid."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
    b = make_batch(q_lens=[1, 1], seq_lens=[40, 40], head_size=16, group=2, block_size=16)
    b["kv"].nan_to_num_(0.0)
    nb = b["layout"].num_blocks
    table = torch.tensor(ids, dtype=torch.int32).reshape(2, 3).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = run(
        dict(b, block_table=table, seq_lens=seq_lens), "triton", error_flag=flag, validate=False
    )
    assert torch.isfinite(out).all()
    bad = any(
        not 0 <= (ids[3 * s + p] if p < 3 else -1) < nb
        for s, L in enumerate(lens)
        for p in range(-(-L // 16))
    )
    assert (int(flag) > 0) == bad
