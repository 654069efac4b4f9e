"""``sample`` picks every token on the device and reads them with one ``tolist`` (issue 32: at
most one device-to-host sync a step). The tokens must be exactly those of the per-row form it
replaced (a boolean-mask top-p filter and an ``.item()`` a sampled row): the same filter values
and the same draws from each request's generator.

Planted: a top-p filter that writes the kept values back through the wrong permutation
(``gather`` instead of ``scatter``) differs from the reference, so the equality would catch a
wrong-page style mix-up of vocabulary order."""

from __future__ import annotations

import pytest
import torch
from kvstack.engine.sampling import SamplingParams, _filter, make_generator, sample


def _filter_masked(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The filter as it was: top-p by boolean indexing (a device sync a row on CUDA); top-k
    did not change, so it is the engine's own."""
    logits = _filter(logits, top_k, 1.0)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def _sample_per_row(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> list[int]:
    """``sample`` as it was: an ``.item()`` per sampled row."""
    out = logits.argmax(dim=-1).tolist()
    for r, (p, gen) in enumerate(zip(params, gens, strict=True)):
        if p.greedy:
            continue
        row = _filter_masked(logits[r].float() / p.temperature, p.top_k, p.top_p)
        out[r] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen).item())
    return out


CASES = [(0, 1.0), (5, 1.0), (0, 0.9), (0, 0.3), (7, 0.5), (50, 0.99), (1, 1.0), (0, 1e-6)]


@pytest.mark.parametrize(("top_k", "top_p"), CASES)
def test_filter_equals_the_masked_form(top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100))
    for _ in range(5):
        logits = torch.randn(257, generator=g) * 3
        logits[::17] = logits[0]  # ties across the sort
        assert torch.equal(_filter(logits, top_k, top_p), _filter_masked(logits, top_k, top_p))


def test_a_filter_through_the_wrong_permutation_is_caught() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    kept = sorted_logits.masked_fill((torch.cumsum(probs, dim=-1) - probs) >= 0.5, float("-inf"))
    wrong = kept.gather(0, order)  # (what gather in place of scatter would give)
    assert not torch.equal(wrong, _filter_masked(logits, 0, 0.5))


def test_sampled_tokens_equal_the_per_row_form_draw_for_draw() -> None:
    """A batch mixing greedy and seeded rows, over several steps (each generator advances):
    every token equals the per-row form's, on twin generators."""
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=20, seed=2),
        SamplingParams(temperature=1.0, top_p=0.8, seed=3),
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.6, seed=4),
    ]
    mine = [make_generator(p, "cpu") for p in kinds]
    twin = [make_generator(p, "cpu") for p in kinds]
    g = torch.Generator().manual_seed(11)
    drawn = 0
    for _ in range(20):
        logits = torch.randn(len(kinds), 1000, generator=g) * 2
        got = sample(logits, kinds, mine)
        assert got == _sample_per_row(logits, kinds, twin)
        assert all(type(t) is int for t in got)
        drawn += sum(not p.greedy for p in kinds)
    assert drawn == 80
