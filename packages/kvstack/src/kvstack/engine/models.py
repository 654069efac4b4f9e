"""The decoder of every supported family as one readable torch module.

Llama, Mistral, Qwen3 and gpt-oss share one skeleton (pre-norm decoder layers, RoPE, GQA); they
differ only in switches read from :class:`ArchConfig`: q/k RMSNorm per head (Qwen3), projection
biases, sinks and a mixture of experts (gpt-oss), sliding-window layers (Mistral, gpt-oss, some
Qwen3), ``v_head_dim != head_dim`` (kvstack's DiffKV flag). Parameter names are the checkpoint's.

Attention itself is not in here: each layer hands its rotated ``q``, ``k``, ``v`` to an
``attend(layer, q, k, v)`` callback. The :class:`kvstack.engine.ModelRunner` passes one that writes
K/V into the paged cache and runs a kv-backends impl; :meth:`CausalLM.forward_dense` passes
:func:`dense_attention`, a cache-free reference over one sequence, so a test can tell a model bug
(both disagree with transformers) from a paging bug (only the runner does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from kvstack.engine.hf_config import ArchConfig
from kvstack.engine.layers import (
    GatedMLP,
    GptOssMoE,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    StackedLinear,
    linear,
    transposed,
)

__all__ = ["AttendFn", "Attention", "CausalLM", "DecoderLayer", "dense_attention"]

#: ``attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]) -> out [T, Hq, Dv]``
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence at positions ``0..T-1``, float32 math.

    ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hkv, D]``, ``v`` ``[T, Hkv, Dv]`` -> ``[T, Hq, Dv]`` in
    ``q.dtype``. A window ``w`` lets position ``p`` see keys ``p - w < j <= p``; a sink adds
    ``exp(sink)`` to the softmax denominator (a logit column whose probability is dropped).
    """
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)  # [T, Hq, D]
    vv = v.float().repeat_interleave(group, dim=1)  # [T, Hq, Dv]
    logits = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale  # [Hq, T, T]
    pos = torch.arange(t, device=q.device)
    visible = pos[None, :] <= pos[:, None]  # [T(q), T(k)]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.float()[:, None, None].expand(hq, t, 1)
        probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)


class Attention(nn.Module):
    """Projections (and Qwen3's per-head q/k norm, gpt-oss's sinks) of one attention layer."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        h, d, dv = arch.hidden_size, arch.head_dim, arch.v_head_dim
        bias = arch.attention_bias
        self.num_q_heads, self.num_kv_heads = arch.num_q_heads, arch.num_kv_heads
        self.head_dim, self.v_head_dim = d, dv
        self.q_proj = Linear(h, arch.num_q_heads * d, bias=bias)
        self.k_proj = Linear(h, arch.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, arch.num_kv_heads * dv, bias=bias)
        self.o_proj = Linear(arch.num_q_heads * dv, h, bias=bias)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(arch.num_q_heads)) if arch.has_sinks else None
        self.stacked: StackedLinear | None = None
        self._qk_weight: tuple[torch.Tensor, torch.Tensor, tuple[int, int], torch.Tensor] | None = (
            None
        )

    def stack_projections(self) -> None:
        """Run q, k and v as one matmul (see :class:`StackedLinear`); call once weights are in."""
        self.stacked = StackedLinear([self.q_proj, self.k_proj, self.v_proj])

    def qkv(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> rotated ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hkv, D]``, ``v``
        ``[T, Hkv, Dv]``; q and k are head slices of one rotated tensor, v a column slice of the
        projection (none of the three is contiguous: attention reads them through strides)."""
        t, hq, hk, d = x.shape[0], self.num_q_heads, self.num_kv_heads, self.head_dim
        out = self.stacked.fused(x) if self.stacked is not None else None
        if out is None:  # not stacked, or a parameter was replaced since
            out = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        # q and k side by side, [T, Hq + Hkv, D]: the per-head norm and RoPE treat every head
        # alike, so one set of ops covers both, with the same values element for element. Each
        # is a handful of small ops per layer, and on a small model's decode step small ops, not
        # arithmetic, are the cost.
        qk = out[:, : (hq + hk) * d].view(t, hq + hk, d)
        v = out[:, (hq + hk) * d :].view(t, hk, self.v_head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3: RMSNorm over each head's dims, before RoPE (q heads take q_norm's weight,
            # k heads k_norm's; the two norms share eps).
            qk = self.q_norm(qk, self._qk_norm_weight(self.q_norm.weight, self.k_norm.weight))
        qk = rotary(qk, cos, sin)
        return qk[:, :hq], qk[:, hq:], v

    def _qk_norm_weight(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        """``[Hq + Hkv, D]``: q_norm's weight for each q head, k_norm's for each k head. Under
        no_grad it is kept between calls (three ops per layer and step otherwise) and remade when
        either weight is replaced or edited in place (its version counter moves). Inference
        tensors (weights loaded under ``torch.inference_mode``) keep no version counter, so for
        them it is remade every call."""
        inference = qw.is_inference() or kw.is_inference()
        key = None if inference else (qw._version, kw._version)
        cached = self._qk_weight
        if cached is not None and cached[0] is qw and cached[1] is kw and cached[2] == key:
            return cached[3]
        hq, hk, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        weight = torch.cat([qw.expand(hq, d), kw.expand(hk, d)])
        # (a kept copy would cut the weights out of autograd)
        if key is not None and not torch.is_grad_enabled():
            self._qk_weight = (qw, kw, key, weight)
        return weight


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        gpt_oss = arch.family == "gpt_oss"
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, weight_first=gpt_oss)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(
            arch.hidden_size, arch.rms_norm_eps, weight_first=gpt_oss
        )
        self.mlp: nn.Module
        if arch.is_moe:
            self.mlp = GptOssMoE(
                arch.hidden_size,
                arch.intermediate_size,
                arch.num_experts,
                arch.num_experts_per_tok,
                arch.swiglu_alpha,
                arch.swiglu_limit,
            )
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias)


class _Backbone(nn.Module):
    """``model.*`` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        # Uninitialised like every weight here (see layers.Linear); the loader fills it.
        self.embed_tokens = nn.Embedding(
            arch.vocab_size,
            arch.hidden_size,
            _weight=torch.empty(arch.vocab_size, arch.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(
            arch.hidden_size, arch.rms_norm_eps, weight_first=arch.family == "gpt_oss"
        )


class CausalLM(nn.Module):
    """A decoder-only LM over flat (varlen) token batches: ``input_ids`` ``[T]`` with their
    ``positions`` ``[T]``; requests are told apart by the ``attend`` callback, not by a batch dim."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = _Backbone(arch)
        # Tied checkpoints store no lm_head; logits then use the embedding matrix.
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else Linear(arch.hidden_size, arch.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim)
        self.scale = arch.head_dim**-0.5
        self._logits_weight_t: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        # The residual stream is added to in place: x is this call's own tensor (the
        # embedding's output) and nothing else holds it, so each add saves an allocation.
        for i, layer in enumerate(self.decoder_layers()):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.qkv(h, self.rotary, cos, sin)
            o = attend(i, q, k, v)  # [T, Hq, Dv]
            x.add_(attn.o_proj(o.reshape(o.shape[0], -1)))
            x.add_(layer.mlp(layer.post_attention_layernorm(x)))
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[R, vocab]`` of hidden states ``[R, hidden]``."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        kept = transposed(self._logits_weight_t, weight)
        if kept is not self._logits_weight_t:  # nn.Module.__setattr__ is slow: set only on change
            self._logits_weight_t = kept
        return linear(hidden, weight, None, kept[1]).float()

    def stack_projections(self) -> None:
        """Run each layer's q/k/v (and a gated MLP's gate/up) projections as one matmul, once the
        weights are in (the loader calls it). Names, shapes and values of every parameter stay
        as the checkpoint gave them (see :class:`~kvstack.engine.layers.StackedLinear`)."""
        for layer in self.decoder_layers():
            layer.self_attn.stack_projections()
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.stack_projections()

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    def layer_sinks(self, i: int) -> torch.Tensor | None:
        """Layer ``i``'s sink logits ``[num_q_heads]`` (gpt-oss), else ``None``."""
        return cast(DecoderLayer, self.model.layers[i]).self_attn.sinks

    @torch.no_grad()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free reference: float32 logits ``[T, vocab]`` of one sequence ``[T]`` at
        positions ``0..T-1``, every layer attending through :func:`dense_attention`."""
        if input_ids.dim() != 1:
            raise ValueError(
                f"forward_dense takes one sequence, int64 [T]; got shape {tuple(input_ids.shape)}"
            )
        arch = self.arch

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dense_attention(
                q,
                k,
                v,
                scale=self.scale,
                sliding_window=arch.layer_window(i),
                sinks=self.layer_sinks(i),
            )

        positions = torch.arange(input_ids.numel(), device=input_ids.device)
        return self.compute_logits(self.forward(input_ids, positions, attend))
