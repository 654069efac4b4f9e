"""Random paged batches for tests and benchmarks (not used by the backends themselves)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kv_kernels import allocate_kv_cache, layer_view
from kv_spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheLayout,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
    to_torch_dtype,
)

from kv_backends.base import AttentionBackend, AttentionImpl
from kv_backends.config import AttentionConfig
from kv_backends.metadata import CommonAttentionMetadata
from kv_backends.registry import get_backend

__all__ = [
    "PagedBatch",
    "fresh_dynamo_for_gpu_test",
    "lowprec_reference",
    "make_batch_impl",
    "make_latent_batch",
    "make_paged_batch",
    "oracle_attention",
    "run_backend",
]


@dataclass
class PagedBatch:
    """A filled cache, a batch over it and the inputs of one layer (layer slot 0)."""

    config: AttentionConfig
    layout: KVCacheLayout
    storage: object
    kv_cache: torch.Tensor  # [B, H, N, C] layer view of slot ``layer``
    common: CommonAttentionMetadata
    q: torch.Tensor  # [T_padded, Hq, D]
    key: torch.Tensor  # [T_ctx, H, D] every context token as the cache holds it (dequantized)
    value: torch.Tensor  # [T_ctx, H, Dv]
    all_slots: torch.Tensor  # [T_ctx] int64 slots of key/value
    sinks: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    k_scale: float | None = None  # fp8 per-tensor scales (the cache stores x / scale)
    v_scale: float | None = None

    def request_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per request, its context K ``[S_r, H, D]`` and V ``[S_r, H, Dv]`` (views)."""
        ks, vs, ctx = [], [], 0
        for s in self.common.host_seq_lens().tolist():
            ks.append(self.key[ctx : ctx + s])
            vs.append(self.value[ctx : ctx + s])
            ctx += s
        return ks, vs


def _spec(
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    cache_dtype: str,
    kv_quant: str,
    sliding_window: int | None,
) -> AttentionSpec:
    spec_kw: dict[str, Any] = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=cache_dtype,
        kv_quant=kv_quant,
    )
    if sliding_window is not None:
        return SlidingWindowSpec(sliding_window=sliding_window, **spec_kw)
    return FullAttentionSpec(**spec_kw)


def _block_rows(
    seq_lens: Sequence[int], perm: Sequence[int], block_size: int, kbs: int
) -> tuple[list[list[int]], list[int], int]:
    """Kernel-block rows of each request (manager block b is kernel blocks b*k .. b*k + k-1,
    rows padded with 0, which every backend must ignore) and the slot of every context token."""
    k = block_size // kbs
    max_blocks = max((-(-s // block_size) for s in seq_lens), default=0)
    rows, slots, cursor = [], [], 0
    for s in seq_lens:
        mblocks = perm[cursor : cursor + -(-s // block_size)]
        cursor += len(mblocks)
        kblocks = [b * k + i for b in mblocks for i in range(k)]
        kblocks += [0] * (max_blocks * k - len(kblocks))
        rows.append(kblocks)
        slots += [kblocks[p // kbs] * kbs + p % kbs for p in range(s)]
    return rows, slots, max_blocks * k


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
    kv_cache_dtype: str | None = None,
    kv_quant: str | None = None,
    k_scale: float = 0.5,
    v_scale: float = 0.25,
    sliding_window: int | None = None,
    causal: bool = True,
    has_sinks: bool = False,
    softcap: float = 0.0,
    use_alibi: bool = False,
    batch_invariant: bool = False,
    pad_tokens: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
    fill: bool = True,
    blocks: Sequence[int] | None = None,
    make_kv: bool = True,
    scale_plane: bool = False,
) -> PagedBatch:
    """Allocate a cache, give each request shuffled (non-contiguous) blocks, and fill every
    context slot with random K/V (written straight into the layer view by torch indexing, so the
    fill does not depend on any backend). Kernel block ids go in the block table. ``blocks``
    gives the manager blocks to hand out, in order (default: a random permutation).
    ``make_kv=False`` skips drawing K/V (benchmarks fill the cache on the device instead).

    ``kv_cache_dtype`` (default ``dtype``) may be an fp8 dtype; then ``kv_quant`` defaults to
    ``"fp8_per_tensor"``, the cache stores ``x / scale`` and ``key``/``value`` hold what a reader
    gets back (``stored * scale``), so the oracle sees exactly the cache's values."""
    gen = torch.Generator().manual_seed(seed)
    hv = head_size_v if head_size_v is not None else head_size
    cache_dtype = kv_cache_dtype or dtype
    quant = kv_quant or ("fp8_per_tensor" if cache_dtype.startswith("fp8") else "none")
    spec = _spec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=hv,
        cache_dtype=cache_dtype,
        kv_quant=quant,
        sliding_window=sliding_window,
    )
    kbs = kernel_block_size or block_size
    need = sum(-(-s // block_size) for s in seq_lens)
    nb = num_blocks if num_blocks is not None else need + 3
    if nb < need:
        raise ValueError(f"num_blocks={nb} < {need} blocks the batch needs")
    layout = KVCacheLayout.from_spec(
        spec, num_blocks=nb, num_layers=num_layers, order=order, scale_plane=scale_plane
    )
    config = dataclasses.replace(
        AttentionConfig.from_spec(
            spec,
            num_q_heads=num_q_heads,
            dtype=dtype,
            has_sinks=has_sinks,
            softcap=softcap,
            use_alibi=use_alibi,
            layout_order=order,
            kernel_block_size=kbs,
            batch_invariant=batch_invariant,
        ),
        causal=causal,
    )
    storage = allocate_kv_cache(layout, device)
    kv_cache = layer_view(storage, layout, layer)
    tdt = to_torch_dtype(dtype)
    perm = list(blocks) if blocks is not None else torch.randperm(nb, generator=gen).tolist()
    rows, slots, width = _block_rows(seq_lens, perm, block_size, kbs)
    all_slots = torch.tensor(slots, dtype=torch.int64)
    n_kv = len(slots) if make_kv else 0
    key = torch.randn(n_kv, num_kv_heads, head_size, generator=gen).to(tdt)
    value = torch.randn(n_kv, num_kv_heads, hv, generator=gen).to(tdt)
    scales = (k_scale, v_scale) if quant == "fp8_per_tensor" else (None, None)
    key, value = _fill(kv_cache, all_slots, key, value, scales, block_size, fill=fill and n_kv > 0)
    common = _common(query_lens, seq_lens, rows, width, kbs, device, pad_tokens)
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
        k_scale=scales[0],
        v_scale=scales[1],
    )


def make_latent_batch(
    *,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_q_heads: int = 4,
    kv_lora_rank: int = 32,
    rope: int = 16,
    block_size: int = 16,
    kernel_block_size: int | None = None,
    num_layers: int = 1,
    layer: int = 0,
    order: str = "LBNHC",
    dtype: str = "float32",
    kv_cache_dtype: str | None = None,
    k_scale: float = 0.5,
    pad_tokens: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """An MLA batch: a latent cache (``MLAAttentionSpec``, one ``kv_lora_rank + rope`` row per
    token, shuffled blocks, written straight into the layer view by torch indexing) and absorbed
    queries ``[T, Hq, kv_lora_rank + rope]``. ``key`` holds each context token's latent row
    ``[T_ctx, 1, kv_lora_rank + rope]`` and ``value`` a view of its first ``kv_lora_rank``
    columns, so :func:`oracle_attention` is the absorbed attention an MLA backend must return
    (``[T, Hq, kv_lora_rank]``). The config's ``mla`` is set; backends take their default
    ``kv_lora_rank`` (the row's largest power of two below it: pass ``rope`` accordingly).

    ``kv_cache_dtype`` (default ``dtype``) may be an fp8 dtype: an ``fp8_per_tensor`` latent
    stored as ``latent / k_scale``, ``k_scale`` its one scale (``v_scale`` stays ``None``), and
    ``key`` what a reader gets back (``stored * k_scale``, float32)."""
    gen = torch.Generator().manual_seed(seed)
    width = kv_lora_rank + rope
    cache_dtype = kv_cache_dtype or dtype
    fp8 = cache_dtype.startswith("fp8")
    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=width, dtype=cache_dtype,
        kv_quant=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE,
    )  # fmt: skip
    kbs = kernel_block_size or block_size
    nb = sum(-(-s // block_size) for s in seq_lens) + 3
    layout = KVCacheLayout.from_spec(spec, num_blocks=nb, num_layers=num_layers, order=order)
    config = AttentionConfig.from_spec(
        spec, num_q_heads=num_q_heads, dtype=dtype, layout_order=order, kernel_block_size=kbs
    )
    storage = allocate_kv_cache(layout, device)
    kv_cache = layer_view(storage, layout, layer)
    tdt = to_torch_dtype(dtype)
    perm = torch.randperm(nb, generator=gen).tolist()
    rows, slots, cols = _block_rows(seq_lens, perm, block_size, kbs)
    all_slots = torch.tensor(slots, dtype=torch.int64)
    latent = torch.randn(len(slots), 1, width, generator=gen).to(tdt)  # [T_ctx, 1, width]
    stored = latent
    if fp8:  # what the cache holds (x / k_scale in fp8) and what a reader gets back from it
        stored = (latent.float() / k_scale).to(kv_cache.dtype)
        latent = stored.float() * k_scale
    dev = kv_cache.device
    blk, off = (all_slots // block_size).to(dev), (all_slots % block_size).to(dev)
    kv_cache[blk, :, off, :] = stored.to(dev)
    common = _common(query_lens, seq_lens, rows, cols, kbs, device, pad_tokens)
    q = torch.randn(sum(query_lens) + pad_tokens, num_q_heads, width, generator=gen).to(tdt)
    key = latent.to(device)
    return PagedBatch(
        config=config,
        layout=layout,
        storage=storage,
        kv_cache=kv_cache,
        common=common,
        q=q.to(device),
        key=key,
        value=key[..., :kv_lora_rank],
        all_slots=all_slots.to(device),
        sinks=None,
        alibi_slopes=None,
        k_scale=k_scale if fp8 else None,
    )


def _common(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    rows: list[list[int]],
    width: int,
    kernel_block_size: int,
    device: str | torch.device,
    pad_tokens: int,
) -> CommonAttentionMetadata:
    """The batch's metadata: its block-table ``rows`` as ``[num_seqs, width]`` int32."""
    return CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=torch.tensor(rows, dtype=torch.int32).reshape(len(seq_lens), width),
        block_size=kernel_block_size,
        device=device,
        pad_tokens_to=sum(query_lens) + pad_tokens,
    )


def _fill(
    kv_cache: torch.Tensor,  # [B, H, N, C]
    all_slots: torch.Tensor,  # [T_ctx] int64
    key: torch.Tensor,  # [T_ctx, H, D]
    value: torch.Tensor,  # [T_ctx, H, Dv]
    scales: tuple[float | None, float | None],
    block_size: int,
    *,
    fill: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write K/V into their slots (``x / scale`` cast to the cache dtype); return what the cache
    now holds, read back as the compute dtype (``stored * scale``)."""
    d = key.shape[-1]
    k_st, v_st = key.float(), value.float()
    if scales[0] is not None and scales[1] is not None:
        k_st, v_st = k_st / scales[0], v_st / scales[1]
    k_st, v_st = k_st.to(kv_cache.dtype), v_st.to(kv_cache.dtype)
    if fill:
        dev = kv_cache.device
        blk, off = (all_slots // block_size).to(dev), (all_slots % block_size).to(dev)
        kv_cache[blk, :, off, :d] = k_st.to(dev)
        kv_cache[blk, :, off, d : d + value.shape[-1]] = v_st.to(dev)
    k_back, v_back = k_st.float(), v_st.float()
    if scales[0] is not None and scales[1] is not None:
        k_back, v_back = k_back * scales[0], v_back * scales[1]
    # float32 when the cache is narrower than the compute dtype: the oracle upcasts anyway.
    out_dt = key.dtype if kv_cache.dtype == key.dtype else torch.float32
    return k_back.to(out_dt), v_back.to(out_dt)


def _reference_call(b: PagedBatch, scale: float | None) -> tuple[Any, ...]:
    """``(q, ks, vs, q_lens, options)`` for kv-kernels' references over ``b``'s dense K/V."""
    cfg = b.config
    ks, vs = b.request_kv()
    qsl = b.common.host_query_start_loc().tolist()
    options = dict(
        scale=scale if scale is not None else cfg.head_size**-0.5,
        causal=cfg.causal,
        sliding_window=cfg.sliding_window,
        sinks=b.sinks,
        softcap=cfg.softcap,
        alibi_slopes=b.alibi_slopes,
    )
    return b.q, ks, vs, [qsl[r + 1] - qsl[r] for r in range(len(ks))], options


def oracle_attention(b: PagedBatch, *, scale: float | None = None) -> torch.Tensor:
    """float64 attention from ``b.key`` / ``b.value`` (the tokens as written): kv-kernels' one
    oracle (:func:`kv_kernels.testing.attention_oracle`, docs/attention_semantics.md), fed the
    dense per-request K/V so it cannot share a paging bug with any backend. ``[T, Hq, Dv]``."""
    from kv_kernels.testing import attention_oracle

    q, ks, vs, q_lens, options = _reference_call(b, scale)
    out, _ = attention_oracle(q, ks, vs, q_lens, **options)
    return out


def lowprec_reference(b: PagedBatch, *, scale: float | None = None) -> torch.Tensor:
    """The same attention in plain torch at the batch's compute dtype (logits, softmax and P@V
    rounded to it; kv-kernels' :func:`~kv_kernels.testing.attention_lowprec`): ``err_lowprec``
    of the flash-attention parity rule (``err_backend <= rtol * err_lowprec + atol *
    max|oracle_row|``, kv-kernels' ``check_close_to_oracle``). For bf16/fp16 on the GPU, where a
    kernel legitimately rounds P to the input dtype. ``[T, Hq, Dv]`` on ``b.q``'s device, padding
    rows zero."""
    from kv_kernels.testing import attention_lowprec

    q, ks, vs, q_lens, options = _reference_call(b, scale)
    return attention_lowprec(q, ks, vs, q_lens, **options)


def make_batch_impl(
    backend: type[AttentionBackend], b: PagedBatch, **options: Any
) -> AttentionImpl:
    """``backend``'s impl for ``b``'s layer: its config and layout, with its sinks, ALiBi slopes
    and KV scales; ``options``: further impl options (e.g. ``device``)."""
    return backend.make_impl(
        b.config,
        b.layout,
        sinks=b.sinks,
        alibi_slopes=b.alibi_slopes,
        k_scale=b.k_scale,
        v_scale=b.v_scale,
        **options,
    )


def run_backend(
    name: str,
    b: PagedBatch,
    *,
    impl_options: dict[str, Any] | None = None,
    builder_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Build metadata and an impl for ``b`` and return ``forward``'s output."""
    backend = get_backend(name)
    impl = make_batch_impl(backend, b, **(impl_options or {}))
    builder = backend.make_builder(b.config, b.layout, device=b.q.device, **(builder_options or {}))
    md = builder.build(b.common)
    return impl.forward(None, b.q, b.kv_cache, md)


def fresh_dynamo_for_gpu_test(node: Any) -> None:
    """Reset Dynamo before a test marked ``gpu`` (``node``: pytest's ``request.node``); the body
    of the autouse ``_fresh_dynamo_for_gpu_tests`` fixture of kv-backends' and kvstack's tests.

    GPU tests compile Flex for many tile/shape parametrizations in one process: each static
    graph counts against Dynamo's per-code-object recompile limit (64 inside our calls), which a
    whole test session passes although no single model or serving loop does. Start each GPU test
    from an empty Dynamo cache so a test's verdict does not depend on how many ran before it."""
    if node.get_closest_marker("gpu") is not None:
        torch._dynamo.reset()
