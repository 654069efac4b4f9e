"""Fused elementwise ops of a decoder layer, each one launch where torch takes several:
``rms_norm`` (optionally with the residual add: vLLM's ``fused_add_rms_norm``),
``silu_and_mul`` / ``gelu_tanh_and_mul``, in-place ``rotary_embedding`` (NeoX and GPT-J
pairs, partial rotary) and ``rope_and_cache`` (RoPE fused into an unquantized cache write),
with ``rope_cos_sin_cache`` building the table the RoPE ops read."""

from __future__ import annotations

from kv_kernels.fused.api import (
    gelu_tanh_and_mul,
    rms_norm,
    rope_and_cache,
    rope_cos_sin_cache,
    rotary_embedding,
    silu_and_mul,
)

# Last: registers torch.ops.kv_kernels.{rms_norm, act_and_mul, rotary_embedding, rope_and_cache}
# (it imports the api above, never the reverse).
from kv_kernels.fused import _ops  # noqa: F401  isort: skip

__all__ = [
    "gelu_tanh_and_mul",
    "rms_norm",
    "rope_and_cache",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "silu_and_mul",
]
