"""FLEX_ATTENTION's decode path: requests with ``query_len == 1`` as a batch of their own.

A query block of ``q_block_size`` decode tokens belongs to as many requests, so in the flattened
call its row would be the union of their KV blocks (~``q_block_size`` x redundant work on a
pure-decode batch). The decode call instead has queries ``[R, Hq, 1, D]`` (``R`` decode requests)
against the same batch-1 K/V view, and a block mask whose batch dim is ``R``: row ``r`` lists only
request ``r``'s KV blocks, and the mask mod reads request ``r``'s block-table row and length
through the batch index. It runs when every decode request's blocks lie in one cache window
(always below 2^31 cache elements); otherwise the whole batch takes the flattened call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kv_backends.backends.flex_mask import (
    CacheGeometry,
    build_flex_block_indices,
    make_decode_mask_mod,
)
from kv_backends.base import AttentionMetadata
from kv_backends.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from kv_backends.backends.flex_metadata import FlexMetadataBuilder

__all__ = ["FlexDecode", "build_decode_call"]


@dataclass(frozen=True)
class FlexDecode:
    """The decode call: one batch row per request with ``query_len == 1``."""

    tok: torch.Tensor  # [R] int64 query row of each decode request
    contiguous: bool  # tok == arange(R): queries and outputs are the first R rows, no gather
    pos: torch.Tensor  # [R] int32 logical position of each query (seq_len - 1)
    base_token: int  # first physical token of the (single) window the call reads
    length: int  # physical tokens in that window
    block_mask: Any  # torch BlockMask of batch R


def _decode_requests(
    builder: FlexMetadataBuilder, common: CommonAttentionMetadata
) -> torch.Tensor | None:
    """Host indices ``[R]`` of the decode requests, or ``None`` when there are none."""
    qsl_h = common.host_query_start_loc().long()
    dec_h = torch.nonzero(qsl_h[1:] - qsl_h[:-1] == 1).flatten()  # host [R]
    if dec_h.numel() == 0:
        return None
    if dec_h.numel() > builder.dec_num_blocks.shape[0]:
        raise ValueError(
            f"batch has {dec_h.numel()} decode requests; this builder was made for "
            f"max_num_seqs={builder.max_num_seqs}"
        )
    return dec_h


def build_decode_call(
    builder: FlexMetadataBuilder,
    common: CommonAttentionMetadata,
    base: AttentionMetadata,
    geo: CacheGeometry,
) -> tuple[FlexDecode | None, torch.Tensor | None]:
    """The decode call of a batch and the requests it serves (bool ``[num_reqs]``), or
    ``(None, None)`` when the batch has no decode request or they span several windows.

    Writes ``builder.dec_num_blocks`` / ``builder.dec_indices`` (growing the latter's column
    count when a batch needs more)."""
    dec_h = _decode_requests(builder, common)
    if dec_h is None:
        return None, None
    opts, cfg = builder.options, builder.config
    r = dec_h.numel()
    dev = base.seq_lens.device
    tok_h = common.host_query_start_loc().long()[:-1][dec_h]
    dec_req = dec_h.to(dev)
    seq_lens = base.seq_lens[dec_req]  # [R] int32
    block_table = base.block_table[dec_req]  # [R, M] int32
    # One request per "query block" of one token: the same trimming as the flattened path;
    # pos is each query's position, seq_len - 1.
    _, pos, e_row, e_f = build_flex_block_indices(
        query_start_loc=torch.arange(r + 1, device=dev),
        seq_lens=seq_lens,
        block_table=block_table,
        num_tokens=r,
        n=builder.n,
        tpb=geo.tpb,
        q_block_size=1,
        kv_block_size=opts.kv_block_size,
        causal=cfg.causal,
        sliding_window=cfg.sliding_window,
    )
    kv_per_window = geo.window_tokens // opts.kv_block_size
    e_w = e_f // kv_per_window
    counts = torch.zeros(r, dtype=torch.long, device=dev)
    counts.index_add_(0, e_row, torch.ones_like(e_row))
    # One host sync for the window test and the column count.
    w_lo, w_hi, max_cols = torch.stack([e_w.min(), e_w.max(), counts.max()]).tolist()
    if w_lo != w_hi:
        return None, None
    if max_cols > builder.dec_indices.shape[1]:
        grown = 1 << (max_cols - 1).bit_length()
        builder.dec_indices = torch.zeros(
            builder.dec_indices.shape[0], grown, dtype=torch.int32, device=builder.device
        )
    num = builder.dec_num_blocks[:r]
    num.copy_(counts)
    idx = builder.dec_indices[:r]
    idx.zero_()
    # Entries are sorted by (row, KV block): position in the row = index - row start.
    row_start = torch.cumsum(counts, 0) - counts
    col = torch.arange(e_row.numel(), device=dev) - row_start[e_row]
    idx[e_row, col] = (e_f - w_lo * kv_per_window).int()
    mask = _decode_block_mask(builder, geo, num, idx, seq_lens, block_table, w_lo)
    served = torch.zeros(base.num_reqs, dtype=torch.bool, device=dev)
    served[dec_req] = True
    decode = FlexDecode(
        tok=tok_h.to(dev),
        contiguous=bool(torch.equal(tok_h, torch.arange(r))),
        pos=pos,
        base_token=w_lo * geo.window_tokens,
        length=geo.window_len(w_lo),
        block_mask=mask,
    )
    return decode, served


def _decode_block_mask(
    builder: FlexMetadataBuilder,
    geo: CacheGeometry,
    num: torch.Tensor,  # [R] int32 KV blocks per row
    idx: torch.Tensor,  # [R, cols] int32 window-relative KV block ids
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, M] int32
    window: int,
) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    opts, cfg = builder.options, builder.config
    return BlockMask.from_kv_blocks(
        num[:, None, None],
        idx[:, None, None],
        BLOCK_SIZE=(opts.q_block_size, opts.kv_block_size),
        mask_mod=make_decode_mask_mod(
            seq_lens=seq_lens,
            phys_to_logical=builder.phys_to_logical,
            block_table=block_table,
            n=builder.n,
            tpb=geo.tpb,
            base_block=window * geo.window_tokens // geo.tpb,
            causal=cfg.causal,
            sliding_window=cfg.sliding_window,
        ),
        seq_lengths=(1, geo.window_len(window)),
        compute_q_blocks=False,
    )
