"""A committed kernel block table in the forms other kernel families read (the ``torch`` extra).

Kernel blocks of ``kernel_block_size`` tokens; request ``r`` reads
``pages[r] = ceil(seq_lens[r] / kernel_block_size)`` of them:

- :func:`csr_from_table`: FlashInfer's paged-KV CSR, ``indptr`` ``[R + 1]`` (prefix sums of
  ``pages``), ``indices`` (each request's first ``pages[r]`` kernel block ids, concatenated) and
  ``last_page_len`` ``[R]`` (tokens in the last page, ``seq_len - (pages - 1) * kbs``; an empty
  request has 0 pages and ``last_page_len = kbs``, so ``(pages - 1) * kbs + last_page_len``
  is its length, 0, as FlashInfer computes it).
- :func:`physical_to_logical`: FlexAttention's per-block map, ``phys_to_logical[block]`` = the
  logical column of a physical kernel block in the batch, ``-1`` elsewhere.

Split out of ``attn_metadata.py`` by job (these read a table, they build no step);
:mod:`kv_blocktable.attn_metadata` re-exports every name, its public home.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kv_blocktable._block_ids import positive_int

__all__ = ["PagedKVIndices", "csr_from_table", "physical_to_logical"]


class PagedKVIndices(NamedTuple):
    """FlashInfer's paged-KV CSR (int32, on the tables' device)."""

    indptr: torch.Tensor  # [R + 1] prefix sums of pages per request
    indices: torch.Tensor  # [indptr[-1]] kernel block ids, request by request
    last_page_len: torch.Tensor  # [R] tokens in each request's last page (kbs when empty)


def _used_entries(
    kernel_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kernel_block_size: int,
    first_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pages [R] host, indptr [R + 1] host, rows [nnz], cols [nnz])`` of the table entries the
    batch reads: columns ``[first_pos // kbs, pages)`` of each row (``first_pos`` [R] host, the
    first key position any query of the request sees; default 0). ``nnz`` comes from host
    lengths, so nothing here waits on the device."""
    device = kernel_table.device
    num_reqs = seq_lens.numel()
    pages = (seq_lens + kernel_block_size - 1) // kernel_block_size  # [R] int64
    first = (
        torch.zeros_like(pages)
        if first_pos is None
        else torch.minimum(first_pos // kernel_block_size, pages)
    )  # [R] first column read
    indptr = torch.zeros(num_reqs + 1, dtype=torch.int64)
    torch.cumsum(pages - first, 0, out=indptr[1:])
    nnz = int(indptr[-1])
    if num_reqs and int(pages.max()) > kernel_table.shape[1]:
        r = int(pages.argmax())
        raise ValueError(
            f"request {r} reads {int(pages[r])} kernel blocks but the table has "
            f"{kernel_table.shape[1]} columns"
        )
    rows = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), (pages - first).to(device), output_size=nnz
    )  # [nnz]
    start = (first - indptr[:-1]).to(device)  # [R] column of entry i is i + start[row]
    cols = torch.arange(nnz, device=device) + start[rows]  # [nnz]
    return pages, indptr, rows, cols


def csr_from_table(
    kernel_table: torch.Tensor,  # [R, max_kernel_blocks] int32
    seq_lens: torch.Tensor,  # [R] int64, host
    kernel_block_size: int,
) -> PagedKVIndices:
    """FlashInfer's ``(indptr, indices, last_page_len)`` of a committed kernel block table."""
    positive_int("csr_from_table", "kernel_block_size", kernel_block_size)
    pages, indptr, rows, cols = _used_entries(kernel_table, seq_lens, kernel_block_size)
    last = seq_lens - (pages - 1) * kernel_block_size  # [R]; an empty request gives kbs
    device = kernel_table.device
    return PagedKVIndices(
        indptr=indptr.to(device=device, dtype=torch.int32),
        indices=kernel_table[rows, cols].to(torch.int32),
        last_page_len=last.to(device=device, dtype=torch.int32),
    )


def physical_to_logical(
    kernel_table: torch.Tensor,  # [R, max_kernel_blocks] int32
    seq_lens: torch.Tensor,  # [R] int64, host
    kernel_block_size: int,
    *,
    num_kernel_blocks: int,
    null_kernel_blocks: tuple[int, int] | None = None,
    first_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlexAttention's int32 ``[num_kernel_blocks]`` physical → logical kernel-block map.

    ``null_kernel_blocks = (first, count)``: the null block's kernel blocks, which a
    sliding-window row holds at many columns; they stay ``-1`` (never a position). ``first_pos``
    ``[R]`` (host): the first key position each request's queries see; columns before it are
    skipped (their blocks may already be another request's). Any other block at two different
    columns in one batch raises (one map per step cannot say both).
    """
    positive_int("physical_to_logical", "kernel_block_size", kernel_block_size)
    positive_int("physical_to_logical", "num_kernel_blocks", num_kernel_blocks)
    _, _, rows, cols = _used_entries(kernel_table, seq_lens, kernel_block_size, first_pos)
    phys = kernel_table[rows, cols].long()  # [nnz]
    if null_kernel_blocks is not None:
        first, count = null_kernel_blocks
        keep = (phys < first) | (phys >= first + count)
        phys, cols = phys[keep], cols[keep]
    out = torch.full((num_kernel_blocks,), -1, dtype=torch.int32, device=kernel_table.device)
    if phys.numel() == 0:
        return out
    lo, hi = int(phys.min()), int(phys.max())
    if lo < 0 or hi >= num_kernel_blocks:
        raise ValueError(
            f"kernel block {lo if lo < 0 else hi} of the batch is outside [0, {num_kernel_blocks}); "
            "the table holds ids from another cache or an uncommitted row"
        )
    out[phys] = cols.to(torch.int32)
    clash = (out[phys].long() != cols).nonzero()
    if clash.numel():
        i = int(clash[0])
        raise ValueError(
            f"kernel block {int(phys[i])} is read at logical columns {int(cols[i])} and "
            f"{int(out[phys[i]])} in one batch; FlexAttention's physical->logical map needs one "
            "position per block per step (split the batch)"
        )
    return out
