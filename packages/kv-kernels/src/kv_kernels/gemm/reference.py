"""The skinny GEMM's torch reference: ``nn.Linear``'s ``y = x @ W^T + bias``, as a reader
checks it by eye (the CPU path, and the oracle of the parity tests at float64)."""

from __future__ import annotations

import torch

__all__ = ["skinny_linear_reference"]


def skinny_linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """``x @ weight.T + bias`` in ``x``'s dtype (torch's own accumulation and rounding)."""
    y = x @ weight.T
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
