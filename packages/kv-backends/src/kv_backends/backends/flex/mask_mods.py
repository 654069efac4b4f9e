"""FLEX_ATTENTION's exact per-token-pair mask mods (the table mask, the owner mask, the decode
call's) and its score mod (softcap, ALiBi), shared with the trainer's dense call. A mask mod
reads a window's key index as a physical token and maps it to the owning request's logical
position (:func:`window_kv_position`); docs/attention_semantics.md has the rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "make_decode_mask_mod",
    "make_mask_mod",
    "make_owner_mask_mod",
    "make_score_mod",
    "window_kv_position",
]


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
