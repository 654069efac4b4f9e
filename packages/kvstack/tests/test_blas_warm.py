"""``kvstack.engine._blas_warm``: the matmuls an engine on CUDA runs at startup so that cuBLAS's
kernels for its steps' token counts are loaded before the first request (the runner calls it
on CUDA only; the functions themselves run anywhere, so they are checked here on the CPU).

The planted traps: a model whose q/k/v and gate/up are stacked (the stacked widths are what
run, so they must be warmed, not only the separate projections), two layers of the same shapes
(one call per shape, not per layer), and a tied embedding (the logits' weight is no Linear)."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvstack.engine import _blas_warm
from kvstack.engine.layers import StackedLinear
from torch import nn


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.down = nn.Linear(16, 8)
        self.stacked = StackedLinear([self.q, self.k, self.v])


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 8)


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.model = _Inner()
        self.lm_head = None  # tied: the logits use the embedding


def test_weights_are_the_shapes_that_run_once_each() -> None:
    lm = _LM()
    shapes = sorted(tuple(w.shape) for w in _blas_warm.matmul_weights(lm))
    # q [8, 8], k and v [4, 8] (one shape), down [8, 16], the stack [16, 8]: per shape, once
    assert shapes == [(4, 8), (8, 8), (8, 16), (16, 8)]


def test_sizes_cover_aligned_and_unaligned_counts_up_to_the_budget() -> None:
    sizes = _blas_warm.warm_sizes(600, step=128)
    assert sizes[:4] == [1, 2, 3, 4] and max(sizes) == 513  # 640 is past the budget
    for m in (128, 129, 256, 257, 384, 385, 512, 513, 64, 65):
        assert m in sizes
    assert 130 not in sizes and len(sizes) == len(set(sizes))
    # every 128 up to 8,192, then ~1/16 of the count apart: a 64k budget stays small
    big = [m for m in _blas_warm.warm_sizes(65536) if m % 2 == 0 and m >= 128]
    assert big[:64] == [128 * i for i in range(1, 65)] and big[-1] <= 65536
    assert all(b - a <= max(128, a // 16) for a, b in itertools.pairwise(big))
    assert len(big) < 110 and 65536 - big[-1] <= 65536 // 16
    with pytest.raises(ValueError, match="max_tokens=0"):
        _blas_warm.warm_sizes(0)


def test_warm_model_runs_every_shape_and_the_tied_logits_up_to_the_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, tuple[int, ...]]] = []
    real = _blas_warm.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((x.shape[0], tuple(w.shape)))
        return real(x, w, b)

    monkeypatch.setattr(_blas_warm, "linear", spy)
    lm = _LM()
    n = _blas_warm.warm_model(lm, max_tokens=300, max_rows=5)
    sizes = _blas_warm.warm_sizes(300)
    assert n == len(calls) == 4 * len(sizes) + len([m for m in sizes if m <= 5])
    logits = [m for m, shape in calls if shape == (32, 8)]  # the tied embedding
    assert logits == [1, 2, 3, 4, 5]
    assert {m for m, shape in calls if shape == (16, 8)} == set(sizes)  # the stack, every count
