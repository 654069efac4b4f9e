"""Plain-torch pieces shared by the backends: cache writes, page gathers, and the float32
attention the TORCH_SDPA backend (and so every test's oracle) is made of."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kv_spec import KVCacheLayout

__all__ = ["attend_one_request", "dequant", "gather_request_kv"]


def _scale_shape(scale: torch.Tensor, ndim: int, head_dim: int) -> torch.Tensor:
    # A scalar scale broadcasts; a per-head [H] scale lines up with the head dim ``head_dim``.
    if scale.numel() == 1:
        return scale.reshape(())
    shape = [1] * ndim
    shape[head_dim] = scale.numel()
    return scale.reshape(shape)


def gather_request_kv(
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    seq_len: int,
    layout: KVCacheLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` tokens of one request as ``k`` ``[H, S, D]`` and ``v`` ``[H, S, Dv]``
    (a copy, in the cache dtype). ``kv_cache`` is ``[B, H, N, C]`` with ``N = layout.block_size``."""
    n = layout.block_size
    nblk = -(-seq_len // n)
    blocks = block_row[:nblk].long()
    if nblk and (int(blocks.min()) < 0 or int(blocks.max()) >= kv_cache.shape[0]):
        raise ValueError(
            f"block table row {blocks.tolist()} references blocks outside [0, {kv_cache.shape[0]})"
        )
    pages = kv_cache[blocks]  # [nblk, H, N, C]
    h, c = pages.shape[1], pages.shape[3]
    seq = pages.permute(1, 0, 2, 3).reshape(h, nblk * n, c)[:, :seq_len]  # [H, S, C]
    k0, k1 = layout.k_range
    assert layout.v_range is not None
    v0, v1 = layout.v_range
    return seq[..., k0:k1], seq[..., v0:v1]


def dequant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[H, S, D]`` as float32, times its per-tensor or per-head scale."""
    y = x.float()
    if scale is not None:
        y = y * _scale_shape(scale.to(y.device), 3, 0)
    return y


def attend_one_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 attention of one request's queries over its context.

    ``q`` ``[L, Hq, D]`` holds the last ``L`` positions ``S-L .. S-1`` of a context of ``S`` tokens;
    ``k`` ``[H, S, D]``, ``v`` ``[H, S, Dv]`` (float32). Query head ``h`` reads KV head
    ``h // (Hq // H)``. Rules (docs/attention_semantics.md): causal (``kv_pos <= q_pos``), window
    ``|q_pos - kv_pos| < window`` (both sides on a non-causal layer),
    softcap ``c * tanh(s / c)`` on scaled logits, ALiBi ``+ slope[h] * (kv_pos - q_pos)``, and a
    sink adds ``exp(sink[h])`` to the softmax denominator. Returns ``[L, Hq, Dv]`` float32.
    """
    num_q, hq, _ = q.shape
    h, s, _ = k.shape
    qf = q.float().permute(1, 0, 2)  # [Hq, L, D]
    q_pos = torch.arange(s - num_q, s, device=q.device)  # [L]
    kv_pos = torch.arange(s, device=q.device)  # [S]
    allowed = torch.ones(num_q, s, dtype=torch.bool, device=q.device)  # [L, S]
    if causal:
        allowed &= kv_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        # docs/attention_semantics.md: the window counts the query itself (p - w < k); on a
        # non-causal layer it bounds both sides (|p - k| < w); under causal the upper side is moot.
        allowed &= (q_pos[:, None] - kv_pos[None, :]).abs() < sliding_window
    if sinks is None and softcap == 0.0:
        # The plain case goes through torch's SDPA (the backend's namesake); ALiBi rides in a float mask.
        mask: torch.Tensor = allowed
        if alibi_slopes is not None:
            bias = (
                alibi_slopes.float().to(q.device)[:, None, None]
                * (kv_pos[None, None, :] - q_pos[None, :, None]).float()
            )  # [Hq, L, S]
            mask = bias.masked_fill(~allowed, float("-inf"))
        out = F.scaled_dot_product_attention(
            qf[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=hq != h
        )[0]  # [Hq, L, Dv]
        return out.permute(1, 0, 2)
    kk = k.repeat_interleave(hq // h, dim=0)  # [Hq, S, D]
    vv = v.repeat_interleave(hq // h, dim=0)  # [Hq, S, Dv]
    logits = torch.einsum("hld,hsd->hls", qf, kk) * scale  # [Hq, L, S]
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if alibi_slopes is not None:
        logits = (
            logits
            + alibi_slopes.float().to(q.device)[:, None, None]
            * (kv_pos[None, None, :] - q_pos[None, :, None]).float()
        )
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        # The sink is one more logit per head that takes probability mass but has no value.
        sink_col = sinks.float().to(q.device)[:, None, None].expand(hq, num_q, 1)
        probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :s]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hls,hsd->lhd", probs, vv)  # [L, Hq, Dv]
