"""Conformance: every capability each backend's ``CAPABILITIES`` literal declares, against the one
float64 oracle (kv-kernels' ``attention_oracle``, docs/attention_semantics.md), with tolerances
scaled to each output row (kv-kernels' ``check_close_to_oracle``).

Cases come from :mod:`kv_backends.conformance` (read from the literals; sampled with a documented
seeded rule, ``KVSTACK_CONFORMANCE=full`` for the full product). On the CPU: TORCH_SDPA,
FLEX_ATTENTION eager and TRITON under ``TRITON_INTERPRET=1`` (fp8 read path included), float32 and
float16. Marked ``gpu``: every backend, every declared dtype.

Also here: negative tests (one planted wrong page, one dropped last page must fail the check,
and the old fixed ``atol = rtol = 2e-2`` would have passed them) and batch invariance (bitwise)
for each backend that declares it.

MLA (``mla`` in the literal): :func:`kv_backends.conformance.mla_cases_for` over a latent cache
(``make_latent_batch``; fp8 per-tensor latents with their one ``k_scale`` where the literal
declares them) against the same oracle with K = the latent row and V its latent part; on the CPU
TORCH_SDPA (kv-kernels' reference), marked ``gpu`` every MLA backend. Planted bugs the check
must catch: the latent's rope part dropped (a write that stores ``kv_c`` without ``k_pe``), a
wrong page, an fp8 latent read with a 25% wrong scale; bitwise batch invariance too.
"""

from __future__ import annotations

import dataclasses
import os
import types
import zlib

import pytest
import torch
from kv_backends import CommonAttentionMetadata, Platform, get_backend
from kv_backends.conformance import (
    MLA_LATENT,
    Case,
    cases_for,
    feature_kwargs,
    mla_cases_for,
    serves_kv_layers,
    untestable_claims,
)
from kv_backends.registry import BACKEND_CLASSES
from kv_backends.testing import (
    PagedBatch,
    lowprec_reference,
    make_batch_impl,
    make_latent_batch,
    make_paged_batch,
    oracle_attention,
    run_backend,
)
from kv_kernels.testing import check_close_to_oracle, drop_last_page, plant_wrong_page
from kv_spec import to_torch_dtype

CPU_BACKENDS = ("TORCH_SDPA", "FLEX_ATTENTION", "TRITON")
# Mixed batch: decodes, a chunked prefill, an empty request, a longer context; padding rows.
QUERY_LENS = [1, 5, 0, 3, 1]
SEQ_LENS = [9, 21, 4, 40, 70]
GPU_QUERY_LENS = [1, 1, 37, 1, 130, 0, 5]
GPU_SEQ_LENS = [200, 513, 37, 1000, 300, 17, 77]
_IMPL_OPTIONS = {"FLEX_ATTENTION": {"compiled": False}}  # eager on the CPU (compiled on the GPU)


def _impl_options(name: str, device: str) -> dict:
    return _IMPL_OPTIONS.get(name, {}) if device == "cpu" else {}


def _run_case(case: Case, device: str) -> None:
    gpu = device == "cuda"
    b = make_paged_batch(
        query_lens=GPU_QUERY_LENS if gpu else QUERY_LENS,
        seq_lens=GPU_SEQ_LENS if gpu else SEQ_LENS,
        num_layers=3 if case.order[0] == "B" else 1,
        layer=1 if case.order[0] == "B" else 0,
        pad_tokens=2,
        device=device,
        seed=zlib.crc32(case.id.encode()),  # stable across processes (str hash is salted)
        **feature_kwargs(case),
    )
    out = run_backend(case.backend, b, impl_options=_impl_options(case.backend, device))
    t = b.common.num_actual_tokens
    # On the GPU, bf16/fp16 kernels round P to the input dtype: the bound adds 2x the error of a
    # plain torch run in that dtype (flash-attention's rule). The CPU cases are held to the
    # dtype's few-ulp bound alone.
    low = lowprec_reference(b)[:t] if gpu and case.dtype != "float32" else None
    res = check_close_to_oracle(out[:t], oracle_attention(b)[:t], lowprec_reference=low)
    assert res.ok, f"{case.id}: {res.message}"
    # Padding rows are zero (or left alone when written into a zeroed buffer).
    assert not out[t:].any(), f"{case.id}: padding rows are not zero"


def _cpu_cases() -> list:
    return [pytest.param(c, id=c.id) for n in CPU_BACKENDS for c in cases_for(n)]


def _gpu_cases() -> list:
    return [pytest.param(c, id=c.id) for n in BACKEND_CLASSES for c in cases_for(n, gpu=True)]


@pytest.mark.parametrize("name", list(BACKEND_CLASSES))
def test_every_declared_capability_is_testable(name: str) -> None:
    caps = get_backend(name).CAPABILITIES
    assert not untestable_claims(caps), (
        f"{name} declares {untestable_claims(caps)}, which no conformance test exercises: "
        "test it or take it out of the literal"
    )
    if caps.mla:
        assert mla_cases_for(name, gpu=True), f"{name} declares MLA but has no MLA case"
    # an MLA-only backend serves no K/V case; every other backend has some
    assert cases_for(name, gpu=True) or caps.mla, f"{name}: no conformance case at all"


@pytest.mark.parametrize("case", _cpu_cases())
def test_conformance_cpu(case: Case, request: pytest.FixtureRequest) -> None:
    if case.backend == "TRITON":
        request.getfixturevalue("triton_interpreter")
    _run_case(case, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", _gpu_cases())
def test_conformance_gpu(case: Case) -> None:
    reasons = get_backend(case.backend).validate(
        _config_of(case), Platform.detect()
    )  # installed packages, compute capability
    if reasons:
        pytest.skip(f"{case.backend} cannot run here: {reasons}")
    _run_case(case, "cuda")


def _config_of(case: Case):
    b = make_paged_batch(query_lens=[1], seq_lens=[1], make_kv=False, **feature_kwargs(case))
    return b.config


# -- negative tests: the check must see one wrong page and one dropped page ----------------------

# A long decode, the regime of the issue: 9k keys, values ~0.01-0.02 per row.
_LONG = {"query_lens": [1, 1], "seq_lens": [9000, 300], "block_size": 16, "num_kv_heads": 1}


def _with(b: PagedBatch, **common_fields) -> PagedBatch:
    return dataclasses.replace(b, common=dataclasses.replace(b.common, **common_fields))


def _old_tolerance_passes(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_planted_wrong_page_fails_the_check(dtype: str) -> None:
    b = make_paged_batch(dtype=dtype, **_LONG)
    ref = oracle_attention(b)
    t = b.common.num_actual_tokens
    good = run_backend("TORCH_SDPA", b)
    assert check_close_to_oracle(good[:t], ref[:t]).ok
    bt = plant_wrong_page(
        b.common.block_table, b.common.host_seq_lens(), 16, b.layout.num_blocks, request=0
    )
    bad = run_backend("TORCH_SDPA", _with(b, block_table=bt))
    res = check_close_to_oracle(bad[:t], ref[:t])
    assert not res.ok and res.worst_row[0] == 0, res.message
    assert _old_tolerance_passes(bad[:t], ref[:t]), "the old tolerance should have missed it"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dropped_last_page_fails_the_check(dtype: str) -> None:
    b = make_paged_batch(dtype=dtype, **_LONG)
    ref = oracle_attention(b)
    t = b.common.num_actual_tokens
    seq = drop_last_page(b.common.seq_lens, 16, request=0)
    short = _with(b, seq_lens=seq, seq_lens_cpu=seq.cpu(), max_seq_len=int(seq.max()))
    bad = run_backend("TORCH_SDPA", short)
    res = check_close_to_oracle(bad[:t], ref[:t])
    assert not res.ok and res.worst_row[0] == 0, res.message
    assert _old_tolerance_passes(bad[:t], ref[:t]), "the old tolerance should have missed it"


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_each_cpu_backend_sees_a_wrong_page(name: str, request: pytest.FixtureRequest) -> None:
    """The same check on every CPU backend's output (short context: the interpreter is slow)."""
    if name == "TRITON":
        request.getfixturevalue("triton_interpreter")
    b = make_paged_batch(query_lens=[1, 3], seq_lens=[64, 40], dtype="float16")
    ref = oracle_attention(b)
    bt = plant_wrong_page(b.common.block_table, b.common.host_seq_lens(), 16, b.layout.num_blocks)
    out = run_backend(name, _with(b, block_table=bt), impl_options=_impl_options(name, "cpu"))
    t = b.common.num_actual_tokens
    assert not check_close_to_oracle(out[:t], ref[:t]).ok


# -- batch invariance ------------------------------------------------------------------------------

# MLA-only backends reject these K/V batches; MLA invariance is below (and TRITON_MLA's in
# test_triton_mla.py)
_INVARIANT = [
    n
    for n in BACKEND_CLASSES
    if get_backend(n).CAPABILITIES.batch_invariant and serves_kv_layers(n)
]


def _sub_batch(b: PagedBatch, reqs: list[int], query_lens: list[int]) -> tuple[PagedBatch, list]:
    """A batch of requests ``reqs`` of ``b`` (same blocks, same contents), and each one's q rows
    in ``b``."""
    qsl = b.common.host_query_start_loc().tolist()
    seq = b.common.host_seq_lens().tolist()
    rows = [list(range(qsl[r], qsl[r + 1])) for r in reqs]
    common = CommonAttentionMetadata.from_lists(
        query_lens=[query_lens[r] for r in reqs],
        seq_lens=[seq[r] for r in reqs],
        block_table=b.common.block_table[reqs].cpu(),
        block_size=b.config.kernel_block_size,
        device=b.q.device,
    )
    q = b.q[[i for r in rows for i in r]]
    return dataclasses.replace(b, common=common, q=q), rows


@pytest.mark.parametrize("name", _INVARIANT)
def test_batch_invariance_bitwise(name: str, request: pytest.FixtureRequest) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if name in CPU_BACKENDS and name == "TRITON":
        request.getfixturevalue("triton_interpreter")
    if device == "cpu" and get_backend(name).CAPABILITIES.needs_gpu and name != "TRITON":
        pytest.skip(f"{name} needs a GPU")
    qlens = [1, 6, 1, 2, 1, 9]
    b = make_paged_batch(
        query_lens=qlens,
        seq_lens=[33, 50, 17, 64, 90, 20],
        dtype="float16" if device == "cpu" else "bfloat16",
        batch_invariant=True,
        device=device,
    )
    opts = _impl_options(name, device)
    full = run_backend(name, b, impl_options=opts)
    qsl = b.common.host_query_start_loc().tolist()
    for target in (0, 1, 4):
        want = full[qsl[target] : qsl[target + 1]]
        for reqs in ([target], [3, target], [target, 2, 5, 1 if target != 1 else 0]):
            sub, _ = _sub_batch(b, reqs, qlens)
            out = run_backend(name, sub, impl_options=opts)
            sq = sub.common.host_query_start_loc().tolist()
            j = reqs.index(target)
            got = out[sq[j] : sq[j + 1]]
            assert torch.equal(got, want), (
                f"{name}: request {target} differs in batch {reqs} (max diff "
                f"{(got.float() - want.float()).abs().max().item():.3g})"
            )


def test_conformance_sampling_is_seeded_and_covering() -> None:
    """The sampled set is a pure function of the seed and covers every (feature, axis value)."""
    from kv_backends.conformance import full_product

    a, b2 = cases_for("TRITON"), cases_for("TRITON")
    assert a == b2
    full = full_product("TRITON", gpu=False)
    for axis in ("dtype", "cache_dtype", "order", "kernel_block_size"):
        for feat in {c.feature for c in full}:
            want = {getattr(c, axis) for c in full if c.feature == feat}
            got = {getattr(c, axis) for c in a if c.feature == feat}
            assert want == got, (feat, axis)
    if os.environ.get("KVSTACK_CONFORMANCE", "").lower() != "full":
        assert len(a) < len(full) // 4


def test_oracle_dtype_of_fp8_cache() -> None:
    """fp8 batches hand the oracle exactly what a reader gets back (stored * scale)."""
    b = make_paged_batch(query_lens=[1], seq_lens=[20], dtype="float16", kv_cache_dtype="fp8_e4m3")
    assert b.config.kv_quant == "fp8_per_tensor" and b.k_scale == 0.5
    blk = b.all_slots // 16
    off = b.all_slots % 16
    stored = b.kv_cache[blk, :, off, : b.config.head_size].float() * b.k_scale
    assert torch.equal(stored, b.key.float())
    assert b.kv_cache.dtype == to_torch_dtype("fp8_e4m3")


# -- MLA: absorbed attention over a latent cache ---------------------------------------------------

_CPU_MLA = [n for n in CPU_BACKENDS if get_backend(n).CAPABILITIES.mla]


def _latent_batch(case: Case, device: str, **kw) -> PagedBatch:
    rank, rope = MLA_LATENT
    b_kw = dict(
        query_lens=GPU_QUERY_LENS if device == "cuda" else QUERY_LENS,
        seq_lens=GPU_SEQ_LENS if device == "cuda" else SEQ_LENS,
        num_layers=3 if case.order[0] == "B" else 1,
        layer=1 if case.order[0] == "B" else 0,
        pad_tokens=2,
    )
    b_kw.update(kw)
    return make_latent_batch(
        **b_kw, kv_lora_rank=rank, rope=rope, order=case.order, dtype=case.dtype,
        kv_cache_dtype=case.cache_dtype, block_size=case.block_size,
        kernel_block_size=case.kernel_block_size, device=device,
        seed=zlib.crc32(case.id.encode()),
    )  # fmt: skip


def _run_mla_case(case: Case, device: str) -> None:
    b = _latent_batch(case, device)
    out = run_backend(case.backend, b)
    t = b.common.num_actual_tokens
    assert out.shape == (b.q.shape[0], b.q.shape[1], MLA_LATENT[0]), out.shape
    low = lowprec_reference(b)[:t] if device == "cuda" and case.dtype != "float32" else None
    res = check_close_to_oracle(out[:t], oracle_attention(b)[:t], lowprec_reference=low)
    assert res.ok, f"{case.id}: {res.message}"
    assert not out[t:].any(), f"{case.id}: padding rows are not zero"


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id) for n in _CPU_MLA for c in mla_cases_for(n)]
)
def test_mla_conformance_cpu(case: Case) -> None:
    _run_mla_case(case, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id) for n in BACKEND_CLASSES for c in mla_cases_for(n, gpu=True)],
)
def test_mla_conformance_gpu(case: Case) -> None:
    b = _latent_batch(case, "cuda", query_lens=[1], seq_lens=[1])
    reasons = get_backend(case.backend).validate(b.config, Platform.detect())
    if reasons:
        pytest.skip(f"{case.backend} cannot run here: {reasons}")
    _run_mla_case(case, "cuda")


def _mla_case(name: str, dtype: str = "float16", cache: str | None = None) -> Case:
    return Case(name, "mla", dtype, cache or dtype, "LBNHC", 16, 16)


@pytest.mark.parametrize("cache", [None, "fp8_e4m3"])
@pytest.mark.parametrize("name", _CPU_MLA)
def test_mla_planted_bugs_fail_the_check(name: str, cache: str | None) -> None:
    """The latent's rope part dropped (the write stored ``kv_c`` but not ``k_pe``) and one wrong
    page must each fail the oracle check that the correct run passes; an fp8 latent read with
    a scale 25% off as well."""
    b = _latent_batch(_mla_case(name, cache=cache), "cpu", query_lens=[1, 4], seq_lens=[64, 40])
    ref = oracle_attention(b)
    t = b.common.num_actual_tokens
    assert check_close_to_oracle(run_backend(name, b)[:t], ref[:t]).ok
    if cache is not None:
        assert b.k_scale is not None and b.kv_cache.element_size() == 1
        wrong = dataclasses.replace(b, k_scale=b.k_scale * 1.25)
        res = check_close_to_oracle(run_backend(name, wrong)[:t], ref[:t])
        assert not res.ok, "an fp8 latent read with a wrong scale passed the check"
    rank = MLA_LATENT[0]
    rope = b.kv_cache[..., rank:].clone()
    b.kv_cache[..., rank:] = 0  # planted: the rope columns never written
    res = check_close_to_oracle(run_backend(name, b)[:t], ref[:t])
    assert not res.ok, "a latent without its rope part passed the check"
    b.kv_cache[..., rank:] = rope
    bt = plant_wrong_page(b.common.block_table, b.common.host_seq_lens(), 16, b.layout.num_blocks)
    res = check_close_to_oracle(run_backend(name, _with(b, block_table=bt))[:t], ref[:t])
    assert not res.ok, "a wrong latent page passed the check"


@pytest.mark.parametrize("name", _CPU_MLA)
def test_mla_write_path_and_contract(name: str) -> None:
    """The backend's own latent write (``value=None``) stores exactly the rows the torch fill
    did, and the MLA contract is enforced: a value tensor, a kv_lora_rank on a K/V layer or
    outside the row are refused."""
    b = _latent_batch(_mla_case(name, "float32"), "cpu")
    backend = get_backend(name)
    impl = make_batch_impl(backend, b)
    assert impl.head_size_v == MLA_LATENT[0]
    want = b.kv_cache.clone()
    b.kv_cache.zero_()
    impl.do_kv_cache_update(None, b.key, None, b.kv_cache, b.all_slots)
    assert torch.equal(b.kv_cache, want)
    with pytest.raises(ValueError, match="value=None"):
        impl.do_kv_cache_update(None, b.key, b.key, b.kv_cache, b.all_slots)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        backend.make_impl(b.config, b.layout, kv_lora_rank=sum(MLA_LATENT))
    plain = make_paged_batch(query_lens=[1], seq_lens=[4])
    with pytest.raises(ValueError, match="only for MLA"):
        backend.make_impl(plain.config, plain.layout, kv_lora_rank=16)
    # per-token-head latents stay refused (paged_attention reads none and fp8 per tensor)
    per_token = dataclasses.replace(
        b.config, kv_cache_dtype="fp8_e4m3", kv_quant="fp8_per_token_head"
    )
    assert any("MLA latent" in r for r in backend.validate(per_token)), name


@pytest.mark.parametrize("name", _CPU_MLA)
def test_mla_fp8_latent_write_and_its_one_scale(name: str) -> None:
    """An fp8 latent: the backend's own write (``value=None``) stores exactly the bytes the torch
    fill did (``latent / k_scale`` in fp8), the impl takes ``k_scale`` alone or with an equal
    ``v_scale`` (an engine hands every layer both), and refuses a missing ``k_scale``, a
    different ``v_scale`` and a layer object whose ``v_scale`` is not its ``k_scale``."""
    b = _latent_batch(_mla_case(name, "float32", "fp8_e4m3"), "cpu")
    backend = get_backend(name)
    assert not backend.validate(b.config), backend.validate(b.config)
    assert b.config.kv_quant == "fp8_per_tensor" and b.v_scale is None
    impl = make_batch_impl(backend, b)
    want = b.kv_cache.clone()
    b.kv_cache.zero_()
    impl.do_kv_cache_update(None, b.key, None, b.kv_cache, b.all_slots)
    assert torch.equal(b.kv_cache.view(torch.uint8), want.view(torch.uint8))
    k = torch.tensor(b.k_scale)
    backend.make_impl(b.config, b.layout, k_scale=k, v_scale=k.clone())  # equal: accepted
    with pytest.raises(ValueError, match="on an MLA layer needs k_scale"):
        backend.make_impl(b.config, b.layout)
    with pytest.raises(ValueError, match=r"v_scale=\[0.25\] differs from k_scale=\[0.5\]"):
        backend.make_impl(b.config, b.layout, k_scale=k, v_scale=0.25)
    layer = types.SimpleNamespace(k_scale=k, v_scale=k.clone())
    with pytest.raises(ValueError, match="layer.v_scale=.* is not its k_scale"):
        impl.do_kv_cache_update(layer, b.key, None, b.kv_cache, b.all_slots)
    layer.v_scale = k  # the same object: one scale
    impl.do_kv_cache_update(layer, b.key, None, b.kv_cache, b.all_slots)
    assert torch.equal(b.kv_cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("name", _CPU_MLA)
def test_mla_batch_invariance_bitwise(name: str) -> None:
    qlens = [1, 6, 1, 2]
    b = _latent_batch(
        _mla_case(name), "cpu", query_lens=qlens, seq_lens=[33, 50, 17, 64], pad_tokens=0
    )
    full = run_backend(name, b)
    qsl = b.common.host_query_start_loc().tolist()
    for target in (0, 1):
        want = full[qsl[target] : qsl[target + 1]]
        for reqs in ([target], [3, target, 2]):
            sub, _ = _sub_batch(b, reqs, qlens)
            out = run_backend(name, sub)
            sq = sub.common.host_query_start_loc().tolist()
            j = reqs.index(target)
            assert torch.equal(out[sq[j] : sq[j + 1]], want), (name, target, reqs)
