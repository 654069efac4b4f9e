"""``num_decodes``: the prefill class of a mixed batch launches programs for the sequences after
its leading decodes only (issue 32: 256 decodes beside one 1,024-token prefill launched
297 x 8 prefill programs for the 32 x 8 with rows; each idle one staged q and set up its
barriers before it found it had nothing to do).

- Parity (Triton interpreter, fp32 / fp16): leading decodes beside prefill chunks, a decode
  after them (not in the leading run), with every true ``num_decodes`` the same rows as with 0,
  bit for bit, and as the float64 oracle; the prefill grid shrinks by what the decodes reserved.
- A batch of decodes only under a larger ``max_query_len`` launches no prefill program at all.
- A planted bug (the grid shrunk, the kernel not told where its sequences start) leaves prefill
  rows unwritten and fails the oracle check.
- A false promise (a prefill among the first ``num_decodes``) and bad values are named errors.
- The bound launch path (stubbed CUDA, check mode) keys the class on ``num_decodes``.
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
    assert_rows_close,
    batch_oracle,
    make_paged_batch,
    run_batch,
)
from kv_kernels.testing_launch import fake_cuda, stubbed_cuda
from kv_spec import KVCacheLayout, LayoutOrder

tri = importlib.import_module("kv_kernels.paged_attention.triton")
fast = importlib.import_module("kv_kernels.paged_attention._fast")
args_mod = importlib.import_module("kv_kernels.paged_attention._launch_args")

#: four leading decodes, two prefill chunks over context, a decode after them (q_lens, seq_lens)
Q_LENS = [1, 1, 1, 1, 20, 37, 1]
SEQ_LENS = [90, 75, 60, 33, 30, 60, 80]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The launches of every described call (:func:`.triton.describe_launches`), recorded."""
    seen: list[list[Any]] = []
    real = tri.describe_launches

    def recording(*a: Any, **kw: Any) -> list[Any]:
        got = real(*a, **kw)
        seen.append(got)
        return got

    monkeypatch.setattr(tri, "describe_launches", recording)
    return seen


def _prefill(got: list[Any]) -> Any:
    """The prefill-class launch of one call (its q_len_min is past 1)."""
    (pre,) = [x for x in got if x.args[-3] > 1]
    return pre


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_true_count_gives_the_same_rows(
    dtype: torch.dtype, launches: Any, triton_device: str
) -> None:
    b = make_paged_batch(q_lens=Q_LENS, seq_lens=SEQ_LENS, head_size=16, group=2, dtype=dtype)
    t = b["q"].shape[0]
    base = run_batch(b, "triton", num_splits=1)
    grid0 = _prefill(launches[-1]).grid[0]
    block_q = tri._configs(b["q"], b["kv"], 16, 16, False, inline_scales=False)[1].block_q
    assert grid0 == t // block_q + len(Q_LENS)
    for n in (1, 4):
        got = run_batch(b, "triton", num_splits=1, num_decodes=n)
        pre = _prefill(launches[-1])
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
    assert all(x.args[-3] == 1 for x in launches[-1]), "a prefill launch ran"
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
    """Stubbed CUDA, check mode (every bound call compared with the described path): the same
    shapes with ``num_decodes`` 0 and 1 are two classes, each bound, each with its own prefill
    grid (``22 // block_q + 3`` less what the one decode reserved)."""
    monkeypatch.delenv("KV_KERNELS_VALIDATE", raising=False)
    monkeypatch.setattr(_call_cache, "ENABLED", True)
    monkeypatch.setattr(_launch, "CHECK", True)
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=12, num_kv_heads=2, block_size=4,
        head_size=16, head_size_v=16, dtype="bfloat16",
    )  # fmt: skip
    fast.clear()
    with stubbed_cuda():
        args: dict[str, Any] = dict(
            q=fake_cuda(torch.zeros(22, 4, 16, dtype=torch.bfloat16)),
            kv_cache=fake_cuda(layer_view(allocate_kv_cache(layout, "cpu", zero=True), layout, 0)),
            layout=layout,
            block_table=fake_cuda(torch.randint(0, 12, (3, 30), dtype=torch.int32)),
            seq_lens=fake_cuda(torch.tensor([100, 40, 100], dtype=torch.int32)),
            query_start_loc=fake_cuda(torch.tensor([0, 1, 21, 22], dtype=torch.int32)),
            max_query_len=20, max_seq_len=100, num_splits=1,
            out=fake_cuda(torch.empty(22, 4, 16, dtype=torch.bfloat16)),
        )  # fmt: skip
        grids = []
        for n in (0, 1, 0, 1, 1):
            testing_launch.LAUNCHES = []
            try:
                paged_attention(**args, num_decodes=n)
                grids.append([g for _, g, _ in testing_launch.LAUNCHES])
            finally:
                testing_launch.LAUNCHES = None
        bound = [bool(e.bound.get(1)) for e in fast._ENTRIES.values()]
    fast.clear()
    assert len(bound) == 2 and all(bound)
    dec, pre0 = grids[0]
    _, pre1 = grids[1]
    assert dec == (3, 2, 1) and pre0[0] == pre1[0] + 1 and pre0[1:] == pre1[1:]
    assert grids == [grids[0], grids[1]] * 2 + [grids[1]]
