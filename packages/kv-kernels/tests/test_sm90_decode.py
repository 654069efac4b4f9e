"""The Gluon decode kernel over 1-byte pages for sm_90 (:mod:`kv_kernels.paged_attention._sm90_decode`).

On the CPU (CI): the kernel compiles for sm_90 ahead of time through ptxas for every served shape
family, its tiles copied by ``cp.async`` (16 bytes, or 8 for per-token-head pages' 8-byte-aligned
rows) into a per-lane shared-memory ring, read back by 16-byte shared loads straight into
``mma.sync`` operands, fp8 converted by the hardware's packed conversion; which launches it
serves (and which stay with the Triton kernel); how it splits KV; bad strides get a ValueError.
Gluon has no interpreter, so its results are checked on an H100 / H200 (``-m gpu``): against the
float64 oracle (bounded by the bf16 torch reference's own error) with per-tensor and per-KV-head
scales, per-token-head pages, splits, LSE and speculative rows; planted bugs (a wrong page, a
dropped or doubled scale) that the same check must catch; caches past 2^31 elements (fp8 per
tensor, int8 per token and head); and the environment switch back to the Triton kernel.
"""

from __future__ import annotations

import pytest
import torch
from kv_kernels.aot import build_problems
from kv_kernels.cache import allocate_kv_cache, layer_view, scale_plane_view
from kv_kernels.paged_attention import _sm90_decode, paged_attention
from kv_kernels.paged_attention._sm90_decode import (
    aot_case,
    pick_decode_splits,
    sm90_decode_eligible,
)
from kv_kernels.reshape_and_cache import reshape_and_cache
from kv_kernels.testing import (
    assert_close_to_oracle,
    attention_oracle_paged,
    check_close_to_oracle,
    plant_wrong_page,
)
from kv_kernels.testing_attention import (
    assert_triton_matches_oracle,
    make_quant_batch,
    quant_oracle,
    run_batch,
)
from kv_spec import KVCacheLayout

_PTX = {
    "mma": r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32",
    "cp_async_16": r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10",
    "cp_async_8": r"cp\.async\.ca\.shared\.global \[[^]]*\], \[[^]]*\], 0x8",
    "ld_shared_v4": r"ld\.shared\.v4\.b32",
    "fp8_pairs": r"cvt\.rn\.f16x2\.e(4m3|5m2)x2",
    "shared_stores": r"st\.shared",
}

# (q dtype, cache, group, page, causal, kv scale mode, split, lse): every served dtype, fp8
# format, group and page shape at least once
_CASES = [
    ("bf16", "fp8e4nv", 4, 16, True, 1, False, False),
    ("fp16", "fp8e4nv", 8, 128, True, 2, True, True),
    ("bf16", "fp8e5", 1, 32, False, 0, True, False),
    ("bf16", "fp8e4nv", 16, 64, True, 1, False, True),
    ("fp16", "fp8e5", 2, 16, False, 2, False, False),
    # per-token-head pages (mode 3): 264-byte rows, scales copied beside the tiles
    ("bf16", "i8", 4, 16, True, 3, True, False),
    ("fp16", "fp8e4nv", 8, 64, True, 3, False, True),
    # the same scales in each page's scale plane: rows of 256 bytes, 16-byte copies
    ("bf16", "i8", 4, 16, True, 3, True, False, "plane"),
]


def _case_id(c: tuple) -> str:
    dt, cache, g, n, causal, ks, split, lse, *plane = c
    return (
        f"{dt}-{cache}-g{g}-n{n}-s{ks}"
        + ("-causal" if causal else "")
        + ("-split" if split else "")
        + ("-lse" if lse else "")
        + ("-plane" if plane else "")
    )


@pytest.fixture(scope="module")
def aot_results(aot_compile_checks) -> dict[str, dict]:
    cases = []
    for c in _CASES:
        dt, cache, g, n, causal, ks, split, lse, *plane = c
        case = aot_case(
            dtype=dt, cache=cache, group=g, block_size=n, causal=causal, kv_scale=ks, split=split,
            write_lse=lse, scale_plane=bool(plane),
        )  # fmt: skip
        cases.append({"id": _case_id(c), "count": _PTX, **case})
    return aot_compile_checks(cases)


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_compiles_for_sm90(case: tuple, aot_results: dict[str, dict]) -> None:
    res = aot_results[_case_id(case)]
    # (per-token-head rows are 8-byte aligned: their tiles move 8 bytes a copy; with a scale
    # plane the rows are K and V, 256 bytes)
    copies = "cp_async_8" if case[5] == 3 and len(case) == 8 else "cp_async_16"
    problems = build_problems(res, arch=90, present=("mma", copies, "ld_shared_v4"))
    assert not problems, problems
    counts = res["counts"]
    if case[1] == "fp8e4nv":  # (e5m2 widens by a byte shuffle, no conversion instruction)
        assert counts["fp8_pairs"] > 0, counts
    # K and V reach shared memory only by cp.async and leave it by reads straight into operand
    # registers: no store of a tile (a 32-token tile of K and V would be 32+ stores; the 18-27
    # there are q's one-time change of layout and the epilogue's)
    assert counts["shared_stores"] <= 30, counts


_FEATURES_OFF = dict(
    sliding_window=False, sinks=False, softcap=False, alibi=False, kv_scale_mode=1, split=True,
    check=False, v_from_k=False, scale_words=False, causal=True, write_lse=True,
)  # fmt: skip


def _eligible(**over) -> bool:
    kw = dict(
        arch=90, q_dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn, head_size=128,
        head_size_v=128, group=4, block_q=4, scale=0.088, compiled=True,
        features=dict(_FEATURES_OFF), peak_tbps=4.9,
    )  # fmt: skip
    feats = over.pop("features", {})
    kw.update(over)
    kw["features"].update(feats)
    return sm90_decode_eligible(**kw)


def test_serves_the_plain_fp8_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KV_KERNELS_SM90_DECODE", raising=False)
    assert _eligible()
    assert _eligible(q_dtype=torch.float16, cache_dtype=torch.float8_e5m2)
    assert _eligible(group=16, block_q=1, features={"causal": False, "kv_scale_mode": 0})
    assert _eligible(group=1, block_q=16, features={"kv_scale_mode": 2, "split": False})
    # per-token-head pages, int8 or fp8, rows 8-byte aligned (264 bytes) or 16
    assert _eligible(cache_dtype=torch.int8, features={"kv_scale_mode": 3, "row_align": 8})
    assert _eligible(features={"kv_scale_mode": 3, "row_align": 1, "scale_words": True})
    # an H100's memory peak: inline rows stay with the Triton kernel, a scale plane's come here
    assert not _eligible(peak_tbps=3.35, features={"kv_scale_mode": 3, "row_align": 8})
    assert _eligible(peak_tbps=3.35, features={"kv_scale_mode": 3, "scale_plane": True})


@pytest.mark.parametrize(
    "over",
    [
        {"arch": 80},
        {"arch": 100},  # no claim for chips it was not measured on
        {"compiled": False},  # the interpreter: Gluon has none
        {"cache_dtype": torch.bfloat16},  # 16-bit pages: the Triton kernel is at the copy limit
        {"cache_dtype": torch.int8},  # int8 only with inline per-token-head scales
        {"features": {"kv_scale_mode": 3, "row_align": 4}},  # rows not 8-byte aligned
        # per-token-head pages on an H100-class memory (3.35 TB/s): the Triton kernel is faster
        {"features": {"kv_scale_mode": 3, "row_align": 8}, "peak_tbps": 3.35},
        {"features": {"kv_scale_mode": 3, "row_align": 8}, "peak_tbps": 0.0},  # (unknown)
        {"q_dtype": torch.float32},
        {"head_size": 64, "head_size_v": 64},
        {"head_size": 192, "head_size_v": 128},
        {"head_size": 576, "head_size_v": 512},
        {"group": 32, "block_q": 1},
        {"group": 4, "block_q": 2},  # the decode class's rows must be this kernel's 16
        {"scale": -0.1},
        {"aligned_rows": False},  # a strided row, or a cache base off a 16-byte boundary
        {"features": {"k_start": 8}},  # (copies start at K's and V's first bytes)
        *({"features": {k: v}} for k, v in [
            ("sliding_window", True), ("sinks", True), ("softcap", True), ("alibi", True),
            ("check", True), ("v_from_k", True),
        ]),
    ],
)  # fmt: skip
def test_leaves_the_rest_to_the_triton_kernel(over: dict) -> None:
    assert not _eligible(**over)


def test_fp8_pages_do_not_depend_on_the_memory() -> None:
    assert _eligible(peak_tbps=3.35)
    assert _eligible(peak_tbps=0.0)


def test_environment_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_KERNELS_SM90_DECODE", "0")
    assert not _eligible()


def test_dispatch_needs_a_compiled_run_on_cuda_tensors() -> None:
    from kv_kernels.paged_attention.triton import _gluon_serves

    q = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(4, 8, 16, 256, dtype=torch.float8_e4m3fn)
    feats = dict(_FEATURES_OFF, ptx=True)
    assert not _gluon_serves("decode", q, kv, 128, 0.088, feats, block_q=4)  # CPU tensors


def test_splits_fill_one_wave_of_one_warp_programs() -> None:
    """One-warp programs: the most splits that fit one wave of PROGRAMS_PER_SM an SM, each
    keeping 8+ tiles."""
    slots = _sm90_decode.PROGRAMS_PER_SM * 132
    s = pick_decode_splits(num_seqs=64, num_kv_heads=8, max_seq_len=4096, num_sms=132)
    assert 64 * 8 * s <= slots < 64 * 8 * s * 2
    s = pick_decode_splits(num_seqs=8, num_kv_heads=8, max_seq_len=32768, num_sms=132)
    assert 8 * 8 * s <= slots < 8 * 8 * s * 2
    assert pick_decode_splits(num_seqs=256, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 1
    # short sequences are not cut below 8 tiles of 32 tokens a split
    assert pick_decode_splits(num_seqs=1, num_kv_heads=1, max_seq_len=1024, num_sms=132) == 4
    assert pick_decode_splits(num_seqs=1, num_kv_heads=1, max_seq_len=100, num_sms=132) == 1


def test_non_unit_row_stride_is_a_value_error() -> None:
    q = torch.zeros(2, 4, 256)[:, :, ::2]  # [2, 4, 128], column stride 2
    kv = torch.zeros(3, 1, 16, 256)
    with pytest.raises(ValueError, match=r"q\.stride\(-1\)=2.*contiguous last dimension"):
        _sm90_decode.launch_sm90_decode(
            q, kv, k_start=0, v_start=128, block_table=torch.zeros(2, 3, dtype=torch.int32),
            seq_lens=torch.tensor([8, 9]), query_start_loc=torch.tensor([0, 1, 2]), scale=0.1,
            causal=True, block_size=16, kv_scale_mode=0, scale_args=(q, q, 0, 0, 1.0, 1.0),
            scale_rows=None, row_align=1,
            out=torch.zeros(2, 4, 128), lse=None, part_out=q, part_lse=q, num_splits=1,
        )  # fmt: skip


# ---- on an sm_90 GPU ---------------------------------------------------------------------------

_ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not _ON_SM90, reason="the Gluon decode kernel is built for sm_90")
#: whether this card's memory is fast enough for per-token-head pages to come here (an H200: yes;
#: an H100: no, the Triton kernel serves them, and the same tests check its results)
_INLINE_HERE = _ON_SM90 and _sm90_decode.peak_memory_tbps(0) >= _sm90_decode.INLINE_MIN_TBPS


@pytest.fixture
def launches(count_gluon_launches) -> list[int]:
    """Counts the Gluon decode kernel's launches."""
    return count_gluon_launches("decode")


def _batch(*, q_lens, seq_lens, h=8, group=4, n=16, fmt="fp8_e4m3", qdtype=torch.bfloat16, seed=0,
           order="LBNHC"):  # fmt: skip
    """An fp8 cache whose pages outside the sequences hold nan (a read past a sequence shows),
    values spread over the format's range (x 0.7 of a unit normal, and a few large ones)."""
    torch.manual_seed(seed)
    d = 128
    pages = [-(-L // n) for L in seq_lens]
    nb = sum(pages) + 4
    layout = KVCacheLayout(
        order=order, num_layers=2, num_blocks=nb, num_kv_heads=h, block_size=n, head_size=d,
        head_size_v=d, dtype=fmt, kv_quant="fp8_per_tensor",
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, "cuda", zero=False), layout, 1)
    kv.copy_(torch.full(kv.shape, float("nan"), device="cuda").to(kv.dtype))
    perm = torch.randperm(nb, device="cuda").to(torch.int32)
    table = torch.full((len(seq_lens), max(pages) + 3), -1, dtype=torch.int32, device="cuda")
    used = 0
    for s, (p, L) in enumerate(zip(pages, seq_lens, strict=True)):
        table[s, :p] = perm[used : used + p]
        used += p
        rows = torch.randn(p * n, h, 2 * d, device="cuda") * 0.7
        rows[torch.rand(rows.shape, device="cuda") < 0.01] *= 40.0
        rows[L:] = float("nan")  # the last page's rows past the sequence
        kv[table[s, :p].long()] = rows.view(p, n, h, 2 * d).transpose(1, 2).to(kv.dtype)
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    q = torch.randn(int(qsl[-1]), h * group, d, dtype=qdtype, device="cuda")
    return dict(
        q=q, kv=kv, layout=layout, block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), qsl=qsl,
        max_query_len=max(q_lens),
    )  # fmt: skip


# decode rows over contexts that end mid-page and mid-tile, one token long, and long ones
_L = [5000, 1, 129, 2100, 33, 900, 31]


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"])
@pytest.mark.parametrize(("group", "n"), [(1, 16), (4, 64), (16, 128)])
@pytest.mark.gpu
@needs_sm90
def test_gpu_every_order(order: str, group: int, n: int, launches: list[int]) -> None:
    """Every physical order (per-layer and cross-layer views, of the second of two layer slots)
    at small, middle and whole-tile pages: the Gluon decode kernel serves it to the oracle's
    bound, or leaves it to the Triton kernel — it never fails to build."""
    b = _batch(q_lens=[1] * len(_L), seq_lens=_L, group=group, n=n, h=2, order=order)
    assert_triton_matches_oracle(b, k_scale=0.75, v_scale=1.25)
    assert launches, "the Gluon decode kernel did not serve an eligible launch"


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(fmt="fp8_e5m2", qdtype=torch.float16, n=128, group=8),
        dict(group=1, n=32),
        dict(group=16, h=2, n=64),
        dict(group=2, n=16, fmt="fp8_e5m2"),
    ],
    ids=["e4m3-bf16-g4-n16", "e5m2-fp16-g8-n128", "e4m3-g1-n32", "e4m3-g16-n64", "e5m2-g2-n16"],
)
@pytest.mark.parametrize("scales", ["floats", "tensor", "per_head"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_matches_the_oracle(
    shape: dict, scales: str, causal: bool, launches: list[int]
) -> None:
    group = shape.get("group", 4)
    b = _batch(q_lens=[1] * len(_L), seq_lens=_L, **shape)
    h = b["kv"].shape[1]
    kw: dict = {"causal": causal}
    if scales == "floats":  # (two floats ride as kernel arguments)
        kw.update(k_scale=0.75, v_scale=1.25)
    elif scales == "tensor":
        kw.update(k_scale=0.75, v_scale=torch.tensor([1.25], device="cuda"))
    elif scales == "per_head":
        kw.update(
            k_scale=torch.rand(h, device="cuda") + 0.5, v_scale=torch.rand(h, device="cuda") + 0.5
        )
    assert_triton_matches_oracle(b, **kw)
    assert launches, "the Gluon kernel did not serve the decode launch"
    if group <= 4:
        # speculative rows: up to 16 / group query tokens a sequence, causal among themselves
        spec = _batch(q_lens=[16 // group, 1, 2, 16 // group], seq_lens=[700, 40, 33, 16], **shape)
        assert_triton_matches_oracle(spec, **kw)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.gpu
@needs_sm90
def test_gpu_fixed_splits_and_lse(splits: int, launches: list[int]) -> None:
    b = _batch(q_lens=[1, 1, 1], seq_lens=[4000, 64, 1000])
    assert_triton_matches_oracle(b, k_scale=0.5, v_scale=2.0, num_splits=splits)
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_mixed_batch_with_prefill(launches: list[int]) -> None:
    """A batch with prefill chunks: the Triton kernel takes those, this kernel the decode rows."""
    b = _batch(q_lens=[300, 1, 0, 64, 1, 4], seq_lens=[300, 5000, 0, 2100, 129, 900])
    assert_triton_matches_oracle(b, k_scale=0.75, v_scale=1.25)
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_catches_a_wrong_page(launches: list[int]) -> None:
    """A planted wrong page (one block-table entry pointing at another block) must fail the same
    oracle check: the tolerance can fail."""
    b = _batch(q_lens=[1, 1], seq_lens=[900, 1200])
    assert_triton_matches_oracle(
        b, k_scale=0.75, v_scale=1.25
    )  # the same batch with its true pages passes
    bad_table = plant_wrong_page(b["block_table"], [900, 1200], 16, b["layout"].num_blocks, page=20)
    bad = dict(b, block_table=bad_table)
    got = run_batch(bad, "triton", k_scale=0.75, v_scale=1.25)
    oracle, _ = attention_oracle_paged(
        b["q"], b["kv"], b["layout"], b["block_table"], b["seq_lens"], b["qsl"], k_scale=0.75,
        v_scale=1.25,
    )  # fmt: skip
    assert not check_close_to_oracle(got, oracle, dtype=torch.bfloat16).ok
    assert launches


@pytest.mark.parametrize("dropped", ["k_scale", "v_scale"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_dropped_scale_is_caught(dropped: str, launches: list[int]) -> None:
    """A scale the kernel forgot (run with 1.0 where the oracle has 0.75 / 1.25) must fail the
    oracle check: K's changes the softmax's sharpness, V's the output's size."""
    b = _batch(q_lens=[1, 1], seq_lens=[900, 1200])
    scales = {"k_scale": 0.75, "v_scale": 1.25}
    got = run_batch(b, "triton", **dict(scales, **{dropped: 1.0}))
    oracle, _ = attention_oracle_paged(
        b["q"], b["kv"], b["layout"], b["block_table"], b["seq_lens"], b["qsl"], **scales
    )
    assert not check_close_to_oracle(got, oracle, dtype=torch.bfloat16).ok
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_cache_past_2_31_elements(launches: list[int]) -> None:
    """An fp8 cache of more than 2^31 elements whose decode reads its last blocks."""
    h, d, n = 8, 128, 16
    nb = 2**31 // (h * n * 2 * d) + 16
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=nb, num_kv_heads=h, block_size=n, head_size=d,
        head_size_v=d, dtype="fp8_e4m3", kv_quant="fp8_per_tensor",
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, "cuda", zero=False), layout, 0)
    ids = torch.arange(nb - 14, nb, dtype=torch.int32, device="cuda")
    kv[ids.long()] = (torch.randn(14, h, n, 2 * d, device="cuda") * 0.5).to(kv.dtype)
    assert (nb - 1) * kv.stride(0) > 2**31
    table = torch.full((2, 10), -1, dtype=torch.int32, device="cuda")
    table[0, :8] = ids[:8]
    table[1, :6] = ids[8:]
    args = (
        torch.randn(2, h * 4, d, dtype=torch.bfloat16, device="cuda"), kv, layout, table,
        torch.tensor([120, 90], dtype=torch.int32, device="cuda"),
        torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"), 1,
    )  # fmt: skip
    got = paged_attention(*args, k_scale=0.5, v_scale=2.0, impl="triton")
    ref = paged_attention(*args, k_scale=0.5, v_scale=2.0, impl="reference")
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_per_token_head_cache_past_2_31_elements(launches: list[int]) -> None:
    """An int8 per-token-head cache (264-byte rows) of more than 2^31 bytes whose decode reads
    its last blocks, written there by the Triton write kernel: the rows' and their inline
    scales' offsets past 2^31 address the right bytes (on cards where the Gluon kernel takes
    these pages; elsewhere the Triton kernel's, the same check)."""
    h, d, n = 8, 128, 16
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=2**31 // (h * n * (2 * d + 8)) + 16,
        num_kv_heads=h, block_size=n, head_size=d, head_size_v=d, dtype="int8",
        kv_quant="int8_per_token_head",
    )  # fmt: skip
    nb = layout.num_blocks
    kv = layer_view(allocate_kv_cache(layout, "cuda", zero=False), layout, 0)
    assert (nb - 1) * kv.stride(0) > 2**31
    ids = torch.arange(nb - 14, nb, dtype=torch.int32, device="cuda")
    table = torch.full((2, 10), -1, dtype=torch.int32, device="cuda")
    table[0, :8] = ids[:8]
    table[1, :6] = ids[8:]
    lens = [120, 90]
    for s, length in enumerate(lens):
        pos = torch.arange(length, device="cuda")
        slots = table[s, pos // n].long() * n + pos % n
        mag = torch.rand(length, h, 1, device="cuda") * 4 + 0.1
        reshape_and_cache(torch.randn(length, h, d, device="cuda") * mag,
                          torch.randn(length, h, d, device="cuda") * mag, kv, slots, layout,
                          impl="triton")  # fmt: skip
    args = (
        torch.randn(2, h * 4, d, dtype=torch.bfloat16, device="cuda"), kv, layout, table,
        torch.tensor(lens, dtype=torch.int32, device="cuda"),
        torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"), 1,
    )  # fmt: skip
    got = paged_attention(*args, impl="triton")
    ref = paged_attention(*args, impl="reference")
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert bool(launches) == _INLINE_HERE


@pytest.mark.gpu
@needs_sm90
def test_gpu_environment_switch(monkeypatch: pytest.MonkeyPatch, launches: list[int]) -> None:
    """``KV_KERNELS_SM90_DECODE=0``: the Triton kernel serves the decode, to the same result."""
    b = _batch(q_lens=[1] * len(_L), seq_lens=_L)
    gluon = run_batch(b, "triton", k_scale=0.75, v_scale=1.25)
    assert len(launches) == 1
    monkeypatch.setenv("KV_KERNELS_SM90_DECODE", "0")
    triton_out = run_batch(b, "triton", k_scale=0.75, v_scale=1.25)
    assert len(launches) == 1
    torch.testing.assert_close(gluon.float(), triton_out.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("kv_quant", "group", "n", "splits", "plane"),
    [
        ("int8_per_token_head", 4, 16, None, False),
        ("fp8_per_token_head", 4, 16, None, False),
        ("int8_per_token_head", 8, 64, 3, False),
        ("fp8_per_token_head", 1, 32, 8, False),
        ("int8_per_token_head", 16, 16, 1, False),
        # the scales in each page's scale plane (rows of 256 bytes)
        ("int8_per_token_head", 4, 16, None, True),
        ("fp8_per_token_head", 8, 64, 3, True),
    ],
)
@pytest.mark.gpu
@needs_sm90
def test_gpu_per_token_head_pages(
    kv_quant: str, group: int, n: int, splits: int | None, plane: bool, launches: list[int]
) -> None:
    """bf16 queries over per-token-head pages the Triton write kernel filled (rows of magnitudes
    spread 40x: per-token scales differ widely), against the oracle over ``read_kv``'s rows;
    ``plane``: the scales in each page's scale plane."""
    q_lens = [1, 1, min(4, 16 // group), 1]
    b = make_quant_batch(
        kv_quant=kv_quant, q_lens=q_lens, seq_lens=[4000, 900, 300, 33], head_size=128,
        head_size_v=128, num_kv_heads=2, group=group, block_size=n, write_impl="triton",
        device="cuda", scale_plane=plane,
    )  # fmt: skip
    b["q"] = b["q"].bfloat16()
    want = quant_oracle(b)
    low = run_batch(b, "reference").cpu()
    got = run_batch(b, "triton", num_splits=splits).cpu()
    assert_close_to_oracle(got, want, lowprec_reference=low)
    # (pages with a scale plane go to the Gluon kernel on every sm_90 card)
    assert bool(launches) == (_INLINE_HERE or plane), "pth pages went to the other kernel"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("plane", [False, True], ids=["inline", "plane"])
def test_gpu_per_token_head_doubled_scale_is_caught(plane: bool, launches: list[int]) -> None:
    """One token's stored K and V scales doubled after the write: the oracle (read before the
    damage) must see it, so the kernel reads each token's own scales (inline in the row, or in
    the page's scale plane)."""
    b = make_quant_batch(
        kv_quant="int8_per_token_head", q_lens=[1], seq_lens=[700], head_size=128,
        head_size_v=128, num_kv_heads=2, group=4, write_impl="triton", device="cuda",
        scale_plane=plane,
    )  # fmt: skip
    b["q"] = b["q"].bfloat16()
    want = quant_oracle(b)
    assert check_close_to_oracle(run_batch(b, "triton").cpu(), want, dtype=torch.bfloat16).ok
    layout, slot = b["layout"], int(b["slots"][0][517])
    if plane:
        scale_plane_view(b["kv"], layout)[
            slot // layout.block_size, :, slot % layout.block_size
        ] *= 2
    else:
        start, stop = layout.scale_range
        row = b["kv"][slot // layout.block_size, :, slot % layout.block_size]  # [H, C] view
        scales = row.view(torch.uint8)[:, start:stop].contiguous().view(torch.float32)  # [H, 2]
        row.view(torch.uint8)[:, start:stop] = (scales * 2).view(torch.uint8)
    got = run_batch(b, "triton").cpu()
    assert not check_close_to_oracle(got, want, dtype=torch.bfloat16).ok
    assert bool(launches) == (_INLINE_HERE or plane)
