"""cuBLAS's kernels for the model's matmuls loaded at startup, not inside the first requests.

cuBLAS picks a kernel for each GEMM shape on the host, and loads a kernel the first time one
runs. On an H200 (torch 2.11, CUDA 13, bf16 Llama-3-8B projections), a linear at a token count
not seen before costs ~150 us of host time, and one whose pick is a kernel not loaded yet costs
3-5 ms: the first count of a size class, and again the first count that is not a multiple of 16.
A step that prefills beside decodes has a new token count almost every time, so the engine's
mixed steps on that card stalled the device for 3-5 ms at their first layer's output projection
(``docs/benchmarks/engine_gpu.*``: ``stall_hosts``).

:func:`warm_matmuls` runs each distinct weight shape once at token counts spread over the range
a step can take (powers of two up to ``step``, then every ``step``, each also one past it), so
the kernels a step's counts pick are loaded before serving. The per-count host cost remains.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvstack.engine.layers import StackedLinear, linear

if TYPE_CHECKING:
    from kvstack.engine.models import CausalLM

__all__ = ["matmul_weights", "warm_matmuls", "warm_model", "warm_sizes"]


def matmul_weights(model: nn.Module) -> list[torch.Tensor]:
    """One weight ``[N, K]`` for each distinct ``(N, K, dtype, device)`` the model's linears
    multiply by: each ``nn.Linear`` and each :class:`StackedLinear` (the stacked q/k/v and
    gate/up run as one matmul of the summed width)."""
    seen: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}

    def add(w: torch.Tensor) -> None:
        if w.dim() == 2:
            seen.setdefault((w.shape[0], w.shape[1], w.dtype, w.device), w)

    for m in model.modules():
        if isinstance(m, nn.Linear):
            add(m.weight)
        for value in vars(m).values():
            if isinstance(value, StackedLinear):
                add(value.weight)
    return list(seen.values())


def warm_sizes(max_tokens: int, step: int = 128) -> list[int]:
    """The token counts :func:`warm_matmuls` runs: 1, 2, 4 ... ``step``, then multiples of
    ``step`` up to ``max_tokens`` -- every one up to ``64 * step`` (8,192 tokens, the grid
    measured on the H200), then one every ~1/16 of the count (cuBLAS's pick changes ever more
    rarely as the count grows, and a 64k-token budget would otherwise warm 1,024 counts) --
    each also one past it (cuBLAS's pick for a count that is not a multiple of 16 is another
    kernel), none past ``max_tokens``."""
    if max_tokens < 1 or step < 1:
        raise ValueError(f"max_tokens={max_tokens} and step={step} must be >= 1")
    sizes = {1 << i for i in range(step.bit_length()) if 1 << i <= step}
    m = step
    while m <= max_tokens:
        sizes.add(m)
        m += step if m < 64 * step else max(step, m // 16 // step * step)
    sizes |= {m + 1 for m in sizes}
    return sorted(m for m in sizes if m <= max_tokens)


def warm_matmuls(
    weights: Iterable[torch.Tensor], sizes: Iterable[int], limits: dict[int, int] | None = None
) -> int:
    """Run ``linear(x[:M], w)`` for each weight and each count ``M`` of ``sizes`` (at most
    ``limits[id(w)]`` for a weight given one: the logits' projection sees at most the batch's
    sampled rows). Returns the number of calls."""
    limits = limits or {}
    calls = 0
    inputs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
    counts = sorted(sizes)
    with torch.no_grad():
        for w in weights:
            top = [m for m in counts if m <= limits.get(id(w), counts[-1])]
            if not top:
                continue
            key = (w.shape[1], w.dtype, w.device)
            x = inputs.get(key)
            if x is None or x.shape[0] < top[-1]:
                x = inputs[key] = torch.zeros(top[-1], w.shape[1], dtype=w.dtype, device=w.device)
            for m in top:
                linear(x[:m], w, None)
                calls += 1
    return calls


def warm_model(model: CausalLM, max_tokens: int, max_rows: int) -> int:
    """:func:`warm_matmuls` over a :class:`~kvstack.engine.models.CausalLM`'s linears at every
    count of :func:`warm_sizes` up to ``max_tokens`` (a step's token budget), the logits'
    projection (``lm_head``, or the tied embedding) up to ``max_rows`` (the sampled rows)."""
    logits = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    weights = matmul_weights(model)
    if not any(w is logits for w in weights):
        weights.append(logits)
    return warm_matmuls(weights, warm_sizes(max_tokens), {id(logits): max_rows})
