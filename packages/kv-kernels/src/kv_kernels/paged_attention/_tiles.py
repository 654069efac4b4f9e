"""Tile shapes of the paged-attention kernel and the one builder of its compile-time constants,
shared by the launchers (:mod:`.triton`) and the ahead-of-time specs (:mod:`._aot`), so CI
compiles exactly what runs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AttentionConfig",
    "arch_and_sms",
    "kernel_constexprs",
    "pick_num_splits",
    "pow2",
    "select_config",
    "split_head",
]

#: Shared memory we let one program's pipeline buffers take (bytes): the sm_90 / sm_80 limits
#: (227 KiB / 163 KiB per block) less room for the Q tile, P and the compiler's scratch.
_SMEM_BUDGET = {90: 176 * 1024, 80: 112 * 1024}


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shapes of one launch class (``"decode"`` or ``"prefill"``)."""

    block_m: int  # query rows per program: block_q tokens x group heads (padded to a power of 2)
    block_q: int  # query tokens per program
    tile_n: int  # KV tokens per inner step
    num_warps: int
    num_stages: int
    #: q heads of one kv head per program: the whole GQA group, or a chunk of it when the group
    #: times the value width would not fit the accumulator (MLA: 128 heads x 512); 0 (a config
    #: made by hand, e.g. a tuning sweep) means the whole group
    heads_per_program: int = 0
    #: GPU waves the decode KV splits aim for (:func:`pick_num_splits`); 1: the most splits whose
    #: programs still fit one wave of ``programs_per_sm`` programs on every SM
    waves: int = 2
    #: a cap on registers a thread (ptxas ``maxnreg``; 0: the compiler's choice), for configs
    #: where occupancy, not spills, is the limit
    max_registers: int = 0
    #: read the unmasked KV tiles by TMA (one box per tile and operand, into shared memory
    #: asynchronously) where the launcher finds the cache's strides aligned for it; needs sm_90,
    #: 16-bit pages, a tile inside one page and power-of-two heads without a tail
    tma: bool = False
    #: 1-byte pages (fp8 / int8) with 16-bit queries: upcast K / V in the layout they are loaded
    #: in by packed PTX conversions and run q.K (and P.V for per-tensor scales) as fp16 MMAs with
    #: q scaled per row (``KV_UPCAST`` in :mod:`._kernels`, why in :mod:`._upcast`)
    kv_upcast: bool = False
    #: with ``waves=1``: programs resident on an SM at once (1: programs that fill an SM)
    programs_per_sm: int = 1
    #: with ``kv_upcast``: read the 8-bit K tile from shared memory in the MMA operand's layout
    #: and upcast it there, in registers, instead of storing an fp16 copy and reloading it
    #: (``K_DIRECT``, why in :mod:`._upcast`)
    k_direct: bool = False
    #: the same for V, its columns renamed so a thread's bytes are adjacent (``V_DIRECT``)
    v_direct: bool = False


def split_head(head_size: int) -> tuple[int, int]:
    """``(main, tail)`` column tiles of a head: a power of two and a power-of-two tail >= 16 that
    sum to ``head_size`` (192 = 128 + 64, MLA's 576 = 512 + 64), so q.k does no padded work;
    ``(pow2(head_size), 0)`` when no such split exists (a tail < 16 is below the MMA's K)."""
    main = 1 << (head_size.bit_length() - 1)
    tail = head_size - main
    if tail >= 16 and tail & (tail - 1) == 0:
        return main, tail
    return pow2(head_size), 0


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def select_config(
    kind: str,
    *,
    head_size: int,
    head_size_v: int,
    group: int,
    block_size: int,
    elem_bytes: int = 2,
    arch: int = 90,
    v_from_k: bool = False,
    inline_scales: bool = False,
) -> AttentionConfig:
    """Tile shapes for ``kind`` that fit the arch's shared memory.

    A function of static properties only (head sizes, GQA group, kernel block size, dtype, arch),
    never of the batch: that is what keeps a fixed ``num_splits`` batch-invariant.

    Decode is bandwidth-bound: 16 rows (the smallest tensor-core tile; a decode step of a GQA
    group of 4 fills 4 of them, speculative steps of up to 4 tokens fill all) and deep
    pipelines of KV tiles. Prefill is compute-bound: 128 rows (64 past head size 128) so each
    KV tile feeds two warpgroups' MMAs.

    Rows are capped so the float32 accumulator ``[block_m, pow2(head_size_v)]`` stays within
    16K values (64 registers a thread at 8 warps, beside the q tile's); a larger GQA group is
    split over programs that each take ``heads_per_program`` heads of one token. MLA decode
    (``v_from_k``: 128 heads over one 576-wide latent whose first 512 columns are V) is the
    exception: at 128 heads a latent byte feeds ~240 FLOPs, so it is MMA-bound, and 64 rows (two
    programs per token) over 8 warps run Hopper's warpgroup MMA where 32 rows fall back to
    ``mma.sync``; such programs fill an SM each, so their KV splits fill one wave (``waves=1``).

    Decode sweeps, H200 (``bench_paged_attention.py --tune-paths``, ms at 64 x 4k / 8 x 32k):
    MLA 128 heads 0.385 / 0.405 at 64 rows, 64-token tiles, 1 stage, vs 0.89 / 0.88 at 32 rows
    (sm_90 build: 255 registers, 8 bytes spilled); MLA at 16 heads (tensor-parallel 8) 0.117 at
    64-token tiles over 8 warps vs 0.136; DiffKV 192/128 0.332 / 0.329 at 128-token tiles over
    8 warps with 4 waves of splits vs 0.355 / 0.344; 1-byte caches 0.290 (fp8 per tensor) and
    0.328 (int8 per token and head) at 2 stages vs 0.366 / 0.357 at 4, then 0.257 / 0.276 with
    registers capped at 128 (they stay at 0.45-0.5 of the copy: issue-bound, the upcast of the
    8-bit tiles and fp8's element-wise widening through f16 cost instructions per byte).
    """
    d_main, d_tail = split_head(head_size)
    d_pad, dv_pad = d_main + d_tail, pow2(head_size_v)
    budget = _SMEM_BUDGET.get(arch, _SMEM_BUDGET[80])
    # one KV token of K (and V, unless it is K's own columns) in shared memory
    row_bytes = (d_pad + (0 if v_from_k else dv_pad)) * max(elem_bytes, 2)
    max_rows = max(16, 16384 // dv_pad)
    if kind == "decode":
        block_m = max(16, pow2(group))
        # H100, head 128, bf16: every tile_n in 32..128 and 2..4 stages read within 1% of each
        # other (2.85-2.94 TB/s of a 3.0 TB/s copy): bandwidth comes from occupancy and splits.
        tile_n = 64 if d_pad + dv_pad <= 256 else 32
        num_warps = 4
        num_stages = 2 if elem_bytes == 1 else 4
        waves = 2
        programs_per_sm = 1
        # 1-byte pages: the upcast tiles take 254 registers a thread (ncu, H200: 2 programs an
        # SM, 12.5% occupancy, issue-bound); capped at 128, 4 fit: 64 x 4k 0.377 -> 0.276 ms
        # (int8 per token and head), 0.289 -> 0.257 ms (fp8 per tensor)
        max_registers = 128 if elem_bytes == 1 else 0
        # 1-byte pages: upcast in the load layout, fp16 MMAs (AttentionConfig.kv_upcast). Compile-
        # time proxies, not GPU timings (sm_90 SASS of the decode kernel's unmasked KV loop, bf16
        # queries, 32 / 8 heads, head 128, page 16, one 64-token tile of K and V per iteration):
        # fp8 per tensor 867 -> 434 instructions a tile (64 byte-wise shared loads LDS.U8 -> 0,
        # 128 F2F.BF16.F16 -> 0; registers 128 -> 116, no spills), i.e. 0.21 -> 0.11 warp-
        # instructions per KV byte against bf16 pages' 0.053; page 128: 749 -> 353. int8 per
        # token and head (P.V stays bf16: p * s_v may leave fp16's range) 899 -> 669, spills 72
        # -> 4 bytes; fp8 per token and head 839 -> 618. sm_80 (e5m2 / int8, 32-token tiles):
        # 691 -> 296 / 562 -> 441. Shared memory grows by the 16-bit tiles (22 -> 53 KiB at
        # sm_90: still 4 programs an SM, as the 128-register cap allows).
        # Timed (H100, bench_paged_attention.py --tune-paths, same process): fp8 per tensor
        # 64 x 4k 0.263 -> 0.240 ms (2.04 -> 2.23 TB/s), 8 x 32k 0.266 -> 0.246 ms; but per
        # token and head (``inline_scales``) slower: int8 8 x 32k 0.277 -> 0.354 ms, fp8 64 x 4k
        # 0.297 -> 0.343 ms, so those pages kept the plain upcast.
        # Then ncu (H100, fp8 per tensor 64 x 4k, 2.18 TB/s): bound by shared memory (L1/TEX
        # 83%, DRAM 57%): per 64-token tile 125 KiB of shared traffic for 16 KiB of KV (PTX of
        # the loop: 16 cp.async, 18.5 ld, 34.5 st, 56 ldmatrix), 40 KiB of it each for K and V
        # (bytes read, fp16 stored, fp16 reloaded) and 16 KiB the q operand, reloaded every
        # tile by Triton's choice. k_direct / v_direct read K / V as bytes in the MMA operand's
        # layout (_upcast): 125 -> 93 KiB (K: one 8 KiB ldmatrix pass) -> 61 KiB (V too: 8 KiB
        # of 32-bit loads, 4-way bank conflicts), shared memory 53 -> 39 -> 22.5 KiB, registers
        # 116 -> 110 -> 109, no spills, no byte loads; SASS loop 434 -> 454 -> 527 instructions
        # (q read by 64-bit loads instead of ldmatrix, V's 4 x 4 byte transposes). Page 128:
        # 124 -> 92 -> 60 KiB, 106 -> 101 -> 100 registers. Same on triton 3.6 (attn_decode 128
        # registers with 4 bytes spilled on all three). Per token and head (int8, page 16), with
        # kv_upcast and both: 66 KiB, 128 registers, no spills (plain upcast: 66 KiB with 64
        # byte-wise loads a thread, 72 / 96 bytes spilled; kv_upcast alone 130 KiB); so those
        # pages take the fp16 q.K again. Timed (H100, --tune-paths, one process): fp8 per
        # tensor with K and V as bytes 64 x 4k 0.205 ms (2.61 TB/s, 0.87 of the copy), 8 x 32k
        # 0.209 (S=8); per token and head with K as bytes and V's fp16 copy: int8 / fp8 64 x 4k
        # 0.251 / 0.251 ms (2.20 TB/s), int8 8 x 32k 0.254 (S=8), vs 0.273 / 0.265 / 0.269
        # with V as bytes too (their P.V stays bf16, which has no packed byte conversion).
        kv_upcast = elem_bytes == 1
        if d_tail and not v_from_k:
            # split head (DiffKV 192 = 128 + 64 over V 128). Registers capped at 128 so two
            # programs of 8 warps share an SM: once V's addresses became K's plus an immediate
            # (K_START / V_START), ptxas took 148 and one program an SM, and the H100 read 64 x
            # 4k / 8 x 32k in 0.4965 / 0.4817 ms against 0.4667 / 0.4621 (sm_90 loop at 128:
            # 400 instructions a tile, was 475; 8 bytes spilled outside it)
            tile_n, num_warps, num_stages, waves = 128, 8, 2, 4
            max_registers = 128
        elif v_from_k and block_m <= max_rows:
            # MLA with few heads per GPU (tensor parallel): bandwidth-bound. 64-token tiles over
            # 4 warps, 2 stages, and the split rule of two programs an SM (shared memory holds
            # one: 147 KiB of latent tiles), which picks S=4 at 64 x 4k and S=32 at 8 x 32k.
            # --tune-paths, graph-timed, against the previous 32-token tiles at 3 stages capped
            # at 128 registers: 64 x 4k H100 0.1171 vs 0.1185 ms, H200 0.0867 vs 0.1018 (0.82
            # of its copy vs 0.69), the sweep's best on both; 8 x 32k H100 0.1180 vs 0.1203 at
            # S=16 (S=32 not in that sweep), H200's best 0.0933 at more splits than the old 16.
            # (do_bench sweeps of earlier sessions measured the host: not comparable.)
            tile_n, num_warps, num_stages, waves = 64, 4, 2, 1
            programs_per_sm = 2
        if block_m > max_rows:
            if v_from_k and arch >= 90:
                # MLA, MMA-bound (see above): 64 rows for the warpgroup MMA, one program an SM.
                # 2 stages of 64-token tiles (16-bit latents): the program takes the SM's whole
                # shared memory (216 KiB of 227: two 72 KiB tiles and the 72 KiB q), so the
                # budget is the SM's less 8 KiB. At 1 stage the tile went through registers
                # into shared memory, beside the 128 accumulator registers (sm_90: 1.5 KiB a
                # thread spilled; 268 bytes, outside the hot path mostly, at 2). H200,
                # --tune-paths, graph-timed: 64 x 4k 0.2882 vs 0.3734 ms (S=1), 8 x 32k 0.3024
                # vs 0.3798 (S=8), the split counts the one-wave rule picks.
                block_m, tile_n, num_warps, num_stages, waves = 64, 64, 8, 1, 1
                if elem_bytes == 2:
                    num_stages, budget = 2, 227 * 1024 - 8 * 1024
            else:
                # 32 rows x 512 values over two warpgroups (64 accumulator registers a thread),
                # 32-token tiles of the 1152-byte latent rows
                block_m, tile_n, num_warps = max_rows, 32, 8
        if v_from_k and elem_bytes == 1:
            # An fp8 latent (issue 31): no register cap (MLA's programs hold a 512-wide
            # accumulator; the cap is for 1-byte K/V pages, whose programs fit 4 an SM), and K
            # is not read as bytes in the MMA operand's layout (``k_direct``, set below: V is
            # K's own tile, which then reaches the P.V operand a byte at a time). Compile-time
            # proxies, no GPU timings yet (sm_90 builds of the decode kernel, triton 3.9, bf16
            # queries, page 64): at 16 heads the shared-memory budget gives 32-token tiles at 2
            # stages; capped at 128 registers with K as bytes: 548 bytes a thread spilled, 256
            # byte-wise shared loads and 1172 SASS instructions a tile in the KV loop; uncapped
            # with K's fp16 copy (what runs): 241 registers, no spills, no byte loads, 612
            # instructions (0.033 a KV byte; the bf16 latent's 64-token tiles: 897, 0.024), 72
            # KiB of shared memory, so two programs an SM as the split rule assumes. At 128
            # heads the cap made ptxas fail ("Insufficient registers (128)"); uncapped: 255
            # registers and 352 bytes spilled, like the bf16 latent's 380. sm_80 (e5m2, 128
            # heads): 255 registers, 812 bytes spilled (K as bytes: none, but 64 byte loads).
            max_registers = 0
    elif kind == "prefill":
        block_m = 128 if max(d_pad, dv_pad) <= 128 else 64
        block_m = max(block_m, pow2(group))
        tile_n = 64
        # One warpgroup over the 128 rows, 2 stages (H100, 4 x 4096 causal, head 128, --tune,
        # after the epilogue stopped keeping the q rows live): page 16 383 TFLOP/s (3 stages
        # 358, 4 stages 357, 128-token tiles over 8 warps 348); page 128 with TMA 497 (3
        # stages 420, gathers 425-435). Before that fix 3 stages led (H200: page 16 316 vs 235,
        # TMA 438 vs 421): the third buffer hid the spills' traffic.
        num_warps = 4
        num_stages = 2
        waves = 2
        max_registers = 0
        programs_per_sm = 1
        kv_upcast = False
        if block_m > max_rows:
            block_m, tile_n, num_warps = max_rows, 32, 8
        if arch >= 90 and elem_bytes == 2 and block_m == max_rows == 128 and block_size % tile_n:
            # Pages smaller than a tile (gathered by pointers, no TMA box): 256 rows over two
            # warpgroups (the same 128 accumulator registers a thread as 128 rows over one), so
            # each tile's gathers serve twice the rows (sm_90 build, page 16: 255 registers, no
            # spills, against 224 bytes a thread spilled at 128 rows). 4 x 4096 causal, --tune,
            # graph-timed: H100 415 vs 404 TFLOP/s, H200 410 vs 395.
            block_m, num_warps = 256, 8
    else:
        raise ValueError(f"config kind={kind!r} must be 'decode' or 'prefill'")
    if elem_bytes == 1:
        # fp8 / int8 pages are upcast to 16 bits before the MMA: a second copy of each tile.
        row_bytes += (d_pad + (0 if v_from_k else dv_pad)) * 2
    if block_m * d_pad * 2 > 16 * 1024:
        # a large q tile (MLA: 64 x 576 bf16 = 72 KiB) is an MMA operand in shared memory too
        budget -= block_m * d_pad * 2
    while num_stages > 2 and num_stages * tile_n * row_bytes > budget:
        num_stages -= 1
    while tile_n > 16 and num_stages * tile_n * row_bytes > budget:
        tile_n //= 2
    heads = min(group, block_m)
    # TMA boxes: a prefill tile inside one page of 16-bit values, head and value widths whole
    # powers of two (a box cannot mask columns), and Hopper's copy engine
    tma = (
        kind == "prefill"
        and arch >= 90
        and elem_bytes == 2
        and not v_from_k
        and d_tail == 0
        and d_pad == head_size
        and dv_pad == head_size_v
        and block_size % tile_n == 0
    )
    # (decode over 1-byte pages, see there; not an MLA latent, whose V is K's tile: see the fp8
    # latent above)
    k_direct = kv_upcast and not v_from_k
    v_direct = kv_upcast and not inline_scales
    return AttentionConfig(
        block_m,
        block_m // heads,
        tile_n,
        num_warps,
        num_stages,
        heads,
        waves,
        max_registers,
        tma,
        kv_upcast,
        programs_per_sm,
        k_direct,
        v_direct,
    )


def pick_num_splits(
    *,
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    tile_n: int,
    num_sms: int,
    waves: int = 2,
    programs_per_sm: int = 1,
    min_tiles: int = 16,
) -> int:
    """KV split count for a decode batch: enough programs for ~``waves`` waves of the GPU, while
    each split keeps at least 8 KV tiles (fewer and the merge and the prologue dominate).
    ``waves=1``: the most splits (a power of two, at most 64) that still fit one wave of
    ``programs_per_sm`` programs an SM, each keeping at least ``min_tiles`` tiles (the sm_90
    Gluon decode and MLA kernels' rule too, with their own tiles, programs an SM and 8)."""
    programs = max(1, num_seqs * num_kv_heads)
    tiles = -(-max(max_seq_len, 1) // tile_n)
    splits = 1
    if waves == 1:
        slots = num_sms * programs_per_sm
        while splits < 64 and programs * splits * 2 <= slots and tiles >= 2 * min_tiles * splits:
            splits *= 2
        return splits
    while splits < 64 and programs * splits < waves * num_sms and tiles >= 16 * splits:
        splits *= 2
    return splits


@functools.lru_cache(maxsize=16)
def _device_info(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major * 10 + props.minor, props.multi_processor_count


def arch_and_sms(device: torch.device) -> tuple[int, int]:
    """(arch for the tile tables, SM count) of ``device``; the interpreter pretends to be an H100
    so its configs match the GPU's."""
    if device.type != "cuda":
        return 90, 132
    arch, sms = _device_info(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    return (90 if arch >= 90 else 80), sms


def kernel_constexprs(
    cfg: AttentionConfig,
    *,
    kind: str,
    head_size: int,
    head_size_v: int,
    block_size: int,
    group: int,
    causal: bool,
    sliding_window: bool,
    sinks: bool,
    softcap: bool,
    alibi: bool,
    kv_scale_mode: int,
    split: bool,
    write_lse: bool,
    dot_ieee: bool,
    check: bool,
    v_from_k: bool = False,
    scale_words: bool = False,
    scale_plane: bool = False,
    row_align: int = 1,
    tma: bool = False,
    kv_bytes: int = 2,
    ptx: bool = True,
    k_start: int = 0,
    v_start: int | None = None,
) -> dict[str, Any]:
    """Every ``tl.constexpr`` of :func:`~._kernels.paged_attention_kernel` for one launch.

    ``kv_scale_mode``: 0 unquantized, 1 scales as scalar arguments, 2 scales read from tensors,
    3 per-token-head scales inline in the page (``scale_words``: read as aligned float32 words;
    ``scale_plane``: in each page's scale plane, kv-spec's ``scale_plane``, not in the rows).
    ``FOLD_LOG2`` folds the base-2 conversion into the q.k scale, which is exact only when nothing
    (softcap, ALiBi) acts on the logits between the scale and the exponent. ``row_align``: see
    :func:`kv_kernels._common.row_align`. ``tma``: the launcher passes TMA descriptors (only
    where ``cfg.tma`` and the cache's strides allow it). ``kv_bytes``: the cache's element size
    (``cfg.kv_upcast`` acts on 1-byte pages with 16-bit queries only); ``ptx``: inline PTX may
    run (off under the interpreter, which converts by ``.to`` instead). ``k_start`` /
    ``v_start``: the first C element of K / V in a token row (the layout's ``k_range[0]`` /
    ``v_range[0]``; by default K then V packed, V at K's own columns with ``v_from_k``).
    """
    if kind not in ("decode", "prefill"):
        raise ValueError(f"kind={kind!r} must be 'decode' or 'prefill'")
    d_main, d_tail = split_head(head_size)
    heads = cfg.heads_per_program or group
    upcast = bool(cfg.kv_upcast and kv_bytes == 1 and not dot_ieee)
    if v_from_k and (head_size_v != d_main or d_tail == 0):
        raise ValueError(
            f"v_from_k needs head_size_v={head_size_v} equal to the main tile {d_main} of "
            f"head_size={head_size} with a tail (MLA: 576 = 512 + 64)"
        )
    if v_start is None:
        v_start = k_start if v_from_k else k_start + head_size
    return dict(
        HEAD_SIZE=head_size,
        HEAD_SIZE_V=head_size_v,
        K_START=k_start,
        V_START=v_start,
        D_PAD=d_main,
        DV_PAD=pow2(head_size_v),
        D_TAIL=d_tail,
        V_FROM_K=v_from_k,
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEADS_PER_PROG=heads,
        HEAD_CHUNKS=-(-group // heads),
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        TILE_N=cfg.tile_n,
        SEQ_PER_PROGRAM=kind == "decode",
        CAUSAL=causal,
        USE_WINDOW=sliding_window,
        USE_SINKS=sinks,
        USE_SOFTCAP=softcap,
        USE_ALIBI=alibi,
        FOLD_LOG2=not (softcap or alibi),
        KV_SCALE=kv_scale_mode,
        SCALE_WORDS=scale_words,
        SCALE_PLANE=scale_plane,
        SPLIT=split,
        WRITE_LSE=write_lse,
        DOT_IEEE=dot_ieee,
        CHECK=check,
        ROW_ALIGN=row_align,
        # (a hand-made config may ask for TMA where a tile spans pages: the boxes cannot)
        TMA=bool(tma and cfg.tma and block_size % cfg.tile_n == 0),
        KV_UPCAST=upcast,
        PTX=ptx,
        K_DIRECT=upcast and cfg.k_direct,
        # (the column renaming gives a thread 4 adjacent bytes where the warps split V's width
        # into 32-column groups, one each (head 128 over 4 warps); elsewhere it would read
        # bytes one by one, so V keeps its fp16 copy; MLA's V is K's own tile)
        V_DIRECT=upcast
        and cfg.v_direct
        and not v_from_k
        and pow2(head_size_v) == 32 * cfg.num_warps,
    )
