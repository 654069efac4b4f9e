"""Paged attention's TMA path and 64-bit addressing: 16-bit prefill tiles that cover whole pages are
read by TMA boxes (checked against the oracle, against the pointer gathers bit for bit, and with a
descriptor planted one page off), and caches whose element offsets pass 2^31 (decode and a TMA
prefill). Batches and the oracle: ``kv_kernels.testing_attention``.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    # conftest does the same; repeated here so the module also runs on its own. Must precede the
    # first import of kv_kernels.paged_attention.triton (imported lazily by the api).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.testing_attention import (
    assert_rows_close,
    batch_oracle,
    feature_kwargs,
    make_paged_batch,
    run_batch,
    tensors_to,
)
from kv_spec import KVCacheLayout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tma_launcher(monkeypatch: pytest.MonkeyPatch, plant=None) -> list[bool]:
    """Spy on the launcher's TMA descriptors (``plant``: replace the cache they address); returns
    the list of calls' ``descriptors made`` flags."""
    launcher = importlib.import_module("kv_kernels.paged_attention.triton")
    made: list[bool] = []
    orig = launcher._tma_descriptors

    def spy(kv_cache, *a, **kw):
        descs = orig(plant(kv_cache) if plant else kv_cache, *a, **kw)
        made.append(descs is not None)
        return descs

    monkeypatch.setattr(launcher, "_tma_descriptors", spy)
    return made


@pytest.mark.parametrize("feature", ["plain", "window", "sinks_softcap", "noncausal"])
@pytest.mark.parametrize("block_size", [64, 128])
def test_prefill_tma_tiles(
    feature: str, block_size: int, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16-bit pages holding whole 64-token prefill tiles: the unmasked tiles are read by TMA
    boxes. They match the oracle (nan-poisoned spare pages catch a wrong page) and equal the
    pointer gathers bit for bit; a descriptor one page off fails the oracle check."""
    b = make_paged_batch(
        q_lens=[150, 1, 70], seq_lens=[150, 90, 260], block_size=block_size, head_size=32,
        group=2, dtype=torch.float16,
    )  # fmt: skip
    kw = tensors_to(DEVICE, feature_kwargs(feature, b["q"].shape[1]))
    ref = batch_oracle(b, **kw)[0]
    made = _tma_launcher(monkeypatch)
    out = run_batch(b, "triton", **kw)
    assert made == [True]
    assert_rows_close(out, ref, torch.float16)
    monkeypatch.undo()
    gathered = run_batch(b, "triton", **kw)
    assert torch.equal(out, gathered)
    if feature == "plain":
        _tma_launcher(monkeypatch, plant=lambda kv: kv[1:])  # block b read from b + 1
        with pytest.raises(AssertionError):
            assert_rows_close(run_batch(b, "triton", **kw), ref, torch.float16)


@pytest.mark.parametrize("n", [16, 64])  # 64: a prefill whose whole-page tiles TMA reads
def test_offsets_past_2_31_elements(
    n: int, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks whose element offset exceeds 2^31: a 4 GiB cache allocated lazily (torch.empty
    maps pages on first touch), of which only the few pages the batch uses are written."""
    if DEVICE == "cuda":
        pytest.skip("covered by the GPU test with a real allocation")
    head, h = 32, 2
    page = n * h * 2 * head  # elements per page
    num_blocks = 2**31 // page + 64
    layout = KVCacheLayout(
        order="LBNHC",
        num_layers=1,
        num_blocks=num_blocks,
        num_kv_heads=h,
        block_size=n,
        head_size=head,
        head_size_v=head,
        dtype="float16",
    )
    storage = allocate_kv_cache(layout, "cpu", zero=False)  # 4 GiB virtual, untouched
    kv = layer_view(storage, layout, 0)
    assert kv.stride(0) * (num_blocks - 1) > 2**31
    gen = torch.Generator().manual_seed(1)
    if n == 16:
        lens, q_lens = [40, 20], [2, 1]
        ids = [[num_blocks - 1, 3, num_blocks - 5], [num_blocks - 2, 5]]
    else:
        lens, q_lens = [200, 20], [70, 1]
        ids = [[num_blocks - 1, 3, num_blocks - 5, num_blocks - 3], [num_blocks - 2]]
    table = torch.full((2, 4), -1, dtype=torch.int32)
    ks, vs = [], []
    for s, L in enumerate(lens):
        table[s, : len(ids[s])] = torch.tensor(ids[s], dtype=torch.int32)
        k = torch.randn(h, L, head, generator=gen).half()
        v = torch.randn(h, L, head, generator=gen).half()
        for p, blk in enumerate(ids[s]):
            lo, hi = p * n, min(L, (p + 1) * n)
            kv[blk, :, :, :] = 0
            kv[blk, :, : hi - lo, :head] = k[:, lo:hi]
            kv[blk, :, : hi - lo, head:] = v[:, lo:hi]
        ks.append(k.double())
        vs.append(v.double())
    b = dict(
        q=torch.randn(sum(q_lens), 2 * h, head, generator=gen).half(),
        kv=kv,
        layout=layout,
        block_table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        qsl=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32),
        max_query_len=max(q_lens),
        ks=ks,
        vs=vs,
        q_lens=q_lens,
        lens=lens,
    )
    ref = batch_oracle(b)[0]
    assert_rows_close(run_batch(b, "reference"), ref, torch.float16)
    made = _tma_launcher(monkeypatch)
    assert_rows_close(run_batch(b, "triton"), ref, torch.float16)
    assert made == ([True] if n == 64 else [])  # the prefill's TMA boxes address past 2^31 too
    assert_rows_close(run_batch(b, "triton", num_splits=2), ref, torch.float16)
