"""Paged attention: torch reference and Triton kernel against the shared float64 dense oracle
(``kv_kernels.testing.attention_oracle``), over the attention features, layout orders, GQA ratios,
head sizes, split KV and merged states.

The oracle's input is built independently of the paged cache (``kv_kernels.testing_attention``):
each test draws every sequence's K/V as dense ``[H, L, D]`` tensors, writes them into the cache
page by page through a shuffled block table, and the oracle attends over the dense tensors
directly. The Triton kernel runs under ``TRITON_INTERPRET=1`` on the CPU (set below before the
kernel module is first imported) or natively when a GPU is present; tests that run it take
conftest's ``triton_device`` fixture, which skips them where neither works (no GPU and no numpy for
the interpreter). TMA tiles and 64-bit offsets: ``test_paged_attention_tma.py``; validation, the
error flag and the custom op: ``test_paged_attention_validation.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # conftest does the same; repeated here so the module also runs on its own. Must precede the
    # first import of kv_kernels.paged_attention.triton (imported lazily by the api).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import merge_attn_states, paged_attention
from kv_kernels.testing import attention_oracle
from kv_kernels.testing_attention import (
    FEATURES,
    MIXED_Q_LENS,
    MIXED_SEQ_LENS,
    assert_lse_close,
    assert_rows_close,
    batch_oracle,
    counting_gluon_launches,
    feature_kwargs,
    make_paged_batch,
    run_batch,
    tensors_to,
)
from kv_spec import KVCacheLayout, LayoutOrder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_ORDERS = [o.value for o in LayoutOrder]

# Tolerances: kv_kernels.testing.TOLERANCES (per dtype, per output row, with the reason there).


# ------------------------------------------------------------------------------------------
# reference vs oracle
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature", list(FEATURES))
def test_reference_matches_oracle(feature: str) -> None:
    b = make_paged_batch(q_lens=MIXED_Q_LENS, seq_lens=MIXED_SEQ_LENS, device="cpu")
    kw = feature_kwargs(feature, b["q"].shape[1])
    out, lse = run_batch(b, "reference", return_lse=True, **kw)
    ref, ref_lse = batch_oracle(b, **kw)
    assert_rows_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


def test_reference_diffkv_gqa8_block32() -> None:
    b = make_paged_batch(
        q_lens=[5, 1],
        seq_lens=[40, 33],
        group=8,
        num_kv_heads=1,
        head_size=48,
        head_size_v=32,
        block_size=32,
        device="cpu",
    )
    out = run_batch(b, "reference")
    assert_rows_close(out, batch_oracle(b)[0], torch.float32)


def test_reference_rejects_unallocated_block() -> None:
    b = make_paged_batch(q_lens=[1], seq_lens=[20], device="cpu")
    b["block_table"][0, 1] = -1  # position 16..19 would read an unallocated page
    with pytest.raises(ValueError, match="outside"):
        run_batch(b, "reference")


# ------------------------------------------------------------------------------------------
# Triton kernel (interpreter on the CPU) vs oracle / reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature", list(FEATURES))
def test_triton_mixed_batch(feature: str, triton_device: str) -> None:
    b = make_paged_batch(q_lens=MIXED_Q_LENS, seq_lens=MIXED_SEQ_LENS)
    kw = tensors_to(DEVICE, feature_kwargs(feature, b["q"].shape[1]))
    out, lse = run_batch(b, "triton", return_lse=True, **kw)
    ref, ref_lse = batch_oracle(
        b, **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    )
    assert_rows_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


def test_triton_fp16_odd_head_size_and_reference_parity(triton_device: str) -> None:
    # head 40 pads to 64 inside the kernel (masked lanes); block 32 with a 64-token tile spans pages.
    b = make_paged_batch(
        q_lens=[6, 1, 2], seq_lens=[50, 77, 2], head_size=40, block_size=32, dtype=torch.float16
    )
    out = run_batch(b, "triton")
    ref = batch_oracle(b)[0]
    assert out.dtype == torch.float16
    assert_rows_close(out, ref, torch.float16)
    torch.testing.assert_close(
        out.float().cpu(), run_batch(b, "reference").float().cpu(), atol=4e-3, rtol=4e-3
    )


@pytest.mark.parametrize("order", ALL_ORDERS)
def test_triton_every_layout_order(order: str, triton_device: str) -> None:
    b = make_paged_batch(
        q_lens=[4, 1], seq_lens=[21, 30], order=order, num_kv_heads=2, group=2, head_size=16
    )
    assert_rows_close(run_batch(b, "triton"), batch_oracle(b)[0], torch.float32)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_triton_gqa_ratios(group: int, triton_device: str) -> None:
    b = make_paged_batch(
        q_lens=[20, 1], seq_lens=[20, 26], num_kv_heads=1, group=group, head_size=16
    )
    assert_rows_close(run_batch(b, "triton"), batch_oracle(b)[0], torch.float32)


def test_triton_diffkv_head_sizes(triton_device: str) -> None:
    # head_size_v != head_size (DiffKV 192/128, scaled down for the interpreter)
    b = make_paged_batch(q_lens=[7, 1], seq_lens=[30, 40], head_size=48, head_size_v=32, group=2)
    out = run_batch(b, "triton")
    assert out.shape[-1] == 32
    assert_rows_close(out, batch_oracle(b)[0], torch.float32)


def test_triton_block_size_64_and_window_skips_tiles(triton_device: str) -> None:
    # A window much shorter than the context: early tiles are never visited (nan poison
    # in unreachable positions would otherwise leak in through 0 * nan).
    b = make_paged_batch(q_lens=[1, 3], seq_lens=[200, 150], block_size=64, head_size=16, group=2)
    first = b["block_table"][0, 0].item()
    b["kv"][first, :, :, :] = float("nan")  # positions 0..63 of sequence 0: outside the window
    out = run_batch(b, "triton", sliding_window=40)
    ref = batch_oracle(b, sliding_window=40)[0]
    assert_rows_close(out, ref, torch.float32)


def test_split_kv_with_lse_and_sinks(triton_device: str) -> None:
    b = make_paged_batch(q_lens=[1, 1, 0, 2], seq_lens=[150, 9, 0, 90], head_size=16, group=2)
    sinks = torch.randn(b["q"].shape[1])
    for splits in (3, 8):
        out, lse = run_batch(
            b, "triton", num_splits=splits, return_lse=True, sinks=sinks.to(DEVICE)
        )
        ref, ref_lse = batch_oracle(b, sinks=sinks)
        assert_rows_close(out, ref, torch.float32)
        assert_lse_close(lse, ref_lse)


def test_empty_rows_and_padding_rows(triton_device: str) -> None:
    # An empty sequence (no query, no keys) in the batch; rows past qsl[-1] stay untouched.
    b = make_paged_batch(q_lens=[0, 2], seq_lens=[0, 5], head_size=16)
    extra = torch.full((3, *b["q"].shape[1:]), 7.0, dtype=b["q"].dtype, device=DEVICE)
    b["q"] = torch.cat([b["q"], extra])
    out = torch.full((b["q"].shape[0], b["q"].shape[1], 16), 5.0, device=DEVICE)
    res, _lse = run_batch(b, "triton", out=out, return_lse=True)
    assert res is out
    assert torch.all(out[2:] == 5.0)
    assert_rows_close(out[:2], batch_oracle(b)[0][:2], torch.float32)


def test_sink_outweighs_a_single_key(triton_device: str) -> None:
    # one key and a large sink: the sink takes most of the denominator, the lse includes it
    b = make_paged_batch(q_lens=[1], seq_lens=[1], head_size=16)
    sinks = torch.full((b["q"].shape[1],), 3.0, device=DEVICE)
    out, lse = run_batch(b, "triton", sinks=sinks, return_lse=True)
    ref, ref_lse = batch_oracle(b, sinks=sinks)
    assert_rows_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


def test_merge_attn_states_cascade(triton_device: str) -> None:
    """Attention over a shared prefix and a suffix, merged, equals attention over both."""
    b = make_paged_batch(q_lens=[3, 2], seq_lens=[64, 48], head_size=16, group=2, block_size=16)
    table = b["block_table"]
    full, full_lse = run_batch(b, "reference", causal=False, return_lse=True)
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


def _cascade(
    q_lens: list[int],
    prefix: int,
    block_size: int,
    impl: str,
    *,
    dtype: torch.dtype = torch.float32,
    head_size: int = 16,
    group: int = 2,
) -> int:
    """Cascade attention as vLLM and FlashInfer run it: requests share the pages of a common
    prefix; one non-causal pass puts every query of the batch against the prefix (more queries
    than prefix keys), a causal pass puts each request against its own suffix, and
    ``merge_attn_states`` joins them. The result is causal attention over prefix + suffix, held
    to the float64 oracle over the dense K/V. Returns the sm_90 Gluon prefill's launches in the
    prefix pass."""
    suffixes = [q + 3 * i for i, q in enumerate(q_lens)]  # each suffix holds its new tokens
    b = make_paged_batch(
        q_lens=q_lens,
        seq_lens=[prefix + s for s in suffixes],
        head_size=head_size,
        group=group,
        block_size=block_size,
        dtype=dtype,
        seed=5,
    )
    n_pre = prefix // block_size
    table = b["block_table"].clone()
    table[1:, :n_pre] = table[0, :n_pre]  # every request reads request 0's prefix pages
    ks = [torch.cat([b["ks"][0][:, :prefix], k[:, prefix:]], 1) for k in b["ks"]]  # [H, L, D]
    vs = [torch.cat([b["vs"][0][:, :prefix], v[:, prefix:]], 1) for v in b["vs"]]
    total = sum(q_lens)
    dev = b["q"].device
    common = (b["q"], b["kv"], b["layout"])
    with counting_gluon_launches("prefill") as gluon:
        pre_out, pre_lse = paged_attention(
            *common,
            table[:1, :n_pre].contiguous(),  # one row: the shared prefix
            torch.tensor([prefix], dtype=torch.int32, device=dev),
            torch.tensor([0, total], dtype=torch.int32, device=dev),
            total,
            causal=False,
            return_lse=True,
            impl=impl,
        )
        launches = len(gluon)
    suf_table = torch.full_like(table, -1)
    suf_table[:, : table.shape[1] - n_pre] = table[:, n_pre:]
    suf_out, suf_lse = paged_attention(
        *common,
        suf_table,
        torch.tensor(suffixes, dtype=torch.int32, device=dev),
        b["qsl"],
        b["max_query_len"],
        causal=True,
        return_lse=True,
        impl=impl,
    )
    out, lse = merge_attn_states(pre_out, pre_lse, suf_out, suf_lse, impl=impl)
    ref, ref_lse = attention_oracle(
        b["q"].cpu(),
        [k.transpose(0, 1) for k in ks],  # [L, H, D]
        [v.transpose(0, 1) for v in vs],
        q_lens,
        causal=True,
    )
    assert_rows_close(out, ref, dtype)
    if dtype == torch.float32:
        assert_lse_close(lse, ref_lse)
    return launches


@pytest.mark.parametrize(
    ("q_lens", "prefix", "block_size"),
    [
        ([20, 1, 9], 16, 16),  # 30 queries over a 16-token prefix: the prefill class
        ([1, 1, 2, 1], 4, 4),  # 5 queries over a 4-token prefix: the decode class
    ],
)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_cascade_shared_prefix(
    q_lens: list[int], prefix: int, block_size: int, impl: str, request: pytest.FixtureRequest
) -> None:
    """A cascade (prefix pass + suffix pass + merge) against the dense oracle (see
    :func:`_cascade`); the prefix pass used to be refused as ``query_len > seq_len``."""
    if impl == "triton":
        request.getfixturevalue("triton_device")
    _cascade(q_lens, prefix, block_size, impl)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("q_lens", "prefix", "block_size", "group"),
    [
        ([200, 1, 90], 128, 16, 4),  # 291 queries over 128 prefix keys, gathered tiles
        ([300, 5, 77], 128, 128, 8),  # whole 128-token pages: TMA tiles
        ([64, 64], 0, 16, 4),  # an empty prefix: rows that see no key, lse -inf
    ],
)
def test_cascade_shared_prefix_sm90_prefill(
    q_lens: list[int], prefix: int, block_size: int, group: int
) -> None:
    """The same cascade in bf16 at heads 128: on sm_90 the prefix pass runs the Gluon prefill
    (7 of 7 cascade cases passed on an H100, triton 3.6; the script it came from on an H200)."""
    launches = _cascade(
        q_lens, prefix, block_size, "triton", dtype=torch.bfloat16, head_size=128, group=group
    )
    if torch.cuda.get_device_capability() == (9, 0):
        assert launches == 1


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
    big = make_paged_batch(
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
        o_big = run_batch(big, "triton", num_splits=splits)
        o_alone = run_batch(alone, "triton", num_splits=splits)
        assert torch.equal(o_big[41:42], o_alone), f"num_splits={splits}: batch changed the bits"


# ------------------------------------------------------------------------------------------
# fp8 per-tensor scales (reference)
# ------------------------------------------------------------------------------------------


def test_fp8_reference_dequantizes_per_head() -> None:
    """fp8 per-tensor / per-head scales on the reference path (the kernel's fp8 path is GPU-tested)."""
    b = make_paged_batch(q_lens=[2, 1], seq_lens=[20, 9], head_size=16, group=2, device="cpu")
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
    assert_rows_close(got, batch_oracle(deq)[0], torch.float32)


def test_launch_memo_keeps_configs_and_sees_a_patched_select_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher keeps its tile configs and constexprs per set of static properties (host
    time a call), and a test or sweep that patches ``select_config`` / ``kernel_constexprs`` in
    the launcher's module still gets its own."""
    from kv_kernels.paged_attention import triton as pa

    q = torch.zeros(3, 8, 64)
    kv = torch.zeros(4, 2, 16, 128)
    first, second = pa._configs(q, kv, 64, 16, False), pa._configs(q, kv, 64, 16, False)
    assert first[0] is second[0] and first[1] is second[1]
    sentinel = dataclasses.replace(first[0], tile_n=16)
    monkeypatch.setattr(pa, "select_config", lambda kind, **kw: sentinel)
    assert pa._configs(q, kv, 64, 16, False)[:2] == (sentinel, sentinel)
    features = dict(
        head_size=64, head_size_v=64, block_size=16, group=4, causal=True, sliding_window=False,
        sinks=False, softcap=False, alibi=False, kv_scale_mode=0, split=False, write_lse=False,
        dot_ieee=True, check=False,
    )  # fmt: skip
    want = pa._constexprs(first[0], "decode", **features)
    assert pa._constexprs(first[0], "decode", **features) is want
    monkeypatch.setattr(pa, "kernel_constexprs", lambda cfg, kind, **kw: {"PATCHED": 1})
    assert pa._constexprs(first[0], "decode", **features) == {"PATCHED": 1}
