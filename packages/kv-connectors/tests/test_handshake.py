"""Handshake: KVTransferParams round trip and hash check; exact conversions (orders, block sizes,
TP head splits) checked byte for byte against the logical content; refusals with reasons."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from kv_connectors import (
    HandshakeRefused,
    KVTransferParams,
    RegisteredKV,
    convert_rows,
    plan_conversion,
)
from kv_connectors.testing import block_bytes, make_layout, random_cache
from kv_spec import KVCacheLayout, LayoutOrder

ORDERS = [o.value for o in LayoutOrder]


def _rows(layout: KVCacheLayout, storage: object, ids: list[int]) -> torch.Tensor:
    kv = RegisteredKV(storage, layout)  # type: ignore[arg-type]
    rows = kv.new_rows(len(ids))
    kv.gather(ids, rows)
    return rows


def _apply(rows: torch.Tensor, layout: KVCacheLayout, ids: list[int]) -> object:
    storage = random_cache(layout, seed=99)
    RegisteredKV(storage, layout).scatter(rows, ids)  # type: ignore[arg-type]
    return storage


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(ORDERS, ORDERS)))
def test_order_conversion_is_exact(src: str, dst: str) -> None:
    a = make_layout(src, num_blocks=6, num_kv_heads=3)
    b = make_layout(dst, num_blocks=5, num_kv_heads=3, page_size_bytes=None)
    conv = plan_conversion(a, b)
    assert conv.identity == (src == dst)
    cache = random_cache(a, seed=1)
    out = _apply(convert_rows(_rows(a, cache, [4, 1]), conv), b, [0, 3])
    assert torch.equal(block_bytes(out, b, 0), block_bytes(cache, a, 4))
    assert torch.equal(block_bytes(out, b, 3), block_bytes(cache, a, 1))


def test_padded_page_to_unpadded_and_quantized_scales_move() -> None:
    a = make_layout("LBNHC", dtype="int8", kv_quant="int8_per_token_head")
    b = make_layout(
        "BLHNC", dtype="int8", kv_quant="int8_per_token_head", page_size_bytes=a.page_bytes + 32
    )
    cache = random_cache(a, seed=2)
    out = _apply(convert_rows(_rows(a, cache, [7]), plan_conversion(a, b)), b, [2])
    assert torch.equal(block_bytes(out, b, 2), block_bytes(cache, a, 7))  # scales are in C


@pytest.mark.parametrize(("bs_src", "bs_dst"), [(4, 8), (4, 16), (8, 4), (16, 4)])
def test_block_size_conversion(bs_src: int, bs_dst: int) -> None:
    a = make_layout("LBHNC", block_size=bs_src, num_blocks=8)
    b = make_layout("BLNHC", block_size=bs_dst, num_blocks=16)
    conv = plan_conversion(a, b)
    cache = random_cache(a, seed=3)
    src_ids = [5, 2, 7, 0]
    n_dst = conv.num_dst_blocks(len(src_ids))
    assert n_dst == len(src_ids) * bs_src // bs_dst
    out = _apply(convert_rows(_rows(a, cache, src_ids), conv), b, list(range(n_dst)))
    # tokens of the request in order: concat over blocks along N (dim 2 of [L, H, N, C])
    want = torch.cat([block_bytes(cache, a, i) for i in src_ids], dim=2)
    got = torch.cat([block_bytes(out, b, j) for j in range(n_dst)], dim=2)
    assert torch.equal(got, want)


def test_tp_split_takes_the_rank_heads() -> None:
    a = make_layout("LBNHC", num_kv_heads=4)  # producer TP 1
    cache = random_cache(a, seed=4)
    for rank in range(2):
        b = make_layout("LBHNC", num_kv_heads=2)
        conv = plan_conversion(a, b, src_tp=(0, 1), dst_tp=(rank, 2))
        out = _apply(convert_rows(_rows(a, cache, [3]), conv), b, [1])
        assert torch.equal(
            block_bytes(out, b, 1), block_bytes(cache, a, 3)[:, 2 * rank : 2 * rank + 2]
        )


def test_tp_gather_fills_heads_from_every_producer_rank() -> None:
    parts = [make_layout("LBNHC", num_kv_heads=2) for _ in range(2)]
    caches = [random_cache(p, seed=10 + i) for i, p in enumerate(parts)]
    b = make_layout("BLNHC", num_kv_heads=4)
    out_rows = torch.zeros(1, b.num_layers * b.page_bytes, dtype=torch.uint8)
    for rank in range(2):
        conv = plan_conversion(parts[rank], b, src_tp=(rank, 2), dst_tp=(0, 1))
        assert conv.sources_needed == 2
        convert_rows(_rows(parts[rank], caches[rank], [5]), conv, out=out_rows)
    out = _apply(out_rows, b, [0])
    want = torch.cat([block_bytes(c, p, 5) for c, p in zip(caches, parts, strict=True)], dim=1)
    assert torch.equal(block_bytes(out, b, 0), want)


def test_replicated_heads_read_from_the_owning_rank() -> None:
    a = make_layout("LBNHC", num_kv_heads=1)  # e.g. one latent or one kv head, TP 2 replicated
    b = make_layout("LBNHC", num_kv_heads=1)
    assert plan_conversion(a, b, src_tp=(1, 2), dst_tp=(3, 4)).src_heads == (0, 1)
    with pytest.raises(HandshakeRefused, match="reads producer rank 1"):
        plan_conversion(a, b, src_tp=(0, 2), dst_tp=(3, 4))


_PLANE_ORDERS = [o.value for o in LayoutOrder if o.page_contiguous]


def _pth(order: str, **kw: object) -> KVCacheLayout:
    """An int8 per-token-head layout with its scales in each page's plane."""
    return make_layout(
        order,
        dtype="int8",
        kv_quant="int8_per_token_head",
        scale_plane=True,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(_PLANE_ORDERS, _PLANE_ORDERS)))
def test_scale_planes_move_with_their_rows(src: str, dst: str) -> None:
    """Orders change, the planes' scales follow their tokens (``block_bytes`` gives each row's
    scales after its K and V, so a conversion that dropped or misplaced a plane fails here)."""
    a, b = _pth(src, num_blocks=6, num_kv_heads=3), _pth(dst, num_blocks=5, num_kv_heads=3)
    cache = random_cache(a, seed=5)
    out = _apply(convert_rows(_rows(a, cache, [4, 1]), plan_conversion(a, b)), b, [0, 3])
    assert torch.equal(block_bytes(out, b, 0), block_bytes(cache, a, 4))
    assert torch.equal(block_bytes(out, b, 3), block_bytes(cache, a, 1))


@pytest.mark.parametrize(("bs_src", "bs_dst"), [(4, 8), (8, 4)])
def test_scale_planes_merge_and_split_blocks_and_heads(bs_src: int, bs_dst: int) -> None:
    a = _pth("LBHNC", block_size=bs_src, num_blocks=8, num_kv_heads=4)
    cache = random_cache(a, seed=6)
    src_ids = [5, 2, 7, 0]
    want = torch.cat([block_bytes(cache, a, i) for i in src_ids], dim=2)
    for rank in range(2):  # TP 1 -> 2: each consumer rank takes its two heads
        b = _pth("BLNHC", block_size=bs_dst, num_blocks=16, num_kv_heads=2)
        conv = plan_conversion(a, b, src_tp=(0, 1), dst_tp=(rank, 2))
        n_dst = conv.num_dst_blocks(len(src_ids))
        out = _apply(convert_rows(_rows(a, cache, src_ids), conv), b, list(range(n_dst)))
        got = torch.cat([block_bytes(out, b, j) for j in range(n_dst)], dim=2)
        assert torch.equal(got, want[:, 2 * rank : 2 * rank + 2])


def test_scale_plane_and_inline_scales_do_not_convert() -> None:
    """The same bytes a token, placed differently: refused with the reason, not reshuffled."""
    inline = make_layout("LBNHC", dtype="int8", kv_quant="int8_per_token_head")
    with pytest.raises(HandshakeRefused, match="scale placement"):
        plan_conversion(_pth("LBNHC"), inline)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dtype": "bfloat16"}, "token content differs"),
        ({"head_size_v": 4}, "token content differs"),
        ({"num_layers": 3}, "layer slots"),
        ({"block_size": 6}, "do not divide"),
        ({"num_kv_heads": 3}, "producer heads"),
    ],
)
def test_refusals_give_a_reason(changes: dict[str, object], match: str) -> None:
    a = make_layout("LBNHC")
    with pytest.raises(HandshakeRefused, match=match):
        plan_conversion(a, make_layout("LBNHC", **changes))  # type: ignore[arg-type]


def test_params_json_round_trip_and_hash_check() -> None:
    lay = make_layout("BLNHC")
    p = KVTransferParams.for_layouts(
        [lay],
        request_id="r",
        engine_id="e",
        transport="p2p",
        host="127.0.0.1",
        port=1,
        block_ids=[3, 4],
    )
    q = KVTransferParams.from_json(p.to_json())
    assert q == p and q.layouts() == (lay,)
    forged = KVTransferParams(**{**p.to_dict(), "compatibility_hashes": ["0" * 32]})
    with pytest.raises(HandshakeRefused, match="declared"):
        forged.layouts()
    with pytest.raises(ValueError, match="tp_rank=2"):
        KVTransferParams(**{**p.to_dict(), "tp_rank": 2, "tp_size": 2})


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([3, -1, 4], r"block_ids\[1\]=-1 is out of range"),
        ([3, True], r"block_ids\[1\]=True is a bool"),
        ([3, 4.0], r"block_ids\[1\]=4.0 is a float"),
        ([3, "5"], r"block_ids\[1\]='5' is a str"),
    ],
)
def test_params_block_ids_errors_name_the_first_bad_id(ids: list[Any], message: str) -> None:
    """The one-pass check of plain ints (issue 30: the per-id check cost ~0.5 ms a request on
    the scheduler's thread) still names the first bad id, its value and the bound."""
    p = KVTransferParams.for_layouts(
        [make_layout("BLNHC")],
        request_id="r",
        engine_id="e",
        transport="p2p",
        host="127.0.0.1",
        port=1,
        block_ids=[0],
    )
    assert KVTransferParams(**{**p.to_dict(), "block_ids": list(range(512))}).block_ids[-1] == 511
    with pytest.raises(ValueError, match=message):
        KVTransferParams(**{**p.to_dict(), "block_ids": ids})


def test_sliced_params_name_the_run_and_keep_the_rest() -> None:
    lay = make_layout("BLNHC")
    params = KVTransferParams.for_layouts(
        [lay], request_id="r", engine_id="e", transport="p2p", host="h", port=9,
        block_ids=(4, 7, 1, 9),
    )  # fmt: skip
    cut = params.sliced(1, 3)
    assert cut.block_ids == (7, 1) and params.block_ids == (4, 7, 1, 9)
    assert cut.to_dict() == {**params.to_dict(), "block_ids": [7, 1]}


def test_plans_are_kept_per_producer_layout_and_per_registration() -> None:
    """A consumer keeps each producer layout's plan (or refusal) for the caches it registered.
    Planted: a bad layout after a good one is still refused (a memo keyed without the layouts
    would hand it the good plan), and after the caches are registered again with another layout
    the good params are refused too (a memo kept across registrations would not)."""
    from kv_connectors import P2pConfig, P2pConnector
    from kv_kernels import allocate_kv_cache

    lay = make_layout("BLNHC")
    other = make_layout("BLNHC", dtype="bfloat16")
    conn = P2pConnector(P2pConfig(role="consumer", timeout_s=5), block_size=lay.block_size)
    conn.register_kv_caches(allocate_kv_cache(lay, torch.device("cpu")), lay)

    def params(layout: KVCacheLayout, ids: tuple[int, ...]) -> KVTransferParams:
        return KVTransferParams.for_layouts(
            [layout], request_id="r", engine_id="e", transport="p2p", host="h", port=9,
            block_ids=ids,
        )  # fmt: skip

    good, bad = params(lay, (1, 2)), params(other, (1, 2))
    plan = conn._plan(good)
    assert plan.identity and plan.params is good
    again = params(lay, (5, 6, 7))
    assert conn._plan(again).params is again  # a kept plan carries each request's own ids
    reasons = []
    for _ in range(2):  # planned, then from the memo: the same reason
        with pytest.raises(HandshakeRefused) as refused:
            conn._plan(bad)
        reasons.append(refused.value.reason)
    assert reasons[0] and reasons[0] == reasons[1]
    conn.register_kv_caches(allocate_kv_cache(other, torch.device("cpu")), other)
    with pytest.raises(HandshakeRefused):
        conn._plan(good)
    assert conn._plan(bad).identity
    conn.close()
