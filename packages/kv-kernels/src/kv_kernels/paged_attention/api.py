"""Public API of paged attention: validate every input, then dispatch on an explicit ``impl``.

``impl="reference"`` runs the torch reference (any device), ``impl="triton"`` the unified Triton
kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), ``impl="auto"`` Triton for CUDA
tensors and the reference for CPU tensors. Nothing falls back silently: an unsupported case raises
a ``ValueError`` that names the value, the bound and the fix.

Value checks that need the data (query offsets monotonic, block ids in range, ``q_len <=
max_query_len``, ``q_len <= seq_len`` where positions matter) run when the index tensors live on the CPU, or on request
(``validate=True`` / ``KV_KERNELS_VALIDATE=1``, a debug mode); on CUDA they would cost a device
sync per call (and break CUDA-graph capture), so there the kernel masks what it cannot trust and
counts it in an optional device-side ``error_flag``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from kv_spec import KVCacheLayout, KVQuantMode, to_torch_dtype

from kv_kernels import _call_cache
from kv_kernels._call_cache import fast_path_allowed
from kv_kernels._common import (
    ScaleArg,
    check_error_flag,
    check_scale,
    host_validation_requested,
    resolve_impl,
)
from kv_kernels._op_calls import paged_attention_op
from kv_kernels.cache import scale_geometry
from kv_kernels.paged_attention._fast import (
    Entry,
    cached_call,
    direct_scales,
    remember,
    triton_launcher,
)
from kv_kernels.paged_attention._index_checks import check_index_values

__all__ = ["merge_attn_states", "paged_attention"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
#: Head sizes the Triton kernel tiles (padded to a power of two inside the kernel).
MAX_HEAD_SIZE = 256


def _check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move it to {device}")


def _check_layout(layout: KVCacheLayout, kv_lora_rank: object) -> tuple[int, int]:
    """The ``[start, stop)`` of V in C: the layout's, or for MLA the latent's first
    ``kv_lora_rank`` columns (the absorbed form: K = the whole row, V = its latent part)."""
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a kv_spec.KVCacheLayout, got {type(layout).__name__}")
    if not layout.is_mla:
        if kv_lora_rank is not None:
            raise ValueError(
                f"kv_lora_rank={kv_lora_rank!r} is only for MLA layouts (is_mla=True); pass None"
            )
        assert layout.v_range is not None
        return layout.v_range
    if layout.kv_quant not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        raise ValueError(
            f"paged_attention over an MLA latent supports kv_quant 'none' and 'fp8_per_tensor', "
            f"got {layout.kv_quant.value!r}; store the latent unquantized or in fp8 with one "
            "per-tensor scale (k_scale)"
        )
    if kv_lora_rank is None:
        raise ValueError(
            f"an MLA layout (is_mla=True, latent head_size={layout.head_size}) needs kv_lora_rank, "
            "the latent width that V reads (DeepSeek-V3: kv_lora_rank=512 of 512 + 64)"
        )
    rank = _int_option("kv_lora_rank", kv_lora_rank, 1, "the latent width (V columns) of MLA")
    if rank >= layout.head_size:
        raise ValueError(
            f"kv_lora_rank={rank} must be < the latent row's head_size={layout.head_size} "
            "(K = latent + rope part, V = the first kv_lora_rank columns; DeepSeek-V3: 512 of 576)"
        )
    return (0, rank)


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
            f"pass a float, a 1-element tensor or a per-kv-head [{num_kv_heads}] tensor"
        )
    return check_scale(name, value, num_heads=num_kv_heads, device=device)


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


#: Bound of every token count / window the kernels take (they index with int32).
_MAX_INT32 = 2**31 - 1
#: More KV splits than this never pays (each split keeps >= 8 KV tiles; see pick_num_splits).
_MAX_SPLITS = 256


def _int_option(name: str, value: object, minimum: int, what: str, optional: bool = False) -> Any:
    """An int option in ``[minimum, 2**31 - 1]`` (or ``None`` when optional)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be {what}: an int, got {type(value).__name__}")
    if not minimum <= value <= _MAX_INT32:
        raise ValueError(f"{name}={value} must be {what} in [{minimum}, {_MAX_INT32}]")
    return value


def _check_tensors(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: KVCacheLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> bool:
    """Shapes, dtypes and devices of the tensor inputs; returns whether the cache is fp8."""
    for name, t in (
        ("q", q),
        ("kv_cache", kv_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = q.device
    if q.dim() != 3 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"q must be [T, Hq, head_size] float16/bfloat16/float32, got {q.dtype} {tuple(q.shape)}"
        )
    num_q_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = layout.num_kv_heads
    if head_size != layout.head_size:
        raise ValueError(
            f"q head_size={head_size} does not match layout.head_size={layout.head_size}"
        )
    if num_q_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_q_heads} heads, not a positive multiple of layout.num_kv_heads="
            f"{num_kv_heads} (GQA needs Hq % H == 0)"
        )
    expected = (layout.num_blocks, num_kv_heads, layout.block_size, layout.content_size)
    if kv_cache.dim() != 4 or tuple(kv_cache.shape) != expected:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)} but the layout's [B, H, N, C] layer view is {expected}; "
            "pass kv_kernels.layer_view(storage, layout, layer)"
        )
    if kv_cache.dtype != to_torch_dtype(layout.dtype):
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} does not match layout dtype {layout.dtype}"
        )
    quantized = layout.kv_quant is KVQuantMode.FP8_PER_TENSOR
    if layout.kv_quant is KVQuantMode.NONE and q.dtype != kv_cache.dtype:
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
    return quantized


def _prepare_out(out: object, q: torch.Tensor, head_size_v: int) -> torch.Tensor:
    num_tokens, num_q_heads = q.shape[0], q.shape[1]
    if out is None:
        return torch.empty((num_tokens, num_q_heads, head_size_v), dtype=q.dtype, device=q.device)
    if (
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
    _check_same_device("out", out, q.device)
    return out


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
    error_flag: torch.Tensor | None = None,  # [1] int32 on q's device
    validate: bool | None = None,
    kv_lora_rank: int | None = None,
    num_decodes: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen paged attention for prefill, chunked prefill and decode in one batch.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s + 1]`` of ``q`` and KV
    positions ``0 .. seq_lens[s] - 1``, position ``p`` stored in block ``block_table[s, p // N]`` at
    row ``p % N`` of ``kv_cache`` (K in ``C[layout.k_range]``, V in ``C[layout.v_range]``). Query
    ``i`` of a sequence sits at position ``seq_len - q_len + i``.

    Semantics are those of :mod:`kv_kernels.testing` (the oracle's docstring), in short:

    - ``causal``: a query sees keys at positions ``<=`` its own.
    - ``sliding_window=w``: with ``causal`` a query sees the last ``w`` positions up to itself
      (``pos - w < key``); without it, keys within ``w`` on both sides (``|pos - key| < w``).
    - ``sinks``: per-q-head logits that join the softmax denominator only (no value).
    - ``softcap > 0``: ``logit = softcap * tanh(logit / softcap)``, applied before ALiBi.
    - ``alibi_slopes``: ``logit += slope * (key_pos - query_pos)``.
    - fp8 caches (``kv_quant='fp8_per_tensor'``): ``k_scale`` / ``v_scale`` (float, 1-element or
      per-kv-head ``[H]`` tensor), dequant ``stored * scale``. An fp8 MLA latent has one scale,
      ``k_scale`` (K and V are the same stored row); ``v_scale`` must be ``None`` there.
    - per-token-head caches (``int8_per_token_head`` / ``fp8_per_token_head``): each token's K
      and V row of each head is ``stored * s`` with its float32 ``s`` read from the page
      (``layout.scale_range``, or the page's scale plane with ``layout.scale_plane``, as
      ``reshape_and_cache`` writes them); pass no ``k_scale``/``v_scale``.
    - MLA (``layout.is_mla``, absorbed decode): ``q`` is ``[T, Hq, head_size]`` against one latent
      row per token (``head_size = kv_lora_rank + rope``, DeepSeek-V3: 512 + 64); K is the whole
      row, V its first ``kv_lora_rank`` columns of the same storage (no second copy), and the
      output is ``[T, Hq, kv_lora_rank]``. ``kv_lora_rank`` is required exactly for MLA layouts.
      The latent may be unquantized or fp8 per tensor (vLLM's ``fp8_e4m3`` latent cache).
    - ``num_splits``: ``None`` lets the Triton kernel pick a KV split count (flash-decoding) for the
      batch; an int fixes it, which makes every sequence's result bit-identical whatever else is in
      the batch (batch invariance). The reference computes the exact softmax and ignores it.
    - ``max_query_len`` must bound every sequence's query count (as in FlashAttention's varlen API);
      ``max_seq_len`` (optional) only steers the split heuristic.
    - ``num_decodes`` (optional, a host int in ``[0, num_seqs]``): the first ``num_decodes``
      sequences hold one query token each (vLLM's ``num_decodes``, a batch with its decodes
      first). Like ``max_query_len`` it is a promise about the metadata, checked where the values
      are (index tensors on the CPU, ``validate=True``) and counted in ``error_flag`` where one is
      given (a promised decode that is not one): the prefill kernels of a mixed batch then
      launch programs for the sequences after them only, not idle ones for every decode. Results
      are the same with any true value, 0 included.
    - ``q_len > seq_len`` is allowed only where no rule reads a position: ``causal=False``, no
      ``sliding_window``, no ``alibi_slopes``. Every query then sees all ``seq_len`` keys, which
      is cascade attention's shared-prefix pass (more queries than prefix keys, merged with the
      suffix pass by :func:`merge_attn_states`). With any position-dependent feature it is an
      input error: the first ``q_len - seq_len`` queries would have no position.

    Bad metadata. With index tensors on the CPU (or ``validate=True``, or the environment variable
    ``KV_KERNELS_VALIDATE=1``) every value is checked on the host first: ``q_len > seq_len`` (where
    positions matter),
    unallocated or out-of-range block ids, non-monotone offsets all raise ``ValueError``. On CUDA
    that check would synchronize every step, so by default it is skipped; the Triton kernel still
    never reads outside the cache or the block table (a bad id is redirected inside it), and when
    ``error_flag`` (an int32 ``[1]`` tensor on the device, zeroed by the caller) is given, it adds
    the number of bad reads (and of sequences with ``q_len > seq_len``) to it: check it when
    convenient (e.g. once per step, after the output is used anyway) instead of syncing per call.

    Returns ``out`` ``[T, Hq, head_size_v]`` in ``q.dtype`` and, with ``return_lse``, the float32
    log-sum-exp ``[T, Hq]`` (natural log, sinks included). A row that sees no key gets zeros and
    ``lse = -inf`` (or its sink). Rows past ``query_start_loc[-1]`` (CUDA-graph padding) are not
    written. Unsupported: per-token-head quantized MLA latents (``ValueError``).
    """
    if torch.compiler.is_compiling():
        if kv_lora_rank is not None:
            raise ValueError(
                "paged_attention with kv_lora_rank (MLA) has no custom op yet, so it cannot run "
                "inside torch.compile; call it outside the compiled region"
            )
        # One opaque node for torch.compile; the op runs this function again, eagerly, and
        # validates there (validation itself is not traceable).
        if out is None:
            out = q.new_empty((q.shape[0], q.shape[1], layout.head_size_v))
        return paged_attention_op(
            q, kv_cache, layout, block_table, seq_lens, query_start_loc, max_query_len,
            max_seq_len=max_seq_len, scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
            causal=causal, sliding_window=sliding_window, sinks=sinks, softcap=softcap,
            alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits,
            return_lse=return_lse, out=out, impl=impl, error_flag=error_flag,
            num_decodes=num_decodes,
        )  # fmt: skip
    fast_key = None
    if (
        (validate is None and fast_path_allowed()) or (validate is False and _call_cache.ENABLED)
    ) and (
        isinstance(q, torch.Tensor)
        and q.is_cuda
        # (max_seq_len as the full path accepts it: the fast path does not check it else)
        and (max_seq_len is None or (type(max_seq_len) is int and 0 <= max_seq_len <= _MAX_INT32))
    ):
        options = (
            scale, type(scale), causal, type(causal), sliding_window, type(sliding_window),
            softcap, type(softcap), num_splits, type(num_splits), return_lse, type(return_lse),
            impl, kv_lora_rank, type(kv_lora_rank), validate, num_decodes, type(num_decodes),
        )  # fmt: skip
        result, fast_key = cached_call(
            q, kv_cache, layout, block_table, seq_lens, query_start_loc, max_query_len, options,
            sinks, alibi_slopes, k_scale, v_scale, out, error_flag, max_seq_len,
        )  # fmt: skip
        if result is not None:
            return result
    scales_given = (k_scale, v_scale)
    v_range = _check_layout(layout, kv_lora_rank)
    quantized = _check_tensors(q, kv_cache, layout, block_table, seq_lens, query_start_loc)
    device = q.device
    num_tokens, num_q_heads, head_size = q.shape
    block_size, head_size_v = layout.block_size, v_range[1] - v_range[0]
    max_query_len = _int_option("max_query_len", max_query_len, 0, "the longest query count")
    max_seq_len = _int_option("max_seq_len", max_seq_len, 0, "None or the longest sequence", True)
    sliding_window = _int_option("sliding_window", sliding_window, 1, "None or a window", True)
    num_splits = _int_option("num_splits", num_splits, 1, "None (heuristic) or a split count", True)
    num_decodes = _int_option("num_decodes", num_decodes, 0, "a count of leading decodes")
    if num_decodes > block_table.shape[0]:
        raise ValueError(
            f"num_decodes={num_decodes} exceeds the batch's {block_table.shape[0]} sequences "
            "(block_table rows); pass how many leading sequences hold one query token"
        )
    if num_splits is not None and num_splits > _MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be <= {_MAX_SPLITS}")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} must be a bool, got {type(flag).__name__}")
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite float (default 1/sqrt(head_size))")
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise ValueError(f"softcap={softcap!r} must be a finite float >= 0 (0 disables it)")
    _check_head_vector("sinks", sinks, num_q_heads, device)
    _check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, device)
    if layout.kv_quant.per_token_head:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise ValueError(
                    f"{name} was given but kv_quant={layout.kv_quant.value!r} keeps its scales "
                    f"inline in the page (one per token and head); pass {name}=None"
                )
    k_scale = _check_scale("k_scale", k_scale, quantized, layout.num_kv_heads, device)
    if quantized and layout.is_mla:
        v_scale = _latent_v_scale(v_scale, k_scale)
    else:
        v_scale = _check_scale("v_scale", v_scale, quantized, layout.num_kv_heads, device)
    out = _prepare_out(out, q, head_size_v)
    impl = resolve_impl(impl, device, op="paged_attention")
    check_error_flag(error_flag, device, op="paged_attention")
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate={validate!r} must be None (auto), True or False")
    if validate is None:
        validate = device.type == "cpu" or host_validation_requested()
    if validate:
        # Without a causal mask, a window or ALiBi no rule reads a query's position, so a query
        # may outnumber the keys (cascade attention's shared-prefix pass).
        positional = causal or sliding_window is not None or alibi_slopes is not None
        check_index_values(
            block_table, seq_lens, query_start_loc, num_tokens, max_query_len, layout, positional,
            num_decodes,
        )  # fmt: skip
    common: dict[str, Any] = dict(
        k_range=layout.k_range, v_range=v_range, scale_rows=scale_geometry(kv_cache, layout),
        block_table=block_table,
        seq_lens=seq_lens, query_start_loc=query_start_loc, scale=float(scale), causal=causal,
        sliding_window=sliding_window, sinks=sinks, softcap=float(softcap),
        alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
        out=out,
    )  # fmt: skip
    if impl == "reference":
        from kv_kernels.paged_attention.reference import paged_attention_reference

        return paged_attention_reference(q, kv_cache, **common)
    _check_triton_heads(head_size, head_size_v, layout.is_mla)
    _check_unit_stride(
        seq_lens=seq_lens, query_start_loc=query_start_loc, sinks=sinks, alibi_slopes=alibi_slopes
    )
    static = dict(
        k_range=common["k_range"], v_range=v_range, scale_rows=common["scale_rows"],
        scale=common["scale"], causal=causal, sliding_window=sliding_window,
        softcap=common["softcap"], return_lse=return_lse, max_query_len=max_query_len,
        block_size=block_size, num_splits=num_splits, v_from_k=layout.is_mla,
        num_decodes=num_decodes,
    )  # fmt: skip
    entry = None
    if fast_key is not None:
        entry = Entry(layout, static, head_size_v, direct_scales(*scales_given))
    result = triton_launcher()(
        q, kv_cache, block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc,
        sinks=sinks, alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale, out=out,
        max_seq_len=max_seq_len, error_flag=error_flag, plan_slot=entry, **static,
    )  # fmt: skip
    if fast_key is not None and entry is not None:
        remember(fast_key, entry)
    return result


def _latent_v_scale(v_scale: ScaleArg, k_scale: ScaleArg) -> ScaleArg:
    """V's dequant scale over an fp8 MLA latent: ``k_scale`` itself. The latent row is stored
    once, as ``x / k_scale`` (``reshape_and_cache`` takes ``k_scale`` only for MLA), and K (the
    whole row) and V (its first ``kv_lora_rank`` columns) are read from those same bytes, so
    one scale dequantizes both; a second one could only disagree with the write."""
    if v_scale is not None:
        got = f"a {type(v_scale).__name__}" if isinstance(v_scale, torch.Tensor) else repr(v_scale)
        raise ValueError(
            f"v_scale={got} was given for an fp8 MLA latent (kv_quant='fp8_per_tensor', "
            "is_mla=True): the latent row is stored once as x / k_scale and K and V both read "
            "it, so its one scale is k_scale; pass v_scale=None"
        )
    return k_scale


def _check_unit_stride(**vectors: torch.Tensor | None) -> None:
    """The Triton kernels read these 1-D tensors as arrays (``ptr + i``): a strided view (e.g.
    ``seq_lens[::2]``) would be read as the wrong values, so it is an input error."""
    for name, t in vectors.items():
        if t is not None and t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(
                f"{name} has stride {t.stride(0)} but impl='triton' reads it as a contiguous "
                f"array (stride 1); pass {name}.contiguous()"
            )


def _check_triton_heads(head_size: int, head_size_v: int, mla: bool) -> None:
    """Head sizes the Triton kernel tiles: up to 256 (padded to a power of two, or split into a
    power of two and a power-of-two tail); MLA latents up to 512 + a tail, V = the main tile."""
    from kv_kernels.paged_attention._tiles import split_head

    main, tail = split_head(head_size)
    if mla:
        if tail == 0 or head_size_v != main or main > 2 * MAX_HEAD_SIZE:
            raise ValueError(
                f"impl='triton' reads an MLA latent of head_size={head_size} with "
                f"kv_lora_rank={head_size_v} only as a power-of-two latent (<= 512) plus a "
                f"power-of-two rope tail >= 16 (DeepSeek-V3: 512 + 64); use impl='reference'"
            )
        return
    if head_size > MAX_HEAD_SIZE or head_size_v > MAX_HEAD_SIZE:
        raise ValueError(
            f"impl='triton' supports head sizes up to {MAX_HEAD_SIZE}, got head_size={head_size}, "
            f"head_size_v={head_size_v}; use impl='reference'"
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
    impl = resolve_impl(impl, device, op="merge_attn_states")
    if impl == "reference":
        from kv_kernels.paged_attention.reference import merge_attn_states_reference

        return merge_attn_states_reference(out_a, lse_a, out_b, lse_b)
    from kv_kernels.paged_attention.triton import merge_attn_states_triton

    return merge_attn_states_triton(out_a, lse_a, out_b, lse_b)
