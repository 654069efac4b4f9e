"""The warp-specialized Gluon prefill kernel for sm_90 (:mod:`kv_kernels.paged_attention._sm90_prefill`).

On the CPU (CI): the kernel compiles for sm_90 ahead of time through ptxas for every served shape
family, with the warpgroup MMAs, the cp.async gathers, the mbarrier rings and the register split
of warp specialization in its PTX and within the SM's shared memory; which launches it serves
(and which stay with the Triton kernel); bad strides get a ValueError. Gluon has no interpreter,
so its results are checked on an H100 / H200 (``-m gpu``): against the float64 oracle (bounded by
the bf16 torch reference's own error), a planted wrong page that the same check must catch, a
cache past 2^31 elements, and the environment switch back to the Triton kernel.
"""

from __future__ import annotations

import pytest
import torch
from kv_kernels.aot import build_problems
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import _sm90_prefill
from kv_kernels.paged_attention._sm90_prefill import aot_case, sm90_prefill_eligible
from kv_kernels.testing import (
    attention_oracle_paged,
    check_close_to_oracle,
    plant_wrong_page,
)
from kv_kernels.testing_attention import assert_triton_matches_oracle, make_paged_batch, run_batch
from kv_spec import KVCacheLayout

#: sm_90's shared memory per block (bytes)

_PTX = {
    "wgmma": r"wgmma\.mma_async",
    "cp_async": r"cp\.async\.c[ag]\.shared\.global",
    "mbarrier_arrive_on_copies": r"cp\.async\.mbarrier\.arrive",
    "mbarrier_wait": r"mbarrier\.try_wait",
    "setmaxnreg": r"setmaxnreg",
}
#: TMA boxes: whole tiles of pages of 128+ tokens (absent at smaller pages)
_TMA = {"tma": r"cp\.async\.bulk\.tensor"}

# (dtype, head, group, page, causal, lse): every served dtype, head size, GQA group and page
# shape at least once
_CASES = [
    ("bf16", 128, 4, 16, True, False),
    ("fp16", 128, 8, 128, True, True),
    ("bf16", 64, 1, 32, False, True),
    ("bf16", 128, 16, 64, True, False),
    ("fp16", 64, 2, 16, False, False),
    ("bf16", 192, 4, 16, True, True),  # DiffKV: K 192 = 128 + 64 columns, V 128
]


def _case_id(c: tuple) -> str:
    dt, d, g, n, causal, lse = c
    return f"{dt}-d{d}-g{g}-n{n}" + ("-causal" if causal else "") + ("-lse" if lse else "")


@pytest.fixture(scope="module")
def aot_results(aot_compile_checks) -> dict[str, dict]:
    cases = []
    for c in _CASES:
        dt, d, g, n, causal, lse = c
        dv = 128 if d == 192 else d
        case = aot_case(
            dtype=dt, head=d, head_v=dv, group=g, block_size=n, causal=causal, write_lse=lse
        )
        cases.append({"id": _case_id(c), "count": {**_PTX, **_TMA}, **case})
    return aot_compile_checks(cases)


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_compiles_for_sm90(case: tuple, aot_results: dict[str, dict]) -> None:
    """Every build has its warpgroup MMAs, gathers and barriers; pages of whole tiles (128
    tokens) also TMA boxes, and only they."""
    result = aot_results[_case_id(case)]
    problems = build_problems(result, arch=90, present=tuple(_PTX))
    assert not problems, problems
    page = case[3]
    assert bool(result["counts"]["tma"]) == (page % 128 == 0), result["counts"]


_FEATURES_OFF = dict(
    sliding_window=False, sinks=False, softcap=False, alibi=False, kv_scale_mode=0, split=False,
    check=False, v_from_k=False, scale_words=False, causal=True, write_lse=True,
)  # fmt: skip


def _eligible(**over) -> bool:
    kw = dict(
        arch=90, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, head_size=128,
        head_size_v=128, group=4, scale=0.088, compiled=True, features=dict(_FEATURES_OFF),
    )  # fmt: skip
    feats = over.pop("features", {})
    kw.update(over)
    kw["features"].update(feats)
    return sm90_prefill_eligible(**kw)


def test_tma_descriptors_only_where_tma_can_address_whole_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One descriptor for K and V (a second for DiffKV's tail) at pages of whole 128-token tiles
    of a TMA-addressable cache; gathers (``None``) at smaller pages, for a base off 16 bytes, rows
    of 16-bit values whose pitch is no multiple of 16 bytes, or with TMA tiles turned off."""
    kv = torch.zeros(4, 2, 128, 256, dtype=torch.bfloat16)
    k, tail = _sm90_prefill._tma_descriptors(kv, 128, 128, 0)  # type: ignore[misc]
    assert k.block_shape == [1, 1, 128, 128] and tail is None
    diffkv = torch.zeros(2, 2, 256, 192 + 128, dtype=torch.bfloat16)
    k, tail = _sm90_prefill._tma_descriptors(diffkv, 256, 128, 64)  # type: ignore[misc]
    assert tail is not None and tail.block_shape == [1, 1, 128, 64]
    assert _sm90_prefill._tma_descriptors(kv, 64, 128, 0) is None
    off = torch.zeros(kv.numel() + 8, dtype=torch.bfloat16)[1 : 1 + kv.numel()].view(kv.shape)
    assert _sm90_prefill._tma_descriptors(off, 128, 128, 0) is None
    pitch = torch.zeros(4, 2, 128, 260, dtype=torch.bfloat16)[..., :256]  # 520-byte rows
    assert _sm90_prefill._tma_descriptors(pitch, 128, 128, 0) is None
    monkeypatch.setattr(_sm90_prefill, "TMA_TILES", False)
    assert _sm90_prefill._tma_descriptors(kv, 128, 128, 0) is None


@pytest.mark.parametrize(
    ("version", "split"),
    [("3.6.0", (120, 192)), ("3.5.1", (120, 192)), ("3.9.0", (80, 216)), ("3.10.0", (80, 216))],
)
def test_register_split_follows_the_triton_version(
    monkeypatch: pytest.MonkeyPatch, version: str, split: tuple[int, int]
) -> None:
    """The measured 120 / 192 split only where it was measured (triton 3.6 and before: a "3.10"
    read as text would sort before "3.6"); every split fits setmaxnreg's rules (multiples of 8,
    two consumers and the producer within 512 registers a thread-slot)."""
    monkeypatch.setattr(_sm90_prefill.triton, "__version__", version)
    p_regs, c_regs = _sm90_prefill._register_split()
    assert (p_regs, c_regs) == split
    assert p_regs % 8 == 0 and c_regs % 8 == 0 and 2 * c_regs + p_regs <= 512


def test_serves_the_plain_16_bit_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KV_KERNELS_SM90_PREFILL", raising=False)
    assert _eligible()
    assert _eligible(q_dtype=torch.float16, cache_dtype=torch.float16, head_size=64, head_size_v=64)
    assert _eligible(group=16, features={"causal": False, "write_lse": False})
    assert _eligible(head_size=192, head_size_v=128)  # DiffKV


@pytest.mark.parametrize(
    "over",
    [
        {"arch": 80},
        {"compiled": False},  # the interpreter: Gluon has none
        {"cache_dtype": torch.float8_e4m3fn},
        {"q_dtype": torch.float32, "cache_dtype": torch.float32},
        {"q_dtype": torch.float16},  # q and cache dtypes differ
        {"head_size": 192, "head_size_v": 192},
        {"head_size": 256, "head_size_v": 256},
        {"head_size": 96, "head_size_v": 96},
        {"group": 32},
        {"scale": -0.1},  # the kernel keeps raw-logit maxima: a positive scale only
        {"aligned_rows": False},  # a strided row, or a cache base off a 16-byte boundary
        *({"features": {k: v}} for k, v in [
            ("sliding_window", True), ("sinks", True), ("softcap", True), ("alibi", True),
            ("kv_scale_mode", 1), ("split", True), ("check", True), ("v_from_k", True),
            ("scale_words", True),
        ]),
    ],
)  # fmt: skip
def test_leaves_the_rest_to_the_triton_kernel(over: dict) -> None:
    assert not _eligible(**over)


def test_environment_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_KERNELS_SM90_PREFILL", "0")
    assert not _eligible()


def test_dispatch_needs_a_compiled_run_on_cuda_tensors() -> None:
    """The launcher asks for the Gluon kernel only for compiled runs on a CUDA device (Gluon has
    no interpreter); the interpreter's CPU tensors keep the Triton kernel."""
    from kv_kernels.paged_attention.triton import _gluon_serves

    q = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(4, 8, 16, 256, dtype=torch.bfloat16)
    feats = dict(_FEATURES_OFF, ptx=True)
    assert not _gluon_serves("prefill", q, kv, 128, 0.088, feats)  # CPU tensors
    assert not _gluon_serves("prefill", q, kv, 128, 0.088, dict(feats, ptx=False))


def test_non_unit_row_stride_is_a_value_error() -> None:
    q = torch.zeros(8, 4, 256)[:, :, ::2]  # [8, 4, 128], column stride 2
    kv = torch.zeros(3, 1, 16, 256)
    with pytest.raises(ValueError, match=r"q\.stride\(-1\)=2.*contiguous last dimension"):
        _sm90_prefill.launch_sm90_prefill(
            q, kv, k_start=0, v_start=128, block_table=torch.zeros(1, 3, dtype=torch.int32),
            seq_lens=torch.tensor([8]), query_start_loc=torch.tensor([0, 8]), scale=0.1,
            causal=True, block_size=16, out=torch.zeros(8, 4, 128), lse=None, q_len_min=2,
        )  # fmt: skip


# ---- on an sm_90 GPU ---------------------------------------------------------------------------

_ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not _ON_SM90, reason="the Gluon prefill kernel is built for sm_90")


@pytest.fixture
def launches(count_gluon_launches) -> list[int]:
    """Counts the Gluon prefill kernel's launches."""
    return count_gluon_launches("prefill")


def _batch(*, q_lens, seq_lens, h=8, group=4, d=128, dv=None, n=16, dtype="bfloat16", seed=0):
    """A varlen batch whose pages outside the sequences hold nan (a read past a sequence shows)."""
    return make_paged_batch(
        q_lens=q_lens, seq_lens=seq_lens, num_kv_heads=h, group=group, head_size=d,
        head_size_v=dv, block_size=n, dtype=getattr(torch, dtype), num_layers=1, layer=0,
        seed=seed, device="cuda",
    )  # fmt: skip


# prefill chunks over cached context, a whole prompt, a decode row (Triton's decode launch) and
# lengths that end mid-page and mid-tile
_Q = [300, 1, 513, 64, 129]
_L = [1000, 700, 513, 2100, 129]


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(dtype="float16", n=128, group=8),
        dict(d=64, group=1, n=32),
        dict(group=16, h=2, n=64),
        dict(d=192, dv=128),
    ],
    ids=["bf16-d128-g4-n16", "fp16-d128-g8-n128", "bf16-d64-g1-n32", "bf16-g16-n64", "diffkv"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_matches_the_oracle(shape: dict, causal: bool, launches: list[int]) -> None:
    b = _batch(q_lens=_Q, seq_lens=_L, **shape)
    assert_triton_matches_oracle(b, causal=causal)
    assert launches, "the Gluon kernel did not serve the prefill launch"


@pytest.mark.gpu
@needs_sm90
def test_gpu_catches_a_wrong_page(launches: list[int]) -> None:
    """A planted wrong page (one block-table entry pointing at another block) must fail the same
    oracle check: the tolerance can fail."""
    b = _batch(q_lens=[600], seq_lens=[900])
    assert_triton_matches_oracle(b)  # the same batch with its true pages passes
    bad_table = plant_wrong_page(b["block_table"], [900], 16, b["layout"].num_blocks, page=50)
    bad = dict(b, block_table=bad_table)
    got = run_batch(bad, "triton")
    oracle, _ = attention_oracle_paged(
        b["q"], b["kv"], b["layout"], b["block_table"], b["seq_lens"], b["qsl"]
    )
    assert not check_close_to_oracle(got, oracle, dtype=torch.bfloat16).ok
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_tma_tiles_match_the_gathers(
    monkeypatch: pytest.MonkeyPatch, launches: list[int]
) -> None:
    """Pages of 128 tokens: whole tiles by TMA (the last, partial one gathered) give the same bits
    as gathering every tile, so a box at a wrong block, head, token or column shows."""
    b = _batch(q_lens=_Q, seq_lens=_L, n=128)
    with_tma = run_batch(b, "triton")
    monkeypatch.setattr(_sm90_prefill, "TMA_TILES", False)
    gathered = run_batch(b, "triton")
    assert torch.equal(with_tma, gathered)
    assert launches


@pytest.mark.parametrize(("n", "seq_lens"), [(16, (120, 90)), (128, (1000, 700))])
@pytest.mark.gpu
@needs_sm90
def test_gpu_cache_past_2_31_elements(
    n: int, seq_lens: tuple[int, int], launches: list[int]
) -> None:
    """A bf16 cache of more than 2^31 elements whose prefill reads its last blocks (64-bit page
    offsets in the producer's gathers; at page 128 its TMA boxes too)."""
    h, d = 8, 128
    nb = 2**31 // (h * n * 2 * d) + 16
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=nb, num_kv_heads=h, block_size=n, head_size=d,
        head_size_v=d, dtype="bfloat16",
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, "cuda", zero=False), layout, 0)
    ids = torch.arange(nb - 14, nb, dtype=torch.int32, device="cuda")
    kv[ids.long()] = torch.randn(14, h, n, 2 * d, device="cuda").to(kv.dtype)
    assert (nb - 1) * kv.stride(0) > 2**31
    table = torch.full((2, 10), -1, dtype=torch.int32, device="cuda")
    table[0, :8] = ids[:8]
    table[1, :6] = ids[8:]
    b = dict(
        q=torch.randn(160, h * 4, d, dtype=torch.bfloat16, device="cuda"), kv=kv, layout=layout,
        block_table=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        qsl=torch.tensor([0, 100, 160], dtype=torch.int32, device="cuda"), max_query_len=100,
    )  # fmt: skip
    got = run_batch(b, "triton")
    ref = run_batch(b, "reference")
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert launches


@pytest.mark.gpu
@needs_sm90
def test_gpu_environment_switch(monkeypatch: pytest.MonkeyPatch, launches: list[int]) -> None:
    """``KV_KERNELS_SM90_PREFILL=0``: the Triton kernel serves the prefill, to the same result."""
    b = _batch(q_lens=_Q, seq_lens=_L)
    gluon = run_batch(b, "triton")
    assert len(launches) == 1
    monkeypatch.setenv("KV_KERNELS_SM90_PREFILL", "0")
    triton_out = run_batch(b, "triton")
    assert len(launches) == 1
    torch.testing.assert_close(gluon.float(), triton_out.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_sm90
def test_gpu_num_decodes_leaves_the_decodes_out_of_the_grid(
    monkeypatch: pytest.MonkeyPatch, launches: list[int]
) -> None:
    """Leading decodes beside prefill chunks (and a decode after them): with ``num_decodes`` the
    Gluon kernel's grid starts past the decodes, and every row is the one the full grid gives,
    bit for bit, and the oracle's. Its grids recorded: each smaller by what the decodes
    reserved (:func:`kv_kernels.paged_attention._launch_args.prefill_grid_q`)."""
    grids: list[tuple[int, ...]] = []
    real = _sm90_prefill.sm90_prefill_kernel

    class Recording:
        def __getitem__(self, grid: tuple[int, ...]):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(_sm90_prefill, "sm90_prefill_kernel", Recording())
    q_lens = [1] * 40 + [300, 129, 1]
    b = _batch(q_lens=q_lens, seq_lens=[700] * 40 + [1000, 129, 900])
    full = run_batch(b, "triton", num_splits=1)
    for n in (1, 33, 40):
        got = run_batch(b, "triton", num_splits=1, num_decodes=n)
        torch.testing.assert_close(got, full, atol=0, rtol=0)
    assert_triton_matches_oracle(b, num_splits=1, num_decodes=40)
    t, s, block_q = sum(q_lens), len(q_lens), _sm90_prefill.BLOCK_M // 4
    want = [t // block_q + s - (n // block_q + n) for n in (0, 1, 33, 40, 40)]
    assert [g[0] for g in grids] == want and len(launches) == 5
