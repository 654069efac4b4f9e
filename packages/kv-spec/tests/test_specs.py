from __future__ import annotations

import dataclasses

import pytest
from kv_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
    merge_specs,
)
from kv_spec.specs import AttentionSpec


def full(**kw: object) -> FullAttentionSpec:
    args: dict[str, object] = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    args.update(kw)
    return FullAttentionSpec(**args)  # type: ignore[arg-type]


def test_page_size_of_llama3_layer_by_hand() -> None:
    s = full()
    # 16 tokens * 8 heads * (128 K + 128 V) * 2 bytes
    assert s.real_page_size_bytes == 16 * 8 * 256 * 2 == 65536
    assert s.page_size_bytes == 65536
    assert s.bytes_per_token == 4096
    assert s.head_size_v == 128  # defaults to head_size


def test_diffkv_page_counts_k_and_v_separately() -> None:
    s = full(head_size=192, head_size_v=128, num_kv_heads=4)
    assert s.content_size == 320
    assert s.real_page_size_bytes == 16 * 4 * (192 + 128) * 2 == 40960


def test_mla_stores_one_latent_without_doubling() -> None:
    s = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert s.real_page_size_bytes == 64 * 576 * 2 == 73728
    with pytest.raises(ValueError, match=r"MLAAttentionSpec.head_size_v=512 is not allowed"):
        MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, head_size_v=512)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 must be 1"):
        MLAAttentionSpec(block_size=64, num_kv_heads=2, head_size=576)


def test_per_token_head_quant_counts_scale_bytes() -> None:
    s = full(dtype="int8", kv_quant="int8_per_token_head")
    # 16*8*(256 one-byte values) + 16*8*2 float32 scales
    assert s.real_page_size_bytes == 16 * 8 * 256 + 16 * 8 * 2 * 4 == 33792
    mla = MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=576,
        dtype="fp8_e4m3",
        kv_quant="fp8_per_token_head",
    )
    assert mla.real_page_size_bytes == 16 * 576 + 16 * 4
    pt = full(dtype="fp8_e4m3", kv_quant=KVQuantMode.FP8_PER_TENSOR)
    assert pt.real_page_size_bytes == 16 * 8 * 256  # per-tensor scales live outside the page


def test_quant_mode_and_dtype_must_agree() -> None:
    with pytest.raises(ValueError, match=r"dtype='bfloat16' cannot hold kv_quant='fp8_per_tensor'"):
        full(kv_quant="fp8_per_tensor")
    with pytest.raises(ValueError, match=r"dtype='fp8_e4m3' cannot hold kv_quant='none'"):
        full(dtype="fp8_e4m3")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, r"FullAttentionSpec.block_size=0 must be >= 1"),
        ("num_kv_heads", -2, r"FullAttentionSpec.num_kv_heads=-2 must be >= 1"),
        ("head_size", 64.0, r"FullAttentionSpec.head_size=64.0 must be an int >= 1; got float"),
        ("head_size_v", 0, r"FullAttentionSpec.head_size_v=0 must be >= 1"),
        ("dtype", "float64", r"FullAttentionSpec.dtype='float64' is not a known KV-cache dtype"),
        ("page_size_padded", 100, r"page_size_padded=100 is smaller than the real page size 65536"),
        (
            "page_size_padded",
            65537,
            r"page_size_padded=65537 must be a multiple of the bfloat16 element size",
        ),
        ("block_size", True, r"block_size=True must be an int"),
    ],
)
def test_constructors_reject_bad_fields_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        full(**{field: value})


def test_padding_changes_page_size_not_real_size() -> None:
    s = full(page_size_padded=70000)
    assert (s.real_page_size_bytes, s.page_size_bytes) == (65536, 70000)


def test_base_spec_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract base"):
        AttentionSpec(block_size=16, num_kv_heads=1, head_size=64)


def test_specs_are_frozen_and_keyword_only() -> None:
    s = full()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 8, 128)  # type: ignore[misc]


def test_full_attention_memory_is_whole_context() -> None:
    s = full()
    assert s.max_memory_usage_bytes(max_model_len=8192) == 512 * 65536
    assert s.max_memory_usage_bytes(max_model_len=8193) == 513 * 65536


def test_sliding_window_memory_is_window_plus_in_flight_plus_one_block() -> None:
    s = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=4096)
    # min(4096 - 1 + 2048, 32768) = 6143 tokens -> 384 blocks, +1 for a window off a block boundary
    assert s.max_memory_usage_bytes(max_model_len=32768, max_num_batched_tokens=2048) == 385 * 65536
    # a short context never needs more than the context itself (+1 block)
    assert (
        s.max_memory_usage_bytes(max_model_len=100, max_num_batched_tokens=2048) == (7 + 1) * 65536
    )


def test_chunked_local_memory() -> None:
    s = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, attention_chunk_size=8192
    )
    assert (
        s.max_memory_usage_bytes(max_model_len=100000, max_num_batched_tokens=1024)
        == (9216 // 16) * 65536
    )
    with pytest.raises(ValueError, match="attention_chunk_size=0 must be >= 1"):
        ChunkedLocalAttentionSpec(
            block_size=16, num_kv_heads=8, head_size=128, attention_chunk_size=0
        )


def test_cross_attention_allows_diff_v() -> None:
    s = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, head_size_v=32)
    assert s.content_size == 96


def test_merge_across_workers() -> None:
    a = full()
    assert merge_specs([a, full(), full()]) is a
    with pytest.raises(ValueError, match=r"worker 0 and worker 2 disagree on num_kv_heads: 8 vs 4"):
        merge_specs([a, full(), full(num_kv_heads=4)])
    with pytest.raises(ValueError, match="different kinds"):
        merge_specs(
            [a, SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=8)]
        )
    with pytest.raises(ValueError, match="at least one spec"):
        merge_specs([])


def test_with_block_size_recomputes_page() -> None:
    s = full(page_size_padded=70000).with_block_size(32)
    assert s.block_size == 32 and s.page_size_padded is None and s.page_size_bytes == 131072
