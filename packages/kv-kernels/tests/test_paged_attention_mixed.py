"""Mixed batches of decode rows and prefill chunks (issue 32).

Split KV in the decode class: under the split heuristic
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

``num_decodes``: the prefill class of a mixed batch launches programs for the sequences after
its leading decodes only (issue 32: 256 decodes beside one 1,024-token prefill launched 297 x 8
prefill programs for the 32 x 8 with rows; each idle one staged q and set up its barriers before
it found it had nothing to do).

- Parity (interpreter, fp32 / fp16): leading decodes beside prefill chunks, a decode after them
  (not in the leading run), with every true ``num_decodes`` the same rows as with 0, bit for
  bit, and as the float64 oracle; the prefill grid shrinks by what the decodes reserved.
- A batch of decodes only under a larger ``max_query_len`` launches no prefill program at all.
- A planted bug (the grid shrunk, the kernel not told where its sequences start) leaves prefill
  rows unwritten and fails the oracle check.
- A false promise (a prefill among the first ``num_decodes``) and bad values are named errors.
- The bound launch path keys the class on ``num_decodes``.
The same through the sm_90 Gluon prefill kernel on an H200: ``test_sm90_prefill.py``.
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
args_mod = importlib.import_module("kv_kernels.paged_attention._launch_args")

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
    grids, entries = _bound_calls(
        monkeypatch,
        [1100, 40, 1100],
        275,
        [{"max_seq_len": m} for m in (1100,) * 3 + (100,) * 2 + (1100,)],
    )
    bound = {k for k, v in entries[0].bound.items() if v}
    # decode (a program a sequence), prefill (22 // its block_q + 3 sequences: unsplit), merge
    split = [(3, 2, 2), (3, 2, 1), (22, 4, 1)]
    unsplit = [(3, 2, 1), (3, 2, 1)]
    assert grids == [split] * 3 + [unsplit] * 2 + [split], grids
    assert bound == {1, 2}


#: four leading decodes, two prefill chunks over context, a decode after them (q_lens, seq_lens)
Q_LENS = [1, 1, 1, 1, 20, 37, 1]
SEQ_LENS = [90, 75, 60, 33, 30, 60, 80]


def _prefill(seen: Any) -> Any:
    """The prefill-class launch of the last described call (its q_len_min is past 1)."""
    (pre,) = [x for x in seen[-1][1] if x.args[-3] > 1]
    return pre


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_true_count_gives_the_same_rows(
    dtype: torch.dtype, launches: Any, triton_device: str
) -> None:
    b = make_paged_batch(q_lens=Q_LENS, seq_lens=SEQ_LENS, head_size=16, group=2, dtype=dtype)
    t = b["q"].shape[0]
    base = run_batch(b, "triton", num_splits=1)
    grid0 = _prefill(launches).grid[0]
    block_q = tri._configs(b["q"], b["kv"], 16, 16, False, inline_scales=False)[1].block_q
    assert grid0 == t // block_q + len(Q_LENS)
    for n in (1, 4):
        got = run_batch(b, "triton", num_splits=1, num_decodes=n)
        pre = _prefill(launches)
        assert pre.grid[0] == args_mod.prefill_grid_q(t, len(Q_LENS), block_q, n) < grid0
        assert pre.args[-1] == n
        assert torch.equal(got, base), n
    assert_rows_close(base, batch_oracle(b)[0], dtype)


def test_decodes_only_launch_no_prefill_program(launches: Any, triton_device: str) -> None:
    """Every sequence a decode but a caller's ``max_query_len`` of 5 (a prefill class planned):
    with ``num_decodes`` covering them all, the prefill launch is left out."""
    b = make_paged_batch(q_lens=[1, 1, 1], seq_lens=[40, 17, 64], head_size=16, group=2)
    b["max_query_len"] = 5
    out = run_batch(b, "triton", num_splits=1, num_decodes=3)
    assert all(x.args[-3] == 1 for x in launches[-1][1]), "a prefill launch ran"
    assert_rows_close(out, batch_oracle(b)[0], torch.float32)


def test_a_planted_missing_offset_fails_the_oracle_check(
    launches: Any, monkeypatch: pytest.MonkeyPatch, triton_device: str
) -> None:
    """The grid shrunk for 4 decodes but the kernel told its sequences start at 0: its programs
    land on the decodes' (idle) tiles and the last prefill tiles get none."""
    b = make_paged_batch(q_lens=Q_LENS, seq_lens=SEQ_LENS, head_size=16, group=2)
    real = tri.describe_launches

    def no_offset(*a: Any, **kw: Any) -> list[Any]:
        got = real(*a, **kw)
        return [x._replace(args=(*x.args[:-1], 0)) if x.args[-3] > 1 else x for x in got]

    monkeypatch.setattr(tri, "describe_launches", no_offset)
    out = torch.zeros(b["q"].shape[0], b["q"].shape[1], 16, device=triton_device)
    run_batch(b, "triton", num_splits=1, num_decodes=4, out=out)
    with pytest.raises(AssertionError):
        assert_rows_close(out, batch_oracle(b)[0], torch.float32)
    monkeypatch.setattr(tri, "describe_launches", real)
    run_batch(b, "triton", num_splits=1, num_decodes=4, out=out)  # the same call, unplanted
    assert_rows_close(out, batch_oracle(b)[0], torch.float32)


def test_a_prefill_among_the_promised_decodes_is_named(triton_device: str) -> None:
    b = make_paged_batch(q_lens=Q_LENS, seq_lens=SEQ_LENS, head_size=16, group=2)
    with pytest.raises(ValueError, match=r"num_decodes=5 but sequence 4 has query_len=20"):
        run_batch(b, "triton", num_decodes=5, validate=True)


@pytest.mark.parametrize(("promised", "errors"), [(4, 0), (5, 1), (6, 2)])
def test_unchecked_a_false_promise_is_counted_in_the_error_flag(
    promised: int, errors: int, triton_device: str
) -> None:
    """Without the host check (CUDA's default), the decode launch counts each promised decode
    that is not one in ``error_flag``: the rows the prefill grid then leaves unwritten are said,
    not silently wrong. The true count adds nothing."""
    b = make_paged_batch(q_lens=Q_LENS, seq_lens=SEQ_LENS, head_size=16, group=2)
    flag = torch.zeros(1, dtype=torch.int32, device=triton_device)
    run_batch(b, "triton", num_splits=1, num_decodes=promised, validate=False, error_flag=flag)
    assert int(flag.item()) == errors


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (-1, ValueError, r"num_decodes=-1 must be a count of leading decodes in \[0, "),
        (8, ValueError, r"num_decodes=8 exceeds the batch's 7 sequences"),
        (2.0, TypeError, r"num_decodes=2.0 must be a count of leading decodes: an int"),
        (True, TypeError, r"num_decodes=True must be"),
    ],
)
def test_bad_counts_are_named(value: Any, error: type, words: str, triton_device: str) -> None:
    b = make_paged_batch(q_lens=Q_LENS, seq_lens=SEQ_LENS, head_size=16, group=2)
    with pytest.raises(error, match=words):
        run_batch(b, "triton", num_decodes=value)


def test_the_bound_path_keys_the_class_on_num_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same shapes with ``num_decodes`` 0 and 1 are two classes, each bound, each with its
    own prefill grid (``22 // block_q + 3`` less what the one decode reserved)."""
    calls = [{"max_seq_len": 100, "num_splits": 1, "num_decodes": n} for n in (0, 1, 0, 1, 1)]
    grids, entries = _bound_calls(monkeypatch, [100, 40, 100], 30, calls)
    assert len(entries) == 2 and all(e.bound.get(1) for e in entries)
    dec, pre0 = grids[0]
    _, pre1 = grids[1]
    assert dec == (3, 2, 1) and pre0[0] == pre1[0] + 1 and pre0[1:] == pre1[1:]
    assert grids == [grids[0], grids[1]] * 2 + [grids[1]]


def _bound_calls(
    monkeypatch: pytest.MonkeyPatch, seq_lens: list[int], pages: int, calls: list[dict[str, Any]]
) -> tuple[list[list[tuple[int, ...]]], list[Any]]:
    """Stubbed CUDA, check mode (every bound call compared with the described path): a batch
    of a decode, a 20-token chunk and a decode (22 rows, bf16, 4 q / 2 kv heads of 16) called
    once per keyword set of ``calls``; returns each call's launch grids and the call cache's
    entries (in the order made)."""
    monkeypatch.delenv("KV_KERNELS_VALIDATE", raising=False)
    monkeypatch.setattr(_call_cache, "ENABLED", True)
    monkeypatch.setattr(_launch, "CHECK", True)
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=12, num_kv_heads=2, block_size=4,
        head_size=16, head_size_v=16, dtype="bfloat16",
    )  # fmt: skip
    fast.clear()
    grids = []
    try:
        with stubbed_cuda():
            args: dict[str, Any] = dict(
                q=fake_cuda(torch.zeros(22, 4, 16, dtype=torch.bfloat16)),
                kv_cache=fake_cuda(
                    layer_view(allocate_kv_cache(layout, "cpu", zero=True), layout, 0)
                ),
                layout=layout,
                block_table=fake_cuda(torch.randint(0, 12, (3, pages), dtype=torch.int32)),
                seq_lens=fake_cuda(torch.tensor(seq_lens, dtype=torch.int32)),
                query_start_loc=fake_cuda(torch.tensor([0, 1, 21, 22], dtype=torch.int32)),
                max_query_len=20, out=fake_cuda(torch.empty(22, 4, 16, dtype=torch.bfloat16)),
            )  # fmt: skip
            for kw in calls:
                testing_launch.LAUNCHES = []
                try:
                    paged_attention(**args, **kw)
                    grids.append([g for _, g, _ in testing_launch.LAUNCHES])
                finally:
                    testing_launch.LAUNCHES = None
            return grids, list(fast._ENTRIES.values())
    finally:
        fast.clear()
