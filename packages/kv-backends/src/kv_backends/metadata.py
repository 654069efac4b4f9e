"""The one batch description every backend's metadata builder starts from."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["CommonAttentionMetadata"]


@dataclass(frozen=True, kw_only=True)
class CommonAttentionMetadata:
    """A varlen batch of ``num_reqs`` requests over a paged cache, as every backend receives it.

    Request ``r`` has ``query_len(r) = query_start_loc[r+1] - query_start_loc[r]`` new tokens whose
    positions are ``seq_lens[r] - query_len(r) .. seq_lens[r] - 1`` (its context ends at
    ``seq_lens[r]``, the new tokens included). A decode is a request with ``query_len == 1``.

    - ``query_start_loc``: int32 ``[num_reqs + 1]``, prefix sums of query lengths.
    - ``seq_lens``: int32 ``[num_reqs]``, context length (cached + new tokens) per request.
    - ``block_table``: int32 ``[num_reqs, max_blocks]`` of *kernel* block ids (manager blocks
      already expanded); entries past a request's last block are ignored.
    - ``slot_mapping``: int64 ``[num_tokens]`` cache slot of each new token, ``-1`` = padding.
    - ``max_query_len`` / ``max_seq_len``: host ints, bounds of the two above.
    - ``num_actual_tokens``: real tokens (the rest of ``slot_mapping`` and of ``q`` is padding).
    - ``query_start_loc_cpu`` / ``seq_lens_cpu``: host copies, when the caller has them (saves
      builders a device sync).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        qsl, sl, bt, sm = self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"CommonAttentionMetadata.{name} must be a torch.Tensor; got {type(t).__name__} "
                    "(build batches from Python lists with CommonAttentionMetadata.from_lists)"
                )
        for name in ("max_query_len", "max_seq_len", "num_actual_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(
                    f"CommonAttentionMetadata.{name}={v!r} must be a host int; got {type(v).__name__}"
                )
        if qsl.dim() != 1 or qsl.numel() < 1:
            raise ValueError(
                f"query_start_loc must be 1-D [num_reqs + 1]; got shape {tuple(qsl.shape)}"
            )
        num_reqs = qsl.numel() - 1
        if tuple(sl.shape) != (num_reqs,):
            raise ValueError(
                f"seq_lens has shape {tuple(sl.shape)}; expected ({num_reqs},) to match "
                f"query_start_loc of {num_reqs + 1} entries"
            )
        if bt.dim() != 2 or bt.shape[0] != num_reqs:
            raise ValueError(
                f"block_table has shape {tuple(bt.shape)}; expected ({num_reqs}, max_blocks)"
            )
        if sm.dim() != 1:
            raise ValueError(f"slot_mapping must be 1-D [num_tokens]; got shape {tuple(sm.shape)}")
        for name, t in (("query_start_loc", qsl), ("seq_lens", sl), ("block_table", bt)):
            if t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} has dtype {t.dtype}; expected int32 or int64")
        if sm.dtype != torch.int64:
            raise ValueError(
                f"slot_mapping has dtype {sm.dtype}; expected int64 (slots overflow int32 on large caches)"
            )
        if not 0 <= self.num_actual_tokens <= sm.numel():
            raise ValueError(
                f"num_actual_tokens={self.num_actual_tokens} must be in [0, {sm.numel()}] "
                "(the length of slot_mapping)"
            )
        if self.max_query_len < 0 or self.max_seq_len < 0:
            raise ValueError(
                f"max_query_len={self.max_query_len} and max_seq_len={self.max_seq_len} must be >= 0"
            )

    @property
    def num_reqs(self) -> int:
        return self.query_start_loc.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    def host_query_start_loc(self) -> torch.Tensor:
        """``query_start_loc`` on the host (the given copy, else one device sync)."""
        if self.query_start_loc_cpu is not None:
            return self.query_start_loc_cpu
        return self.query_start_loc.cpu()

    def host_seq_lens(self) -> torch.Tensor:
        """``seq_lens`` on the host (the given copy, else one device sync)."""
        if self.seq_lens_cpu is not None:
            return self.seq_lens_cpu
        return self.seq_lens.cpu()

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len <= 1

    def leading_decodes(self) -> int:
        """How many requests from the first hold one query token each (vLLM's ``num_decodes``
        of a batch with its decodes first), counted on the host copy of ``query_start_loc``;
        0 without one (counting on the device would sync). A kernel's prefill launch can leave
        them out of its grid (``kv_kernels.paged_attention``'s ``num_decodes``)."""
        r = self.num_reqs
        if self.max_query_len <= 1 and self.num_actual_tokens == r:
            return r  # (r query counts of 0 or 1 that sum to r: every one is 1)
        qsl = self.query_start_loc_cpu
        if qsl is None or r == 0:
            return 0
        other = ((qsl[1:] - qsl[:-1]) != 1).nonzero()
        return int(other[0, 0]) if other.numel() else r

    @classmethod
    def from_lists(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: Sequence[Sequence[int]] | torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
        pad_tokens_to: int | None = None,
    ) -> CommonAttentionMetadata:
        """Build a batch from host lists (tests, benchmarks, the toy engine).

        Slots of the new tokens follow ``block_table`` (kernel blocks of ``block_size`` tokens);
        ``pad_tokens_to`` appends ``-1`` slots (padding tokens every op must skip).
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(
                f"from_lists block_size={block_size!r} must be a positive int (tokens per kernel block)"
            )
        _check_lengths("query_lens", query_lens)
        _check_lengths("seq_lens", seq_lens)
        if pad_tokens_to is not None and (
            isinstance(pad_tokens_to, bool) or not isinstance(pad_tokens_to, int)
        ):
            raise TypeError(f"pad_tokens_to={pad_tokens_to!r} must be an int or None")
        if len(query_lens) != len(seq_lens):
            raise ValueError(
                f"query_lens has {len(query_lens)} entries and seq_lens {len(seq_lens)}; one per request"
            )
        for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if not 0 <= q <= s:
                raise ValueError(f"request {r}: query_len={q} must be in [0, seq_len={s}]")
        bt = _block_table_tensor(block_table, len(query_lens))
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        slots: list[int] = []
        for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            need = -(-s // block_size)
            if need > bt.shape[1]:
                raise ValueError(
                    f"request {r}: seq_len={s} needs {need} blocks of {block_size}; block_table "
                    f"has {bt.shape[1]} columns"
                )
            if need and int(bt[r, :need].min()) < 0:
                raise ValueError(
                    f"request {r}: block_table row {bt[r, :need].tolist()} has a negative block id "
                    f"among the {need} blocks that seq_len={s} needs; block ids are >= 0"
                )
            for pos in range(s - q, s):
                slots.append(int(bt[r, pos // block_size]) * block_size + pos % block_size)
        num_actual = len(slots)
        if pad_tokens_to is not None:
            if pad_tokens_to < num_actual:
                raise ValueError(
                    f"pad_tokens_to={pad_tokens_to} is below the {num_actual} real tokens"
                )
            slots += [-1] * (pad_tokens_to - num_actual)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        sl_t = torch.tensor(list(seq_lens), dtype=torch.int32)
        return cls(
            query_start_loc=qsl_t.to(device),
            seq_lens=sl_t.to(device),
            block_table=bt.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_actual_tokens=num_actual,
            query_start_loc_cpu=qsl_t,
            seq_lens_cpu=sl_t,
        )


def _check_lengths(name: str, values: object) -> None:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | torch.Tensor):
        raise TypeError(f"{name}={values!r} must be a sequence of ints (one per request)")
    for r, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}[{r}]={v!r} must be an int")
        if v < 0:
            raise ValueError(f"{name}[{r}]={v} must be >= 0")


def _block_table_tensor(block_table: object, num_reqs: int) -> torch.Tensor:
    if isinstance(block_table, torch.Tensor):
        if block_table.is_floating_point() or block_table.dtype == torch.bool:
            raise TypeError(
                f"block_table has dtype {block_table.dtype}; block ids must be integers"
            )
        bt = block_table.to(torch.int32)
    else:
        try:
            bt = torch.as_tensor(block_table, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(
                f"block_table must be a [num_reqs, max_blocks] list of int lists or an int "
                f"tensor; got {block_table!r:.80}: {e}"
            ) from e
        # as_tensor truncates floats silently (1.7 -> 1): refuse anything that is not an int.
        flat = list(_flatten(block_table))
        bad = [v for v in flat if isinstance(v, bool) or not isinstance(v, int)]
        if bad:
            raise TypeError(f"block_table holds non-int entries {bad[:4]}; block ids are ints")
        bt = bt.to(torch.int32)
    if bt.dim() != 2:
        if num_reqs == 0 or bt.numel() % max(num_reqs, 1):
            raise ValueError(
                f"block_table has shape {tuple(bt.shape)}; expected ({num_reqs}, max_blocks)"
            )
        bt = bt.reshape(num_reqs, -1)
    return bt


def _flatten(x: object) -> Iterator[object]:
    if isinstance(x, Sequence) and not isinstance(x, str | bytes):
        for v in x:
            yield from _flatten(v)
    else:
        yield x
