"""Decode cases of the paths added for issue 12, for ``bench_paged_attention.py``: per-token-head
int8 / fp8 caches, MLA absorbed decode and DiffKV 192/128. Each is bandwidth-bound, so each is
reported as TB/s of the bytes the kernel must read, against the copy bandwidth measured in the
same process (``ratio = value / copy``).

Bytes counted (the query, output and block table are < 0.1% and not counted):

- ``pth_{int8,fp8}``: ``batch * ctx * H * (D + Dv + 8)`` -- one byte per K/V element plus the two
  inline float32 scales of each token and head, i.e. the stored bytes. ``pth_*_plane``: the
  same bytes with the scales in each page's scale plane (kv-spec ``scale_plane``).
- ``mla``: ``batch * ctx * (512 + 64) * 2`` -- the one bf16 latent row per token, read once for
  K and V (128 query heads over one latent, page 64). Also reported as TFLOP/s
  (``2 * heads * (576 + 512)`` per token): at 128 heads a latent byte feeds 242 FLOPs, so 80% of
  an H200's 4.3 TB/s copy would need ~830 TFLOP/s of bf16 MMA -- compute-bound, as FlashMLA's
  own 128-head figure is. ``mla_h16`` is DeepSeek-V3 at tensor-parallel 8 (16 heads per GPU),
  where decode is bandwidth-bound. ``mla8_*``: the same over an fp8 (e4m3) per-tensor latent,
  ``batch * ctx * (512 + 64)`` bytes (issue 31's goal: >= 0.9 of the copy at 16 heads).
- ``diffkv``: ``batch * ctx * H * (192 + 128) * 2``.
- ``fp8pt``: ``batch * ctx * H * (D + Dv)`` -- fp8 per-tensor, one byte per element (the goal:
  >= 90% of the copy counted in these bytes, ~2x bf16's tokens/s).

``smoke=True`` shrinks every shape so the same code runs under the Triton interpreter on a CPU
(a check that the cases and the report work, not a measurement).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from kv_kernels.cache import allocate_kv_cache, layer_view, scale_bytes, scale_geometry
from kv_kernels.paged_attention import paged_attention
from kv_spec import KVCacheLayout, LayoutOrder

__all__ = ["NewCase", "new_cases"]


@dataclass(frozen=True)
class NewCase:
    """One decode case: ``run()`` launches our kernel once; ``nbytes`` is what it must read."""

    name: str
    nbytes: int
    run: Callable[..., Any]  # run(num_splits=None): None is the launcher's own choice
    flops: int = 0  # MLA: 2 * heads * (576 + 512) per token read (128 heads are compute-bound)
    #: the tensor ``run()`` writes (MLA: [batch, heads, 512]), to compare a peer's output with
    out: torch.Tensor | None = None
    #: MLA at page 64 on a GPU: makes FlashMLA's call over the same cache, block table, lengths,
    #: query and softmax scale (``flash_mla`` imported when called); its output is [batch, 1,
    #: heads, 512], the first 512 dims of the latent being V
    flashmla: Callable[[], Callable[[], Any]] | None = None


def _paged(
    *, batch: int, ctx: int, block: int, device: str, gen: torch.Generator, **layout_kw: Any
) -> tuple[KVCacheLayout, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shuffled block table over a fresh cache: ``(layout, kv, block_table, seq_lens, qsl)``."""
    pages = -(-ctx // block)
    num_blocks = batch * pages + 1
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=num_blocks, block_size=block, **layout_kw
    )
    kv = layer_view(allocate_kv_cache(layout, device, zero=False), layout, 0)
    perm = torch.randperm(num_blocks - 1, generator=gen)[: batch * pages] + 1
    table = perm.view(batch, pages).to(device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)  # one query token each
    return layout, kv, table, seq_lens, qsl


def _fill_quantized(kv: torch.Tensor, layout: KVCacheLayout, gen: torch.Generator) -> None:
    """Random data (never zeros) and valid float32 scales, block chunk by block chunk (the
    scales inline in the rows or in each page's scale plane: ``scale_geometry`` says where)."""
    data = layout.head_size + layout.head_size_v  # (the rows' K and V; inline scales after them)
    geometry = scale_geometry(kv, layout)
    assert geometry is not None
    scale_rows = scale_bytes(kv, geometry, layout.num_scales)  # [B, H, N, 4 * scales]
    for lo in range(0, kv.shape[0], 1024):
        chunk = kv[lo : lo + 1024]  # [b, H, N, C]
        x = torch.randn(*chunk.shape[:-1], data, generator=gen) * 30
        if kv.dtype == torch.int8:
            x = x.round().clamp(-127, 127)
        chunk[..., :data] = x.to(kv.dtype).to(kv.device)
        rows = scale_rows[lo : lo + 1024]
        scales = torch.rand(*rows.shape[:-1], layout.num_scales, generator=gen) * 0.01 + 1e-3
        rows.copy_(scales.view(torch.uint8).to(kv.device))


def _pth(
    quant: str, batch: int, ctx: int, block: int, device: str, gen: torch.Generator
) -> NewCase:
    hq, h, d = (4, 2, 32) if device == "cpu" else (32, 8, 128)
    mode, _, plane = quant.partition("_")  # "int8" / "fp8", "_plane": kv-spec's scale plane
    cache_dtype = "int8" if mode == "int8" else "fp8_e4m3"
    layout, kv, table, seq_lens, qsl = _paged(
        batch=batch, ctx=ctx, block=block, device=device, gen=gen, num_kv_heads=h,
        head_size=d, head_size_v=d, dtype=cache_dtype, kv_quant=f"{mode}_per_token_head",
        scale_plane=plane == "plane",
    )  # fmt: skip
    _fill_quantized(kv, layout, gen)
    q = torch.randn(batch, hq, d, generator=gen).to(device=device, dtype=torch.bfloat16)
    if device == "cpu":
        q = q.float()  # the interpreter computes bf16 wrongly (DESIGN.md)
    out = torch.empty_like(q)

    def run(num_splits: int | None = None) -> Any:
        return paged_attention(
            q, kv, layout, table, seq_lens, qsl, 1, out=out, max_seq_len=ctx, impl="triton",
            num_splits=num_splits,
        )  # fmt: skip

    nbytes = batch * ctx * h * (2 * d + 8)
    return NewCase(f"pth_{quant}_decode_b{batch}_ctx{ctx}_n{block}", nbytes, run)


def _fp8(batch: int, ctx: int, block: int, device: str, gen: torch.Generator) -> NewCase:
    """fp8 (e4m3) per-tensor cache: half the bytes of bf16, scales as two floats."""
    hq, h, d = (4, 2, 32) if device == "cpu" else (32, 8, 128)
    layout, kv, table, seq_lens, qsl = _paged(
        batch=batch, ctx=ctx, block=block, device=device, gen=gen, num_kv_heads=h,
        head_size=d, head_size_v=d, dtype="fp8_e4m3", kv_quant="fp8_per_tensor",
    )  # fmt: skip
    _fill_fp8(kv)
    q = torch.randn(batch, hq, d, generator=gen).to(device=device, dtype=torch.bfloat16)
    if device == "cpu":
        q = q.float()
    out = torch.empty_like(q)

    def run(num_splits: int | None = None) -> Any:
        return paged_attention(
            q, kv, layout, table, seq_lens, qsl, 1, out=out, max_seq_len=ctx, impl="triton",
            k_scale=0.02, v_scale=0.03, num_splits=num_splits,
        )  # fmt: skip

    nbytes = batch * ctx * h * 2 * d
    return NewCase(f"fp8pt_decode_b{batch}_ctx{ctx}_n{block}", nbytes, run)


def _fill_fp8(kv: torch.Tensor) -> None:
    for lo in range(0, kv.shape[0], 1024):
        chunk = kv[lo : lo + 1024]
        chunk.copy_((torch.randn(chunk.shape, device=kv.device) * 30).to(kv.dtype))


def _mla(
    batch: int,
    ctx: int,
    block: int,
    device: str,
    gen: torch.Generator,
    heads_tp: int = 128,
    fp8: bool = False,
) -> NewCase:
    """``heads_tp``: DeepSeek-V3's 128 heads (one GPU) or a tensor-parallel share (16 at TP 8);
    ``fp8``: the latent in fp8 e4m3 per tensor (one scale, ``k_scale``)."""
    heads, rank, rope = (8, 64, 16) if device == "cpu" else (heads_tp, 512, 64)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    quant = dict(dtype="fp8_e4m3", kv_quant="fp8_per_tensor") if fp8 else {}
    layout, kv, table, seq_lens, qsl = _paged(
        batch=batch, ctx=ctx, block=block, device=device, gen=gen, num_kv_heads=1,
        head_size=rank + rope, head_size_v=0, is_mla=True,
        **{"dtype": str(dt).removeprefix("torch."), **quant},
    )  # fmt: skip
    if fp8:
        _fill_fp8(kv)
    else:
        kv.normal_(generator=gen) if device == "cpu" else kv.normal_()
    q = torch.randn(batch, heads, rank + rope, generator=gen).to(device=device, dtype=dt)
    out = torch.empty(batch, heads, rank, device=device, dtype=dt)
    scale = 1.0 / (192**0.5)  # DeepSeek-V3's softmax scale (qk_nope 128 + rope 64)

    def run(num_splits: int | None = None) -> Any:
        return paged_attention(
            q, kv, layout, table, seq_lens, qsl, 1, out=out, max_seq_len=ctx, scale=scale,
            kv_lora_rank=rank, impl="triton", num_splits=num_splits,
            k_scale=0.02 if fp8 else None,
        )  # fmt: skip

    def flashmla() -> Callable[[], Any]:
        """FlashMLA's dense decode over this cache: its paged layout is ``[blocks, 64, 1, 576]``,
        which is our MLA page ``[blocks, 1, 64, 576]`` with the two unit-free axes swapped (no
        copy); q ``[batch, 1, heads, 576]``; the same int32 block table and lengths."""
        import flash_mla

        k_cache = kv.permute(0, 2, 1, 3)
        q4 = q.unsqueeze(1)
        meta, _ = flash_mla.get_mla_metadata()

        def fn() -> Any:
            return flash_mla.flash_mla_with_kvcache(
                q4, k_cache, table, seq_lens, rank, meta, None, softmax_scale=scale,
                causal=False,
            )[0]  # fmt: skip

        return fn

    nbytes = batch * ctx * (rank + rope) * kv.element_size()
    flops = 2 * batch * ctx * heads * (2 * rank + rope)
    tag = _mla_tag(heads_tp, fp8)
    # FlashMLA serves page 64 only (and bf16 / fp16 on sm_90): the page-16 and fp8 cases have
    # no peer
    peer = flashmla if device != "cpu" and block == 64 and not fp8 else None
    return NewCase(f"{tag}_decode_b{batch}_ctx{ctx}_n{block}", nbytes, run, flops, out, peer)


def _mla_tag(heads_tp: int, fp8: bool) -> str:
    """``mla`` (128 heads), ``mla_h16`` (16), ``mla8`` / ``mla8_h16`` (an fp8 latent)."""
    return ("mla8" if fp8 else "mla") + ("" if heads_tp == 128 else f"_h{heads_tp}")


def _diffkv(batch: int, ctx: int, block: int, device: str, gen: torch.Generator) -> NewCase:
    hq, h = (4, 1) if device == "cpu" else (32, 8)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    layout, kv, table, seq_lens, qsl = _paged(
        batch=batch, ctx=ctx, block=block, device=device, gen=gen, num_kv_heads=h,
        head_size=192, head_size_v=128, dtype=str(dt).removeprefix("torch."),
    )  # fmt: skip
    kv.normal_(generator=gen) if device == "cpu" else kv.normal_()
    q = torch.randn(batch, hq, 192, generator=gen).to(device=device, dtype=dt)
    out = torch.empty(batch, hq, 128, device=device, dtype=dt)

    def run(num_splits: int | None = None) -> Any:
        return paged_attention(
            q, kv, layout, table, seq_lens, qsl, 1, out=out, max_seq_len=ctx, impl="triton",
            num_splits=num_splits,
        )  # fmt: skip

    nbytes = batch * ctx * h * (192 + 128) * kv.element_size()
    return NewCase(f"diffkv_decode_b{batch}_ctx{ctx}_n{block}", nbytes, run)


#: (builder, args) per case: decode at 64 x 4k and 8 x 32k (MLA at page 64, as DeepSeek serves).
_Table = list[tuple[Callable[..., NewCase], tuple[Any, ...]]]

_GPU: _Table = [
    (_pth, ("int8", 64, 4096, 16)),
    (_pth, ("fp8", 64, 4096, 16)),
    (_pth, ("int8", 8, 32768, 16)),
    # the same rows with their scales in each page's scale plane (256-byte rows)
    (_pth, ("int8_plane", 64, 4096, 16)),
    (_pth, ("fp8_plane", 64, 4096, 16)),
    (_pth, ("int8_plane", 8, 32768, 16)),
    (_fp8, (64, 4096, 16)),
    (_fp8, (8, 32768, 16)),
    (_mla, (64, 4096, 64)),
    (_mla, (8, 32768, 64)),
    (_mla, (64, 4096, 64, 16)),  # DeepSeek-V3 at TP 8: 16 heads per GPU, bandwidth-bound
    (_mla, (8, 32768, 64, 16)),
    # page 16: DeepSeek-V3's spec default (kvstack backends picks TRITON_MLA at kernel block 16)
    (_mla, (64, 4096, 16)),
    (_mla, (64, 4096, 16, 16)),
    # issue 31: an fp8 e4m3 latent at TP 8 (the goal: >= 0.9 of the copy) and on one GPU
    (_mla, (64, 4096, 64, 16, "fp8")),
    (_mla, (8, 32768, 64, 16, "fp8")),
    (_mla, (64, 4096, 64, 128, "fp8")),
    (_diffkv, (64, 4096, 16)),
    (_diffkv, (8, 32768, 16)),
]
_SMOKE: _Table = [
    (_pth, ("int8", 2, 40, 16)),
    (_pth, ("fp8", 2, 40, 16)),
    (_pth, ("int8_plane", 2, 40, 16)),
    (_fp8, (2, 40, 16)),
    (_mla, (2, 70, 64)),
    (_mla, (2, 70, 64, 128, "fp8")),
    (_diffkv, (2, 40, 16)),
]


def new_cases(
    *, device: str, smoke: bool, keep: Callable[[str], bool]
) -> list[Callable[[], NewCase]]:
    """Lazy makers of the cases whose name ``keep`` accepts (each allocates its cache when
    called, so one case's cache is freed before the next is made)."""
    gen = torch.Generator().manual_seed(0)
    table = _SMOKE if smoke else _GPU
    makers: list[Callable[[], NewCase]] = []
    for build, args in table:
        name = _name_of(build, args)
        if keep(name):
            makers.append(functools.partial(_make, build, args, device, gen))
    return makers


def _make(build: Callable[..., NewCase], args: tuple, device: str, gen: torch.Generator) -> NewCase:
    if build is _mla and len(args) >= 4:
        batch, ctx, block = args[:3]
        return _mla(batch, ctx, block, device, gen, heads_tp=args[3], fp8=args[4:] == ("fp8",))
    return build(*args, device, gen)


def _name_of(build: Callable[..., NewCase], args: tuple) -> str:
    if build is _pth:
        quant, batch, ctx, block = args
        return f"pth_{quant}_decode_b{batch}_ctx{ctx}_n{block}"
    if build is _fp8:
        batch, ctx, block = args
        return f"fp8pt_decode_b{batch}_ctx{ctx}_n{block}"
    if build is _mla:
        batch, ctx, block, *tp = args
        tag = _mla_tag(tp[0] if tp else 128, tp[1:] == ["fp8"])
        return f"{tag}_decode_b{batch}_ctx{ctx}_n{block}"
    batch, ctx, block = args
    return f"diffkv_decode_b{batch}_ctx{ctx}_n{block}"
