"""Slot mapping: where each new token's K/V goes (``compute_slot_mapping``), and the manager ->
kernel block-table expansion (``expand_block_table``).

Both validate their inputs and dispatch on an explicit ``impl``: ``"reference"`` (torch),
``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (triton for CUDA tensors,
reference for CPU ones). Value checks (positions in range, ``query_start_loc`` monotone) run on CPU
tensors only: on CUDA they would synchronize every step, so the kernel instead writes ``-1`` for a
token whose block-table column is out of range.
"""

from __future__ import annotations

import torch
from kv_spec import kernel_blocks_per_block

from kv_kernels import _op_calls
from kv_kernels._common import resolve_impl

__all__ = ["compute_slot_mapping", "expand_block_table"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _resolve_impl(impl: str, device: torch.device, op: str) -> str:
    return resolve_impl(impl, device, op=op)


#: Entries of an expanded block table we agree to allocate (2 GiB of int64).
_MAX_EXPANDED = 2**28
#: Block sizes are token counts addressed with int32 positions inside the kernels.
_MAX_BLOCK_SIZE = 2**31 - 1


def _check_block_sizes(block_size: int, kernel_block_size: int) -> int:
    """``k`` of kv-spec's manager -> kernel block rule, with the kernels' int32 bound."""
    for name, v in (("block_size", block_size), ("kernel_block_size", kernel_block_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}={v!r} must be an int, got {type(v).__name__}")
        if not 0 < v <= _MAX_BLOCK_SIZE:
            raise ValueError(f"{name}={v} must be in [1, {_MAX_BLOCK_SIZE}] (tokens per block)")
    return kernel_blocks_per_block(block_size, kernel_block_size)


def _check_index(name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} must be int32 or int64")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dim (stride {t.stride()}); pass {name}.contiguous()"
        )
    return t


def expand_block_table(
    block_table: torch.Tensor,
    block_size: int,
    kernel_block_size: int,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Manager block table ``[R, M]`` -> kernel block table ``[R, M * k]`` (``k = block_size //
    kernel_block_size``): entry ``b`` becomes ``b * k + i`` for ``i < k``; negative entries
    (padding) become ``k`` entries of ``-1``. Same dtype as the input (int32 overflow is checked
    on CPU tensors)."""
    if torch.compiler.is_compiling():
        return _op_calls.expand_block_table_op(
            block_table, block_size, kernel_block_size, impl=impl
        )
    k = _check_block_sizes(block_size, kernel_block_size)
    _check_index("block_table", block_table, 2)
    if block_table.numel() * k > _MAX_EXPANDED:
        raise ValueError(
            f"expanding a {tuple(block_table.shape)} block table by k={k} (block_size={block_size} "
            f"/ kernel_block_size={kernel_block_size}) gives {block_table.numel() * k} entries, "
            f"over {_MAX_EXPANDED}; pick a kernel block size closer to the block size"
        )
    if (
        block_table.device.type == "cpu"
        and block_table.dtype == torch.int32
        and block_table.numel()
    ):
        top = int(block_table.max())
        if top * k + k - 1 >= 2**31:
            raise ValueError(
                f"expanding block id {top} by k={k} overflows int32; pass block_table.long()"
            )
    chosen = _resolve_impl(impl, block_table.device, "expand_block_table")
    if chosen == "reference":
        from kv_kernels.slot_mapping.reference import expand_block_table_reference

        return expand_block_table_reference(block_table, block_size, kernel_block_size)
    from kv_kernels.slot_mapping.triton import expand_block_table_triton

    return expand_block_table_triton(block_table, block_size, kernel_block_size)


def compute_slot_mapping(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    kernel_block_size: int,
    *,
    num_slots: int | None = None,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 slots ``[num_slots or T]`` of the ``T = positions.numel()`` new tokens.

    Args:
        block_table: ``[R, M]`` manager block ids (int32/int64), one row per request.
        positions: ``[T]`` each token's position within its request.
        query_start_loc: ``[R + 1]``; request ``r`` owns tokens ``[qsl[r], qsl[r + 1])``.
        block_size: the manager block size; ``kernel_block_size`` must divide it.
        num_slots: length of the result (``>= T``; fixed for CUDA graphs); entries past the
            requests' tokens are ``-1``.
        out: an int64 ``[num_slots]`` tensor on ``positions``' device (contiguous) to write the
            slots into and return, e.g. a persistent buffer a CUDA graph captured; default: a
            new tensor.

    ``slot = kernel_block * kernel_block_size + pos % kernel_block_size`` with kernel block
    ``table[r, pos // block_size] * k + (pos // kernel_block_size) % k``; a ``-1`` table entry gives
    slot ``-1``.
    """
    if torch.compiler.is_compiling():
        slots = _op_calls.compute_slot_mapping_op(
            block_table,
            positions,
            query_start_loc,
            block_size,
            kernel_block_size,
            num_slots=num_slots,
            impl=impl,
        )
        return slots if out is None else out.copy_(slots)
    _check_block_sizes(block_size, kernel_block_size)
    _check_index("block_table", block_table, 2)
    _check_index("positions", positions, 1)
    _check_index("query_start_loc", query_start_loc, 1)
    device = positions.device
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but positions is on {device}")
    num_tokens = positions.numel()
    num_reqs = query_start_loc.numel() - 1
    if num_reqs < 0:
        raise ValueError("query_start_loc must have R + 1 >= 1 entries")
    if num_reqs != block_table.shape[0]:
        raise ValueError(
            f"query_start_loc has {num_reqs} requests but block_table has {block_table.shape[0]} rows; "
            f"pass block_table[:{num_reqs}]"
        )
    if num_slots is None:
        num_slots = num_tokens
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < num_tokens:
        raise ValueError(f"num_slots={num_slots!r} must be an int >= the {num_tokens} tokens")
    if out is not None:
        _check_out(out, num_slots, device)
    if device.type == "cpu":
        _check_values(block_table, positions, query_start_loc, block_size)
    chosen = _resolve_impl(impl, device, "compute_slot_mapping")
    if chosen == "reference":
        from kv_kernels.slot_mapping.reference import compute_slot_mapping_reference

        return compute_slot_mapping_reference(
            block_table, positions, query_start_loc, block_size, kernel_block_size, num_slots, out
        )
    from kv_kernels.slot_mapping.triton import compute_slot_mapping_triton

    return compute_slot_mapping_triton(
        block_table, positions, query_start_loc, block_size, kernel_block_size, num_slots, out
    )


def _check_out(out: object, num_slots: int, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.int64 or tuple(out.shape) != (num_slots,):
        raise ValueError(
            f"out is {out.dtype} of shape {tuple(out.shape)}; slots need int64 of shape "
            f"({num_slots},) (num_slots); pass buffer[:num_slots] of an int64 buffer"
        )
    if out.device != device:
        raise ValueError(f"out is on {out.device} but positions is on {device}")
    if num_slots and out.stride(0) != 1:
        raise ValueError(f"out must be contiguous (stride {out.stride()}); pass a contiguous slice")


def _check_values(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> None:
    # A handful of reductions on the happy path (this runs every step on host tables); the
    # offending token is only located once a bound is known to be broken.
    num_tokens = positions.numel()
    first, end = int(query_start_loc[0]), int(query_start_loc[-1])
    if first != 0:
        raise ValueError(f"query_start_loc[0]={first} must be 0")
    if query_start_loc.numel() > 1 and bool((query_start_loc[1:] < query_start_loc[:-1]).any()):
        qsl = query_start_loc.to(torch.int64)
        raise ValueError(f"query_start_loc must be non-decreasing, got {qsl.tolist()[:16]}")
    if end > num_tokens:
        raise ValueError(f"query_start_loc[-1]={end} exceeds the {num_tokens} positions")
    if end == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(positions[:end]))
    if lo < 0:
        raise ValueError(f"positions of request tokens must be >= 0, got {lo}")
    max_cols = block_table.shape[1]
    if hi // block_size < max_cols:  # the largest position needs the last column read
        return
    pos = positions[:end].to(torch.int64)
    steps = query_start_loc[1:].to(torch.int64) - query_start_loc[:-1]
    req = torch.repeat_interleave(torch.arange(steps.numel()), steps)  # [end] request of each token
    col = pos // block_size
    t = int((col >= max_cols).nonzero()[0])
    raise ValueError(
        f"token {t} of request {int(req[t])} is at position {int(pos[t])}, which needs block-table "
        f"column {int(col[t])} but block_table has {max_cols} columns (block_size={block_size})"
    )
