"""FLEX_ATTENTION's *span* mask mods: each query row's visible keys as one interval of key
numbers, precomputed per row by the builder, so a partial tile's mask is two compares.

Why. On a partial tile (the causal diagonal) Flex evaluates the mask mod for every (query, key)
pair, inside the kernel's inner loop. Dense causal Flex's is ``kv_idx <= q_idx``; the owner mask
(:func:`~kv_backends.backends.flex.mask_mods.make_owner_mask_mod`) loads the row's request and
position and the column's owning request and logical block, then multiplies, compares and
combines five terms. The partial tiles are few (128 of 2112 tiles at 4 x 4096, pages of 128)
but the inner loop of each is that much longer.

How. A row's visible keys are one interval of its own request's logical positions: ``[a, b]``
with ``a = max(0, q_pos - w + 1)`` under a sliding window ``w`` (else 0) and ``b = q_pos``
(causal) or ``min(seq_len - 1, q_pos + w - 1)`` (non-causal, the window on both sides). Number
every key of the call so that one request's keys are consecutive in logical order, and the
interval becomes ``[row_lo, row_hi]`` of key numbers, written per row by the builder:

- the gathered buffer (:mod:`~kv_backends.backends.flex.gather`): request ``r``'s pages are
  consecutive in logical order, so the key number is the buffer index ``kv_idx`` itself, offset
  by ``(page0[r] - first_tile[r]) * kv_block_size``. Mask: ``row_lo[q] <= kv_idx <= row_hi[q]``
  (two loads per row, none per column, no division: dense causal's mask plus two loads).
- the paged cache: pages are shuffled, so each block carries its key base
  ``block_key[block] = r * S + logical_block * n`` (``S``: a stride above every logical
  position), the key number is ``block_key[block] + offset`` and the row's interval is offset by
  ``r * S``. One load per column (the owner mask makes two) and the same two compares.

Exact where the owner mask is (every block the call reads has one request of the call, blocks
outside it hold a key below every interval; the builder checks each step) and where the key
numbers fit int32 (``num_reqs * S + tpb < 2**31``, else the builder keeps the owner mask). Rows of
requests another call serves (decodes) and padding rows get the empty interval ``[0, -1]``:
their outputs are dropped either way. Not under batch invariance (its mask mod stays the one its
bitwise equality with the trainer was pinned with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SPAN_KEY_LIMIT",
    "SPAN_NO_KEY",
    "SpanInputs",
    "make_keyed_span_mask_mod",
    "make_span_mask_mod",
    "span_stride",
    "write_row_spans",
]

#: Key numbers are int32: ``num_reqs * S + tpb`` must stay at or below this.
SPAN_KEY_LIMIT = 2**31 - 1
#: ``block_key`` of a block outside the call: plus any in-block offset, below every interval.
SPAN_NO_KEY = -(2**30)


@dataclass(frozen=True)
class SpanInputs:
    """What a span mask mod reads: per query row its interval of key numbers, and on the paged
    cache each block's key base (``None`` on the gathered buffer, whose index is the key)."""

    row_lo: torch.Tensor  # [padded] int32
    row_hi: torch.Tensor  # [padded] int32
    block_key: torch.Tensor | None = None  # [blocks] int32


def span_stride(ncols: int, n: int, max_seq_len: int, num_reqs: int, tpb: int) -> int | None:
    """The per-request key stride ``S`` of the paged cache (above every logical position a key
    or a query can have: ``ncols * n`` and ``max_seq_len``), or ``None`` when the mask's
    arithmetic could leave int32 (a key base ``< num_reqs * S`` plus an in-block offset
    ``< tpb``; the builder then keeps the owner mask)."""
    s = max(ncols * n, max_seq_len, 1)
    return s if num_reqs * s + tpb <= SPAN_KEY_LIMIT else None


def write_row_spans(
    row_lo: torch.Tensor,  # [>= padded] int32, persistent
    row_hi: torch.Tensor,  # [>= padded] int32, persistent
    q_req: torch.Tensor,  # [T] request of each query row
    q_pos: torch.Tensor,  # [T] logical position of each query row
    seq_lens: torch.Tensor,  # [R]
    offset: torch.Tensor,  # [R] int64 key number of each request's logical position 0
    active: torch.Tensor | None,  # [R] bool, requests this call serves (None: all)
    padded: int,
    *,
    causal: bool,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write each query row's interval of visible key numbers (see the module docstring) into
    ``row_lo[:padded]`` / ``row_hi[:padded]`` and return those slices. Rows of inactive
    requests and padding rows get ``[0, -1]`` (empty)."""
    t = q_req.numel()
    r, qp = q_req.long(), q_pos.long()
    lo = torch.zeros_like(qp)
    hi = qp if causal else seq_lens.long()[r] - 1
    if sliding_window is not None:
        lo = (qp - sliding_window + 1).clamp(min=0)
        if not causal:
            hi = torch.minimum(hi, qp + sliding_window - 1)
    base = offset[r]
    lo, hi = base + lo, base + hi
    if active is not None:
        on = active[r]
        lo, hi = torch.where(on, lo, 0), torch.where(on, hi, -1)
    row_lo[:t] = lo
    row_hi[:t] = hi
    row_lo[t:padded] = 0
    row_hi[t:padded] = -1
    return row_lo[:padded], row_hi[:padded]


def make_span_mask_mod(*, row_lo: torch.Tensor, row_hi: torch.Tensor) -> Any:
    """The gathered buffer's mask: key ``kv_idx`` is visible to row ``q_idx`` iff it lies in
    the row's interval (the buffer index is the key number)."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx >= row_lo[q_idx]) & (kv_idx <= row_hi[q_idx])

    return mask_mod


def make_keyed_span_mask_mod(
    *,
    row_lo: torch.Tensor,
    row_hi: torch.Tensor,
    block_key: torch.Tensor,
    n: int,
    tpb: int,
    base_block: int,
) -> Any:
    """The paged cache's mask of one window (``kv_idx`` counts from block ``base_block``, ``tpb``
    physical tokens a block): the key number is the block's key base plus the in-block offset;
    in-block tokens ``>= n`` belong to other layers or padding and are never visible."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        off = kv_idx % tpb
        key = block_key[base_block + kv_idx // tpb] + off
        ok = (key >= row_lo[q_idx]) & (key <= row_hi[q_idx])
        if tpb != n:
            ok = ok & (off < n)
        return ok

    return mask_mod
