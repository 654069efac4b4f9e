"""A step's batch as attention metadata: host-side checks, staging, and the exports other kernel
families read (the ``torch`` extra).

:class:`StepInputs` is a step's query and sequence lengths checked on the host (where checking
costs no device sync) with everything derived from them: ``query_start_loc``, each new token's
position, the padded token count. :func:`make_common` pairs it with a group's kernel block table
and slot mapping into the :class:`kv_backends.CommonAttentionMetadata` that kv-backends' builders
take. :class:`~kv_blocktable.block_table.BlockTables` drives all of this; the functions here take
plain tensors so they can be tested against a by-hand formulation one at a time.

Exports for other kernel families (FlashInfer-style CSR pages, FlexAttention's physical → logical
block map: :class:`PagedKVIndices`, :func:`csr_from_table`, :func:`physical_to_logical`) live in
:mod:`kv_blocktable._kernel_exports`, which describes them; they are re-exported here, their
public home.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch
from kv_backends import CommonAttentionMetadata

from kv_blocktable._block_ids import int64_tensor
from kv_blocktable._kernel_exports import PagedKVIndices, csr_from_table, physical_to_logical

__all__ = [
    "KeyWindow",
    "PagedKVIndices",
    "StepBuffers",
    "StepInputs",
    "check_new_tokens_not_null",
    "check_rows_cover",
    "csr_from_table",
    "decode_blocks",
    "decode_slot_mappings",
    "host_slot_mapping",
    "host_slot_mappings",
    "make_common",
    "physical_to_logical",
]

_INT32_MAX = 2**31 - 1
_WINDOW_KINDS = ("sliding_window", "chunked_local")


@dataclass(frozen=True)
class KeyWindow:
    """Which earlier keys a group's queries see besides causality: the last ``size`` positions,
    the query's own included (``"sliding_window"``), or the query's own chunk of ``size``
    positions (``"chunked_local"``).

    Blocks wholly before the window of a request's first query are never read. The scheduler
    returns them to the pool (they may already belong to another request) while the worker's
    row may still hold their old ids, so exports that map blocks to positions skip them.
    """

    kind: str
    size: int

    def __post_init__(self) -> None:
        if self.kind not in _WINDOW_KINDS:
            raise ValueError(f"KeyWindow.kind={self.kind!r} is not one of {_WINDOW_KINDS}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
            raise ValueError(f"KeyWindow.size={self.size!r} must be a positive int")

    @classmethod
    def of_spec(cls, spec: object) -> KeyWindow | None:
        """The window of a kv_spec spec (None for full attention, MLA and cross attention)."""
        from kv_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec

        if isinstance(spec, SlidingWindowSpec):
            return cls("sliding_window", spec.sliding_window)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return cls("chunked_local", spec.attention_chunk_size)
        return None

    def first_visible(self, positions: torch.Tensor) -> torch.Tensor:
        """The first key position a query at each of ``positions`` sees (int64, same shape)."""
        if self.kind == "sliding_window":
            return (positions - self.size + 1).clamp(min=0)
        return positions // self.size * self.size


def _host_lengths(name: str, values: object, num_reqs: int) -> torch.Tensor:
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        raise ValueError(
            f"{name} is on {values.device}; pass host lengths (a list, numpy array or CPU tensor): "
            "checking device values would synchronize every step"
        )
    if isinstance(values, (list, tuple)) and len(values) == num_reqs:
        try:  # the common case, a list of ints from the scheduler: the fast conversion
            # (array('q') refuses floats and None; it reads a bool as 0 / 1, the same number,
            # which a per-element check every step would cost more than it is worth)
            return int64_tensor(values)
        except (TypeError, OverflowError):
            pass  # not plain ints: the checks below explain
    _check_integer_lengths(name, values)
    try:
        t = torch.as_tensor(values, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be a sequence of ints: {e}") from None
    if t.dim() != 1 or t.numel() != num_reqs:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected ({num_reqs},), one length per request "
            f"of num_reqs={num_reqs}"
        )
    return t


def _check_integer_lengths(name: str, values: object) -> None:
    """Lengths are integers: a float (or bool) list, tensor or array is refused, never
    truncated (``torch.as_tensor([1.5], dtype=int64)`` is 1)."""
    dtype = getattr(values, "dtype", None)
    if dtype is not None:
        if isinstance(dtype, torch.dtype):
            ok = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
        else:
            ok = getattr(dtype, "kind", "") in ("i", "u")
        if not ok:
            raise TypeError(f"{name} has dtype {dtype}; pass integer lengths")
    elif isinstance(values, (list, tuple)):
        for bad in values:
            if type(bad) is int:
                continue
            raise TypeError(
                f"{name} holds {bad!r} ({type(bad).__name__}); lengths are ints (never rounded)"
            )


_DECODE_RANGES: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_POW2_OPERANDS: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}


def _pow2_operands(block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(log2(block_size), block_size - 1)`` as 0-d int64 tensors for a power-of-two block
    size, else ``None``. On the non-negative positions of a step, ``>>`` and ``&`` with these give
    exactly ``// block_size`` and ``% block_size``, and a tensor operand skips the Python
    scalar's wrapping: ~1 us less per op on the CPU, two ops per group of a decode step."""
    got = _POW2_OPERANDS.get(block_size, ())
    if got == ():
        pow2 = block_size > 0 and block_size & (block_size - 1) == 0
        got = _POW2_OPERANDS[block_size] = (
            (torch.tensor(block_size.bit_length() - 1), torch.tensor(block_size - 1))
            if pow2
            else None
        )
    return got  # type: ignore[return-value]


def _decode_ranges(num_reqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(arange(R) int64, arange(R + 1) int32, ones(R) int64)``: a pure-decode step's token
    rows, ``query_start_loc`` and query lengths, shared by every decode step of ``R`` requests
    (never written)."""
    got = _DECODE_RANGES.get(num_reqs)
    if got is None:
        got = _DECODE_RANGES[num_reqs] = (
            torch.arange(num_reqs),
            torch.arange(num_reqs + 1, dtype=torch.int32),
            torch.ones(num_reqs, dtype=torch.int64),
        )
    return got


def _decode_step(
    num_reqs: int,
    query_lens: object,
    seq_lens: object,
    pad_tokens_to: int | None,
    max_num_batched_tokens: int,
) -> StepInputs | None:
    """The :class:`StepInputs` of a pure-decode step given as lists (every query length 1), or
    ``None`` for anything else, valid or not: the general path then builds it or names the
    error. Accepts exactly what the general path accepts for such a step, in a handful of C-level
    passes instead of its list and tensor rounds (a decode step runs this every step)."""
    if (
        not num_reqs
        or type(query_lens) not in (list, tuple)
        or type(seq_lens) not in (list, tuple)
        or len(query_lens) != num_reqs  # type: ignore[arg-type]
        or len(seq_lens) != num_reqs  # type: ignore[arg-type]
        or query_lens.count(1) != num_reqs  # type: ignore[attr-defined]
        # count() also matches 1.0 (refused by the general path): a sum of ints is an int.
        or type(sum(query_lens)) is not int  # type: ignore[call-overload]
    ):
        return None
    padded = num_reqs if pad_tokens_to is None else pad_tokens_to
    if type(padded) is not int or not num_reqs <= padded <= max_num_batched_tokens:
        return None
    try:
        s = int64_tensor(seq_lens)  # type: ignore[arg-type]  # refuses floats, None, str
    except (TypeError, OverflowError):
        return None
    lo, hi = s.aminmax()
    max_s = int(hi)
    if int(lo) < 1 or max_s > _INT32_MAX:  # query_len 1 needs seq_len >= 1
        return None
    return _pure_decode_inputs(num_reqs, s, padded, max_s)


def _pure_decode_inputs(
    num_reqs: int,
    seq_lens: torch.Tensor,
    padded: int,
    max_seq_len: int,
    query_lens: torch.Tensor | None = None,
) -> StepInputs:
    """A pure-decode step's :class:`StepInputs` (every query length 1): token ``r`` is request
    ``r``'s only new token, at ``seq_len - 1``, and ``query_start_loc`` is ``0..R``; those
    ranges depend on ``R`` alone and are made once per ``R`` (read-only, as every StepInputs
    tensor). ``query_lens``: the step's own ``[R]`` ones, else the shared ones."""
    token_reqs, qsl_i32, ones = _decode_ranges(num_reqs)
    return StepInputs(
        num_reqs=num_reqs,
        query_lens=ones if query_lens is None else query_lens,
        seq_lens=seq_lens,
        query_start_loc=qsl_i32,
        # (.int() and a tensor operand: the same values as .to(torch.int32) and `- 1`, each
        # about half a microsecond less of torch's dispatch on a batch of a few hundred)
        seq_lens_i32=seq_lens.int(),
        positions=seq_lens - ones,
        token_reqs=token_reqs,
        num_tokens=num_reqs,
        padded_tokens=padded,
        max_query_len=1,
        max_seq_len=max_seq_len,
    )


@dataclass(frozen=True)
class StepInputs:
    """One step's batch, checked on the host. All tensors are CPU tensors, read-only: a decode
    step's ``token_reqs`` and ``query_start_loc`` are shared by every decode step of its size."""

    num_reqs: int
    query_lens: torch.Tensor  # [R] int64
    seq_lens: torch.Tensor  # [R] int64
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens_i32: torch.Tensor  # [R] int32
    positions: torch.Tensor  # [T] int64, position of each new token within its request
    token_reqs: torch.Tensor  # [T] int64, request (row) of each new token
    num_tokens: int  # T
    padded_tokens: int  # T plus padding (a CUDA graph's captured length)
    max_query_len: int
    max_seq_len: int

    @property
    def pure_decode(self) -> bool:
        """Every request has exactly one new token (at ``seq_len - 1``)."""
        return self.max_query_len == 1 and self.num_tokens == self.num_reqs

    @classmethod
    def from_lengths(
        cls,
        num_reqs: int,
        query_lens: object,
        seq_lens: object,
        *,
        pad_tokens_to: int | None,
        max_num_batched_tokens: int,
    ) -> StepInputs:
        if isinstance(num_reqs, bool) or not isinstance(num_reqs, int) or num_reqs < 0:
            raise ValueError(f"num_reqs={num_reqs!r} must be an int >= 0")
        fast = _decode_step(num_reqs, query_lens, seq_lens, pad_tokens_to, max_num_batched_tokens)
        if fast is not None:
            return fast
        q = _host_lengths("query_lens", query_lens, num_reqs)
        s = _host_lengths("seq_lens", seq_lens, num_reqs)
        # Every step runs this. The checks and bounds are Python's min / max / sum over the
        # lengths as lists: on a few hundred ints they cost less than the torch reductions they
        # replace (microseconds per op, a dozen ops per step).
        ql, sl = q.tolist(), s.tolist()
        first = [b - a for a, b in zip(ql, sl, strict=True)]  # each request's first new position
        if num_reqs and (min(ql) < 0 or min(first) < 0):
            r = next(i for i, (a, f) in enumerate(zip(ql, first, strict=True)) if a < 0 or f < 0)
            raise ValueError(
                f"request {r}: query_len={ql[r]} must be in [0, seq_len={sl[r]}] (the "
                "new tokens are the last query_len of its seq_len tokens)"
            )
        max_q, max_s, num_tokens = max(ql, default=0), max(sl, default=0), sum(ql)
        if max_s > _INT32_MAX:
            raise ValueError(f"seq_len={max_s} exceeds the int32 range of seq_lens")
        padded = num_tokens if pad_tokens_to is None else pad_tokens_to
        if isinstance(padded, bool) or not isinstance(padded, int):
            raise ValueError(f"pad_tokens_to={pad_tokens_to!r} must be an int or None")
        if not num_tokens <= padded <= max_num_batched_tokens:
            raise ValueError(
                f"the step has {num_tokens} tokens padded to {padded}; both must be at most "
                f"max_num_batched_tokens={max_num_batched_tokens} and the padded length at least "
                "the token count; split the step or raise max_num_batched_tokens"
            )
        if max_q == 1 and num_tokens == num_reqs:
            # Pure decode (every query_len is 1: none is above 1 and they sum to R)
            return _pure_decode_inputs(num_reqs, s, padded, max_s, q)
        # Per-token arrays with numpy, not torch: torch's CPU index and repeat_interleave enter
        # its OpenMP pool at these sizes, and on a GPU host (16 cores, workers spinning after the
        # region) an 8k-token prefill's metadata took 10-20 ms instead of ~1 (H200 host, the
        # engine's own step; OMP_WAIT_POLICY=PASSIVE or one thread gave ~1 ms too). numpy runs
        # on the calling thread.
        q_np, s_np = q.numpy(), s.numpy()
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)  # [R + 1]
        np.cumsum(q_np, out=qsl[1:])
        token_reqs = np.repeat(np.arange(num_reqs, dtype=np.int64), q_np)  # [T]
        # Token t of request r sits at position (seq_len - query_len) + (t - qsl[r]), i.e.
        # t + (seq_len - qsl[r + 1]).
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(s_np - qsl[1:], q_np)
        return cls(
            num_reqs=num_reqs,
            query_lens=q,
            seq_lens=s,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            seq_lens_i32=s.to(torch.int32),
            positions=torch.from_numpy(positions),
            token_reqs=torch.from_numpy(token_reqs),
            num_tokens=num_tokens,
            padded_tokens=padded,
            max_query_len=max_q,
            max_seq_len=max_s,
        )


def check_rows_cover(
    step: StepInputs,
    row_blocks: Sequence[Sequence[int]],  # [>= R][G] manager blocks per row and group
    block_sizes: Sequence[int],
    max_blocks: Sequence[int],
) -> None:
    """Every request's row holds the blocks its ``seq_len`` tokens need, in every group.

    A token past its row's blocks would get slot ``-1`` (its K/V silently dropped) and its
    attention would read padding: refuse the batch here, on host values, instead. The counts are
    Python lists (what :class:`~kv_blocktable.block_table.BlockTables` keeps): a compare per
    request costs less than the few torch ops of a vectorized check on a batch of this size.
    """
    seq_lens = step.seq_lens.tolist()
    for g, bs in enumerate(block_sizes):
        for r, seq_len in enumerate(seq_lens):
            # seq_len <= blocks * block_size, i.e. ceil(seq_len / block_size) <= blocks.
            have = row_blocks[r][g]
            if seq_len <= have * bs:
                continue
            want = -(-seq_len // bs)
            hint = (
                f"max_num_blocks_per_req={max_blocks[g]} cannot hold it; raise max_model_len"
                if want > max_blocks[g]
                else "append the step's new blocks with append_row, then commit"
            )
            raise ValueError(
                f"request {r}: seq_len={seq_len} needs {want} blocks of group {g} "
                f"(block_size={bs}) but row {r} holds {have}; {hint}"
            )


def check_new_tokens_not_null(
    step: StepInputs,
    host_table: torch.Tensor,  # [>= R, M] int32 manager block ids of one group
    block_size: int,
    null_block: int,
    group: int,
) -> None:
    """No new token is written into the null block.

    A sliding-window row holds the null block where old blocks fell out of the window; a new
    token's block must be a real one, or its K/V would land in the shared null page (read by
    nobody, overwritten by everybody).
    """
    if step.num_tokens == 0:
        return
    # numpy's gather, not torch's CPU index (which enters its OpenMP pool: see from_lengths)
    blocks = host_table.numpy()[step.token_reqs.numpy(), step.positions.numpy() // block_size]
    hit = blocks == null_block  # [T]
    if hit.any():
        _null_error(step, int(hit.argmax()), block_size, null_block, group)


def _check_not_null(
    step: StepInputs, blocks: torch.Tensor, block_size: int, null_block: int, group: int
) -> None:
    hit = blocks == null_block
    if bool(hit.any()):
        _null_error(step, int(hit.nonzero()[0]), block_size, null_block, group)


def _null_error(step: StepInputs, t: int, block_size: int, null_block: int, group: int) -> NoReturn:
    r, pos = int(step.token_reqs[t]), int(step.positions[t])
    raise ValueError(
        f"request {r}: new token at position {pos} maps to the null block {null_block} "
        f"(group {group}, column {pos // block_size}); the scheduler must allocate a real block "
        "for every block the step writes"
    )


def host_slot_mapping(
    step: StepInputs,
    table: torch.Tensor,  # [>= R, M] int32 committed manager block ids of one group (host)
    block_size: int,
    null_block: int | None,
    group: int,
    out: torch.Tensor,  # [padded_tokens] int64, written in place
) -> torch.Tensor:
    """The step's slots from a host table, with :func:`check_new_tokens_not_null`'s check on the
    same lookup: ``slot = table[r, pos // block_size] * block_size + pos % block_size`` (kernel
    blocks split a manager block's slots evenly, so the kernel block size drops out), ``-1`` for
    the padding. The same values as kv-kernels' ``compute_slot_mapping`` for a batch that passed
    :func:`check_rows_cover` (every token's column holds a real block id, so no ``-1`` entry is
    read), in four small ops instead of the library's checks and searches: on a CPU table that
    call was most of a decode step's metadata build (kvstack's engine benchmark)."""
    t = step.num_tokens
    if t:
        blocks = table[step.token_reqs, step.positions // block_size]  # [T] int32
        if null_block is not None:
            _check_not_null(step, blocks, block_size, null_block, group)
        # int64 arithmetic (the add promotes before it multiplies): slots overflow int32.
        dst = out if out.numel() == t else out[:t]
        torch.add(step.positions % block_size, blocks, alpha=block_size, out=dst)
    if out.numel() > t:
        out[t:] = -1
    return out


def host_slot_mappings(
    step: StepInputs,
    table: torch.Tensor,  # [>= R, sum M_g] int32 every group's committed manager block ids (host)
    cols: Sequence[int],  # group g's table is columns [cols[g], cols[g + 1])
    block_sizes: Sequence[int],
    null_block: int | None,
    outs: Sequence[torch.Tensor],  # per group a persistent int64 buffer of >= padded_tokens
) -> tuple[torch.Tensor, ...]:
    """:func:`host_slot_mapping` of every group, written into ``outs[g][:padded_tokens]``."""
    if len(block_sizes) == 1 and cols[1] == table.shape[1]:  # one group: the whole table
        out = outs[0]
        if out.numel() != step.padded_tokens:
            out = out[: step.padded_tokens]
        return (host_slot_mapping(step, table, block_sizes[0], null_block, 0, out),)
    return tuple(
        host_slot_mapping(
            step, table[:, cols[g] : cols[g + 1]], bs, null_block, g, outs[g][: step.padded_tokens]
        )
        for g, bs in enumerate(block_sizes)
    )


def decode_blocks(
    step: StepInputs,
    flat_table: torch.Tensor,  # [rows * width] int32 committed manager ids, row-major (host)
    bases: Sequence[torch.Tensor],  # per group [R] int64: row * width + the group's first column
    block_sizes: Sequence[int],
    max_blocks: Sequence[int],
    null_block: int | None,
) -> list[torch.Tensor] | None:
    """Per group, the manager block of each request's new token in a pure-decode step ``[R]``
    int32 — or ``None`` when one of them is not a real block (past the row's blocks: ``-1``
    padding; the null block; past the table), so the caller runs :func:`check_rows_cover` and
    the null check, which name the error.

    For a decode the two checks are this one lookup: the new token sits at ``seq_len - 1``, and
    the row covers ``seq_len`` tokens exactly when that column holds a block (a row's columns
    past its blocks are ``-1``, block ids are ``>= 0``). One gather per group replaces the
    Python loop over rows and the null check's own gather."""
    floor = 1 if null_block == 0 else 0  # the smallest id a new token may land in
    out = []
    for g, bs in enumerate(block_sizes):
        if step.max_seq_len > max_blocks[g] * bs:
            return None
        ops = _pow2_operands(bs)
        col = (
            step.positions.bitwise_right_shift(ops[0])  # positions >= 0: floor division
            if ops is not None
            else torch.div(step.positions, bs, rounding_mode="floor")
        )
        idx = col.add_(bases[g])  # [R]
        blocks = flat_table.index_select(0, idx)  # [R] int32
        if int(blocks.min()) < floor:
            return None
        if null_block not in (None, 0) and bool((blocks == null_block).any()):
            return None
        out.append(blocks)
    return out


def decode_slot_mappings(
    step: StepInputs,
    blocks: Sequence[torch.Tensor],  # per group [R] int32, from decode_blocks
    block_sizes: Sequence[int],
    outs: Sequence[torch.Tensor],  # per group the int64 [padded_tokens] view written in place
) -> tuple[torch.Tensor, ...]:
    """:func:`host_slot_mappings` of a pure-decode step from :func:`decode_blocks`' lookup:
    ``slot = block * block_size + pos % block_size``, ``-1`` padding."""
    n, padded = step.num_tokens, step.padded_tokens
    for g, bs in enumerate(block_sizes):
        out = outs[g]
        # int64 arithmetic (the add promotes before it multiplies): slots overflow int32.
        ops = _pow2_operands(bs)
        within = step.positions.bitwise_and(ops[1]) if ops is not None else step.positions % bs
        torch.add(within, blocks[g], alpha=bs, out=out[:n] if padded > n else out)
        if padded > n:
            out[n:] = -1
    return tuple(outs)


class StepBuffers:
    """Persistent device buffers of a step's ``query_start_loc`` / ``seq_lens`` / ``positions``,
    filled from pinned host staging buffers (asynchronous copies on CUDA)."""

    def __init__(
        self, max_num_reqs: int, max_num_tokens: int, device: torch.device, pinned: bool
    ) -> None:
        self.pinned = pinned
        self.qsl = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.pos = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        # On the CPU the "device" buffers are host memory already: no staging copy.
        self.direct = device.type == "cpu"
        # R when qsl[: R + 1] holds 0..R as a decode step of R requests left it (HostDecode
        # skips rewriting it); -1 once anything else is staged.
        self.decode_qsl = -1
        self._decode_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if self.direct:
            self.host_qsl, self.host_seq, self.host_pos = self.qsl, self.seq, self.pos
        else:
            self.host_qsl = torch.zeros(max_num_reqs + 1, dtype=torch.int32, pin_memory=pinned)
            self.host_seq = torch.zeros(max_num_reqs, dtype=torch.int32, pin_memory=pinned)
            self.host_pos = torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pinned)

    def stage(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy the step to the device; returns views ``qsl [R + 1]``, ``seq_lens [R]``,
        ``positions [T]`` of the persistent buffers. The caller waits for the previous copies
        before calling (the host buffers are reused)."""
        r, t = step.num_reqs, step.num_tokens
        self.decode_qsl = -1
        if self.direct:  # the buffers are the host copies: one view each, no staging
            views = self._decode_views.get(r) if r == t else None
            if views is None:
                views = self.qsl[: r + 1], self.seq[:r], self.pos[:t]
                if r == t:  # decode sizes: at most max_num_reqs of them, views made once
                    self._decode_views[r] = views
            qsl, seq, pos = views
            qsl.copy_(step.query_start_loc)
            seq.copy_(step.seq_lens_i32)
            pos.copy_(step.positions)
            return views
        pairs = (
            (self.host_qsl[: r + 1], self.qsl[: r + 1], step.query_start_loc),
            (self.host_seq[:r], self.seq[:r], step.seq_lens_i32),
            (self.host_pos[:t], self.pos[:t], step.positions),
        )
        for host, dev, src in pairs:
            host.copy_(src)
            dev.copy_(host, non_blocking=self.pinned)
        return self.qsl[: r + 1], self.seq[:r], self.pos[:t]


def make_common(
    step: StepInputs,
    query_start_loc: torch.Tensor,  # [R + 1] int32, device
    seq_lens: torch.Tensor,  # [R] int32, device
    kernel_block_table: torch.Tensor,  # [R, max_blocks * k] int32, device
    slot_mapping: torch.Tensor,  # [padded_tokens] int64, device
) -> CommonAttentionMetadata:
    """One group's :class:`kv_backends.CommonAttentionMetadata` (host copies from ``step``, so
    builders never sync)."""
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=kernel_block_table,
        slot_mapping=slot_mapping,
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        num_actual_tokens=step.num_tokens,
        query_start_loc_cpu=step.query_start_loc,
        seq_lens_cpu=step.seq_lens_i32,
    )
