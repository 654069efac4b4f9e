"""Triton slot mapping and block-table expansion.

The slot mapping never materializes the expanded table: with ``k = block_size // kernel_block_size``
and manager block ``b = table[r, pos // block_size]``, the kernel block is
``b * k + (pos // kernel_block_size) % k``, so::

    slot = (b * k + (pos // kbs) % k) * kbs + pos % kbs = b * block_size + pos % block_size

(``pos % block_size = ((pos // kbs) % k) * kbs + pos % kbs``): one table load per token. One
program per request walks its tokens ``BLOCK`` at a time (so a long prefill and a decode token cost
one launch together, sized by shapes alone: nothing is read back to the host, CUDA-graph safe), and
one extra program writes ``-1`` from ``query_start_loc[-1]`` to ``num_slots``. Slots are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["compute_slot_mapping_triton", "expand_block_table_triton"]

_BLOCK = 256


# num_reqs and num_slots change every step: specialized (== 1, % 16), each new class compiled in
# the middle of serving (an H200 mixed step took 93-133 ms instead of ~32 when one did).
@triton.jit(do_not_specialize=["num_reqs", "num_slots"])
def _slot_mapping_kernel(
    table_ptr,  # [R, M] manager block ids
    pos_ptr,  # [T]
    qsl_ptr,  # [R + 1]
    out_ptr,  # [num_slots] int64
    table_stride,
    num_reqs,
    max_cols,  # M
    num_slots,
    BLOCK_SIZE: tl.constexpr,  # manager block size
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    if r < num_reqs:
        start = tl.load(qsl_ptr + r).to(tl.int64)
        end = tl.load(qsl_ptr + r + 1).to(tl.int64)
        row = table_ptr + r.to(tl.int64) * table_stride
        for s in range(start, end, BLOCK):
            t = s + lane
            m = t < end
            pos = tl.load(pos_ptr + t, mask=m, other=0).to(tl.int64)
            col = pos // BLOCK_SIZE
            ok = m & (pos >= 0) & (col < max_cols)
            blk = tl.load(row + col, mask=ok, other=-1).to(tl.int64)
            slot = tl.where(ok & (blk >= 0), blk * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
            tl.store(out_ptr + t, slot, mask=m)
    else:
        # padding tail: [query_start_loc[-1], num_slots)
        start = tl.load(qsl_ptr + num_reqs).to(tl.int64)
        for s in range(start, num_slots, BLOCK):
            t = s + lane
            tl.store(out_ptr + t, tl.full([BLOCK], -1, tl.int64), mask=t < num_slots)


@triton.jit
def _expand_block_table_kernel(
    table_ptr,  # [R, M]
    out_ptr,  # [R, M * K]
    table_stride,
    out_stride,
    out_cols,  # M * K
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < out_cols
    b = tl.load(table_ptr + r * table_stride + c // K, mask=m, other=-1).to(tl.int64)
    v = tl.where(b >= 0, b * K + c % K, -1)
    tl.store(out_ptr + r * out_stride + c, v.to(out_ptr.dtype.element_ty), mask=m)


def compute_slot_mapping_triton(
    block_table: torch.Tensor,  # [R, M]
    positions: torch.Tensor,  # [T]
    query_start_loc: torch.Tensor,  # [R + 1]
    block_size: int,
    kernel_block_size: int,  # validated to divide block_size; slots do not depend on it
    num_slots: int,
    out: torch.Tensor | None = None,  # [num_slots] int64, written and returned when given
) -> torch.Tensor:
    """int64 ``[num_slots]`` (one launch)."""
    if out is None:
        out = torch.empty(num_slots, dtype=torch.int64, device=positions.device)
    num_reqs = query_start_loc.numel() - 1
    if num_slots == 0:
        return out
    _slot_mapping_kernel[(num_reqs + 1,)](
        block_table,
        positions,
        query_start_loc,
        out,
        block_table.stride(0),
        num_reqs,
        block_table.shape[1],
        num_slots,
        BLOCK_SIZE=block_size,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return out


def expand_block_table_triton(
    block_table: torch.Tensor, block_size: int, kernel_block_size: int
) -> torch.Tensor:
    """``[R, M]`` -> ``[R, M * k]`` (same dtype, -1 kept; one launch)."""
    k = block_size // kernel_block_size
    rows, cols = block_table.shape
    out = torch.empty((rows, cols * k), dtype=block_table.dtype, device=block_table.device)
    if out.numel() == 0:
        return out
    grid = (rows, triton.cdiv(cols * k, _BLOCK))
    _expand_block_table_kernel[grid](
        block_table,
        out,
        block_table.stride(0),
        out.stride(0),
        cols * k,
        K=k,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return out
