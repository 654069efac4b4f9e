"""Rotary position embeddings: the inverse frequencies of each RoPE type (default, linear,
Llama 3.1, YaRN); :class:`RotaryEmbedding`, which rotates heads with torch ops from per-step
cos/sin or keeps the ``[max_positions, dim]`` table that kv-kernels' fused ``rotary_embedding``
reads; and one step's rotation either way (:class:`TorchRope`, :class:`FusedRope`), which the
attention layers call. Split from :mod:`kvstack.engine.layers` and :mod:`kvstack.engine.models`
(which re-export their old names) by job.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from kv_kernels.fused import rope_cos_sin_cache, rotary_embedding
from torch import nn

from kvstack.engine.hf_config import RopeConfig

__all__ = [
    "FusedRope",
    "Rope",
    "RotaryEmbedding",
    "TorchRope",
    "rope_inv_freq",
    "rotate_partial",
]


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the dispatch when it is a no-op (float32 models)."""
    return x if x.dtype == dtype else x.to(dtype)


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies ``[dim // 2]`` (float32) for ``rope`` over a ``dim``-wide head."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = rope.theta**exponents  # [dim // 2]
    inv_freq = 1.0 / base
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, base, dim)
    return inv_freq


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    # Llama 3.1: long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
    # the band in between blended linearly in 1/wavelength.
    assert rope.low_freq_factor is not None and rope.high_freq_factor is not None
    assert rope.original_max_position_embeddings is not None
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(rope: RopeConfig, base_pow: torch.Tensor, dim: int) -> torch.Tensor:
    # YaRN: dimensions that rotate many times over the pretraining context keep their frequency
    # (extrapolation), slow ones are interpolated by `factor`, a linear ramp in between.
    assert rope.original_max_position_embeddings is not None
    omp = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(omp / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    inv_extra = 1.0 / base_pow
    inv_inter = 1.0 / (rope.factor * base_pow)
    return inv_inter * (1 - extrapolation) + inv_extra * extrapolation


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (the "rotate_half" convention of every family here).

    ``forward(x, positions)`` takes ``x`` ``[T, H, D]`` and int64 ``positions`` ``[T]``.
    """

    inv_freq: torch.Tensor
    head_freq: torch.Tensor
    sin_scale: torch.Tensor
    cos_sin_cache: torch.Tensor | None  # built by build_cos_sin_cache (the fused RoPE's table)

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary head_dim={dim} must be even")
        self.register_buffer("inv_freq", rope_inv_freq(rope, dim), persistent=False)
        self.scaling = rope.yarn_attention_factor()
        # Over a whole head: each frequency twice, and the sin's factor, -scaling over the first
        # half (rotate_half's sign) and +scaling over the second, in float32 as the product
        # with the Python float would take it.
        self.register_buffer("head_freq", self.inv_freq.repeat(2), persistent=False)
        sin_scale = torch.full((dim,), self.scaling, dtype=torch.float32)
        sin_scale[: dim // 2] *= -1
        self.register_buffer("sin_scale", sin_scale, persistent=False)
        self.register_buffer("cos_sin_cache", None, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` ``[T, 1, D]`` in ``dtype`` (computed in float32, like
        transformers): each frequency's cos and sin, repeated over both halves of the head, the
        sin negated in the first half, so :meth:`forward` rotates with whole-head ops."""
        head_freq, sin_scale = self.head_freq, self.sin_scale
        if head_freq.device != positions.device:
            head_freq, sin_scale = head_freq.to(positions.device), sin_scale.to(positions.device)
        freqs = positions.float()[:, None] * head_freq  # [T, D]
        cos = _cast(freqs.cos() * self.scaling, dtype)
        # A sign flip is exact, so the first half is -(sin * scaling) bit for bit.
        sin = _cast(freqs.sin() * sin_scale, dtype)
        return cos[:, None, :], sin[:, None, :]

    def build_cos_sin_cache(self, max_positions: int, dtype: torch.dtype) -> None:
        """Keep :attr:`cos_sin_cache` ``[max_positions, dim]`` in ``dtype`` on this module's
        device (a non-persistent buffer): row ``p`` is ``cos(p * inv_freq)`` then ``sin(p *
        inv_freq)``, times YaRN's scaling, the table kv-kernels' ``rotary_embedding`` reads. The
        same float32 products as :meth:`cos_sin`, rounded to the model's dtype as transformers
        rounds its cos/sin (``dtype`` float32 keeps them as they are)."""
        self.cos_sin_cache = rope_cos_sin_cache(
            self.inv_freq, max_positions, scaling=self.scaling, dtype=dtype
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` of the halves ``x1``, ``x2`` (``cos``,
        ``sin`` from :meth:`cos_sin`) as ``x * cos + cat(x2, x1) * sin``: the same products and
        sums (``a - b`` is ``a + (-b)`` exactly, and ``sin`` carries the sign), in four ops
        instead of seven; per layer and step, host time is what a small model's decode costs."""
        x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
        out = x * cos
        return out.add_(torch.cat([x2, x1], dim=-1).mul_(sin))  # cat's own tensor: in place


def rotate_partial(
    rotary: RotaryEmbedding, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int
) -> torch.Tensor:
    """RoPE over the first ``dim`` of each head of ``x`` ``[T, H, D]`` (the rest passes through,
    transformers' partial rotary); all of it when ``dim == D``."""
    if dim == x.shape[-1]:
        return rotary(x, cos, sin)
    return torch.cat([rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)


class TorchRope(NamedTuple):
    """One step's RoPE through torch ops: a table's :class:`RotaryEmbedding` and the step's
    ``cos``/``sin`` ``[T, 1, dim]`` (from :meth:`RotaryEmbedding.cos_sin`)."""

    rotary: RotaryEmbedding
    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, x: torch.Tensor, dim: int, num_q_heads: int) -> torch.Tensor:
        """``x`` ``[T, H, D]`` with the first ``dim`` of each head rotated (a new tensor; q and
        k heads alike, so ``num_q_heads`` does not matter)."""
        return rotate_partial(self.rotary, x, self.cos, self.sin, dim)


class FusedRope(NamedTuple):
    """One step's RoPE through kv-kernels' ``rotary_embedding``: the step's ``positions`` ``[T]``
    and the table's ``cos_sin_cache`` ``[max_positions, dim]``
    (:meth:`RotaryEmbedding.build_cos_sin_cache`). Rotate-half pairs (``is_neox``), as every
    family served here (MLA's interleaved pairs keep :class:`TorchRope`)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    impl: str

    def __call__(self, x: torch.Tensor, dim: int, num_q_heads: int) -> torch.Tensor:
        """``x`` ``[T, Hq + Hk, D]`` (unit last stride, any token/head strides) rotated in place
        over the first ``dim`` of each head, one launch for all; returns ``x``. q and k go in as
        the op's two tensors: its head tiles are sized for k's few heads."""
        rotary_embedding(
            self.positions, x[:, :num_q_heads], x[:, num_q_heads:], self.cos_sin_cache,
            is_neox=True, rotary_dim=dim, impl=self.impl,
        )  # fmt: skip
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` rotated in place over the table's width
        (the layer's rotary dims): what :meth:`__call__` does to their heads, for a caller that
        got them unrotated (:mod:`kvstack.engine.attend`'s fallback)."""
        rotary_embedding(
            self.positions, q, k, self.cos_sin_cache, is_neox=True,
            rotary_dim=self.cos_sin_cache.shape[1], impl=self.impl,
        )  # fmt: skip


#: What rotates a step's heads: ``rope(qk [T, Hq + Hk, D], dim, Hq)`` -> ``qk`` rotated over the
#: first ``dim`` of each head (q heads first, then k heads).
Rope = TorchRope | FusedRope
