"""FLEX_ATTENTION's block-mask entries: per query token its request and position, and the
(query block, KV block) tiles a batch needs, trimmed to what a query can see and flagged full
where every (query, key) pair of the tile is visible (Flex skips the mask mod there).

Pure tensor arithmetic on the batch's metadata; nothing here calls FlexAttention. See
:mod:`kv_backends.backends.flex` for how the cache is seen as one strided sequence of physical
tokens, and docs/attention_semantics.md for the masking rules.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["FlexEntries", "build_flex_block_entries", "build_flex_block_indices"]


class FlexEntries(NamedTuple):
    """The block-mask entries of a batch (see :func:`build_flex_block_entries`)."""

    q_req: torch.Tensor  # [num_tokens] int32 request of each query token
    q_pos: torch.Tensor  # [num_tokens] int32 logical position of each query token
    qb: torch.Tensor  # [E] int64 query block of each entry
    kv: torch.Tensor  # [E] int64 global Flex KV block of each entry
    full: torch.Tensor  # [E] bool: every (query, key) pair of the tile is visible


def build_flex_block_indices(
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_req, q_pos, entry_qb, entry_kv)`` of :func:`build_flex_block_entries` with every
    entry partial (the mask mod runs on all of them)."""
    e = build_flex_block_entries(**kw)
    return e.q_req, e.q_pos, e.qb, e.kv


def build_flex_block_entries(
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    n: int,
    tpb: int,
    q_block_size: int,
    kv_block_size: int,
    causal: bool,
    sliding_window: int | None,
    exclude_reqs: torch.Tensor | None = None,
    logical_order: bool = False,
    full_blocks: bool = False,
) -> FlexEntries:
    """The block-mask entries of a batch, in O(tokens + entries).

    Per query token its request and logical position (int32 ``[num_tokens]``), and the unique
    (query block, global FlexAttention KV block) pairs sorted by query block (int64). Global KV
    block ``f`` covers physical tokens ``[f * kv_block_size, (f + 1) * kv_block_size)``.
    Trimming: a query block needs, per request, logical blocks from its earliest query's window
    start to its last query's position (everything up to ``seq_len`` when not causal, within
    the window on both sides when there is one). ``exclude_reqs`` (bool ``[num_reqs]``) drops
    the entries of those requests (their tokens keep ``q_req`` / ``q_pos``; another call serves
    them).

    ``logical_order=True`` sorts each query block's entries by logical position instead
    (needs ``kv_block_size <= n``, so an entry is one tile of one block): Flex visits a row's KV
    tiles in the listed order, and a request's tiles in logical order are what a dense call over
    that request visits — the order that makes batch-invariant results bitwise equal to it.
    A block shared by several requests (a prefix) sits at the same logical position in each and
    stays one entry.

    ``full_blocks=True`` flags the tiles every query of the block sees whole (``full``): the
    query block's served rows are one request's (rows of ``exclude_reqs`` and padding rows are
    dropped by the caller, whatever they compute), and the tile is one block's keys all visible
    to all of them. Flex skips the mask mod on those (its causal fast path; what dense causal Flex
    does for the interior of the triangle). Only with ``kv_block_size <= n`` (a wider tile holds
    other blocks) and never with ``logical_order`` (Flex visits full tiles after the partial
    ones, an order a dense call over one request does not share).
    """
    dev = query_start_loc.device
    sl = seq_lens.long()
    q_req, q_pos = _token_positions(query_start_loc.long(), sl, num_tokens)
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    if num_tokens == 0:
        return FlexEntries(q_req.int(), q_pos.int(), empty, empty, empty.bool())
    p_qb, p_req, first_pos, last_pos = _block_request_pairs(q_req, q_pos, q_block_size, sl.numel())
    # Causal: keys up to the last query; non-causal: the whole context. A window (both sides on a
    # non-causal layer, docs/attention_semantics.md) trims to [first - w + 1, last + w - 1].
    hi = last_pos if causal else sl[p_req] - 1
    lo = torch.zeros_like(hi)
    if sliding_window is not None:
        lo = (first_pos - sliding_window + 1).clamp(min=0)
        if not causal:
            hi = torch.minimum(hi, last_pos + sliding_window - 1)
    # Expand each pair into logical units of u = min(n, kv_block_size) tokens: a unit lies in
    # one kernel block and in one Flex KV block, so the trimming is exact at tile granularity.
    u = min(n, kv_block_size)
    lo_u, hi_u = lo // u, hi // u
    counts = (hi_u - lo_u + 1).clamp(min=0)
    if exclude_reqs is not None:
        counts = torch.where(exclude_reqs[p_req], 0, counts)
    e_pair = torch.repeat_interleave(torch.arange(p_qb.numel(), device=dev), counts)
    offs = torch.arange(e_pair.numel(), device=dev) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    unit_tok = (lo_u[e_pair] + offs) * u  # first logical token of each unit
    phys = block_table[p_req[e_pair], unit_tok // n].long()  # kernel block ids
    e_f = (phys * tpb + unit_tok % n) // kv_block_size
    e_qb = p_qb[e_pair]
    nf = int(e_f.max()) + 1 if e_f.numel() else 1
    if logical_order:
        if kv_block_size > n:
            raise ValueError(
                f"logical_order needs kv_block_size={kv_block_size} <= the kernel block size {n}"
            )
        e_u = unit_tok // u  # logical tile of each entry within its request
        nu = int(e_u.max()) + 1 if e_u.numel() else 1
        key = torch.unique((e_qb * nu + e_u) * nf + e_f)  # sorted by (qb, logical tile)
        return FlexEntries(
            q_req.int(), q_pos.int(), key // (nu * nf), key % nf, torch.zeros_like(key).bool()
        )
    full = torch.zeros_like(e_f)
    if full_blocks and kv_block_size <= n:
        full = _full_units(
            e_pair, unit_tok, u, p_qb, p_req, first_pos, last_pos, sl, exclude_reqs,
            causal=causal, sliding_window=sliding_window,
        ).long()  # fmt: skip
    # A tile is full for a query block only when that block holds a single request, so one
    # (qb, f) never comes both full and partial: the flag can ride in the sort key.
    key = torch.unique((e_qb * 2 + full) * nf + e_f)  # sorted by qb, deduplicated
    return FlexEntries(q_req.int(), q_pos.int(), key // (2 * nf), key % nf, (key // nf) % 2 == 1)


def _token_positions(
    qsl: torch.Tensor, sl: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request and logical position of each query token (int64 ``[num_tokens]`` each)."""
    t = torch.arange(num_tokens, device=qsl.device)
    q_req = torch.searchsorted(qsl[1:], t, right=True)  # [T]
    q_len = qsl[1:] - qsl[:-1]
    return q_req, sl[q_req] - q_len[q_req] + (t - qsl[q_req])


def _block_request_pairs(
    q_req: torch.Tensor, q_pos: torch.Tensor, q_block_size: int, num_reqs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query block, request) pairs — consecutive tokens of one request in one query block —
    as ``(query block, request, first position, last position)``, ``[P]`` each."""
    num_tokens = q_req.numel()
    qb = torch.arange(num_tokens, device=q_req.device) // q_block_size
    pair_key = qb * num_reqs + q_req
    pair_start = torch.ones(num_tokens, dtype=torch.bool, device=q_req.device)
    pair_start[1:] = pair_key[1:] != pair_key[:-1]
    starts = torch.nonzero(pair_start).flatten()
    ends = torch.cat([starts[1:], torch.tensor([num_tokens], device=q_req.device)]) - 1
    return qb[starts], q_req[starts], q_pos[starts], q_pos[ends]


def _full_units(
    e_pair: torch.Tensor,  # [E] pair of each unit
    unit_tok: torch.Tensor,  # [E] first logical token of each unit
    u: int,
    p_qb: torch.Tensor,  # [P] query block of each pair
    p_req: torch.Tensor,  # [P] request of each pair
    first_pos: torch.Tensor,  # [P] first query position of each pair
    last_pos: torch.Tensor,  # [P] last query position of each pair
    sl: torch.Tensor,  # [R] seq lens
    excluded: torch.Tensor | None,  # [R] bool, requests another call serves
    *,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """``[E]`` bool: units every query of their block sees whole, for blocks whose served rows
    are one request's. Rows another call serves (``excluded``: decodes) and padding rows past
    ``num_tokens`` do not count: their outputs are dropped, whatever a full tile gives them."""
    served = p_qb if excluded is None else p_qb[~excluded[p_req]]
    pairs_per_qb = torch.bincount(served, minlength=int(p_qb.max()) + 1)
    alone = pairs_per_qb[p_qb] == 1  # [P]
    first, last, tok_hi = first_pos[e_pair], last_pos[e_pair], unit_tok + u - 1
    ok = alone[e_pair] & (tok_hi < sl[p_req[e_pair]])
    if causal:
        ok &= tok_hi <= first
    if sliding_window is not None:
        ok &= unit_tok > last - sliding_window
        if not causal:
            ok &= tok_hi < first + sliding_window
    return ok
