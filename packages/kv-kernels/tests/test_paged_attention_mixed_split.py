"""Split KV in the decode class of a mixed batch (issue 32): under the split heuristic
(``num_splits=None``) a batch of decode rows and prefill chunks splits the decode launch's KV,
runs the prefill launch unsplit (writing ``out`` itself), and merges decode-class rows only.

- Parity with the float64 oracle (Triton interpreter on the CPU, fp32 / fp16) over decode rows of
  ~1k-token contexts beside prefill chunks: decodes first, prefills first, a decode row between
  two prefill requests, with sinks (the merge adds them), ``return_lse``, an error flag, an empty
  sequence and CUDA-graph padding rows; each case asserts from the launches that the decode class
  split and the prefill class did not.
- A caller's ``num_splits`` still splits both classes and merges every row.
- Planted bugs the oracle check catches: a merge that skips decode rows, one that merges prefill
  rows (whose partials nobody wrote).
- The bound launch path (stubbed CUDA, check mode): one shape class of mixed batches binds a call
  per split count as ``max_seq_len`` moves the heuristic, each equal to the described path.
The same on an H200 with bf16 and fp8 pages: ``test_paged_attention_gpu.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from kv_kernels import _call_cache, _launch, testing_launch
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.testing_attention import (
    assert_lse_close,
    assert_rows_close,
    batch_oracle,
    make_paged_batch,
    run_batch,
)
from kv_kernels.testing_launch import fake_cuda, stubbed_cuda
from kv_spec import KVCacheLayout, LayoutOrder

tri = importlib.import_module("kv_kernels.paged_attention.triton")
fast = importlib.import_module("kv_kernels.paged_attention._fast")
splits_mod = importlib.import_module("kv_kernels.paged_attention._splits")

#: (q_lens, seq_lens): decode rows over 1030-1100 keys (the interpreter's decode config reads
#: 64-key tiles, so the heuristic splits them in 2) beside prefill chunks with context
ORDERS = {
    "decodes_first": ([1, 1, 1, 20, 17], [1100, 1030, 1070, 30, 60]),
    "prefills_first": ([20, 17, 1, 1], [30, 60, 1100, 1045]),
    # a decode row between two prefill requests, an empty sequence, a 3-token speculative step
    "interleaved": ([1, 19, 1, 0, 24, 3, 1], [1090, 40, 1050, 0, 24, 1040, 1100]),
}


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[Any]]]:
    """``(splits, launches)`` of every described call (what :func:`.triton.describe_launches`
    returned), recorded."""
    seen: list[tuple[int, list[Any]]] = []
    real = tri.describe_launches

    def recording(plan: Any, splits: int, *a: Any, **kw: Any) -> list[Any]:
        got = real(plan, splits, *a, **kw)
        seen.append((splits, got))
        return got

    monkeypatch.setattr(tri, "describe_launches", recording)
    return seen


def _assert_decode_split_only(seen: list[tuple[int, list[Any]]]) -> None:
    """The last call: the decode launch split, the prefill launch did not, and the merge took
    decode-class rows only."""
    splits, (dec, pre, merge) = seen[-1]
    assert splits > 1 and dec.grid[2] == splits and dec.kwargs["SPLIT"]
    assert pre.grid[2] == 1 and not pre.kwargs["SPLIT"]
    # (the decode class's bound: past every decode row's q_len in ORDERS, below every prefill's)
    assert merge.kwargs["DECODE_ONLY"] and 3 <= merge.args[-1] < 17


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("order", list(ORDERS))
def test_mixed_batch_splits_the_decode_class_only(
    order: str, dtype: torch.dtype, launches: Any, triton_device: str
) -> None:
    q_lens, seq_lens = ORDERS[order]
    b = make_paged_batch(q_lens=q_lens, seq_lens=seq_lens, head_size=16, group=2, dtype=dtype)
    sinks = torch.randn(b["q"].shape[1], generator=torch.Generator().manual_seed(1)) * 2
    flag = torch.zeros(1, dtype=torch.int32, device=triton_device)
    out, lse = run_batch(
        b, "triton", return_lse=True, sinks=sinks.to(triton_device), error_flag=flag
    )
    ref, ref_lse = batch_oracle(b, sinks=sinks)
    _assert_decode_split_only(launches)
    assert_rows_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse)
    assert int(flag.item()) == 0


@pytest.mark.parametrize("cap_bytes", [1, None], ids=["no_room", "room_for_two"])
def test_the_split_scratch_of_a_mixed_batch_is_bounded(
    cap_bytes: int | None, launches: Any, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split scratch holds every token row, prefill rows too: a mixed batch splits its
    decode class only as far as ``MIXED_SPLIT_SCRATCH`` bytes allow (a long chunk beside a few
    long decodes would take gigabytes), and unsplit it still matches the oracle."""
    q_lens, seq_lens = ORDERS["decodes_first"]
    b = make_paged_batch(q_lens=q_lens, seq_lens=seq_lens, head_size=16, group=2)
    rows, heads = b["q"].shape[0], b["q"].shape[1]
    per_split = rows * heads * (16 + 1) * 4
    monkeypatch.setattr(splits_mod, "MIXED_SPLIT_SCRATCH", cap_bytes or 2 * per_split)
    out = run_batch(b, "triton")
    splits, got = launches[-1]
    if cap_bytes == 1:
        assert splits == 1 and len(got) == 2 and not got[0].kwargs["SPLIT"]
    else:
        assert splits == 2 and got[0].kwargs["SPLIT"]
    assert_rows_close(out, batch_oracle(b)[0], torch.float32)


def test_padding_rows_stay_untouched_and_lse_without_sinks(
    launches: Any, triton_device: str
) -> None:
    q_lens, seq_lens = ORDERS["interleaved"]
    b = make_paged_batch(q_lens=q_lens, seq_lens=seq_lens, head_size=16, group=2)
    t = b["q"].shape[0]
    b["q"] = torch.cat([b["q"], torch.ones(5, *b["q"].shape[1:], device=triton_device)])
    out = torch.full((t + 5, b["q"].shape[1], 16), 5.0, device=triton_device)
    res, lse = run_batch(b, "triton", out=out, return_lse=True)
    _assert_decode_split_only(launches)
    ref, ref_lse = batch_oracle(dict(b, q=b["q"][:t]))
    assert res is out and torch.all(out[t:] == 5.0)
    assert_rows_close(out[:t], ref, torch.float32)
    assert_lse_close(lse[:t], ref_lse)


def test_callers_num_splits_splits_both_classes_and_merges_every_row(
    launches: Any, triton_device: str
) -> None:
    q_lens, seq_lens = ORDERS["interleaved"]
    b = make_paged_batch(q_lens=q_lens, seq_lens=seq_lens, head_size=16, group=2)
    sinks = torch.randn(b["q"].shape[1])
    out, lse = run_batch(b, "triton", num_splits=3, return_lse=True, sinks=sinks.to(triton_device))
    splits, (dec, pre, merge) = launches[-1]
    assert splits == 3 and dec.grid[2] == pre.grid[2] == 3 and pre.kwargs["SPLIT"]
    assert not merge.kwargs["DECODE_ONLY"]
    ref, ref_lse = batch_oracle(b, sinks=sinks)
    assert_rows_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("bug", ["merge skips decode rows", "merge takes prefill rows"])
def test_a_planted_merge_bug_fails_the_oracle_check(
    bug: str, launches: Any, monkeypatch: pytest.MonkeyPatch, triton_device: str
) -> None:
    q_lens, seq_lens = ORDERS["interleaved"]
    b = make_paged_batch(q_lens=q_lens, seq_lens=seq_lens, head_size=16, group=2)
    real_merge, real_buffers = tri._merge_splits, tri._split_buffers
    # skipping: no row has q_len <= 0 (the empty sequence has none); taking: every row passes
    bound = 0 if bug == "merge skips decode rows" else 2**30
    monkeypatch.setattr(tri, "_merge_splits", lambda *a: real_merge(*a[:-1], bound))

    def zeroed(*a: Any) -> Any:  # (unwritten partials read as zeros, not as whatever was there)
        po, pl = real_buffers(*a)
        return po.zero_(), pl.zero_()

    monkeypatch.setattr(tri, "_split_buffers", zeroed)
    out = torch.zeros(b["q"].shape[0], b["q"].shape[1], 16, device=triton_device)
    run_batch(b, "triton", out=out)
    assert launches[-1][1][-1].kwargs["DECODE_ONLY"]
    with pytest.raises(AssertionError):
        assert_rows_close(out, batch_oracle(b)[0], torch.float32)


def test_the_bound_path_binds_a_mixed_class_per_split_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One shape class of mixed batches (stubbed CUDA, check mode: every bound call is compared
    with the described path): ``max_seq_len`` 1100 splits the decode class in 2 (decode, prefill,
    merge), 100 does not (decode, prefill); each split count is bound once and served bound."""
    monkeypatch.delenv("KV_KERNELS_VALIDATE", raising=False)
    monkeypatch.setattr(_call_cache, "ENABLED", True)
    monkeypatch.setattr(_launch, "CHECK", True)
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=12, num_kv_heads=2, block_size=4,
        head_size=16, head_size_v=16, dtype="bfloat16",
    )  # fmt: skip
    q_lens, pages = (1, 20, 1), 275
    qsl = torch.tensor([0, 1, 21, 22], dtype=torch.int32)
    fast.clear()
    with stubbed_cuda():
        args: dict[str, Any] = dict(
            q=fake_cuda(torch.zeros(22, 4, 16, dtype=torch.bfloat16)),
            kv_cache=fake_cuda(layer_view(allocate_kv_cache(layout, "cpu", zero=True), layout, 0)),
            layout=layout,
            block_table=fake_cuda(torch.randint(0, 12, (3, pages), dtype=torch.int32)),
            seq_lens=fake_cuda(torch.tensor([1100, 40, 1100], dtype=torch.int32)),
            query_start_loc=fake_cuda(qsl), max_query_len=max(q_lens),
            out=fake_cuda(torch.empty(22, 4, 16, dtype=torch.bfloat16)),
        )  # fmt: skip
        grids = []
        for max_seq_len in (1100, 1100, 1100, 100, 100, 1100):
            testing_launch.LAUNCHES = []
            try:
                paged_attention(**args, max_seq_len=max_seq_len)
                grids.append([g for _, g, _ in testing_launch.LAUNCHES])
            finally:
                testing_launch.LAUNCHES = None
        entry = next(iter(fast._ENTRIES.values()))
        bound = {k for k, v in entry.bound.items() if v}
    fast.clear()
    # decode (a program a sequence), prefill (22 // its block_q + 3 sequences: unsplit), merge
    split = [(3, 2, 2), (3, 2, 1), (22, 4, 1)]
    unsplit = [(3, 2, 1), (3, 2, 1)]
    assert grids == [split] * 3 + [unsplit] * 2 + [split], grids
    assert bound == {1, 2}
