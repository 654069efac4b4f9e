"""Public API of paged attention: validate every input, then dispatch on an explicit ``impl``.

``impl="reference"`` runs the torch reference (any device), ``impl="triton"`` the unified Triton
kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), ``impl="auto"`` Triton for CUDA
tensors and the reference for CPU tensors. Nothing falls back silently: an unsupported case raises
a ``ValueError`` that names the value, the bound and the fix.

Value checks that need the data (query offsets monotonic, block ids in range, ``q_len <=
max_query_len``) run when the index tensors live on the CPU; on CUDA they would cost a device sync
per call (and break CUDA-graph capture), so there the caller's metadata builder owns them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from kv_spec import KVCacheLayout, KVQuantMode, to_torch_dtype

from kv_kernels.paged_attention._op import paged_attention_op

__all__ = ["merge_attn_states", "paged_attention"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_IMPLS = ("auto", "reference", "triton")
#: Head sizes the Triton kernel tiles (padded to a power of two inside the kernel).
MAX_HEAD_SIZE = 256

ScaleArg = float | torch.Tensor | None


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {list(_IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"impl='triton' needs CUDA tensors (got {device.type}); on the CPU use impl='reference' "
            "or set TRITON_INTERPRET=1 before importing kv_kernels.paged_attention.triton"
        )
    return impl


def _check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move it to {device}")


def _check_layout(layout: KVCacheLayout) -> None:
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a kv_spec.KVCacheLayout, got {type(layout).__name__}")
    if layout.is_mla:
        raise ValueError(
            "paged_attention does not support MLA layouts (is_mla=True: one latent, no separate V); "
            "use an MLA attention backend"
        )
    if layout.kv_quant.per_token_head:
        raise ValueError(
            f"paged_attention does not support kv_quant={layout.kv_quant.value!r} (inline per-token-head "
            f"scales) yet; use {KVQuantMode.FP8_PER_TENSOR.value!r} or an unquantized cache"
        )


def _check_scale(
    name: str, value: ScaleArg, quantized: bool, num_kv_heads: int, device: torch.device
) -> ScaleArg:
    if not quantized:
        if value is not None:
            raise ValueError(
                f"{name} was given but the cache is not quantized (kv_quant='none'); pass {name}=None"
            )
        return None
    if value is None:
        raise ValueError(
            f"{name} is required for an fp8 cache (kv_quant='fp8_per_tensor': dequant = stored * scale); "
            "pass a float, a 1-element tensor or a per-kv-head [H] tensor"
        )
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {value.dtype}")
        if value.numel() not in (1, num_kv_heads) or value.dim() > 1:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; pass one element (per tensor) or "
                f"[{num_kv_heads}] (per kv head)"
            )
        _check_same_device(name, value, device)
        return value.reshape(-1).to(torch.float32).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value} must be a finite positive float")
    return float(value)


def _check_head_vector(
    name: str, t: torch.Tensor | None, num_q_heads: int, device: torch.device
) -> None:
    if t is None:
        return
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != torch.float32
        or tuple(t.shape) != (num_q_heads,)
    ):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{name} must be a float32 tensor of shape [{num_q_heads}] (one per q head), got {got}"
        )
    _check_same_device(name, t, device)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, head_size]
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view, any strides
    layout: KVCacheLayout,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32/int64 kernel block ids
    seq_lens: torch.Tensor,  # [num_seqs] KV length of each sequence, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] cumulative query offsets
    max_query_len: int,
    *,
    max_seq_len: int | None = None,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] float32
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [Hq] float32
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,  # [T, Hq, head_size_v]
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen paged attention for prefill, chunked prefill and decode in one batch.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s + 1]`` of ``q`` and KV
    positions ``0 .. seq_lens[s] - 1``, position ``p`` stored in block ``block_table[s, p // N]`` at
    row ``p % N`` of ``kv_cache`` (K in ``C[layout.k_range]``, V in ``C[layout.v_range]``). Query
    ``i`` of a sequence sits at position ``seq_len - q_len + i``.

    - ``causal``: a query sees keys at positions ``<=`` its own.
    - ``sliding_window=w``: a query sees only the last ``w`` positions up to itself (a lower bound
      ``key > pos - w``; without ``causal`` there is no upper bound).
    - ``sinks``: per-q-head logits that join the softmax denominator only (no value).
    - ``softcap > 0``: ``logit = softcap * tanh(logit / softcap)``, applied before ALiBi.
    - ``alibi_slopes``: ``logit += slope * (key_pos - query_pos)``.
    - fp8 caches (``kv_quant='fp8_per_tensor'``): ``k_scale`` / ``v_scale`` (float, 1-element or
      per-kv-head ``[H]`` tensor), dequant ``stored * scale``.
    - ``num_splits``: ``None`` lets the Triton kernel pick a KV split count (flash-decoding) for the
      batch; an int fixes it, which makes every sequence's result bit-identical whatever else is in
      the batch (batch invariance). The reference computes the exact softmax and ignores it.
    - ``max_query_len`` must bound every sequence's query count (as in FlashAttention's varlen API);
      ``max_seq_len`` (optional) only steers the split heuristic.

    Returns ``out`` ``[T, Hq, head_size_v]`` in ``q.dtype`` and, with ``return_lse``, the float32
    log-sum-exp ``[T, Hq]`` (natural log, sinks included). A row that sees no key gets zeros and
    ``lse = -inf`` (or its sink). Rows past ``query_start_loc[-1]`` (CUDA-graph padding) are not
    written. Unsupported: MLA layouts and per-token-head quantized caches (``ValueError``).
    """
    if torch.compiler.is_compiling():
        # One opaque node for torch.compile; the op runs this function again, eagerly, and
        # validates there (validation itself is not traceable).
        if out is None:
            out = q.new_empty((q.shape[0], q.shape[1], layout.head_size_v))
        return paged_attention_op(
            q,
            kv_cache,
            layout,
            block_table,
            seq_lens,
            query_start_loc,
            max_query_len,
            max_seq_len=max_seq_len,
            scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
            causal=causal,
            sliding_window=sliding_window,
            sinks=sinks,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            k_scale=k_scale,
            v_scale=v_scale,
            num_splits=num_splits,
            return_lse=return_lse,
            out=out,
            impl=impl,
        )
    _check_layout(layout)
    for name, t in (
        ("q", q),
        ("kv_cache", kv_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = q.device
    if q.dim() != 3 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"q must be [T, Hq, head_size] float16/bfloat16/float32, got {q.dtype} {tuple(q.shape)}"
        )
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads, block_size = layout.num_kv_heads, layout.block_size
    head_size_v = layout.head_size_v
    if head_size != layout.head_size:
        raise ValueError(
            f"q head_size={head_size} does not match layout.head_size={layout.head_size}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_q_heads} heads, not a multiple of layout.num_kv_heads={num_kv_heads} (GQA needs Hq % H == 0)"
        )
    expected = (layout.num_blocks, num_kv_heads, block_size, layout.content_size)
    if kv_cache.dim() != 4 or tuple(kv_cache.shape) != expected:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)} but the layout's [B, H, N, C] layer view is {expected}; "
            "pass kv_kernels.layer_view(storage, layout, layer)"
        )
    cache_dtype = to_torch_dtype(layout.dtype)
    if kv_cache.dtype != cache_dtype:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} does not match layout dtype {layout.dtype}"
        )
    quantized = layout.kv_quant is KVQuantMode.FP8_PER_TENSOR
    if not quantized and q.dtype != kv_cache.dtype:
        raise ValueError(
            f"q dtype {q.dtype} must match the unquantized cache dtype {kv_cache.dtype}; cast q"
        )
    _check_same_device("kv_cache", kv_cache, device)
    if block_table.dim() != 2 or block_table.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"block_table must be [num_seqs, max_blocks] int32/int64, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    num_seqs = block_table.shape[0]
    if seq_lens.dim() != 1 or seq_lens.dtype not in _INDEX_DTYPES or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens must be [{num_seqs}] int32 (one per block-table row), got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if (
        query_start_loc.dim() != 1
        or query_start_loc.dtype not in _INDEX_DTYPES
        or query_start_loc.shape[0] != num_seqs + 1
    ):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}] int32 (num_seqs + 1 offsets), "
            f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    for name, t in (
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        _check_same_device(name, t, device)
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len={max_query_len!r} must be an int >= 0")
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0
    ):
        raise ValueError(f"max_seq_len={max_seq_len!r} must be None or an int >= 0")
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite float")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1")
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise ValueError(f"softcap={softcap!r} must be a finite float >= 0 (0 disables it)")
    _check_head_vector("sinks", sinks, num_q_heads, device)
    _check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, device)
    k_scale = _check_scale("k_scale", k_scale, quantized, num_kv_heads, device)
    v_scale = _check_scale("v_scale", v_scale, quantized, num_kv_heads, device)
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"num_splits={num_splits!r} must be None (heuristic) or an int >= 1")
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_size_v), dtype=q.dtype, device=device)
    elif (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (num_tokens, num_q_heads, head_size_v)
        or out.dtype != q.dtype
    ):
        got = (
            f"{out.dtype} {tuple(out.shape)}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise ValueError(
            f"out must be {q.dtype} [{num_tokens}, {num_q_heads}, {head_size_v}], got {got}"
        )
    else:
        _check_same_device("out", out, device)
    impl = _resolve_impl(impl, device)
    if device.type == "cpu":
        _check_values(block_table, seq_lens, query_start_loc, num_tokens, max_query_len, layout)
    common: dict[str, Any] = dict(
        k_range=layout.k_range,
        v_range=layout.v_range,
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        scale=float(scale),
        causal=bool(causal),
        sliding_window=sliding_window,
        sinks=sinks,
        softcap=float(softcap),
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=bool(return_lse),
        out=out,
    )
    if impl == "reference":
        from kv_kernels.paged_attention.reference import paged_attention_reference

        return paged_attention_reference(q, kv_cache, **common)
    if head_size > MAX_HEAD_SIZE or head_size_v > MAX_HEAD_SIZE:
        raise ValueError(
            f"impl='triton' supports head sizes up to {MAX_HEAD_SIZE}, got head_size={head_size}, "
            f"head_size_v={head_size_v}; use impl='reference'"
        )
    from kv_kernels.paged_attention.triton import paged_attention_triton

    return paged_attention_triton(
        q,
        kv_cache,
        **common,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
        num_splits=num_splits,
    )


def _check_values(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    max_query_len: int,
    layout: KVCacheLayout,
) -> None:
    """Data-dependent checks, run only for CPU index tensors (no device sync)."""
    qsl = query_start_loc.to(torch.int64)
    if qsl.numel() and int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0]={int(qsl[0])} must be 0")
    q_lens = qsl[1:] - qsl[:-1]
    if q_lens.numel():
        if int(q_lens.min()) < 0:
            raise ValueError(
                "query_start_loc must be non-decreasing (a negative query count was found)"
            )
        if int(q_lens.max()) > max_query_len:
            raise ValueError(
                f"a sequence has {int(q_lens.max())} query tokens but max_query_len={max_query_len}; "
                "pass the true maximum"
            )
        if int(qsl[-1]) > num_tokens:
            raise ValueError(f"query_start_loc[-1]={int(qsl[-1])} exceeds q's {num_tokens} tokens")
    lens = seq_lens.to(torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"seq_lens has a negative entry ({int(lens.min())})")
    n = layout.block_size
    for s in range(lens.numel()):
        if int(q_lens[s]) == 0:
            continue  # an empty query row reads nothing
        n_pages = -(-int(lens[s]) // n)
        if n_pages > block_table.shape[1]:
            raise ValueError(
                f"seq_lens[{s}]={int(lens[s])} needs {n_pages} blocks of {n} but block_table has "
                f"{block_table.shape[1]} columns; widen the block table"
            )
        ids = block_table[s, :n_pages]
        if n_pages and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_blocks):
            raise ValueError(
                f"block_table[{s}, :{n_pages}] holds ids outside [0, {layout.num_blocks}) for "
                f"seq_len={int(lens[s])}: every block under the sequence must be allocated (-1 only in the padded tail)"
            )


def merge_attn_states(
    out_a: torch.Tensor,  # [T, Hq, Dv]
    lse_a: torch.Tensor,  # [T, Hq] float32
    out_b: torch.Tensor,  # [T, Hq, Dv]
    lse_b: torch.Tensor,  # [T, Hq] float32
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets (cascade / shared prefix / split KV).

    Each state is a softmax-normalized output and its natural-log LSE; the merge is
    ``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logaddexp(lse_a, lse_b)``. Returns
    ``(out [T, Hq, Dv] in out_a.dtype, lse [T, Hq] float32)``; rows where both LSEs are ``-inf``
    give zeros and ``-inf``.
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.dim() != 3 or out_a.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"out_a must be [T, Hq, Dv] float16/bfloat16/float32, got {out_a.dtype} {tuple(out_a.shape)}"
        )
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(
            f"out_b ({out_b.dtype} {tuple(out_b.shape)}) must match out_a ({out_a.dtype} {tuple(out_a.shape)})"
        )
    want = tuple(out_a.shape[:2])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.dtype != torch.float32 or tuple(t.shape) != want:
            raise ValueError(f"{name} must be float32 {list(want)}, got {t.dtype} {tuple(t.shape)}")
    device = out_a.device
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _check_same_device(name, t, device)
    impl = _resolve_impl(impl, device)
    if impl == "reference":
        from kv_kernels.paged_attention.reference import merge_attn_states_reference

        return merge_attn_states_reference(out_a, lse_a, out_b, lse_b)
    from kv_kernels.paged_attention.triton import merge_attn_states_triton

    return merge_attn_states_triton(out_a, lse_a, out_b, lse_b)
