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
) -> torch.Tensor:
    """int64 ``[num_slots]`` slots of the ``T`` tokens, ``-1`` for padding."""
    device = positions.device
    num_tokens = positions.numel()
    table = expand_block_table_reference(block_table.to(torch.int64), block_size, kernel_block_size)
    qsl = query_start_loc.to(device=device, dtype=torch.int64)
    out = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
    num_reqs = qsl.numel() - 1
    if num_tokens == 0 or num_reqs == 0:
        return out
    # request of each token: the r with qsl[r] <= t < qsl[r + 1]
    tokens = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(qsl, tokens, right=True) - 1  # [T]
    in_req = (tokens < qsl[-1]) & (req >= 0) & (req < num_reqs)
    tokens, req = tokens[in_req], req[in_req]
    pos = positions.to(torch.int64)[tokens]
    kernel_block = table.to(device)[req, pos // kernel_block_size]
    slots = kernel_block * kernel_block_size + pos % kernel_block_size
    out[tokens] = torch.where(kernel_block >= 0, slots, torch.full_like(slots, -1))
    return out
