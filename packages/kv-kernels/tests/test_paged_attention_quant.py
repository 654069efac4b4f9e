"""Paged attention over per-token-head quantized caches (int8 / fp8, float32 scales inline in the
page, as ``reshape_and_cache`` writes them).

Every cache here is filled by the write op itself (write -> read round trip); the oracle attends
over ``read_kv``'s dequantized rows (a separate read path: advanced indexing and a byte view), so
a kernel that reads the wrong scale, the wrong byte order or the wrong page disagrees with it.
int8 values and their products with float32 scales are exact in float32, so the interpreter's
float32 run is held to the float32 bound; fp8 -> float32 is exact as well (every e4m3 / e5m2 value
is a float32), so the same bound applies.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import scale_plane_view
from kv_kernels.paged_attention import triton as pa_triton
from kv_kernels.testing import assert_close_to_oracle, check_close_to_oracle
from kv_kernels.testing_attention import CACHE_DTYPES, run_batch
from kv_kernels.testing_attention import make_quant_batch as _make_quant_batch
from kv_kernels.testing_attention import quant_oracle as oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_quant_batch(**kw: object) -> dict:
    return _make_quant_batch(device=DEVICE, **kw)  # type: ignore[arg-type]


MIXED = dict(q_lens=[5, 1, 3], seq_lens=[21, 40, 9])


@pytest.mark.parametrize("kv_quant", list(CACHE_DTYPES))
def test_reference_reads_inline_scales(kv_quant: str) -> None:
    b = make_quant_batch(kv_quant=kv_quant, **MIXED)
    assert_close_to_oracle(run_batch(b, "reference").cpu(), oracle(b), dtype=torch.float32)


@pytest.mark.parametrize(
    ("kv_quant", "head_size_v", "write_impl"),
    [
        # C = 32 + 32 + 8: every scale 4-byte aligned -> one float32 load per scale
        ("int8_per_token_head", 32, "reference"),
        ("fp8_per_token_head", 32, "reference"),
        # C = 32 + 14 + 8: the scales sit at byte 46, so the kernel assembles them from bytes;
        # and the Triton write kernel fills the cache (the write -> read round trip on one path)
        ("int8_per_token_head", 14, "triton"),
    ],
)
def test_triton_reads_inline_scales(
    kv_quant: str, head_size_v: int, write_impl: str, triton_device: str
) -> None:
    b = make_quant_batch(kv_quant=kv_quant, head_size_v=head_size_v, write_impl=write_impl, **MIXED)
    want = oracle(b)
    out = run_batch(b, "triton")
    assert_close_to_oracle(out.cpu(), want, dtype=torch.float32)
    # and split KV (flash-decoding partials merged by LSE) reads the same scales
    assert_close_to_oracle(run_batch(b, "triton", num_splits=3).cpu(), want, dtype=torch.float32)


def test_triton_inline_scales_16bit_query(triton_device: str) -> None:
    """fp16 queries against an int8 cache: the tile is upcast to fp16 (exact for int8), the
    scales stay float32; held to the fp16 bound."""
    b = make_quant_batch(kv_quant="int8_per_token_head", **MIXED)
    b["q"] = b["q"].half()
    want = oracle(b)
    assert_close_to_oracle(run_batch(b, "triton").cpu(), want, dtype=torch.float16)


@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("kv_quant", list(CACHE_DTYPES))
def test_per_token_head_fp16_rows(
    kv_quant: str, upcast: bool, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 queries whose rows span 1e-2 .. 3e4, with the launcher's plain upcast and with a
    config asking for KV_UPCAST (q.K as an fp16 MMA with each row scaled by a power of two,
    test_paged_attention_upcast.py; the default for these pages since K is read as bytes in the
    MMA operand's layout, k_direct), the inline scales on the logit and P columns; with and
    without KV splits, held to the fp16 bound."""
    orig = pa_triton.select_config

    def pick(kind: str, **kw: object) -> object:
        cfg = orig(kind, **kw)  # type: ignore[arg-type]
        return dataclasses.replace(cfg, kv_upcast=upcast) if kind == "decode" else cfg

    monkeypatch.setattr(pa_triton, "select_config", pick)
    b = make_quant_batch(kv_quant=kv_quant, q_lens=[1, 3, 1], seq_lens=[50, 21, 9])
    gen = torch.Generator().manual_seed(2)
    mag = 10.0 ** (torch.rand(b["q"].shape[0], b["q"].shape[1], 1, generator=gen) * 6 - 2)
    b["q"] = (b["q"].cpu() * mag).clamp(-3e4, 3e4).half().to(DEVICE)
    want = oracle(b)
    for splits in (None, 2):
        out = run_batch(b, "triton", num_splits=splits).cpu()
        assert_close_to_oracle(out, want, dtype=torch.float16)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_wrong_scale_fails_the_check(impl: str, request: pytest.FixtureRequest) -> None:
    """One token's K and V scales doubled in the cache (a writer that stored the wrong scale):
    the oracle, which read the cache before the damage, must see it."""
    if impl == "triton":
        request.getfixturevalue("triton_device")
    b = make_quant_batch(kv_quant="int8_per_token_head", q_lens=[1], seq_lens=[24])
    want = oracle(b)
    assert check_close_to_oracle(run_batch(b, impl).cpu(), want, dtype=torch.float32).ok
    layout, slot = b["layout"], int(b["slots"][0][17])
    start, stop = layout.scale_range
    row = b["kv"][slot // layout.block_size, :, slot % layout.block_size]  # [H, C] view
    scales = row.view(torch.uint8)[:, start:stop].contiguous().view(torch.float32)  # [H, 2]
    row.view(torch.uint8)[:, start:stop] = (scales * 2).view(torch.uint8)
    res = check_close_to_oracle(run_batch(b, impl).cpu(), want, dtype=torch.float32)
    assert not res.ok, "a doubled scale went unnoticed"


@pytest.mark.parametrize(
    ("kv_quant", "write_impl"),
    [
        ("int8_per_token_head", "reference"),
        ("fp8_per_token_head", "reference"),
        ("int8_per_token_head", "triton"),
    ],
)
def test_triton_reads_a_scale_plane(kv_quant: str, write_impl: str, triton_device: str) -> None:
    """The scales in each page's scale plane (kv-spec ``scale_plane``: rows of K + V only): the
    reference and the Triton kernel, with and without KV splits, against the oracle over
    ``read_kv``'s rows; and the Triton write fills the plane the kernel reads."""
    b = make_quant_batch(kv_quant=kv_quant, write_impl=write_impl, scale_plane=True, **MIXED)
    assert b["layout"].scale_range is None and b["kv"].shape[-1] == 64
    want = oracle(b)
    assert_close_to_oracle(run_batch(b, "reference").cpu(), want, dtype=torch.float32)
    assert_close_to_oracle(run_batch(b, "triton").cpu(), want, dtype=torch.float32)
    assert_close_to_oracle(run_batch(b, "triton", num_splits=3).cpu(), want, dtype=torch.float32)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_wrong_plane_scale_fails_the_check(impl: str, request: pytest.FixtureRequest) -> None:
    """One token's K and V scales doubled in the page's scale plane: the read must see it (a
    kernel reading the plane at the wrong head or token would read an undamaged scale)."""
    if impl == "triton":
        request.getfixturevalue("triton_device")
    b = make_quant_batch(
        kv_quant="int8_per_token_head", q_lens=[1], seq_lens=[24], scale_plane=True
    )
    want = oracle(b)
    assert check_close_to_oracle(run_batch(b, impl).cpu(), want, dtype=torch.float32).ok
    layout, slot = b["layout"], int(b["slots"][0][17])
    plane = scale_plane_view(b["kv"], layout)
    plane[slot // layout.block_size, :, slot % layout.block_size] *= 2
    res = check_close_to_oracle(run_batch(b, impl).cpu(), want, dtype=torch.float32)
    assert not res.ok, "a doubled plane scale went unnoticed"


def test_scales_are_refused_for_inline_modes() -> None:
    b = make_quant_batch(kv_quant="int8_per_token_head", q_lens=[1], seq_lens=[5])
    with pytest.raises(ValueError, match="k_scale was given but kv_quant='int8_per_token_head'"):
        run_batch(b, "reference", k_scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_quant", list(CACHE_DTYPES))
def test_gpu_bf16_long_decode(kv_quant: str) -> None:
    """bf16 queries over a long per-token-head cache written by the Triton write kernel, head 128:
    the compiled kernel against the oracle (bf16 torch reference as the low-precision run)."""
    b = make_quant_batch(kv_quant=kv_quant, q_lens=[1, 1, 4], seq_lens=[4000, 900, 300],
                         head_size=128, head_size_v=128, num_kv_heads=2, group=4,
                         write_impl="triton")  # fmt: skip
    b["q"] = b["q"].bfloat16()
    want = oracle(b)
    low = run_batch(b, "reference").cpu()
    assert_close_to_oracle(run_batch(b, "triton").cpu(), want, lowprec_reference=low)
