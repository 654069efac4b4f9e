"""FLEX_ATTENTION's span mask mods (kv_backends.backends.flex.span), the default where exact, against the owner mask
they replace: the same visibility on every (query, key) pair of a row the flattened call serves,
so bitwise the same outputs, eager and compiled on the CPU. Planted bugs (an interval one key too
wide, block keys of the previous batch left in place, a gathered offset one page off) show the
checks catch a wrong span.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends.flex import gather as flex_gather
from kv_backends.backends.flex import metadata as flex_metadata
from kv_backends.backends.flex import span as flex_span
from kv_backends.backends.flex.span import SPAN_NO_KEY, span_stride
from kv_backends.testing import PagedBatch, make_paged_batch, oracle_attention

TOL: dict[str, Any] = {"atol": 2e-5, "rtol": 1e-4}

# Query blocks of 16 rows spanning several requests (decodes first, as a scheduler orders them),
# prefix context not aligned to pages, each masking feature.
CASES: dict[str, dict[str, Any]] = {
    "causal": {"query_lens": [1, 1, 23, 5, 40], "seq_lens": [30, 17, 50, 21, 40]},
    "prefix": {"query_lens": [37, 50, 1], "seq_lens": [100, 50, 70]},
    "window": {
        "query_lens": [1, 1, 23, 5, 40], "seq_lens": [30, 17, 50, 21, 40], "sliding_window": 24,
    },
    "noncausal": {
        "query_lens": [1, 23, 5, 40], "seq_lens": [30, 50, 21, 40], "causal": False,
    },
    "noncausal_window": {
        "query_lens": [23, 1, 40], "seq_lens": [50, 33, 60], "causal": False, "sliding_window": 9,
    },
    "blnhc": {
        "query_lens": [1, 23, 5, 40], "seq_lens": [30, 50, 21, 40], "order": "BLNHC",
        "num_layers": 2,
    },
    "kernel_split": {
        "query_lens": [1, 23, 40], "seq_lens": [30, 50, 70], "block_size": 32,
        "kernel_block_size": 16,
    },
}  # fmt: skip
TILES = {"q_block_size": 16, "kv_block_size": 16}


def _batch(case: str, **kw: Any) -> PagedBatch:
    return make_paged_batch(seed=7, **{**CASES[case], **kw})


def _build(b: PagedBatch, **opts: Any) -> Any:
    backend = get_backend("FLEX_ATTENTION")
    return backend.make_builder(b.config, b.layout, static_shapes=True, **opts).build(b.common)


def _forward(b: PagedBatch, md: Any, compiled: bool = False) -> torch.Tensor:
    impl = get_backend("FLEX_ATTENTION").make_impl(b.config, b.layout, compiled=compiled)
    return impl.forward(None, b.q, b.kv_cache, md)


def _kind(md: Any) -> str:
    return md.windows[0].block_mask.mask_mod.__qualname__.split(".")[0]


def _served_rows(b: PagedBatch, md: Any) -> torch.Tensor:
    """Query rows whose output the flattened call gives (not the decode call's, not padding)."""
    ql = b.common.query_start_loc.diff()
    served = torch.repeat_interleave(ql > 1 if md.decode is not None else ql > 0, ql)
    return torch.nonzero(served).flatten()


def _visibility(md: Any, rows: torch.Tensor) -> list[torch.Tensor]:
    """Each window's mask over every (row, key) pair, as eager Flex evaluates it."""
    zero = torch.zeros((), dtype=torch.int32)
    q_idx = rows.int()[:, None]
    return [
        w.block_mask.mask_mod(zero, zero, q_idx, torch.arange(w.length, dtype=torch.int32)[None])
        for w in md.windows
    ]


def _same_visibility(b: PagedBatch, span_md: Any, owner_md: Any) -> bool:
    rows = _served_rows(b, owner_md)
    got, want = _visibility(span_md, rows), _visibility(owner_md, rows)
    return all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def _assert_oracle(b: PagedBatch, out: torch.Tensor) -> None:
    t = b.common.num_actual_tokens
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)


@pytest.mark.parametrize("prefill", ["paged", "gather"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_span_mask_sees_what_the_owner_mask_sees(case: str, prefill: str) -> None:
    b = _batch(case)
    span_md = _build(b, prefill=prefill, **TILES)
    owner_md = _build(b, prefill=prefill, mask="owner", **TILES)
    want = "make_span_mask_mod" if prefill == "gather" else "make_keyed_span_mask_mod"
    assert _kind(span_md) == want
    assert _kind(owner_md) == "make_owner_mask_mod"
    assert _same_visibility(b, span_md, owner_md)
    out = _forward(b, span_md)
    t = b.common.num_actual_tokens
    assert torch.equal(out[:t], _forward(b, owner_md)[:t])
    _assert_oracle(b, out)


# One compiled case per mask mod by default (the keyed span mask of the paged prefill, the span
# mask of the gathered one; ~20 s of inductor each on two cores); the rest under ``-m slow``.
# The eager test above runs every case through both.
_COMPILED_DEFAULT = {("window", "paged"), ("prefix", "gather")}
_COMPILED = [
    pytest.param(
        case, prefill, marks=[] if (case, prefill) in _COMPILED_DEFAULT else [pytest.mark.slow]
    )
    for prefill in ("paged", "gather")
    for case in ("prefix", "window", "blnhc")
]


@pytest.mark.parametrize(("case", "prefill"), _COMPILED)
def test_span_mask_compiled_equals_the_owner_mask(case: str, prefill: str) -> None:
    # inductor's C++ Flex template inlines the mask mod as the GPU template does.
    b = _batch(case)
    span_md = _build(b, prefill=prefill, **TILES)
    owner_md = _build(b, prefill=prefill, mask="owner", **TILES)
    out = _forward(b, span_md, compiled=True)
    t = b.common.num_actual_tokens
    assert torch.equal(out[:t], _forward(b, owner_md, compiled=True)[:t])
    _assert_oracle(b, out)


@pytest.mark.parametrize("page", [16, 128])
def test_default_prefill_takes_the_span_mask_on_dense_tiles(page: int) -> None:
    # The bench's prefill shape at CPU scale, with the builder's own tiles.
    b = make_paged_batch(query_lens=[256] * 3, seq_lens=[256] * 3, block_size=page, seed=2)
    md = _build(b)
    assert _kind(md) in ("make_span_mask_mod", "make_keyed_span_mask_mod")
    assert torch.equal(_forward(b, md), _forward(b, _build(b, mask="owner")))


def test_windows_key_each_block_from_its_own_base() -> None:
    # Several cache windows (max_view_elements stands in for 2^31): the keyed span mask of each
    # window indexes the block keys from the window's first block.
    b = make_paged_batch(
        query_lens=[23, 1, 40], seq_lens=[50, 30, 70], num_blocks=24, seed=5, block_size=16
    )
    opts = {"kv_block_size": 16, "max_view_elements": 4100, "prefill": "paged"}
    span_md, owner_md = _build(b, **opts), _build(b, mask="owner", **opts)
    assert len(span_md.windows) > 1
    assert _same_visibility(b, span_md, owner_md)
    _assert_oracle(b, _forward(b, span_md))


def test_block_keys_of_the_previous_batch_are_reset() -> None:
    kw: dict[str, Any] = {"block_size": 16, "num_blocks": 40}
    first = make_paged_batch(query_lens=[30, 20, 25], seq_lens=[60, 20, 90], seed=1, **kw)
    b = make_paged_batch(query_lens=[30, 20, 25], seq_lens=[40, 50, 30], seed=2, **kw)
    builder: Any = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout, kv_block_size=16)
    builder.build(first.common)
    md = builder.build(b.common)
    stale = set(first.common.block_table.flatten().tolist()) - set(
        b.common.block_table.flatten().tolist()
    )
    assert stale and all(int(builder.block_key[x]) == SPAN_NO_KEY for x in stale)
    _assert_oracle(b, _forward(b, md))


def test_keys_past_int32_keep_the_owner_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    assert span_stride(4, 16, 50, 3, 16) == 64  # the table's width
    assert span_stride(4, 16, 100, 3, 16) == 100  # the longest sequence
    # Keys below num_reqs * S, plus an in-block offset below tpb, must fit int32.
    assert span_stride(2**12, 2**7, 1, 2**12 - 1, 2**7) == 2**19
    assert span_stride(2**12, 2**7, 1, 2**12, 2**7) is None
    monkeypatch.setattr(flex_span, "SPAN_KEY_LIMIT", 100)
    b = _batch("causal")
    md = _build(b, prefill="paged", **TILES)
    assert _kind(md) == "make_owner_mask_mod"
    _assert_oracle(b, _forward(b, md))


def test_shared_block_keeps_the_table_mask() -> None:
    b = make_paged_batch(query_lens=[40, 30], seq_lens=[70, 50], seed=3)
    bt = b.common.block_table
    bt[1, 0] = bt[0, 0]
    ks, vs = b.request_kv()
    ks[1][:16] = ks[0][:16]
    vs[1][:16] = vs[0][:16]
    md = _build(b, prefill="paged", **TILES)
    assert _kind(md) == "make_mask_mod"
    _assert_oracle(b, _forward(b, md))


# -- planted bugs: the checks above must catch a wrong span ---------------------------------


def _widened(write: Any) -> Any:
    def planted(*args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = write(*args, **kw)
        hi += 1  # one key past the row's last visible key
        return lo, hi

    return planted


@pytest.mark.parametrize(("prefill", "module"), [("paged", flex_metadata), ("gather", flex_gather)])
def test_planted_interval_one_key_too_wide_is_caught(
    monkeypatch: pytest.MonkeyPatch, prefill: str, module: Any
) -> None:
    b = _batch("causal")
    owner_md = _build(b, prefill=prefill, mask="owner", **TILES)
    monkeypatch.setattr(module, "write_row_spans", _widened(module.write_row_spans))
    span_md = _build(b, prefill=prefill, **TILES)
    assert not _same_visibility(b, span_md, owner_md)
    with pytest.raises(AssertionError):
        _assert_oracle(b, _forward(b, span_md))


def test_planted_stale_block_keys_are_caught() -> None:
    # The first batch's requests are long; left in place, their block keys fall inside the
    # second batch's rows' intervals (eager Flex evaluates every pair of the window).
    kw: dict[str, Any] = {"block_size": 16, "num_blocks": 40}
    first = make_paged_batch(query_lens=[30, 20, 25], seq_lens=[200, 120, 90], seed=1, **kw)
    b = make_paged_batch(query_lens=[30, 20, 25], seq_lens=[40, 50, 30], seed=2, **kw)
    builder: Any = get_backend("FLEX_ATTENTION").make_builder(
        b.config, b.layout, kv_block_size=16, prefill="paged"
    )
    builder.build(first.common)
    builder._keyed = builder._keyed[:0]  # planted: forget which blocks hold keys
    md = builder.build(b.common)
    owner_md = _build(b, prefill="paged", kv_block_size=16, mask="owner")
    assert not _same_visibility(b, md, owner_md)
    with pytest.raises(AssertionError):
        _assert_oracle(b, _forward(b, md))


def test_planted_gathered_offset_one_page_off_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    write = flex_gather.write_row_spans

    def planted(*args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        moved = list(args)
        moved[5] = moved[5] + 16  # the request's offset one 16-token page late
        return write(*moved, **kw)

    b = _batch("window")
    owner_md = _build(b, prefill="gather", mask="owner", **TILES)
    monkeypatch.setattr(flex_gather, "write_row_spans", planted)
    span_md = _build(b, prefill="gather", **TILES)
    assert not _same_visibility(b, span_md, owner_md)
    with pytest.raises(AssertionError):
        _assert_oracle(b, _forward(b, span_md))


@pytest.mark.parametrize("prefill", ["paged", "gather"])
@pytest.mark.parametrize("case", ["prefix", "window", "noncausal", "blnhc"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_span_mask_equals_the_owner_mask(case: str, prefill: str) -> None:
    # Compiled Flex's Triton template with the backend's CUDA defaults (static shapes).
    b = _batch(case, device="cuda", dtype="bfloat16")
    span_md = _build(b, device=b.q.device, prefill=prefill, **TILES)
    owner_md = _build(b, device=b.q.device, prefill=prefill, mask="owner", **TILES)
    out = _forward(b, span_md, compiled=True)
    t = b.common.num_actual_tokens
    assert torch.equal(out[:t], _forward(b, owner_md, compiled=True)[:t])
