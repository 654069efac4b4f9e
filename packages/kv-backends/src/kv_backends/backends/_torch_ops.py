"""Plain-torch pieces shared by the backends: cache writes, page gathers, and the float32
attention the TORCH_SDPA backend (and so every test's oracle) is made of."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kv_spec import KVCacheLayout, KVQuantMode

from kv_backends.backends._torch_masks import PaddedMask, decode_masks, padded_mask

__all__ = [
    "PaddedGroup",
    "PaddedMask",
    "attend_decode",
    "attend_one_request",
    "attend_padded",
    "batch_columns",
    "decode_masks",
    "dequant",
    "gather_kv_rows",
    "gather_padded_kv",
    "gather_request_kv",
    "group_by_padded_shape",
    "padded_groups",
    "padded_length",
    "padded_mask",
    "plan_padded_groups",
    "split_kv_rows",
    "write_kv_slots",
]


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


def write_kv_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
) -> bool:
    """Write ``key`` ``[T', H, D]`` and ``value`` ``[T', H, Dv]`` to slots ``slot_mapping``
    ``[T]`` with one ``index_copy_``, or return ``False`` (nothing written) where that does not
    apply: a quantized cache, K and V not side by side in ``C``, a block stride other than
    ``block_size`` x the token stride (so slots are not one strided axis), padding slots (``< 0``)
    or slots past the cache (the caller's reference write skips or reports those).

    Slot ``s`` is token ``s % N`` of block ``s // N``; with block stride ``N`` x token stride, it
    sits at ``s`` x token stride, so ``[B, H, N, C]`` views as ``[B * N, H, C]``."""
    k0, k1 = layout.k_range
    b, h, n, _ = kv_cache.shape
    sb, sh, sn, sc = kv_cache.stride()
    if (
        layout.kv_quant is not KVQuantMode.NONE
        or layout.v_range is None
        or layout.v_range[0] != k1
        or sb != n * sn
        or key.dtype != kv_cache.dtype
        or value.dtype != kv_cache.dtype
    ):
        return False
    t = slot_mapping.numel()
    if t <= 256:  # a decode step's few slots: one host copy, Python's min and max
        slots = slot_mapping.tolist()
        lo, hi = min(slots), max(slots)
    else:
        lo, hi = (int(x) for x in torch.aminmax(slot_mapping))  # one reduction, one sync
    if lo < 0 or hi >= b * n:
        return False
    v1 = layout.v_range[1]
    rows = kv_cache.as_strided((b * n, h, v1 - k0), (sn, sh, sc), kv_cache.storage_offset() + k0)
    rows.index_copy_(0, slot_mapping, torch.cat([key[:t], value[:t]], dim=-1))
    return True


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


# -- batched: many requests in one padded attention call -------------------------------------------
#
# Looping over requests costs one gather and one SDPA call per request per layer; on small models
# that per-call overhead is most of a decode step. The batched path pads a group of requests to one
# query length ``Lb`` and one context length ``Sb`` and runs one gather and one attention call.
#
# Batch invariance by construction: a request's padded shape is a function of its own lengths only
# (``padded_length``), never of its neighbours', and requests are grouped by that shape. So a
# request sees the same kernel, the same reduction length and the same padding whatever else is in
# the batch; only the batch dimension of the call changes, and on the CPU every op used here picks
# its kernel per matrix shape and computes batch elements independently (TORCH_SDPA keeps one
# request per call elsewhere; tests/test_torch_sdpa_batched.py checks the CPU bitwise).

# The smallest padding step: contexts of 2..64 tokens share one shape. Fewer, wider shapes mean
# fewer calls but more padded K/V to gather; on the engine benchmark 64 and 128 tie and 256 loses
# a third of the tokens/s.
_PAD_QUANTUM = 64


def padded_length(n: int) -> int:
    """The padded length of a query or context of ``n`` tokens: ``n`` itself for a single token
    (decode), else ``n`` rounded up to a multiple of ``max(64, 2**ceil(log2 n) / 8)``. Padding
    wastes fewer than ``max(64, n / 4)`` tokens, while the number of distinct shapes (and so of
    attention calls per step) grows only logarithmically with the longest context."""
    if n <= 1:
        return n
    quantum = max(_PAD_QUANTUM, (1 << (n - 1).bit_length()) // 8)
    return -(-n // quantum) * quantum


@dataclass(frozen=True)
class PaddedGroup:
    """Requests that share one padded shape, attended in one call.

    ``q_index`` ``[G, Lb]`` holds each request's query rows (pad rows repeat its first row, so every
    index is valid) and ``q_valid`` ``[G, Lb]`` marks the real ones; ``q_lens`` and ``seq_lens``
    ``[G]`` are int64 on the query's device."""

    reqs: torch.Tensor  # [G] int64, request indices into the batch
    q_index: torch.Tensor  # [G, Lb] int64
    q_valid: torch.Tensor  # [G, Lb] bool
    q_lens: torch.Tensor  # [G] int64
    seq_lens: torch.Tensor  # [G] int64
    query_len: int  # Lb
    seq_len: int  # Sb, a whole number of cache blocks


def group_by_padded_shape(
    query_start_loc: list[int],
    seq_lens: list[int],
    block_size: int,
    *,
    one_request_per_group: bool = False,
) -> list[tuple[int, int, list[int]]]:
    """``(Lb, Sb, requests)`` of each group of :func:`plan_padded_groups`, in its order (decode
    groups, ``Lb = 1``, first), from host lengths only."""
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for r, s in enumerate(seq_lens):
        n = query_start_loc[r + 1] - query_start_loc[r]
        if n == 0:
            continue
        if n > s:
            raise ValueError(f"request {r}: query_len={n} exceeds seq_len={s}")
        sb = -(-padded_length(s) // block_size) * block_size
        lb = 1 if n == 1 else padded_length(n)
        by_shape.setdefault((lb, sb, r if one_request_per_group else 0), []).append(r)
    return [(lb, sb, reqs) for (lb, sb, _), reqs in sorted(by_shape.items())]


def batch_columns(
    shapes: list[tuple[int, int, list[int]]],
    query_start_loc: list[int],
    seq_lens: list[int],
    device: torch.device,
) -> torch.Tensor:
    """int64 ``[4, R']`` on ``device``: request, first query row, query length and context
    length of every grouped request, in group order. One host tensor and one copy for the whole
    step (small tensor ops cost more than their data here); groups take views of it."""
    reqs = [r for _, _, rs in shapes for r in rs]
    if not reqs:
        return torch.empty(4, 0, dtype=torch.int64, device=device)
    qsl = query_start_loc
    flat = array("q", reqs)
    flat.extend(qsl[r] for r in reqs)
    flat.extend(qsl[r + 1] - qsl[r] for r in reqs)
    flat.extend(seq_lens[r] for r in reqs)
    # From a C array: torch.tensor of nested lists walks them element by element (several
    # times the cost at a few dozen requests).
    return torch.frombuffer(flat, dtype=torch.int64).view(4, len(reqs)).to(device)


def padded_groups(
    shapes: list[tuple[int, int, list[int]]], columns: torch.Tensor
) -> list[PaddedGroup]:
    """The :class:`PaddedGroup` of each shape, over :func:`batch_columns` ``columns``."""
    groups = []
    g0 = 0
    for lb, sb, reqs in shapes:
        g1 = g0 + len(reqs)
        req_t, start_t, len_t, seq_t = columns[:, g0:g1].unbind(0)
        if lb == 1:  # decodes: one real row each
            index, valid = start_t[:, None], torch.ones_like(start_t, dtype=torch.bool)[:, None]
        else:
            offs = torch.arange(lb, device=columns.device)  # [Lb]
            valid = offs[None, :] < len_t[:, None]  # [G, Lb]
            index = start_t[:, None] + offs[None, :] * valid  # [G, Lb]; pad rows -> the first
        groups.append(PaddedGroup(req_t, index, valid, len_t, seq_t, lb, sb))
        g0 = g1
    return groups


def plan_padded_groups(
    query_start_loc: list[int],
    seq_lens: list[int],
    block_size: int,
    device: torch.device,
    *,
    one_request_per_group: bool = False,
) -> list[PaddedGroup]:
    """Group the requests of a batch by padded (query, context) shape; requests with no query rows
    are left out. ``query_start_loc`` has ``num_reqs + 1`` entries and ``seq_lens`` ``num_reqs``.
    Contexts pad to :func:`padded_length` rounded up to whole blocks of ``block_size`` (still a
    function of the request's own length), so gathered pages need no trimming.
    ``one_request_per_group`` keeps the padded shapes but gives every request its own group."""
    shapes = group_by_padded_shape(
        query_start_loc, seq_lens, block_size, one_request_per_group=one_request_per_group
    )
    return padded_groups(shapes, batch_columns(shapes, query_start_loc, seq_lens, device))


def gather_padded_kv(
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    layout: KVCacheLayout,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded contexts as contiguous float32 ``k`` ``[G, H, Sb, D]`` and ``v`` ``[G, H, Sb, Dv]``
    (dequantized by the per-tensor or per-head scales) from ``kv_cache`` ``[B, H, N, C]`` and
    ``rows`` ``[G, nblk]`` (:func:`padded_block_rows`; ``Sb = nblk * N``).

    ``index_select`` over the cache viewed in its memory order moves whole blocks as runs of
    contiguous bytes (indexing the ``[B, H, N, C]`` view copies element by element when the layout
    order puts tokens outside heads), then one copy (two where V is not right after K, as wide)
    brings heads ahead of tokens and converts to float32 in the same pass; K and V come out
    contiguous for ``bmm``."""
    g, nblk = rows.shape
    _, h, n, c = kv_cache.shape
    strides = kv_cache.stride()
    inner = sorted((1, 2, 3), key=lambda d: -strides[d])  # block dims, outermost first
    mem = kv_cache.permute(0, *inner)  # a view; each block's part is in memory order
    pages = mem.index_select(0, rows.reshape(-1))  # [G*nblk, *block dims in memory order]
    back = [0] + [1 + inner.index(d) for d in (1, 2, 3)]
    pages = pages.permute(*back).view(g, nblk, h, n, c)  # [G, nblk, H, N, C] (strided)
    k0, k1 = layout.k_range
    assert layout.v_range is not None
    v0, v1 = layout.v_range
    d = k1 - k0
    if v0 == k1 and v1 - v0 == d:
        # V right after K, as wide: both in one copy, K and V apart on a leading axis of 2, so
        # each is still contiguous for bmm (bmm on column slices of one shared copy measured ~40%
        # slower per decode step than a second copy). One copy, not two, matters beyond its
        # bytes: each is an OpenMP region of all threads, and on a busy machine a region waits
        # for its slowest thread's time slice (kvstack's engine benchmark on 2 shared cores).
        kv = torch.empty(2, g, h, nblk, n, d, dtype=torch.float32, device=kv_cache.device)
        both = pages[..., k0:v1].unflatten(-1, (2, d))  # [G, nblk, H, N, 2, D]
        kv.copy_(both.permute(4, 0, 2, 1, 3, 5))  # heads ahead of tokens, cast to float32
        out = list(kv.view(2, g, h, nblk * n, d).unbind(0))  # [G, H, Sb, D] each
    else:
        out = []
        for c0, c1 in ((k0, k1), (v0, v1)):
            x = torch.empty(g, h, nblk, n, c1 - c0, dtype=torch.float32, device=kv_cache.device)
            x.copy_(pages[..., c0:c1].transpose(1, 2))  # heads ahead of tokens, cast to float32
            out.append(x.view(g, h, nblk * n, c1 - c0))  # [G, H, Sb, D or Dv]
    for x, scale in zip(out, (k_scale, v_scale), strict=True):
        if scale is not None:
            x.mul_(_scale_shape(scale.to(x.device), 4, 1))
    return out[0], out[1]


def gather_kv_rows(row_array: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``row_array`` (from :func:`kv_row_array`; ``index`` from
    :func:`kv_row_index`, flattened, every group's K rows then V rows one after the other) in one
    ``index_select`` of ``D``-element rows, as float32 ``[rows, D]`` (non-float32 caches take
    one cast): heads ahead of tokens with no second pass, where the page gather needs a
    permuting copy after it. Same bytes, so the same attention bits; :func:`split_kv_rows`
    turns a group's rows into its K and V."""
    rows = row_array.index_select(0, index)
    return rows if rows.dtype == torch.float32 else rows.float()


def split_kv_rows(
    rows: torch.Tensor,
    group_shape: tuple[int, int, int],
    head_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's gathered rows (float32 ``[2 * G * H * Sb, D]``, K rows then V rows, as
    :func:`gather_kv_rows` gathers them) as K and V ``[G, H, Sb, D]``: contiguous views,
    multiplied in place by their scales (the rows are the caller's own copy; quantized caches
    are scaled here, as in the page gather)."""
    g, h, s = group_shape
    k, v = rows.view(2, g, h, s, head_size).unbind(0)  # [G, H, Sb, D] each, contiguous
    for x, scale in ((k, k_scale), (v, v_scale)):
        if scale is not None:
            x.mul_(_scale_shape(scale.to(x.device), 4, 1))
    return k, v


def attend_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: PaddedMask,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 attention of a padded group: the same rules as :func:`attend_one_request` (causal
    and window live in ``mask``).

    ``q`` ``[G, Lb, Hq, D]``; ``k`` ``[G, H, Sb, D]``, ``v`` ``[G, H, Sb, Dv]`` (float32, rows
    of unit stride whose ``(G, H)`` dims merge, as :func:`gather_kv_rows` returns them). Returns
    ``[G, Lb, Hq, Dv]`` float32; pad rows (``~group.q_valid``) hold garbage to be dropped.
    ``mask`` is :func:`padded_mask` of the group under this layer's rules.
    """
    g, lb, hq, _ = q.shape
    h = k.shape[1]
    qf = q.float().permute(0, 2, 1, 3)  # [G, Hq, Lb, D]
    if sinks is None and softcap == 0.0 and lb > 1:
        # Plain prefill: one SDPA call for the whole group (GQA without copying K/V), which never
        # holds a [Lb, Sb] score matrix per head; its CPU kernel gives each (request, head, query
        # block) the whole KV loop, so neighbours cannot change a request's reduction. Decodes
        # (lb == 1) do not come here: SDPA's one-query path splits the KV loop across threads by
        # batch size, so a request's bits would depend on its neighbours (measured: 2 threads,
        # 1e-8 differences); the bmm path below is as fast at one query and keeps batch elements
        # apart.
        if alibi_slopes is None and mask.top_left_causal:
            # Whole prompts, causal, no window: SDPA's own causal mask is the group's on every
            # real row, and its kernel skips the key blocks past the diagonal (about half the
            # work) instead of adding -inf to them. Pad rows see more keys than the explicit
            # mask gives them; their outputs are dropped.
            out = F.scaled_dot_product_attention(
                qf, k, v, is_causal=True, scale=scale, enable_gqa=hq != h
            )  # [G, Hq, Lb, Dv]
            return out.permute(0, 2, 1, 3)
        if alibi_slopes is not None:
            attn_mask = _alibi_bias(alibi_slopes, mask).masked_fill(
                ~mask.allowed[:, None], float("-inf")
            )
        else:
            attn_mask = mask.sdpa_bias  # [G, 1, Lb, Sb], shared by the step's layers
        out = F.scaled_dot_product_attention(
            qf, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=hq != h
        )  # [G, Hq, Lb, Dv]
        return out.permute(0, 2, 1, 3)
    # Query head hq reads KV head hq // (Hq // H): view the query heads as [H, Hq // H] so K/V
    # broadcast over the group instead of being repeated.
    out = _attend_explicit(
        qf.reshape(g * h, (hq // h) * lb, -1), k, v, mask,
        scale=scale, sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
    )  # fmt: skip
    return out.view(g, hq, lb, -1).permute(0, 2, 1, 3)  # [G, Lb, Hq, Dv]


def attend_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: PaddedMask,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attend_padded` for a decode group (``Lb = 1``) with the query rows as they come:
    ``q`` ``[G, Hq, D]`` -> ``[G, Hq, Dv]`` float32. The same ops on the same shapes, so the same
    bits, without the query-length axis and its views: decodes are most of a step's groups.
    ``out``: a contiguous float32 ``[G, Hq, Dv]`` to write the result into (and return)."""
    g, hq, _ = q.shape
    h = k.shape[1]
    qf = q if q.dtype == torch.float32 else q.float()
    res = _attend_explicit(
        qf.view(g * h, hq // h, -1), k, v, mask,
        scale=scale, sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
        out=None if out is None else out.view(g * h, hq // h, -1),
    )  # fmt: skip
    return res.view(g, hq, -1)


def _alibi_bias(alibi_slopes: torch.Tensor, mask: PaddedMask) -> torch.Tensor:
    """ALiBi's ``slope[h] * (kv_pos - q_pos)``, ``[G, Hq, Lb, Sb]`` float32."""
    return (
        alibi_slopes.float().to(mask.kv_pos.device)[None, :, None, None]
        * (mask.kv_pos[None, None, None, :] - mask.q_pos[:, None, :, None]).float()
    )


def _attend_explicit(
    q3: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: PaddedMask,
    *,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decodes, sinks or softcap: an explicit softmax. ``q3`` ``[G*H, rep*Lb, D]`` float32 (query
    head ``h * rep + i`` of request ``g`` at ``[g*H + h, i*Lb : (i+1)*Lb]``), ``k``/``v`` as in
    :func:`attend_padded`. Returns ``[G*H, rep*Lb, Dv]`` (in ``out`` when given)."""
    g, h, sb = k.shape[0], k.shape[1], k.shape[2]
    lb = mask.allowed.shape[1]
    hq = q3.shape[1] // lb * h
    k3t = k.reshape(g * h, sb, -1).transpose(1, 2)  # [G*H, D, Sb]
    bias = None if alibi_slopes is None else _alibi_bias(alibi_slopes, mask)  # [G, Hq, Lb, Sb]
    if softcap:
        logits = (torch.bmm(q3, k3t) * scale).view(g, hq, lb, sb)
        logits = softcap * torch.tanh(logits / softcap)
        if bias is not None:
            logits = logits + bias
        logits = logits.masked_fill(~mask.allowed[:, None], float("-inf"))  # [G, Hq, Lb, Sb]
    else:
        # scale * (q . k) + (0 or -inf) in one op; ALiBi (finite) may follow the mask.
        logits = torch.baddbmm(mask.additive, q3, k3t, alpha=scale)  # [G*H, rep*Lb, Sb]
        if bias is not None:
            logits = logits.view(g, hq, lb, sb) + bias
    if sinks is not None:
        # The sink is one more logit per head that takes probability mass but has no value.
        logits = logits.view(g, hq, lb, sb)
        sink_col = sinks.float().to(q3.device)[None, :, None, None].expand(g, hq, lb, 1)
        probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :sb]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.bmm(probs.reshape(g * h, -1, sb), v.reshape(g * h, sb, -1), out=out)
