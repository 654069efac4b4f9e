"""FLEX_ATTENTION's decode path: requests with ``query_len == 1`` as a batch of their own.

A query block of ``q_block_size`` decode tokens belongs to as many requests, so in the flattened
call its row would be the union of their KV blocks (~``q_block_size`` x redundant work on a
pure-decode batch). The decode call instead has queries ``[R, Hq, 1, D]`` (``R`` decode requests)
against the same batch-1 K/V view, and a block mask whose batch dim is ``R``: row ``r`` lists only
request ``r``'s KV blocks, and the mask mod reads request ``r``'s block-table row and length
through the batch index. It runs when every decode request's blocks lie in one cache window
(always below 2^31 cache elements); otherwise the whole batch takes the flattened call.

With static shapes the batch is padded to a power of 2 (rows of length 0, no tiles, outputs
dropped), so compiled Flex sees a static batch size: the condition for its split-KV decoding
kernel, which packs a KV head's query heads (GQA) into one tile's rows and splits long contexts
across programs. Whole visible pages are full tiles (no mask mod) outside batch invariance.

KV tiles of the decode call (builder option ``decode_tiles``). A Flex KV tile is a contiguous
run of the K/V view, so a tile wider than a page (``kv_block_size > n``: the default 64 at pages
of 16) holds pages of other requests, which the kernel loads and the mask mod then discards:
with shuffled pages ~``kv_block_size / n`` x the bytes a decode needs (3.9x at 64 over 16).
``"auto"`` (default) gives the decode call tiles of one page (``n``, when that is a power of 2
>= 16) whenever ``kv_block_size > n``, and ``BLOCK_N`` to match; otherwise its tiles are the
layer's. It lists whole pages as full tiles only where the decoding kernel runs one split per
(request, KV head) (``rows * H_kv > SMs``): with full tiles, torch's decoding template sizes each
split from the whole K/V view (``cdiv(KV_LEN, SPLIT_KV)``, flex_decode.py.jinja), so one split
would do every full tile while the others idle; below that batch size every tile is partial (the
mask mod runs, the splits share the work), and the split count is pinned to the one this choice
assumed. ``"kv"``: the layer's tiles and the full-tile rule of the flattened call (the behaviour
before ``decode_tiles``; kept for A/B measurements). Batch invariance is unaffected either way:
it needs ``kv_block_size <= n``, so its decode tiles are the layer's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kv_backends.backends.flex.entries import build_flex_block_entries
from kv_backends.backends.flex.geometry import CacheGeometry
from kv_backends.backends.flex.mask_mods import make_decode_mask_mod
from kv_backends.backends.flex.options import flex_has_backend_option
from kv_backends.base import AttentionMetadata
from kv_backends.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from kv_backends.backends.flex.metadata import FlexMetadataBuilder

__all__ = [
    "DECODE_TILE_MODES",
    "FlexDecode",
    "build_decode_call",
    "decode_kv_block_size",
    "decode_split_kv",
    "uses_decoding_kernel",
]

#: Values of the builder option ``decode_tiles`` (see the module docstring).
DECODE_TILE_MODES = ("auto", "kv")


def decode_kv_block_size(mode: str, kv_block_size: int, n: int) -> int:
    """The decode call's KV tile in physical tokens: one page (``n``) when the layer's tile is
    wider than a page and ``mode == "auto"``; otherwise the layer's ``kv_block_size``."""
    if mode not in DECODE_TILE_MODES:
        raise ValueError(f"FLEX_ATTENTION decode_tiles={mode!r} must be one of {DECODE_TILE_MODES}")
    # kv_block_size > n passes FlexOptions.resolve only for a power-of-2 n dividing it.
    if mode == "kv" or kv_block_size <= n or n < 16 or n & (n - 1):
        return kv_block_size
    return n


def uses_decoding_kernel(
    *, batch_invariant: bool, static_shapes: bool, group: int, kv_block_size: int
) -> bool:
    """Whether a CUDA decode call runs Flex's split-KV decoding kernel (else the main one):
    outside batch invariance, with static shapes, a power-of-2 GQA group, and a torch with the
    ``BACKEND`` option or tiles >= 128 (not known to work below that on torch 2.11)."""
    return not (
        batch_invariant
        or not static_shapes
        or group & (group - 1)
        or (not flex_has_backend_option() and kv_block_size < 128)
    )


#: Decode programs per SM that a pinned split aims for (see :func:`decode_split_kv`).
_DECODE_SPLIT_PROGRAMS_PER_SM = 8


def decode_split_kv(device: torch.device, rows: int, num_kv_heads: int) -> int:
    """The KV split count of a decode call of ``rows`` x ``num_kv_heads`` programs.

    Where torch's own choice (``get_split_k`` in torch/_inductor/kernel/flex/flex_decoding.py:
    2 per SM the programs leave free) is 1, that stays (one split per program: whole pages then
    run as full tiles). Otherwise the split is raised to the largest power of two that gives at
    most ``_DECODE_SPLIT_PROGRAMS_PER_SM`` programs per SM: the decode call's tiles are one page, so
    each split's loop of 16-token tiles has little in flight, and more splits are what keep
    loads in flight. H100, bf16 32 q / 8 kv heads, decode 8 x 32k at page 16 (bench_flex.py
    ``--decode-kernel-options``): torch's 4 splits 1.68 TB/s, 8 -> 2.53, 16 -> 2.85 (0.94 of
    the copy), 32 -> 2.81. A function of the (padded) row count and the heads only, so a
    serving loop compiles one kernel per captured row count."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    programs = max(rows * num_kv_heads, 1)
    torch_split = max(sms // programs * 2, 1)
    if torch_split == 1:
        return 1
    want = _DECODE_SPLIT_PROGRAMS_PER_SM * sms // programs
    return max(torch_split, 1 << (want.bit_length() - 1))


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    # one driver query per device, not one per step
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@dataclass(frozen=True)
class FlexDecode:
    """The decode call: one batch row per request with ``query_len == 1``."""

    tok: torch.Tensor  # [R] int64 query row of each decode request
    contiguous: bool  # tok == arange(R): queries and outputs are the first R rows, no gather
    pos: torch.Tensor  # [rows] int32 logical position of each query (seq_len - 1; 0 padding)
    rows: int  # batch rows of the call: R, or R padded to a captured size (static shapes)
    gather: torch.Tensor  # [rows] int64 query row of each batch row (tok, then 0 for padding)
    base_token: int  # first physical token of the (single) window the call reads
    length: int  # physical tokens in that window
    block_mask: Any  # torch BlockMask of batch R
    kv_block_size: int = 0  # physical tokens per KV tile of this call (see decode_kv_block_size)
    #: SPLIT_KV to pin on the decoding kernel (the count the full-tile choice assumed); ``None``:
    #: leave it to torch (``decode_tiles="kv"``, CPU, or the main kernel).
    split_kv: int | None = None
    #: First query row of the decode requests when their rows are one run (``tok == start +
    #: arange(R)``: decodes leading or trailing the batch), else -1. Queries are then read as a
    #: slice and outputs written into one, no gather or scatter.
    start: int = -1


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
    cfg = builder.config
    r = dec_h.numel()
    dev = base.seq_lens.device
    tok_h = common.host_query_start_loc().long()[:-1][dec_h]
    dec_req = dec_h.to(dev)
    seq_lens = base.seq_lens[dec_req]  # [R] int32
    block_table = base.block_table[dec_req]  # [R, M] int32
    rows = builder.decode_rows(r)
    kvb, full_blocks, split = _decode_tiles(builder, dev, rows)
    # One request per "query block" of one token: the same trimming as the flattened path;
    # pos is each query's position, seq_len - 1.
    ent = build_flex_block_entries(
        query_start_loc=torch.arange(r + 1, device=dev),
        seq_lens=seq_lens,
        block_table=block_table,
        num_tokens=r,
        n=builder.n,
        tpb=geo.tpb,
        q_block_size=1,
        kv_block_size=kvb,
        causal=cfg.causal,
        sliding_window=cfg.sliding_window,
        logical_order=cfg.batch_invariant,
        full_blocks=full_blocks,
    )
    pos_r, e_row, e_f, e_full = ent.q_pos, ent.qb, ent.kv, ent.full.long()
    # Windows are aligned to lcm(tpb, kv_block_size), a multiple of kvb (a power-of-2 divisor).
    kv_per_window = geo.window_tokens // kvb
    e_w = e_f // kv_per_window
    counts = torch.zeros(2, r, dtype=torch.long, device=dev)  # [partial/full, R]
    counts.index_put_((e_full, e_row), torch.ones_like(e_row), accumulate=True)
    # One host sync for the window test and the column count.
    w_lo, w_hi, max_cols = torch.stack([e_w.min(), e_w.max(), counts.max()]).tolist()
    if w_lo != w_hi:
        return None, None
    cpu = {"kv_len": geo.window_len(w_lo), "kv_block": kvb}
    builder.grow_index_buffer("dec_indices", max_cols, **cpu)
    builder.grow_index_buffer("dec_full_indices", max_cols, **cpu)
    tables = []
    for kind, (nbuf, ibuf) in enumerate(
        [
            (builder.dec_num_blocks, builder.dec_indices),
            (builder.dec_full_num_blocks, builder.dec_full_indices),
        ]
    ):
        num, idx = nbuf[:rows], ibuf[:rows]
        num.zero_()
        num[:r] = counts[kind]
        idx.zero_()
        sel = e_full == kind
        # Entries are sorted by row first: position in the row = index - row start.
        row_start = torch.cumsum(counts[kind], 0) - counts[kind]
        col = torch.arange(int(sel.sum()), device=dev) - row_start[e_row[sel]]
        idx[e_row[sel], col] = (e_f[sel] - w_lo * kv_per_window).int()
        tables.append((num, idx))
    if rows != r or builder.static_shapes:
        # Padded rows: length 0 (the mask refuses every key), no KV tiles, outputs dropped.
        seq_lens, block_table, pos = builder.padded_decode_rows(seq_lens, block_table, pos_r, rows)
    else:
        pos = pos_r
    # Full tiles where listed; on the CPU always (empty when not listed): torch 2.15's C++ Flex
    # decoding template reads full_kv_num_blocks unconditionally and fails to compile without.
    full = tables[1] if full_blocks or dev.type == "cpu" else None
    mask = _decode_block_mask(builder, geo, tables[0], full, seq_lens, block_table, w_lo, kvb)
    served = torch.zeros(base.num_reqs, dtype=torch.bool, device=dev)
    served[dec_req] = True
    gather = torch.zeros(rows, dtype=torch.long)
    gather[:r] = tok_h
    first = int(tok_h[0])
    run = bool(torch.equal(tok_h, torch.arange(first, first + r)))
    decode = FlexDecode(
        tok=tok_h.to(dev),
        contiguous=run and first == 0,
        pos=pos,
        rows=rows,
        gather=gather.to(dev),
        base_token=w_lo * geo.window_tokens,
        length=geo.window_len(w_lo),
        block_mask=mask,
        kv_block_size=kvb,
        split_kv=split,
        start=first if run else -1,
    )
    return decode, served


def _decode_tiles(
    builder: FlexMetadataBuilder, dev: torch.device, rows: int
) -> tuple[int, bool, int | None]:
    """``(kv tile, list full tiles, SPLIT_KV to pin)`` of a decode call of ``rows`` batch rows."""
    opts, cfg = builder.options, builder.config
    kvb = decode_kv_block_size(builder.decode_tiles, opts.kv_block_size, builder.n)
    if builder.decode_tiles == "kv":
        return kvb, builder.full_blocks, None
    full = not cfg.batch_invariant and kvb <= builder.n
    split = None
    if (
        full
        and dev.type == "cuda"
        and uses_decoding_kernel(
            batch_invariant=cfg.batch_invariant,
            static_shapes=builder.static_shapes,
            group=cfg.num_queries_per_kv,
            kv_block_size=kvb,
        )
    ):
        split = decode_split_kv(dev, rows, cfg.num_kv_heads)
        full = split == 1
    return kvb, full, split


def _decode_block_mask(
    builder: FlexMetadataBuilder,
    geo: CacheGeometry,
    partial: tuple[torch.Tensor, torch.Tensor],  # [rows] count, [rows, cols] window-relative ids
    full: tuple[torch.Tensor, torch.Tensor] | None,  # the same for tiles the row sees whole
    seq_lens: torch.Tensor,  # [rows] int32
    block_table: torch.Tensor,  # [rows, M] int32
    window: int,
    kv_block_size: int,
) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    cfg = builder.config
    extra: dict[str, torch.Tensor] = {}
    if full is not None:
        extra = {
            "full_kv_num_blocks": full[0][:, None, None],
            "full_kv_indices": full[1][:, None, None],
        }
    return BlockMask.from_kv_blocks(
        partial[0][:, None, None],
        partial[1][:, None, None],
        **extra,
        BLOCK_SIZE=(builder.decode_q_block_size, kv_block_size),
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
