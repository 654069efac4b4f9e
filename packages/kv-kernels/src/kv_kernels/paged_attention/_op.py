"""``torch.ops.kv_kernels.paged_attention``: the op registered once as a torch custom op.

Under ``torch.compile`` the api calls this op (one opaque node with its mutations declared)
instead of tracing the launcher; a CUDA graph captures the kernels it launches. The schema carries
the layout as its JSON and every optional as a primitive sentinel (``-1`` / ``0``) so it stays a
plain torch schema; the real implementation is the validating api function itself.
"""

from __future__ import annotations

import functools

import torch
from kv_spec import KVCacheLayout

__all__ = ["paged_attention_op"]

Tensor = torch.Tensor


@functools.lru_cache(maxsize=64)
def _layout(layout_json: str) -> KVCacheLayout:
    return KVCacheLayout.from_json(layout_json)


@torch.compiler.assume_constant_result
def _layout_json(layout: KVCacheLayout) -> str:
    """The layout's JSON; a constant of the graph under torch.compile (traced, not run)."""
    return layout.to_json()


@torch.library.custom_op("kv_kernels::paged_attention", mutates_args=("out", "lse"))
def _paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    layout: str,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool,
    sliding_window: int,
    sinks: Tensor | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    num_splits: int,
    out: Tensor,
    lse: Tensor | None,
    impl: str,
) -> None:
    from kv_kernels.paged_attention.api import paged_attention

    res = paged_attention(
        q,
        kv_cache,
        _layout(layout),
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len=None if max_seq_len < 0 else max_seq_len,
        scale=scale,
        causal=causal,
        sliding_window=None if sliding_window < 0 else sliding_window,
        sinks=sinks,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        num_splits=None if num_splits <= 0 else num_splits,
        return_lse=lse is not None,
        out=out,
        impl=impl,
    )
    if lse is not None:
        lse.copy_(res[1])


@_paged_attention.register_fake
def _(
    q,
    kv_cache,
    layout,
    block_table,
    seq_lens,
    query_start_loc,
    max_query_len,
    max_seq_len,
    scale,
    causal,
    sliding_window,
    sinks,
    softcap,
    alibi_slopes,
    k_scale,
    v_scale,
    num_splits,
    out,
    lse,
    impl,
) -> None:
    return None


def paged_attention_op(
    q: Tensor,
    kv_cache: Tensor,
    layout: KVCacheLayout,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    *,
    max_seq_len: int | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: Tensor | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    k_scale: float | Tensor | None,
    v_scale: float | Tensor | None,
    num_splits: int | None,
    return_lse: bool,
    out: Tensor,
    impl: str,
) -> Tensor | tuple[Tensor, Tensor]:
    """Call ``torch.ops.kv_kernels.paged_attention`` with the api's argument types."""

    def as_tensor(x: float | Tensor | None) -> Tensor | None:
        if x is None or isinstance(x, Tensor):
            return x
        return torch.full((1,), float(x), dtype=torch.float32, device=q.device)

    lse = (
        torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
        if return_lse
        else None
    )
    torch.ops.kv_kernels.paged_attention(
        q,
        kv_cache,
        _layout_json(layout),
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        -1 if max_seq_len is None else max_seq_len,
        scale,
        causal,
        -1 if sliding_window is None else sliding_window,
        sinks,
        softcap,
        alibi_slopes,
        as_tensor(k_scale),
        as_tensor(v_scale),
        0 if num_splits is None else num_splits,
        out,
        lse,
        impl,
    )
    return (out, lse) if lse is not None else out
