"""Ahead-of-time compile specs of the paged-attention kernels: CI compiles every variant for
sm_90 / sm_80 on a machine with no GPU, with the launcher's own tile configs and constexprs
(:func:`._tiles.kernel_constexprs`), so what compiles in CI is what runs."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from kv_spec import KVQuantMode, normalize_dtype, pages

from kv_kernels._common import row_align
from kv_kernels.paged_attention._kernels import paged_attention_kernel
from kv_kernels.paged_attention._merge import merge_splits_kernel, merge_two_kernel
from kv_kernels.paged_attention._tiles import kernel_constexprs, pow2, select_config

__all__ = ["AotSpec", "aot_specs"]


class AotSpec(NamedTuple):
    """One kernel variant to compile ahead of time."""

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    aligned: tuple[str, ...]
    max_registers: int = 0


_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int8: "i8",
}


def _attention_signature(qt: str, ct: str, st: str) -> dict[str, str]:
    """Argument types of the attention kernel; cache strides are ``i64`` (the large-cache case).
    ``st``: the type the inline scales are read as (``fp32`` words; the cache's own otherwise)."""
    i32, i64 = "i32", "i64"
    return {
        "q_ptr": f"*{qt}", "stride_qt": i32, "stride_qh": i32, "stride_qd": i32,
        "kv_ptr": f"*{ct}", "stride_kb": i64, "stride_kh": i64, "stride_kn": i64, "stride_kc": i64,
        "kvs_ptr": f"*{st}", "k_desc": f"*{qt}", "v_desc": f"*{qt}",
        "bt_ptr": "*i32", "stride_bts": i32, "stride_btb": i32,
        "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "sinks_ptr": "*fp32", "alibi_ptr": "*fp32",
        "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "stride_ks": i32, "stride_vs": i32,
        "k_scale_val": "fp32", "v_scale_val": "fp32",
        "out_ptr": f"*{qt}", "stride_ot": i32, "stride_oh": i32, "stride_od": i32,
        "lse_ptr": "*fp32", "stride_lt": i32, "stride_lh": i32,
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "err_ptr": "*i32",
        "num_seqs": i32, "num_q_heads": i32, "num_blocks": i32, "max_blocks": i32,
        "ks_idx": i32, "vs_idx": i32, "stride_ssh": i64, "stride_ssn": i64,
        "scale": "fp32", "softcap": "fp32", "window": i32,
        "q_len_min": i32, "q_len_max": i32, "seq_lo": i32,
    }  # fmt: skip


def _attention_specs(
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    *,
    head_size: int,
    head_size_v: int,
    group: int,
    block_size: int,
    arch: int,
    inline_scales: bool,
    mla: bool,
    scale_plane: bool = False,
) -> list[AotSpec]:
    ct = _TRITON_TYPES[cache_dtype]
    sig = _attention_signature(_TRITON_TYPES[q_dtype], ct, "fp32" if inline_scales else ct)
    elem = torch.empty((), dtype=cache_dtype).element_size()
    scale_mode = 3 if inline_scales else (2 if elem == 1 else 0)
    # Arguments Triton sees as multiples of 16 at launch (aligned pointers, page strides).
    aligned = (
        *tuple(n for n, t in sig.items() if t.startswith("*")),
        "stride_qt", "stride_qh", "stride_kb", "stride_kh", "stride_kn", "stride_bts",
        "stride_ot", "stride_oh",
    )  # fmt: skip
    # A token row that is not a multiple of 16 elements (heads of 80 + 72): Triton does not
    # specialize its stride, and the launcher passes the alignment it has (ROW_ALIGN: a
    # per-token-head row of 128 + 128 + 8 bytes is 8-byte aligned; with a scale plane 256).
    row = pages.content_size(
        head_size=head_size,
        head_size_v=0 if mla else head_size_v,
        kv_quant=(
            KVQuantMode.INT8_PER_TOKEN_HEAD
            if inline_scales and not scale_plane
            else KVQuantMode.NONE
        ),
        is_mla=mla,
        dtype=normalize_dtype(cache_dtype),
    )  # (a scale plane keeps the rows to K + V)
    if row % 16:
        aligned = tuple(a for a in aligned if a != "stride_kn")
    align = row_align((row,))
    specs: list[AotSpec] = []
    for kind, split in (("decode", False), ("decode", True), ("prefill", False)):
        cfg = select_config(
            kind,
            head_size=head_size,
            head_size_v=head_size_v,
            group=group,
            block_size=block_size,
            elem_bytes=elem,
            arch=arch,
            v_from_k=mla,
            inline_scales=inline_scales,
        )
        consts: dict[str, Any] = kernel_constexprs(
            cfg,
            kind=kind,
            head_size=head_size,
            head_size_v=head_size_v,
            block_size=block_size,
            group=group,
            causal=True,
            sliding_window=kind == "prefill",
            sinks=not split,
            softcap=kind == "prefill",
            alibi=False,
            kv_scale_mode=scale_mode,
            split=split,
            write_lse=True,
            dot_ieee=q_dtype == torch.float32,
            check=not split,  # both the counting and the plain variant compile
            v_from_k=mla,
            scale_words=inline_scales,
            scale_plane=scale_plane,
            row_align=align,
            tma=cfg.tma,
            kv_bytes=elem,
        )
        sig_k = dict(sig)
        if consts["TMA"]:
            # the launcher's descriptors: one [1, tile_n, 1, head] box of K / V per tile
            sig_k["k_desc"] = f"tensordesc<{ct}[1, {cfg.tile_n}, 1, {head_size}]>"
            sig_k["v_desc"] = f"tensordesc<{ct}[1, {cfg.tile_n}, 1, {head_size_v}]>"
        # Unit strides are specialized to constants at launch (Triton does so for ints == 1);
        # the AOT build does the same so it compiles the vectorized code that runs.
        consts.update(stride_qd=1, stride_kc=1, stride_btb=1, stride_od=1)
        specs.append(
            AotSpec(
                f"attn_{kind}{'_split' if split else ''}",
                paged_attention_kernel,
                {**sig_k, **dict.fromkeys(consts, "constexpr")},
                consts,
                cfg.num_warps,
                cfg.num_stages,
                aligned,
                cfg.max_registers,
            )
        )
    return specs


def _merge_specs(qt: str, head_size_v: int) -> list[AotSpec]:
    i32 = "i32"
    dv_pad = pow2(head_size_v)
    merge_sig = {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
        "out_ptr": f"*{qt}", "stride_ot": i32, "stride_oh": i32, "stride_od": i32,
        "lse_ptr": "*fp32", "stride_lt": i32, "stride_lh": i32,
        "sinks_ptr": "*fp32", "qsl_ptr": "*i32", "num_seqs": i32, "num_q_heads": i32,
        "num_splits": i32, "q_len_max": i32,
    }  # fmt: skip
    merge_consts = dict(
        HEAD_SIZE_V=head_size_v, DV_PAD=dv_pad, S_PAD=16, USE_SINKS=True, WRITE_LSE=True,
        DECODE_ONLY=False,
    )  # fmt: skip
    # a mixed batch's merge: decode-class rows only (a binary search over query_start_loc)
    decode_only = dict(merge_consts, DECODE_ONLY=True, USE_SINKS=False, WRITE_LSE=False)
    two_sig = {
        "a_ptr": f"*{qt}", "stride_at": i32, "stride_ah": i32, "stride_ad": i32,
        "lse_a_ptr": "*fp32", "stride_lat": i32, "stride_lah": i32,
        "b_ptr": f"*{qt}", "stride_bt": i32, "stride_bh": i32, "stride_bd": i32,
        "lse_b_ptr": "*fp32", "stride_lbt": i32, "stride_lbh": i32,
        "o_ptr": f"*{qt}", "stride_ot": i32, "stride_oh": i32, "stride_od": i32,
        "lse_o_ptr": "*fp32", "num_q_heads": i32,
    }  # fmt: skip
    two_consts = dict(HEAD_SIZE_V=head_size_v, DV_PAD=dv_pad)

    def pointers(sig: dict[str, str]) -> tuple[str, ...]:
        return tuple(n for n, t in sig.items() if t.startswith("*"))

    return [
        AotSpec(
            "merge_splits",
            merge_splits_kernel,
            {**merge_sig, **dict.fromkeys(merge_consts, "constexpr")},
            merge_consts,
            4,
            1,
            pointers(merge_sig),
        ),
        AotSpec(
            "merge_splits_decode_only",
            merge_splits_kernel,
            {**merge_sig, **dict.fromkeys(decode_only, "constexpr")},
            decode_only,
            2,
            1,
            pointers(merge_sig),
        ),
        AotSpec(
            "merge_two",
            merge_two_kernel,
            {**two_sig, **dict.fromkeys(two_consts, "constexpr")},
            two_consts,
            1,
            1,
            pointers(two_sig),
        ),
    ]


def aot_specs(
    *,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_size: int,
    head_size_v: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    arch: int,
    kv_quant: str | None = None,
    mla: bool = False,
    scale_plane: bool = False,
) -> list[AotSpec]:
    """Every kernel variant the launcher would run on such a cache, with the launcher's own
    configs (so CI compiles what runs). Strides of the cache are ``i64`` (the large-cache case);
    ``aligned`` names the arguments Triton would see as multiples of 16 at launch.

    ``kv_quant``: ``None`` (unquantized, or fp8 per tensor for an fp8 cache) or a per-token-head
    mode (scales read inline as float32 words); ``mla``: one latent (``head_size = head_size_v``
    + rope tail), V read from K's tile; ``scale_plane``: the per-token-head scales in each page's
    scale plane (kv-spec's ``scale_plane``)."""
    inline = kv_quant in ("int8_per_token_head", "fp8_per_token_head")
    if kv_quant not in (None, "none", "fp8_per_tensor") and not inline:
        raise ValueError(f"aot_specs: kv_quant={kv_quant!r} is not a mode the kernel reads")
    return [
        *_attention_specs(
            q_dtype,
            cache_dtype,
            head_size=head_size,
            head_size_v=head_size_v,
            group=num_q_heads // num_kv_heads,
            block_size=block_size,
            arch=arch,
            inline_scales=inline,
            mla=mla,
            scale_plane=scale_plane and inline,
        ),
        *_merge_specs(_TRITON_TYPES[q_dtype], head_size_v),
    ]
