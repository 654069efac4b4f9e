"""FLEX_ATTENTION: torch FlexAttention over the paged cache, with a block mask built per batch.

How the cache is seen. The kernel-block view ``[B, H, n, C]`` of a token-major (NHD) order has a
token stride ``sn`` and a block stride ``sb = tpb * sn`` (``tpb = n`` for LBNHC, ``L * n`` for
BLNHC, more with padded pages). So the whole layer is one strided sequence of *physical tokens*:
K is ``[1, H, T_phys, D]`` with strides ``(sh, sn, 1)`` and physical token ``t`` is in-block token
``t % tpb`` of kernel block ``t // tpb`` (in-block tokens ``>= n`` belong to other layers or to
padding and are always masked). HND orders put heads outside tokens, so no such view exists: they
are rejected, and the reason says so.

The batch. Queries are flattened to ``[1, Hq, T, D]``; query block ``i`` is tokens
``[i * q_block_size, (i + 1) * q_block_size)`` and may span several requests. Its row of
``kv_indices`` lists every FlexAttention KV block (``kv_block_size`` physical tokens) any of its
requests needs, causally trimmed and window-trimmed. ``mask_mod`` then decides per token pair:
``physical -> logical`` is a per-block table (``phys_to_logical[block]``, written for the blocks of
this batch only: O(tokens) per step, never O(batch x total blocks)), and ownership is checked
exactly (``block_table[req, logical] == block``), so blocks of other requests inside a KV tile,
shared prefix blocks and stale entries are all handled.

Decodes. A query block of ``q_block_size`` decode tokens belongs to as many requests, so its row
is the union of their KV blocks and every query would be computed against all of them, masked
(~``q_block_size`` x redundant work on a pure-decode batch). Requests with ``query_len == 1``
therefore run as a batch of their own: queries ``[R, Hq, 1, D]`` (``R`` decode requests, a view
when they are the first ``R`` tokens, else a gather), K/V the same ``[1, H, T_phys, D]`` view
(Flex broadcasts a batch-1 K/V over the query batch), and a block mask whose batch dim is ``R``:
row ``r`` lists only request ``r``'s KV blocks, and ``mask_mod`` reads request ``r``'s block
table row and length through the batch index ``b``. Mixed batches make two Flex calls: the
decode requests through this path, the other requests through the flattened path above (the
decode requests' (query block, request) pairs are left out of its mask, so a query block of
decodes only costs nothing there), each written into its own rows of ``out``. A batch whose
decode requests need blocks from several cache windows (see below; caches over 2^31 elements
only) runs entirely through the flattened path. Under batch invariance the decode call is kept on
the main Flex template (the decode template's split count depends on the batch size).

Buffers. ``q_req`` / ``q_pos`` / ``kv_num_blocks`` / ``kv_indices`` are allocated once per builder
and sized by ``max_num_batched_tokens`` (query blocks), not by ``max_model_len``; the decode
path's ``dec_num_blocks`` / ``dec_indices`` by ``max_num_seqs``; each ``*_indices``
grows its column count when a batch needs more (outside CUDA-graph capture: this backend does not
support graphs, its builder syncs once per step).

Large caches. Torch's Flex templates compute element offsets in 32 bits, so a view over more
than 2^31 elements overflows. The view is cut into aligned *windows* of at most
``max_view_elements`` elements (default ``2**31 - 1``) and re-based onto each window's first
token (the base pointer carries the 64-bit offset). A batch whose blocks lie in one window (every
cache below 2^31 elements, and most batches over larger ones) runs one Flex call; otherwise one call
per window that holds blocks, merged exactly through their log-sum-exps.

Sinks are applied after the call from the log-sum-exp: ``out * sigmoid(lse - sink)`` equals a
softmax whose denominator has an extra ``exp(sink)``.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kv_backends.base import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    MetadataBuilder,
    kernel_block_view,
)
from kv_backends.capabilities import BackendCapabilities
from kv_backends.config import AttentionConfig
from kv_backends.metadata import CommonAttentionMetadata

__all__ = [
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexMetadataBuilder",
    "FlexOptions",
    "build_flex_block_indices",
]

_INT32_LIMIT = 2**31 - 1


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class FlexOptions:
    """Tile sizes of the Flex backend, validated against the kernel block size ``n``.

    - ``q_block_size``: query tokens per block-mask row (power of 2, >= 16).
    - ``kv_block_size``: physical KV tokens per block-mask column (power of 2, >= 16, dividing
      ``n`` or a multiple of it; ``<= n`` under batch invariance so a tile never mixes requests).
    - ``block_m`` / ``block_n``: the kernel's tiles (``kernel_options`` BLOCK_M / BLOCK_N), powers
      of 2 >= 16 dividing ``q_block_size`` / ``kv_block_size``.
    """

    q_block_size: int
    kv_block_size: int
    block_m: int
    block_n: int

    @classmethod
    def resolve(
        cls,
        n: int,
        *,
        batch_invariant: bool = False,
        q_block_size: int | None = None,
        kv_block_size: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
    ) -> FlexOptions:
        """Defaults filled in, every value validated; errors name the value and the bound."""
        if kv_block_size is None:
            # Largest power of 2 dividing n, capped at 128; without batch invariance at least 64
            # (big tiles are what makes Flex fast), which is then a multiple of a small n.
            pow2 = n & -n
            kv_block_size = min(pow2, 128)
            if not batch_invariant and kv_block_size < 64 and _is_pow2(n):
                kv_block_size = 64
        q_block_size = 16 if q_block_size is None else q_block_size
        block_m = min(q_block_size, 64) if block_m is None else block_m
        block_n = min(kv_block_size, 64) if block_n is None else block_n
        for name, v in (
            ("q_block_size", q_block_size),
            ("kv_block_size", kv_block_size),
            ("block_m", block_m),
            ("block_n", block_n),
        ):
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"flex {name}={v} must be a power of 2 >= 16")
        if n % kv_block_size and kv_block_size % n:
            raise ValueError(
                f"flex kv_block_size={kv_block_size} must divide the kernel block size {n} or be a "
                f"multiple of it; pick a power of 2 dividing {n}"
            )
        if batch_invariant and kv_block_size > n:
            raise ValueError(
                f"flex kv_block_size={kv_block_size} must be <= the kernel block size {n} under "
                "batch invariance (a KV tile must not mix blocks of different requests)"
            )
        if q_block_size % block_m:
            raise ValueError(f"flex block_m={block_m} must divide q_block_size={q_block_size}")
        if kv_block_size % block_n:
            raise ValueError(f"flex block_n={block_n} must divide kv_block_size={kv_block_size}")
        return cls(q_block_size, kv_block_size, block_m, block_n)


@dataclass(frozen=True)
class _CacheGeometry:
    """How the kernel-block view maps to physical tokens, and the windows it is cut into."""

    n: int  # tokens per kernel block
    tpb: int  # physical tokens per block stride
    num_blocks: int
    sn: int  # token stride (elements)
    window_tokens: int  # physical tokens per window (multiple of tpb and kv_block_size)
    total_tokens: int  # physical tokens of the whole view

    @property
    def num_windows(self) -> int:
        return -(-self.total_tokens // self.window_tokens)

    def window_len(self, w: int) -> int:
        return min(self.window_tokens, self.total_tokens - w * self.window_tokens)


def _geometry(kv_cache: torch.Tensor, kv_block_size: int, max_view_elements: int) -> _CacheGeometry:
    b, h, n, c = kv_cache.shape
    sb, sh, sn, sc = kv_cache.stride()
    if sc != 1 or sn < h * sh or sh < c:
        raise ValueError(
            f"FLEX_ATTENTION needs a token-major (NHD) cache with contiguous content; got strides "
            f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)} (use order LBNHC or BLNHC)"
        )
    if sb % sn:
        raise ValueError(
            f"FLEX_ATTENTION needs the block stride {sb} to be a multiple of the token stride {sn} "
            "(a padded page must pad by whole tokens); use an unpadded layout"
        )
    tpb = sb // sn
    align = math.lcm(tpb, kv_block_size)
    if tpb % min(n, kv_block_size):
        raise ValueError(
            f"FLEX_ATTENTION: block stride of {tpb} tokens is not a multiple of "
            f"min(block {n}, kv_block_size {kv_block_size})"
        )
    total = (b - 1) * tpb + n
    # Largest element offset inside a window of W tokens: (W-1)*sn + (h-1)*sh + c - 1.
    budget = max_view_elements - (h - 1) * sh - c
    window = (budget // sn + 1) // align * align
    if window <= 0:
        raise ValueError(
            f"max_view_elements={max_view_elements} cannot hold one aligned window of {align} "
            f"tokens x {sn} elements; raise it"
        )
    window = min(window, -(-total // align) * align)
    return _CacheGeometry(n, tpb, b, sn, window, total)


def build_flex_block_indices(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block-mask entries of a batch, in O(tokens + entries).

    Returns ``(q_req, q_pos, entry_qb, entry_kv)``: per query token its request and logical
    position (int32 ``[num_tokens]``), and the unique (query block, global FlexAttention KV block)
    pairs sorted by query block then KV block (int64). Global KV block ``f`` covers physical
    tokens ``[f * kv_block_size, (f + 1) * kv_block_size)``. Trimming: a query block needs, per
    request, logical blocks from its earliest query's window start to its last query's position
    (everything up to ``seq_len`` when not causal). ``exclude_reqs`` (bool ``[num_reqs]``) drops
    the entries of those requests (their tokens keep ``q_req`` / ``q_pos``; another call serves
    them).
    """
    dev = query_start_loc.device
    qsl = query_start_loc.long()
    sl = seq_lens.long()
    num_reqs = sl.numel()
    t = torch.arange(num_tokens, device=dev)
    q_req = torch.searchsorted(qsl[1:], t, right=True)  # [T]
    q_len = qsl[1:] - qsl[:-1]
    q_pos = sl[q_req] - q_len[q_req] + (t - qsl[q_req])  # [T]
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    if num_tokens == 0:
        return q_req.int(), q_pos.int(), empty, empty
    # (query block, request) pairs: consecutive tokens of one request in one query block.
    qb = t // q_block_size
    pair_key = qb * num_reqs + q_req
    pair_start = torch.ones(num_tokens, dtype=torch.bool, device=dev)
    pair_start[1:] = pair_key[1:] != pair_key[:-1]
    starts = torch.nonzero(pair_start).flatten()
    ends = torch.cat([starts[1:], torch.tensor([num_tokens], device=dev)]) - 1
    p_qb, p_req = qb[starts], q_req[starts]
    first_pos, last_pos = q_pos[starts], q_pos[ends]
    if causal:
        hi = last_pos
        lo = (
            (first_pos - sliding_window + 1).clamp(min=0)
            if sliding_window
            else torch.zeros_like(hi)
        )
    else:
        hi = sl[p_req] - 1
        lo = torch.zeros_like(hi)
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
    key = torch.unique(e_qb * nf + e_f)  # sorted, deduplicated
    return q_req.int(), q_pos.int(), key // nf, key % nf


def _make_mask_mod(
    *,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    phys_to_logical: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    n: int,
    tpb: int,
    base_block: int,
    causal: bool,
    sliding_window: int | None,
) -> Any:
    """The exact per-token-pair mask of one window (``kv_idx`` counts from the window's base)."""
    ncols = block_table.shape[1]

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        r = q_req[q_idx]
        blk = base_block + kv_idx // tpb
        off = kv_idx % tpb
        # Stale entries (blocks of earlier batches) are in range after the clamp and then fail
        # the ownership test below: block_table[r, lb] == blk only for this batch's blocks.
        lb = phys_to_logical[blk].clamp(0, ncols - 1)
        kv_pos = lb * n + off
        ok = (block_table[r, lb] == blk) & (off < n) & (kv_pos < seq_lens[r])
        if causal:
            qp = q_pos[q_idx]
            ok = ok & (kv_pos <= qp)
            if sliding_window is not None:
                ok = ok & (qp - kv_pos < sliding_window)
        return ok

    return mask_mod


def _make_decode_mask_mod(
    *,
    seq_lens: torch.Tensor,
    phys_to_logical: torch.Tensor,
    block_table: torch.Tensor,
    n: int,
    tpb: int,
    base_block: int,
    causal: bool,
    sliding_window: int | None,
) -> Any:
    """The exact mask of the decode call: batch row ``b`` is one decode request, whose block
    table row and length are ``block_table[b]`` / ``seq_lens[b]`` (gathered for the decode
    requests); its one query sits at position ``seq_lens[b] - 1``."""
    ncols = block_table.shape[1]

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        blk = base_block + kv_idx // tpb
        off = kv_idx % tpb
        lb = phys_to_logical[blk].clamp(0, ncols - 1)
        kv_pos = lb * n + off
        s = seq_lens[b]
        # kv_pos < s is also the causal bound of a query at s - 1.
        ok = (block_table[b, lb] == blk) & (off < n) & (kv_pos < s)
        if causal and sliding_window is not None:
            ok = ok & (s - 1 - kv_pos < sliding_window)
        return ok

    return mask_mod


@dataclass(frozen=True)
class _FlexDecode:
    """The decode call: one batch row per request with ``query_len == 1``."""

    tok: torch.Tensor  # [R] int64 query row of each decode request
    contiguous: bool  # tok == arange(R): queries and outputs are the first R rows, no gather
    pos: torch.Tensor  # [R] int32 logical position of each query (seq_len - 1)
    base_token: int  # first physical token of the (single) window the call reads
    length: int  # physical tokens in that window
    block_mask: Any  # torch BlockMask of batch R


@dataclass(frozen=True)
class _FlexWindow:
    base_token: int  # first physical token of the window
    length: int  # physical tokens in the window
    block_mask: Any  # torch BlockMask


@dataclass(frozen=True, kw_only=True)
class FlexAttentionMetadata(AttentionMetadata):
    """Per-batch Flex metadata: the common fields plus per-token lookups, one block mask per
    cache window the flattened call touches (none when every request takes the decode call) and
    the decode call (``None`` when the batch has no decode request or runs flattened)."""

    q_req: torch.Tensor  # [num_tokens] int32
    q_pos: torch.Tensor  # [num_tokens] int32
    phys_to_logical: torch.Tensor  # [num_kernel_blocks] int32, valid for this batch's blocks
    windows: tuple[_FlexWindow, ...]
    tpb: int
    options: FlexOptions
    decode: _FlexDecode | None = None


class FlexMetadataBuilder(MetadataBuilder):
    """Builds block masks; owns the persistent index buffers of one KV group.

    Options: ``q_block_size``, ``kv_block_size``, ``block_m``, ``block_n`` (see
    :class:`FlexOptions`) and ``max_view_elements`` (window cut, default ``2**31 - 1``; tests
    lower it to exercise the split path on small caches).
    """

    def __init__(
        self,
        config: AttentionConfig,
        layout: Any,
        *,
        device: torch.device,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        q_block_size: int | None = None,
        kv_block_size: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
        max_view_elements: int = _INT32_LIMIT,
    ) -> None:
        super().__init__(
            config,
            layout,
            device=device,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        )
        assert config.kernel_block_size is not None
        self.n = config.kernel_block_size
        self.options = FlexOptions.resolve(
            self.n,
            batch_invariant=config.batch_invariant,
            q_block_size=q_block_size,
            kv_block_size=kv_block_size,
            block_m=block_m,
            block_n=block_n,
        )
        if max_view_elements > _INT32_LIMIT:
            raise ValueError(
                f"max_view_elements={max_view_elements} exceeds 2**31 - 1: Flex templates use 32-bit offsets"
            )
        self.max_view_elements = max_view_elements
        num_kernel_blocks = layout.num_blocks * config.kernel_blocks_per_block
        max_q_blocks = -(-max_num_batched_tokens // self.options.q_block_size)
        # Persistent buffers, sized by the batch bound (query blocks), never by max_model_len.
        self.q_req = torch.zeros(max_num_batched_tokens, dtype=torch.int32, device=device)
        self.q_pos = torch.zeros(max_num_batched_tokens, dtype=torch.int32, device=device)
        self.phys_to_logical = torch.zeros(num_kernel_blocks, dtype=torch.int32, device=device)
        self.kv_num_blocks = torch.zeros(max_q_blocks, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(max_q_blocks, 64, dtype=torch.int32, device=device)
        # The decode call's rows: one per decode request.
        self.dec_num_blocks = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.dec_indices = torch.zeros(max_num_seqs, 64, dtype=torch.int32, device=device)
        self._geometry: _CacheGeometry | None = None

    def geometry_for(self, kv_cache_kernel_view: torch.Tensor) -> _CacheGeometry:
        return _geometry(kv_cache_kernel_view, self.options.kv_block_size, self.max_view_elements)

    def _layout_geometry(self) -> _CacheGeometry:
        # The geometry depends only on the layout; build it from a meta tensor of its strides.
        if self._geometry is None:
            lay = self.layout
            meta = torch.empty_strided(
                (lay.num_blocks, lay.num_kv_heads, lay.block_size, lay.content_size),
                lay.strides[1:],
                device="meta",
            )
            view, _ = kernel_block_view(meta, lay, self.n)
            self._geometry = self.geometry_for(view)
        return self._geometry

    def _build_decode(
        self, common: CommonAttentionMetadata, base: AttentionMetadata, geo: _CacheGeometry
    ) -> tuple[_FlexDecode | None, torch.Tensor | None]:
        """The decode call of a batch and the requests it serves (bool ``[num_reqs]``), or
        ``(None, None)`` when the batch has no decode request or they span several windows."""
        from torch.nn.attention.flex_attention import BlockMask

        opts, cfg = self.options, self.config
        qsl_h = common.host_query_start_loc().long()
        dec_h = torch.nonzero(qsl_h[1:] - qsl_h[:-1] == 1).flatten()  # host [R]
        r = dec_h.numel()
        if r == 0:
            return None, None
        if r > self.dec_num_blocks.shape[0]:
            raise ValueError(
                f"batch has {r} decode requests; this builder was made for "
                f"max_num_seqs={self.max_num_seqs}"
            )
        dev = base.seq_lens.device
        tok_h = qsl_h[:-1][dec_h]
        contiguous = bool(torch.equal(tok_h, torch.arange(r)))
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
            n=self.n,
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
        if max_cols > self.dec_indices.shape[1]:
            grown = 1 << (max_cols - 1).bit_length()
            self.dec_indices = torch.zeros(
                self.dec_indices.shape[0], grown, dtype=torch.int32, device=self.device
            )
        num = self.dec_num_blocks[:r]
        num.copy_(counts)
        idx = self.dec_indices[:r]
        idx.zero_()
        # Entries are sorted by (row, KV block): position in the row = index - row start.
        row_start = torch.cumsum(counts, 0) - counts
        col = torch.arange(e_row.numel(), device=dev) - row_start[e_row]
        idx[e_row, col] = (e_f - w_lo * kv_per_window).int()
        length = geo.window_len(w_lo)
        mask = BlockMask.from_kv_blocks(
            num[:, None, None],
            idx[:, None, None],
            BLOCK_SIZE=(opts.q_block_size, opts.kv_block_size),
            mask_mod=_make_decode_mask_mod(
                seq_lens=seq_lens,
                phys_to_logical=self.phys_to_logical,
                block_table=block_table,
                n=self.n,
                tpb=geo.tpb,
                base_block=w_lo * geo.window_tokens // geo.tpb,
                causal=cfg.causal,
                sliding_window=cfg.sliding_window,
            ),
            seq_lengths=(1, length),
            compute_q_blocks=False,
        )
        served = torch.zeros(base.num_reqs, dtype=torch.bool, device=dev)
        served[dec_req] = True
        decode = _FlexDecode(
            tok=tok_h.to(dev),
            contiguous=contiguous,
            pos=pos,
            base_token=w_lo * geo.window_tokens,
            length=length,
            block_mask=mask,
        )
        return decode, served

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        base = super().build(common)
        opts = self.options
        geo = self._layout_geometry()
        cfg = self.config
        num_tokens = common.num_actual_tokens
        decode, served = self._build_decode(common, base, geo) if num_tokens else (None, None)
        q_req, q_pos, e_qb, e_f = build_flex_block_indices(
            query_start_loc=base.query_start_loc,
            seq_lens=base.seq_lens,
            block_table=base.block_table,
            num_tokens=num_tokens,
            n=self.n,
            tpb=geo.tpb,
            q_block_size=opts.q_block_size,
            kv_block_size=opts.kv_block_size,
            causal=cfg.causal,
            sliding_window=cfg.sliding_window,
            exclude_reqs=served,
        )
        self.q_req[:num_tokens] = q_req
        self.q_pos[:num_tokens] = q_pos
        # physical -> logical for the blocks of this batch only (O(blocks in the batch)).
        bt = base.block_table.long()
        nblk = (base.seq_lens.long() + self.n - 1) // self.n  # [R]
        cols = torch.arange(bt.shape[1], device=bt.device)
        used = cols[None, :] < nblk[:, None]  # [R, M]
        phys = bt[used]
        logical = cols.expand_as(bt)[used]
        self.phys_to_logical[phys] = logical.int()
        conflict = (self.phys_to_logical[phys].long() != logical).any()
        # Cut the entries into windows; one host sync for every count this step needs.
        kv_per_window = geo.window_tokens // opts.kv_block_size
        e_w = e_f // kv_per_window
        nqb = -(-num_tokens // opts.q_block_size)
        windows_present = torch.unique(e_w) if e_w.numel() else e_w
        w_list = windows_present.tolist()
        per_qb_w = torch.zeros(max(len(w_list), 1), max(nqb, 1), dtype=torch.long, device=bt.device)
        w_rank = torch.searchsorted(windows_present, e_w) if e_w.numel() else e_w
        per_qb_w.index_put_((w_rank, e_qb), torch.ones_like(e_qb), accumulate=True)
        max_cols, has_conflict = int(per_qb_w.max()), bool(conflict)
        if has_conflict:
            raise ValueError(
                "a physical block appears at two different logical positions in this batch; the "
                "Flex backend's physical->logical table needs one position per block per step"
            )
        if max_cols > self.kv_indices.shape[1]:
            grown = 1 << (max_cols - 1).bit_length()
            self.kv_indices = torch.zeros(
                self.kv_indices.shape[0], grown, dtype=torch.int32, device=self.device
            )
        # Position of each entry within its (window, query block) row; entries are sorted by
        # (query block, global KV block), so within one (window, qb) they are contiguous.
        windows: list[_FlexWindow] = []
        from torch.nn.attention.flex_attention import BlockMask

        row_key = w_rank * max(nqb, 1) + e_qb
        for rank, w in enumerate(w_list):
            sel = w_rank == rank
            qbs, fs, rk = e_qb[sel], e_f[sel] - w * kv_per_window, row_key[sel]
            first = torch.ones_like(rk, dtype=torch.bool)
            first[1:] = rk[1:] != rk[:-1]
            group_start = torch.cummax(
                torch.where(first, torch.arange(rk.numel(), device=rk.device), 0), 0
            ).values
            pos = torch.arange(rk.numel(), device=rk.device) - group_start
            num = self.kv_num_blocks[:nqb]
            idx = self.kv_indices[:nqb]
            if rank > 0:
                # Each window needs its own buffers (the block masks live together in one step).
                num, idx = num.clone(), idx.clone()
            num.zero_()
            num.index_put_((qbs,), torch.ones_like(qbs, dtype=torch.int32), accumulate=True)
            idx.zero_()
            idx[qbs, pos] = fs.int()
            length = geo.window_len(w)
            mask = BlockMask.from_kv_blocks(
                num[None, None],
                idx[None, None],
                BLOCK_SIZE=(opts.q_block_size, opts.kv_block_size),
                mask_mod=_make_mask_mod(
                    q_req=self.q_req[:num_tokens],
                    q_pos=self.q_pos[:num_tokens],
                    phys_to_logical=self.phys_to_logical,
                    block_table=base.block_table,
                    seq_lens=base.seq_lens,
                    n=self.n,
                    tpb=geo.tpb,
                    base_block=w * geo.window_tokens // geo.tpb,
                    causal=cfg.causal,
                    sliding_window=cfg.sliding_window,
                ),
                seq_lengths=(num_tokens, length),
                compute_q_blocks=False,
            )
            windows.append(_FlexWindow(w * geo.window_tokens, length, mask))
        return FlexAttentionMetadata(
            query_start_loc=base.query_start_loc,
            seq_lens=base.seq_lens,
            block_table=base.block_table,
            slot_mapping=base.slot_mapping,
            max_query_len=base.max_query_len,
            max_seq_len=base.max_seq_len,
            num_actual_tokens=num_tokens,
            num_reqs=base.num_reqs,
            query_start_loc_cpu=base.query_start_loc_cpu,
            seq_lens_cpu=base.seq_lens_cpu,
            q_req=self.q_req[:num_tokens],
            q_pos=self.q_pos[:num_tokens],
            phys_to_logical=self.phys_to_logical,
            windows=tuple(windows),
            tpb=geo.tpb,
            options=opts,
            decode=decode,
        )


@functools.cache
def _compiled_flex(static: bool = False) -> Any:
    """``static=True``: one graph per shape (``dynamic=False``). Used on the CPU, where
    inductor's C++ Flex template fails to compile dynamic-shape graphs with a sliding-window mask
    (torch 2.15: undeclared ``cur_kvSplitSize``), which every second batch shape would hit."""
    from torch.nn.attention.flex_attention import flex_attention

    # One compiled callable per process (a memo, not configuration); torch marks shapes dynamic
    # after the first recompile, so batches of different sizes share a graph.
    #
    # Dynamo keeps at most `recompile_limit` (8) graphs per code object, and every FlexAttention
    # user in the process shares flex_attention's: each distinct (q/kv dtype, head sizes, score_mod
    # features) of the model's layers is one graph, and a hybrid model with sinks, windows and
    # DiffKV groups, plus fp16 and bf16 runs in one process, passes 8. With fullgraph=True the
    # ninth is a hard failure, so raise the limits (never lower them) to what a process needs.
    dynamo_config = torch._dynamo.config
    for name, floor in (
        ("recompile_limit", FLEX_RECOMPILE_LIMIT),
        ("accumulated_recompile_limit", 8 * FLEX_RECOMPILE_LIMIT),
    ):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < floor:
            setattr(dynamo_config, name, floor)
    return torch.compile(flex_attention, fullgraph=True, dynamic=False if static else None)


#: Graphs of compiled FlexAttention one process may hold (see :func:`_compiled_flex`).
FLEX_RECOMPILE_LIMIT = 64


class FlexAttentionImpl(AttentionImpl):
    """Per-layer FlexAttention. Option ``compiled``: run ``torch.compile``'d Flex (default: on
    CUDA yes, on CPU no; the eager path is dense math, fine for tests only)."""

    def __init__(
        self,
        config: AttentionConfig,
        layout: Any,
        *,
        compiled: bool | None = None,
        kernel_options: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, layout, **kw)
        self.compiled = compiled
        self.kernel_options = dict(kernel_options) if kernel_options else None

    def _kernel_options(
        self, md: FlexAttentionMetadata, device: torch.device, *, decode: bool = False
    ) -> dict[str, Any] | None:
        if self.kernel_options is not None:
            return self.kernel_options
        if device.type != "cuda":
            return None
        opts: dict[str, Any] = {"BLOCK_M": md.options.block_m, "BLOCK_N": md.options.block_n}
        if md.options.kv_block_size < 128 or (decode and self.config.batch_invariant):
            # The decode template wants KV tiles of >= 128 tokens; force the main template so
            # 16-token pages work. Its split count also follows the batch size, which batch
            # invariance forbids for the decode call.
            opts["FORCE_USE_FLEX_ATTENTION"] = True
        return opts

    def _flex(
        self,
        fn: Any,
        qx: torch.Tensor,
        cache: torch.Tensor,
        *,
        base_token: int,
        length: int,
        block_mask: Any,
        score_mod: Any,
        need_lse: bool,
        kernel_options: dict[str, Any] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One Flex call over the window of ``length`` physical tokens from ``base_token``; K/V
        are ``[1, H, length, D]`` views (batch 1, broadcast over the query batch)."""
        h = cache.shape[1]
        _, sh, sn, _ = cache.stride()
        k0, k1 = self.layout.k_range
        assert self.layout.v_range is not None
        v0, v1 = self.layout.v_range
        base_off = cache.storage_offset() + base_token * sn
        k = cache.as_strided((1, h, length, k1 - k0), (0, sh, sn, 1), base_off + k0)
        v = cache.as_strided((1, h, length, v1 - v0), (0, sh, sn, 1), base_off + v0)
        with warnings.catch_warnings():
            # return_lse is deprecated in newer torch in favour of return_aux (absent in 2.11).
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            # Eager Flex (compiled=False) is dense math by design here: tests and CPU runs.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            res = fn(
                qx,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=self.scale,
                enable_gqa=self.num_q_heads != h,
                return_lse=need_lse,
                kernel_options=kernel_options,
            )
        return res if need_lse else (res, None)

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlexAttentionMetadata,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        self.check_forward_inputs(q, kv_cache, metadata)
        result = self.empty_output(q, out)
        num_tokens = metadata.num_actual_tokens
        if num_tokens == 0:
            return result
        cache, _ = self.kernel_cache(kv_cache)  # [B*k, H, n, C]
        k_scale, v_scale = self.scales(layer)
        if k_scale is not None or v_scale is not None:
            raise ValueError("FLEX_ATTENTION reads unquantized caches only; got k_scale/v_scale")
        sn = cache.stride(2)
        tpb = metadata.tpb
        if cache.stride(0) != tpb * sn:
            raise ValueError(
                f"kv_cache block stride {cache.stride(0)} does not match the layout the metadata "
                f"was built for ({tpb} tokens x {sn}); pass the layer view of the planned layout"
            )
        use_compiled = self.compiled if self.compiled is not None else q.device.type == "cuda"
        if not use_compiled:
            fn = flex_attention
        else:
            fn = _compiled_flex() if q.device.type == "cuda" else _compiled_flex(static=True)
        # The log-sum-exp is needed only to apply sinks or merge windows; torch's compiled CPU
        # template cannot return it, so ask for it only then.
        need_lse = self.sinks is not None or len(metadata.windows) > 1
        if need_lse and use_compiled and q.device.type == "cpu":
            raise ValueError(
                "compiled FlexAttention on the CPU cannot return the log-sum-exp, which "
                f"{'sinks need' if self.sinks is not None else 'a batch spanning several cache windows needs'}; "
                "use compiled=False on the CPU"
            )
        if metadata.windows:
            self._forward_flat(fn, q, cache, metadata, result, need_lse)
        if metadata.decode is not None:
            # After the flattened call: it leaves the decode requests' rows empty (or NaN).
            self._forward_decode(fn, q, cache, metadata, metadata.decode, result)
        return result

    def _forward_flat(
        self,
        fn: Any,
        q: torch.Tensor,
        cache: torch.Tensor,
        md: FlexAttentionMetadata,
        result: torch.Tensor,
        need_lse: bool,
    ) -> None:
        num_tokens = md.num_actual_tokens
        qx = q[:num_tokens].transpose(0, 1)[None]  # [1, Hq, T, D]
        kernel_options = self._kernel_options(md, q.device)
        outs: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        for win in md.windows:
            o, lse = self._flex(
                fn,
                qx,
                cache,
                base_token=win.base_token,
                length=win.length,
                block_mask=win.block_mask,
                score_mod=self._score_mod(md, win.base_token // md.tpb),
                need_lse=need_lse,
                kernel_options=kernel_options,
            )
            outs.append(o[0])  # [Hq, T, Dv]
            if lse is not None:
                lses.append(lse[0].float())  # [Hq, T]
        if not need_lse:
            # The common case: one window, no sinks; one copy into [T, Hq, Dv], no upcast.
            result[:num_tokens] = outs[0].transpose(0, 1)
            return
        if len(outs) == 1:
            o = outs[0].float()
            lse = lses[0]
        else:
            lse_all = torch.stack(lses)  # [W, Hq, T]
            lse = torch.logsumexp(lse_all, dim=0)
            weights = torch.exp(lse_all - lse[None]).nan_to_num(0.0)  # [W, Hq, T]
            o = (torch.stack(outs).float() * weights[..., None]).sum(0)
        if self.sinks is not None:
            o = o * torch.sigmoid(lse - self.sinks.float().to(o.device)[:, None])[..., None]
        result[:num_tokens] = o.transpose(0, 1).to(result.dtype)

    def _forward_decode(
        self,
        fn: Any,
        q: torch.Tensor,
        cache: torch.Tensor,
        md: FlexAttentionMetadata,
        dec: _FlexDecode,
        result: torch.Tensor,
    ) -> None:
        r = dec.tok.numel()
        # [R, Hq, 1, D]: a view of the first R rows when the decodes lead the batch.
        qd = (q[:r] if dec.contiguous else q[dec.tok]).unsqueeze(2)
        need_lse = self.sinks is not None
        o, lse = self._flex(
            fn,
            qd,
            cache,
            base_token=dec.base_token,
            length=dec.length,
            block_mask=dec.block_mask,
            score_mod=self._score_mod(md, dec.base_token // md.tpb, dec_pos=dec.pos),
            need_lse=need_lse,
            kernel_options=self._kernel_options(md, q.device, decode=True),
        )
        o = o[:, :, 0]  # [R, Hq, Dv]
        if lse is not None:
            assert self.sinks is not None
            gate = torch.sigmoid(lse[:, :, 0].float() - self.sinks.float().to(o.device)[None])
            o = (o.float() * gate[..., None]).to(result.dtype)
        if dec.contiguous:
            result[:r] = o
        else:
            result[dec.tok] = o.to(result.dtype)

    def _score_mod(
        self, md: FlexAttentionMetadata, base_block: int, *, dec_pos: torch.Tensor | None = None
    ) -> Any:
        """Softcap and ALiBi; a query's position is ``q_pos[q_idx]`` in the flattened call and
        ``dec_pos[b]`` (one query per batch row) in the decode call."""
        softcap, slopes = self.softcap, self.alibi_slopes
        if not softcap and slopes is None:
            return None
        q_pos, ptl = md.q_pos, md.phys_to_logical
        n, tpb, ncols = self.kernel_block_size, md.tpb, md.block_table.shape[1]
        assert n is not None
        slopes_f = None if slopes is None else slopes.float().to(q_pos.device)
        # A 0-d tensor, not a Python float: once Dynamo sees several Flex graphs (the decode and
        # the flattened call), it makes captured floats symbolic, which Flex's score_mod
        # buffers reject ("can only be of Tensor, int, SymInt ... but got SymFloat").
        cap = torch.full((), softcap, dtype=torch.float32, device=q_pos.device) if softcap else None

        def score_mod(
            score: torch.Tensor,
            b: torch.Tensor,
            h: torch.Tensor,
            q_idx: torch.Tensor,
            kv_idx: torch.Tensor,
        ) -> torch.Tensor:
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if slopes_f is not None:
                blk = base_block + kv_idx // tpb
                kv_pos = ptl[blk].clamp(0, ncols - 1) * n + kv_idx % tpb
                qp = q_pos[q_idx] if dec_pos is None else dec_pos[b]
                score = score + slopes_f[h] * (kv_pos - qp).to(score.dtype)
            return score

        return score_mod


class FlexAttentionBackend(AttentionBackend):
    NAME: ClassVar[str] = "FLEX_ATTENTION"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("float32", "float16", "bfloat16"),
        kv_quant_modes=("none",),
        head_size_rule=(16, 256, 8),
        supports_head_size_v_diff=True,
        kernel_block_sizes=(16, 32, 64, 128, 256, 512, 1024),
        supported_layouts=("LBNHC", "BLNHC"),
        sinks=True,
        sliding_window=True,
        softcap=True,
        alibi=True,
        mla=False,
        non_causal=True,
        batch_invariant=True,
        cudagraph_support="never",
        needs_gpu=False,
        notes="torch FlexAttention with a per-batch block mask; token-major (NHD) orders only; caches over 2^31 elements are cut into re-based windows.",
    )
    builder_cls = FlexMetadataBuilder
    impl_cls = FlexAttentionImpl
