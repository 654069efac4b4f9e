from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_spec import (
    CATALOGUE,
    FullAttentionSpec,
    LayoutOrder,
    SlidingWindowSpec,
    get_model,
    merge_kv_cache_configs,
    plan_kv_cache,
    unify_page_sizes,
)

GiB = 2**30


def llama_specs(n: int = 4, **kw: object) -> dict[str, FullAttentionSpec]:
    args: dict[str, object] = dict(block_size=16, num_kv_heads=8, head_size=128)
    args.update(kw)
    return {f"l{i}": FullAttentionSpec(**args) for i in range(n)}  # type: ignore[arg-type]


def test_llama3_8b_by_hand() -> None:
    cfg = plan_kv_cache(
        get_model("Llama-3-8B").kv_specs(block_size=16), 40 * GiB, max_model_len=8192
    )
    # page = 16 tok * 8 heads * 256 * 2 B = 64 KiB; one block id = 32 layers * 64 KiB = 2 MiB
    assert cfg.page_size_bytes == 65536 and cfg.num_layer_slots == 32
    assert cfg.num_blocks == 40 * GiB // (2 * 2**20) == 20480
    assert len(cfg.groups) == 1 and len(cfg.groups[0].layer_names) == 32
    assert len(cfg.tensors) == 32 and all(t.size_bytes == 20480 * 65536 for t in cfg.tensors)
    assert cfg.blocks_per_request() == 8192 // 16
    # all blocks but the allocator's null block
    assert cfg.max_concurrency() == (20480 - 1) / 512


def test_llama3_70b_tp8_by_hand() -> None:
    specs = get_model("Llama-3-70B").kv_specs(block_size=16, tensor_parallel_size=8)
    spec = next(iter(specs.values()))
    assert spec.num_kv_heads == 1 and spec.page_size_bytes == 16 * 1 * 256 * 2 == 8192
    cfg = plan_kv_cache(specs, 10 * GiB)
    assert cfg.num_blocks == 10 * GiB // (8192 * 80) == 16384


def test_qwen3_32b_and_mistral() -> None:
    q = plan_kv_cache(get_model("Qwen3-32B").kv_specs(), 20 * GiB, max_model_len=40960)
    assert q.num_blocks == 20 * GiB // (65536 * 64) == 5120
    assert q.blocks_per_request() == 2560
    m = plan_kv_cache(
        get_model("Mistral-7B").kv_specs(),
        8 * GiB,
        max_model_len=32768,
        max_num_batched_tokens=2048,
    )
    assert m.groups[0].spec.kind == "sliding_window"
    assert m.num_blocks == 8 * GiB // (65536 * 32) == 4096
    # window 4096 - 1 + 2048 in flight = 6143 tokens -> 384 blocks + 1
    assert m.blocks_per_request() == 385


def test_gpt_oss_alternating_groups_share_slots() -> None:
    cfg = plan_kv_cache(
        get_model("gpt-oss-120b").kv_specs(),
        8 * GiB,
        max_model_len=131072,
        max_num_batched_tokens=8192,
    )
    assert [g.spec.kind for g in cfg.groups] == ["sliding_window", "full"]
    assert cfg.num_layer_slots == 18
    assert cfg.page_size_bytes == 16 * 8 * 128 * 2 == 32768
    assert cfg.num_blocks == 8 * GiB // (32768 * 18) == 14563
    # each tensor is shared by one sliding and one full layer
    assert cfg.tensors[0].shared_by == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    # full: 131072/16 = 8192 blocks; sliding: min(127 + 8192, 131072) -> 520 blocks + 1
    assert cfg.blocks_per_request() == 8192 + 521


def test_deepseek_v3_mla() -> None:
    cfg = plan_kv_cache(
        get_model("DeepSeek-V3").kv_specs(block_size=64), 30 * GiB, max_model_len=163840
    )
    assert cfg.page_size_bytes == 64 * 576 * 2 == 73728
    assert cfg.num_blocks == 30 * GiB // (73728 * 61) == 7162
    assert cfg.layout(0).is_mla and cfg.layout(0).content_size == 576


def test_mimo_v2_flash_unifies_by_growing_the_full_groups_block() -> None:
    cfg = plan_kv_cache(get_model("MiMo-V2-Flash").kv_specs(block_size=16), 60 * GiB)
    kinds = [
        (g.spec.kind, g.spec.block_size, g.spec.num_kv_heads, len(g.layer_names))
        for g in cfg.groups
    ]
    # SWA page: 16*8*(192+128)*2 = 81920; full page (4 heads) is 40960 -> block 16 grows to 32
    assert kinds == [("full", 32, 4, 9)] + [("sliding_window", 16, 8, 9)] * 4 + [
        ("sliding_window", 16, 8, 3)
    ]
    assert cfg.page_size_bytes == 81920 and cfg.num_layer_slots == 9
    assert cfg.num_blocks == 60 * GiB // (81920 * 9)
    assert all(g.spec.page_size_bytes == g.spec.real_page_size_bytes for g in cfg.groups)


def test_unify_pads_when_no_integer_factor_and_errors_without_padding() -> None:
    a = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)  # 65536
    b = SlidingWindowSpec(block_size=16, num_kv_heads=3, head_size=128, sliding_window=64)  # 24576
    out = unify_page_sizes([a, b])
    assert (
        out[1].page_size_bytes == 65536
        and out[1].block_size == 16
        and out[1].page_size_padded == 65536
    )
    with pytest.raises(
        ValueError,
        match=r"24576-byte page and the largest page is 65536 bytes, which is not an integer multiple",
    ):
        unify_page_sizes([a, b], allow_padding=False)
    with pytest.raises(ValueError, match="which layout LHBNC cannot express"):
        plan_kv_cache({"a": a, "b": b}, GiB, layout_order="LHBNC")


def test_refuses_budget_too_small_for_one_request() -> None:
    # exactly enough: 1 GiB / 2 MiB per block id = 512 blocks = 8192 tokens, one of them the
    # allocator's null block, so 511 blocks (8176 tokens) for a request
    assert (
        plan_kv_cache(get_model("Llama-3-8B").kv_specs(), GiB, max_model_len=8176).num_blocks == 512
    )
    with pytest.raises(
        ValueError,
        match=r"one request of max_model_len=8177 needs 512 blocks besides the allocator's null "
        r"block; give at least 1075838976 bytes",
    ):
        plan_kv_cache(get_model("Llama-3-8B").kv_specs(), GiB, max_model_len=8177)
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_cache(llama_specs(), 1000)
    with pytest.raises(ValueError, match="available_bytes=-1 must be >= 0"):
        plan_kv_cache(llama_specs(), -1)
    with pytest.raises(ValueError, match="at least one layer spec"):
        plan_kv_cache({}, GiB)


def test_cross_layer_order_allocates_one_slab() -> None:
    cfg = plan_kv_cache(llama_specs(4), 64 * 2**20, layout_order=LayoutOrder.BLNHC)
    assert len(cfg.tensors) == 1 and cfg.tensors[0].layer_slot is None
    assert cfg.tensors[0].size_bytes == cfg.num_blocks * 65536 * 4 == cfg.layout(0).total_bytes
    assert cfg.layer_slot("l2") == 2


def test_merge_takes_min_blocks_across_workers() -> None:
    a = plan_kv_cache(llama_specs(), 64 * 2**20)
    b = plan_kv_cache(llama_specs(), 40 * 2**20)
    m = merge_kv_cache_configs([a, b])
    assert m.num_blocks == b.num_blocks == 160
    assert all(t.size_bytes == 160 * 65536 for t in m.tensors)
    c = plan_kv_cache(llama_specs(num_kv_heads=4), 64 * 2**20)
    with pytest.raises(ValueError, match="worker 1's KV-cache config differs"):
        merge_kv_cache_configs([a, c])


@settings(max_examples=60, deadline=None)
@given(
    model=st.sampled_from(sorted(CATALOGUE)),
    block=st.sampled_from([1, 16, 64, 256]),
    budget=st.integers(1, 2**40),
    order=st.sampled_from(list(LayoutOrder)),
)
def test_page_bytes_times_blocks_never_exceed_budget(
    model: str, block: int, budget: int, order: LayoutOrder
) -> None:
    specs = get_model(model).kv_specs(block_size=block)
    try:
        cfg = plan_kv_cache(specs, budget, layout_order=order)
    except ValueError as e:
        assert "holds no block" in str(e)
        return
    assert cfg.total_bytes <= budget
    assert cfg.num_blocks * cfg.page_size_bytes * cfg.num_layer_slots <= budget
    # and it leaves no whole block id unused
    assert (cfg.num_blocks + 1) * cfg.page_size_bytes * cfg.num_layer_slots > budget
    assert sum(len(g.layer_names) for g in cfg.groups) == len(specs)
    assert all(g.spec.page_size_bytes == cfg.page_size_bytes for g in cfg.groups)


def test_catalogue_sink_layers() -> None:
    gpt = get_model("gpt-oss-120b")
    assert all(gpt.layer_has_sinks(i) for i in range(gpt.num_layers))
    mimo = get_model("MiMo-V2-Flash")
    assert [i for i in range(48) if not mimo.layer_has_sinks(i)] == [
        0,
        5,
        11,
        17,
        23,
        29,
        35,
        41,
        47,
    ]
    assert not get_model("Llama-3-8B").layer_has_sinks(0)


def test_scale_plane_reaches_the_per_token_head_groups_layouts() -> None:
    """``plan_kv_cache(scale_plane=True)``: per-token-head groups get plane layouts (same page
    bytes, rows of K + V), other groups keep theirs; refused with no per-token-head layer, with an
    order that interleaves pages, and across workers that disagree."""
    pth = llama_specs(2, dtype="int8", kv_quant="int8_per_token_head")
    mixed = {**pth, "full": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)}
    cfg = plan_kv_cache(mixed, 64 * 2**20, scale_plane=True)
    kinds = {g.spec.kv_quant.value: cfg.layout(g.group_id) for g in cfg.groups}
    plane, plain = kinds["int8_per_token_head"], kinds["none"]
    assert plane.scale_placement == "plane" and plane.content_size == 256
    assert plane.page_bytes == cfg.page_size_bytes and plain.scale_plane is False
    inline = plan_kv_cache(mixed, 64 * 2**20, scale_plane=False)
    assert inline.layout(0).scale_placement == "inline" and inline.scale_plane is False
    with pytest.raises(ValueError, match="scale_plane=True but no layer stores per-token-head"):
        plan_kv_cache(llama_specs(), 64 * 2**20, scale_plane=True)
    with pytest.raises(ValueError, match=r"plan_kv_cache\.scale_plane=1 must be a bool"):
        plan_kv_cache(pth, 64 * 2**20, scale_plane=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page-contiguous order"):
        plan_kv_cache(pth, 64 * 2**20, scale_plane=True, layout_order="LHBNC")
    with pytest.raises(ValueError, match="layout order or scale plane"):
        merge_kv_cache_configs(
            [plan_kv_cache(pth, 2**24), plan_kv_cache(pth, 2**24, scale_plane=False)]
        )


def test_scale_plane_by_default_where_the_layout_takes_one() -> None:
    """No ``scale_plane`` argument: per-token-head groups get a plane wherever every such group's
    layout can take one (the same layout as asking for it), inline where one cannot (an order
    that interleaves pages, page data off 16 bytes), and configs without per-token-head scales
    record no plane."""
    pth = llama_specs(2, dtype="int8", kv_quant="int8_per_token_head")
    auto, asked = plan_kv_cache(pth, 2**24), plan_kv_cache(pth, 2**24, scale_plane=True)
    assert auto.scale_plane is True and auto.layout(0) == asked.layout(0)
    assert auto.layout(0).scale_placement == "plane"
    interleaved = plan_kv_cache(pth, 2**24, layout_order="LHBNC")
    assert interleaved.scale_plane is False and interleaved.layout(0).scale_placement == "inline"
    # 1 token x 1 head x (3 + 2) bytes of data a page: no 16-byte-aligned plane after it
    odd = {"l0": FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=3, head_size_v=2,
                                   dtype="int8", kv_quant="int8_per_token_head")}  # fmt: skip
    assert plan_kv_cache(odd, 2**20).scale_plane is False
    with pytest.raises(ValueError, match="16"):
        plan_kv_cache(odd, 2**20, scale_plane=True)
    assert plan_kv_cache(llama_specs(), 2**26).scale_plane is False
