"""Heads that are a power of two plus a power-of-two tail (DiffKV 192 = 128 + 64, MLA 576 =
512 + 64) run q.k as two column tiles instead of padding the head to the next power of two."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.paged_attention._tiles import kernel_constexprs, select_config, split_head
from kv_kernels.testing import assert_close_to_oracle, attention_oracle
from kv_spec import KVCacheLayout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _attend(q_lens, seq_lens, *, head_size, head_size_v, group, dtype, **kw):
    """Kernel output and float64 oracle for a batch whose K/V are drawn densely and paged
    through a reversed block table (the oracle never reads the cache)."""
    gen = torch.Generator().manual_seed(0)
    block = 16
    pages = [-(-n // block) for n in seq_lens]
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=sum(pages) + 1, num_kv_heads=1, block_size=block,
        head_size=head_size, head_size_v=head_size_v, dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, DEVICE), layout, 0)
    kv.fill_(float("nan"))
    ids = list(range(layout.num_blocks))[::-1]
    table = torch.full((len(seq_lens), max(pages)), -1, dtype=torch.int32)
    ks, vs = [], []
    for s, n in enumerate(seq_lens):
        row, ids = ids[: pages[s]], ids[pages[s] :]
        table[s, : pages[s]] = torch.tensor(row)
        k = torch.randn(n, 1, head_size, generator=gen).to(dtype)
        v = torch.randn(n, 1, head_size_v, generator=gen).to(dtype)
        for p, blk in enumerate(row):
            lo, hi = p * block, min(n, (p + 1) * block)
            kv[blk, 0, : hi - lo, :head_size] = k[lo:hi, 0].to(DEVICE)
            kv[blk, 0, : hi - lo, head_size:] = v[lo:hi, 0].to(DEVICE)
        ks.append(k.double())
        vs.append(v.double())
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), group, head_size, generator=gen).to(dtype)
    out = paged_attention(
        q.to(DEVICE), kv, layout, table.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qsl.to(DEVICE), max(q_lens),
        impl="triton", **kw,
    )  # fmt: skip
    return out.cpu(), attention_oracle(q, ks, vs, q_lens)[0]


@pytest.mark.parametrize(
    ("head", "want"),
    [(192, (128, 64)), (576, (512, 64)), (48, (32, 16)), (80, (64, 16)), (128, (128, 0)),
     (40, (64, 0)), (96, (64, 32)), (200, (256, 0))],
)  # fmt: skip
def test_split_head(head: int, want: tuple[int, int]) -> None:
    assert split_head(head) == want
    main, tail = want
    assert main + tail == head or tail == 0


def test_diffkv_192_128_compiles_no_padded_columns() -> None:
    shape = dict(head_size=192, head_size_v=128, group=8, block_size=16)
    for kind in ("decode", "prefill"):
        cfg = select_config(kind, **shape)
        c = kernel_constexprs(
            cfg, kind=kind, causal=True, sliding_window=False, sinks=False, softcap=False,
            alibi=False, kv_scale_mode=0, split=False, write_lse=False, dot_ieee=False,
            check=False, **shape,
        )  # fmt: skip
        # 128 + 64 columns of q.k (was 256: a quarter of the work on zero padding)
        assert (c["D_PAD"], c["D_TAIL"], c["DV_PAD"]) == (128, 64, 128)


def test_triton_diffkv_192_128_full_size(triton_device: str) -> None:
    """The real DiffKV head sizes (not scaled down): a decode, a chunked prefill, a split run."""
    shape = dict(head_size=192, head_size_v=128, group=4, dtype=torch.float32)
    out, want = _attend([1, 5], [40, 21], **shape)
    assert_close_to_oracle(out, want, dtype=torch.float32)
    out, want = _attend([1, 1], [40, 21], num_splits=2, **shape)
    assert_close_to_oracle(out, want, dtype=torch.float32)


def test_triton_split_head_fp16_tail_16(triton_device: str) -> None:
    out, want = _attend([3, 1], [19, 33], head_size=80, head_size_v=48, group=2,
                        dtype=torch.float16)  # fmt: skip
    assert_close_to_oracle(out, want, dtype=torch.float16)
