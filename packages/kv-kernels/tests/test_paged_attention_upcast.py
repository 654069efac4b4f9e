"""1-byte pages with 16-bit queries through ``KV_UPCAST`` (``AttentionConfig.kv_upcast``): the
tiles upcast in their load layout, q.K (and P.V for per-tensor scales) as fp16 MMAs with each
query row scaled by a power of two, P carried as ``p * 2^15`` (see ``paged_attention/_upcast.py``).

Under the interpreter the PTX conversions are replaced by ``.to`` (``PTX`` off) and everything
else -- the fp16 query rows and their scales, the fp16 P and its 2^15, the LSE correction, the
per-token-head scales beside an fp16 q.K -- runs as compiled; the GPU build's PTX is checked by
``test_aot_compile_attention.py`` and timed by ``bench_paged_attention.py --tune-paths``.

Queries are fp16 (the interpreter computes bf16 wrongly), with rows of very different
magnitudes (1e-3 .. 3e4), so a wrong row scale shows; the oracle attends over the dequantized
fp8 / int8 values in float64 and the bound is the fp16 row of ``kv_kernels.testing.TOLERANCES``.
Negative checks show that bound catches one wrong page and a 10% wrong scale. Per-token-head
pages under the same path: ``test_paged_attention_quant.py::test_per_token_head_fp16_rows``.

The operands read as bytes (``k_direct`` / ``v_direct``, the default) are checked beside the
earlier fp16 copies; V's column renaming (``v_operand`` / ``restore_columns``) also on its own, at
the full 128-column width whose four 32-column groups the small batches do not reach.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import triton as pa_triton
from kv_kernels.paged_attention._tiles import kernel_constexprs, select_config
from kv_kernels.paged_attention._upcast import restore_columns, upcast_tile, v_operand
from kv_kernels.testing import check_close_to_oracle, plant_wrong_page
from kv_kernels.testing_attention import (
    assert_lse_close,
    assert_rows_close,
    batch_oracle,
    make_paged_batch,
    run_batch,
)
from kv_spec import KVCacheLayout

FP8 = {"e4m3": ("fp8_e4m3", torch.float8_e4m3fn), "e5m2": ("fp8_e5m2", torch.float8_e5m2)}
K_SCALE = torch.tensor([0.5, 0.25])  # per kv head
V_SCALE = 0.125
# decode steps (1 and 3 tokens: both in the decode class) beside an empty sequence; pages of 16
DECODE = dict(q_lens=[1, 3, 0, 1], seq_lens=[70, 40, 0, 19])


def _fp8_batch(fmt: str, device: str) -> dict:
    """The batch's K / V stored as fp8 per tensor (K scaled per kv head), the oracle's dense
    K / V replaced by the dequantized fp8 values, and fp16 queries of spread magnitudes."""
    b = make_paged_batch(head_size=32, group=4, device=device, **DECODE)
    name, dt = FP8[fmt]
    lay = b["layout"]
    fp8 = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=lay.num_blocks, num_kv_heads=2,
        block_size=16, head_size=32, head_size_v=32, dtype=name, kv_quant="fp8_per_tensor",
    )  # fmt: skip
    kv8 = layer_view(allocate_kv_cache(fp8, device), fp8, 0)
    src = b["kv"].float().nan_to_num(0.0) * 3  # values up to ~12 in fp8 units
    kv8[..., :32] = (src[..., :32] / K_SCALE.to(device)[None, :, None, None]).to(dt)
    kv8[..., 32:] = (src[..., 32:] / V_SCALE).to(dt)
    ks, vs = [], []
    for s, n in enumerate(b["lens"]):
        pages = kv8[b["block_table"][s, : -(-n // 16)].long()].float().cpu()  # [p, H, N, C]
        flat = pages.permute(1, 0, 2, 3).reshape(2, -1, 64)[:, :n]  # [H, L, C]
        ks.append((flat[..., :32] * K_SCALE[:, None, None]).double())
        vs.append((flat[..., 32:] * V_SCALE).double())
    gen = torch.Generator().manual_seed(1)
    mag = 10.0 ** (torch.rand(b["q"].shape[0], b["q"].shape[1], 1, generator=gen) * 7.5 - 3)
    q = (b["q"].float().cpu() * mag).clamp(-3e4, 3e4).half()
    return dict(b, kv=kv8, layout=fp8, ks=ks, vs=vs, q=q.to(device))


def _spy_constexprs(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    seen: list[dict] = []

    def spy(*args, **kw):
        out = kernel_constexprs(*args, **kw)
        seen.append(out)
        return out

    monkeypatch.setattr(pa_triton, "kernel_constexprs", spy)
    return seen


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("splits", [None, 3])
def test_fp8_per_tensor_fp16_mma(
    fmt: str, splits: int | None, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = _fp8_batch(fmt, triton_device)
    seen = _spy_constexprs(monkeypatch)
    out, lse = run_batch(
        b, "triton", k_scale=K_SCALE.to(triton_device), v_scale=V_SCALE, num_splits=splits,
        return_lse=True,
    )  # fmt: skip
    assert seen and seen[0]["KV_UPCAST"], "decode over fp8 pages did not take the fp16-MMA path"
    # (V as bytes only where the warps split its width in 32-column groups: not at head 32
    # over 4 warps; test_fp8_per_tensor_operand_paths runs it)
    assert seen[0]["K_DIRECT"] and not seen[0]["V_DIRECT"], "K not read as bytes"
    assert seen[0]["PTX"] == (triton_device == "cuda")
    want, want_lse = batch_oracle(b)
    assert_rows_close(out, want, torch.float16)
    # the LSE takes out the 2^15 that P carries
    assert_lse_close(lse, want_lse)
    # the bound would see a 10% wrong K scale and one wrong page
    wrong = check_close_to_oracle(
        out.cpu(), batch_oracle(b, scale=1.1 / 32**0.5)[0], dtype=torch.float16
    )
    assert not wrong.ok, "a 10% wrong q.K scale passed the bound"
    table = plant_wrong_page(b["block_table"].cpu(), b["lens"], 16, b["layout"].num_blocks)
    bad = run_batch(
        dict(b, block_table=table.to(triton_device)), "triton", k_scale=K_SCALE.to(triton_device),
        v_scale=V_SCALE, num_splits=splits,
    )  # fmt: skip
    assert not check_close_to_oracle(bad.cpu(), want, dtype=torch.float16).ok, "wrong page passed"


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize(
    "direct", [(False, False), (True, False), (True, True)], ids=["fp16_copies", "k_only", "both"]
)
def test_fp8_per_tensor_operand_paths(
    fmt: str, direct: tuple[bool, bool], triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K and V through fp16 copies, K alone as bytes, both as bytes (V's 32 columns over one
    warp, the width V_DIRECT asks for; the interpreter ignores warps); same bound, KV splits."""
    orig = pa_triton.select_config

    def pick(kind: str, **kw: object) -> object:
        cfg = orig(kind, **kw)  # type: ignore[arg-type]
        if kind != "decode":
            return cfg
        return dataclasses.replace(
            cfg, k_direct=direct[0], v_direct=direct[1], num_warps=1 if direct[1] else 4
        )

    monkeypatch.setattr(pa_triton, "select_config", pick)
    seen = _spy_constexprs(monkeypatch)
    b = _fp8_batch(fmt, triton_device)
    out = run_batch(b, "triton", k_scale=K_SCALE.to(triton_device), v_scale=V_SCALE, num_splits=3)
    assert (seen[0]["K_DIRECT"], seen[0]["V_DIRECT"]) == direct
    assert_rows_close(out, batch_oracle(b)[0], torch.float16)


@triton.jit
def _pv_kernel(p_ptr, v_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, DV: tl.constexpr):
    # P [M, N] fp16 times V [N, DV] (int8) as the decode loop does with V_DIRECT: V's columns
    # renamed, upcast, the product's columns put back
    rm, rn, rd = tl.arange(0, M), tl.arange(0, N), tl.arange(0, DV)
    p = tl.load(p_ptr + rm[:, None] * N + rn[None, :])
    v = tl.load(v_ptr + rn[:, None] * DV + rd[None, :])
    v = upcast_tile(v_operand(v, N, DV), tl.float16, False, True)
    acc = tl.dot(p, v, tl.zeros([M, DV], dtype=tl.float32))
    acc = restore_columns(acc, M, DV)
    tl.store(out_ptr + rm[:, None] * DV + rd[None, :], acc)


@pytest.mark.parametrize("dv", [32, 128])
def test_v_column_renaming_round_trips(dv: int, triton_device: str) -> None:
    """P.V over the renamed V, its columns put back, equals P.V: exact (small integers), and a
    renaming left in place would show (every column of V differs)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randint(-4, 5, (16, 64), generator=gen).half()
    v = (torch.arange(dv)[None, :] * 3 + torch.randint(-9, 10, (64, dv), generator=gen)) % 127
    v = v.to(torch.int8)
    out = torch.empty(16, dv)
    p_d, v_d, out_d = p.to(triton_device), v.to(triton_device), out.to(triton_device)
    _pv_kernel[(1,)](p_d, v_d, out_d, 16, 64, dv)
    torch.testing.assert_close(
        out_d.cpu(), p.double() @ v.double(), rtol=0, atol=0, check_dtype=False
    )


def test_fp8_per_tensor_fp16_mma_scalar_scales(triton_device: str) -> None:
    """Scales as two floats (folded into the q.K scale and the output as scalars)."""
    b = _fp8_batch("e4m3", triton_device)
    scalar = dict(b, ks=[k / K_SCALE[:, None, None].double() * 0.5 for k in b["ks"]])
    out = run_batch(b, "triton", k_scale=0.5, v_scale=V_SCALE)
    assert_rows_close(out, batch_oracle(scalar)[0], torch.float16)


@pytest.mark.gpu
def test_gpu_bf16_rows_past_fp16_range() -> None:
    """bf16 query rows of 1e-3 .. 1e6 (past fp16's 65504) over fp8 pages: the PTX upcasts and
    the fp16 MMAs of the compiled kernel, each row brought into fp16's range by its own power of
    two; held to the bf16 bound. (A softmax scale of 1e-5 keeps the largest rows' logits near
    10: the test is about the query's range, not about near-ties of huge logits.)"""
    b = _fp8_batch("e4m3", "cuda")
    gen = torch.Generator().manual_seed(3)
    q = b["q"].float().cpu()
    q = q / q.abs().amax(-1, keepdim=True)  # rows of max 1, then spread over 1e-3 .. 1e6
    q = q * 10.0 ** (torch.rand(q.shape[0], q.shape[1], 1, generator=gen) * 9 - 3)
    b = dict(b, q=q.bfloat16().cuda())
    for splits in (None, 3):
        out = run_batch(
            b, "triton", k_scale=K_SCALE.cuda(), v_scale=V_SCALE, num_splits=splits, scale=1e-5
        )
        assert_rows_close(out, batch_oracle(b, scale=1e-5)[0], torch.bfloat16)


def test_select_config_upcasts_one_byte_decode_only() -> None:
    shape = dict(head_size=128, head_size_v=128, group=4, block_size=16)
    assert select_config("decode", elem_bytes=1, **shape).kv_upcast
    for inline in (False, True):
        cfg1 = select_config("decode", elem_bytes=1, inline_scales=inline, **shape)
        # (per-token-head pages keep V's fp16 copy: their P.V is bf16, which has no packed
        # byte conversion, and V as bytes timed slower there on the H100)
        assert cfg1.kv_upcast and cfg1.k_direct and cfg1.v_direct == (not inline)
    assert not select_config("prefill", elem_bytes=1, **shape).k_direct
    assert not select_config("decode", elem_bytes=2, **shape).kv_upcast
    assert not select_config("prefill", elem_bytes=1, **shape).kv_upcast
    cfg = select_config("decode", elem_bytes=1, **shape)
    feats = dict(
        kind="decode", head_size=128, head_size_v=128, block_size=16, group=4, causal=True,
        sliding_window=False, sinks=False, softcap=False, alibi=False, kv_scale_mode=2,
        split=False, write_lse=False, check=False,
    )  # fmt: skip
    assert kernel_constexprs(cfg, dot_ieee=False, kv_bytes=1, **feats)["KV_UPCAST"]
    # float32 queries keep their ieee dots; 16-bit pages have nothing to upcast
    assert not kernel_constexprs(cfg, dot_ieee=True, kv_bytes=1, **feats)["KV_UPCAST"]
    assert not kernel_constexprs(cfg, dot_ieee=False, kv_bytes=2, **feats)["KV_UPCAST"]
