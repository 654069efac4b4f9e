"""The bound-launcher path on a CUDA GPU, bit for bit against the plain ``kernel[grid]`` launch:
paged attention (the Triton decode kernel, split merge, and the sm_90 Gluon decode where the card
has it), the cache write and the fused ops, over several shapes and pointer alignments, with a
call of another specialization between the bound ones. Check mode is on: each bound launch also
runs Triton's binder and raises if the launch site's key let two specializations share a variant.
The cache write and the fused ops' second calls are call-cache hits (kv_kernels._call_cache):
their checks skipped, their launch plan reused, and still the bits of the uncached path.
Paged attention's second calls are bound calls (paged_attention._bound: every launch's arguments
fixed per shape class, pointers passed as ints), which in check mode also describe the call the
uncached way and raise unless each launch's arguments are the same, pointer by pointer.

    export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd: -)
    python3 -m pytest -q -m gpu packages/kv-kernels/tests/test_fast_launch_gpu.py
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from kv_kernels import _call_cache, _launch, reshape_and_cache
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.fused import rms_norm, rope_and_cache, rotary_embedding, silu_and_mul
from kv_kernels.paged_attention import paged_attention
from kv_spec import KVCacheLayout

pytestmark = pytest.mark.gpu
_fast = importlib.import_module("kv_kernels.paged_attention._fast")


@pytest.fixture(autouse=True)
def check_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_launch, "CHECK", True)
    monkeypatch.setattr(_launch, "ENABLED", True)
    _launch.reset_all()
    yield
    _launch.reset_all()


def _hits() -> int:
    return sum(launcher.hits for launcher in _launch._ALL)


def _plain_then_fast(run: Callable[[], torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` (which returns what it wrote) with the fast path and the call caches off, then
    twice with them on (the first validates, keeps its plan and binds, the second is a call-cache
    hit through the bound launcher): equal bits each time."""
    monkeypatch.setattr(_launch, "ENABLED", False)
    monkeypatch.setattr(_call_cache, "ENABLED", False)
    want = run().clone()
    monkeypatch.setattr(_call_cache, "ENABLED", True)
    monkeypatch.setattr(_launch, "ENABLED", True)
    first = run().clone()
    hits = _hits()
    second = run().clone()
    assert _hits() > hits, "the second call did not go through a bound launcher"
    torch.testing.assert_close(first, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(second, want, rtol=0, atol=0, equal_nan=True)


def _offset(t: torch.Tensor, elems: int) -> torch.Tensor:
    """A copy of ``t`` starting ``elems`` elements into a fresh buffer (2-byte elements: 1 gives
    an address that is not 16-byte aligned, 8 one that is)."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    view = buf[elems : elems + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _attention_case(
    batch: int, seq: int, dtype: str, seed: int = 0, kv_quant: str | None = None
) -> dict[str, Any]:
    torch.manual_seed(seed)
    n, h, group, d = 16, 8, 4, 128
    pages = -(-seq // n)
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=batch * pages + 2, num_kv_heads=h,
        block_size=n, head_size=d, head_size_v=d, dtype=dtype,
        kv_quant=kv_quant or ("fp8_per_tensor" if dtype.startswith("fp8") else "none"),
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, "cuda", zero=False), layout, 0)
    kv.copy_((torch.randn(kv.shape, device="cuda") * 0.7).to(kv.dtype))
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    q = torch.randn(batch, h * group, d, dtype=torch.bfloat16, device="cuda")
    return dict(
        q=q, kv_cache=kv, layout=layout, block_table=table,
        seq_lens=torch.full((batch,), seq, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        max_query_len=1,
    )  # fmt: skip


@pytest.mark.parametrize("batch", [1, 3, 64])
@pytest.mark.parametrize(
    ("dtype", "q_offset"),
    # (fp8 pages on sm_90 run the Gluon decode, whose rule asks for 16-byte rows: aligned q only)
    [("bfloat16", 0), ("bfloat16", 8), ("bfloat16", 1), ("fp8_e4m3", 0), ("fp8_e4m3", 8)],
)
def test_paged_attention_bound_equals_plain(
    batch: int, dtype: str, q_offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = _attention_case(batch, 700, dtype)
    c["q"] = _offset(c["q"], q_offset)
    kw: dict[str, Any] = {"k_scale": 0.5, "v_scale": 0.25} if dtype.startswith("fp8") else {}
    out = torch.empty_like(c["q"])

    def run() -> torch.Tensor:
        return paged_attention(**c, max_seq_len=700, out=out, **kw)  # type: ignore[return-value]

    _plain_then_fast(run, monkeypatch)
    # other specializations (another batch; for bf16 also q off by one element or back to
    # aligned), then this one again: the same bits
    other = _attention_case(batch + 16, 700, dtype, seed=1)
    paged_attention(**other, max_seq_len=700, **kw)
    if dtype == "bfloat16":
        shifted = dict(c, q=_offset(c["q"], 1 if q_offset != 1 else 0))
        paged_attention(**shifted, max_seq_len=700, out=torch.empty_like(out))
    want = run().clone()
    torch.testing.assert_close(run(), want, rtol=0, atol=0)


def test_paged_attention_split_count_follows_max_seq_len(monkeypatch: pytest.MonkeyPatch) -> None:
    """One plan, decode steps of growing length: the split count (and so the variant) moves."""
    c = _attention_case(4, 4096, "bfloat16")
    for max_seq_len in (64, 4096, 64, 4096):
        lens = torch.full((4,), max_seq_len, dtype=torch.int32, device="cuda")
        case = dict(c, seq_lens=lens)

        def run(case: dict[str, Any] = case, m: int = max_seq_len) -> torch.Tensor:
            return paged_attention(**case, max_seq_len=m)  # type: ignore[return-value]

        _plain_then_fast(run, monkeypatch)


@pytest.mark.parametrize("offset", [0, 8, 1])
@pytest.mark.parametrize("kv_quant", ["none", "int8_per_token_head"])
def test_reshape_and_cache_bound_equals_plain(
    offset: int, kv_quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(1)
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=32, num_kv_heads=8, block_size=16,
        head_size=128, head_size_v=128, dtype="int8" if kv_quant != "none" else "bfloat16",
        kv_quant=kv_quant,
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, "cuda", zero=True), layout, 0)
    for tokens in (1, 37, 64):
        key = _offset(torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda"), offset)
        value = _offset(torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda"), offset)
        slots = torch.randperm(32 * 16, device="cuda")[:tokens]

        def run(key=key, value=value, slots=slots) -> torch.Tensor:  # type: ignore[no-untyped-def]
            kv.zero_()
            reshape_and_cache(key, value, kv, slots, layout)
            return kv.view(torch.uint8)

        _plain_then_fast(run, monkeypatch)


@pytest.mark.parametrize("tokens", [1, 16, 37])
@pytest.mark.parametrize("offset", [0, 1])
def test_fused_ops_bound_equal_plain(
    tokens: int, offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(2)
    dev, bf = "cuda", torch.bfloat16
    x = _offset(torch.randn(tokens, 4096, dtype=bf, device=dev), offset)
    res0 = torch.randn(tokens, 4096, dtype=bf, device=dev)
    w = torch.randn(4096, dtype=bf, device=dev)

    def norm() -> torch.Tensor:
        res = res0.clone()
        y, h = rms_norm(x, w, 1e-6, residual=res)  # type: ignore[misc]
        return torch.cat([y, h])

    _plain_then_fast(norm, monkeypatch)
    gate_up = _offset(torch.randn(tokens, 2 * 1024, dtype=bf, device=dev), offset)
    _plain_then_fast(lambda: silu_and_mul(gate_up), monkeypatch)

    qkv0 = torch.randn(tokens, 48 * 128, dtype=bf, device=dev)
    positions = torch.randint(0, 4096, (tokens,), device=dev)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=dev).float() / 128))
    t = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([t.cos(), t.sin()], dim=-1)

    def rope() -> torch.Tensor:
        qkv = _offset(qkv0, offset)
        q = qkv[:, : 32 * 128].view(tokens, 32, 128)
        k = qkv[:, 32 * 128 : 40 * 128].view(tokens, 8, 128)
        rotary_embedding(positions, q, k, cos_sin)
        return qkv.clone()

    _plain_then_fast(rope, monkeypatch)
    layout = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=8, num_kv_heads=8, block_size=16,
        head_size=128, head_size_v=128, dtype="bfloat16",
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, dev, zero=True), layout, 0)
    slots = torch.randperm(8 * 16, device=dev)[:tokens]

    def rope_cache() -> torch.Tensor:
        qkv = _offset(qkv0, offset)
        q = qkv[:, : 32 * 128].view(tokens, 32, 128)
        k = qkv[:, 32 * 128 : 40 * 128].view(tokens, 8, 128)
        v = qkv[:, 40 * 128 :].view(tokens, 8, 128)
        kv.zero_()
        rope_and_cache(positions, q, k, v, cos_sin, kv, slots, layout)
        return torch.cat([qkv.flatten(), kv.flatten()])

    _plain_then_fast(rope_cache, monkeypatch)


def _bound_calls() -> int:
    """Bound paged-attention calls built so far (paged_attention._bound), over every entry."""
    return sum(1 for e in _fast._ENTRIES.values() for b in e.bound.values() if b)


def _flat(result: Any, *extra: torch.Tensor) -> torch.Tensor:
    """An attention result (``out`` or ``(out, lse)``) and ``extra`` as one float tensor (bf16
    and small int32 counts convert exactly)."""
    parts = result if isinstance(result, tuple) else (result,)
    return torch.cat([p.flatten().float() for p in (*parts, *extra)])


def _heads(n: int) -> torch.Tensor:
    return torch.rand(n, device="cuda") - 0.5


# each: (batch, cache dtype, kv_quant, the call's extra keywords)
_BOUND_CASES: dict[str, Any] = {
    "lse-split4": (3, "bfloat16", None, lambda: dict(num_splits=4, return_lse=True)),
    "batch1-heuristic-split": (1, "bfloat16", None, lambda: dict(max_seq_len=700)),
    "features": (3, "bfloat16", None, lambda: dict(
        num_splits=2, sinks=_heads(32), alibi_slopes=_heads(32) * 0.01, softcap=20.0,
        sliding_window=300, error_flag=torch.zeros(1, dtype=torch.int32, device="cuda"),
    )),
    "fp8-tensor-scales": (3, "fp8_e4m3", None, lambda: dict(
        k_scale=torch.full((8,), 0.5, device="cuda"),
        v_scale=torch.full((1,), 0.25, device="cuda"), max_seq_len=700,
    )),
    "int8-per-token-head": (3, "int8", "int8_per_token_head", lambda: dict(max_seq_len=700)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_BOUND_CASES))
def test_paged_attention_bound_calls_equal_plain(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call bound per shape class (its second call) gives the uncached path's bits, with
    check mode comparing its launches with the described path's; a third call too."""
    batch, dtype, kv_quant, extra = _BOUND_CASES[name]
    c = _attention_case(batch, 700, dtype, kv_quant=kv_quant)
    kw = extra()
    flag = kw.get("error_flag")

    def run() -> torch.Tensor:
        if flag is not None:
            flag.zero_()
        return _flat(paged_attention(**c, **kw), *(() if flag is None else (flag,)))

    before = _bound_calls()
    _plain_then_fast(run, monkeypatch)
    assert _bound_calls() > before, "no bound call was built for this class"
    want = run().clone()
    torch.testing.assert_close(run(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("cache", ["bf16", "fp8", "fp8_tensor_scale"])
def test_paged_attention_bound_mla_equals_plain(
    cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLA decode, 512 + 64 at 128 heads: a bf16 latent and an fp8 e4m3 per-tensor one whose
    scale is a float or a ``[1]`` tensor (on an H100 / H200 all three run the sm_90 Gluon MLA
    kernel, the fp8 ones with the scale in its arguments: ``k_scale`` as V's too)."""
    from kv_kernels.testing_attention import make_mla_batch

    ks = torch.tensor([0.5], device="cuda") if cache == "fp8_tensor_scale" else 0.5
    fp8 = dict(cache_dtype="fp8_e4m3", k_scale=ks)
    b = make_mla_batch(
        q_lens=[1] * 4, seq_lens=[3000, 700, 1, 129], num_heads=128, rank=512, rope=64,
        block_size=64, dtype=torch.bfloat16, device="cuda", **(fp8 if cache != "bf16" else {}),
    )  # fmt: skip
    args = dict(
        q=b["q"], kv_cache=b["kv"], layout=b["layout"], block_table=b["block_table"],
        seq_lens=b["seq_lens"], query_start_loc=b["qsl"], max_query_len=b["max_query_len"],
        kv_lora_rank=512, max_seq_len=3000, return_lse=True, k_scale=b["k_scale"],
    )  # fmt: skip
    before = _bound_calls()
    _plain_then_fast(lambda: _flat(paged_attention(**args)), monkeypatch)
    assert _bound_calls() > before


@pytest.mark.parametrize("order", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("offset", [0, 16, 8])
def test_block_copies_bound_equal_plain(order: str, offset: int) -> None:
    """gather / scatter / copy_blocks, the second call of each shape through the bound launcher
    (check mode: Triton's binder agrees with the key), bit for bit the first call's bytes; a
    buffer ``offset`` bytes into its allocation, and pinned host rows."""
    from kv_kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks

    block_copy = importlib.import_module("kv_kernels.block_copy.triton")
    layout = KVCacheLayout(
        order=order, num_layers=3, num_blocks=64, num_kv_heads=2, block_size=16, head_size=64,
        head_size_v=64, dtype="bfloat16",
    )  # fmt: skip
    cache = allocate_kv_cache(layout, "cuda")
    for t in cache if isinstance(cache, (list, tuple)) else [cache]:
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, t.view(torch.uint8).shape, device="cuda", dtype=torch.uint8)
        )
    width = layout.num_layers * layout.page_bytes
    ids = torch.tensor([5, 9, 2, 40, 17], device="cuda")
    for device, pin in (("cuda", False), ("cpu", True)):
        raw = torch.empty(5 * width + 64, dtype=torch.uint8, device=device, pin_memory=pin)
        buf = raw[offset : offset + 5 * width].view(5, width)
        block_copy._COPY.reset()  # (an earlier case may have bound this key)
        got, hits = [], [block_copy._COPY.hits]
        for _ in range(2):
            buf.zero_()
            gather_blocks(cache, layout, ids, buf, impl="triton")
            torch.cuda.synchronize()
            got.append(buf.clone())
            hits.append(block_copy._COPY.hits)
        # a call is one launch a layer or one for all (the order decides): the first binds at
        # least one of them, the second goes through the bound launcher for every one
        assert hits[2] - hits[1] > hits[1] - hits[0], hits
        assert torch.equal(got[0], got[1])
        scatter_blocks(buf, cache, layout, torch.tensor([50, 51, 52, 53, 54], device="cuda"),
                       impl="triton")  # fmt: skip
        scatter_blocks(buf, cache, layout, torch.tensor([55, 56, 57, 58, 59], device="cuda"),
                       impl="triton")  # fmt: skip
        back = torch.empty(buf.shape, dtype=buf.dtype, device=device, pin_memory=pin)
        gather_blocks(cache, layout, torch.tensor([55, 56, 57, 58, 59], device="cuda"), back,
                      impl="triton")  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(back, got[0])
    copy_blocks(cache, layout, [5, 9], [60, 61], impl="triton")
    copy_blocks(cache, layout, [2, 40], [62, 63], impl="triton")
    out = torch.empty(4, width, dtype=torch.uint8, device="cuda")
    gather_blocks(cache, layout, [60, 61, 62, 63], out, impl="triton")
    want = torch.empty_like(out)
    gather_blocks(cache, layout, [5, 9, 2, 40], want, impl="triton")
    assert torch.equal(out, want)
