"""Compile a cache's kernels before the first request: the cold start, cut.

A Triton (or Gluon) kernel compiles on its first launch for each *specialization* — its
constexprs, and of its runtime arguments whether each integer is 1, fits 32 bits or divides by
16 and whether each pointer is 16-byte aligned. A model needs a handful of such variants per KV
group (the cache write, attention's prefill and decode classes, the split-KV decode and its
merge), and each costs seconds to build: an H200 with an empty Triton cache took over 260 s for
25 varied paged-attention calls that ran in 38 s warm. Served inside the first requests, that is
minutes of time to first token.

:func:`warm_paged_ops` runs each op once on inputs shaped like a serving step's over the real
cache, reading and writing only ``scratch_block`` (the block pool's null block 0 by default, which
no request owns), so every variant a step launches is built (and lands in Triton's on-disk cache,
``TRITON_CACHE_DIR`` or ``~/.triton/cache``, so the next process loads it in milliseconds).
``jobs > 1`` first builds the same calls in ``jobs`` child processes over small caches of the same
strides' specialization, in parallel (compilation is single-threaded per kernel, and a GPU host
has cores to spare), then runs them here from the disk cache.

What it cannot foresee: a batch shape whose specialization differs from the ones it runs (a cache
whose strides pass 2^31 elements compiles 64-bit stride variants: the warmup's own calls use the
real cache, so those are covered in this process, but the child processes' small caches are not).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kv_spec import KVCacheLayout, to_torch_dtype

__all__ = ["WarmupCall", "warm_paged_ops", "warmup_calls"]


@dataclass(frozen=True)
class WarmupCall:
    """One op launch of a serving step's shape: ``op`` "write" (``reshape_and_cache`` of
    ``tokens`` tokens) or "attention" (``paged_attention`` of sequences ``(q_len, seq_len)`` over
    a block table ``width`` columns wide); ``name`` says what it stands for in a report."""

    name: str
    op: str
    seqs: tuple[tuple[int, int], ...] = ()
    tokens: int = 0
    width: int = 0
    #: the table's row stride (columns of the buffer the table is a view of; 0: ``width``)
    row_stride: int = 0


def warmup_calls(
    layout: KVCacheLayout,
    *,
    max_seq_len: int = 8192,
    block_table_width: int | None = None,
    block_table_stride: int | None = None,
) -> list[WarmupCall]:
    """The launches a serving step makes over ``layout``, one per compiled variant: the cache
    write, a mixed prefill + decode step (attention's prefill and decode classes), a whole-prompt
    prefill, decode-only batches of 1, 4 and 16 requests over contexts up to ``max_seq_len`` (the
    split-KV decode and its merge), a mixed step whose decodes split KV (the merge of decode rows
    only), and a mixed step of 16 sequences: the kernels specialize a
    count of sequences that is 1 or a multiple of 16 (batches of 16, 32, 64, ...).

    The attention kernels specialize the block table's width (a multiple of 16 or not), so the
    calls use ``block_table_width`` (the serving engine's persistent table, as wide as its
    longest request's pages) or, when it is ``None``, run once at each kind of width; and the
    table's row stride, ``block_table_stride`` (a group's columns of a wider buffer), else the
    width."""
    n = layout.block_size
    if block_table_width is not None:
        check = block_table_width
        if isinstance(check, bool) or not isinstance(check, int) or check < 2:
            raise ValueError(
                f"block_table_width={block_table_width!r} must be an int >= 2 (the columns of the "
                "serving step's block table), or None to warm both kinds of width"
            )
        widths = [block_table_width]
        if block_table_stride is not None and (
            isinstance(block_table_stride, bool)
            or not isinstance(block_table_stride, int)
            or block_table_stride < block_table_width
        ):
            raise ValueError(
                f"block_table_stride={block_table_stride!r} must be an int >= "
                f"block_table_width={block_table_width} (the table's row pitch), or None"
            )
        max_seq_len = min(max_seq_len, (block_table_width - 1) * n)
    else:
        longest = -(-max(2 * n, max_seq_len) // n) + 1
        widths = [longest | 1, -(-longest // 16) * 16]  # (an odd width, then a multiple of 16)
    if block_table_width is None and block_table_stride is not None:
        raise ValueError(
            "block_table_stride needs block_table_width (the table it is the pitch of)"
        )
    long = max(2, min(max(2 * n, max_seq_len), (min(widths) - 1) * n))
    # (every sequence fits the narrowest table: 300-, 200-, 96- and 40-token lengths shrink)
    mixed, ctx, prompt, short = (min(x, long) for x in (300, 200, 96, 40))
    stride = block_table_stride or 0
    calls = [WarmupCall("write", "write", tokens=max(n, 2))]
    for w in widths:
        tag = "" if len(widths) == 1 else f", table width {w}"
        calls += [
            WarmupCall(
                "mixed prefill + decode" + tag,
                "attention",
                ((mixed, mixed), (1, ctx)),
                0,
                w,
                stride,
            ),
            WarmupCall("prefill, one prompt" + tag, "attention", ((prompt, prompt),), 0, w, stride),
            WarmupCall("decode, batch 1" + tag, "attention", ((1, long),), 0, w, stride),
            WarmupCall(
                "decode, batch 4" + tag, "attention", ((1, long),) * 3 + ((1, short),), 0, w, stride
            ),
            WarmupCall(
                "decode, batch 16" + tag,
                "attention",
                ((1, long),) * 15 + ((1, short),),
                0,
                w,
                stride,
            ),
            # (the decode class of a mixed step splits KV over long contexts: the split decode
            # beside an unsplit prefill, and the merge of decode rows only)
            WarmupCall(
                "mixed, long decodes" + tag,
                "attention",
                ((mixed, mixed),) + ((1, long),) * 3,
                0,
                w,
                stride,
            ),
            WarmupCall(
                "mixed, 16 sequences" + tag,
                "attention",
                ((mixed, mixed),) + ((1, ctx),) * 15,
                0,
                w,
                stride,
            ),
        ]
    return calls


def _run(
    call: WarmupCall,
    kv_cache: torch.Tensor,
    layout: KVCacheLayout,
    *,
    num_q_heads: int,
    q_dtype: torch.dtype,
    scratch_block: int,
    attention_kwargs: dict,
) -> None:
    from kv_kernels.paged_attention import paged_attention
    from kv_kernels.reshape_and_cache import reshape_and_cache

    dev = kv_cache.device
    n, h = layout.block_size, layout.num_kv_heads
    if call.op == "write":
        slots = scratch_block * n + torch.arange(call.tokens, device=dev) % n
        scales = {k: attention_kwargs.get(k, v) for k, v in _scales(layout).items()}
        if layout.is_mla:
            key = torch.zeros(call.tokens, 1, layout.head_size, dtype=q_dtype, device=dev)
            reshape_and_cache(key, None, kv_cache, slots, layout, **scales)
        else:
            key = torch.zeros(call.tokens, h, layout.head_size, dtype=q_dtype, device=dev)
            value = torch.zeros(call.tokens, h, layout.head_size_v, dtype=q_dtype, device=dev)
            reshape_and_cache(key, value, kv_cache, slots, layout, **scales)
        return
    q_lens = [q for q, _ in call.seqs]
    seq_lens = [s for _, s in call.seqs]
    pitch = call.row_stride or call.width
    table = torch.full((len(seq_lens), pitch), scratch_block, dtype=torch.int32, device=dev)
    table = table[:, : call.width]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    head = layout.head_size
    q = torch.zeros(sum(q_lens), num_q_heads, head, dtype=q_dtype, device=dev)
    paged_attention(
        q, kv_cache, layout, table, torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        qsl.to(dev), max(q_lens), **{**_scales(layout), **attention_kwargs},
    )  # fmt: skip


def _scales(layout: KVCacheLayout) -> dict:
    """Stand-in fp8 per-tensor scales (the layer's own win, as keyword arguments): K's and V's,
    or an fp8 MLA latent's one ``k_scale`` (its write and attention take no ``v_scale``)."""
    if layout.kv_quant.value != "fp8_per_tensor":
        return {}
    return {"k_scale": 1.0} if layout.is_mla else {"k_scale": 1.0, "v_scale": 1.0}


def warm_paged_ops(
    kv_cache: torch.Tensor,
    layout: KVCacheLayout,
    *,
    num_q_heads: int,
    q_dtype: torch.dtype | None = None,
    scratch_block: int = 0,
    max_seq_len: int = 8192,
    block_table_width: int | None = None,
    block_table_stride: int | None = None,
    jobs: int = 1,
    **attention_kwargs: object,
) -> dict[str, float]:
    """Build every kernel variant a serving step over ``kv_cache`` (a layer view of ``layout``)
    launches, and return the seconds each :func:`warmup_calls` launch took (its first call: the
    compile, or the disk cache's load).

    ``attention_kwargs`` are the layer's attention options as the step passes them
    (``sliding_window``, ``sinks``, ``softcap``, ``causal``, ``kv_lora_rank``, ...); the
    calls read and write only ``scratch_block``; ``block_table_width`` / ``block_table_stride``:
    the columns and row pitch of the step's block tables (see :func:`warmup_calls`). CUDA only (on the CPU nothing compiles: returns
    ``{}``). ``jobs > 1``: build the calls in that many child processes first (see the module).
    """
    if not isinstance(layout, KVCacheLayout):
        raise TypeError(f"layout must be a kv_spec.KVCacheLayout, got {type(layout).__name__}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs={jobs!r} must be an int >= 1 (the child processes that compile)")
    if (
        isinstance(scratch_block, bool)
        or not isinstance(scratch_block, int)
        or not 0 <= scratch_block < layout.num_blocks
    ):
        raise ValueError(
            f"scratch_block={scratch_block!r} must be a block id in [0, {layout.num_blocks}) that "
            "no request owns (the block pool's null block 0)"
        )
    if kv_cache.device.type != "cuda":
        return {}
    if q_dtype is None:
        cache_dtype = to_torch_dtype(layout.dtype)
        q_dtype = cache_dtype if cache_dtype.itemsize == 2 else torch.bfloat16
    calls = warmup_calls(
        layout,
        max_seq_len=max_seq_len,
        block_table_width=block_table_width,
        block_table_stride=block_table_stride,
    )
    if jobs > 1:
        _build_in_children(layout, calls, num_q_heads, q_dtype, attention_kwargs, jobs)
    times = {}
    for call in calls:
        torch.cuda.synchronize(kv_cache.device)
        t0 = time.perf_counter()
        _run(
            call, kv_cache, layout, num_q_heads=num_q_heads, q_dtype=q_dtype,
            scratch_block=scratch_block, attention_kwargs=dict(attention_kwargs),
        )  # fmt: skip
        torch.cuda.synchronize(kv_cache.device)
        times[call.name] = time.perf_counter() - t0
    return times


def _small_layout(layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with 64 blocks (a multiple of 16, so every stride keeps its divisibility)."""
    return KVCacheLayout.from_dict({**layout.to_dict(), "num_blocks": 64})


def _build_in_children(
    layout: KVCacheLayout,
    calls: Sequence[WarmupCall],
    num_q_heads: int,
    q_dtype: torch.dtype,
    attention_kwargs: dict,
    jobs: int,
) -> None:
    """Run ``calls`` split over ``jobs`` child processes (one GPU context each) on a small cache
    of ``layout``'s order: their builds land in the shared on-disk Triton cache. Tensors among
    ``attention_kwargs`` (sinks, ALiBi slopes) travel as their shape and dtype (zeros there)."""
    kw = {}
    for k, v in attention_kwargs.items():
        if isinstance(v, torch.Tensor):
            kw[k] = {"tensor": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        else:
            kw[k] = v
    spec = {
        "layout": _small_layout(layout).to_dict(),
        "num_q_heads": num_q_heads,
        "q_dtype": str(q_dtype).removeprefix("torch."),
        "attention_kwargs": kw,
    }
    procs = []
    for j in range(jobs):
        mine = [dataclasses.asdict(c) for i, c in enumerate(calls) if i % jobs == j]
        if not mine:
            continue
        payload = json.dumps({**spec, "calls": mine})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "kv_kernels.warmup"],
                stdin=subprocess.PIPE,
                env=dict(os.environ),
            )
        )
        assert procs[-1].stdin is not None
        procs[-1].stdin.write(payload.encode())
        procs[-1].stdin.close()
    failed = [p.args for p in procs if p.wait() != 0]
    if failed:
        raise RuntimeError(f"warm_paged_ops: {len(failed)} of {len(procs)} build processes failed")


def _child() -> None:
    """A build process: the calls of stdin's JSON on a small cache of its layout."""
    from kv_kernels.cache import allocate_kv_cache, layer_view

    spec = json.load(sys.stdin)
    layout = KVCacheLayout.from_dict(spec["layout"])
    kv = layer_view(allocate_kv_cache(layout, "cuda"), layout, layout.num_layers - 1)
    kw = {}
    for k, v in spec["attention_kwargs"].items():
        if isinstance(v, dict) and "tensor" in v:
            kw[k] = torch.zeros(v["tensor"], dtype=getattr(torch, v["dtype"]), device="cuda")
        else:
            kw[k] = v
    for c in spec["calls"]:
        call = WarmupCall(**{**c, "seqs": tuple(tuple(s) for s in c["seqs"])})
        _run(
            call, kv, layout, num_q_heads=spec["num_q_heads"],
            q_dtype=getattr(torch, spec["q_dtype"]), scratch_block=0, attention_kwargs=kw,
        )  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    _child()
