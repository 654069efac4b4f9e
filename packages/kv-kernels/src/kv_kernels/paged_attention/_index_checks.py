"""The data-dependent checks of :func:`.api.paged_attention`'s index tensors (query offsets
monotonic and within q, ``q_len <= max_query_len``, ``q_len <= seq_len`` where positions matter,
the promised leading decodes, every block under a sequence allocated): they read the values, so
they run where the tensors live on the CPU, or on request (``validate=True`` /
``KV_KERNELS_VALIDATE=1``)."""

from __future__ import annotations

import torch
from kv_spec import KVCacheLayout

__all__ = ["check_index_values"]


def check_index_values(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    max_query_len: int,
    layout: KVCacheLayout,
    positional: bool = True,
    num_decodes: int = 0,
) -> None:
    """Data-dependent checks, run only for CPU index tensors (no device sync). ``positional``:
    some rule (causal, window, ALiBi) reads query positions, so ``q_len <= seq_len`` must hold;
    the first ``num_decodes`` sequences hold one query token each."""
    qsl = query_start_loc.to(torch.int64)
    if qsl.numel() and int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0]={int(qsl[0])} must be 0")
    q_lens = qsl[1:] - qsl[:-1]
    if q_lens.numel():
        if int(q_lens.min()) < 0:
            raise ValueError(
                "query_start_loc must be non-decreasing (a negative query count was found)"
            )
        if int(q_lens.max()) > max_query_len:
            raise ValueError(
                f"a sequence has {int(q_lens.max())} query tokens but max_query_len={max_query_len}; "
                "pass the true maximum"
            )
        if int(qsl[-1]) > num_tokens:
            raise ValueError(f"query_start_loc[-1]={int(qsl[-1])} exceeds q's {num_tokens} tokens")
        wrong = (q_lens[:num_decodes] != 1).nonzero().flatten()
        if wrong.numel():
            s = int(wrong[0])
            raise ValueError(
                f"num_decodes={num_decodes} but sequence {s} has query_len={int(q_lens[s])}: the "
                "first num_decodes sequences must hold one query token each; pass the length of "
                "the batch's leading run of decodes (0 is always right)"
            )
    lens = seq_lens.to(torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"seq_lens has a negative entry ({int(lens.min())})")
    longer = (q_lens > lens).nonzero().flatten() if positional and q_lens.numel() else q_lens[:0]
    if longer.numel():
        s = int(longer[0])
        raise ValueError(
            f"sequence {s} has query_len={int(q_lens[s])} > seq_lens[{s}]={int(lens[s])}: the query "
            "tokens are the last query_len positions of the sequence, so seq_lens must count them "
            "(seq_len = context + new tokens); only a call with causal=False, no sliding_window "
            "and no alibi_slopes (a cascade prefix pass) may have more queries than keys"
        )
    n = layout.block_size
    for s in range(lens.numel()):
        if int(q_lens[s]) == 0:
            continue  # an empty query row reads nothing
        n_pages = -(-int(lens[s]) // n)
        if n_pages > block_table.shape[1]:
            raise ValueError(
                f"seq_lens[{s}]={int(lens[s])} needs {n_pages} blocks of {n} but block_table has "
                f"{block_table.shape[1]} columns; widen the block table"
            )
        ids = block_table[s, :n_pages]
        if n_pages and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_blocks):
            raise ValueError(
                f"block_table[{s}, :{n_pages}] holds ids outside [0, {layout.num_blocks}) for "
                f"seq_len={int(lens[s])}: every block under the sequence must be allocated (-1 only in the padded tail)"
            )
