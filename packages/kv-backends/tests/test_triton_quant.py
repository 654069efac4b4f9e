"""TRITON over per-token-head quantized caches (int8 / fp8 with inline float32 scales), written by
the backend's own cache write and read by its forward, under the Triton interpreter; and the
TRITON impl's device-side metadata flag (``check_metadata``).

The oracle attends over what ``read_kv`` reads back from the cache (dequantized by a separate
torch path), so a kernel that misreads a scale or a page disagrees with it.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from kv_backends import get_backend
from kv_backends.testing import make_paged_batch, oracle_attention
from kv_kernels.reshape_and_cache import read_kv
from kv_kernels.testing import assert_close_to_oracle, check_close_to_oracle

QUANT = {"int8_per_token_head": "int8", "fp8_per_token_head": "fp8_e4m3"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the CPU case


def _written_batch(kv_quant: str, dtype: str = "float32", **kw):
    b = make_paged_batch(
        query_lens=[1, 4, 1], seq_lens=[23, 9, 40], num_q_heads=4, num_kv_heads=2,
        dtype=dtype, kv_cache_dtype=QUANT[kv_quant], kv_quant=kv_quant, fill=False,
        pad_tokens=1, device=DEVICE, **kw,
    )  # fmt: skip
    impl = get_backend("TRITON").make_impl(b.config, b.layout, check_metadata=True)
    impl.do_kv_cache_update(None, b.key, b.value, b.kv_cache, b.all_slots)
    k, v = read_kv(b.kv_cache, b.layout, b.all_slots)
    assert v is not None
    b = dataclasses.replace(b, key=k.to(b.q.dtype), value=v.to(b.q.dtype))
    return b, impl


@pytest.mark.parametrize("kv_quant", list(QUANT))
def test_triton_backend_reads_per_token_head_caches(
    kv_quant: str, triton_interpreter: None
) -> None:
    caps = get_backend("TRITON").CAPABILITIES
    assert kv_quant in caps.kv_quant_modes and QUANT[kv_quant] in caps.kv_cache_dtypes
    b, impl = _written_batch(kv_quant)
    md = get_backend("TRITON").make_builder(b.config, b.layout).build(b.common)
    out = impl.forward(None, b.q, b.kv_cache, md)
    t = b.common.num_actual_tokens
    # read_kv's rows are exact float32 values, so the oracle over them is the float32 bound
    assert_close_to_oracle(out[:t], oracle_attention(b)[:t], dtype=torch.float32)
    assert not out[t:].any()
    assert int(impl.metadata_errors(DEVICE)) == 0


@pytest.mark.parametrize("kv_quant", list(QUANT))
def test_triton_backend_reads_scale_plane_caches(kv_quant: str, triton_interpreter: None) -> None:
    """The same through a layout whose scales sit in each page's scale plane (kv-spec
    ``scale_plane=True``): the backend's write fills the plane, its forward reads it."""
    b, impl = _written_batch(kv_quant, scale_plane=True)
    assert b.layout.scale_placement == "plane"
    md = get_backend("TRITON").make_builder(b.config, b.layout).build(b.common)
    out = impl.forward(None, b.q, b.kv_cache, md)
    t = b.common.num_actual_tokens
    assert_close_to_oracle(out[:t], oracle_attention(b)[:t], dtype=torch.float32)
    assert not out[t:].any()


def test_triton_backend_sees_a_damaged_scale(triton_interpreter: None) -> None:
    b, impl = _written_batch("int8_per_token_head")
    want = oracle_attention(b)
    slot = int(b.all_slots[30])  # a context token of request 2
    start, stop = b.layout.scale_range
    row = b.kv_cache[slot // b.layout.block_size, :, slot % b.layout.block_size]  # [H, C]
    row.view(torch.uint8)[:, start:stop] = (
        row.view(torch.uint8)[:, start:stop].contiguous().view(torch.float32) * 3
    ).view(torch.uint8)
    md = get_backend("TRITON").make_builder(b.config, b.layout).build(b.common)
    t = b.common.num_actual_tokens
    assert not check_close_to_oracle(impl.forward(None, b.q, b.kv_cache, md)[:t], want[:t]).ok


def test_metadata_flag_reaches_both_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``check_metadata`` the impl hands one device flag to the attention kernel and to the
    cache write (on CUDA they count bad ids / slots there instead of syncing; on the CPU the host
    checks raise first, so the wiring is what is checked here)."""
    # the subpackages (kv_kernels' top level re-exports functions of the same names)
    pa = importlib.import_module("kv_kernels.paged_attention")
    rc = importlib.import_module("kv_kernels.reshape_and_cache")

    seen: dict[str, object] = {}
    monkeypatch.setattr(pa, "paged_attention", lambda *a, **kw: seen.setdefault("attn", kw))
    monkeypatch.setattr(rc, "reshape_and_cache", lambda *a, **kw: seen.setdefault("write", kw))
    b = make_paged_batch(query_lens=[2], seq_lens=[5], num_q_heads=2, num_kv_heads=1, device=DEVICE)
    impl = get_backend("TRITON").make_impl(b.config, b.layout, check_metadata=True)
    md = get_backend("TRITON").make_builder(b.config, b.layout).build(b.common)
    impl.do_kv_cache_update(None, b.key, b.value, b.kv_cache, b.all_slots)
    impl.forward(None, b.q, b.kv_cache, md)
    flag = impl.metadata_errors(DEVICE)
    assert flag.dtype == torch.int32 and flag.shape == (1,)
    assert seen["attn"]["error_flag"] is flag and seen["write"]["error_flag"] is flag  # type: ignore[index]
    flag += 3
    impl.reset_metadata_errors()
    assert int(flag) == 0
    plain = get_backend("TRITON").make_impl(b.config, b.layout)
    plain.forward(None, b.q, b.kv_cache, md)
    assert seen["attn"]["error_flag"] is flag  # the first call's kwargs were kept  # type: ignore[index]
    with pytest.raises(ValueError, match="check_metadata=True"):
        plain.metadata_errors(DEVICE)
