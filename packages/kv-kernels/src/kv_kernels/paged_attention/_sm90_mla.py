"""MLA decode for Hopper (sm_90) in Gluon: DeepSeek-V3's absorbed attention, 64 query heads a
program over one 576-wide latent (K the whole row, V its first 512 columns of the same tile).

Why a third Gluon kernel. At 128 heads a latent byte feeds ~240 FLOPs, so MLA decode is bound by
the tensor cores and by how well the copies overlap them, not by HBM bandwidth; the Triton
kernel's MLA decode reached 232-245 TFLOP/s on an H100 / H200 (0.24-0.33 of the copy). This
kernel states the schedule, as :mod:`._sm90_prefill_kernel` does for prefill:

- a producer warpgroup gathers each 64-token tile of latent rows (``cp.async``, 16 bytes a
  thread, any page size) into a ring of ``NBUF`` slots: the 512 "nope" columns in one tile
  (which is V as well), the 64 rope columns in another; each slot's ``full`` mbarrier signals
  its copies, its ``empty`` one its release;
- one consumer of two warpgroups (8 warps) over the program's 64 query rows: ``S = q K^T``
  with the warpgroups splitting the tile's tokens (32 each, K = 576: q's nope part from shared
  memory, its rope part from registers), the online softmax over both halves, ``P`` through
  shared memory, and ``O += P V`` with the warpgroups splitting V's 512 columns (a 64 x 256
  float32 accumulator each, 128 registers a thread). A slot is released as soon as its ``P V``
  is done, so the copy of the next tile overlaps a whole tile's work (see :func:`_consumer`).

Scope (:func:`sm90_mla_eligible`): the decode class (one query token a sequence: the Triton
config's ``block_q`` for MLA at these head counts is 1) of a latent cache (K 576, V its first 512
columns, ``v_from_k``) in the query's 16-bit dtype, or in fp8 e4m3 with one per-tensor scale
(vLLM's ``fp8_e4m3`` latent), 64 or 128 query heads over the one latent head, a positive scale,
LSE and KV splits. 16 or 32 heads (tensor parallelism 8 / 4) go to
:mod:`._sm90_mla_narrow`, which turns the MMAs around (tokens as M) rather than pad 16 heads to
this kernel's 64 rows, over the same ring (:mod:`._sm90_mla_ring`) and this launcher. Everything
else (other head counts, e5m2 / int8 / per-token-head latents, windows, soft-cap, metadata
checks) stays with the Triton kernel. ``KV_KERNELS_SM90_MLA=0`` turns both off.

fp8 latents (:mod:`._sm90_mla_fp8`): the producer loads the bytes into registers, widens them to
the query's dtype and stores them into the same ring (no room for an fp8 staging ring beside
it), so the consumer is the same; the scale multiplies the logits' scale and, once, the output
(``KV_SCALE`` 1: a float argument, 2: a ``[1]`` float32 tensor read on the device, as
:mod:`._sm90_decode_kernel`'s). Not measured on a GPU yet; the Triton kernel reads 95 TFLOP/s
over that latent at 128 heads on an H200, this kernel 434 over the bf16 one.

Bounds: as :mod:`._sm90_prefill_kernel` (block-table columns and block ids clamped, tokens past the
sequence zero-filled by ``cp.async``, or masked loads, and masked), so no read leaves the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from kv_kernels._common import require_unit_rows, sm90_gluon_allowed
from kv_kernels._launch import FastLauncher
from kv_kernels.aot import aot_case_spec
from kv_kernels.paged_attention._gluon_compat import barrier
from kv_kernels.paged_attention._sm90_mla_narrow import (
    FAST_NARROW,
    NARROW_HEADS,
    sm90_mla_narrow_kernel,
)
from kv_kernels.paged_attention._sm90_mla_ring import (
    D_NOPE,
    D_ROPE,
    NBUF,
    P_REGS,
    P_REGS_FP8,
    P_REGS_FP8_WHOLE,
    TILE_N,
    allocate_ring,
    producer,
    program_tiles,
)
from kv_kernels.paged_attention._tiles import pick_num_splits

__all__ = [
    "aot_case",
    "launch_sm90_mla",
    "pick_mla_splits",
    "sm90_mla_eligible",
    "sm90_mla_kernel",
]

#: query rows a program (a warpgroup MMA's M)
ROWS = gl.constexpr(64)


@gluon.constexpr_function
def _s_layout():
    """The logits' layout: a 64 x 64 tile, the two warpgroups' MMAs 32 tokens each."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE_N // 2, 16]
    )


@gluon.jit
def _softmax(sc, m_i, l_part, t, kcols, seq_len, qk_scale_log2):
    """Online softmax of tile ``t``'s raw logits: ``p = 2^(s c - m c)`` (tokens past the
    sequence masked), the running maxima, the row sums kept per column (summed once at the end:
    no cross-warpgroup reduction a tile) and the rescale factor."""
    kpos = t * TILE_N + kcols
    sc = gl.where((kpos < seq_len)[None, :], sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    # a row that has seen nothing keeps m = -inf: exp2 against 0 keeps its weights at 0
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale_log2
    alpha = gl.exp2(m_i * qk_scale_log2 - m_use)
    p32 = gl.exp2(sc * qk_scale_log2 - m_use[:, None])
    return p32, m_new, l_part * alpha[:, None] + p32, alpha


@gluon.jit
def _consumer(qn_smem, q_rope, kvn_smem, kr_smem, p_smem, full, empty, t_lo, n_tiles, seq_len,
              qk_scale_log2, NBUF_: gl.constexpr):  # fmt: skip
    """The program's 64 rows over its tiles: returns ``(acc, m, l)`` (raw-logit maxima).

    Tile ``i``: tile ``i - 1``'s ``P V``, then (its slot released as soon as that is done in
    every warp, so the producer's copy of tile ``i + 1`` overlaps all of tile ``i``) tile ``i``'s
    ``q K^T`` and softmax. The copies, not the MMAs, set the pace: with two slots of 72 KiB
    beside q's 64 KiB there is no room for a third, and (H100, same process, 64 x 4k) a
    producer that copies nothing reads 521 TFLOP/s where this one reads 422-437. Measured
    against it (H100 / H200, graph-timed, probe output): ``P V`` kept one tile behind ``q K^T``
    with both slots released at the tile's end 341 TFLOP/s (ncu: 5,800 cycles a tile, its MMAs
    ~2,500: every copy waited for); ``P V`` issued beside the next ``q K^T`` and its slot
    released after 422 / 426; this order 437 on the H200 (414-424 on the H100, one program's
    P buffer less). Copies signalled in 2, 4 or 8 column pieces, q.K starting on the first
    (FlashMLA's way), changed nothing (H100: 425-437 at every count): not the waits but the
    shared memory the copies write beside the MMAs' operand reads seems to cost (modelled:
    ~360 KiB a tile, ~200 of it the two warpgroups' 64 x 32 q.K MMAs reading q). An MMA left
    in flight across the loop's back edge made ptxas serialize every warpgroup MMA.

    Also tried (H100, same process, 64 x 4k / 8 x 32k / page 16): FlashMLA's split of the
    work, each warpgroup the q.K and softmax of every other tile (64 x 64 MMAs, a third less
    shared traffic for q.K) and P.V of every tile on its half of V, the running maximum and P
    passed between them tile by tile: 313-329 TFLOP/s against this schedule's 426-436, every
    softmax waiting on the other warpgroup's; 64 or 128 of q's nope columns in operand
    registers beside its rope columns (less shared memory read by q.K): 422 / 405 against 424;
    a TMA producer (nine 64 x 64 boxes a page-64 tile, one thread issuing): 429-436 against
    420-431, within the runs' spread, and it would need the rows past a sequence zeroed in
    shared memory (TMA copies whole pages)."""
    dtype: gl.constexpr = qn_smem.dtype
    s_layout: gl.constexpr = _s_layout()
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_NOPE // 2, 16]
    )
    kcols = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_part = gl.zeros([ROWS, TILE_N], gl.float32, layout=s_layout)
    acc = gl.zeros([ROWS, D_NOPE], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, TILE_N], gl.float32, layout=s_layout)
    for i in range(n_tiles):
        s = i % NBUF_
        if i > 0:
            sp = (i + NBUF_ - 1) % NBUF_  # tile i - 1's slot
            acc = warpgroup_mma(p_smem, kvn_smem.index(sp), acc)
            barrier()  # every warp's P.V of tile i - 1 done: its slot and P are free
            mbarrier.arrive(empty.index(sp), count=1)
        mbarrier.wait(full.index(s), (i // NBUF_) & 1)
        sc = warpgroup_mma(qn_smem, kvn_smem.index(s).permute((1, 0)), s_zero, use_acc=False)
        sc = warpgroup_mma(q_rope, kr_smem.index(s).permute((1, 0)), sc)
        p32, m_i, l_part, alpha = _softmax(sc, m_i, l_part, t_lo + i, kcols, seq_len,
                                           qk_scale_log2)  # fmt: skip
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_smem.store(p32.to(dtype))
        fence_async_shared()
        barrier()  # every warp's part of P stored
    if n_tiles > 0:
        acc = warpgroup_mma(p_smem, kvn_smem.index((n_tiles + NBUF_ - 1) % NBUF_), acc)
    return acc, m_i, gl.sum(l_part, 1)


# (num_blocks is a bound, never a constexpr: Triton specializes an int equal to 1 into one,
# and the kernel casts it; a one-block cache -- a small workspace -- failed to compile)
@gluon.jit(do_not_specialize=["num_blocks"])
def sm90_mla_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kb, stride_kn,
    bt_ptr, stride_bts,
    seq_lens_ptr, qsl_ptr,
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, k_scale_val, v_scale_val,
    out_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt, stride_lh,
    part_out_ptr, part_lse_ptr,
    num_q_heads, num_blocks, max_blocks, qk_scale_log2,
    BLOCK_SIZE: gl.constexpr, KV_SCALE: gl.constexpr, SPLIT: gl.constexpr,
    WRITE_LSE: gl.constexpr, NBUF_: gl.constexpr, P_WARPS: gl.constexpr, P_REGS_: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    hb = gl.program_id(0)  # the block of 64 query heads (fastest: both blocks share L2)
    seq = gl.program_id(1)
    split = gl.program_id(2)
    num_splits = gl.num_programs(2)
    q_start, mine, seq_len, t_lo, n_tiles, qk_scale_log2, v_deq = program_tiles(
        qsl_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, qk_scale_log2,
        KV_SCALE,
    )  # fmt: skip

    # ---- q: nope columns into shared memory, rope columns into MMA-operand registers ---------
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_l))
    q_rows = q_start.to(gl.int64) * stride_qt + (hb * ROWS + rq).to(gl.int64) * stride_qh
    q_in = mine & (rq >= 0)
    cn = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, q_l))
    qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D_NOPE], dtype)
    qn_smem = gl.allocate_shared_memory(
        dtype, [ROWS, D_NOPE], qn_sl,
        gl.load(q_ptr + q_rows[:, None] + cn[None, :], mask=q_in[:, None], other=0.0),
    )  # fmt: skip
    cr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, q_l))
    q_rope = gl.load(q_ptr + q_rows[:, None] + (D_NOPE + cr)[None, :], mask=q_in[:, None],
                     other=0.0)  # fmt: skip
    s_layout: gl.constexpr = _s_layout()
    q_rope = gl.convert_layout(
        q_rope, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    )

    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, TILE_N], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [ROWS, TILE_N], p_sl)
    kvn_smem, kr_smem, full, empty = allocate_ring(dtype, NBUF_, P_WARPS)

    bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bts
    acc, m_i, l_i = gl.warp_specialize(
        [
            (_consumer, (qn_smem, q_rope, kvn_smem, kr_smem, p_smem, full, empty, t_lo,
                         n_tiles, seq_len, qk_scale_log2, NBUF_)),
            (producer, (kvn_smem, kr_smem, full, empty, kv_ptr, bt_row_ptr, t_lo, n_tiles,
                        seq_len, num_blocks, max_blocks, stride_kb, stride_kn, BLOCK_SIZE,
                        NBUF_, P_WARPS)),
        ],
        [P_WARPS],
        [P_REGS_],
    )  # fmt: skip

    # ---- epilogue: normalize, store (a split's partial output and LSE in float32) -----------
    o_layout: gl.constexpr = acc.type.layout
    has = l_i > 0.0
    l_div = gl.where(has, l_i, 1.0)
    if KV_SCALE > 0:
        o = acc * gl.convert_layout(v_deq / l_div, gl.SliceLayout(1, o_layout))[:, None]
    else:
        o = acc / gl.convert_layout(l_div, gl.SliceLayout(1, o_layout))[:, None]
    lse = gl.where(has, (m_i * qk_scale_log2 + gl.log2(l_div)) * 0.6931471805599453, float("-inf"))
    ro = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    co = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, o_layout))
    head = hb * ROWS + ro
    ok = mine & (ro >= 0)
    tok = q_start.to(gl.int64)
    rl = gl.arange(0, ROWS, layout=lse.type.layout)
    ok_l = mine & (rl >= 0)
    if SPLIT:
        part = (tok * num_q_heads + head) * num_splits + split
        part_l = (tok * num_q_heads + hb * ROWS + rl) * num_splits + split
        gl.store(part_lse_ptr + part_l, lse, mask=ok_l)
        gl.store(part_out_ptr + part[:, None] * D_NOPE + co[None, :], o, mask=ok[:, None])
    else:
        o_ptrs = out_ptr + (tok * stride_ot + head.to(gl.int64) * stride_oh)[:, None] + co[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=ok[:, None])
        if WRITE_LSE:
            h_l = (hb * ROWS + rl).to(gl.int64)
            gl.store(lse_ptr + tok * stride_lt + h_l * stride_lh, lse, mask=ok_l)


#: the features this kernel does not implement (the Triton kernel serves them)
_UNSERVED = ("sliding_window", "sinks", "softcap", "alibi", "check", "scale_words")


def sm90_mla_eligible(
    *,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_size: int,
    head_size_v: int,
    block_q: int,
    features: dict[str, Any],
    **common: Any,
) -> bool:
    """Whether :func:`launch_sm90_mla` serves a launch's decode class (else the Triton kernel):
    :func:`kv_kernels._common.sm90_gluon_allowed`'s conditions for 64 or 128 query heads (this
    kernel) or 16, 32 (:mod:`._sm90_mla_narrow`'s)
    (``common``: its ``arch``, ``compiled``, ``group``, ``scale``, ``aligned_rows``;
    ``KV_KERNELS_SM90_MLA=0`` turns the kernel off), then this kernel's own: MLA's one latent
    (``v_from_k``, K 576 and V its first 512 columns, K from column 0) that
    :func:`_latent_served` says, and a decode class of one token a sequence (``block_q`` 1)."""
    return (
        sm90_gluon_allowed(
            "mla",
            q_dtype=q_dtype,
            features=features,
            unserved=_UNSERVED,
            groups=(*NARROW_HEADS, 64, 128),
            **common,
        )
        and bool(features.get("v_from_k"))
        and _latent_served(q_dtype, cache_dtype, features)
        and (head_size, head_size_v) == (D_NOPE.value + D_ROPE.value, D_NOPE.value)
        and features.get("k_start", 0) == 0
        and block_q == 1
    )


def _latent_served(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, features: dict[str, Any]
) -> bool:
    """The query's dtype with no scale, or fp8 e4m3 with one per-tensor scale (``kv_scale_mode``
    1: a float, 2: a tensor; per-token-head latents the api refuses) in rows whose strides are
    multiples of 16 bytes (``row_align`` 1: the fp8 producer's L2 prefetches move whole 16-byte
    aligned rows). e5m2 and int8 latents stay with the Triton kernel (e5m2 would need its own
    widening: not written, as vLLM's DeepSeek latent cache is e4m3)."""
    mode = features.get("kv_scale_mode", 0)
    if cache_dtype == q_dtype:
        return mode == 0
    return (
        cache_dtype == torch.float8_e4m3fn and mode in (1, 2) and features.get("row_align", 1) == 1
    )


def mla_head_blocks(num_q_heads: int) -> int:
    """Programs a sequence's split takes across the heads: one a 64 heads here, one for every
    head in :mod:`._sm90_mla_narrow` (16, 32 heads)."""
    return max(1, num_q_heads // ROWS.value)


def pick_mla_splits(*, num_seqs: int, head_blocks: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits for an MLA decode batch (``head_blocks``: :func:`mla_head_blocks`): programs
    take a whole SM each (their shared memory; the narrow kernel's ring alone is 144 KiB),
    so the most splits (a power of two, at most 64) whose programs still fit one wave, each
    split keeping at least 8 tiles of 64 tokens. A function of the batch's shape and the card,
    as the Triton kernel's split rule."""
    return pick_num_splits(
        num_seqs=num_seqs, num_kv_heads=head_blocks, max_seq_len=max_seq_len,
        tile_n=TILE_N.value, num_sms=num_sms, waves=1, programs_per_sm=1, min_tiles=8,
    )  # fmt: skip


def launch_sm90_mla(
    q: torch.Tensor,  # [T, Hq, 576], unit column stride
    kv_cache: torch.Tensor,  # [B, 1, N, 576], unit column stride
    *,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    block_size: int,
    out: torch.Tensor,  # [T, Hq, 512]
    lse: torch.Tensor | None,  # [T, Hq] f32
    part_out: torch.Tensor,  # [T, Hq, S, 512] f32 (``out`` when S = 1)
    part_lse: torch.Tensor,  # [T, Hq, S] f32
    num_splits: int,
    kv_scale_mode: int = 0,  # an fp8 latent's scale: 1 a float, 2 a [1] float32 tensor
    scale_args: tuple[Any, ...] | None = None,  # ._launch_args._scale_args' (k_ptr .. v_val)
    key: Any = None,  # the launch's key (paged_attention_triton): a bound launch
    launches: list[Any] | None = None,  # given: append the launch (._bound.Launch), run nothing
) -> None:
    """The decode class of an MLA launch on sm_90 (inputs validated by the api; eligibility by
    :func:`sm90_mla_eligible`; the caller merges the splits). An fp8 latent's ``scale_args``
    carry its one scale as K's and V's (``paged_attention_triton`` passes ``v_scale=k_scale``);
    none for a 16-bit latent."""
    num_q_heads = q.shape[1]
    require_unit_rows(
        "the sm_90 MLA decode kernel",
        {"q": q, "kv_cache": kv_cache, "out": out, "block_table": block_table},
    )
    lse_t = lse if lse is not None else out
    grid = (mla_head_blocks(num_q_heads), block_table.shape[0], num_splits)
    args = (
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(2),
        block_table, block_table.stride(0), seq_lens, query_start_loc,
        *(scale_args or (q, q, 0, 0, 1.0, 1.0)),
        out, out.stride(0), out.stride(1),
        lse_t, lse_t.stride(0), lse_t.stride(1),
        part_out, part_lse,
        num_q_heads, kv_cache.shape[0], block_table.shape[1], scale * 1.4426950408889634,
    )  # fmt: skip
    kwargs = _constexprs(num_q_heads, kv_cache.element_size() == 1)
    kwargs.update(
        BLOCK_SIZE=block_size, KV_SCALE=kv_scale_mode, SPLIT=num_splits > 1,
        WRITE_LSE=lse is not None,
    )  # fmt: skip
    narrow = num_q_heads in NARROW_HEADS
    fast = FAST_NARROW if narrow else _FAST
    if launches is not None:
        from kv_kernels.paged_attention._bound import Launch

        launches.append(Launch(fast, key, grid, args, kwargs))
    elif key is not None:
        fast(key, grid, args, kwargs)
    else:
        (sm90_mla_narrow_kernel if narrow else sm90_mla_kernel)[grid](*args, **kwargs)


def _constexprs(num_q_heads: int, fp8: bool) -> dict[str, Any]:
    """The launch's schedule constants: this kernel's (two consumer warpgroups) or, at 16 / 32
    heads, :mod:`._sm90_mla_narrow`'s (one, and ``HEADS``)."""
    kw: dict[str, Any] = dict(NBUF_=NBUF, P_WARPS=4, P_REGS_=P_REGS_FP8 if fp8 else P_REGS)
    if num_q_heads in NARROW_HEADS:
        kw.update(HEADS=num_q_heads, num_warps=4)
        if fp8:  # (its producer loads a whole tile at once: _sm90_mla_fp8.producer_fp8_whole)
            kw.update(P_REGS_=P_REGS_FP8_WHOLE)
    else:
        kw.update(num_warps=8)
    return kw


def aot_case(
    *,
    dtype: str = "bf16",
    cache: str | None = None,
    kv_scale: int = 0,
    block_size: int = 64,
    split: bool = False,
    write_lse: bool = False,
    heads: int = 128,
) -> dict[str, Any]:
    """The kernel as :func:`launch_sm90_mla` launches it, for an ahead-of-time sm_90 build
    (``kv_kernels.aot.aot_compile`` keywords, as :func:`._sm90_prefill.aot_case`): ``cache``
    the latent's type (the query's ``dtype`` by default; ``"fp8e4nv"`` an e4m3 latent, whose
    scale ``kv_scale`` 1 rides as a float, 2 as a tensor); ``heads`` the query heads (16, 32:
    :mod:`._sm90_mla_narrow`'s kernel)."""
    cache = cache or dtype
    pointers = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{cache}", "bt_ptr": "*i32",
                "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "k_scale_ptr": "*fp32",
                "v_scale_ptr": "*fp32", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}  # fmt: skip
    constexprs = dict(
        BLOCK_SIZE=block_size, KV_SCALE=kv_scale, SPLIT=split, WRITE_LSE=write_lse,
        **_constexprs(heads, cache.startswith("fp8")),
    )  # fmt: skip
    kernel = sm90_mla_narrow_kernel if heads in NARROW_HEADS else sm90_mla_kernel
    strides = [n for n in kernel.arg_names if n.startswith("stride_")]
    # (the scales' strides are 0: one latent head)
    aligned = [n for n in strides if n not in ("stride_lh", "stride_ks", "stride_vs")]
    return aot_case_spec(
        kernel, module=__name__, pointers=pointers,
        floats=("qk_scale_log2", "k_scale_val", "v_scale_val"), constexprs=constexprs,
        aligned_strides=aligned,
    )  # fmt: skip


#: bound launches (kv_kernels._launch)
_FAST = FastLauncher(sm90_mla_kernel)
