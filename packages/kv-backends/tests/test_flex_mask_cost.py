"""What FLEX_ATTENTION's flattened call costs beside dense causal Flex on the same tokens (issue 11):
the tiles it lists (partial: mask mod evaluated; full: skipped) and the loads its mask mod does
per (query, key) pair. Counted on the CPU; the GPU timing is bench_flex.py's.

- A causal prefill whose tiles lie within pages (page 128, or the gathered buffer at page 16)
  lists exactly dense causal Flex's partial and full tiles.
- The mask mod loads per query row and per key column only (the span mask over the gathered
  buffer: per row only); the block-table mask (still used where the owner test is not exact: a
  block shared by two requests, batch invariance) loads one table entry per pair.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.testing import make_paged_batch, oracle_attention
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

TOL = {"atol": 2e-5, "rtol": 1e-4}


def _build(b: Any, **opts: Any) -> Any:
    backend = get_backend("FLEX_ATTENTION")
    return backend.make_builder(b.config, b.layout, static_shapes=True, **opts).build(b.common)


def _assert_oracle(b: Any, md: Any) -> None:
    """FLEX_ATTENTION's output over ``md`` equals the float64 oracle on the batch's tokens."""
    out = (
        get_backend("FLEX_ATTENTION")
        .make_impl(b.config, b.layout)
        .forward(None, b.q, b.kv_cache, md)
    )
    t = b.common.num_actual_tokens
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)


def _tiles(bm: Any) -> tuple[int, int]:
    full = 0 if bm.full_kv_num_blocks is None else int(bm.full_kv_num_blocks.sum())
    return int(bm.kv_num_blocks.sum()), full


class _PairLoads(TorchDispatchMode):
    """Counts the indexed loads (``aten.index``) a mask mod makes, and those with one element
    per (query, key) pair of the evaluated tile."""

    def __init__(self, pairs: int) -> None:
        super().__init__()
        self.pairs, self.loads, self.pair_loads = pairs, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index.Tensor:
            self.loads += 1
            self.pair_loads += int(out.numel() == self.pairs)
        return out


def _pair_loads(bm: Any, rows: int = 128, cols: int = 64) -> tuple[int, int]:
    """(indexed loads, loads with one element per pair) of the mask mod over a
    ``[rows, cols]`` tile, as Flex's kernels evaluate it: ``q_idx`` a column, ``kv_idx`` a row."""
    q_idx = torch.arange(rows, dtype=torch.int32)[:, None]
    kv_idx = torch.arange(cols, dtype=torch.int32)[None, :]
    zero = torch.zeros((), dtype=torch.int32)
    with _PairLoads(rows * cols) as mode:
        bm.mask_mod(zero, zero, q_idx, kv_idx)
    return mode.loads, mode.pair_loads


@pytest.mark.parametrize(
    ("page", "prefill"),
    [(128, "paged"), (64, "paged"), (16, "gather"), (128, "gather")],
)
def test_causal_prefill_lists_dense_causal_tiles(page: int, prefill: str) -> None:
    # The bench's prefill at CPU scale: 4 requests of 512 tokens on shuffled pages.
    r, s = 4, 512
    b = make_paged_batch(
        query_lens=[s] * r, seq_lens=[s] * r, block_size=page, num_q_heads=4, num_kv_heads=2
    )
    md = _build(b, prefill=prefill)
    (win,) = md.windows
    qbs, kvb = md.options.q_block_size, md.options.kv_block_size
    dense = create_block_mask(
        lambda b, h, q, k: k <= q, None, None, s, s, device="cpu", BLOCK_SIZE=(qbs, kvb)
    )
    partial, full = _tiles(dense)
    assert _tiles(win.block_mask) == (r * partial, r * full)
    assert win.block_mask.BLOCK_SIZE == dense.BLOCK_SIZE


def test_paged_prefill_with_tiles_wider_than_pages_lists_more() -> None:
    # Why the gathered path exists: at page 16 a 64-token tile holds four shuffled pages, never
    # whole for one request, so every tile is partial and most hold other requests' keys.
    r, s = 4, 512
    b = make_paged_batch(
        query_lens=[s] * r, seq_lens=[s] * r, block_size=16, num_q_heads=4, num_kv_heads=2
    )
    md = _build(b, prefill="paged")  # (the default, "auto", gathers here)
    partial, full = _tiles(md.windows[0].block_mask)
    dense = create_block_mask(
        lambda b, h, q, k: k <= q, None, None, s, s, device="cpu", BLOCK_SIZE=(128, 64)
    )
    assert full == 0 and partial > 2 * r * sum(_tiles(dense))


@pytest.mark.parametrize(
    ("page", "prefill"), [(128, "paged"), (16, "paged"), (16, "gather"), (128, "gather")]
)
def test_mask_mod_loads_per_row_and_column_only(page: int, prefill: str) -> None:
    b = make_paged_batch(query_lens=[200, 1, 90], seq_lens=[300, 40, 90], block_size=page)
    loads, pair_loads = _pair_loads(_build(b, prefill=prefill).windows[0].block_mask)
    assert loads >= 2  # the span mask's row interval (and over the paged cache a block key)
    assert pair_loads == 0
    # The owner mask mod, as before the span mask: per row and per column too.
    owner_loads, owner_pair_loads = _pair_loads(
        _build(b, prefill=prefill, mask="owner").windows[0].block_mask
    )
    assert owner_loads >= 3 and owner_pair_loads == 0
    # The block-table mask mod, as before (and wherever the owner test is not exact).
    _, table_pair_loads = _pair_loads(
        _build(b, prefill=prefill, mask="table").windows[0].block_mask
    )
    assert table_pair_loads == 1


def _shared_prefix_batch(**kw: Any) -> Any:
    """Requests 0 and 1 read the same first page (a prefix-cache hit); its keys are request 0's
    in both (the oracle's copy of request 1 is changed to match)."""
    n = kw.get("block_size", 16)
    b = make_paged_batch(query_lens=[40, 30, 1], seq_lens=[70, 50, 33], seed=3, **kw)
    bt = b.common.block_table
    bt[1, 0] = bt[0, 0]
    ks, vs = b.request_kv()
    ks[1][:n] = ks[0][:n]
    vs[1][:n] = vs[0][:n]
    return b


def test_shared_block_takes_the_table_mask() -> None:
    b = _shared_prefix_batch(block_size=16)
    md = _build(b, kv_block_size=16)
    assert _pair_loads(md.windows[0].block_mask)[1] == 1, "a shared block needs the table test"
    _assert_oracle(b, md)


@pytest.mark.parametrize(
    "feature",
    [{}, {"sliding_window": 24}, {"causal": False}, {"order": "BLNHC", "num_layers": 2}],
    ids=["causal", "window", "noncausal", "blnhc"],
)
@pytest.mark.parametrize("prefill", ["paged", "gather"])
def test_owner_mask_matches_the_oracle(feature: dict, prefill: str) -> None:
    # Query blocks of 16 rows spanning several requests (decodes lead, as a scheduler orders
    # them), so the owner test decides between requests inside one tile row.
    b = make_paged_batch(
        query_lens=[1, 1, 23, 5, 40], seq_lens=[30, 17, 50, 21, 40], seed=7, **feature
    )
    md = _build(b, prefill=prefill, q_block_size=16, kv_block_size=16)
    assert _pair_loads(md.windows[0].block_mask, rows=16, cols=16)[1] == 0
    _assert_oracle(b, md)


def test_owner_entries_of_the_previous_batch_are_reset() -> None:
    # Eager Flex evaluates the mask mod on every pair, listed tile or not: a block of the
    # previous batch must not still name a request of this one.
    kw = {"block_size": 16, "num_blocks": 40}
    first = make_paged_batch(query_lens=[30, 20, 25], seq_lens=[60, 20, 90], seed=1, **kw)
    b = make_paged_batch(query_lens=[30, 20, 25], seq_lens=[40, 50, 30], seed=2, **kw)
    builder = get_backend("FLEX_ATTENTION").make_builder(
        b.config, b.layout, kv_block_size=16, mask="owner"
    )
    builder.build(first.common)
    md = builder.build(b.common)
    stale = set(first.common.block_table.flatten().tolist()) - set(
        b.common.block_table.flatten().tolist()
    )
    assert stale and all(int(builder.block_req[x]) == -1 for x in stale)
    _assert_oracle(b, md)


def test_batch_invariant_keeps_the_table_mask() -> None:
    b = make_paged_batch(query_lens=[150, 1], seq_lens=[150, 40], batch_invariant=True)
    md = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout).build(b.common)
    assert _pair_loads(md.windows[0].block_mask)[1] == 1


def test_mask_option_is_validated() -> None:
    b = make_paged_batch(query_lens=[4], seq_lens=[4])
    with pytest.raises(ValueError, match="mask='rows' must be one of"):
        get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout, mask="rows")


@pytest.mark.parametrize(
    ("page", "invariant", "want"),
    [(16, False, "gather"), (128, False, "paged"), (16, True, "paged")],
)
def test_prefill_auto_gathers_where_tiles_span_pages(page: int, invariant: bool, want: str) -> None:
    """``prefill="auto"`` (the default) gathers where a KV tile is wider than a page (H200, 4 x
    4096 causal at page 16: 48 -> 321 TFLOP/s against dense Flex's 385), and never under batch
    invariance (the gathered buffer's tiles are not the trainer's)."""
    b = make_paged_batch(
        query_lens=[40, 1], seq_lens=[40, 30], block_size=page, num_q_heads=4, num_kv_heads=2,
        batch_invariant=invariant,
    )  # fmt: skip
    builder = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout, static_shapes=True)
    assert builder.options.kv_block_size > page if want == "gather" else True
    assert builder.prefill == want
    md = builder.build(b.common)
    _assert_oracle(b, md)
