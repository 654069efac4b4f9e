"""FLEX_ATTENTION's flattened call, cut into cache windows: each window's block mask (partial and
full tiles in the builder's persistent index buffers) and the mask mod it carries.

Split from :mod:`~kv_backends.backends.flex.metadata` (the builder calls :func:`build_windows`
for the paged cache, :mod:`~kv_backends.backends.flex.gather` for its gathered buffer).

The mask mod. All are exact per (query, key) pair; they differ in cost on partial tiles:

- ``"span"`` (:mod:`~kv_backends.backends.flex.span`, builder option ``mask="auto"``, the
  default): each query row's visible keys as one interval of key numbers precomputed per row, so
  a partial tile's mask is two compares after two loads per row (and, over the paged cache, one
  per column). Exact where the owner mask is and the key numbers fit int32; otherwise ``auto``
  falls back to the owner mask, then the table mask.

- ``"owner"`` (:func:`~kv_backends.backends.flex.mask_mods.make_owner_mask_mod`, builder option
  ``mask="owner"``: the default before the span mask, kept for A/B runs): two loads per query
  row and per key column (the column's owning request and logical block), so a partial tile
  costs little more than dense causal Flex's. Exact when no block is read by two requests of the
  flattened call (blocks outside the batch own no request): always in the gathered buffer
  (private pages of one request each), and over the paged cache unless a block is shared (a
  prefix-cache hit shares blocks; the builder checks each step, with its other checks).
- ``"table"`` (:func:`~kv_backends.backends.flex.mask_mods.make_mask_mod`): the ownership test reads
  ``block_table[request of the row, logical block of the column]``, a gather indexed by both,
  ``BLOCK_M x BLOCK_N`` loads per partial tile. Exact everywhere; used where the owner mask is
  not, under batch invariance (its mask mod stays the one the trainer's rows were pinned with),
  and with the builder option ``mask="table"`` (the behaviour before, for A/B runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kv_backends.backends.flex.entries import FlexEntries
from kv_backends.backends.flex.geometry import CacheGeometry
from kv_backends.backends.flex.mask_mods import make_mask_mod, make_owner_mask_mod
from kv_backends.backends.flex.span import SpanInputs, make_keyed_span_mask_mod, make_span_mask_mod

if TYPE_CHECKING:
    from kv_backends.backends.flex.metadata import FlexMetadataBuilder

__all__ = ["MASK_MODES", "FlexWindow", "MaskInputs", "build_windows"]

#: Values of the builder option ``mask`` (see the module docstring).
MASK_MODES = ("auto", "owner", "table")


@dataclass(frozen=True)
class FlexWindow:
    """One flattened Flex call: the cache window it reads and its block mask."""

    base_token: int  # first physical token of the window
    length: int  # physical tokens in the window
    block_mask: Any  # torch BlockMask
    #: Gathered prefill: the physical token of each row of the call's private K/V buffer
    #: (``[length]`` int64); ``None`` when the call reads the paged cache itself.
    gather: torch.Tensor | None = None


@dataclass(frozen=True)
class MaskInputs:
    """What the windows' mask mods read (besides the builder's ``q_req`` / ``q_pos``)."""

    seq_lens: torch.Tensor  # [rows] int32
    table: torch.Tensor  # [rows, cols] int32 block table (the "table" mask)
    phys_to_logical: torch.Tensor  # [blocks] int32
    n: int  # tokens per block (page)
    #: ``[blocks]`` int32, the one request reading each block: the "owner" mask when its
    #: conditions hold (``owner_ok``, a 0-d bool tensor synced with the step's other checks).
    block_req: torch.Tensor | None = None
    owner_ok: torch.Tensor | None = None
    #: The span mask's rows and keys (span.py): used where ``owner_ok`` holds.
    span: SpanInputs | None = None


def build_windows(
    builder: FlexMetadataBuilder,
    padded: int,  # query rows of the call
    geo: CacheGeometry,
    ent: FlexEntries,
    conflict: torch.Tensor,  # 0-d bool: a block at two logical positions
    masks: MaskInputs,
    *,
    full: bool,  # lay out full tiles
) -> tuple[FlexWindow, ...]:
    """Cut the entries into cache windows; one block mask per window that holds entries."""
    opts = builder.options
    e_qb, e_f, e_full = ent.qb, ent.kv, ent.full.long()
    kv_per_window = geo.window_tokens // opts.kv_block_size
    e_w = e_f // kv_per_window
    nqb = max(-(-padded // opts.q_block_size), 1)
    windows_present = torch.unique(e_w) if e_w.numel() else e_w
    w_list = windows_present.tolist()
    w_rank = torch.searchsorted(windows_present, e_w) if e_w.numel() else e_w
    # Entries per (window, partial/full, query block): the column counts this step needs.
    row_key = (w_rank * 2 + e_full) * nqb + e_qb
    per_row = torch.zeros(max(len(w_list), 1) * 2 * nqb, dtype=torch.long, device=e_qb.device)
    per_row.index_put_((row_key,), torch.ones_like(e_qb), accumulate=True)
    # One host sync for every count and flag this step needs.
    owner_ok = masks.owner_ok if masks.owner_ok is not None else torch.zeros((), dtype=torch.bool)
    max_cols, has_conflict, owner = torch.stack(
        [per_row.max(), conflict.to(per_row.device).long(), owner_ok.to(per_row.device).long()]
    ).tolist()
    if has_conflict:
        raise ValueError(
            "a physical block appears at two different logical positions in this batch; the "
            "Flex backend's physical->logical table needs one position per block per step"
        )
    cpu = {"kv_len": geo.window_tokens, "kv_block": opts.kv_block_size}
    builder.grow_index_buffer("kv_indices", max_cols, **cpu)
    if full:
        builder.grow_index_buffer("full_kv_indices", max_cols, **cpu)
    windows: list[FlexWindow] = []
    for rank, w in enumerate(w_list):
        rows: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        for kind in (0, 1) if full else (0,):
            sel = (w_rank == rank) & (e_full == kind)
            rows[kind] = _window_rows(
                builder,
                nqb,
                e_qb[sel],
                e_f[sel] - w * kv_per_window,
                row_key[sel],
                full=kind == 1,
                fresh=rank > 0,
            )
        windows.append(_window(builder, padded, geo, w, rows[0], rows[1], masks, owner=bool(owner)))
    return tuple(windows)


def _window_rows(
    builder: FlexMetadataBuilder,
    nqb: int,
    qbs: torch.Tensor,  # [E_w] query block of each entry of this window
    fs: torch.Tensor,  # [E_w] window-relative Flex KV block
    rk: torch.Tensor,  # [E_w] (window, kind, query block) row key, sorted
    *,
    full: bool,
    fresh: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_num_blocks`` ``[nqb]`` and ``kv_indices`` ``[nqb, cols]`` of one window (its
    partial tiles, or with ``full`` its full ones)."""
    # Position of each entry within its row; entries are sorted by query block first, so
    # the selected entries of one (window, kind, qb) are contiguous.
    first = torch.ones_like(rk, dtype=torch.bool)
    first[1:] = rk[1:] != rk[:-1]
    ar = torch.arange(rk.numel(), device=rk.device)
    group_start = torch.cummax(torch.where(first, ar, 0), 0).values
    pos = ar - group_start
    num = (builder.full_kv_num_blocks if full else builder.kv_num_blocks)[:nqb]
    idx = (builder.full_kv_indices if full else builder.kv_indices)[:nqb]
    if fresh:
        # Each window needs its own buffers (the block masks live together in one step).
        num, idx = num.clone(), idx.clone()
    num.zero_()
    num.index_put_((qbs,), torch.ones_like(qbs, dtype=torch.int32), accumulate=True)
    idx.zero_()
    idx[qbs, pos] = fs.int()
    return num, idx


def _window(
    builder: FlexMetadataBuilder,
    padded: int,
    geo: CacheGeometry,
    w: int,
    partial: tuple[torch.Tensor, torch.Tensor] | None,
    full: tuple[torch.Tensor, torch.Tensor] | None,
    masks: MaskInputs,
    *,
    owner: bool,
) -> FlexWindow:
    from torch.nn.attention.flex_attention import BlockMask

    opts, cfg = builder.options, builder.config
    assert partial is not None
    length = geo.window_len(w)
    extra = {}
    if full is not None:
        extra = {
            "full_kv_num_blocks": full[0][None, None],
            "full_kv_indices": full[1][None, None],
        }
    common: dict[str, Any] = {
        "q_req": builder.q_req[:padded],
        "q_pos": builder.q_pos[:padded],
        "phys_to_logical": masks.phys_to_logical,
        "seq_lens": masks.seq_lens,
        "n": masks.n,
        "tpb": geo.tpb,
        "base_block": w * geo.window_tokens // geo.tpb,
        "causal": cfg.causal,
        "sliding_window": cfg.sliding_window,
    }
    span = masks.span
    if owner and span is not None and span.block_key is None:
        mask_mod = make_span_mask_mod(row_lo=span.row_lo, row_hi=span.row_hi)
    elif owner and span is not None:
        assert span.block_key is not None
        mask_mod = make_keyed_span_mask_mod(
            row_lo=span.row_lo,
            row_hi=span.row_hi,
            block_key=span.block_key,
            n=masks.n,
            tpb=geo.tpb,
            base_block=common["base_block"],
        )
    elif owner:
        assert masks.block_req is not None
        mask_mod = make_owner_mask_mod(block_req=masks.block_req, **common)
    else:
        mask_mod = make_mask_mod(block_table=masks.table, **common)
    mask = BlockMask.from_kv_blocks(
        partial[0][None, None],
        partial[1][None, None],
        **extra,
        BLOCK_SIZE=(opts.q_block_size, opts.kv_block_size),
        mask_mod=mask_mod,
        seq_lengths=(padded, length),
        compute_q_blocks=False,
    )
    return FlexWindow(w * geo.window_tokens, length, mask)
