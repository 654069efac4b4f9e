"""DeepSeek-V3's multi-head latent attention layer (:class:`MLAAttention`), in both forms.

The decompressed form (:meth:`MLAAttention.qkv`) hands attention per-head K/V, as any
``head_size_v != head_size`` layer. The latent form caches one row per token (the normed
compressed K/V, then the rotated shared rope key) and attends it two ways, which a step mixes:

- absorbed (decode rows): each head's nope query times its ``W_UK`` (:meth:`~MLAAttention.
  absorb_query`), attention over the latent rows with V = their first ``kv_lora_rank`` columns,
  the output times ``W_UV`` (:meth:`~MLAAttention.absorb_out`): ``H x (rank + rope + rank)``
  multiply-adds a (query, key) pair, 1088 a head in the release;
- decompressed (prefill rows, :mod:`kvstack.engine.mla_prefill`): the context's latent rows through
  ``kv_b_proj`` (:meth:`~MLAAttention.decompress`) into per-head K (nope + the shared rope key) and
  V, ordinary attention of the un-absorbed query: ``H x (nope + rope + v)``, 320 a head.

:meth:`MLAAttention.latent_parts` computes what both need once; :meth:`MLAAttention.attend_latent`
is the layer's step in the latent form (all rows absorbed, or handed to a step's split).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from kvstack.engine.hf_config import ArchConfig
from kvstack.engine.layers import Linear, RMSNorm, RotaryEmbedding
from kvstack.engine.rotary import Rope, TorchRope

__all__ = ["MLAAttention", "MLAParts", "MLASplitFn"]


class MLAParts(NamedTuple):
    """One layer's latent-form inputs for ``T`` rows (see :meth:`MLAAttention.latent_parts`)."""

    q_nope: torch.Tensor  # [T, H, nope] the query's nope part (a view of the projection)
    q_pe: torch.Tensor  # [T, H, rope] its rope part, rotated (pairs evens-then-odds)
    row: torch.Tensor  # [T, 1, rank + rope] the latent row the cache stores


#: ``split(layer_index, attn, parts) -> out [T, H, v_head_dim]``: a step's latent attention of one
#: layer when it is not absorbed for every row (the runner's mixed and prefill steps,
#: :class:`kvstack.engine.mla_prefill.MLAStep`). It writes the rows to the cache itself.
MLASplitFn = Callable[[int, "MLAAttention", MLAParts], torch.Tensor]

#: ``attend(layer_index, q, k, v)``, as :data:`kvstack.engine.models.AttendFn`
_AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _evens_then_odds(x: torch.Tensor) -> torch.Tensor:
    """``x``'s last dim reordered ``x0, x2, ..., x1, x3, ...``: interleaved RoPE pairs become
    rotate-half halves (slices, so no index tensor to keep on the right device)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention, with K and V decompressed per head.

    ``x`` -> ``q`` ``[T, H, nope + rope]`` (through ``q_a_proj`` -> RMSNorm -> ``q_b_proj``, or one
    ``q_proj``); the latent ``kv_a_proj_with_mqa(x)`` = ``kv_lora_rank`` compressed K/V (RMSNorm'd)
    plus one ``rope``-wide rotary key shared by all heads; ``kv_b_proj`` decompresses the latent to
    each head's ``nope`` key and ``v_head_dim`` value. RoPE turns the rope parts only; with
    ``rope_interleave`` they are pairs ``(x0, x1), (x2, x3), ...``, which is rotate-half over the
    dims reordered evens-then-odds (transformers' output order too).
    """

    def __init__(self, arch: ArchConfig, layer: int = 0) -> None:
        super().__init__()
        h, heads = arch.hidden_size, arch.num_q_heads
        self.num_q_heads = self.num_kv_heads = heads
        self.nope, self.rope = arch.mla_qk_nope_head_dim, arch.mla_qk_rope_head_dim
        self.rank, self.v_head_dim = arch.mla_kv_lora_rank, arch.v_head_dim
        self.head_dim = self.nope + self.rope
        self.rotary_dim = self.rope
        self.interleave = arch.mla_rope_interleave
        q_rank = arch.mla_q_lora_rank
        bias = arch.attention_bias
        qk = heads * self.head_dim
        self.q_proj = Linear(h, qk, bias=False) if q_rank is None else None
        self.q_a_proj = Linear(h, q_rank, bias=bias) if q_rank is not None else None
        # transformers builds both latent norms with its RMSNorm's default eps (1e-6).
        self.q_a_layernorm = RMSNorm(q_rank, 1e-6) if q_rank is not None else None
        self.q_b_proj = Linear(q_rank, qk, bias=False) if q_rank is not None else None
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = Linear(heads * self.v_head_dim, h, bias=arch.o_proj_bias)
        self.sinks = None

    def stack_projections(self) -> None:
        pass  # (latent projections are chained, not side by side)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s weight split per head: ``W_UK`` ``[H, nope, rank]`` (latent -> key)
        and ``W_UV`` ``[H, v, rank]`` (latent -> value), views."""
        w = self.kv_b_proj.weight.view(self.num_q_heads, self.nope + self.v_head_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def latent_parts(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> MLAParts:
        """``x`` ``[T, hidden]`` -> the query's nope part, its rotated rope part and the latent row
        ``[T, 1, rank + rope]`` (the normed compressed K/V, then the rotated shared rope key)."""
        q = self._query(x)  # [T, H, nope + rope]
        latent = self.kv_a_proj_with_mqa(x)  # [T, rank + rope]
        c = self.kv_a_layernorm(latent[:, : self.rank])  # [T, rank]
        q_rot, k_rot = q[..., self.nope :], latent[:, None, self.rank :]
        if self.interleave:
            q_rot, k_rot = _evens_then_odds(q_rot), _evens_then_odds(k_rot)
        row = torch.cat([c[:, None, :], rotary(k_rot, cos, sin)], dim=-1)  # [T, 1, rank + rope]
        return MLAParts(q[..., : self.nope], rotary(q_rot, cos, sin), row)

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """The absorbed query ``[T, H, rank + rope]``: each head's nope query times its ``W_UK``,
        then its rotated rope query. ``q . row`` is the decompressed ``q . k`` (``q_nope . W_UK c
        + q_rope . k_rope``)."""
        w_uk, _ = self._w_uk_uv()
        q_abs = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, rank]
        return torch.cat([q_abs, q_pe], dim=-1)

    def latent_qkv(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed form: ``q`` ``[T, H, rank + rope]`` (:meth:`absorb_query`) and the latent
        row ``[T, 1, rank + rope]`` that MLA caches once per token. Attention over the rows with
        V = the rows' first ``rank`` columns, followed by :meth:`absorb_out`, is the
        decompressed attention."""
        q_nope, q_pe, row = self.latent_parts(x, rotary, cos, sin)
        return self.absorb_query(q_nope, q_pe), row

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows' compressed part ``[n, rank]`` (as cached: normed) -> each head's nope key
        ``[n, H, nope]`` and value ``[n, H, v]`` (views of one ``kv_b_proj`` output)."""
        kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_q_heads, -1)
        return kv[..., : self.nope], kv[..., self.nope :]

    def attend_latent(
        self,
        i: int,
        x: torch.Tensor,
        rope: Rope,
        attend: _AttendFn,
        split: MLASplitFn | None = None,
    ) -> torch.Tensor:
        """Layer ``i``'s attention in the latent form, ``[T, H, v]``: every row absorbed through
        ``attend(i, q, row, row[..., :rank])`` (which writes the rows and returns ``[T, H,
        rank]``), or, given a step's ``split``, whatever it does with :meth:`latent_parts`."""
        assert isinstance(rope, TorchRope), "MLA rotates its interleaved pairs with torch ops"
        parts = self.latent_parts(x, *rope)
        if split is not None:
            return split(i, self, parts)
        q = self.absorb_query(parts.q_nope, parts.q_pe)
        return self.absorb_out(attend(i, q, parts.row, parts.row[..., : self.rank]))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> the per-head queries ``[T, H, nope + rope]``: one projection,
        or with ``q_lora_rank`` the low-rank down-projection, its norm and the up-projection."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_q_heads, self.head_dim)

    def absorb_out(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention output over latent rows ``[T, H, rank]`` -> per-head values ``[T, H, v]``
        (times each head's ``W_UV``)."""
        _, w_uv = self._w_uk_uv()
        return torch.einsum("thr,hvr->thv", o_latent, w_uv)

    def project(
        self, x: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`qkv` (RoPE through torch: :meth:`CausalLM.use_fused_ops` leaves MLA's)."""
        assert isinstance(rope, TorchRope), "MLA rotates its interleaved pairs with torch ops"
        return self.qkv(x, *rope)

    def qkv(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> ``q``, ``k`` ``[T, H, nope + rope]``, ``v`` ``[T, H, Dv]``."""
        t, heads = x.shape[0], self.num_q_heads
        q = self._query(x)  # [T, H, nope + rope]
        latent = self.kv_a_proj_with_mqa(x)  # [T, rank + rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent[:, : self.rank]))
        kv = kv.view(t, heads, self.nope + self.v_head_dim)
        q_rot, k_rot = q[..., self.nope :], latent[:, None, self.rank :]  # [T, H|1, rope]
        if self.interleave:
            q_rot, k_rot = _evens_then_odds(q_rot), _evens_then_odds(k_rot)
        q_rot, k_rot = rotary(q_rot, cos, sin), rotary(k_rot, cos, sin)
        q = torch.cat([q[..., : self.nope], q_rot], dim=-1)
        k = torch.cat([kv[..., : self.nope], k_rot.expand(t, heads, self.rope)], dim=-1)
        return q, k, kv[..., self.nope :]
