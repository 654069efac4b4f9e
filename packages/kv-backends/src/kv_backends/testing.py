"""Random paged batches for tests and benchmarks (not used by the backends themselves)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kv_kernels import allocate_kv_cache, layer_view
from kv_spec import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec, to_torch_dtype

from kv_backends.config import AttentionConfig
from kv_backends.metadata import CommonAttentionMetadata
from kv_backends.registry import get_backend

__all__ = ["PagedBatch", "make_paged_batch", "oracle_attention", "run_backend"]


@dataclass
class PagedBatch:
    """A filled cache, a batch over it and the inputs of one layer (layer slot 0)."""

    config: AttentionConfig
    layout: KVCacheLayout
    storage: object
    kv_cache: torch.Tensor  # [B, H, N, C] layer view of slot ``layer``
    common: CommonAttentionMetadata
    q: torch.Tensor  # [T_padded, Hq, D]
    key: torch.Tensor  # [T_ctx, H, D] every context token, in (request, position) order
    value: torch.Tensor  # [T_ctx, H, Dv]
    all_slots: torch.Tensor  # [T_ctx] int64 slots of key/value
    sinks: torch.Tensor | None
    alibi_slopes: torch.Tensor | None


def make_paged_batch(
    *,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    head_size_v: int | None = None,
    block_size: int = 16,
    kernel_block_size: int | None = None,
    num_blocks: int | None = None,
    num_layers: int = 1,
    layer: int = 0,
    order: str = "LBNHC",
    dtype: str = "float32",
    sliding_window: int | None = None,
    has_sinks: bool = False,
    softcap: float = 0.0,
    use_alibi: bool = False,
    pad_tokens: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
    fill: bool = True,
    blocks: Sequence[int] | None = None,
    make_kv: bool = True,
) -> PagedBatch:
    """Allocate a cache, give each request shuffled (non-contiguous) blocks, and fill every
    context slot with random K/V (written straight into the layer view by torch indexing, so the
    fill does not depend on any backend). Kernel block ids go in the block table. ``blocks``
    gives the manager blocks to hand out, in order (default: a random permutation).
    ``make_kv=False`` skips drawing K/V (benchmarks fill the cache on the device instead)."""
    gen = torch.Generator().manual_seed(seed)
    hv = head_size_v if head_size_v is not None else head_size
    spec_kw = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=hv,
        dtype=dtype,
    )
    spec = (
        SlidingWindowSpec(sliding_window=sliding_window, **spec_kw)  # type: ignore[arg-type]
        if sliding_window is not None
        else FullAttentionSpec(**spec_kw)  # type: ignore[arg-type]
    )
    kbs = kernel_block_size or block_size
    k = block_size // kbs
    need = sum(-(-s // block_size) for s in seq_lens)
    nb = num_blocks if num_blocks is not None else need + 3
    if nb < need:
        raise ValueError(f"num_blocks={nb} < {need} blocks the batch needs")
    layout = KVCacheLayout.from_spec(spec, num_blocks=nb, num_layers=num_layers, order=order)
    config = AttentionConfig.from_spec(
        spec,
        num_q_heads=num_q_heads,
        has_sinks=has_sinks,
        softcap=softcap,
        use_alibi=use_alibi,
        layout_order=order,
        kernel_block_size=kbs,
    )
    storage = allocate_kv_cache(layout, device)
    kv_cache = layer_view(storage, layout, layer)
    tdt = to_torch_dtype(dtype)
    perm = list(blocks) if blocks is not None else torch.randperm(nb, generator=gen).tolist()
    max_blocks = max((-(-s // block_size) for s in seq_lens), default=0)
    rows, slots = [], []
    cursor = 0
    for s in seq_lens:
        mblocks = perm[cursor : cursor + -(-s // block_size)]
        cursor += len(mblocks)
        # Manager block b is kernel blocks b*k .. b*k + k-1.
        kblocks = [b * k + i for b in mblocks for i in range(k)]
        kblocks += [0] * (max_blocks * k - len(kblocks))  # padding entries must be ignored
        rows.append(kblocks)
        slots += [kblocks[p // kbs] * kbs + p % kbs for p in range(s)]
    all_slots = torch.tensor(slots, dtype=torch.int64)
    t_ctx = len(slots)
    n_kv = t_ctx if make_kv else 0
    key = torch.randn(n_kv, num_kv_heads, head_size, generator=gen).to(tdt)
    value = torch.randn(n_kv, num_kv_heads, hv, generator=gen).to(tdt)
    if fill and n_kv:
        blk, off = (all_slots // block_size).to(device), (all_slots % block_size).to(device)
        kv_cache[blk, :, off, :head_size] = key.to(device)
        kv_cache[blk, :, off, head_size : head_size + hv] = value.to(device)
    common = CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=torch.tensor(rows, dtype=torch.int32).reshape(len(seq_lens), max_blocks * k),
        block_size=kbs,
        device=device,
        pad_tokens_to=sum(query_lens) + pad_tokens,
    )
    q = torch.randn(sum(query_lens) + pad_tokens, num_q_heads, head_size, generator=gen).to(tdt)
    sinks = torch.randn(num_q_heads, generator=gen) if has_sinks else None
    slopes = torch.rand(num_q_heads, generator=gen) * 0.5 if use_alibi else None
    return PagedBatch(
        config=config,
        layout=layout,
        storage=storage,
        kv_cache=kv_cache,
        common=common,
        q=q.to(device),
        key=key.to(device),
        value=value.to(device),
        all_slots=all_slots.to(device),
        sinks=None if sinks is None else sinks.to(device),
        alibi_slopes=None if slopes is None else slopes.to(device),
    )


def oracle_attention(b: PagedBatch, *, scale: float | None = None) -> torch.Tensor:
    """float64 attention from ``b.key`` / ``b.value`` (the tokens as written), per request and
    head with explicit masks: the obviously-correct answer every backend is held to."""
    cfg = b.config
    scale = scale if scale is not None else cfg.head_size**-0.5
    qsl = b.common.host_query_start_loc().tolist()
    seq_lens = b.common.host_seq_lens().tolist()
    out = torch.zeros(b.q.shape[0], cfg.num_q_heads, cfg.head_size_v, dtype=torch.float64)
    group = cfg.num_q_heads // cfg.num_kv_heads
    q = b.q.double().cpu()
    sinks = None if b.sinks is None else b.sinks.double().cpu()
    slopes = None if b.alibi_slopes is None else b.alibi_slopes.double().cpu()
    ctx = 0
    for r, s in enumerate(seq_lens):
        k = b.key[ctx : ctx + s].double().cpu()  # [S, H, D]
        v = b.value[ctx : ctx + s].double().cpu()  # [S, H, Dv]
        ctx += s
        for i in range(qsl[r], qsl[r + 1]):
            pos = s - (qsl[r + 1] - qsl[r]) + (i - qsl[r])
            for h in range(cfg.num_q_heads):
                kv = h // group
                logits = (k[:, kv] @ q[i, h]) * scale  # [S]
                if cfg.softcap:
                    logits = cfg.softcap * torch.tanh(logits / cfg.softcap)
                kv_pos = torch.arange(s, dtype=torch.float64)
                if slopes is not None:
                    logits = logits + slopes[h] * (kv_pos - pos)
                ok = torch.ones(s, dtype=torch.bool)
                if cfg.causal:
                    ok &= kv_pos <= pos
                    if cfg.sliding_window is not None:
                        ok &= kv_pos > pos - cfg.sliding_window
                logits = logits.masked_fill(~ok, float("-inf"))
                m = logits.max()
                if sinks is not None:
                    m = torch.maximum(m, sinks[h])
                w = torch.exp(logits - m)
                denom = w.sum() + (torch.exp(sinks[h] - m) if sinks is not None else 0.0)
                out[i, h] = (w[:, None] * v[:, kv]).sum(0) / denom
    return out


def run_backend(
    name: str,
    b: PagedBatch,
    *,
    impl_options: dict[str, Any] | None = None,
    builder_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Build metadata and an impl for ``b`` and return ``forward``'s output."""
    backend = get_backend(name)
    impl = backend.make_impl(
        b.config, b.layout, sinks=b.sinks, alibi_slopes=b.alibi_slopes, **(impl_options or {})
    )
    builder = backend.make_builder(b.config, b.layout, device=b.q.device, **(builder_options or {}))
    md = builder.build(b.common)
    return impl.forward(None, b.q, b.kv_cache, md)
