"""FLEX_ATTENTION's gathered prefill (builder option ``prefill="gather"``): the flattened call
reads a private copy of the batch's visible context instead of the paged cache.

Why. Over the paged view a KV tile of ``kv_block_size`` physical tokens holds pages of whatever
requests the allocator put there: with small pages (16) and shuffled blocks most of a 64-token
tile is other requests' keys, masked element by element, so prefill does several times the work
of dense causal Flex. Copying each prefilling request's visible keys into one contiguous buffer
(one gather of ``G`` tokens, ~``3 x`` the context bytes once per step and layer, small beside a
prefill's FLOPs) makes every tile one request's consecutive keys: the interior of the causal
triangle becomes full tiles (no mask mod), and the tile count is dense Flex's.

How. The buffer is itself a paged cache with pages of ``kv_block_size`` tokens, request ``r``'s
pages consecutive from page ``page0[r]``, starting at its window's first tile: so the ordinary
entry builder (:func:`~kv_backends.backends.flex.entries.build_flex_block_entries`) and mask mods
run on it unchanged, with a per-batch page table and physical -> logical map of the buffer; and
since one request's pages are consecutive in logical order, a query row's visible keys are one
interval of buffer indices (the span mask, :mod:`~kv_backends.backends.flex.span`).
Its size is padded to a power of 2 of pages under static shapes. Not with batch invariance (the
buffer's tiles are not the trainer's) nor ALiBi (the score mod reads cache positions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kv_backends.backends.flex.entries import FlexEntries, build_flex_block_entries
from kv_backends.backends.flex.geometry import CacheGeometry
from kv_backends.backends.flex.span import SpanInputs, write_row_spans
from kv_backends.backends.flex.windows import FlexWindow, MaskInputs, build_windows
from kv_backends.base import AttentionMetadata
from kv_backends.config import AttentionConfig

if TYPE_CHECKING:
    from kv_backends.backends.flex.metadata import FlexMetadataBuilder

__all__ = ["PREFILL_MODES", "build_gathered_window", "check_prefill", "gather_tokens"]

#: Values of the builder option ``prefill``.
PREFILL_MODES = ("paged", "gather")


def gather_tokens(
    cache: torch.Tensor,  # [B, H, n, C] kernel-block view of one layer
    tpb: int,
    tokens: torch.Tensor,  # [G] int64 physical tokens
) -> torch.Tensor:
    """The gathered buffer ``[G, H, C]`` (contiguous): row ``i`` is physical token
    ``tokens[i]`` of the layer (in-block token ``t % tpb`` of block ``t // tpb``)."""
    b, h, n, c = cache.shape
    _, sh, sn, _ = cache.stride()
    flat = cache.as_strided(((b - 1) * tpb + n, h, c), (sn, sh, 1), cache.storage_offset())
    return flat.index_select(0, tokens)


def build_gathered_window(
    builder: FlexMetadataBuilder,
    base: AttentionMetadata,
    served: torch.Tensor | None,  # [R] bool, requests the decode call serves
    padded: int,
    geo: CacheGeometry,
) -> tuple[FlexWindow, ...]:
    """The flattened call of a batch over a gathered buffer: ``()`` when no request needs it."""
    kvb, cfg, n = builder.options.kv_block_size, builder.config, builder.n
    sl = base.seq_lens.long()
    qsl = base.query_start_loc.long()
    q_len = qsl[1:] - qsl[:-1]
    active = q_len > 0
    if served is not None:
        active &= ~served
    first_tile = torch.zeros_like(sl)
    if cfg.sliding_window is not None:
        first_tile = (sl - q_len - cfg.sliding_window + 1).clamp(min=0) // kvb
    pages = torch.where(active, -(-sl // kvb) - first_tile, 0)  # [R] buffer pages per request
    page0 = torch.cumsum(pages, 0) - pages  # [R]
    total = int(pages.sum())  # the step's one host sync for the buffer size
    if total == 0:
        return ()
    total_pad = builder.gathered_pages(total)
    # The buffer's page table, in logical columns of kvb tokens: column c of request r (from its
    # first tile) is page page0[r] + c - first_tile[r]; other columns -1 (never read: the
    # entries are trimmed to the window, the mask mod's ownership test fails on them).
    cols = int(-(-int(base.max_seq_len) // kvb))
    c = torch.arange(cols, device=sl.device)
    valid = active[:, None] & (c[None] >= first_tile[:, None]) & (c[None] < -(-sl // kvb)[:, None])
    table = torch.where(valid, page0[:, None] + c[None] - first_tile[:, None], -1)  # [R, cols]
    rr, cc = torch.nonzero(valid, as_tuple=True)  # sorted by (r, c): the buffer's page order
    ptl = builder.gathered_phys_to_logical(total_pad)
    ptl[table[rr, cc]] = cc.int()
    # Each page is one request's private copy: the owner mask mod is exact here (windows.py).
    g_req = builder.gathered_block_req(total_pad)
    g_req.fill_(-1)  # padding pages (and last step's entries) belong to no request
    g_req[table[rr, cc]] = rr.int()
    tokens = builder.gathered_token_buffer(total_pad * kvb)
    tokens.zero_()
    pos = cc[:, None] * kvb + torch.arange(kvb, device=sl.device)[None]  # [P, kvb] positions
    ok = pos < sl[rr][:, None]
    pos_ok = torch.where(ok, pos, 0)
    blk = base.block_table.long()[rr[:, None], pos_ok // n]
    tokens[: total * kvb] = torch.where(ok, blk * geo.tpb + pos_ok % n, 0).flatten()
    ent: FlexEntries = build_flex_block_entries(
        query_start_loc=base.query_start_loc,
        seq_lens=base.seq_lens,
        block_table=table,
        num_tokens=base.num_actual_tokens,
        n=kvb,
        tpb=kvb,
        q_block_size=builder.options.q_block_size,
        kv_block_size=kvb,
        causal=cfg.causal,
        sliding_window=cfg.sliding_window,
        exclude_reqs=served,
        full_blocks=True,
    )
    builder.write_queries(ent.q_req, ent.q_pos, padded)
    gtok = total_pad * kvb
    ggeo = CacheGeometry(kvb, kvb, total_pad, geo.sn, gtok, gtok)
    if builder.static_shapes:
        seq_lens, tab = builder.padded_table("gather", base.seq_lens, table.int())
    else:
        seq_lens, tab = base.seq_lens, table.int()
    no_conflict = torch.zeros((), dtype=torch.bool, device=sl.device)
    owner = torch.full((), builder.owner_mask, dtype=torch.bool, device=sl.device)
    span = None
    if builder.span_mask:
        # Request r's pages are consecutive in logical order from page0[r]: the buffer index
        # is the key number, logical position 0 of r at (page0[r] - first_tile[r]) * kvb.
        lo, hi = write_row_spans(
            builder.row_lo,
            builder.row_hi,
            ent.q_req,
            ent.q_pos,
            base.seq_lens,
            (page0 - first_tile) * kvb,
            active,
            padded,
            causal=cfg.causal,
            sliding_window=cfg.sliding_window,
        )
        span = SpanInputs(lo, hi)
    masks = MaskInputs(seq_lens, tab, ptl, kvb, g_req, owner, span)
    wins = build_windows(builder, padded, ggeo, ent, no_conflict, masks, full=True)
    # One window: the buffer is far below 2^31 elements' worth of tokens per view.
    return tuple(FlexWindow(0, gtok, w.block_mask, gather=tokens[:gtok]) for w in wins)


def check_prefill(prefill: object, config: AttentionConfig, tile_spans_pages: bool) -> str:
    """The builder option ``prefill`` resolved: ``"paged"`` or ``"gather"`` (this module).
    ``"auto"``: gather where a KV tile spans pages (``tile_spans_pages``: most of a tile would be
    other requests' keys) and nothing forbids it, else paged."""
    if prefill == "auto":
        ok = not (config.batch_invariant or config.use_alibi)
        return "gather" if tile_spans_pages and ok else "paged"
    if prefill not in PREFILL_MODES:
        raise ValueError(
            f"FLEX_ATTENTION prefill={prefill!r} must be 'auto' or one of {PREFILL_MODES}"
        )
    if prefill == "gather" and config.batch_invariant:
        raise ValueError(
            "FLEX_ATTENTION prefill='gather' cannot keep batch invariance (the gathered "
            "buffer's tiles are not the trainer's); use prefill='paged'"
        )
    if prefill == "gather" and config.use_alibi:
        raise ValueError(
            "FLEX_ATTENTION prefill='gather' does not support ALiBi (its score mod reads cache "
            "positions); use prefill='paged'"
        )
    return str(prefill)
