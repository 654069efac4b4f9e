"""Launchers of the unified Triton paged-attention kernel (prefill, chunked prefill and decode in
one batch) and of the attention-state merges: checks, grids and the choice of constexprs.

The ``@triton.jit`` bodies are in :mod:`._kernels` (their docstring explains the work split),
the tile tables in :mod:`._tiles`, the ahead-of-time specs in :mod:`._aot`; this module re-exports
the public names of all three so ``kv_kernels.paged_attention.triton`` stays the one import.

Two launches, one per query-length class. Sequences with ``q_len <= BLOCK_Q(decode)`` (decode,
short speculative steps) run with a small-M "decode" config, one program per sequence (no search);
longer ones run with a large-M "prefill" config whose programs find their sequence by a binary
search over ``query_start_loc``. The class of a sequence depends only on its own ``q_len``, so a
sequence is computed by the same tile shapes whatever else is in the batch. Under the split
heuristic (``num_splits=None``) only the decode class splits KV, in a mixed batch too (its
prefill tiles fill the GPU on their own), and the merge then merges decode-class rows only; a
caller's ``num_splits`` splits both classes and the merge takes every row.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kv_kernels._common import row_align
from kv_kernels._launch import FastLauncher
from kv_kernels.paged_attention import _splits
from kv_kernels.paged_attention._aot import AotSpec, aot_specs
from kv_kernels.paged_attention._bound import Launch
from kv_kernels.paged_attention._kernels import paged_attention_kernel
from kv_kernels.paged_attention._launch_args import (
    _inline_scale_args,
    _reg_cap,
    _scale_args,
    _split_buffers,
    _tma_descriptors,
    prefill_grid_q,
)
from kv_kernels.paged_attention._merge import merge_splits_kernel, merge_two_kernel
from kv_kernels.paged_attention._splits import _num_splits
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


class _Plan:
    """What a launch decides from its inputs' shapes, strides, dtypes, options and alignments
    (everything but the tensors' addresses and ``max_seq_len``): configs, the kernels each
    query-length class runs, constexprs. Kept per validated api call (:mod:`._fast`)."""

    cfg_dec: AttentionConfig
    cfg_pre: AttentionConfig
    num_sms: int
    grid_y_dec: int  # programs along the heads: kv heads x head chunks
    grid_y_pre: int
    run_prefill: bool
    kv_scale_mode: int
    features: dict[str, Any]  # kernel_constexprs' features, split / scale_words per launch
    gluon_decode: bool
    gluon_mla: bool
    gluon_prefill: bool
    splits: Any  # the caller's split count, or the heuristic's inputs (see _num_splits)

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)
        #: launch keyword arguments by (kind, split, scale words, tma)
        self.constexprs: dict[tuple[Any, ...], dict[str, Any]] = {}


def _make_plan(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    k_range: tuple[int, int],
    v_range: tuple[int, int],
    block_table: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    return_lse: bool,
    max_query_len: int,
    block_size: int,
    num_splits: int | None,
    error_flag: torch.Tensor | None,
    scale_rows: tuple[int, int, int] | None,
    v_from_k: bool,
) -> _Plan:
    num_q_heads, head_size = q.shape[1], q.shape[2]
    num_seqs, num_kv_heads = block_table.shape[0], kv_cache.shape[1]
    head_size_v = v_range[1] - v_range[0]
    cfg_dec, cfg_pre, num_sms = _configs(
        q, kv_cache, head_size_v, block_size, v_from_k, inline_scales=scale_rows is not None
    )
    group = num_q_heads // num_kv_heads
    # (a hand-made config may leave heads_per_program at 0: the whole group, as kernel_constexprs)
    chunks_dec = -(-group // (cfg_dec.heads_per_program or group))
    chunks_pre = -(-group // (cfg_pre.heads_per_program or group))
    run_prefill = max_query_len > cfg_dec.block_q
    kv_scale_mode = _scale_args(k_scale, v_scale, q)[0] if k_scale is not None else 0
    if scale_rows is not None:
        kv_scale_mode = 3
    features = dict(
        head_size=head_size,
        head_size_v=head_size_v,
        block_size=block_size,
        group=group,
        causal=causal,
        sliding_window=sliding_window is not None,
        sinks=sinks is not None,
        softcap=softcap > 0,
        alibi=alibi_slopes is not None,
        kv_scale_mode=kv_scale_mode,
        split=False,  # (set per launch, once the split count is known)
        write_lse=return_lse,
        dot_ieee=q.dtype == torch.float32,
        check=error_flag is not None,
        v_from_k=v_from_k,
        scale_words=False,  # (set per launch: see _inline_scale_args)
        # (scales off the rows' own strides: in each page's plane)
        scale_plane=scale_rows is not None
        and scale_rows[1:] != (kv_cache.stride(1), kv_cache.stride(2)),
        row_align=row_align(kv_cache.stride()[:3]),
        kv_bytes=kv_cache.element_size(),
        ptx=type(paged_attention_kernel).__name__ != "InterpretedFunction",
        k_start=k_range[0],
        v_start=v_range[0],
    )
    if scale_rows is not None:
        # (whether the scales can be read as words is a property of the cache's storage)
        features["scale_words"] = _inline_scale_args(kv_cache, scale_rows)[3]
    # sm_90, fp8 pages, no special features: the decode class runs the Gluon decode kernel (see
    # _sm90_decode; with KV_KERNELS_SM90_DECODE=0 the Triton kernel does)
    gluon_decode = _gluon_serves(
        "decode", q, kv_cache, head_size_v, scale, features, (out, block_table),
        block_q=cfg_dec.block_q,
    )  # fmt: skip
    # sm_90, MLA's 16-bit or fp8 e4m3 per-tensor latent at 8-32 / 64 / 128 heads: the decode class
    # runs a Gluon MLA kernel (see _sm90_mla; with KV_KERNELS_SM90_MLA=0 the Triton kernel does)
    gluon_mla = v_from_k and _gluon_serves(
        "mla", q, kv_cache, head_size_v, scale, features, (out, block_table),
        block_q=cfg_dec.block_q,
    )  # fmt: skip
    # decode splits KV to fill the GPU (by max_seq_len, per launch: see _num_splits), in a mixed
    # batch too; the prefill class then runs unsplit (describe_launches: a tuple, not the caller's)
    splits: Any = num_splits
    if splits is None:
        if gluon_decode:
            splits = ("decode", num_seqs, num_kv_heads, num_sms)
        elif gluon_mla:
            from kv_kernels.paged_attention._sm90_mla import mla_head_blocks

            splits = ("mla", num_seqs, mla_head_blocks(num_q_heads), num_sms)
        else:
            splits = ("triton", num_seqs, num_kv_heads * chunks_dec, num_sms, cfg_dec)
        if run_prefill:
            # the split scratch holds every token row of the batch, prefill rows too: a decode
            # split beside a long chunk would take it to gigabytes (8k rows x 32 heads x 16
            # splits x 128 x 4 bytes is 2 GiB), so a mixed batch splits only as far as
            # MIXED_SPLIT_SCRATCH bytes allow (q's shape is part of the plan's class)
            per_split = q.shape[0] * num_q_heads * (pow2(head_size_v) + 1) * 4
            splits = ("capped", max(1, _splits.MIXED_SPLIT_SCRATCH // per_split), splits)
    # sm_90, 16-bit pages, no special features: the prefill class runs the warp-specialized
    # Gluon kernel (see _sm90_prefill; with KV_KERNELS_SM90_PREFILL=0 the Triton kernel does).
    # (Its rule reads features["split"]: a prefill launch never splits on its own.)
    gluon_prefill = (
        run_prefill
        and not (isinstance(splits, int) and splits > 1)
        and _gluon_serves("prefill", q, kv_cache, head_size_v, scale, features, (out, block_table))
    )
    return _Plan(
        cfg_dec=cfg_dec, cfg_pre=cfg_pre, num_sms=num_sms, grid_y_dec=num_kv_heads * chunks_dec,
        grid_y_pre=num_kv_heads * chunks_pre, run_prefill=run_prefill,
        kv_scale_mode=kv_scale_mode, features=features, gluon_decode=gluon_decode,
        gluon_mla=gluon_mla, gluon_prefill=gluon_prefill, splits=splits,
    )  # fmt: skip


def _plan_constexprs(plan: _Plan, kind: str, split: bool, words: bool, tma: bool) -> dict[str, Any]:
    """The keyword arguments (constexprs and options) of one Triton launch of ``plan``."""
    key = (kind, split, words, tma)
    kept = plan.constexprs.get(key)
    if kept is None:
        cfg = plan.cfg_dec if kind == "decode" else plan.cfg_pre
        features = dict(plan.features, split=split, scale_words=words)
        extra = {"tma": tma} if kind == "prefill" else {}
        kept = dict(
            _constexprs(cfg, kind, **extra, **features),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **_reg_cap(cfg),
        )
        plan.constexprs[key] = kept
    return kept


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
    plan_slot: Any = None,  # the api's validated call (._fast.Entry): keeps the plan, binds launches
    num_decodes: int = 0,  # leading sequences of one query token: the prefill grid leaves them
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch the unified kernel (and the split merge); inputs validated by the api."""
    _check_runnable(q.device)
    if v_from_k and v_scale is None:
        # an fp8 MLA latent: V is the row stored as x / k_scale (api._latent_v_scale; the api's
        # fast path hands the caller's v_scale=None through)
        v_scale = k_scale
    num_tokens, num_q_heads = q.shape[0], q.shape[1]
    lse: torch.Tensor | None = None
    if return_lse:
        lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    num_seqs = block_table.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return (out, lse) if lse is not None else out
    plan = plan_slot.plan if plan_slot is not None else None
    if plan is None:
        plan = _make_plan(
            q, kv_cache, k_range, v_range, block_table, out, scale, causal, sliding_window,
            sinks, softcap, alibi_slopes, k_scale, v_scale, return_lse, max_query_len, block_size,
            num_splits, error_flag, scale_rows, v_from_k,
        )  # fmt: skip
        if plan_slot is not None:
            plan_slot.plan = plan
    splits = _num_splits(plan.splits, block_table, block_size, max_seq_len)
    part_out, part_lse = _split_buffers(out, splits, pow2(v_range[1] - v_range[0]))
    launches = describe_launches(
        plan, splits, plan_slot, q, kv_cache, k_range=k_range, v_range=v_range,
        block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc, scale=scale,
        causal=causal, sliding_window=sliding_window, sinks=sinks, softcap=softcap,
        alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
        part_out=part_out, part_lse=part_lse, block_size=block_size, error_flag=error_flag,
        scale_rows=scale_rows, num_decodes=num_decodes,
    )  # fmt: skip
    for launch in launches:
        launch.run()
    if plan_slot is not None:  # bind the call per shape class (an MLA latent's v_scale is k_scale)
        plan_slot.learn(
            splits, launches, (q, kv_cache, block_table, seq_lens, query_start_loc, sinks,
            alibi_slopes, k_scale, None if v_from_k else v_scale, error_flag, out, lse,
            part_out, part_lse),
            lambda m: _num_splits(plan.splits, block_table, block_size, m),
        )  # fmt: skip
    return (out, lse) if lse is not None else out


def describe_launches(
    plan: _Plan,
    splits: int,
    plan_slot: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    k_range: tuple[int, int],
    v_range: tuple[int, int],
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    block_size: int,
    error_flag: torch.Tensor | None,
    scale_rows: tuple[int, int, int] | None,
    num_decodes: int = 0,
    **_rest: Any,  # (the rest of paged_attention_triton's keywords: the plan holds them)
) -> list[Launch]:
    """The launches of one call of ``plan`` at ``splits`` KV splits, in order (nothing runs):
    the decode class (sm_90 Gluon decode / MLA, or the Triton kernel), the prefill class, the
    split merge. ``plan_slot``: the api's validated call, whose serial keys bound launches.
    ``num_decodes``: the leading sequences of one query token each, which the prefill class's
    grid leaves out (:func:`._launch_args.prefill_grid_q`)."""
    num_tokens, num_q_heads, num_seqs = q.shape[0], q.shape[1], block_table.shape[0]
    split = splits > 1
    # the prefill class splits only at the caller's count (the heuristic's is the decode class's)
    split_pre = split and isinstance(plan.splits, int)
    _, scale_args = _scale_args(k_scale, v_scale, q)
    kvs, ks_idx, vs_idx, words = _inline_scale_args(kv_cache, scale_rows)
    lse_t = lse if lse is not None else out
    # the launch key: the plan's, the split count and the scale view (its address too)
    launch_key = (
        None if plan_slot is None else (plan_slot.serial, splits, words, kvs.data_ptr() & 15)
    )
    launches: list[Launch] = []
    if plan.gluon_decode:
        from kv_kernels.paged_attention._sm90_decode import launch_sm90_decode

        launch_sm90_decode(
            q, kv_cache, k_start=k_range[0], v_start=v_range[0], block_table=block_table,
            seq_lens=seq_lens, query_start_loc=query_start_loc, scale=scale, causal=causal,
            block_size=block_size, kv_scale_mode=plan.kv_scale_mode, scale_args=scale_args,
            scale_rows=scale_rows, row_align=plan.features["row_align"], out=out, lse=lse,
            part_out=part_out, part_lse=part_lse, num_splits=splits, key=launch_key,
            launches=launches,
        )  # fmt: skip
    elif plan.gluon_mla:
        from kv_kernels.paged_attention._sm90_mla import launch_sm90_mla

        # (an fp8 latent's one scale: paged_attention_triton passed k_scale as v_scale too)
        launch_sm90_mla(
            q, kv_cache, block_table=block_table, seq_lens=seq_lens,
            query_start_loc=query_start_loc, scale=scale, block_size=block_size, out=out,
            lse=lse, part_out=part_out, part_lse=part_lse, num_splits=splits,
            kv_scale_mode=plan.kv_scale_mode, scale_args=scale_args, key=launch_key,
            launches=launches,
        )  # fmt: skip
    descs = None
    if plan.run_prefill and not plan.gluon_prefill:
        descs = _tma_descriptors(kv_cache, k_range, v_range, plan.cfg_pre)
    head_args = (q, *q.stride(), kv_cache, *kv_cache.stride(), kvs)
    args = (
        block_table, *block_table.stride(), seq_lens, query_start_loc,
        sinks if sinks is not None else q, alibi_slopes if alibi_slopes is not None else q,
        *scale_args, out, *out.stride(), lse_t, lse_t.stride(0), lse_t.stride(1),
        part_out, part_lse, error_flag if error_flag is not None else seq_lens,
        num_seqs, num_q_heads, kv_cache.shape[0], block_table.shape[1],
        ks_idx, vs_idx, *(scale_rows[1:] if scale_rows else (0, 0)),
        scale, float(softcap), int(sliding_window or 0),
    )  # fmt: skip
    if not (plan.gluon_decode or plan.gluon_mla):
        # decode class: q_len in [1, block_q(decode)], one program per sequence
        # (no TMA descriptors in decode: its tiles are gathered)
        launches.append(
            Launch(
                _ATTENTION,
                launch_key and ("decode", launch_key),
                (num_seqs, plan.grid_y_dec, splits),
                (*head_args, q, q, *args, 1, plan.cfg_dec.block_q, num_decodes),
                _plan_constexprs(plan, "decode", split, words, False),
            )
        )
    if plan.gluon_prefill:
        from kv_kernels.paged_attention._sm90_prefill import launch_sm90_prefill

        prefill = functools.partial(
            launch_sm90_prefill, q, kv_cache, k_start=k_range[0], v_start=v_range[0],
            block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc,
            scale=scale, causal=causal, block_size=block_size, out=out, lse=lse,
            q_len_min=plan.cfg_dec.block_q + 1, seq_lo=num_decodes,
        )  # fmt: skip
        launches.append(Launch(None, None, (), (), {}, prefill))
    elif plan.run_prefill:
        grid_q = prefill_grid_q(num_tokens, num_seqs, plan.cfg_pre.block_q, num_decodes)
        if grid_q > 0:  # (every sequence a decode: no prefill-class program to run)
            launches.append(
                Launch(
                    # (TMA descriptors: the plain launch, which specializes on them)
                    _ATTENTION,
                    launch_key and descs is None and ("prefill", launch_key),
                    (grid_q, plan.grid_y_pre, splits if split_pre else 1),
                    (*head_args, *(descs or (q, q)), *args, plan.cfg_dec.block_q + 1,
                     2**31 - 1, num_decodes),
                    _plan_constexprs(plan, "prefill", split_pre, words, descs is not None),
                )
            )  # fmt: skip
    if split:  # (an unsplit prefill class wrote its rows: the merge leaves them alone)
        q_len_max = plan.cfg_dec.block_q if plan.run_prefill and not split_pre else None
        merge = _merge_splits(
            part_out, part_lse, out, lse_t, sinks, query_start_loc, lse is not None, launch_key,
            q_len_max,
        )  # fmt: skip
        launches.append(merge)
    return launches


#: the unified kernel's and the merge's bound launches (kv_kernels._launch)
_ATTENTION = FastLauncher(paged_attention_kernel)
_MERGE = FastLauncher(merge_splits_kernel)


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


def _merge_splits(
    part_out: torch.Tensor,  # [T, Hq, S, DV_PAD] f32
    part_lse: torch.Tensor,  # [T, Hq, S] f32
    out: torch.Tensor,  # [T, Hq, Dv]
    lse_t: torch.Tensor,  # [T, Hq] f32 (or a dummy when not written)
    sinks: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    write_lse: bool,
    key: Any = None,  # the launch's key (paged_attention_triton): a bound launch
    q_len_max: int | None = None,  # merge only sequences with q_len <= q_len_max (None: all)
) -> Launch:
    """The launch that merges a split launch's partial states into ``out`` (and its LSE)."""
    num_tokens, num_q_heads, num_splits, dv_pad = part_out.shape
    args = (
        part_out, part_lse, out, *out.stride(), lse_t, lse_t.stride(0), lse_t.stride(1),
        sinks if sinks is not None else part_lse, query_start_loc,
        query_start_loc.shape[0] - 1, num_q_heads, num_splits, q_len_max or 0,
    )  # fmt: skip
    kwargs = dict(
        HEAD_SIZE_V=out.shape[2], DV_PAD=dv_pad, S_PAD=pow2(num_splits),
        USE_SINKS=sinks is not None, WRITE_LSE=write_lse, DECODE_ONLY=q_len_max is not None,
        num_warps=4 if dv_pad * pow2(num_splits) >= 2048 else 2,
    )  # fmt: skip
    return Launch(_MERGE, key, (num_tokens, num_q_heads), args, kwargs)


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
