"""The KV split count of a paged-attention launch (:mod:`.triton`): the caller's, or the
heuristic of the decode kernel that serves the launch, capped for a mixed batch by the bytes of
its split scratch."""

from __future__ import annotations

from typing import Any

import torch

from kv_kernels.paged_attention._tiles import pick_num_splits

__all__ = ["MIXED_SPLIT_SCRATCH"]


#: bytes of split scratch (partial outputs and LSEs of every token row) a mixed batch's decode
#: split may take: past it the decode class runs unsplit, as every mixed batch once did
MIXED_SPLIT_SCRATCH = 64 << 20


def _num_splits(
    splits: Any, block_table: torch.Tensor, block_size: int, max_seq_len: int | None
) -> int:
    """The KV split count of a launch: the caller's, or the heuristic of the decode kernel that
    serves it over ``max_seq_len`` (the only input a plan does not fix)."""
    if isinstance(splits, int):
        return splits
    if splits[0] == "capped":  # (a mixed batch: the largest power of two within the cap)
        cap, inner = splits[1], splits[2]
        return min(
            _num_splits(inner, block_table, block_size, max_seq_len), 1 << (cap.bit_length() - 1)
        )
    bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
    kind, num_seqs, heads, num_sms = splits[:4]
    if kind == "decode":
        from kv_kernels.paged_attention._sm90_decode import pick_decode_splits

        return pick_decode_splits(
            num_seqs=num_seqs, num_kv_heads=heads, max_seq_len=bound, num_sms=num_sms
        )
    if kind == "mla":
        from kv_kernels.paged_attention._sm90_mla import pick_mla_splits

        return pick_mla_splits(
            num_seqs=num_seqs, head_blocks=heads, max_seq_len=bound, num_sms=num_sms
        )
    cfg = splits[4]
    return pick_num_splits(
        num_seqs=num_seqs, num_kv_heads=heads, max_seq_len=bound, tile_n=cfg.tile_n,
        num_sms=num_sms, waves=cfg.waves, programs_per_sm=cfg.programs_per_sm,
    )  # fmt: skip
