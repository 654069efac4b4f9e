"""The Gluon MLA decode kernels for sm_90 (:mod:`kv_kernels.paged_attention._sm90_mla`, 64 / 128
heads; :mod:`kv_kernels.paged_attention._sm90_mla_narrow`, 16 / 32 heads, tokens as the MMAs' M:
68 ``m64nHk16`` MMAs a tile, nothing padded).

On the CPU (CI): the kernel compiles for sm_90 ahead of time through ptxas (pages 16, 64, 128;
bf16 and fp16; splits and LSE; 16-bit latents and fp8 e4m3 ones with a float or a tensor scale)
with warpgroup MMAs of the shapes its schedule names (q.K: 64 x 32 a warpgroup over K = 576; P.V:
64 x 256 a warpgroup), the producer's copies (16-byte ``cp.async`` gathers; over fp8: 8-byte
loads, L2 prefetches and the widening, no ``cp.async``), its register cut and bounded spills;
which launches it serves (and which stay with the Triton kernel); its split rule; bad strides get
a ValueError. Gluon has no interpreter, so its results are checked on an H100 / H200 (``-m gpu``)
at DeepSeek-V3's shapes against the float64 oracle over the latents the test drew (or, fp8, the
rows the cache gives back), bounded by the bf16 / fp16 torch reference's own error: 128, 64, 32
and 16 heads, pages 16-128, splits, LSE, a batch mixing decode rows with a prefill (which the Triton
kernel takes), bitwise batch invariance at a fixed split count; a planted wrong page, a planted
tile of the wrong sequence and (fp8) planted wrong scales that the same check must catch; a cache
past 2^31 elements; and the environment switch back to the Triton kernel.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from kv_kernels.aot import build_problems
from kv_kernels.paged_attention import _sm90_mla
from kv_kernels.paged_attention._sm90_mla import aot_case, pick_mla_splits, sm90_mla_eligible
from kv_kernels.testing import (
    assert_close_to_oracle,
    check_close_to_oracle,
    plant_wrong_page,
)
from kv_kernels.testing_attention import make_mla_batch, mla_oracle, run_batch

_MMA = {
    "qk_mma": r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.(bf16\.bf16|f16\.f16)",
    "pv_mma": r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.(bf16\.bf16|f16\.f16)",
}
#: the 16-bit latent's producer: 16-byte cp.async gathers at 40 registers
_PTX = {
    **_MMA,
    "cp_async_16": r"cp\.async\.cg\.shared\.global(\.L2::128B)? \[[^]]*\], \[[^]]*\], 0x10",
    "producer_regs": rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{_sm90_mla.P_REGS};",
}
#: the fp8 latent's producer (kv_kernels.paged_attention._sm90_mla_fp8): 8-byte loads into
#: registers, a row's L2 prefetch, the widening (bf16: the bytes placed by PRMT, scaled by a bf16
#: multiply; fp16: the pair conversion), one arrival of 128 on the ring's barrier
_PTX_FP8 = {
    **_MMA,
    "ld_8": r"ld\.global(\.\w+)*\.v2\.b32",
    "ld_16": r"ld\.global(\.\w+)*\.v4\.b32",
    "prefetch_l2": r"cp\.async\.bulk\.prefetch\.L2\.global \[[^]]*\], 576;",
    "widen_bf16": r"mul\.rn\.bf16x2",
    "widen_f16": r"cvt\.rn\.f16x2\.e4m3x2",
    "full_arrival": r"mbarrier\.arrive\.shared::cta\.b64 _, \[[^]]*\], 128;",
    "producer_regs": rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{_sm90_mla.P_REGS_FP8};",
    "cp_async": r"cp\.async\.c[ag]\.shared\.global",
}


#: the narrow kernel (kv_kernels.paged_attention._sm90_mla_narrow, 16 / 32 heads): tokens as the
#: MMAs' M and the heads as N, so one shape serves both products: S^T's 36 (K = 576 in steps of
#: 16) and O^T's 32 (M = 512 in 8 steps of 64, K = 64 tokens in 4 of 16) a tile
def _narrow_mma(heads: int) -> dict[str, str]:
    return {"mma": rf"wgmma\.mma_async\.sync\.aligned\.m64n{heads}k16\.f32\.(bf16\.bf16|f16\.f16)"}


# (q dtype, page, split, lse, latent: the q dtype, or fp8 e4m3 whose scale is a float (1) or a
# tensor (2), query heads)
_CASES = [
    ("bf16", 64, False, False, None, 128), ("fp16", 16, True, True, None, 128),
    ("bf16", 128, True, False, None, 128),
    ("bf16", 64, False, False, 1, 128), ("fp16", 16, True, True, 2, 128),
    ("bf16", 128, True, False, 2, 128),
    ("bf16", 64, False, False, None, 16), ("fp16", 16, True, True, None, 32),
    ("bf16", 128, True, False, None, 32),
    ("bf16", 64, True, True, 1, 16), ("fp16", 128, False, False, 2, 32),
]  # fmt: skip


def _case_id(c: tuple) -> str:
    dt, n, split, lse, fp8, heads = c
    return (
        f"{dt}-h{heads}-n{n}" + ("-split" if split else "") + ("-lse" if lse else "")
        + (f"-fp8-scale{fp8}" if fp8 else "")
    )  # fmt: skip


def _counts(case: tuple) -> dict[str, str]:
    fp8, heads = case[4], case[5]
    counts = dict(_PTX_FP8 if fp8 else _PTX)
    if heads < 64:
        for name in _MMA:
            del counts[name]
        counts.update(_narrow_mma(heads))
        if fp8:  # (the whole-tile producer, _sm90_mla_fp8.producer_fp8_whole)
            regs = _sm90_mla.P_REGS_FP8_WHOLE
            counts["producer_regs"] = rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{regs};"
    return counts


@pytest.fixture(scope="module")
def aot_results(aot_compile_checks) -> dict[str, dict]:
    cases = []
    for c in _CASES:
        dt, n, split, lse, fp8, heads = c
        fp8_kw = dict(cache="fp8e4nv", kv_scale=fp8) if fp8 else {}
        case = aot_case(dtype=dt, block_size=n, split=split, write_lse=lse, heads=heads, **fp8_kw)
        cases.append({"id": _case_id(c), "count": _counts(c), "spills": True, **case})
    return aot_compile_checks(cases)


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_compiles_for_sm90(case: tuple, aot_results: dict[str, dict]) -> None:
    """Every build fits sm_90's shared memory with the schedule's MMAs and its producer's
    copies; an fp8 latent's producer loads and widens the whole 288 bytes a thread of each tile
    (9 pieces of 64 bytes a row x 4 rows: 36 loads of 8 bytes, 72 words widened by two
    instructions each), with no cp.async (at 16 / 32 heads all of a tile's at once). The narrow
    kernel (16 / 32 heads) issues exactly its 68
    MMAs a tile, nothing padded to 64 heads. Spills (ptxas -v, triton 3.9's build; an fp8
    producer that carried its loads' bytes around the tile loop spilled ~2.7 KB a thread):
    within the bounds below, which the builds of this change meet with room (16-bit 12-36
    bytes, fp8 68-120)."""
    res = aot_results[_case_id(case)]
    fp8, heads = case[4], case[5]
    mmas = ("qk_mma", "pv_mma") if heads >= 64 else ("mma",)
    if not fp8:
        problems = build_problems(res, arch=90, present=tuple(_counts(case)))
        assert not problems, problems
    else:
        widen = "widen_bf16" if case[0] == "bf16" else "widen_f16"
        present = (*mmas, "ld_8", "prefetch_l2", widen, "full_arrival", "producer_regs")
        problems = build_problems(res, arch=90, present=present)
        assert not problems, problems
        counts = res["counts"]
        assert (counts["ld_8"], counts[widen], counts["cp_async"]) == (36, 144, 0), counts
        # (16-byte loads: q's alone, the narrow kernel's q of heads x 576 16-bit values)
        if heads < 64:
            assert counts["ld_16"] == heads * 576 * 2 // (16 * 128), counts
    if heads < 64:
        assert res["counts"]["mma"] == 68, res["counts"]
    if res.get("spill_bytes") is None:
        pytest.skip("ptxas -v could not be run on this triton's build")
    assert res["spill_bytes"] <= (160 if fp8 else 64), res["spill_bytes"]


def test_bf16_widening_bits_are_exact() -> None:
    """The fp8 producer's bf16 widening (``_sm90_mla_fp8._E4M3_BF16``), its integer part emulated
    on the CPU with the asm's own constants: every finite e4m3 byte, in any lane of a word,
    becomes the bf16 of its value times 2^-120 (subnormals too), so the multiply by 2^120 it
    ends with restores the value exactly; e4m3's nan reads 480 (documented)."""
    from kv_kernels.paged_attention import _sm90_mla_fp8

    asm = _sm90_mla_fp8._E4M3_BF16.value
    sel = [int(x, 16) for x in re.findall(r"prmt\.b32 \w, \$2, 0, (0x[0-9A-Fa-f]+);", asm)]
    mask = int(re.search(r"and\.b32 a, a, (0x[0-9A-Fa-f]+);", asm).group(1), 16)
    mul = int(re.search(r"mov\.b32 k, (0x[0-9A-Fa-f]+);", asm).group(1), 16)
    assert (len(sel), mul & 0xFFFF, mul >> 16) == (2, 0x7B80, 0x7B80)  # bf16 2^120, twice
    gen = torch.Generator().manual_seed(0)
    words = torch.stack([torch.randperm(256, generator=gen) for _ in range(4)], 1)  # [256, 4]

    def prmt(w: torch.Tensor, s: int) -> torch.Tensor:
        out = torch.zeros(w.shape[0], dtype=torch.int64)
        for i in range(4):  # d's byte i: byte (s >> 4 i) & 7 of {0, w}, its sign if bit 3
            n = (s >> (4 * i)) & 0xF
            byte = w[:, n & 7] if (n & 7) < 4 else torch.zeros_like(w[:, 0])
            if n & 8:
                byte = torch.where(byte >= 128, 255, 0)
            out |= byte << (8 * i)
        return out

    got, want = [], []
    for half, s_ in enumerate(sel):
        a = ((prmt(words, s_) << 4) & 0xFFFFFFFF) & mask
        for lane in range(2):
            bits = ((a >> (16 * lane)) & 0xFFFF).to(torch.int32).to(torch.int16)
            got.append(bits.view(torch.bfloat16).double() * 2.0**120)
            byte = words[:, 2 * half + lane].to(torch.uint8)
            want.append(byte.view(torch.float8_e4m3fn).double())
    got_t, want_t = torch.cat(got), torch.cat(want)
    fin = torch.isfinite(want_t)
    assert torch.equal(got_t[fin], want_t[fin])
    assert set(got_t[~fin].abs().tolist()) == {480.0}


def test_build_problems_can_fail() -> None:
    """The check the three sm_90 kernels' builds go through sees each kind of bad build."""
    assert (
        build_problems(
            {"ok": True, "shared": 1024, "counts": {"mma": 3}}, arch=90, present=("mma",)
        )
        == []
    )
    bad = build_problems(
        {"ok": True, "shared": 240_000, "counts": {"mma": 0}}, arch=90, present=("mma",)
    )
    assert len(bad) == 2 and "shared memory" in bad[0] and "no mma" in bad[1]
    assert "failed" in build_problems({"ok": False, "error": "x"}, arch=90, present=())[0]


_FEATURES = dict(
    sliding_window=False, sinks=False, softcap=False, alibi=False, kv_scale_mode=0, split=True,
    check=False, v_from_k=True, scale_words=False, causal=True, write_lse=True, k_start=0,
)  # fmt: skip


def _eligible(**over) -> bool:
    kw = dict(
        arch=90, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, head_size=576,
        head_size_v=512, group=128, block_q=1, scale=0.07, compiled=True,
        features=dict(_FEATURES),
    )  # fmt: skip
    feats = over.pop("features", {})
    kw.update(over)
    kw["features"].update(feats)
    return sm90_mla_eligible(**kw)


def test_serves_deepseek_v3_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KV_KERNELS_SM90_MLA", raising=False)
    assert _eligible()
    assert _eligible(q_dtype=torch.float16, cache_dtype=torch.float16, group=64)
    assert _eligible(features={"causal": False, "write_lse": False, "split": False})


@pytest.mark.parametrize("group", [16, 32])
def test_serves_tensor_parallel_head_counts(group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's 128 heads under tensor parallelism 8 and 4: the narrow kernel."""
    monkeypatch.delenv("KV_KERNELS_SM90_MLA", raising=False)
    assert _eligible(group=group)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [16, 64, 128])
@pytest.mark.parametrize("mode", [1, 2], ids=["float-scale", "tensor-scale"])
def test_serves_the_fp8_e4m3_latent(
    q_dtype: torch.dtype, group: int, mode: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's fp8_e4m3 latent (one per-tensor scale, a float or a [1] tensor) at 16, 64 and 128
    heads, with 16-bit queries."""
    monkeypatch.delenv("KV_KERNELS_SM90_MLA", raising=False)
    assert _eligible(q_dtype=q_dtype, cache_dtype=torch.float8_e4m3fn, group=group,
                     features={"kv_scale_mode": mode, "row_align": 1})  # fmt: skip


@pytest.mark.parametrize(
    "over",
    [
        {"arch": 80},
        {"arch": 100},
        {"compiled": False},  # the interpreter: Gluon has none
        {"cache_dtype": torch.float8_e4m3fn},  # an fp8 latent with no scale
        # an fp8 latent the Gluon kernel does not widen, or with per-token-head scales
        {"cache_dtype": torch.float8_e5m2, "features": {"kv_scale_mode": 1}},
        {"cache_dtype": torch.int8, "features": {"kv_scale_mode": 1}},
        {"cache_dtype": torch.float8_e4m3fn, "features": {"kv_scale_mode": 3}},
        # rows not 16-byte aligned (the fp8 producer prefetches whole aligned rows)
        {"cache_dtype": torch.float8_e4m3fn, "features": {"kv_scale_mode": 1, "row_align": 8}},
        {"cache_dtype": torch.float8_e4m3fn, "q_dtype": torch.float32,
         "features": {"kv_scale_mode": 1}},
        {"q_dtype": torch.float16},  # q and cache dtypes differ
        {"q_dtype": torch.float32, "cache_dtype": torch.float32},
        # head counts neither kernel takes (8: the Triton config's decode class is two tokens)
        {"group": 4}, {"group": 8}, {"group": 24}, {"group": 48}, {"group": 96}, {"group": 256},
        {"head_size": 320, "head_size_v": 256},  # another latent width
        {"block_q": 2},  # a config whose decode class holds more than one token
        {"scale": -0.1},
        {"aligned_rows": False},
        *({"features": {k: v}} for k, v in [
            ("v_from_k", False), ("sliding_window", True), ("sinks", True), ("softcap", True),
            ("alibi", True), ("kv_scale_mode", 1), ("check", True), ("k_start", 64),
        ]),
    ],
)  # fmt: skip
def test_leaves_the_rest_to_the_triton_kernel(over: dict) -> None:
    assert not _eligible(**over)


def test_environment_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_KERNELS_SM90_MLA", "0")
    assert not _eligible()


def test_head_blocks() -> None:
    assert [_sm90_mla.mla_head_blocks(h) for h in (16, 32, 64, 128)] == [1, 1, 1, 2]


def test_split_rule_fills_one_wave_of_one_program_an_sm() -> None:
    # 64 x 4k: 128 programs (two head blocks a sequence) already fill 132 SMs
    assert pick_mla_splits(num_seqs=64, head_blocks=2, max_seq_len=4096, num_sms=132) == 1
    # 8 x 32k: 16 programs, 8 splits (128 programs, 64 tiles each)
    assert pick_mla_splits(num_seqs=8, head_blocks=2, max_seq_len=32768, num_sms=132) == 8
    # 16 heads (one program a split): 64 x 4k, 2 splits; 8 x 32k, 16
    assert pick_mla_splits(num_seqs=64, head_blocks=1, max_seq_len=4096, num_sms=132) == 2
    assert pick_mla_splits(num_seqs=8, head_blocks=1, max_seq_len=32768, num_sms=132) == 16
    # a short context keeps at least 8 tiles of 64 tokens a split
    assert pick_mla_splits(num_seqs=1, head_blocks=2, max_seq_len=960, num_sms=132) == 1
    assert pick_mla_splits(num_seqs=1, head_blocks=2, max_seq_len=1024, num_sms=132) == 2


def test_non_unit_row_stride_is_a_value_error() -> None:
    q = torch.zeros(2, 128, 1152)[:, :, ::2]  # [2, 128, 576], column stride 2
    kv = torch.zeros(3, 1, 64, 576)
    with pytest.raises(ValueError, match=r"q\.stride\(-1\)=2.*contiguous last dimension"):
        _sm90_mla.launch_sm90_mla(
            q, kv, block_table=torch.zeros(2, 3, dtype=torch.int32),
            seq_lens=torch.tensor([8, 8]), query_start_loc=torch.tensor([0, 1, 2]), scale=0.1,
            block_size=64, out=torch.zeros(2, 128, 512), lse=None, part_out=torch.zeros(1),
            part_lse=torch.zeros(1), num_splits=1,
        )  # fmt: skip


# ---- on an sm_90 GPU ---------------------------------------------------------------------------

_ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not _ON_SM90, reason="the Gluon MLA kernel is built for sm_90")
SCALE = 0.0417  # 1 / sqrt(576)


@pytest.fixture
def launches(count_gluon_launches) -> list[int]:
    """Counts the Gluon MLA kernel's launches."""
    return count_gluon_launches("mla")


#: an fp8 latent's per-tensor scale: the drawn latents (~4 N(0, 1)) stored up to ~320, inside
#: e4m3's 448
K_SCALE = 0.05


def _batch(
    *, seq_lens, q_lens=None, heads=128, n=64, dtype=torch.bfloat16, seed=0, fp8=None
) -> dict:
    """A DeepSeek-V3 decode batch (latent 512 + 64) on the GPU; ``fp8`` ``"float"`` /
    ``"tensor"``: an fp8 e4m3 latent whose scale :data:`K_SCALE` is a float / a ``[1]`` tensor
    (``b["latents"]`` are then the rows as the cache gives them back)."""
    quant: dict = {}
    if fp8:
        ks = K_SCALE if fp8 == "float" else torch.tensor([K_SCALE], device="cuda")
        quant = dict(cache_dtype="fp8_e4m3", k_scale=ks)
    b = make_mla_batch(
        q_lens=q_lens or [1] * len(seq_lens), seq_lens=seq_lens, num_heads=heads, rank=512,
        rope=64, block_size=n, dtype=dtype, seed=seed, device="cuda", **quant,
    )  # fmt: skip
    return b


def _zeroed(kv: torch.Tensor) -> torch.Tensor:
    """The cache with its nan poison as zeros (fp8 has no ``nan_to_num``; its finite values
    round-trip through float32 exactly)."""
    if kv.element_size() == 1:
        return kv.float().nan_to_num(0.0).to(kv.dtype)
    return kv.nan_to_num(0.0)


def _run(b: dict, impl: str, **kw):
    """``paged_attention`` over the batch with its latent's scale (None: a 16-bit latent)."""
    return run_batch(b, impl, kv_lora_rank=512, scale=SCALE, k_scale=b["k_scale"], **kw)


def _check(b: dict, **kw) -> None:
    """The kernel's output and LSE against the float64 oracle, bounded by the bf16 / fp16 torch
    reference's own error; its LSE against the oracle's to 1e-4 (natural log). The cache's rows
    past each sequence hold nan: a read of one shows (an fp8 latent's nan reads as 480 in the
    bf16 widening: there the masked loads and the logits' mask are what keep them out)."""
    got, lse = _run(b, "triton", return_lse=True, **kw)
    # (the torch reference reads whole pages: it runs on the cache without the nan poison)
    low = _run(dict(b, kv=_zeroed(b["kv"])), "reference")
    want, want_lse = mla_oracle(b, SCALE)
    assert_close_to_oracle(got.cpu(), want, lowprec_reference=low.cpu(), dtype=b["q"].dtype)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse.cpu()))
    torch.testing.assert_close(lse.cpu().double()[fin], want_lse[fin], atol=1e-4, rtol=1e-4)


# context lengths that end mid-page and mid-tile, a one-token context, a whole tile
_L = [3000, 700, 1, 64, 129]


@pytest.mark.parametrize(
    "shape",
    [dict(), dict(n=16, dtype=torch.float16), dict(n=128, heads=64), dict(heads=16),
     dict(n=16, heads=32, dtype=torch.float16), dict(n=128, heads=32)],
    ids=["bf16-h128-n64", "fp16-h128-n16", "bf16-h64-n128", "bf16-h16-n64", "fp16-h32-n16",
         "bf16-h32-n128"],
)  # fmt: skip
@pytest.mark.parametrize("splits", [None, 1, 4], ids=["auto", "s1", "s4"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_matches_the_oracle(shape: dict, splits: int | None, launches: list[int]) -> None:
    b = _batch(seq_lens=_L, **shape)
    _check(b, num_splits=splits)
    assert launches, "the Gluon kernel did not serve the MLA decode"


_FP8_SHAPES = [dict(), dict(n=16, dtype=torch.float16), dict(n=128, heads=64), dict(heads=16),
               dict(n=16, heads=32, dtype=torch.float16)]  # fmt: skip
_FP8_IDS = ["bf16-h128-n64", "fp16-h128-n16", "bf16-h64-n128", "bf16-h16-n64", "fp16-h32-n16"]


@pytest.mark.parametrize("shape", _FP8_SHAPES, ids=_FP8_IDS)
@pytest.mark.parametrize("splits", [None, 1, 4], ids=["auto", "s1", "s4"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_fp8_latent_matches_the_oracle(
    shape: dict, splits: int | None, launches: list[int]
) -> None:
    """vLLM's fp8_e4m3 latent, its scale a float (``KV_SCALE`` 1): the Gluon kernel's output
    and LSE against the float64 oracle over the rows the cache gives back."""
    b = _batch(seq_lens=_L, fp8="float", **shape)
    _check(b, num_splits=splits)
    assert launches, "the Gluon kernel did not serve the fp8 MLA decode"


@pytest.mark.parametrize("shape", _FP8_SHAPES, ids=_FP8_IDS)
@pytest.mark.gpu
@needs_sm90
def test_gpu_fp8_latent_tensor_scale_matches_the_oracle(shape: dict, launches: list[int]) -> None:
    """The scale as a ``[1]`` float32 tensor, read on the device (``KV_SCALE`` 2)."""
    b = _batch(seq_lens=_L, fp8="tensor", **shape)
    _check(b)
    _check(b, num_splits=4)
    assert launches


def _launch_direct(b: dict, scale_args: tuple) -> torch.Tensor:
    """:func:`launch_sm90_mla` over the batch at one split with the given ``scale_args`` (the
    launcher's ``(k_ptr, v_ptr, k_stride, v_stride, k_val, v_val)``, a float scale)."""
    q = b["q"]
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=q.dtype, device=q.device)
    _sm90_mla.launch_sm90_mla(
        q, b["kv"], block_table=b["block_table"], seq_lens=b["seq_lens"],
        query_start_loc=b["qsl"], scale=SCALE, block_size=b["layout"].block_size, out=out,
        lse=None, part_out=out, part_lse=out, num_splits=1, kv_scale_mode=1,
        scale_args=scale_args,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.gpu
@needs_sm90
def test_gpu_fp8_planted_bugs_fail_the_same_check(heads: int, launches: list[int]) -> None:
    """Over an fp8 latent, each of these is caught by the bound the parity tests use: a wrong
    page; a scale 25% off (K and V both: the latent's one scale); the kernel launched with the
    scale left out of the output (V's scale 1), or out of the logits (K's 1). The direct launch
    with the right scale passes. (Held instead to an oracle with a wrong scale, the bound cannot
    judge: it is derived from the bf16 reference's own distance to that oracle, which a wrong
    oracle widens too; on the H200 it passed the right output against K 25% off.)"""
    lens = [3000, 700, 64]
    b = _batch(seq_lens=lens, fp8="float", heads=heads)
    b["kv"].copy_(_zeroed(b["kv"]))  # (the spare page is read on purpose)
    want, _ = mla_oracle(b, SCALE)
    low = _run(b, "reference").cpu()

    def caught(got: torch.Tensor, oracle: torch.Tensor = want) -> bool:
        return not check_close_to_oracle(got.cpu(), oracle, lowprec_reference=low).ok

    table = plant_wrong_page(b["block_table"].cpu(), lens, 64, b["layout"].num_blocks)
    assert caught(_run(dict(b, block_table=table.cuda()), "triton"))
    assert caught(_run(dict(b, k_scale=K_SCALE * 1.25), "triton"))
    q = b["q"]
    right = _launch_direct(b, (q, q, 0, 0, K_SCALE, K_SCALE))
    assert not caught(right)
    assert caught(_launch_direct(b, (q, q, 0, 0, K_SCALE, 1.0)))  # V's scale left out
    assert caught(_launch_direct(b, (q, q, 0, 0, 1.0, K_SCALE)))  # K's scale left out
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_mixed_batch_leaves_the_prefill_to_the_triton_kernel(launches: list[int]) -> None:
    b = _batch(q_lens=[1, 7, 1], seq_lens=[900, 300, 65])
    _check(b)
    assert len(launches) == 1


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("fp8", [None, "float"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.gpu
@needs_sm90
def test_gpu_batch_invariance_bitwise(
    splits: int, fp8: str | None, heads: int, launches: list[int]
) -> None:
    """With a fixed split count a sequence's rows are bit-identical alone and in a batch (what
    TRITON_MLA declares as batch invariance)."""
    b = _batch(seq_lens=[900, 300, 65], fp8=fp8, heads=heads)
    full = _run(b, "triton", num_splits=splits)
    alone = dict(
        b, q=b["q"][1:2], block_table=b["block_table"][1:2], seq_lens=b["seq_lens"][1:2],
        qsl=torch.tensor([0, 1], dtype=torch.int32, device="cuda"), q_lens=[1],
    )  # fmt: skip
    one = _run(alone, "triton", num_splits=splits)
    assert torch.equal(full[1:2], one)
    assert len(launches) == 2


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.gpu
@needs_sm90
def test_gpu_planted_bugs_fail_the_same_check(heads: int, launches: list[int]) -> None:
    """One wrong page, and one sequence's rows read through another's pages, are both caught by
    the bound the parity tests use."""
    b = _batch(seq_lens=[3000, 700, 64], heads=heads)
    b["kv"].nan_to_num_(0.0)
    want, _ = mla_oracle(b, SCALE)
    low = run_batch(b, "reference", kv_lora_rank=512, scale=SCALE).cpu()
    table = plant_wrong_page(b["block_table"].cpu(), [3000, 700, 64], 64, b["layout"].num_blocks)
    bad = run_batch(dict(b, block_table=table.cuda()), "triton", kv_lora_rank=512, scale=SCALE)
    assert not check_close_to_oracle(bad.cpu(), want, lowprec_reference=low).ok
    swapped = b["block_table"].clone()
    swapped[1, :2] = b["block_table"][2, :2].clone()  # seq 1's first page is seq 2's only one
    bad = run_batch(dict(b, block_table=swapped), "triton", kv_lora_rank=512, scale=SCALE)
    assert not check_close_to_oracle(bad.cpu(), want, lowprec_reference=low).ok
    # (the second call is of the first one's shape class: the api may replay its bound launch
    # without calling launch_sm90_mla again, which the counter does not see)
    assert launches


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("fp8", [None, "float"], ids=["bf16", "fp8"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_cache_past_2_31_elements(fp8: str | None, heads: int, launches: list[int]) -> None:
    """The sequences' pages moved to the end of a cache of blocks x 64 x 576 > 2^31 elements
    (4.3 GiB bf16, 2.1 GiB fp8): offsets past 2^31 address the right rows."""
    b = _batch(seq_lens=[700, 130], fp8=fp8, heads=heads)
    num_blocks = 2**31 // (64 * 576) + 64
    big = torch.zeros(num_blocks, 1, 64, 576, dtype=b["kv"].dtype, device="cuda")
    table = b["block_table"].clone()
    used = table[table >= 0]
    moved = num_blocks - 1 - torch.arange(used.numel(), device="cuda", dtype=torch.int32)
    # (as bytes / 16-bit words: index_put has no fp8 kernel)
    word = torch.uint8 if big.element_size() == 1 else torch.int16
    big.view(word)[moved.long()] = b["kv"].view(word)[used.long()]
    table[table >= 0] = moved
    layout = dataclasses.replace(b["layout"], num_blocks=num_blocks)
    assert big.numel() > 2**31 and int(moved.min()) * 64 * 576 > 2**31
    _check(dict(b, kv=big, block_table=table, layout=layout))
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_environment_switch_sends_mla_back_to_the_triton_kernel(
    launches: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = _batch(seq_lens=[200, 64])
    monkeypatch.setenv("KV_KERNELS_SM90_MLA", "0")
    _check(b)
    assert not launches
