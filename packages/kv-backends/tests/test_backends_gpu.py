"""Every backend on the GPU against the float64 oracle, bf16 included: GQA, sliding window, sinks,
DiffKV 192/128, kernel blocks 16/64/128, and a cache of more than 2^31 elements.

Run on the GPU machine (see the package README for the command). FA4 tests need
``flash_attn.cute`` on the path (../shared/device/README.md) and skip without it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from kv_backends import Platform, get_backend, select_backend
from kv_backends.testing import (
    lowprec_reference,
    make_paged_batch,
    oracle_attention,
    run_backend,
)
from kv_kernels.testing import assert_close_to_oracle
from kv_spec import to_torch_dtype

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Tolerance: kv-kernels' per-row rule against the float64 oracle, err <= 2 * err_lowprec +
# atol(dtype) * max|oracle_row| (flash-attention's parity rule; err_lowprec is a plain torch run
# in the batch's dtype). A fixed atol = rtol = 2e-2 would pass a wrong page on long decodes,
# whose rows are ~0.01-0.02 in size (issue 10; see test_conformance's planted-page tests).
QUERY_LENS = [1, 1, 37, 1, 130, 0, 5]
SEQ_LENS = [200, 513, 37, 1000, 300, 17, 77]


def _has_fa4() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


def _skip_unless_usable(name: str, cfg) -> None:
    if name.startswith("FLASH_ATTN") and not _has_fa4():
        pytest.skip("flash_attn.cute (FA4) is not installed")
    reasons = get_backend(name).validate(cfg, Platform.detect())
    if reasons:
        pytest.skip(f"{name} cannot serve this config here: {reasons}")


def _check(out: torch.Tensor, b, dtype: str) -> None:
    t = b.common.num_actual_tokens
    assert b.q.dtype == to_torch_dtype(dtype)
    low = lowprec_reference(b)[:t] if dtype != "float32" else None
    assert_close_to_oracle(out[:t], oracle_attention(b)[:t], lowprec_reference=low)


CASES = {
    "gqa": {},
    "window": {"sliding_window": 128},
    "sinks_window": {"has_sinks": True, "sliding_window": 128},
    "softcap": {"softcap": 30.0},
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("feature", list(CASES))
@pytest.mark.parametrize("name", ["TORCH_SDPA", "TRITON", "FLEX_ATTENTION", "FLASH_ATTN"])
def test_backend_matches_oracle(name: str, feature: str, dtype: str) -> None:
    b = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        num_q_heads=16,
        num_kv_heads=4,
        head_size=128,
        dtype=dtype,
        device="cuda",
        **CASES[feature],
    )
    _skip_unless_usable(name, b.config)
    _check(run_backend(name, b), b, dtype)


@pytest.mark.parametrize(
    ("block_size", "kernel_block_size"), [(16, 16), (64, 64), (128, 128), (64, 16)]
)
@pytest.mark.parametrize("name", ["TRITON", "FLEX_ATTENTION", "FLASH_ATTN"])
def test_kernel_block_sizes(name: str, block_size: int, kernel_block_size: int) -> None:
    b = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=128,
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        dtype="bfloat16",
        device="cuda",
        sliding_window=200,
    )
    _skip_unless_usable(name, b.config)
    _check(run_backend(name, b), b, "bfloat16")


@pytest.mark.parametrize("kernel_block_size", [16, 64])
@pytest.mark.parametrize("name", ["FLASH_ATTN_DIFFKV", "TRITON", "FLEX_ATTENTION", "TORCH_SDPA"])
def test_diffkv_192_128(name: str, kernel_block_size: int) -> None:
    # MiMo-V2-Flash's sliding layers: 192/128 heads, sinks, window 128, on the packed layout.
    b = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        num_q_heads=16,
        num_kv_heads=2,
        head_size=192,
        head_size_v=128,
        block_size=64,
        kernel_block_size=kernel_block_size,
        dtype="bfloat16",
        device="cuda",
        has_sinks=True,
        sliding_window=128,
    )
    _skip_unless_usable(name, b.config)
    _check(run_backend(name, b), b, "bfloat16")


def test_diffkv_selected_automatically_and_impls_coexist() -> None:
    if not _has_fa4():
        pytest.skip("flash_attn.cute (FA4) is not installed")
    diff = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=192,
        head_size_v=128,
        dtype="bfloat16",
        device="cuda",
        seed=1,
    )
    same = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=128,
        dtype="bfloat16",
        device="cuda",
        seed=2,
    )
    sel_diff, sel_same = select_backend(diff.config), select_backend(same.config)
    assert sel_diff.name == "FLASH_ATTN_DIFFKV", str(sel_diff)
    assert sel_same.name == "FLASH_ATTN", str(sel_same)
    outs = {}
    for _ in range(2):  # interleave the two layers: per-layer head_size_v, nothing global
        outs["diff"] = run_backend(sel_diff.name, diff)
        outs["same"] = run_backend(sel_same.name, same)
    _check(outs["diff"], diff, "bfloat16")
    _check(outs["same"], same, "bfloat16")


@pytest.mark.parametrize("order", ["LBHNC", "BLNHC", "BLHNC"])
@pytest.mark.parametrize("name", ["TRITON", "FLASH_ATTN"])
def test_other_layout_orders(name: str, order: str) -> None:
    b = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=128,
        dtype="bfloat16",
        device="cuda",
        order=order,
        num_layers=2 if order[0] == "B" else 1,
        layer=1 if order[0] == "B" else 0,
    )
    _skip_unless_usable(name, b.config)
    _check(run_backend(name, b), b, "bfloat16")


@pytest.mark.parametrize("name", ["FLEX_ATTENTION", "TRITON", "FLASH_ATTN"])
def test_cache_over_2_31_elements(name: str) -> None:
    # 8 heads x (128 + 128) x 16 tokens = 32768 elements a block; 70000 blocks = 2.29e9 elements
    # (4.6 GB in bf16). The batch's blocks sit on both sides of element 2^31.
    free, _ = torch.cuda.mem_get_info()
    if free < 8 * 2**30:
        pytest.skip(f"needs ~8 GiB free GPU memory, have {free / 2**30:.1f}")
    num_blocks = 70000
    low = [3, 9, 100]
    high = [num_blocks - 1 - i * 7 for i in range(80)]
    seq_lens, query_lens = [300, 513, 40, 16], [1, 1, 40, 16]
    need = sum(-(-s // 16) for s in seq_lens)
    blocks = (high[:40] + low + high[40:])[:need]
    b = make_paged_batch(
        query_lens=query_lens,
        seq_lens=seq_lens,
        num_q_heads=16,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        device="cuda",
        num_blocks=num_blocks,
        blocks=blocks,
        has_sinks=True,
    )
    assert b.kv_cache.numel() > 2**31
    _skip_unless_usable(name, b.config)
    if name == "FLEX_ATTENTION":
        impl = get_backend(name).make_impl(b.config, b.layout, sinks=b.sinks)
        # prefill="paged": the view is cut into windows below 2^31 elements, at least two
        # touched here. The default ("auto": these 64-token tiles span pages of 16, so the
        # flattened call reads a gathered copy) gathers from past 2^31 into one window.
        for prefill, windows in (("paged", 2), ("auto", 1)):
            builder = get_backend(name).make_builder(
                b.config, b.layout, device="cuda", prefill=prefill
            )
            md = builder.build(b.common)
            assert len(md.windows) >= windows and all(w.base_token >= 0 for w in md.windows)
            assert (prefill == "auto") == all(w.gather is not None for w in md.windows)
            _check(impl.forward(None, b.q, b.kv_cache, md), b, "bfloat16")
        return
    _check(run_backend(name, b), b, "bfloat16")


def test_flex_compiled_block_16_needs_no_user_options() -> None:
    b = make_paged_batch(
        query_lens=[1] * 32 + [64],
        seq_lens=[700] * 32 + [64],
        num_q_heads=8,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype="bfloat16",
        device="cuda",
    )
    out = run_backend("FLEX_ATTENTION", b, builder_options={"kv_block_size": 16})
    _check(out, b, "bfloat16")


def test_cache_update_on_gpu() -> None:
    b = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=192,
        head_size_v=128,
        dtype="bfloat16",
        device="cuda",
        fill=False,
    )
    ref = torch.zeros_like(b.kv_cache)
    get_backend("TORCH_SDPA").make_impl(b.config, b.layout).do_kv_cache_update(
        None, b.key, b.value, ref, b.all_slots
    )
    for name in ("TRITON", "FLEX_ATTENTION"):
        cache = torch.zeros_like(b.kv_cache)
        get_backend(name).make_impl(b.config, b.layout).do_kv_cache_update(
            None, b.key, b.value, cache, b.all_slots
        )
        torch.testing.assert_close(cache, ref, atol=0, rtol=0)
