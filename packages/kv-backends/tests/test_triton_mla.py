"""TRITON_MLA: selection for DeepSeek-V3 on a CUDA platform, and the whole backend (latent cache
write, metadata builder, absorbed attention) under the Triton interpreter at small sizes
(latent 128 + 64 rope, 8 query heads) against kv-kernels' float64 oracle."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kv_backends import CommonAttentionMetadata, Platform, get_backend
from kv_backends.config import AttentionConfig, configs_for_model
from kv_backends.selector import select_backend
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.reshape_and_cache import read_kv
from kv_kernels.testing import (
    assert_close_to_oracle,
    attention_oracle,
    check_close_to_oracle,
    plant_wrong_page,
)
from kv_spec import KVCacheLayout, MLAAttentionSpec

RANK, ROPE, HEADS, BLOCK = 128, 64, 8, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the CPU case


def _deepseek_config() -> AttentionConfig:
    (cfg,) = configs_for_model("DeepSeek-V3", block_size=64).values()
    return cfg


def test_deepseek_v3_selects_triton_mla_on_cuda() -> None:
    cfg = _deepseek_config()
    for cc in ((9, 0), (8, 0), (10, 0)):
        sel = select_backend(cfg, Platform.cuda(cc))
        assert sel.backend.NAME == "TRITON_MLA", str(sel)


def test_mla_needs_a_gpu_and_only_mla_layers() -> None:
    # the CPU serves MLA through the reference (TORCH_SDPA); TRITON_MLA says why not there
    sel = select_backend(_deepseek_config(), Platform.cpu())
    assert sel.name == "TORCH_SDPA", str(sel)
    assert "needs a CUDA GPU" in get_backend("TRITON_MLA").validate(
        _deepseek_config(), Platform.cpu()
    )
    plain = AttentionConfig(
        num_q_heads=8, num_kv_heads=1, head_size=192, head_size_v=192, dtype="bfloat16",
        kv_cache_dtype="bfloat16", block_size=16,
    )  # fmt: skip
    reasons = get_backend("TRITON_MLA").validate(plain)
    assert any("only MLA" in r for r in reasons), reasons
    assert any("MLA" in r for r in get_backend("TRITON").validate(_deepseek_config()))


def _setup(dtype: str = "float32", seq_lens=(40, 70, 9), query_lens=(1, 1, 3), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=RANK + ROPE, dtype=dtype)
    cfg = AttentionConfig.from_spec(spec, num_q_heads=HEADS)
    pages = [-(-n // BLOCK) for n in seq_lens]
    layout = KVCacheLayout.from_spec(spec, num_blocks=sum(pages) + 2)
    cache = layer_view(allocate_kv_cache(layout, DEVICE), layout, 0)
    perm = torch.randperm(layout.num_blocks, generator=gen).tolist()
    table, used = [], 0
    for p in pages:
        table.append(perm[used : used + p])
        used += p
    width = max(pages)
    bt = torch.tensor([row + [-1] * (width - len(row)) for row in table], dtype=torch.int32)
    td = getattr(torch, dtype)
    latents = [torch.randn(n, 1, RANK + ROPE, generator=gen).to(DEVICE, td) for n in seq_lens]
    q = torch.randn(sum(query_lens), HEADS, RANK + ROPE, generator=gen).to(DEVICE, td)
    # context tokens are written by the backend's own write path, one whole-context step
    ctx = CommonAttentionMetadata.from_lists(
        query_lens=list(seq_lens),
        seq_lens=list(seq_lens),
        block_table=bt,
        block_size=BLOCK,
        device=DEVICE,
    )
    common = CommonAttentionMetadata.from_lists(
        query_lens=list(query_lens), seq_lens=list(seq_lens), block_table=bt, block_size=BLOCK,
        pad_tokens_to=sum(query_lens) + 2, device=DEVICE,
    )  # fmt: skip
    return cfg, layout, cache, latents, q, ctx, common


def _oracle(q: torch.Tensor, latents: list[torch.Tensor], query_lens, scale: float):
    ks = [lat.cpu().double() for lat in latents]
    vs = [lat.double()[..., :RANK] for lat in ks]
    return attention_oracle(q.cpu(), ks, vs, list(query_lens), scale=scale)[0]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backend_writes_and_attends(dtype: str, triton_interpreter: None) -> None:
    cfg, layout, cache, latents, q, ctx, common = _setup(dtype)
    backend = get_backend("TRITON_MLA")
    impl = backend.make_impl(cfg, layout, scale=0.08, check_metadata=True)
    assert impl.kv_lora_rank == RANK
    impl.do_kv_cache_update(None, torch.cat(latents), None, cache, ctx.slot_mapping)
    md = backend.make_builder(cfg, layout).build(common)
    padded = torch.cat([q, q.new_zeros(2, HEADS, RANK + ROPE)])
    out = impl.forward(None, padded, cache, md)
    assert out.shape == (padded.shape[0], HEADS, RANK)
    t = q.shape[0]
    assert_close_to_oracle(out[:t].cpu(), _oracle(q, latents, [1, 1, 3], 0.08), dtype=q.dtype)
    assert not out[t:].any(), "padding rows must stay zero"
    assert int(impl.metadata_errors(DEVICE)) == 0


def test_backend_sees_a_wrong_page_and_counts_a_bad_id(triton_interpreter: None) -> None:
    cfg, layout, cache, latents, q, ctx, common = _setup(seq_lens=(64, 20), query_lens=(1, 1))
    backend = get_backend("TRITON_MLA")
    impl = backend.make_impl(cfg, layout, scale=0.08, check_metadata=True)
    impl.do_kv_cache_update(None, torch.cat(latents), None, cache, ctx.slot_mapping)
    want = _oracle(q, latents, [1, 1], 0.08)
    bt = plant_wrong_page(common.block_table, [64, 20], BLOCK, layout.num_blocks)
    md = backend.make_builder(cfg, layout).build(common)
    out = impl.forward(None, torch.cat([q, q[:2] * 0]), cache, replace(md, block_table=bt))
    assert not check_close_to_oracle(out[:2].cpu(), want).ok
    bad = bt.clone()
    bad[1, 0] = layout.num_blocks + 5  # past the cache: redirected and counted, no fault
    # device-side counting is what the flag is for: skip the host checks as a CUDA step would
    paged_attention(
        q, cache, layout, bad, md.seq_lens, md.query_start_loc[: 3], 1,
        kv_lora_rank=RANK, impl="triton", validate=False,
        error_flag=impl.metadata_errors(DEVICE),
    )  # fmt: skip
    assert int(impl.metadata_errors(DEVICE)) > 0
    impl.reset_metadata_errors()
    assert int(impl.metadata_errors(DEVICE)) == 0


def test_write_refuses_a_value_tensor() -> None:
    cfg, layout, cache, latents, _, ctx, _ = _setup()
    impl = get_backend("TRITON_MLA").make_impl(cfg, layout)
    lat = torch.cat(latents)
    with pytest.raises(ValueError, match="value=None"):
        impl.do_kv_cache_update(None, lat, lat, cache, ctx.slot_mapping)


def test_batch_invariance_bitwise(triton_interpreter: None) -> None:
    """Declared ``batch_invariant``: under a batch-invariant config each request's rows are
    bit-identical alone and in a batch (the conformance suite's invariance test builds K/V
    layers, which TRITON_MLA rejects, so MLA's is here)."""
    cfg, layout, cache, latents, q, ctx, _ = _setup(seq_lens=(40, 70, 9), query_lens=(1, 1, 3))
    cfg = replace(cfg, batch_invariant=True)
    backend = get_backend("TRITON_MLA")
    impl = backend.make_impl(cfg, layout, scale=0.08)
    assert impl.num_splits == 1
    impl.do_kv_cache_update(None, torch.cat(latents), None, cache, ctx.slot_mapping)
    bt = ctx.block_table.cpu()
    full = CommonAttentionMetadata.from_lists(
        query_lens=[1, 1, 3], seq_lens=[40, 70, 9], block_table=bt, block_size=BLOCK, device=DEVICE
    )
    alone = CommonAttentionMetadata.from_lists(
        query_lens=[1], seq_lens=[70], block_table=bt[1:2], block_size=BLOCK, device=DEVICE
    )
    builder = backend.make_builder(cfg, layout)
    out_full = impl.forward(None, q, cache, builder.build(full))
    out_alone = impl.forward(None, q[1:2], cache, builder.build(alone))
    assert torch.equal(out_full[1:2], out_alone)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backend_attends_an_fp8_latent(fmt: str, dtype: str, triton_interpreter: None) -> None:
    """An fp8 latent (issue 31): declared, written through the impl's own write path with its one
    scale (``k_scale``; the engine's equal ``v_scale`` accepted), read back by the Triton
    forward; the oracle attends over what ``read_kv`` dequantizes from the cache. A 25% wrong
    scale fails the same check. (On the CPU the write runs the reference: the interpreter casts
    float32 to fp8 wrongly; the Triton write is held to it bitwise on the GPU.)"""
    caps = get_backend("TRITON_MLA").CAPABILITIES
    assert "fp8_per_tensor" in caps.kv_quant_modes and fmt in caps.kv_cache_dtypes
    gen = torch.Generator().manual_seed(3)
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=RANK + ROPE, dtype=fmt,
                            kv_quant="fp8_per_tensor")  # fmt: skip
    cfg = AttentionConfig.from_spec(spec, num_q_heads=HEADS, dtype=dtype)
    backend = get_backend("TRITON_MLA")
    assert not backend.validate(cfg, Platform.cuda((9, 0)))
    seq_lens, query_lens = [40, 70, 9], [1, 1, 3]
    layout = KVCacheLayout.from_spec(spec, num_blocks=sum(-(-n // BLOCK) for n in seq_lens) + 2)
    cache = layer_view(allocate_kv_cache(layout, DEVICE), layout, 0)
    width = max(-(-n // BLOCK) for n in seq_lens)
    ids = torch.randperm(layout.num_blocks, generator=gen)
    bt, used = torch.full((3, width), -1, dtype=torch.int32), 0
    for r, n in enumerate(seq_lens):
        bt[r, : -(-n // BLOCK)] = ids[used : used + -(-n // BLOCK)]
        used += -(-n // BLOCK)
    ctx = CommonAttentionMetadata.from_lists(
        query_lens=seq_lens, seq_lens=seq_lens, block_table=bt, block_size=BLOCK, device=DEVICE
    )
    latent = torch.randn(sum(seq_lens), 1, RANK + ROPE, generator=gen) * 4
    k = torch.full((), 0.125, device=DEVICE)
    writer = backend.make_impl(cfg, layout, k_scale=k, v_scale=k.clone(), impl="reference")
    writer.do_kv_cache_update(None, latent.to(DEVICE), None, cache, ctx.slot_mapping)
    back, _ = read_kv(cache, layout, ctx.slot_mapping, k)  # [T, 1, RANK + ROPE]
    latents = list(back.cpu().split(seq_lens))
    assert torch.equal(((back / 0.125).to(cache.dtype).float() * 0.125), back)
    td = getattr(torch, dtype)
    q = torch.randn(sum(query_lens), HEADS, RANK + ROPE, generator=gen).to(DEVICE, td)
    common = CommonAttentionMetadata.from_lists(
        query_lens=query_lens, seq_lens=seq_lens, block_table=bt, block_size=BLOCK, device=DEVICE
    )
    md = backend.make_builder(cfg, layout).build(common)
    want = _oracle(q, latents, query_lens, 0.08)
    impl = backend.make_impl(cfg, layout, scale=0.08, k_scale=k)
    out = impl.forward(None, q, cache, md)
    assert_close_to_oracle(out.cpu(), want, dtype=td)
    wrong = backend.make_impl(cfg, layout, scale=0.08, k_scale=0.125 * 1.25)
    assert not check_close_to_oracle(wrong.forward(None, q, cache, md).cpu(), want, dtype=td).ok
