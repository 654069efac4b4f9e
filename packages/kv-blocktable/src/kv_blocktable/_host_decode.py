"""A pure-decode step's metadata on host (CPU) tables, built in place (the ``torch`` extra).

:class:`HostDecode` is :meth:`BlockTables.build_common_metadata`'s path for the step a decode
engine runs every step — every query length 1, lengths given as lists, tables on the CPU with the
reference slot mapping, power-of-two block sizes, the null block ``0`` or none — and gives what
the general path gives (``tests/test_decode_tables.py`` holds the two to each other on twin
tables), or ``None`` for anything else, valid or not: the general path then builds the step or
names its error. Nothing it writes is visible before every check has passed.

Where the general decode path makes a tensor, copies it into a persistent buffer and wraps it,
this one writes the buffers directly and reuses what depends on the batch size alone:

- ``seq_lens`` goes from the list into an int64 buffer with one ``struct`` call (the int check;
  ~2 us for 256 against ~5 for a fresh tensor through ``array('q')``), then into the int32
  ``seq_lens`` buffer and, less one, into the positions buffer; the
  host copies in the step and the metadata (``seq_lens_cpu``, ``StepInputs.positions`` /
  ``seq_lens_i32``) are those buffers' views — on a CPU device they are the host, and like every
  tensor of a step's metadata they hold the last built step's values.
- the block of each new token is one gather from the committed table at
  ``(seq_len + (row * width + first column) * block_size - 1) >> log2(block_size)`` (the
  offsets made once per batch size), and its slot ``block * block_size + (position & mask)``,
  written into the slot buffer.
- ``query_start_loc`` holds ``0..R`` for every decode of ``R`` requests: written when the buffer
  last held something else, not every step.
- the :class:`kv_backends.CommonAttentionMetadata` of a batch size is checked by its constructor
  once; later steps copy it with their ``max_seq_len`` (its only field that changes: every
  tensor is the same persistent view), which the constructor's checks would pass by
  construction (a host int >= 1).

About 20 us less than the general decode path for 256 requests on the shared 2-core EPYC
(issue 32), most of it fewer torch calls (each ~1 us of dispatch here) and no per-step
metadata checks.

On CUDA tables staged from pinned memory (``pin_memory=True``) the same host work runs on the
host table (what the last commit copied: no row changed since, or the step is refused before
this runs) and writes one pinned staging block — ``seq_lens``, positions and each group's slots
side by side, each at a 16-byte aligned offset fixed by the batch size — then copies it into
its device twin in one asynchronous copy (``query_start_loc``, into the tables' own buffer, only
when stale), whose views the step's metadata holds: no kv-kernels slot-mapping launch, no
staging of a fresh ``StepInputs``, no per-step metadata checks. A copy costs ~7 us of host time
on the H200 machine's host whatever its size up to 256 KB, and a step made three (seq_lens,
positions, slots) before they were packed. The caller waits for the last step's copies before
``build`` writes the staging block and records this step's after it (the general path's rule
for its buffers). On the H200 host the general CUDA decode path was ~180 us for 256
requests, most of it the slot-mapping launch's Python, the staging and the checks.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from kv_backends import CommonAttentionMetadata

from kv_blocktable import attn_metadata as _md

if TYPE_CHECKING:
    from kv_blocktable.attn_metadata import StepBuffers, StepInputs
    from kv_blocktable.block_table import BlockTables

__all__ = ["HostDecode"]

_INT32_MAX = 2**31 - 1
_MAX_SIZES = 1024  # cached batch sizes; more (many paddings) clears the cache


class _Size(NamedTuple):
    """What every decode step of ``num_reqs`` requests padded to ``padded`` tokens reads and
    writes, made once (views of persistent buffers stay valid)."""

    pack: Callable[..., None]  # struct pack_into of R int64 (the int check and the copy)
    lens: tuple[torch.Tensor, torch.Tensor]  # [R] int64 views of the two seq_lens buffers
    # The buffers the host work writes: the step's own on a CPU device, the packed staging
    # block's views on CUDA (copied, ``packed`` bytes, into the device block's twin views;
    # ``qsl_copy`` into the tables' query_start_loc buffer).
    qsl: torch.Tensor  # [R + 1] int32 query_start_loc buffer view
    seq: torch.Tensor  # [R] int32 seq_lens buffer view (also the host copy)
    pos: torch.Tensor  # [R] int64 positions buffer view (also the host copy)
    offsets: tuple[torch.Tensor, ...]  # per group [R] int64: (row * width + col0) * bs - 1
    positions: torch.Tensor  # [R] int64 positions buffer view on the tables' device
    qsl_copy: tuple[torch.Tensor, torch.Tensor] | None  # staged: query_start_loc (device, host)
    # staged: the bytes of the packed block the step writes (one copy); 0 on a CPU device
    packed: int
    idx: torch.Tensor  # [R] int64 scratch: flat table indices
    blocks: tuple[torch.Tensor, ...]  # per group [R] int32 scratch: each new token's block
    wide: tuple[torch.Tensor, ...]  # per group [R] int64 view of the slot buffer
    slots: tuple[torch.Tensor, ...]  # per group [padded] int64 slot buffer view
    kernel: tuple[torch.Tensor, ...]  # per group [R, M_g * k_g] kernel table view
    step: StepInputs  # a template: seq_lens and max_seq_len change per step
    common: tuple[CommonAttentionMetadata, ...]  # templates: max_seq_len changes per step


def _copy_with(template: Any, **changes: object) -> Any:
    """A copy of a frozen dataclass instance with ``changes``, past ``__init__`` (and so past its
    ``__post_init__`` checks, which ``template`` passed: only a value the checks would pass may
    be changed this way)."""
    obj = object.__new__(type(template))
    d = obj.__dict__
    d.update(template.__dict__)
    d.update(changes)
    return obj


class HostDecode:
    """The decode fast path of one :class:`~kv_blocktable.block_table.BlockTables` (see the
    module docstring); ``build`` returns ``(step, metadata)`` or ``None``."""

    def __init__(
        self,
        step_buffers: StepBuffers,
        dev_flat: torch.Tensor,  # [rows * width] int32 committed manager ids (host)
        kernel: Sequence[torch.Tensor],  # per group [rows, M_g * k_g] kernel tables
        slots: Sequence[torch.Tensor],  # per group [max_num_batched_tokens] int64
        col: Sequence[int],  # group g's columns are [col[g], col[g + 1]); col[-1] = width
        block_sizes: Sequence[int],
        max_blocks: Sequence[int],
        max_num_batched_tokens: int,
        null_block: int | None,
        staged: bool = False,
        pin_memory: bool = False,
    ) -> None:
        # staged (CUDA tables): the step is written into one staging block (pinned with
        # pin_memory) and copied into its device twin, whose views the metadata reads (dev_flat
        # is then the host table); else the buffers are host memory, written directly.
        self._buffers = step_buffers
        self._staged = staged
        self._flat = dev_flat
        self._kernel = tuple(kernel)
        self._slots = tuple(slots)
        self._col = tuple(col)
        self._block_sizes = tuple(block_sizes)
        self._max_tokens = max_num_batched_tokens
        # A seq_len up to this fits every group's row and int32 (past it: the general path).
        self._max_seq = min(
            _INT32_MAX, *(m * b for m, b in zip(max_blocks, block_sizes, strict=True))
        )
        # 0-d operands (a tensor operand skips the Python scalar's wrapping, ~1 us less an op).
        self._shift = tuple(torch.tensor(b.bit_length() - 1) for b in block_sizes)
        self._mask = tuple(torch.tensor(b - 1) for b in block_sizes)
        self._one = torch.tensor(1)
        # The smallest id a new token may land in: block 0 is the null block, or a real one.
        self._floor = 1 if null_block == 0 else 0
        rows = step_buffers.seq.numel()
        self._idx = torch.empty(rows, dtype=torch.int64)  # scratch
        self._blocks = tuple(torch.empty(rows, dtype=torch.int32) for _ in block_sizes)
        self._sizes: dict[tuple[int, int], _Size] = {}
        # Two int64 seq_lens buffers, used in turn: a step that fails its checks has written
        # the one the last built step does not read. Bytearrays: struct writes them directly.
        self._lens = (bytearray(8 * rows), bytearray(8 * rows))
        self._lens_t = tuple(torch.frombuffer(b, dtype=torch.int64) for b in self._lens)
        self._flip = 0
        if staged:  # the packed block at its largest: every request, the widest padding
            nbytes = _packed_layout(rows, max_num_batched_tokens, len(block_sizes))[-1]
            self._pack_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
            self._pack_d = torch.empty(nbytes, dtype=torch.uint8, device=slots[0].device)

    @classmethod
    def of(cls, tables: BlockTables) -> HostDecode | None:
        """The fast path of ``tables`` when they can take it at all: host tables, or CUDA tables
        staged from pinned memory, with the reference slot mapping (or ``impl="auto"`` on CUDA:
        the slots are the kernel's, held by the parity tests), power-of-two block sizes, the
        null block ``0`` or none."""
        if (
            not (tables._track_rows or tables._pinned)  # (a CPU device, or pinned staging)
            or tables.impl == "triton"
            or tables.null_block not in (None, 0)
            or any(b & (b - 1) for b in tables.block_sizes)
        ):
            return None
        staged = not tables._track_rows
        return cls(
            tables._step,
            tables._host_flat if staged else tables._dev_flat,
            tables._kernel,
            tables._slots,
            tables._col,
            tables.block_sizes,
            tables.max_num_blocks_per_req,
            tables.max_num_batched_tokens,
            tables.null_block,
            staged=staged,
            pin_memory=staged,
        )

    def build(
        self,
        num_reqs: int,
        query_lens: object,
        seq_lens: object,
        pad_tokens_to: object,
    ) -> tuple[StepInputs, tuple[CommonAttentionMetadata, ...], torch.Tensor] | None:
        """The step's inputs, one metadata per group and the positions on the tables' device, or
        ``None`` (the general path's case). The caller has checked ``num_reqs`` and that rows
        ``[0, num_reqs)`` are committed, and (staged) waited for the last step's copies."""
        n = num_reqs
        if (
            not n
            or type(query_lens) not in (list, tuple)
            or type(seq_lens) not in (list, tuple)
            or len(query_lens) != n  # type: ignore[arg-type]
            or len(seq_lens) != n  # type: ignore[arg-type]
            or query_lens.count(1) != n  # type: ignore[attr-defined]
            # count() also matches 1.0 and True (refused by the general path): a sum of ints
            # is an int.
            or type(sum(query_lens)) is not int  # type: ignore[call-overload]
        ):
            return None
        padded = n if pad_tokens_to is None else pad_tokens_to
        if type(padded) is not int or not n <= padded <= self._max_tokens:
            return None
        size = self._sizes.get((n, padded))
        if size is None:
            size = self._size(n, padded)
        # The lengths go into the seq_lens buffer the last step did not use (its StepInputs
        # still reads the other), one struct call: ints in the int64 range (floats, None, str
        # refused; a bool is its 0 / 1, as array('q') and the general path read it).
        flip = self._flip ^ 1
        try:
            size.pack(self._lens[flip], 0, *seq_lens)  # type: ignore[misc]
        except (struct.error, TypeError):
            return None
        s = size.lens[flip]  # [R] int64
        lo, hi = s.aminmax()
        max_seq = int(hi)
        if int(lo) < 1 or max_seq > self._max_seq:  # query_len 1 needs seq_len >= 1
            return None
        # Each group's block of each new token, into scratch buffers: a column past a row's
        # blocks holds -1, so one minimum checks coverage and the null block at once.
        idx, flat, floor = size.idx, self._flat, self._floor
        for offsets, shift, blocks in zip(size.offsets, self._shift, size.blocks, strict=True):
            torch.add(s, offsets, out=idx).bitwise_right_shift_(shift)
            torch.index_select(flat, 0, idx, out=blocks)  # [R] int32
            if int(blocks.min()) < floor:  # -1: past the row's blocks; 0: the null block
                return None
        # Every check passed: write the step.
        buffers = self._buffers
        if buffers.decode_qsl != n:
            size.qsl.copy_(size.step.query_start_loc)
            if size.qsl_copy is not None:
                size.qsl_copy[0].copy_(size.qsl_copy[1], non_blocking=True)
            buffers.decode_qsl = n
        size.seq.copy_(s)
        pos = torch.sub(s, self._one, out=size.pos)
        for wide, blocks, mask, bs in zip(
            size.wide, size.blocks, self._mask, self._block_sizes, strict=True
        ):
            # slot = block * bs + (pos & mask), in int64 (slots overflow int32); the block copied
            # to int64 first: mixed int32 / int64 arithmetic costs a microsecond more an op.
            wide.copy_(blocks)
            torch.add(torch.bitwise_and(pos, mask, out=idx), wide, alpha=bs, out=wide)
        if padded > n:
            for out in size.slots:
                out[n:] = -1
        if size.packed:  # staged: the whole step in one copy
            self._pack_d[: size.packed].copy_(self._pack_h[: size.packed], non_blocking=True)
        self._flip = flip
        step = _copy_with(size.step, seq_lens=s, max_seq_len=max_seq)
        common = size.common
        if common[0].max_seq_len != max_seq:
            common = tuple([_copy_with(md, max_seq_len=max_seq) for md in common])
        return step, common, size.positions

    def _size(self, n: int, padded: int) -> _Size:
        if len(self._sizes) >= _MAX_SIZES:
            self._sizes.clear()
        b = self._buffers
        token_reqs, qsl_i32, ones = _md._decode_ranges(n)
        rows = torch.arange(n) * self._col[-1]
        # What the host work writes (staged: the packed staging block) and what the metadata
        # reads (staged: the device block's views at the same offsets; on a CPU device the
        # persistent buffers, written directly).
        qsl_d = b.qsl[: n + 1]
        packed = 0
        if self._staged:
            qsl = b.host_qsl[: n + 1]
            *offsets, packed = _packed_layout(n, padded, len(self._block_sizes))
            (seq, pos, *host_slots), (seq_d, pos_d, *slots_d) = (
                _packed_views(block, n, padded, offsets) for block in (self._pack_h, self._pack_d)
            )
        else:
            seq, pos, qsl = b.seq[:n], b.pos[:n], qsl_d
            seq_d, pos_d = seq, pos
            host_slots = slots_d = [out[:padded] for out in self._slots]
        step = _md.StepInputs(
            num_reqs=n,
            query_lens=ones,
            seq_lens=ones,  # replaced per step
            query_start_loc=qsl_i32,
            seq_lens_i32=seq,
            positions=pos,
            token_reqs=token_reqs,
            num_tokens=n,
            padded_tokens=padded,
            max_query_len=1,
            max_seq_len=1,  # replaced per step
        )
        slots = tuple(host_slots)
        kernel = tuple(k[:n] for k in self._kernel)
        common = tuple(
            _md.make_common(step, qsl_d, seq_d, k, out)
            for k, out in zip(kernel, slots_d, strict=True)
        )
        size = self._sizes[(n, padded)] = _Size(
            pack=struct.Struct(f"={n}q").pack_into,
            lens=(self._lens_t[0][:n], self._lens_t[1][:n]),
            qsl=qsl,
            seq=seq,
            pos=pos,
            offsets=tuple(
                (rows + c) * bs - 1 for c, bs in zip(self._col[:-1], self._block_sizes, strict=True)
            ),
            positions=pos_d,
            qsl_copy=(qsl_d, qsl) if self._staged else None,
            packed=packed,
            idx=self._idx[:n],
            blocks=tuple(b[:n] for b in self._blocks),
            wide=tuple(out[:n] for out in slots),
            slots=slots,
            kernel=kernel,
            step=step,
            common=common,
        )
        return size


def _align16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def _packed_layout(n: int, padded: int, groups: int) -> tuple[int, ...]:
    """Byte offsets of a staged step's parts in its packed block — ``seq_lens`` (int32 ``[n]``),
    positions (int64 ``[n]``), each group's slots (int64 ``[padded]``) — then the block's used
    bytes: each part 16-byte aligned (kernels specialize pointers on it)."""
    pos = _align16(4 * n)
    first_slots = pos + _align16(8 * n)
    step = _align16(8 * padded)
    return (0, pos, *(first_slots + g * step for g in range(groups)), first_slots + groups * step)


def _packed_views(
    block: torch.Tensor, n: int, padded: int, offsets: Sequence[int]
) -> list[torch.Tensor]:
    """The parts of a packed block (:func:`_packed_layout`'s ``offsets``) as typed views."""
    seq, pos, *slots = offsets
    return [
        block[seq : seq + 4 * n].view(torch.int32),
        block[pos : pos + 8 * n].view(torch.int64),
        *(block[o : o + 8 * padded].view(torch.int64) for o in slots),
    ]
