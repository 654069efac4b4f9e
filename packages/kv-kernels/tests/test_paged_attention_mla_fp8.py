"""MLA absorbed decode over an fp8 latent cache with one per-tensor scale (issue 31): vLLM's
``fp8_e4m3`` latent cache for DeepSeek-V3.

The latent row is written once, as ``x / k_scale`` (``reshape_and_cache`` takes ``k_scale`` only
for MLA), and K (the whole row) and V (its first ``kv_lora_rank`` columns) are read from those
same bytes times the same scale: ``k_scale`` is the latent's one scale and ``v_scale`` must be
``None``. The oracle attends in float64 over the rows as the cache gives them back (``read_kv``:
stored fp8 times ``k_scale``, exact in float32), never over the kernel's own reads, so a kernel
that scales K or V wrongly, or reads a wrong page, disagrees with it.

Under the interpreter the shapes are scaled down (latent 64 + 16, 8 heads); float32 queries run
the ieee dots, fp16 queries the fp16-MMA path of 1-byte pages (``KV_UPCAST``, its PTX replaced by
``.to``). DeepSeek-V3's shapes (512 + 64, 16 and 128 heads, bf16 queries) run on the GPU, where
on sm_90 the Gluon MLA kernel serves the e4m3 latent at 128 heads (its own tests:
``tests/test_sm90_mla.py``) and the Triton kernel the rest.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.paged_attention import triton as pa_triton
from kv_kernels.paged_attention._tiles import kernel_constexprs, select_config
from kv_kernels.testing import (
    assert_close_to_oracle,
    attention_oracle,
    check_close_to_oracle,
    plant_wrong_page,
)
from kv_kernels.testing_attention import counting_gluon_launches, make_mla_batch, run_batch
from kv_spec import KVCacheLayout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RANK, ROPE = 64, 16
FORMATS = ["fp8_e4m3", "fp8_e5m2"]
DECODE = dict(q_lens=[1, 1, 1, 1], seq_lens=[70, 1, 33, 16])


def make(fmt: str = "fp8_e4m3", k_scale: float | torch.Tensor = 0.25, **kw) -> dict:
    args = dict(rank=RANK, rope=ROPE, device=DEVICE, cache_dtype=fmt, k_scale=k_scale)
    return make_mla_batch(**{**args, **kw})


def run(b: dict, impl: str, *, k_scale: object = "batch", **kw) -> torch.Tensor:
    """``paged_attention`` over the batch's latent with its own ``k_scale`` (or the given one)."""
    ks = b["k_scale"] if isinstance(k_scale, str) else k_scale
    return run_batch(b, impl, kv_lora_rank=b["rank"], scale=0.1, k_scale=ks, **kw)


def oracle(b: dict, *, k_factor: float = 1.0, v_factor: float = 1.0) -> torch.Tensor:
    """The float64 oracle over the latents the cache holds; ``k_factor`` / ``v_factor`` scale K /
    V (a wrong dequantization, to show the bound sees one)."""
    ks = [lat * k_factor for lat in b["latents"]]
    vs = [lat[..., : b["rank"]] * v_factor for lat in b["latents"]]
    return attention_oracle(b["q"].cpu(), ks, vs, b["q_lens"], scale=0.1)[0]


def _zero_nans(kv: torch.Tensor) -> None:
    """The poisoned (unwritten) rows as zeros (fp8 has no ``nan_to_num``; its finite values
    round-trip through float32 exactly)."""
    kv.copy_(kv.float().nan_to_num(0.0).to(kv.dtype))


# -- the write: reshape_and_cache already stores the latent as x / k_scale -----------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_latent_is_stored_over_its_one_scale(fmt: str) -> None:
    b = make(fmt, q_lens=[1], seq_lens=[20])
    lay, kv = b["layout"], b["kv"]
    assert (lay.kv_quant.value, lay.dtype, kv.element_size()) == ("fp8_per_tensor", fmt, 1)
    # what the cache gives back is fp8 times the scale: every value is a multiple of the scale
    # times an fp8 number, and none of the poisoned rows leaked in
    back = b["latents"][0].float()  # [20, 1, 80]
    stored = back / 0.25
    assert torch.equal(stored.to(kv.dtype).float(), stored)
    assert torch.isfinite(back).all() and back.abs().max() > 4.0  # the latent's spread survived


# -- parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_reference_reads_the_fp8_latent(fmt: str, scale_kind: str) -> None:
    ks = 0.25 if scale_kind == "float" else torch.tensor([0.25], device=DEVICE)
    b = make(fmt, ks, q_lens=[1, 4, 1], seq_lens=[40, 20, 1])
    out = run(b, "reference")
    assert out.shape == (6, 8, RANK)
    assert_close_to_oracle(out.cpu(), oracle(b), dtype=torch.float32)


def _spy_constexprs(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    seen: list[dict] = []

    def spy(*args, **kw):
        out = kernel_constexprs(*args, **kw)
        seen.append(out)
        return out

    monkeypatch.setattr(pa_triton, "kernel_constexprs", spy)
    return seen


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [None, 3])
def test_triton_reads_the_fp8_latent(
    fmt: str,
    q_dtype: torch.dtype,
    splits: int | None,
    triton_device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32 queries: ieee dots over the upcast tile; fp16 queries: the fp16 MMAs of 1-byte
    pages (q rows scaled by powers of two, P carried as ``p * 2^15``), V the latent tile's own
    first columns in both, the one scale folded into the logits and the output."""
    b = make(fmt, dtype=q_dtype, **DECODE)
    b["q"] = b["q"].to(q_dtype)
    seen = _spy_constexprs(monkeypatch)
    out = run(b, "triton", num_splits=splits)
    c = seen[0]
    assert c["V_FROM_K"] and c["KV_SCALE"] == 1  # the float k_scale rides as a scalar
    assert c["KV_UPCAST"] == (q_dtype == torch.float16)
    # (K keeps its fp16 copy: read as bytes, V -- the same tile -- would be read byte by byte)
    assert not c["K_DIRECT"] and not c["V_DIRECT"]
    assert_close_to_oracle(out.cpu(), oracle(b), dtype=q_dtype)


def test_triton_reads_a_per_head_tensor_scale(triton_device: str) -> None:
    """The scale as a ``[1]`` tensor (one kv head: per tensor and per head alike), read from
    memory by the kernel (``KV_SCALE`` 2)."""
    b = make(
        "fp8_e4m3", torch.tensor([0.25], device=triton_device), q_lens=[1, 3], seq_lens=[33, 9]
    )
    assert_close_to_oracle(run(b, "triton").cpu(), oracle(b), dtype=torch.float32)


# -- planted bugs: the bound sees a wrong scale on K, on V, on both, and a wrong page -------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_wrong_scales_fail_the_check(impl: str, request: pytest.FixtureRequest) -> None:
    if impl == "triton":
        request.getfixturevalue("triton_device")
    b = make("fp8_e4m3", q_lens=[1, 1, 2], seq_lens=[64, 20, 9])
    out = run(b, impl).cpu()
    assert check_close_to_oracle(out, oracle(b), dtype=torch.float32).ok
    # read with a scale 25% off (K and V both: the kernel's one scale)
    wrong = run(b, impl, k_scale=0.25 * 1.25).cpu()
    assert not check_close_to_oracle(wrong, oracle(b), dtype=torch.float32).ok
    # a kernel that dequantized only K, or only V, would be held to these oracles and miss
    for factors in ({"k_factor": 1.05}, {"v_factor": 1.05}):
        res = check_close_to_oracle(out, oracle(b, **factors), dtype=torch.float32)
        assert not res.ok, f"a 5% wrong scale on {next(iter(factors))} passed the bound"
    _zero_nans(b["kv"])  # the spare page is read on purpose
    table = plant_wrong_page(b["block_table"].cpu(), [64, 20, 9], 16, b["layout"].num_blocks)
    bad = run(dict(b, block_table=table.to(b["block_table"].device)), impl).cpu()
    assert not check_close_to_oracle(bad, oracle(b), dtype=torch.float32).ok


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_the_latent_takes_one_scale(impl: str) -> None:
    b = make("fp8_e4m3", q_lens=[1], seq_lens=[5])
    for v_scale in (0.25, torch.tensor([0.25], device=DEVICE)):
        with pytest.raises(ValueError, match=r"its one scale is k_scale; pass v_scale=None"):
            run(b, impl, v_scale=v_scale)
    with pytest.raises(ValueError, match="k_scale is required for an fp8 cache"):
        run(b, impl, k_scale=None)
    with pytest.raises(ValueError, match="k_scale=0.0 must be finite and > 0"):
        run(b, impl, k_scale=0.0)


def test_per_token_head_latents_stay_refused() -> None:
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=4, num_kv_heads=1, block_size=16,
        head_size=RANK + ROPE, head_size_v=0, dtype="fp8_e4m3", kv_quant="fp8_per_token_head",
        is_mla=True,
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout), layout, 0)
    q = torch.randn(1, 8, RANK + ROPE)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="supports kv_quant 'none' and 'fp8_per_tensor'"):
        paged_attention(
            q, kv, layout, one[None], one, torch.tensor([0, 1], dtype=torch.int32), 1,
            kv_lora_rank=RANK,
        )  # fmt: skip


# -- the launch config ---------------------------------------------------------------------------


def test_fp8_latent_configs() -> None:
    """DeepSeek-V3 at tensor-parallel 8 (16 heads): no register cap, K's fp16 copy (V reads it),
    32-token tiles at 2 stages whose shared memory (fp8 stages, the fp16 copy, the q tile) lets
    two programs share an SM as the split rule assumes. At 128 heads no cap either (capped at
    128 registers, ptxas refused the sm_90 build)."""
    shape = dict(head_size=576, head_size_v=512, block_size=64, arch=90, v_from_k=True)
    cfg = select_config("decode", group=16, elem_bytes=1, **shape)
    assert (cfg.tile_n, cfg.num_warps, cfg.num_stages) == (32, 4, 2)
    assert (cfg.max_registers, cfg.kv_upcast, cfg.k_direct) == (0, True, False)
    assert (cfg.waves, cfg.programs_per_sm) == (1, 2)
    shared = (cfg.num_stages * cfg.tile_n * 576 + cfg.tile_n * 576 * 2 + 16 * 576 * 2) * 2
    assert shared <= 227 * 1024, shared
    cfg128 = select_config("decode", group=128, elem_bytes=1, **shape)
    assert (cfg128.max_registers, cfg128.k_direct) == (0, False)
    # 1-byte K/V pages keep their cap and K as bytes (the MLA rule is MLA's alone)
    kv = select_config("decode", head_size=128, head_size_v=128, group=4, block_size=16,
                       elem_bytes=1)  # fmt: skip
    assert (kv.max_registers, kv.k_direct) == (128, True)


# -- GPU: DeepSeek-V3's shapes -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_deepseek_v3_fp8_latent(heads: int, fmt: str) -> None:
    """512 + 64 latent at page 64, bf16 queries, 16 heads (tensor-parallel 8: the Triton
    kernel's bandwidth-bound config) and 128 (one GPU): the compiled kernel against the oracle,
    the reference over the same fp8 cache (float32 math rounded to bf16 once) as the
    low-precision bound; a 25% wrong scale and a wrong page fail the same check. On sm_90 the
    Gluon MLA kernel serves the e4m3 latent at 128 heads (and only that one here: e5m2 and 16
    heads stay with the Triton kernel). A second call takes the api's cached fast path and
    must agree bit for bit."""
    lens = [3000, 700, 64]
    b = make(fmt, 0.05, q_lens=[1, 1, 1], seq_lens=lens, num_heads=heads, rank=512, rope=64,
             block_size=64, dtype=torch.bfloat16)  # fmt: skip
    _zero_nans(b["kv"])
    want = oracle(b)
    low = run(b, "reference").cpu()
    with counting_gluon_launches("mla") as calls:
        got = run(b, "triton")
        again = run(b, "triton")
    gluon = (
        heads == 128
        and fmt == "fp8_e4m3"
        and torch.cuda.get_device_capability() == (9, 0)
        and os.environ.get("KV_KERNELS_SM90_MLA", "1") != "0"
    )
    assert bool(calls) == gluon, (calls, gluon)
    assert torch.equal(got, again)
    assert_close_to_oracle(got.cpu(), want, lowprec_reference=low)
    for splits in (1, 4):
        assert_close_to_oracle(
            run(b, "triton", num_splits=splits).cpu(), want, lowprec_reference=low
        )
    wrong = run(b, "triton", k_scale=0.05 * 1.25).cpu()
    assert not check_close_to_oracle(wrong, want, lowprec_reference=low).ok
    table = plant_wrong_page(b["block_table"].cpu(), lens, 64, b["layout"].num_blocks)
    bad = run(dict(b, block_table=table.cuda()), "triton").cpu()
    assert not check_close_to_oracle(bad, want, lowprec_reference=low).ok
