"""Launchers of the unified Triton paged-attention kernel (prefill, chunked prefill and decode in
one batch) and of the attention-state merges: checks, grids and the choice of constexprs.

The ``@triton.jit`` bodies are in :mod:`._kernels` (their docstring explains the work split),
the tile tables in :mod:`._tiles`, the ahead-of-time specs in :mod:`._aot`; this module re-exports
the public names of all three so ``kv_kernels.paged_attention.triton`` stays the one import.

Two launches, one per query-length class. Sequences with ``q_len <= BLOCK_Q(decode)`` (decode,
short speculative steps) run with a small-M "decode" config, one program per sequence (no search);
longer ones run with a large-M "prefill" config whose programs find their sequence by a binary
search over ``query_start_loc``. The class of a sequence depends only on its own ``q_len``, so a
sequence is computed by the same tile shapes whatever else is in the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from kv_kernels._common import row_align, tma_addressable
from kv_kernels.paged_attention._aot import AotSpec, aot_specs
from kv_kernels.paged_attention._kernels import paged_attention_kernel
from kv_kernels.paged_attention._merge import merge_splits_kernel, merge_two_kernel
from kv_kernels.paged_attention._tiles import (
    AttentionConfig,
    _device_info,
    arch_and_sms,
    kernel_constexprs,
    pick_num_splits,
    pow2,
    select_config,
)

__all__ = [
    "AotSpec",
    "AttentionConfig",
    "aot_specs",
    "merge_attn_states_triton",
    "paged_attention_triton",
    "pick_num_splits",
    "select_config",
]


def _check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and type(paged_attention_kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            "kv_kernels.paged_attention.triton was imported without TRITON_INTERPRET=1, so its kernels "
            "cannot run on CPU tensors; set TRITON_INTERPRET=1 before the first import"
        )


def _scale_args(
    k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None, q: torch.Tensor
) -> tuple[int, tuple[Any, ...]]:
    """fp8 dequant scales as kernel arguments: ``(mode, (k_ptr, v_ptr, k_stride, v_stride, k_val,
    v_val))``. Two floats ride as scalars (mode 1); if either is a tensor (per tensor or per kv
    head) both are read from memory (mode 2; a float partner becomes a 1-element tensor)."""
    if k_scale is None:
        return 0, (q, q, 0, 0, 1.0, 1.0)
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        ks, vs = (
            x
            if isinstance(x, torch.Tensor)
            else torch.full((1,), float(x), dtype=torch.float32, device=q.device)  # type: ignore[arg-type]
            for x in (k_scale, v_scale)
        )
        return 2, (ks, vs, 0 if ks.numel() == 1 else 1, 0 if vs.numel() == 1 else 1, 1.0, 1.0)
    return 1, (q, q, 0, 0, float(k_scale), float(v_scale))  # type: ignore[arg-type]


def _configs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    head_size_v: int,
    block_size: int,
    v_from_k: bool,
    inline_scales: bool = False,
):
    arch, num_sms = arch_and_sms(q.device)
    group = q.shape[1] // kv_cache.shape[1]
    shape: dict[str, Any] = dict(
        head_size=q.shape[2],
        head_size_v=head_size_v,
        group=group,
        block_size=block_size,
        elem_bytes=kv_cache.element_size(),
        arch=arch,
        v_from_k=v_from_k,
        inline_scales=inline_scales,
    )
    key = (select_config, *shape.values())
    kept = _CONFIGS.get(key)
    if kept is None:
        kept = select_config("decode", **shape), select_config("prefill", **shape)
        if len(_CONFIGS) >= 256:  # (sweeps patch select_config with a new function per config)
            _CONFIGS.clear()
        _CONFIGS[key] = kept
    return (*kept, num_sms)


# Launch-time memo of two pure functions of static properties, the launcher's largest host cost
# after Triton's own launch (H100 machine, cProfile: select_config twice and kernel_constexprs per
# call). Keyed by the function too, so a test or sweep that patches select_config /
# kernel_constexprs in this module is seen.
_CONFIGS: dict[tuple[Any, ...], tuple[AttentionConfig, AttentionConfig]] = {}
_CONSTEXPRS: dict[tuple[Any, ...], dict[str, Any]] = {}


def _constexprs(cfg: AttentionConfig, kind: str, **features: Any) -> dict[str, Any]:
    """:func:`kernel_constexprs` of ``cfg`` (memoized, see above)."""
    key = (kernel_constexprs, cfg, kind, *features.items())
    kept = _CONSTEXPRS.get(key)
    if kept is None:
        kept = kernel_constexprs(cfg, kind=kind, **features)
        if len(_CONSTEXPRS) >= 256:
            _CONSTEXPRS.clear()
        _CONSTEXPRS[key] = kept
    return kept


def _inline_scale_args(
    kv_cache: torch.Tensor, rows: tuple[int, int, int] | None
) -> tuple[torch.Tensor, int, int, bool]:
    """``(kvs, k_idx, v_idx, words)``: the cache seen as float32 words when every stride and the
    scale offset allow it (one 4-byte load per scale), else as bytes (the scale assembled from
    its 4 bytes: it may sit at any byte offset). Per-token-head caches are 1-byte dtypes, so
    element offsets are byte offsets. ``rows``: ``KVCacheLayout.scale_geometry``."""
    if rows is None:
        return kv_cache, 0, 0, False
    scale_start, head_stride, token_stride = rows
    raw = kv_cache.view(torch.uint8)
    # the whole storage as bytes, so a float32 view of it covers every layer slot the view spans
    flat = torch.empty(0, dtype=torch.uint8, device=raw.device).set_(raw.untyped_storage())
    aligned = (
        raw.stride(3) == 1
        and all(st % 4 == 0 for st in (raw.stride(0), head_stride, token_stride))
        and scale_start % 4 == 0
        and raw.storage_offset() % 4 == 0
        and flat.numel() % 4 == 0
    )
    if aligned:
        # word offsets are the byte offsets / 4 (the kernel divides; all are multiples of 4)
        words = flat.view(torch.float32)[raw.storage_offset() // 4 :]
        return words, scale_start // 4, scale_start // 4 + 1, True
    return raw, scale_start, scale_start + 4, False


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [B, H, N, C]
    *,
    k_range: tuple[int, int],
    v_range: tuple[int, int],
    block_table: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [Hq] f32
    softcap: float,
    alibi_slopes: torch.Tensor | None,  # [Hq] f32
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    return_lse: bool,
    out: torch.Tensor,  # [T, Hq, Dv]
    max_query_len: int,
    max_seq_len: int | None,
    block_size: int,
    num_splits: int | None,
    error_flag: torch.Tensor | None = None,  # [1] int32, counts invalid metadata
    # per-token-head scales, inline or in a plane: KVCacheLayout.scale_geometry (bytes)
    scale_rows: tuple[int, int, int] | None = None,
    v_from_k: bool = False,  # MLA: V is the first head_size_v columns of K (one latent)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch the unified kernel (and the split merge); inputs validated by the api."""
    _check_runnable(q.device)
    num_tokens, num_q_heads, head_size = q.shape
    num_blocks, num_kv_heads = kv_cache.shape[0], kv_cache.shape[1]
    head_size_v = v_range[1] - v_range[0]
    lse: torch.Tensor | None = None
    if return_lse:
        lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    num_seqs = block_table.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return (out, lse) if lse is not None else out
    cfg_dec, cfg_pre, num_sms = _configs(
        q,
        kv_cache,
        head_size_v,
        block_size,
        v_from_k,
        inline_scales=scale_rows is not None,
    )
    group = num_q_heads // num_kv_heads
    # (a hand-made config may leave heads_per_program at 0: the whole group, as kernel_constexprs)
    chunks_dec = -(-group // (cfg_dec.heads_per_program or group))
    chunks_pre = -(-group // (cfg_pre.heads_per_program or group))
    run_prefill = max_query_len > cfg_dec.block_q
    kv_scale_mode, scale_args = _scale_args(k_scale, v_scale, q)
    kvs, ks_idx, vs_idx, scale_words = _inline_scale_args(kv_cache, scale_rows)
    if scale_rows is not None:
        kv_scale_mode = 3
    lse_t = lse if lse is not None else out
    features = dict(
        head_size=head_size,
        head_size_v=head_size_v,
        block_size=block_size,
        group=num_q_heads // num_kv_heads,
        causal=causal,
        sliding_window=sliding_window is not None,
        sinks=sinks is not None,
        softcap=softcap > 0,
        alibi=alibi_slopes is not None,
        kv_scale_mode=kv_scale_mode,
        split=False,  # (set below, once the split count is known)
        write_lse=return_lse,
        dot_ieee=q.dtype == torch.float32,
        check=error_flag is not None,
        v_from_k=v_from_k,
        scale_words=scale_words,
        # (scales off the rows' own strides: in each page's plane)
        scale_plane=scale_rows is not None
        and scale_rows[1:] != (kv_cache.stride(1), kv_cache.stride(2)),
        row_align=row_align(kv_cache.stride()[:3]),
        kv_bytes=kv_cache.element_size(),
        ptx=type(paged_attention_kernel).__name__ != "InterpretedFunction",
        k_start=k_range[0],
        v_start=v_range[0],
    )
    # sm_90, fp8 pages, no special features: the decode class runs the Gluon decode kernel (see
    # _sm90_decode; with KV_KERNELS_SM90_DECODE=0 the Triton kernel does)
    gluon_decode = _gluon_serves(
        "decode", q, kv_cache, head_size_v, scale, features, (out, block_table),
        block_q=cfg_dec.block_q,
    )  # fmt: skip
    # sm_90, MLA's 16-bit latent at 64 / 128 heads: the decode class runs the Gluon MLA kernel
    # (see _sm90_mla; with KV_KERNELS_SM90_MLA=0 the Triton kernel does)
    gluon_mla = v_from_k and _gluon_serves(
        "mla", q, kv_cache, head_size_v, scale, features, (out, block_table),
        block_q=cfg_dec.block_q,
    )  # fmt: skip
    if num_splits is None:
        # prefill tiles fill the GPU on their own; decode splits KV to fill it
        bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
        if run_prefill:
            num_splits = 1
        elif gluon_decode:
            from kv_kernels.paged_attention._sm90_decode import pick_decode_splits

            num_splits = pick_decode_splits(
                num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_seq_len=bound, num_sms=num_sms
            )
        elif gluon_mla:
            from kv_kernels.paged_attention._sm90_mla import ROWS, pick_mla_splits

            num_splits = pick_mla_splits(
                num_seqs=num_seqs,
                head_blocks=num_q_heads // ROWS.value,
                max_seq_len=bound,
                num_sms=num_sms,
            )
        else:
            num_splits = pick_num_splits(
                num_seqs=num_seqs, num_kv_heads=num_kv_heads * chunks_dec, max_seq_len=bound,
                tile_n=cfg_dec.tile_n, num_sms=num_sms, waves=cfg_dec.waves,
                programs_per_sm=cfg_dec.programs_per_sm,
            )  # fmt: skip
    split = num_splits > 1
    features["split"] = split
    dv_pad = pow2(head_size_v)
    part_out, part_lse = _split_buffers(out, num_splits, dv_pad)
    # sm_90, 16-bit pages, no special features: the prefill class runs the warp-specialized
    # Gluon kernel (see _sm90_prefill; with KV_KERNELS_SM90_PREFILL=0 the Triton kernel does)
    gluon_prefill = run_prefill and _gluon_serves(
        "prefill", q, kv_cache, head_size_v, scale, features, (out, block_table)
    )
    descs = None
    if run_prefill and not gluon_prefill:
        descs = _tma_descriptors(kv_cache, k_range, v_range, cfg_pre)
    head_args = (q, *q.stride(), kv_cache, *kv_cache.stride(), kvs)
    args = (
        block_table, *block_table.stride(), seq_lens, query_start_loc,
        sinks if sinks is not None else q, alibi_slopes if alibi_slopes is not None else q,
        *scale_args, out, *out.stride(), lse_t, lse_t.stride(0), lse_t.stride(1),
        part_out, part_lse, error_flag if error_flag is not None else seq_lens,
        num_seqs, num_q_heads, num_blocks, block_table.shape[1],
        ks_idx, vs_idx, *(scale_rows[1:] if scale_rows else (0, 0)),
        scale, float(softcap), int(sliding_window or 0),
    )  # fmt: skip
    # decode class: q_len in [1, block_q(decode)], one program per sequence
    if gluon_decode:
        from kv_kernels.paged_attention._sm90_decode import launch_sm90_decode

        launch_sm90_decode(
            q, kv_cache, k_start=k_range[0], v_start=v_range[0], block_table=block_table,
            seq_lens=seq_lens, query_start_loc=query_start_loc, scale=scale, causal=causal,
            block_size=block_size, kv_scale_mode=kv_scale_mode, scale_args=scale_args,
            scale_rows=scale_rows, row_align=features["row_align"], out=out, lse=lse,
            part_out=part_out, part_lse=part_lse, num_splits=num_splits,
        )  # fmt: skip
    elif gluon_mla:
        from kv_kernels.paged_attention._sm90_mla import launch_sm90_mla

        launch_sm90_mla(
            q, kv_cache, block_table=block_table, seq_lens=seq_lens,
            query_start_loc=query_start_loc, scale=scale, block_size=block_size, out=out,
            lse=lse, part_out=part_out, part_lse=part_lse, num_splits=num_splits,
        )  # fmt: skip
    else:
        paged_attention_kernel[(num_seqs, num_kv_heads * chunks_dec, num_splits)](
            *head_args,
            q,  # no TMA descriptors in decode: its tiles are gathered
            q,
            *args,
            1,
            cfg_dec.block_q,
            **_constexprs(cfg_dec, "decode", **features),
            num_warps=cfg_dec.num_warps,
            num_stages=cfg_dec.num_stages,
            **_reg_cap(cfg_dec),
        )
    if gluon_prefill:
        from kv_kernels.paged_attention._sm90_prefill import launch_sm90_prefill

        launch_sm90_prefill(
            q, kv_cache, k_start=k_range[0], v_start=v_range[0], block_table=block_table,
            seq_lens=seq_lens, query_start_loc=query_start_loc, scale=scale, causal=causal,
            block_size=block_size, out=out, lse=lse, q_len_min=cfg_dec.block_q + 1,
        )  # fmt: skip
    elif run_prefill:
        grid_q = num_tokens // cfg_pre.block_q + num_seqs
        paged_attention_kernel[(grid_q, num_kv_heads * chunks_pre, num_splits)](
            *head_args,
            *(descs or (q, q)),
            *args,
            cfg_dec.block_q + 1,
            2**31 - 1,
            **_constexprs(cfg_pre, "prefill", tma=descs is not None, **features),
            num_warps=cfg_pre.num_warps,
            num_stages=cfg_pre.num_stages,
            **_reg_cap(cfg_pre),
        )
    if split:
        _merge_splits(part_out, part_lse, out, lse_t, sinks, query_start_loc, return_lse)
    return (out, lse) if lse is not None else out


def _gluon_serves(
    kind: str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    head_size_v: int,
    scale: float,
    features: dict[str, Any],
    others: tuple[torch.Tensor, ...] = (),
    **extra: Any,
) -> bool:
    """Whether the sm_90 Gluon ``kind`` kernel ("prefill" / "decode" / "mla") serves this
    launch's class (the rules: :func:`._sm90_prefill.sm90_prefill_eligible`,
    :func:`._sm90_decode.sm90_decode_eligible`, :func:`._sm90_mla.sm90_mla_eligible`);
    ``others``: the output and the block table, whose last dimensions it reads with unit stride
    too; ``extra``: the rule's own arguments (decode, mla: ``block_q``)."""
    if q.device.type != "cuda":
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    eligible: Any
    if kind == "prefill":
        from kv_kernels.paged_attention._sm90_prefill import sm90_prefill_eligible as eligible
    elif kind == "mla":
        from kv_kernels.paged_attention._sm90_mla import sm90_mla_eligible as eligible
    else:
        from kv_kernels.paged_attention._sm90_decode import peak_memory_tbps
        from kv_kernels.paged_attention._sm90_decode import sm90_decode_eligible as eligible

        extra["peak_tbps"] = peak_memory_tbps(index)
    return bool(
        eligible(
            # the device's own arch: arch_and_sms maps later chips to 90 for the tile tables
            arch=_device_info(index)[0],
            q_dtype=q.dtype,
            cache_dtype=kv_cache.dtype,
            head_size=q.shape[2],
            head_size_v=head_size_v,
            group=q.shape[1] // kv_cache.shape[1],
            scale=scale,
            compiled=features["ptx"],
            features=features,
            aligned_rows=kv_cache.data_ptr() % 16 == 0
            and all(t.stride(-1) == 1 for t in (q, kv_cache, *others)),
            **extra,
        )
    )


def _tma_descriptors(
    kv_cache: torch.Tensor, k_range: tuple[int, int], v_range: tuple[int, int], cfg: AttentionConfig
) -> tuple[Any, Any] | None:
    """TMA descriptors of K and V over the layer viewed as ``[B, N, H, C]`` (boxes of one tile of
    one head) when ``cfg.tma`` and the copy engine can address the cache: unit column stride,
    16-byte aligned strides and bases. ``None`` otherwise: the kernel gathers by pointers (same
    results, bit for bit; only the copy mechanism differs)."""
    if not cfg.tma:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    bnhc = kv_cache.permute(0, 2, 1, 3)
    descs = []
    for lo, hi in (k_range, v_range):
        part = bnhc[..., lo:hi]
        if not tma_addressable(part):
            return None
        descs.append(
            TensorDescriptor(
                part, list(part.shape), list(part.stride()), [1, cfg.tile_n, 1, hi - lo]
            )
        )
    return descs[0], descs[1]


def _reg_cap(cfg: AttentionConfig) -> dict[str, int]:
    """``maxnreg`` for a config that caps registers (a launch option Triton passes to ptxas)."""
    return {"maxnreg": cfg.max_registers} if cfg.max_registers else {}


def _split_buffers(
    out: torch.Tensor, num_splits: int, dv_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs ``[T, Hq, S, DV_PAD]`` and LSEs ``[T, Hq, S]`` (f32) of a split launch;
    without splits the kernel never touches them and ``out`` stands in for both."""
    if num_splits == 1:
        return out, out
    t, hq = out.shape[0], out.shape[1]
    part_out = torch.empty((t, hq, num_splits, dv_pad), dtype=torch.float32, device=out.device)
    part_lse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=out.device)
    return part_out, part_lse


def _merge_splits(
    part_out: torch.Tensor,  # [T, Hq, S, DV_PAD] f32
    part_lse: torch.Tensor,  # [T, Hq, S] f32
    out: torch.Tensor,  # [T, Hq, Dv]
    lse_t: torch.Tensor,  # [T, Hq] f32 (or a dummy when not written)
    sinks: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    write_lse: bool,
) -> None:
    num_tokens, num_q_heads, num_splits, dv_pad = part_out.shape
    merge_splits_kernel[(num_tokens, num_q_heads)](
        part_out,
        part_lse,
        out,
        *out.stride(),
        lse_t,
        lse_t.stride(0),
        lse_t.stride(1),
        sinks if sinks is not None else part_lse,
        query_start_loc,
        query_start_loc.shape[0] - 1,
        num_q_heads,
        num_splits,
        HEAD_SIZE_V=out.shape[2],
        DV_PAD=dv_pad,
        S_PAD=pow2(num_splits),
        USE_SINKS=sinks is not None,
        WRITE_LSE=write_lse,
        num_warps=4 if dv_pad * pow2(num_splits) >= 2048 else 2,
    )


def merge_attn_states_triton(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (validated by the api) in one launch over ``(T, Hq)``."""
    _check_runnable(out_a.device)
    num_tokens, num_q_heads, head_size_v = out_a.shape
    out = torch.empty(
        (num_tokens, num_q_heads, head_size_v), dtype=out_a.dtype, device=out_a.device
    )
    lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=out_a.device)
    if num_tokens == 0 or num_q_heads == 0:
        return out, lse
    merge_two_kernel[(num_tokens, num_q_heads)](
        out_a,
        *out_a.stride(),
        lse_a,
        *lse_a.stride(),
        out_b,
        *out_b.stride(),
        lse_b,
        *lse_b.stride(),
        out,
        *out.stride(),
        lse,
        num_q_heads,
        HEAD_SIZE_V=head_size_v,
        DV_PAD=pow2(head_size_v),
        num_warps=1 if head_size_v <= 128 else 2,
    )
    return out, lse
