"""Readable torch reference of paged attention and of the attention-state merge (any device).

Per sequence: gather the sequence's K/V pages through its block-table row, cut them to its
``seq_len`` tokens, build the visibility mask (causal / sliding window), add softcap and ALiBi to
the scaled logits, and take the softmax in float32, with the per-head sink logits joining the
denominator. Inputs are assumed validated by :mod:`kv_kernels.paged_attention.api`.
"""

from __future__ import annotations

import math

import torch

from kv_kernels.cache import scale_values

__all__ = ["merge_attn_states_reference", "paged_attention_reference"]


def _as_head_scale(
    scale: float | torch.Tensor | None, num_kv_heads: int, device: torch.device
) -> torch.Tensor:
    """A float32 ``[H]`` dequant scale from ``None`` (1), a float, a 1-element or an ``[H]`` tensor."""
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(-1).expand(num_kv_heads)
    return torch.full((num_kv_heads,), float(scale), dtype=torch.float32, device=device)


def paged_attention_reference(
    q: torch.Tensor,  # [T, Hq, head_size]
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view
    *,
    k_range: tuple[int, int],
    v_range: tuple[int, int],
    scale_rows: tuple[int, int, int] | None = None,
    block_table: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [Hq] float32
    softcap: float,
    alibi_slopes: torch.Tensor | None,  # [Hq] float32
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    return_lse: bool,
    out: torch.Tensor,  # [T, Hq, head_size_v], written in place
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention in float32 torch; writes ``out`` and returns it (and ``lse`` ``[T, Hq]``).

    ``scale_rows`` (per-token-head quantized caches, ``KVCacheLayout.scale_geometry``): where
    each token's float32 K scale and V scale sit (inline at the row's end, or in the page's scale
    plane); K and V rows are multiplied by them.
    For MLA ``k_range`` is the whole latent row and ``v_range`` its first columns.

    Query ``i`` of a sequence with ``q_len`` new tokens and ``seq_len`` KV tokens sits at absolute
    position ``seq_len - q_len + i``; with ``causal`` it sees keys ``<= `` that position, with a
    ``sliding_window`` of ``w`` keys ``> position - w`` (and, without ``causal``, ``< position + w``). Logits are ``scale * q.k`` (times the fp8 K
    scale), then ``softcap * tanh(x / softcap)``, then ``+ slope * (key_pos - query_pos)``. A row
    that sees no key gets a zero output and ``lse = -inf`` (or its sink logit).
    Rows past ``query_start_loc[-1]`` are left untouched.
    """
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    device = q.device
    k_deq = _as_head_scale(k_scale, num_kv_heads, device)  # [H]
    v_deq = _as_head_scale(v_scale, num_kv_heads, device)  # [H]
    lse = torch.full((q.shape[0], num_q_heads), float("-inf"), dtype=torch.float32, device=device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s in range(len(lens)):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len, seq_len = q1 - q0, lens[s]
        if q_len == 0:
            continue
        n_pages = -(-seq_len // block_size)
        if seq_len < 0 or n_pages > block_table.shape[1]:
            raise ValueError(
                f"seq_lens[{s}]={seq_len} needs {n_pages} blocks of {block_size} but block_table "
                f"has {block_table.shape[1]} columns; widen the block table or fix seq_lens"
            )
        pages = block_table[s, :n_pages].to(torch.int64)
        if n_pages and (int(pages.min()) < 0 or int(pages.max()) >= num_blocks):
            raise ValueError(
                f"sequence {s}: block_table[{s}, :{n_pages}] holds ids outside [0, {num_blocks}) "
                f"({pages.tolist()}); every block covering seq_len={seq_len} must be allocated"
            )
        kv = kv_cache[pages]  # [n_pages, H, N, C]
        kv = kv.permute(1, 0, 2, 3).reshape(num_kv_heads, n_pages * block_size, -1)[:, :seq_len]
        k = kv[..., k_range[0] : k_range[1]].float() * k_deq[:, None, None]  # [H, seq_len, D]
        v = kv[..., v_range[0] : v_range[1]].float() * v_deq[:, None, None]  # [H, seq_len, Dv]
        if scale_rows is not None:
            sc = scale_values(kv_cache, scale_rows, 2)[pages]  # [n_pages, H, N, 2]
            sc = sc.permute(1, 0, 2, 3).reshape(num_kv_heads, n_pages * block_size, 2)[:, :seq_len]
            k = k * sc[..., 0:1]
            v = v * sc[..., 1:2]
        k = k.repeat_interleave(group, dim=0)  # [Hq, seq_len, D]: q head h reads kv head h // group
        v = v.repeat_interleave(group, dim=0)  # [Hq, seq_len, Dv]
        qs = q[q0:q1].float().transpose(0, 1)  # [Hq, q_len, D]
        logits = torch.matmul(qs, k.transpose(1, 2)) * scale  # [Hq, q_len, seq_len]
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(seq_len, device=device)[None, :]  # [1, seq_len]
        if alibi_slopes is not None:
            logits = logits + alibi_slopes.float()[:, None, None] * (k_pos - q_pos).float()
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
            if not causal:
                visible &= k_pos < q_pos + sliding_window  # a non-causal window bounds both sides
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(num_q_heads, q_len, 1)
            row_lse = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1)  # [Hq, q_len]
        else:
            row_lse = torch.logsumexp(logits, dim=-1)  # [Hq, q_len]
        # exp(-inf - -inf) is nan: rows that see nothing (and have no sink) get zero weights.
        safe = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
        probs = torch.exp(logits - safe[..., None])  # [Hq, q_len, seq_len]
        o = torch.matmul(probs, v)  # [Hq, q_len, Dv]
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
        lse[q0:q1] = row_lse.transpose(0, 1)
    if return_lse:
        return out, lse
    return out


def merge_attn_states_reference(
    out_a: torch.Tensor,  # [T, Hq, Dv]
    lse_a: torch.Tensor,  # [T, Hq] float32, natural log
    out_b: torch.Tensor,  # [T, Hq, Dv]
    lse_b: torch.Tensor,  # [T, Hq]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalized attention states over disjoint key sets by log-sum-exp.

    ``out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / (exp(lse_a) + exp(lse_b))``, computed
    relative to the larger lse; rows where both are ``-inf`` give zeros and ``-inf``.
    """
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)  # [T, Hq]
    tot = wa + wb
    lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(tot, -math.inf))
    inv = torch.where(tot > 0, 1.0 / tot, torch.zeros_like(tot))
    out = (out_a.float() * (wa * inv)[..., None] + out_b.float() * (wb * inv)[..., None]).to(
        out_a.dtype
    )
    return out, lse
