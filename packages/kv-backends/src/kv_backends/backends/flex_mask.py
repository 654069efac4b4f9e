"""FLEX_ATTENTION's block-mask building: tile options, the cache geometry (physical tokens and
the 32-bit windows), the block-mask entries of a batch and the exact per-token-pair mask mods.

Pure tensor arithmetic on the batch's metadata; nothing here calls FlexAttention. See
:mod:`kv_backends.backends.flex_attention` for how the cache is seen as one strided sequence of
physical tokens, and docs/attention_semantics.md for the masking rules.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "INT32_LIMIT",
    "CacheGeometry",
    "FlexEntries",
    "FlexOptions",
    "build_flex_block_entries",
    "build_flex_block_indices",
    "cache_geometry",
    "flex_has_backend_option",
    "make_decode_mask_mod",
    "make_mask_mod",
    "make_owner_mask_mod",
    "make_score_mod",
    "valid_kv_block_sizes",
    "window_kv_position",
]

#: Torch's Flex templates compute element offsets in 32 bits.
INT32_LIMIT = 2**31 - 1


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _pow2_divisors(x: int, lo: int = 16) -> list[int]:
    """Powers of 2 >= ``lo`` dividing ``x`` (the valid tiles inside ``x``)."""
    return [1 << i for i in range(lo.bit_length() - 1, x.bit_length()) if x % (1 << i) == 0]


def _pow2_near(v: int) -> list[int]:
    """The powers of 2 >= 16 next to ``v`` (below and above), for error messages."""
    below = 1 << max(4, v.bit_length() - 1) if v > 0 else 16
    return sorted({below, max(16, below * 2 if below < v else below)})


def valid_kv_block_sizes(n: int, *, batch_invariant: bool, limit: int = 1024) -> list[int]:
    """The ``kv_block_size`` values :meth:`FlexOptions.resolve` accepts for kernel block ``n``
    (up to ``limit``): powers of 2 >= 16 dividing ``n``, plus, without batch invariance, the
    multiples of ``n`` (when ``n`` is a power of 2)."""
    out = _pow2_divisors(n)
    if not batch_invariant and _is_pow2(n):
        out += [v for v in (1 << i for i in range(4, limit.bit_length())) if v > n]
    return out


@dataclass(frozen=True)
class FlexOptions:
    """Tile sizes of the Flex backend, validated against the kernel block size ``n``.

    - ``q_block_size``: query tokens per block-mask row (power of 2, >= 16; default 128).
    - ``kv_block_size``: physical KV tokens per block-mask column (power of 2, >= 16, dividing
      ``n`` or a multiple of it; ``<= n`` under batch invariance so a tile never mixes requests).
    - ``block_m`` / ``block_n``: the kernel's tiles (``kernel_options`` ``BLOCK_M`` /
      ``BLOCK_N``), powers of 2 >= 16 dividing ``q_block_size`` / ``kv_block_size``.

    One value is the per-layer Flex configuration: the builder lays the block mask out with it,
    the impl passes its kernel options, and :func:`~kv_backends.backends.flex_trainer.flex_trainer_attention`
    (the trainer's dense call) takes the same value, which is what makes their numerics equal.
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
        """Defaults filled in, every value validated; errors name the value, the bound and the
        values that would be valid."""
        if kv_block_size is None:
            # Largest power of 2 dividing n, capped at 128; without batch invariance at least 64
            # (big tiles are what makes Flex fast), which is then a multiple of a small n.
            pow2 = n & -n
            kv_block_size = min(pow2, 128)
            if not batch_invariant and kv_block_size < 64 and _is_pow2(n):
                kv_block_size = 64
        # 128-query blocks (16-row blocks ran prefill at ~5% of dense) with BLOCK_M = 64,
        # BLOCK_N = 64: on an H100 (torch 2.11, bf16 head 128) 64-row tiles over 4 warps ran the
        # paged prefill 6-10% faster than torch's own 128 x 64 over 8 warps, within 2-3% of
        # dense causal Flex (the impl pins the warps, FlexAttentionImpl._kernel_options).
        # Decodes never see this size (they have their own call).
        q_block_size = 128 if q_block_size is None else q_block_size
        block_m = min(q_block_size, 64) if block_m is None else block_m
        block_n = min(kv_block_size, 64) if block_n is None else block_n
        for name, v in (
            ("q_block_size", q_block_size),
            ("kv_block_size", kv_block_size),
            ("block_m", block_m),
            ("block_n", block_n),
        ):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"flex {name}={v!r} must be an int (a power of 2 >= 16)")
            if not _is_pow2(v) or v < 16:
                raise ValueError(
                    f"flex {name}={v} must be a power of 2 >= 16; nearest valid: {_pow2_near(v)}"
                )
        valid_kv = valid_kv_block_sizes(n, batch_invariant=batch_invariant)
        if n % kv_block_size and kv_block_size % n:
            raise ValueError(
                f"flex kv_block_size={kv_block_size} must divide the kernel block size {n} or be a "
                f"multiple of it; valid: {valid_kv or 'none (the kernel block size has no power-of-2 divisor >= 16)'}"
            )
        if batch_invariant and kv_block_size > n:
            raise ValueError(
                f"flex kv_block_size={kv_block_size} must be <= the kernel block size {n} under "
                f"batch invariance (a KV tile must not mix blocks of different requests); valid: {valid_kv}"
            )
        if q_block_size % block_m:
            raise ValueError(
                f"flex block_m={block_m} must divide q_block_size={q_block_size}; "
                f"valid: {_pow2_divisors(q_block_size)}"
            )
        if kv_block_size % block_n:
            raise ValueError(
                f"flex block_n={block_n} must divide kv_block_size={kv_block_size}; "
                f"valid: {_pow2_divisors(kv_block_size)}"
            )
        return cls(q_block_size, kv_block_size, block_m, block_n)

    def kernel_options(
        self, *, main_template: bool, batch_invariant: bool = False, block_n: int | None = None
    ) -> dict[str, Any]:
        """``kernel_options`` for a CUDA Flex call with these tiles.

        ``main_template=True`` pins Flex's main kernel with ``BLOCK_M`` / ``BLOCK_N``: the
        batch-invariant calls and the trainer's dense call use exactly this dict, because the
        decoding kernel's split count follows the batch size. ``False`` (a decode call outside
        batch invariance) asks for the split-KV decoding kernel by name where this torch has the
        ``BACKEND`` option (it raises rather than silently falling back when the call cannot use
        it), pinning only ``BLOCK_N``; its ``BLOCK_M`` covers the packed GQA rows and torch
        sizes it.

        ``batch_invariant=True`` also pins ``IS_DIVISIBLE=False``: torch otherwise picks it per
        call from the sequence lengths (padded paged call vs the trainer's exact lengths), and
        the two kernel variants differ in more than their boundary loads (masking between ops
        can change which multiply-adds the compiler fuses). Pinned, both calls run one variant.

        ``block_n`` overrides ``BLOCK_N`` (the decode call's tiles may be one page, narrower than
        ``kv_block_size``; under batch invariance they are not, and it equals ``self.block_n``)."""
        block_n = self.block_n if block_n is None else block_n
        if main_template:
            # The legacy switch, not BACKEND="TRITON": older torch (2.11) has no BACKEND option.
            opts: dict[str, Any] = {
                "BLOCK_M": self.block_m,
                "BLOCK_N": block_n,
                "FORCE_USE_FLEX_ATTENTION": True,
            }
            if batch_invariant:
                opts["IS_DIVISIBLE"] = False
            return opts
        dec: dict[str, Any] = {"BLOCK_N": block_n}
        if flex_has_backend_option():
            dec["BACKEND"] = "TRITON_DECODE"
        return dec


@functools.cache
def flex_has_backend_option() -> bool:
    """Whether this torch's Flex takes ``kernel_options["BACKEND"]`` (torch >= 2.12 or so)."""
    from torch.nn.attention import flex_attention as fa

    return hasattr(fa, "_Backend")


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


def window_kv_position(
    kv_idx: torch.Tensor,
    base_block: int,
    tpb: int,
    n: int,
    phys_to_logical: torch.Tensor,
    ncols: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A window's key index (counted from ``base_block``, ``tpb`` physical tokens a block) as
    ``(physical block, offset in it, logical block, logical position)``; the logical block is
    clamped into ``[0, ncols)`` (stale table entries: the callers' ownership test drops them)."""
    blk = base_block + kv_idx // tpb
    off = kv_idx % tpb
    lb = phys_to_logical[blk].clamp(0, ncols - 1)
    return blk, off, lb, lb * n + off


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
        # Stale entries (blocks of earlier batches) are in range after the clamp and then fail
        # the ownership test below: block_table[r, lb] == blk only for this batch's blocks.
        blk, off, lb, kv_pos = window_kv_position(
            kv_idx, base_block, tpb, n, phys_to_logical, ncols
        )
        ok = (block_table[r, lb] == blk) & (off < n) & (kv_pos < seq_lens[r])
        qp = q_pos[q_idx]
        if causal:
            ok = ok & (kv_pos <= qp)
        if sliding_window is not None:
            # Both sides: under causal the upper bound is already implied.
            ok = ok & ((qp - kv_pos).abs() < sliding_window)
        return ok

    return mask_mod


def make_owner_mask_mod(
    *,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    phys_to_logical: torch.Tensor,
    block_req: torch.Tensor,
    seq_lens: torch.Tensor,
    n: int,
    tpb: int,
    base_block: int,
    causal: bool,
    sliding_window: int | None,
) -> Any:
    """The exact mask of one window where every block the call's tiles hold has one user in
    the batch: ``block_req[block]`` is that request. Same visibility as :func:`make_mask_mod`
    with one load per query row and per key column and none per (query, key) pair.

    Why. :func:`make_mask_mod`'s ownership test ``block_table[q_req[q], lb] == block`` is a
    gather indexed by both the row's request and the column's block, so on a partial tile it
    loads ``BLOCK_M x BLOCK_N`` table entries (after two dependent loads for the indices); dense
    causal Flex's mask loads nothing. Here the request of a column is one load per column and
    the test is a compare, so a partial tile costs little more than dense's.

    Valid only where it is exact (the builder checks, else it uses :func:`make_mask_mod`): no
    block read by two requests of the batch (a shared prefix block has several users), and
    ``block_req`` -1 for every block outside the batch, so the mask is exact on every pair of
    the window, in a listed tile or not (eager Flex evaluates them all). Causal: ``kv_pos <=
    q_pos < seq_len`` makes the length test redundant (padding rows sit below every key)."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        blk = base_block + kv_idx // tpb
        off = kv_idx % tpb
        r = q_req[q_idx]
        ok = block_req[blk] == r
        if tpb != n:
            ok = ok & (off < n)  # in-block tokens >= n belong to other layers or padding
        kv_pos = phys_to_logical[blk] * n + off
        qp = q_pos[q_idx]
        if causal:
            ok = ok & (kv_pos <= qp)
        else:
            ok = ok & (kv_pos < seq_lens[r])
        if sliding_window is not None:
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
        blk, off, lb, kv_pos = window_kv_position(
            kv_idx, base_block, tpb, n, phys_to_logical, ncols
        )
        s = seq_lens[b]
        # kv_pos < s is also the causal bound of a query at s - 1, and (kv_pos <= s - 1) makes a
        # window one-sided whether or not the layer is causal.
        ok = (block_table[b, lb] == blk) & (off < n) & (kv_pos < s)
        if sliding_window is not None:
            ok = ok & (s - 1 - kv_pos < sliding_window)
        return ok

    return mask_mod


def make_score_mod(
    softcap: float,
    slopes: torch.Tensor | None,
    device: torch.device,
    distance: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """Softcap then ALiBi, the one score mod of the backend and of the trainer's reference
    (same ops, same order): ``cap * tanh(score / cap)``, then ``+ slopes[h] * distance(b,
    q_idx, kv_idx)`` (the key's position minus the query's). ``slopes``: float32 on
    ``device``. ``None`` when there is neither."""
    if not softcap and slopes is None:
        return None
    # A 0-d tensor, not a Python float: once Dynamo sees several Flex graphs (the decode and
    # the flattened call), it makes captured floats symbolic, which Flex's score_mod
    # buffers reject ("can only be of Tensor, int, SymInt ... but got SymFloat").
    cap = torch.full((), softcap, dtype=torch.float32, device=device) if softcap else None

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
    ) -> torch.Tensor:
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score + slopes[h] * distance(b, q_idx, kv_idx).to(score.dtype)
        return score

    return score_mod
