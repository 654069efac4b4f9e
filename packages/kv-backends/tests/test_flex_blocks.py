"""FLEX_ATTENTION's block-mask entries on their own: partial and full tiles against a brute-force
visibility check (hypothesis over batches), and forwards where full tiles are present.

A tile marked full skips the mask mod, so a wrong flag is a wrong answer, not a slow one: every
(query, key) pair of a full tile must be visible, and partial + full must be exactly the tiles
the batch needs (``KVSTACK_HYPOTHESIS_EXAMPLES`` raises the example count)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_backends import get_backend
from kv_backends.backends.flex.entries import build_flex_block_entries
from kv_backends.testing import make_paged_batch, oracle_attention, run_backend

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "40"))
TOL = {"atol": 2e-5, "rtol": 1e-4}


def _visible(p: int, k: int, s: int, causal: bool, w: int | None) -> bool:
    """docs/attention_semantics.md, written out."""
    if k >= s or (causal and k > p):
        return False
    return w is None or abs(p - k) < w


@st.composite
def _batches(draw: st.DrawFn) -> dict:
    n = draw(st.sampled_from([16, 32]))
    kvb = draw(st.sampled_from([16, n]))
    r = draw(st.integers(1, 4))
    seq = [draw(st.integers(1, 90)) for _ in range(r)]
    ql = [draw(st.integers(0, s)) for s in seq]
    causal = draw(st.booleans())
    w = draw(st.one_of(st.none(), st.integers(1, 40)))
    qbs = draw(st.sampled_from([16, 32]))
    return {"n": n, "kvb": kvb, "seq": seq, "ql": ql, "causal": causal, "w": w, "qbs": qbs}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_full_and_partial_tiles_match_brute_force(case: dict) -> None:
    n, kvb, seq, ql, causal, w, qbs = (
        case[k] for k in ("n", "kvb", "seq", "ql", "causal", "w", "qbs")
    )
    cols = max(-(-s // n) for s in seq)
    perm = torch.randperm(len(seq) * cols + 2, generator=torch.Generator().manual_seed(sum(seq)))
    bt = perm[: len(seq) * cols].view(len(seq), cols).int()  # distinct blocks, shuffled
    qsl = torch.tensor([0, *torch.tensor(ql).cumsum(0).tolist()], dtype=torch.int32)
    t = int(qsl[-1])
    ent = build_flex_block_entries(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_table=bt,
        num_tokens=t,
        n=n,
        tpb=n,
        q_block_size=qbs,
        kv_block_size=kvb,
        causal=causal,
        sliding_window=w,
        full_blocks=True,
    )
    # Brute force: which (query block, tile) pairs hold a visible pair, and which hold only
    # visible pairs for every (real) query row of a single-request block.
    tok_req = [r for r in range(len(seq)) for _ in range(ql[r])]
    tok_pos = [seq[r] - ql[r] + i for r in range(len(seq)) for i in range(ql[r])]
    need: set[tuple[int, int]] = set()
    for i in range(t):
        r, p = tok_req[i], tok_pos[i]
        for k in range(seq[r]):
            if _visible(p, k, seq[r], causal, w):
                need.add((i // qbs, (int(bt[r, k // n]) * n + k % n) // kvb))
    got = list(zip(ent.qb.tolist(), ent.kv.tolist(), ent.full.tolist(), strict=True))
    assert {(a, b) for a, b, _ in got} == need
    assert len(got) == len(need), "a tile listed twice is visited twice"
    for qb, f, full in got:
        if not full:
            continue
        # Rows past the batch are padding: their outputs are dropped, so they do not count.
        rows = range(qb * qbs, min((qb + 1) * qbs, t))
        assert len({tok_req[i] for i in rows}) == 1
        r = tok_req[qb * qbs]
        keys = [
            k for k in range(seq[r]) if (int(bt[r, k // n]) * n + k % n) // kvb == f
        ]  # the tile's keys of request r
        assert len(keys) == kvb
        assert all(_visible(tok_pos[i], k, seq[r], causal, w) for i in rows for k in keys)


@pytest.mark.parametrize("window", [None, 200])  # a window wider than a query block of 128
def test_forward_with_full_tiles(window: int | None) -> None:
    # A long prefill, a chunk and decodes at kv tiles = pages of 16: full tiles appear in both
    # calls (the triangle's interior; a decode's whole pages).
    b = make_paged_batch(
        query_lens=[1, 400, 40, 1], seq_lens=[70, 400, 100, 33], sliding_window=window, seed=2
    )
    backend = get_backend("FLEX_ATTENTION")
    md = backend.make_builder(b.config, b.layout, kv_block_size=16).build(b.common)
    assert int(md.windows[0].block_mask.full_kv_num_blocks.sum()) > 0
    assert md.decode is not None and int(md.decode.block_mask.full_kv_num_blocks.sum()) > 0
    out = backend.make_impl(b.config, b.layout).forward(None, b.q, b.kv_cache, md)
    t = b.common.num_actual_tokens
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)


def test_batch_invariant_mode_has_no_full_tiles() -> None:
    # Flex visits full tiles after the partial ones: an order the trainer's dense call does not
    # share, so batch invariance lists every tile as partial, in logical order.
    b = make_paged_batch(query_lens=[150, 1], seq_lens=[150, 40], batch_invariant=True)
    md = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout).build(b.common)
    assert md.windows[0].block_mask.full_kv_num_blocks is None
    t = b.common.num_actual_tokens
    out = run_backend("FLEX_ATTENTION", b)
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)
