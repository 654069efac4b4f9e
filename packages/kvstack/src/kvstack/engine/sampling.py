"""Picking the next token: greedy, or seeded temperature / top-k / top-p sampling.

Each sampled request owns a ``torch.Generator`` seeded from its :class:`SamplingParams`, so its
tokens depend only on its own logits and seed, never on which requests shared its batch (the
property continuous batching needs for reproducible sampling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "make_generator", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    - ``max_new_tokens``: tokens to generate (it stops earlier on a stop token).
    - ``temperature``: ``0`` is greedy (argmax; ``top_k``/``top_p``/``seed`` unused).
    - ``top_k``: keep the ``k`` most likely tokens (``0``: all). ``top_p``: keep the smallest set
      whose probability reaches ``p`` (``1.0``: all). Both apply after the temperature.
    - ``seed``: seeds the request's own generator (``None``: drawn from torch's global RNG once).
    - ``stop_token_ids``: finish when one is generated (it is kept in the output);
      ``ignore_eos`` drops the model's EOS ids from the stop set (random-weight models, benchmarks).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an int >= 1"
            )
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0
        ):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"SamplingParams.seed={self.seed!r} must be an int or None")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own generator (``None`` for greedy requests: they draw nothing)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    gen.manual_seed(seed)
    return gen


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` ``[V]`` with everything outside top-k / top-p set to ``-inf``."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first one always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` ``[R, vocab]`` (float32), row ``r`` with ``params[r]``."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} must be [R, vocab] with R = len(params) = "
            f"len(generators) (got {len(params)} and {len(generators)})"
        )
    out = logits.argmax(dim=-1).tolist()  # greedy rows: one batched argmax, one sync
    for r, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        row = _filter(logits[r].float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        out[r] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out  # tolist() gave Python ints; the sampled rows hold int() of an item
