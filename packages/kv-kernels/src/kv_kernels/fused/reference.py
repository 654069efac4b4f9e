"""Readable torch references of the fused elementwise ops (any device; float32 arithmetic).

Each is what the unfused torch sequence of a decoder layer computes, with every intermediate in
float32 and one rounding to the input dtype at the points a model's own code rounds:

- ``rms_norm``: ``h = x + residual`` rounded to the input dtype (it is the residual stream the
  next layer adds to, so it is stored in that dtype), then ``h / rms(h)`` in float32 and the gain
  ``weight + weight_offset``; Llama's order rounds the normalized row before the gain multiply,
  ``weight_first`` (Gemma, gpt-oss) multiplies in float32 and rounds once.
- ``silu_and_mul`` / ``gelu_tanh_and_mul``: ``act(x[..., :d]) * x[..., d:]``, rounded once.
- ``rotary_embedding``: each pair ``(x1, x2)`` of the first ``rotary_dim`` columns becomes
  ``(x1 cos - x2 sin, x2 cos + x1 sin)`` with ``cos``/``sin`` read from the cache row of the token's
  position; NeoX pairs column ``i`` with ``i + rotary_dim / 2``, GPT-J pairs ``2i`` with ``2i + 1``.

Inputs are assumed validated by :mod:`kv_kernels.fused.api`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "gelu_tanh_and_mul_reference",
    "rms_norm_reference",
    "rotary_embedding_reference",
    "silu_and_mul_reference",
]


def rms_norm_reference(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D], or [H, D] for x [T, H, D]
    eps: float,
    residual: torch.Tensor | None,  # [..., D] like x
    weight_offset: float,
    weight_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)``: ``h = x + residual`` (``x`` itself without a residual) in ``x.dtype`` and
    ``y = h / sqrt(mean(h^2) + eps) * (weight + weight_offset)`` in ``x.dtype``."""
    dtype = x.dtype
    h = x if residual is None else (x.float() + residual.float()).to(dtype)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    gain = weight.float() + weight_offset  # [D] or [H, D]: broadcasts over the rows
    if weight_first:
        y = (normed * gain).to(dtype)
    else:
        y = (normed.to(dtype).float() * gain).to(dtype)
    return y, h


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[..., 2d]``; ``[..., d]`` in ``x.dtype``."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` (Gemma's ``gelu_pytorch_tanh``) in ``x.dtype``."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def rotary_embedding_reference(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T', Hq, D], rotated in place (first T tokens)
    k: torch.Tensor | None,  # [T', Hk, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]: cos then sin, rotary_dim / 2 each
    is_neox: bool,
    rotary_dim: int,
) -> None:
    """Rotate the first ``rotary_dim`` columns of the first ``T = positions.numel()`` tokens of
    ``q`` and ``k`` in place; the other columns and tokens are left as they are."""
    num_tokens = positions.numel()
    half = rotary_dim // 2
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, rotary_dim]
    cos = cos_sin[:, None, :half]  # [T, 1, half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        if x is None:
            continue
        rot = x[:num_tokens, :, :rotary_dim].float()  # [T, H, rotary_dim]
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox:
            new = torch.cat([o1, o2], dim=-1)
        else:
            new = torch.stack([o1, o2], dim=-1).flatten(-2)  # back to interleaved
        x[:num_tokens, :, :rotary_dim] = new.to(x.dtype)
