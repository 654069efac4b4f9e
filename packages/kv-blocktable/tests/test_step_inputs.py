"""``StepInputs.from_lengths`` and the null-block check against by-hand formulations, and the
rule that a step's per-token host arithmetic never runs as torch CPU ops (torch's index and
repeat_interleave enter its OpenMP pool at these sizes: 10-20 ms of an 8k-token prefill's
metadata on the H200 host, where numpy took ~1 ms)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kv_blocktable.attn_metadata import StepInputs, check_new_tokens_not_null  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def _by_hand(qlens: list[int], seqlens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """``query_start_loc``, each new token's position and request, one token at a time."""
    qsl, pos, reqs = [0], [], []
    for r, (q, s) in enumerate(zip(qlens, seqlens, strict=True)):
        qsl.append(qsl[-1] + q)
        pos.extend(range(s - q, s))
        reqs.extend([r] * q)
    return qsl, pos, reqs


@pytest.mark.parametrize("seed", range(6))
def test_from_lengths_matches_a_token_by_token_build(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    qlens = [rng.choice([0, 1, rng.randint(1, 70)]) for _ in range(n)]
    seqlens = [q + rng.randint(0, 100) for q in qlens]
    step = StepInputs.from_lengths(
        n, qlens, seqlens, pad_tokens_to=None, max_num_batched_tokens=10_000
    )
    qsl, pos, reqs = _by_hand(qlens, seqlens)
    assert step.query_start_loc.dtype == torch.int32 and step.query_start_loc.tolist() == qsl
    assert step.positions.dtype == torch.int64 and step.positions.tolist() == pos
    assert step.token_reqs.dtype == torch.int64 and step.token_reqs.tolist() == reqs
    assert step.num_tokens == sum(qlens) and step.max_query_len == max(qlens)


def _table(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(1, rows * cols + 1, dtype=torch.int32).view(rows, cols)


def test_null_check_names_the_first_new_token_in_the_null_block() -> None:
    # request 1 writes positions 30..49 (columns 1..3 of block size 16); its column 2 is null
    step = StepInputs.from_lengths(
        2, [4, 20], [4, 50], pad_tokens_to=None, max_num_batched_tokens=64
    )
    table = _table(2, 4)
    check_new_tokens_not_null(step, table, 16, 0, 0)  # no null block in the way
    table[1, 2] = 0
    table[1, 3] = 0  # a later hit too: the first one (position 32) is named
    with pytest.raises(ValueError, match=r"request 1: new token at position 32 .* column 2"):
        check_new_tokens_not_null(step, table, 16, 0, 0)
    table[1, 2] = 9
    with pytest.raises(ValueError, match=r"request 1: new token at position 48 .*column 3"):
        check_new_tokens_not_null(step, table, 16, 0, 0)
    # the null block in an old column (before the new tokens) is fine: a sliding window's
    table[1, 3], table[1, 0] = 9, 0
    check_new_tokens_not_null(step, table, 16, 0, 0)


class _PerTokenOps(TorchDispatchMode):
    """Records the torch ops that compute an output of at least ``size`` elements (wrapping a
    numpy array, ``torch.from_numpy``, dispatches as ``lift_fresh`` / ``detach``: no work)."""

    _WRAPS = frozenset({"lift_fresh", "detach", "alias"})

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.seen = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.numel() >= self.size and name not in self._WRAPS:
            self.seen.append(str(func))
        return out


def test_a_prefill_steps_per_token_host_math_is_not_torch_ops() -> None:
    """A mixed step (decode rows and a long prompt): nothing the size of its tokens is a torch
    op. Written with torch's repeat_interleave and index (the old form), this fails."""
    qlens = [1] * 40 + [3000, 1000]
    seqlens = [200 + r for r in range(40)] + [3000, 1500]
    table = _table(42, 200)
    with _PerTokenOps(1000) as ops:
        step = StepInputs.from_lengths(
            42, qlens, seqlens, pad_tokens_to=None, max_num_batched_tokens=8192
        )
        check_new_tokens_not_null(step, table, 16, 0, 0)
    assert ops.seen == []
    assert step.num_tokens == 4040  # (the step was built)
