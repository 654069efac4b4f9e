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

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import triton as pa_triton
from kv_kernels.reshape_and_cache import read_kv, reshape_and_cache
from kv_kernels.testing import assert_close_to_oracle, attention_oracle, check_close_to_oracle
from kv_kernels.testing_attention import run_batch
from kv_spec import KVCacheLayout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CACHE_DTYPES = {"int8_per_token_head": "int8", "fp8_per_token_head": "fp8_e4m3"}


def make_quant_batch(
    *,
    kv_quant: str,
    q_lens: list[int],
    seq_lens: list[int],
    head_size: int = 32,
    head_size_v: int = 32,
    num_kv_heads: int = 2,
    group: int = 2,
    block_size: int = 16,
    order: str = "LBNHC",
    write_impl: str = "reference",
    seed: int = 0,
) -> dict:
    """A varlen batch whose cache was written by ``reshape_and_cache`` through a shuffled table."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 2
    layout = KVCacheLayout(
        order=order,
        num_layers=2,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=CACHE_DTYPES[kv_quant],
        kv_quant=kv_quant,
    )
    kv = layer_view(allocate_kv_cache(layout, DEVICE), layout, 1)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)
    slots_of: list[torch.Tensor] = []
    used = 0
    for s, n in enumerate(seq_lens):
        ids = torch.tensor(perm[used : used + pages[s]], dtype=torch.int32)
        used += pages[s]
        table[s, : pages[s]] = ids
        pos = torch.arange(n)
        slots = ids[pos // block_size].long() * block_size + pos % block_size  # [n]
        # rows of different magnitudes, so per-token scales differ widely
        mag = torch.rand(n, num_kv_heads, 1, generator=gen) * 4 + 0.1
        key = torch.randn(n, num_kv_heads, head_size, generator=gen) * mag
        value = torch.randn(n, num_kv_heads, head_size_v, generator=gen) * mag
        reshape_and_cache(
            key.to(DEVICE), value.to(DEVICE), kv, slots.to(DEVICE), layout, impl=write_impl
        )
        slots_of.append(slots)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=gen)
    return dict(
        q=q.to(DEVICE),
        kv=kv,
        layout=layout,
        block_table=table.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        qsl=qsl.to(DEVICE),
        max_query_len=max(q_lens),
        slots=slots_of,
        q_lens=q_lens,
    )


def oracle(b: dict) -> torch.Tensor:
    """The float64 oracle over each sequence's rows as ``read_kv`` dequantizes them."""
    ks, vs = [], []
    for slots in b["slots"]:
        k, v = read_kv(b["kv"], b["layout"], slots.to(DEVICE))
        assert v is not None
        ks.append(k.cpu().double())  # [L, H, D]
        vs.append(v.cpu().double())
    return attention_oracle(b["q"].cpu(), ks, vs, b["q_lens"])[0]


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
