"""FLEX_ATTENTION's block-mask building: tile options, the cache geometry (physical tokens and
the 32-bit windows), the block-mask entries of a batch and the exact per-token-pair mask mods.

Pure tensor arithmetic on the batch's metadata; nothing here calls FlexAttention. See
:mod:`kv_backends.backends.flex_attention` for how the cache is seen as one strided sequence of
physical tokens, and docs/attention_semantics.md for the masking rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "INT32_LIMIT",
    "CacheGeometry",
    "FlexOptions",
    "build_flex_block_indices",
    "cache_geometry",
    "make_decode_mask_mod",
    "make_mask_mod",
]

#: Torch's Flex templates compute element offsets in 32 bits.
INT32_LIMIT = 2**31 - 1


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
class CacheGeometry:
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


def cache_geometry(
    kv_cache: torch.Tensor, kv_block_size: int, max_view_elements: int
) -> CacheGeometry:
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
    return CacheGeometry(n, tpb, b, sn, window, total)


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
    (everything up to ``seq_len`` when not causal, within the window on both sides when there is
    one). ``exclude_reqs`` (bool ``[num_reqs]``) drops
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
    key = torch.unique(e_qb * nf + e_f)  # sorted, deduplicated
    return q_req.int(), q_pos.int(), key // nf, key % nf


def make_mask_mod(
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
        qp = q_pos[q_idx]
        if causal:
            ok = ok & (kv_pos <= qp)
        if sliding_window is not None:
            # Both sides: under causal the upper bound is already implied.
            ok = ok & ((qp - kv_pos).abs() < sliding_window)
        return ok

    return mask_mod


def make_decode_mask_mod(
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
        # kv_pos < s is also the causal bound of a query at s - 1, and (kv_pos <= s - 1) makes a
        # window one-sided whether or not the layer is causal.
        ok = (block_table[b, lb] == blk) & (off < n) & (kv_pos < s)
        if sliding_window is not None:
            ok = ok & (s - 1 - kv_pos < sliding_window)
        return ok

    return mask_mod
