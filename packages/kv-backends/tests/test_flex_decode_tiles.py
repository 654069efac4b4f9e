"""FLEX_ATTENTION's decode-call KV tiles (builder option ``decode_tiles``, issue 11).

A Flex KV tile is a contiguous run of the K/V view; a tile wider than a page holds other
requests' pages, which the kernel loads and masks away. ``decode_tiles="auto"`` gives the decode
call one-page tiles (whole pages full where the decoding kernel runs one split), ``"kv"`` keeps
the layer's tiles. Options and block masks are data: the CUDA choices are checked without a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends.flex import decode as flex_decode
from kv_backends.testing import make_paged_batch, oracle_attention

TOL = {"atol": 2e-5, "rtol": 1e-4}
CUDA = torch.device("cuda")


def _decode_batch(**kw):
    return make_paged_batch(
        query_lens=[1] * 6,
        seq_lens=[64, 33, 100, 16, 80, 47],
        num_q_heads=8,
        num_kv_heads=2,
        seed=5,
        **kw,
    )


def _tiles_read(bm) -> int:
    """KV tokens the decode call's tiles cover (partial + full)."""
    n = int(bm.kv_num_blocks.sum())
    if bm.full_kv_num_blocks is not None:
        n += int(bm.full_kv_num_blocks.sum())
    return n * bm.BLOCK_SIZE[1]


@pytest.mark.parametrize("decode_tiles", ["auto", "kv"])
def test_decode_tiles_read_only_the_requests_pages(decode_tiles: str) -> None:
    b = _decode_batch(num_blocks=128)  # shuffled pages of 16 spread over the cache
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(
        b.config, b.layout, static_shapes=True, max_num_seqs=8, decode_tiles=decode_tiles
    )
    assert builder.options.kv_block_size == 64  # the default at pages of 16
    md = builder.build(b.common)
    dec = md.decode
    assert dec is not None
    pages = sum(-(-s // 16) for s in [64, 33, 100, 16, 80, 47])
    if decode_tiles == "auto":
        assert dec.kv_block_size == dec.block_mask.BLOCK_SIZE[1] == 16
        assert _tiles_read(dec.block_mask) == pages * 16  # each page once, nothing else
        # Whole pages are full tiles (no mask mod); only the partial last pages are not.
        assert int(dec.block_mask.kv_num_blocks.sum()) == 3  # lengths 33, 100, 47
    else:
        assert dec.kv_block_size == dec.block_mask.BLOCK_SIZE[1] == 64
        assert _tiles_read(dec.block_mask) > 2 * pages * 16  # foreign pages in every tile
    opts = backend.make_impl(b.config, b.layout)._kernel_options(md, CUDA, decode=True)
    assert opts is not None and opts["BLOCK_N"] == (16 if decode_tiles == "auto" else 64)
    # The flattened call keeps the layer's tiles.
    assert backend.make_impl(b.config, b.layout)._kernel_options(md, CUDA)["BLOCK_N"] == 64
    out = backend.make_impl(b.config, b.layout).forward(None, b.q, b.kv_cache, md)
    torch.testing.assert_close(out.double(), oracle_attention(b), **TOL)


@pytest.mark.parametrize(("rows", "split", "full"), [(8, 1, True), (4, 2, False), (1, 8, False)])
def test_full_tiles_only_where_the_decoding_kernel_runs_one_split(
    monkeypatch: pytest.MonkeyPatch, rows: int, split: int, full: bool
) -> None:
    # With full tiles, torch's decoding template sizes each split from the whole K/V view, so
    # one split would do every full tile: below one split per (request, KV head) every tile is
    # partial and the split count is pinned to the one assumed.
    b = _decode_batch()
    builder = get_backend("FLEX_ATTENTION").make_builder(
        b.config, b.layout, static_shapes=True, max_num_seqs=8
    )
    monkeypatch.setattr(flex_decode, "decode_split_kv", lambda dev, r, h: 8 // r)
    assert flex_decode._decode_tiles(builder, CUDA, rows) == (16, full, split)
    # The CPU (C++ template, no split) and decode_tiles="kv" keep their rules.
    assert flex_decode._decode_tiles(builder, torch.device("cpu"), rows) == (16, True, None)
    builder.decode_tiles = "kv"
    assert flex_decode._decode_tiles(builder, CUDA, rows) == (64, False, None)


def test_decode_call_pins_the_split_and_merges_tuning_options() -> None:
    b = _decode_batch()
    backend = get_backend("FLEX_ATTENTION")
    md = backend.make_builder(b.config, b.layout, static_shapes=True, max_num_seqs=8).build(
        b.common
    )
    md = dataclasses.replace(md, decode=dataclasses.replace(md.decode, split_kv=2))
    # by default the decoding kernel runs 3 stages (torch's sm_90 default is 1: H200, decode
    # 64 x 4k page 16, 2.22 -> 4.04 TB/s); tuning options override it
    default = backend.make_impl(b.config, b.layout)._kernel_options(md, CUDA, decode=True)
    assert default["num_stages"] == 3 and default["SPLIT_KV"] == 2
    impl = backend.make_impl(b.config, b.layout, decode_kernel_options={"num_stages": 4})
    opts = impl._kernel_options(md, CUDA, decode=True)
    assert opts["SPLIT_KV"] == 2 and opts["num_stages"] == 4 and opts["BLOCK_N"] == 16
    flat = impl._kernel_options(md, CUDA)
    assert "SPLIT_KV" not in flat and "num_stages" not in flat


def test_batch_invariant_decode_tiles_are_the_layers() -> None:
    # Batch invariance needs kv_block_size <= n, so the decode call keeps the layer's tiles and
    # the trainer's options (test_flex_trainer checks them equal); tuning options are refused.
    b = make_paged_batch(query_lens=[1, 1], seq_lens=[40, 70], batch_invariant=True)
    backend = get_backend("FLEX_ATTENTION")
    md = backend.make_builder(b.config, b.layout).build(b.common)
    assert md.decode is not None
    assert md.decode.kv_block_size == md.options.kv_block_size == 16
    assert md.decode.split_kv is None
    with pytest.raises(ValueError, match="decode_kernel_options"):
        backend.make_impl(b.config, b.layout, decode_kernel_options={"num_stages": 3})
    # nor does the default stage count reach it: the trainer's call has torch's defaults
    opts = backend.make_impl(b.config, b.layout)._kernel_options(md, CUDA, decode=True)
    assert "num_stages" not in opts


def test_decode_tiles_option_is_validated() -> None:
    b = _decode_batch()
    with pytest.raises(ValueError, match="decode_tiles"):
        get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout, decode_tiles="page")


@pytest.mark.parametrize(
    ("sms", "rows", "heads", "split"),
    [(132, 64, 8, 1), (132, 32, 8, 1), (132, 16, 8, 8), (132, 8, 8, 16), (132, 8, 4, 32),
     (132, 1, 8, 128), (16, 1, 1, 128), (16, 16, 1, 8), (16, 2, 1, 64)],
)  # fmt: skip
def test_decode_split_kv_keeps_one_split_and_otherwise_fills_the_sms(
    monkeypatch: pytest.MonkeyPatch, sms: int, rows: int, heads: int, split: int
) -> None:
    # One split per program where torch's rule gives 1 (whole pages stay full tiles); below
    # that, the largest power of two giving at most 8 programs an SM (one-page tiles keep little
    # in flight), never below torch's own count.
    monkeypatch.setattr(flex_decode, "_num_sms", lambda index: sms)
    got = flex_decode.decode_split_kv(torch.device("cuda", 0), rows, heads)
    assert got == split
    torch_split = max(sms // (rows * heads) * 2, 1)
    assert (
        got == torch_split or torch_split < got * rows * heads <= 8 * sms < 2 * got * rows * heads
    )
