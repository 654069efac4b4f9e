"""The Gluon MLA decode kernel for sm_90 (:mod:`kv_kernels.paged_attention._sm90_mla`).

On the CPU (CI): the kernel compiles for sm_90 ahead of time through ptxas (pages 16, 64, 128;
bf16 and fp16; splits and LSE) with warpgroup MMAs of the shapes its schedule names (q.K: 64 x 32
a warpgroup over K = 576; P.V: 64 x 256 a warpgroup), 16-byte ``cp.async`` gathers and the
producer's register cut; which launches it serves (and which stay with the Triton kernel); its
split rule; bad strides get a ValueError. Gluon has no interpreter, so its results are checked on
an H100 / H200 (``-m gpu``) at DeepSeek-V3's shapes against the float64 oracle over the latents
the test drew (bounded by the bf16 torch reference's own error): 128 and 64 heads, pages 16-128,
splits, LSE, a batch mixing decode rows with a prefill (which the Triton kernel takes), bitwise
batch invariance at a fixed split count; a planted wrong page and a planted tile of the wrong
sequence that the same check must catch; a cache past 2^31 elements; and the environment switch
back to the Triton kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_kernels.aot import build_problems
from kv_kernels.paged_attention import _sm90_mla
from kv_kernels.paged_attention._sm90_mla import aot_case, pick_mla_splits, sm90_mla_eligible
from kv_kernels.testing import assert_close_to_oracle, check_close_to_oracle, plant_wrong_page
from kv_kernels.testing_attention import make_mla_batch, mla_oracle, run_batch

_PTX = {
    "qk_mma": r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.(bf16\.bf16|f16\.f16)",
    "pv_mma": r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.(bf16\.bf16|f16\.f16)",
    "cp_async_16": r"cp\.async\.cg\.shared\.global(\.L2::128B)? \[[^]]*\], \[[^]]*\], 0x10",
    "producer_regs": r"setmaxnreg\.inc\.sync\.aligned\.u32\s+40;",
}

# (q dtype, page, split, lse)
_CASES = [("bf16", 64, False, False), ("fp16", 16, True, True), ("bf16", 128, True, False)]


def _case_id(c: tuple) -> str:
    dt, n, split, lse = c
    return f"{dt}-n{n}" + ("-split" if split else "") + ("-lse" if lse else "")


@pytest.fixture(scope="module")
def aot_results(aot_compile_checks) -> dict[str, dict]:
    cases = []
    for c in _CASES:
        dt, n, split, lse = c
        case = aot_case(dtype=dt, block_size=n, split=split, write_lse=lse)
        cases.append({"id": _case_id(c), "count": _PTX, **case})
    return aot_compile_checks(cases)


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_compiles_for_sm90(case: tuple, aot_results: dict[str, dict]) -> None:
    problems = build_problems(aot_results[_case_id(case)], arch=90, present=tuple(_PTX))
    assert not problems, problems


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


@pytest.mark.parametrize(
    "over",
    [
        {"arch": 80},
        {"arch": 100},
        {"compiled": False},  # the interpreter: Gluon has none
        {"cache_dtype": torch.float8_e4m3fn},  # an fp8 latent
        {"q_dtype": torch.float16},  # q and cache dtypes differ
        {"q_dtype": torch.float32, "cache_dtype": torch.float32},
        {"group": 16},  # tensor parallel 8: bandwidth-bound, the Triton kernel's
        {"group": 32},
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


def test_split_rule_fills_one_wave_of_one_program_an_sm() -> None:
    # 64 x 4k: 128 programs (two head blocks a sequence) already fill 132 SMs
    assert pick_mla_splits(num_seqs=64, head_blocks=2, max_seq_len=4096, num_sms=132) == 1
    # 8 x 32k: 16 programs, 8 splits (128 programs, 64 tiles each)
    assert pick_mla_splits(num_seqs=8, head_blocks=2, max_seq_len=32768, num_sms=132) == 8
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


def _batch(*, seq_lens, q_lens=None, heads=128, n=64, dtype=torch.bfloat16, seed=0) -> dict:
    b = make_mla_batch(
        q_lens=q_lens or [1] * len(seq_lens), seq_lens=seq_lens, num_heads=heads, rank=512,
        rope=64, block_size=n, dtype=dtype, seed=seed, device="cuda",
    )  # fmt: skip
    return b


def _check(b: dict, **kw) -> None:
    """The kernel's output and LSE against the float64 oracle, bounded by the bf16 / fp16 torch
    reference's own error; its LSE against the oracle's to 1e-4 (natural log). The cache's rows
    past each sequence hold nan: a read of one shows."""
    got, lse = run_batch(b, "triton", kv_lora_rank=512, scale=SCALE, return_lse=True, **kw)
    # (the torch reference reads whole pages: it runs on the cache without the nan poison)
    low = run_batch(dict(b, kv=b["kv"].nan_to_num(0.0)), "reference", kv_lora_rank=512,
                    scale=SCALE)  # fmt: skip
    want, want_lse = mla_oracle(b, SCALE)
    assert_close_to_oracle(got.cpu(), want, lowprec_reference=low.cpu(), dtype=b["q"].dtype)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse.cpu()))
    torch.testing.assert_close(lse.cpu().double()[fin], want_lse[fin], atol=1e-4, rtol=1e-4)


# context lengths that end mid-page and mid-tile, a one-token context, a whole tile
_L = [3000, 700, 1, 64, 129]


@pytest.mark.parametrize(
    "shape",
    [dict(), dict(n=16, dtype=torch.float16), dict(n=128, heads=64)],
    ids=["bf16-h128-n64", "fp16-h128-n16", "bf16-h64-n128"],
)
@pytest.mark.parametrize("splits", [None, 1, 4], ids=["auto", "s1", "s4"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_matches_the_oracle(shape: dict, splits: int | None, launches: list[int]) -> None:
    b = _batch(seq_lens=_L, **shape)
    _check(b, num_splits=splits)
    assert launches, "the Gluon kernel did not serve the MLA decode"


@pytest.mark.gpu
@needs_sm90
def test_gpu_mixed_batch_leaves_the_prefill_to_the_triton_kernel(launches: list[int]) -> None:
    b = _batch(q_lens=[1, 7, 1], seq_lens=[900, 300, 65])
    _check(b)
    assert len(launches) == 1


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.gpu
@needs_sm90
def test_gpu_batch_invariance_bitwise(splits: int, launches: list[int]) -> None:
    """With a fixed split count a sequence's rows are bit-identical alone and in a batch (what
    TRITON_MLA declares as batch invariance)."""
    b = _batch(seq_lens=[900, 300, 65])
    full = run_batch(b, "triton", kv_lora_rank=512, scale=SCALE, num_splits=splits)
    alone = dict(
        b, q=b["q"][1:2], block_table=b["block_table"][1:2], seq_lens=b["seq_lens"][1:2],
        qsl=torch.tensor([0, 1], dtype=torch.int32, device="cuda"), q_lens=[1],
    )  # fmt: skip
    one = run_batch(alone, "triton", kv_lora_rank=512, scale=SCALE, num_splits=splits)
    assert torch.equal(full[1:2], one)
    assert len(launches) == 2


@pytest.mark.gpu
@needs_sm90
def test_gpu_planted_bugs_fail_the_same_check(launches: list[int]) -> None:
    """One wrong page, and one sequence's rows read through another's pages, are both caught by
    the bound the parity tests use."""
    b = _batch(seq_lens=[3000, 700, 64])
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
    assert len(launches) == 2


@pytest.mark.gpu
@needs_sm90
def test_gpu_cache_past_2_31_elements(launches: list[int]) -> None:
    """The sequences' pages moved to the end of a 4.3 GiB cache (blocks x 64 x 576 > 2^31
    elements): offsets past 2^31 address the right rows."""
    b = _batch(seq_lens=[700, 130])
    num_blocks = 2**31 // (64 * 576) + 64
    big = torch.zeros(num_blocks, 1, 64, 576, dtype=torch.bfloat16, device="cuda")
    table = b["block_table"].clone()
    used = table[table >= 0]
    moved = num_blocks - 1 - torch.arange(used.numel(), device="cuda", dtype=torch.int32)
    big[moved.long()] = b["kv"][used.long()]
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
