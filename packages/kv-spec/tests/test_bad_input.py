"""Bad input to kv-spec's values: every case is a ValueError naming the field, never a silent
coercion or a raw IndexError / TypeError from inside; plus the one home of page arithmetic and
the manager -> kernel block rule."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_spec import (
    SPLITTABLE_ORDERS,
    FullAttentionSpec,
    KVCacheLayout,
    LayoutOrder,
    MLAAttentionSpec,
    content_size,
    expand_block_ids,
    kernel_blocks_per_block,
    plan_kv_cache,
    real_page_size_bytes,
)

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "60"))


def _layout_dict(**kw: object) -> dict[str, object]:
    d: dict[str, object] = dict(
        order="LBNHC", num_layers=2, num_blocks=8, num_kv_heads=2, block_size=16, head_size=8,
        head_size_v=8, dtype="float16",
    )  # fmt: skip
    d.update(kw)
    return d


@pytest.mark.parametrize("value", ["no", "false", 1, 0, None, 1.0])
def test_is_mla_must_be_a_real_bool(value: object) -> None:
    # "no" used to count as MLA (truthy); 1 == True but serialized as 1 -> another hash
    with pytest.raises(ValueError, match=r"is_mla=.* must be a bool"):
        KVCacheLayout.from_dict(_layout_dict(is_mla=value))


@pytest.mark.parametrize("text", ["[1, 2]", '"LBNHC"', "3", "null", "{not json"])
def test_from_json_rejects_non_objects(text: str) -> None:
    with pytest.raises(ValueError, match="JSON object|does not parse"):
        KVCacheLayout.from_json(text)


def test_from_json_rejects_non_text() -> None:
    with pytest.raises(ValueError, match="str or bytes"):
        KVCacheLayout.from_json(123)  # type: ignore[arg-type]


def test_round_trip_keeps_hash() -> None:
    lay = KVCacheLayout.from_dict(_layout_dict())
    again = KVCacheLayout.from_json(lay.to_json())
    assert again == lay and hash(again) == hash(lay)
    assert again.compatibility_hash() == lay.compatibility_hash()


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = [*list(_layout_dict()), "kv_quant", "is_mla", "page_size_bytes", "format"]


@settings(max_examples=EXAMPLES, deadline=None)
@given(field=st.sampled_from(_FIELDS), value=_json_values)
def test_fuzz_one_field_gives_value_error_or_a_valid_layout(field: str, value: object) -> None:
    """Any JSON value in any field: a valid layout or a ValueError with a message, nothing else."""
    try:
        lay = KVCacheLayout.from_dict(_layout_dict(**{field: value}))
    except ValueError as e:
        assert str(e)
        return
    assert KVCacheLayout.from_json(lay.to_json()) == lay


def test_config_layout_group_out_of_range() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64)
    config = plan_kv_cache({"l0": spec}, available_bytes=2**24, max_model_len=256)
    assert config.layout(0).block_size == 16
    with pytest.raises(ValueError, match=r"group_id=5 is out of range.*1 KV-cache group"):
        config.layout(5)
    with pytest.raises(ValueError, match="group_id=-1"):
        config.layout(-1)
    with pytest.raises(ValueError, match="must be an int"):
        config.layout("0")  # type: ignore[arg-type]


# ---- one home of the arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, head_size_v=64),
        FullAttentionSpec(
            block_size=16,
            num_kv_heads=8,
            head_size=128,
            dtype="int8",
            kv_quant="int8_per_token_head",
        ),
        MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576),
        MLAAttentionSpec(
            block_size=64,
            num_kv_heads=1,
            head_size=576,
            dtype="fp8_e4m3",
            kv_quant="fp8_per_token_head",
        ),
    ],
)
def test_spec_and_layout_agree_with_the_page_functions(spec) -> None:
    lay = KVCacheLayout.from_spec(spec, num_blocks=4)
    is_mla = isinstance(spec, MLAAttentionSpec)
    args = dict(
        head_size=spec.head_size,
        head_size_v=0 if is_mla else spec.v_size,
        kv_quant=spec.kv_quant,
        is_mla=is_mla,
        dtype=spec.dtype,
    )
    c = content_size(**args)  # type: ignore[arg-type]
    page = real_page_size_bytes(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, **args)  # type: ignore[arg-type]
    assert spec.content_size == lay.content_size == c
    assert spec.real_page_size_bytes == lay.real_page_size_bytes == page
    # by hand: 128 + 64 = 192 bf16 elements x 8 heads x 16 tokens x 2 bytes
    if spec.head_size == 128 and spec.kv_quant.value == "none":
        assert page == 16 * 8 * 192 * 2


def test_kernel_block_rule() -> None:
    assert kernel_blocks_per_block(64, 16) == 4
    with pytest.raises(ValueError, match="must divide block_size=64"):
        kernel_blocks_per_block(64, 24)
    assert expand_block_ids([2, -1, 0], 32, 16) == [4, 5, -1, -1, 0, 1]
    assert {o.value for o in LayoutOrder if o.splits_into_kernel_blocks} == set(SPLITTABLE_ORDERS)
    lay = KVCacheLayout.from_dict(_layout_dict(block_size=64))
    kl = lay.kernel_block_layout(16)
    assert (kl.num_blocks, kl.block_size) == (32, 16)
    assert kl.byte_strides[1] * 4 == lay.byte_strides[1]  # kernel block stride = block stride / k
    assert kl.strides[3] == lay.strides[3]  # same token stride: one view, no copy
    assert lay.kernel_block_layout(64) == lay
    for order in ("LBHNC", "BLNHC"):
        other = KVCacheLayout.from_dict(_layout_dict(block_size=64, order=order))
        assert other.kernel_block_problem(16) is not None
        with pytest.raises(ValueError, match="needs order LBNHC or LHBNC"):
            other.kernel_block_layout(16)
    padded = KVCacheLayout.from_dict(
        _layout_dict(block_size=64, page_size_bytes=lay.page_bytes + 64)
    )
    with pytest.raises(ValueError, match="unpadded pages"):
        padded.kernel_block_layout(16)
    assert json.loads(kl.to_json())["block_size"] == 16
