"""Paged-attention test batches the kernel tests share: a varlen batch over a freshly filled,
nan-poisoned paged cache with the dense K/V it was filled from, the float64 oracle over those dense
tensors (never the cache), the call, and the per-row checks.

The oracle's input is built independently of the paging: :func:`make_paged_batch` draws every
sequence's K/V as dense ``[H, L, D]`` tensors and writes them page by page through a shuffled block
table; :func:`batch_oracle` attends over the dense tensors, so a kernel that reads a wrong page or
a position outside its sequence (nan) disagrees with it. The oracle and the tolerance rule are
:mod:`kv_kernels.testing`'s.

A batch is a plain ``dict`` (:data:`PagedBatch`) so a test can swap one field for a bad value
(``dict(batch, seq_lens=...)``) and call again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from kv_spec import KVCacheLayout, KVQuantMode, LayoutOrder

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.reshape_and_cache import read_kv, reshape_and_cache
from kv_kernels.testing import assert_close_to_oracle, attention_oracle, attention_oracle_paged

__all__ = [
    "CACHE_DTYPES",
    "FEATURES",
    "MIXED_Q_LENS",
    "MIXED_SEQ_LENS",
    "PagedBatch",
    "assert_lse_close",
    "assert_rows_close",
    "assert_triton_matches_oracle",
    "batch_oracle",
    "counting_gluon_launches",
    "feature_kwargs",
    "make_mla_batch",
    "make_paged_batch",
    "make_quant_batch",
    "mla_oracle",
    "quant_oracle",
    "run_batch",
    "shuffled_pages",
    "tensors_to",
]

#: ``paged_attention``'s inputs under the keys ``q`` ``[T, Hq, D]``, ``kv`` (the ``[B, H, N, C]``
#: layer view), ``storage``, ``layout``, ``block_table`` ``[num_seqs, max_blocks]`` int32 (-1
#: padded), ``seq_lens`` ``[num_seqs]`` int32, ``qsl`` (query_start_loc, ``[num_seqs + 1]`` int32)
#: and ``max_query_len``; and the oracle's: ``ks`` / ``vs`` (per sequence, dense ``[H, L, D]`` /
#: ``[H, L, Dv]`` float64 on the CPU), ``q_lens`` and ``lens`` (the seq_lens as a list).
PagedBatch = dict[str, Any]

#: A mixed batch: a long prefill, a decode step, an empty sequence, a chunked prefill with
#: context, and a speculative step of 3 tokens.
MIXED_Q_LENS = [37, 1, 0, 9, 3]
MIXED_SEQ_LENS = [37, 45, 0, 70, 19]

#: Attention options by name, for parametrized parity tests; ``"sinks"`` / ``"alibi"`` stand for
#: per-head tensors :func:`feature_kwargs` draws.
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "window": {"sliding_window": 11},
    "sinks_softcap": {"sinks": "sinks", "softcap": 3.0},
    "alibi": {"alibi_slopes": "alibi"},
    "noncausal": {"causal": False, "scale": 0.2},
    # a window on a non-causal layer bounds both sides (|p - k| < w)
    "noncausal_window": {"causal": False, "sliding_window": 7},
}


def make_paged_batch(
    *,
    q_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int = 2,
    group: int = 4,
    head_size: int = 32,
    head_size_v: int | None = None,
    block_size: int = 16,
    order: str = "LBNHC",
    dtype: torch.dtype = torch.float32,
    num_layers: int = 2,
    layer: int = 1,
    seed: int = 0,
    spare_blocks: int = 3,
    device: str | None = None,
) -> PagedBatch:
    """A varlen batch over a freshly filled paged cache (see :data:`PagedBatch` for its keys).

    Sequence ``s`` has ``seq_lens[s]`` tokens and its last ``q_lens[s]`` are queries; there are
    ``num_kv_heads * group`` query heads. Pages are drawn from a shuffled permutation of
    ``sum(pages) + spare_blocks`` blocks, every page of layer ``layer`` is nan before the fill (a
    read outside the sequence shows), and each table row has a tail of at least two -1 entries.
    ``device`` defaults to ``"cuda"`` where available, else ``"cpu"``; ``ks``/``vs`` stay on the
    CPU in float64 (the values stored, in ``dtype``).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    head_size_v = head_size if head_size_v is None else head_size_v
    pages = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    layout = KVCacheLayout(
        order=LayoutOrder(order),
        num_layers=num_layers,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=str(dtype).removeprefix("torch."),
    )
    storage = allocate_kv_cache(layout, device)
    kv = layer_view(storage, layout, layer)  # [B, H, N, C]
    # Poison every page first: a kernel that reads outside its sequence sees nan.
    kv.fill_(float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max([*pages, 1]) + 2  # padded tail of -1
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    ks, vs = [], []
    used = 0
    for s, L in enumerate(seq_lens):
        ids = perm[used : used + pages[s]]
        used += pages[s]
        table[s, : pages[s]] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(num_kv_heads, L, head_size, generator=gen).to(dtype)  # [H, L, D]
        v = torch.randn(num_kv_heads, L, head_size_v, generator=gen).to(dtype)  # [H, L, Dv]
        for p, b in enumerate(ids):
            lo, hi = p * block_size, min(L, (p + 1) * block_size)
            kv[b, :, : hi - lo, 0:head_size] = k[:, lo:hi].to(device)
            kv[b, :, : hi - lo, head_size : head_size + head_size_v] = v[:, lo:hi].to(device)
        ks.append(k.double())
        vs.append(v.double())
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=gen).to(dtype)
    return dict(
        q=q.to(device),
        kv=kv,
        storage=storage,
        layout=layout,
        block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl=qsl.to(device),
        max_query_len=max([*q_lens, 0]),
        ks=ks,
        vs=vs,
        q_lens=q_lens,
        lens=seq_lens,
    )


def batch_oracle(batch: PagedBatch, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~kv_kernels.testing.attention_oracle` over each sequence's own dense K/V (never the
    cache): ``(out [T, Hq, Dv], lse [T, Hq])`` in float64 on the CPU. ``kw`` are the attention
    options (``sliding_window``, ``sinks``, ...); tensors among them may sit on any device."""
    options: dict[str, Any] = {
        k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()
    }
    return attention_oracle(
        batch["q"],
        [k.transpose(0, 1) for k in batch["ks"]],  # [H, L, D] -> [L, H, D]
        [v.transpose(0, 1) for v in batch["vs"]],
        batch["q_lens"],
        **options,
    )


def run_batch(batch: PagedBatch, impl: str, **kw: Any) -> Any:
    """``paged_attention`` on the batch's inputs with ``impl=impl`` and extra keywords ``kw``;
    returns what it returns (the output ``[T, Hq, Dv]``, or ``(out, lse)`` with ``return_lse``)."""
    return paged_attention(
        batch["q"],
        batch["kv"],
        batch["layout"],
        batch["block_table"],
        batch["seq_lens"],
        batch["qsl"],
        batch["max_query_len"],
        impl=impl,
        **kw,
    )


def assert_triton_matches_oracle(batch: PagedBatch, **kw: Any) -> None:
    """The Triton launcher's output on ``batch`` (with ``kw``) against the float64 oracle over the
    same pages, bounded by the torch reference's own error at the query dtype; its LSE against
    the oracle's (:func:`assert_lse_close`: the same rows ``-inf``, the rest to 1e-4).
    ``num_splits`` goes to the kernel only; ``scale``, ``causal`` and fp8 ``k_scale`` /
    ``v_scale`` to all three."""
    got, lse = run_batch(batch, "triton", return_lse=True, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "num_splits"}
    low = run_batch(batch, "reference", **ref_kw)
    sem = {k: v for k, v in ref_kw.items() if k in ("scale", "causal", "k_scale", "v_scale")}
    oracle, oracle_lse = attention_oracle_paged(
        batch["q"], batch["kv"], batch["layout"], batch["block_table"], batch["seq_lens"],
        batch["qsl"], **sem,
    )  # fmt: skip
    assert_close_to_oracle(got, oracle, lowprec_reference=low, dtype=batch["q"].dtype)
    assert_lse_close(lse, oracle_lse)


def assert_rows_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rows: int | None = None
) -> None:
    """The shared per-row oracle bound (:data:`kv_kernels.testing.TOLERANCES` ``[dtype]``) over
    the first ``rows`` token rows of ``out`` (all by default) against the float64 ``ref``."""
    assert_close_to_oracle(out.detach().cpu()[:rows], ref[:rows], dtype=dtype)


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel's LSE ``[T, Hq]`` against the oracle's: the same rows are ``-inf`` (no key
    seen), and the finite ones agree to 1e-4 (natural log, so ~1e-4 relative in the weights)."""
    got, want = lse.detach().cpu().double(), ref.double()
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        raise AssertionError("lse -inf rows differ")
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=1e-4)


def feature_kwargs(name: str, num_q_heads: int) -> dict[str, Any]:
    """The keyword arguments of :data:`FEATURES` ``[name]`` with its per-head tensors drawn (sinks
    ``[Hq]`` ~ 2 N(0, 1), ALiBi slopes ``[Hq]`` in [0, 0.5)) from a fixed seed, on the CPU."""
    gen = torch.Generator().manual_seed(7)
    kw = dict(FEATURES[name])
    if kw.get("sinks") == "sinks":
        kw["sinks"] = torch.randn(num_q_heads, generator=gen) * 2
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = torch.rand(num_q_heads, generator=gen) * 0.5
    return kw


def tensors_to(device: str, kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with its tensor values moved to ``device`` (other values as they are)."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def shuffled_pages(
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
    spare_columns: int = 1,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A block table ``[num_seqs, max_pages + spare_columns]`` (int32, -1 padded, on the CPU)
    over a shuffled permutation of ``num_blocks`` blocks, and each sequence's slots ``[L]``
    (int64) through it: the pages a write op fills and a kernel reads back."""
    pages = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(pages) + spare_columns), -1, dtype=torch.int32)
    slots_of: list[torch.Tensor] = []
    used = 0
    for s, n in enumerate(seq_lens):
        ids = torch.tensor(perm[used : used + pages[s]], dtype=torch.int32)
        used += pages[s]
        table[s, : pages[s]] = ids
        pos = torch.arange(n)
        slots_of.append(ids[pos // block_size].long() * block_size + pos % block_size)
    return table, slots_of


def make_mla_batch(
    *,
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 8,
    rank: int = 64,
    rope: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
    cache_dtype: str | None = None,
    k_scale: float | torch.Tensor | None = None,
) -> PagedBatch:
    """An MLA decode batch: one latent row (``rank + rope`` columns) per token in a nan-poisoned
    paged cache (one KV head) written through a shuffled block table, ``num_heads`` query heads;
    the latents the test drew are kept (``latents``, float64) for :func:`mla_oracle`, and
    ``rank`` is the ``kv_lora_rank`` to pass.

    ``cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``: an fp8 per-tensor latent cache written by
    the reference ``reshape_and_cache`` with ``k_scale`` (kept as ``k_scale``, the one scale to
    read it with) from float32 latents of ~4x spread; ``latents`` are then the rows as the cache
    gives them back (``read_kv``: stored fp8 times ``k_scale``), so the oracle attends over
    exactly what a reader must see."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 3
    fp8 = cache_dtype is not None and cache_dtype.startswith("fp8")
    if fp8 != (k_scale is not None):
        raise ValueError(
            f"make_mla_batch: cache_dtype={cache_dtype!r} with k_scale={k_scale!r}; an fp8 latent "
            "needs its k_scale and an unquantized one takes none"
        )
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=num_blocks, num_kv_heads=1,
        block_size=block_size, head_size=rank + rope, head_size_v=0,
        dtype=cache_dtype or str(dtype).removeprefix("torch."), is_mla=True,
        kv_quant=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE,
    )  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, device), layout, 0)
    kv.fill_(float("nan"))  # a read outside the sequence's rows shows up as nan
    table, slots_of = shuffled_pages(seq_lens, block_size, num_blocks, gen, spare_columns=2)
    latents = []
    for n, slots in zip(seq_lens, slots_of, strict=True):
        latent = torch.randn(n, 1, rank + rope, generator=gen)  # [n, 1, rank + rope]
        if fp8:
            latent = latent * 4
            reshape_and_cache(
                latent.to(device), None, kv, slots.to(device), layout, k_scale, impl="reference"
            )
            back, _ = read_kv(kv, layout, slots.to(device), k_scale)  # [n, 1, rank + rope]
            latents.append(back.cpu().double())
            continue
        latent = latent.to(dtype)
        reshape_and_cache(latent.to(device), None, kv, slots.to(device), layout, impl="reference")
        latents.append(latent.double())
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, rank + rope, generator=gen).to(dtype)
    return dict(
        q=q.to(device), kv=kv, layout=layout, block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl=qsl.to(device),
        max_query_len=max(q_lens), latents=latents, q_lens=q_lens, rank=rank, k_scale=k_scale,
    )  # fmt: skip


def mla_oracle(b: PagedBatch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle's ``(out, lse)`` over an MLA batch's drawn latents (never the cache):
    K is each whole latent row, V its first ``rank`` columns."""
    ks = b["latents"]  # [L, 1, rank + rope]
    vs = [lat[..., : b["rank"]] for lat in ks]
    return attention_oracle(b["q"].cpu(), ks, vs, b["q_lens"], scale=scale)


#: the cache dtype of each per-token-head quantization mode
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
    device: str = "cpu",
    scale_plane: bool = False,
) -> PagedBatch:
    """A varlen batch over a per-token-head quantized cache (``kv_quant`` int8 / fp8 per token
    and head) that ``reshape_and_cache`` wrote through a shuffled table, rows of magnitudes
    spread 40x so the per-token scales differ widely; ``slots`` holds each sequence's slots for
    :func:`quant_oracle`. ``scale_plane``: the scales in each page's plane (kv-spec)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 2
    layout = KVCacheLayout(
        order=LayoutOrder(order),
        num_layers=2,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=CACHE_DTYPES[kv_quant],
        kv_quant=KVQuantMode(kv_quant),
        scale_plane=scale_plane,
    )
    kv = layer_view(allocate_kv_cache(layout, device), layout, 1)
    table, slots_of = shuffled_pages(seq_lens, block_size, num_blocks, gen, spare_columns=1)
    for n, slots in zip(seq_lens, slots_of, strict=True):
        # rows of different magnitudes, so per-token scales differ widely
        mag = torch.rand(n, num_kv_heads, 1, generator=gen) * 4 + 0.1
        key = torch.randn(n, num_kv_heads, head_size, generator=gen) * mag
        value = torch.randn(n, num_kv_heads, head_size_v, generator=gen) * mag
        reshape_and_cache(
            key.to(device), value.to(device), kv, slots.to(device), layout, impl=write_impl
        )
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=gen)
    return dict(
        q=q.to(device),
        kv=kv,
        layout=layout,
        block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl=qsl.to(device),
        max_query_len=max(q_lens),
        slots=slots_of,
        q_lens=q_lens,
    )


def quant_oracle(b: PagedBatch) -> torch.Tensor:
    """The float64 oracle over each sequence's rows of a :func:`make_quant_batch` batch as
    ``read_kv`` dequantizes them (a read path apart from the kernels': advanced indexing and a
    byte view)."""
    ks, vs = [], []
    for slots in b["slots"]:
        k, v = read_kv(b["kv"], b["layout"], slots.to(b["kv"].device))
        assert v is not None
        ks.append(k.cpu().double())  # [L, H, D]
        vs.append(v.cpu().double())
    return attention_oracle(b["q"].cpu(), ks, vs, b["q_lens"])[0]


@contextlib.contextmanager
def counting_gluon_launches(kind: str) -> Iterator[list[int]]:
    """Inside the block, a list that grows by one for every launch of the sm_90 Gluon ``kind``
    kernel ("prefill" / "decode" / "mla"): the Triton launcher imports the launch function at
    call time, so replacing the module attribute sees every call; restored on exit.

    The api's validated calls are forgotten on entry (``paged_attention._fast.clear``): a call
    of a shape class already seen replays its bound launches without calling the launch
    function, so a block around a second call counted nothing (bench_paged_attention labelled
    every Gluon-served MLA case ``decode_kernel: triton`` and left out its ``triton_kernel``
    twin, the probe having run the case once for the decode kind first)."""
    from kv_kernels.paged_attention import _fast, _sm90_decode, _sm90_mla, _sm90_prefill

    module: Any = {"prefill": _sm90_prefill, "decode": _sm90_decode, "mla": _sm90_mla}[kind]
    attr = f"launch_sm90_{kind}"
    calls: list[int] = []
    real = getattr(module, attr)

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    _fast.clear()
    setattr(module, attr, counted)
    try:
        yield calls
    finally:
        setattr(module, attr, real)
