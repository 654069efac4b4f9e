"""The decoder of every supported family as one readable torch module.

Every family (:mod:`kvstack.engine.archs`) shares one skeleton (pre-norm decoder layers, RoPE,
GQA); they differ only in switches read from :class:`ArchConfig`: q/k RMSNorm per head (Qwen3,
Gemma-3), projection biases (Qwen2, gpt-oss), sinks (gpt-oss; MiMo-V2-Flash's sliding layers),
sliding-window layers, RoPE per layer type and partial rotary (Gemma-3, MiMo-V2-Flash), Gemma's
``1 + w`` norms after each sublayer, embedding scale, ``query_pre_attn_scalar`` and softcaps, value
scaling (MiMo-V2-Flash), ``v_head_dim != head_dim``, the MLP or mixture of experts per layer
(gpt-oss, Mixtral, Qwen3-MoE, DeepSeek-V3, MiMo-V2-Flash), and DeepSeek-V3's multi-head latent
attention (:class:`MLAAttention`). Parameter names are the checkpoint's.

On CUDA the runner switches the elementwise ops to kv-kernels' fused Triton ops once, at build
(:meth:`CausalLM.use_fused_ops`): the residual add with the next RMSNorm, the activation with the
up projection's product, RoPE in place on the q/k heads. The residual stream flows vLLM's way for
both: each norm takes the sublayer's output and the stream (``norm.add_norm(x, residual) ->
(normed, residual)``), so the add can ride in the norm's launch; on the CPU the torch ops run in
the same order as before, bit for bit.

Attention itself is not in here: each layer hands its rotated ``q``, ``k``, ``v`` to an
``attend(layer, q, k, v)`` callback. The :class:`kvstack.engine.ModelRunner` passes one that writes
K/V into the paged cache and runs a kv-backends impl; :meth:`CausalLM.forward_dense` passes
:func:`dense_attention`, a cache-free reference over one sequence, so a test can tell a model bug
(both disagree with transformers) from a paging bug (only the runner does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import torch
from torch import nn

from kvstack.engine.hf_config import ArchConfig
from kvstack.engine.layers import (
    GatedMLP,
    GptOssMoE,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
    StackedLinear,
    linear,
    transposed,
)
from kvstack.engine.mla import MLAAttention, MLASplitFn
from kvstack.engine.moe_grouped import grouped_mm_available
from kvstack.engine.rotary import FusedRope, Rope, TorchRope, rotate_partial

__all__ = [
    "AttendFn",
    "AttendRopeFn",
    "Attention",
    "CausalLM",
    "DecoderLayer",
    "FusedRope",
    "MLAAttention",
    "RopeAttend",
    "TorchRope",
    "dense_attention",
    "rotate_partial",
]

#: ``attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]) -> out [T, Hq, Dv]``
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``attend_rope(layer_index, q, k, v, rope) -> out``: an :data:`AttendFn` for a layer whose
#: ``q`` and ``k`` come unrotated (head slices of one tensor): it rotates them in place with the
#: step's ``rope`` as it writes K to the cache (kv-kernels' ``rope_and_cache``).
AttendRopeFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, FusedRope], torch.Tensor]


class RopeAttend(NamedTuple):
    """Which layers' RoPE rides in attention's cache write (:mod:`kvstack.engine.attend`), for
    one :meth:`CausalLM.forward`: layer ``i`` with ``layers[i]`` hands ``attend`` its q and k
    unrotated, with the step's :class:`FusedRope`, when the model's RoPE is the fused one (with
    the torch RoPE every layer rotates its own, as without this)."""

    layers: tuple[bool, ...]  # [num_layers]
    attend: AttendRopeFn


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of one sequence at positions ``0..T-1``, float32 math.

    ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hkv, D]``, ``v`` ``[T, Hkv, Dv]`` -> ``[T, Hq, Dv]`` in
    ``q.dtype``. A window ``w`` lets position ``p`` see keys ``p - w < j <= p``; a sink adds
    ``exp(sink)`` to the softmax denominator (a logit column whose probability is dropped);
    ``softcap > 0`` maps each scaled logit ``s`` to ``softcap * tanh(s / softcap)`` before masking.
    """
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)  # [T, Hq, D]
    vv = v.float().repeat_interleave(group, dim=1)  # [T, Hq, Dv]
    logits = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale  # [Hq, T, T]
    if softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
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
    """Projections (and the per-head q/k norm, sinks, value scale) of one attention layer."""

    def __init__(self, arch: ArchConfig, layer: int = 0) -> None:
        super().__init__()
        h, d, dv = arch.hidden_size, arch.head_dim, arch.v_head_dim
        bias = arch.attention_bias
        kv_heads = arch.layer_num_kv_heads(layer)
        self.num_q_heads, self.num_kv_heads = arch.num_q_heads, kv_heads
        self.head_dim, self.v_head_dim = d, dv
        self.rotary_dim = arch.rotary_dim(layer)
        self.v_scale = arch.v_scale
        self.q_proj = Linear(h, arch.num_q_heads * d, bias=bias)
        self.k_proj = Linear(h, kv_heads * d, bias=bias)
        self.v_proj = Linear(h, kv_heads * dv, bias=bias)
        self.o_proj = Linear(arch.num_q_heads * dv, h, bias=arch.o_proj_bias)
        # Gemma-3's q/k norms scale by (1 + w) and cast back after the multiply.
        norm = dict(eps=arch.rms_norm_eps, offset=arch.norm_offset)
        first = bool(arch.norm_offset)
        self.q_norm = RMSNorm(d, **norm, weight_first=first) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, **norm, weight_first=first) if arch.qk_norm else None
        self.sinks = (
            nn.Parameter(torch.empty(arch.num_q_heads)) if arch.layer_has_sinks(layer) else None
        )
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
        """:meth:`project` with torch's RoPE (``cos``, ``sin`` from ``rotary.cos_sin``)."""
        return self.project(x, TorchRope(rotary, cos, sin))

    def project(
        self, x: torch.Tensor, rope: Rope | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> rotated ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hkv, D]``, ``v``
        ``[T, Hkv, Dv]``; q and k are head slices of one rotated tensor, v a column slice of the
        projection (none of the three is contiguous: attention reads them through strides).
        ``rope=None``: q and k unrotated (the caller rotates them in the cache write)."""
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
        if rope is not None:
            qk = rope(qk, self.rotary_dim, hq)
        if self.v_scale != 1.0:
            v = v * self.v_scale  # MiMo-V2-Flash: values scaled before attention
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
    def __init__(self, arch: ArchConfig, layer: int = 0) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        # Gemma's (1 + w) norms cast back after the multiply, as gpt-oss's do.
        first, off = arch.norm_weight_first or bool(arch.norm_offset), arch.norm_offset

        def norm() -> RMSNorm:
            return RMSNorm(h, eps, weight_first=first, offset=off)

        self.input_layernorm = norm()
        self.self_attn: Attention | MLAAttention = (
            MLAAttention(arch, layer) if arch.is_mla else Attention(arch, layer)
        )
        self.post_attention_layernorm = norm()
        self.sandwich = arch.sandwich_norms
        if self.sandwich:  # Gemma: norms around the MLP as well
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        mlp: nn.Module
        if arch.layer_mlp(layer) == "dense":
            mlp = GatedMLP(h, arch.intermediate_size, bias=arch.mlp_bias, act=arch.hidden_act)
        elif arch.moe_kind == "gpt_oss":
            mlp = GptOssMoE(
                h,
                arch.intermediate_size,
                arch.num_experts,
                arch.num_experts_per_tok,
                arch.swiglu_alpha,
                arch.swiglu_limit,
            )
        else:
            mlp = SparseMoE(
                arch.moe_kind,
                h,
                arch.moe_intermediate_size,
                arch.num_experts,
                arch.num_experts_per_tok,
                norm_topk_prob=arch.norm_topk_prob,
                n_group=arch.n_group,
                topk_group=arch.topk_group,
                routed_scaling_factor=arch.routed_scaling_factor,
                shared_intermediate=arch.n_shared_experts * arch.moe_intermediate_size,
            )
        # The checkpoint's name for the MLP: Mixtral's is block_sparse_moe.
        self.mlp_name = "block_sparse_moe" if arch.moe_kind == "mixtral" else "mlp"
        self.add_module(self.mlp_name, mlp)

    @property
    def ffn(self) -> nn.Module:
        return cast(nn.Module, self._modules[self.mlp_name])


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
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(
            arch.hidden_size,
            arch.rms_norm_eps,
            weight_first=arch.norm_weight_first or bool(arch.norm_offset),
            offset=arch.norm_offset,
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
        self.scale = arch.scale
        self._logits_weight_t: tuple[torch.Tensor, torch.Tensor] | None = None
        #: The fused ops' ``impl`` when :meth:`use_fused_ops` switched them on, else ``None``;
        #: :attr:`fused_rope` likewise for RoPE (off for MLA), with :attr:`rope_table_rows`.
        self.fused_ops: str | None = None
        self.fused_rope: str | None = None
        self.rope_table_rows = 0
        self.reset_rotaries()

    def reset_rotaries(self, device: torch.device | str | None = None) -> None:
        """(Re)build the rotary tables, in float32 on ``device``: one per distinct (RoPE, rotated
        dims) among the layers (Gemma-3 and MiMo-V2-Flash have one per layer type).
        :attr:`rotary` is layer 0's."""
        arch = self.arch
        keys: dict[tuple[object, int], str] = {}
        self.rotary_keys: list[str] = []
        tables: dict[str, RotaryEmbedding] = {}
        for i in range(arch.num_layers):
            rope, dim = arch.layer_rope(i), arch.rotary_dim(i)
            key = keys.setdefault((rope, dim), f"rope{len(keys)}")
            if key not in tables:
                tables[key] = RotaryEmbedding(rope, dim)
            self.rotary_keys.append(key)
        self.rotaries = nn.ModuleDict(tables)
        if device is not None:
            self.rotaries.to(device)
        self.rotary = cast(RotaryEmbedding, self.rotaries[self.rotary_keys[0]])
        if self.fused_rope is not None:  # the fused RoPE's tables, for the new rotaries
            self._build_rope_tables()

    def use_fused_ops(self, impl: str | None = "auto", *, max_positions: int = 0) -> None:
        """Run the elementwise ops through kv-kernels' fused ops from now on (``impl``: their
        ``"auto"``, ``"triton"`` or ``"reference"``), or the torch code again (``None``).

        Fused: every RMSNorm (one launch with the residual add before it), the gated MLP's
        activation and product (SiLU, or Gemma's tanh GELU, over the stacked gate/up output) and
        RoPE (in place over the q/k heads, partial rotary included; one table of ``max(
        max_positions, max_position_embeddings)`` rows per RoPE, in the weights' dtype). Kept
        in torch: MLA's interleaved RoPE, the mixtures of experts' expert MLPs, projections
        that left their stack. Each module's methods are rebound here, once, so a step costs no
        branch on the choice; the fused ops launch without host syncs, so a decode step still
        captures into a CUDA graph.

        The runner calls this at build on CUDA (``ModelRunner(fused_ops=...)``); the CPU keeps
        the torch code, whose bits the transformers parity tests hold (the ops' CPU references
        gave the same float32 bits on every tiny family, but a step costs more host time)."""
        if impl is not None and not isinstance(impl, str):
            raise TypeError(
                f"use_fused_ops: impl={impl!r} must be 'auto', 'triton', 'reference' or None"
            )
        for m in self.modules():
            if isinstance(m, RMSNorm | GatedMLP):
                m.use_fused(impl)
        self.fused_ops = impl
        self.fused_rope = None if self.arch.is_mla else impl
        self.rope_table_rows = max(max_positions, self.arch.max_position_embeddings)
        if self.fused_rope is not None:
            self._build_rope_tables()

    def _build_rope_tables(self) -> None:
        dtype = self.model.embed_tokens.weight.dtype  # the activations' dtype
        for rot in self.rotaries.values():
            cast(RotaryEmbedding, rot).build_cos_sin_cache(self.rope_table_rows, dtype)

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rope]:
        """Each RoPE table's rotation for this step's ``positions`` (one per table, not per
        layer: torch's cos/sin are computed once a step)."""
        fused = self.fused_rope
        if fused is not None:
            return {
                key: FusedRope(positions, cast(torch.Tensor, rot.cos_sin_cache), fused)
                for key, rot in self.rotaries.items()
            }
        return {
            key: TorchRope(rot, *rot.cos_sin(positions, dtype))
            for key, rot in self.rotaries.items()
            if isinstance(rot, RotaryEmbedding)
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        *,
        mla_latent: bool = False,
        mla_split: MLASplitFn | None = None,
        rope_attend: RopeAttend | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm.

        ``mla_latent``: MLA layers hand ``attend`` the absorbed form (:meth:`MLAAttention.
        latent_qkv`): ``q`` ``[T, H, rank + rope]``, ``k`` the latent rows ``[T, 1, rank +
        rope]`` and ``v`` their first ``rank`` columns (a view of ``k``: a latent cache stores the
        row once), and take back ``[T, H, rank]``; without it, decompressed per-head K/V.
        ``mla_split`` (with ``mla_latent``): MLA layers hand it their latent parts instead and
        take back ``[T, H, v]`` (the runner's mixed and prefill steps: decode rows absorbed,
        prefill rows decompressed, :mod:`kvstack.engine.mla_prefill`). ``rope_attend``: the
        layers whose q and k go to its callback unrotated, where the RoPE is the fused one
        (the runner's RoPE fused into the cache write); ``None``: every layer rotates its own."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.arch.embed_scale is not None:
            # Gemma: the scale as a tensor of the activation dtype, as transformers rounds it.
            x.mul_(torch.tensor(self.arch.embed_scale, dtype=x.dtype))
        ropes = self._ropes(positions, x.dtype)
        deferred = rope_attend.layers if rope_attend is not None else ()
        # The residual stream is added to in place: x is this call's own tensor (the
        # embedding's output) and nothing else holds it, so each add saves an allocation. Each
        # sublayer's output is handed to the next norm, which adds it to the stream first
        # (add_norm): with the fused ops, the add and the norm are one launch.
        residual = x  # [T, hidden]
        pending: torch.Tensor | None = None  # the last sublayer's output, not yet added
        for i, layer in enumerate(self.decoder_layers()):
            attn = layer.self_attn
            rope = ropes[self.rotary_keys[i]]
            if pending is None:
                h = layer.input_layernorm(residual)
            else:
                h, residual = layer.input_layernorm.add_norm(pending, residual)
            if mla_latent and isinstance(attn, MLAAttention):
                o = attn.attend_latent(i, h, rope, attend, mla_split)  # [T, H, v]
            elif i < len(deferred) and deferred[i] and isinstance(rope, FusedRope):
                assert rope_attend is not None and isinstance(attn, Attention)
                q, k, v = attn.project(h, None)  # rotated by the cache write
                o = rope_attend.attend(i, q, k, v, rope)  # [T, Hq, Dv]
            else:
                q, k, v = attn.project(h, rope)
                o = attend(i, q, k, v)  # [T, Hq, Dv]
            out = attn.o_proj(o.reshape(o.shape[0], -1))
            if layer.sandwich:  # Gemma: the sublayers' outputs are normed before the add
                out = layer.post_attention_layernorm(out)
                h, residual = layer.pre_feedforward_layernorm.add_norm(out, residual)
                pending = layer.post_feedforward_layernorm(layer.ffn(h))
            else:
                h, residual = layer.post_attention_layernorm.add_norm(out, residual)
                pending = layer.ffn(h)
        if pending is None:  # (no layers)
            return self.model.norm(residual)
        return self.model.norm.add_norm(pending, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[R, vocab]`` of hidden states ``[R, hidden]``."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        kept = transposed(self._logits_weight_t, weight)
        if kept is not self._logits_weight_t:  # nn.Module.__setattr__ is slow: set only on change
            self._logits_weight_t = kept
        logits = linear(hidden, weight, None, kept[1]).float()
        cap = self.arch.final_softcap
        if cap > 0:  # Gemma: the final logits softcapped, c * tanh(logits / c)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def stack_projections(self) -> None:
        """Run each layer's q/k/v (and a gated MLP's gate/up) projections as one matmul, once the
        weights are in (the loader calls it). Names, shapes and values of every parameter stay
        as the checkpoint gave them (see :class:`~kvstack.engine.layers.StackedLinear`)."""
        w = self.model.embed_tokens.weight
        grouped = grouped_mm_available(w.device, w.dtype)
        for layer in self.decoder_layers():
            layer.self_attn.stack_projections()
            if isinstance(layer.ffn, GatedMLP):
                layer.ffn.stack_projections()
            elif grouped and isinstance(layer.ffn, SparseMoE):  # experts without a host sync
                layer.ffn.stack_experts()

    @property
    def host_synced_moe(self) -> bool:
        """Whether a mixture-of-experts layer picks its experts on the host (the expert loop:
        a device sync a layer, so no CUDA graph)."""
        return any(
            isinstance(layer.ffn, GptOssMoE)
            or (isinstance(layer.ffn, SparseMoE) and layer.ffn.grouped is None)
            for layer in self.decoder_layers()
        )

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    def layer_sinks(self, i: int) -> torch.Tensor | None:
        """Layer ``i``'s sink logits ``[num_q_heads]`` (gpt-oss, MiMo-V2-Flash's sliding layers),
        else ``None``."""
        return cast(DecoderLayer, self.model.layers[i]).self_attn.sinks

    @torch.no_grad()
    def forward_dense(self, input_ids: torch.Tensor, *, mla_latent: bool = False) -> torch.Tensor:
        """Cache-free reference: float32 logits ``[T, vocab]`` of one sequence ``[T]`` at
        positions ``0..T-1``, every layer attending through :func:`dense_attention`
        (``mla_latent``: MLA layers in the absorbed form over latent rows, see :meth:`forward`)."""
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
                softcap=arch.attn_softcap,
            )

        positions = torch.arange(input_ids.numel(), device=input_ids.device)
        hidden = self.forward(input_ids, positions, attend, mla_latent=mla_latent)
        return self.compute_logits(hidden)
