"""FLEX_ATTENTION's gathered prefill (``prefill="gather"``): the flattened call over a private
contiguous copy of the visible context, against the float64 oracle, with its refusals."""

from __future__ import annotations

import pytest
import torch
from kv_backends import get_backend
from kv_backends.testing import make_paged_batch, oracle_attention

TOL = {"atol": 2e-5, "rtol": 1e-4}

# Decodes, a chunk, a long prefill (whole query blocks of one request: full tiles), an empty
# request, a short chunk.
QUERY_LENS = [1, 7, 1, 300, 0, 3]
SEQ_LENS = [9, 30, 17, 330, 5, 41]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(
    "feature",
    [
        {},
        {"sliding_window": 40},
        {"has_sinks": True, "softcap": 4.0},
        {"head_size": 48, "head_size_v": 32, "sliding_window": 200},
        {"block_size": 64, "kernel_block_size": 16},
        {"order": "BLNHC", "num_layers": 3, "layer": 1},
        {"causal": False, "sliding_window": 25},
    ],
    ids=[
        "causal",
        "window",
        "sinks_softcap",
        "diffkv_window",
        "kernel16of64",
        "blnhc",
        "noncausal",
    ],
)
def test_gathered_prefill_matches_the_oracle(feature: dict, static: bool) -> None:
    b = make_paged_batch(query_lens=QUERY_LENS, seq_lens=SEQ_LENS, pad_tokens=3, seed=5, **feature)
    backend = get_backend("FLEX_ATTENTION")
    md = backend.make_builder(
        b.config, b.layout, prefill="gather", static_shapes=static, kv_block_size=16
    ).build(b.common)
    (win,) = md.windows
    assert win.gather is not None and win.base_token == 0
    if static:
        assert win.length & (win.length - 1) == 0, "static shapes pad the buffer to 2^k tokens"
    if feature.get("causal", True) and feature.get("sliding_window", 1 << 30) > 128:
        # The long prefill's later query blocks are its alone: whole tiles skip the mask mod
        # (a window narrower than a query block leaves no tile whole for all its rows).
        assert int(win.block_mask.full_kv_num_blocks.sum()) > 0
    impl = backend.make_impl(b.config, b.layout, sinks=b.sinks)
    out = impl.forward(None, b.q, b.kv_cache, md)
    t = b.common.num_actual_tokens
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)
    assert torch.all(out[t:] == 0)


def test_gathered_buffer_holds_only_visible_tiles() -> None:
    # A window of 40 on a chunk of 100 new tokens at 230..329: the buffer starts at the first
    # new token's window tile (position 191, tile 11), not at position 0.
    b = make_paged_batch(query_lens=[100], seq_lens=[330], sliding_window=40)
    md = (
        get_backend("FLEX_ATTENTION")
        .make_builder(b.config, b.layout, prefill="gather", kv_block_size=16)
        .build(b.common)
    )
    first_tile = (330 - 100 - 40 + 1) // 16
    assert md.windows[0].length == (-(-330 // 16) - first_tile) * 16


def test_decode_only_batch_has_no_gathered_call() -> None:
    b = make_paged_batch(query_lens=[1, 1], seq_lens=[20, 7])
    md = (
        get_backend("FLEX_ATTENTION")
        .make_builder(b.config, b.layout, prefill="gather")
        .build(b.common)
    )
    assert md.windows == () and md.decode is not None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"batch_invariant": True}, "cannot keep batch invariance"),
        ({"use_alibi": True}, "does not support ALiBi"),
        ({}, "must be .auto. or one of"),
    ],
)
def test_gathered_prefill_refusals(config: dict, message: str) -> None:
    b = make_paged_batch(query_lens=[3], seq_lens=[3], **config)
    mode = "gather" if config else "dense"
    with pytest.raises(ValueError, match=message):
        get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout, prefill=mode)
