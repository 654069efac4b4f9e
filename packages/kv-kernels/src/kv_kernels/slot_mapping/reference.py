"""Readable torch reference of the slot mapping and the manager -> kernel block-table expansion.

With ``k = block_size // kernel_block_size``, manager block ``b`` is kernel blocks ``b * k + i``
(``i < k``), and the token at position ``pos`` of request ``r`` goes to::

    kernel_block = expanded_table[r, pos // kernel_block_size]
    slot         = kernel_block * kernel_block_size + pos % kernel_block_size

``-1`` table entries (padding) give ``-1`` slots; tokens past ``query_start_loc[-1]`` and entries
past ``T`` (up to ``num_slots``) are ``-1``. Inputs are assumed validated by
:mod:`kv_kernels.slot_mapping.api`.
"""

from __future__ import annotations

import torch

__all__ = ["compute_slot_mapping_reference", "expand_block_table_reference"]


def expand_block_table_reference(
    block_table: torch.Tensor, block_size: int, kernel_block_size: int
) -> torch.Tensor:
    """``[R, M]`` manager block ids -> ``[R, M * k]`` kernel block ids (same dtype, -1 kept)."""
    k = block_size // kernel_block_size
    sub = torch.arange(k, dtype=block_table.dtype, device=block_table.device)  # [k]
    expanded = block_table[:, :, None] * k + sub  # [R, M, k]
    expanded = torch.where(block_table[:, :, None] >= 0, expanded, torch.full_like(expanded, -1))
    return expanded.reshape(block_table.shape[0], block_table.shape[1] * k)


def compute_slot_mapping_reference(
    block_table: torch.Tensor,  # [R, M] manager block ids
    positions: torch.Tensor,  # [T] positions within their request
    query_start_loc: torch.Tensor,  # [R + 1]
    block_size: int,
    kernel_block_size: int,
    num_slots: int,
    out: torch.Tensor | None = None,  # [num_slots] int64, written and returned when given
) -> torch.Tensor:
    """int64 ``[num_slots]`` slots of the ``T`` tokens, ``-1`` for padding.

    Only the table entries the tokens read are looked at, so the cost follows the tokens, not
    the table's width: the token at ``pos`` reads manager block ``b = table[r, pos // block_size]``,
    whose kernel block is ``b * k + (pos % block_size) // kernel_block_size``, so its slot
    ``kernel_block * kernel_block_size + pos % kernel_block_size`` is
    ``b * block_size + pos % block_size``.
    """
    device = positions.device
    if out is None:
        out = torch.empty(num_slots, dtype=torch.int64, device=device)
    out.fill_(-1)
    end = int(query_start_loc[-1])  # tokens past it are padding
    if end == 0:
        return out
    # request of each token: request r owns tokens [qsl[r], qsl[r + 1]), so token t belongs to
    # the number of requests that end at or before t. (searchsorted, not repeat_interleave: the
    # latter's CPU kernel is an OpenMP region of all threads at any size, which on a busy machine
    # costs a time slice per call.)
    req = torch.searchsorted(
        query_start_loc[1:],
        torch.arange(end, device=device, dtype=query_start_loc.dtype),
        right=True,
    )  # [end]
    pos = positions[:end].to(torch.int64)
    manager = block_table[req, pos // block_size].to(torch.int64)  # [end]
    slots = manager * block_size + pos % block_size
    out[:end] = torch.where(manager >= 0, slots, -1)
    return out
