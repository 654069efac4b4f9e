"""The fused elementwise ops of a decoder layer: ``rms_norm`` (with the residual add),
``silu_and_mul`` / ``gelu_tanh_and_mul``, ``rotary_embedding`` and ``rope_and_cache`` (RoPE
fused into the cache write), plus ``rope_cos_sin_cache`` (the table the RoPE ops read).

Each validates every input, then dispatches on an explicit ``impl``: ``"reference"`` (torch, any
device), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton for CUDA
tensors, the reference for CPU ones). Nothing falls back silently.
"""

from __future__ import annotations

import math

import torch
from kv_spec import KVCacheLayout, KVQuantMode

from kv_kernels._call_cache import Entry
from kv_kernels._common import check_error_flag, layout_json, resolve_impl
from kv_kernels.fused import _fast
from kv_kernels.fused._fast import check_norm_overlaps
from kv_kernels.fused._fast import overlap as _overlap

__all__ = [
    "gelu_tanh_and_mul",
    "rms_norm",
    "rope_and_cache",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "silu_and_mul",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: The widest row the norm kernel takes (kv_kernels.fused.triton.MAX_NORM_WIDTH; the api keeps
#: its own copy so that importing it never imports Triton).
_MAX_NORM_WIDTH = 32768


def _tensor(name: str, t: object, shape_doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    return t


def _float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise TypeError(
            f"{name} dtype {t.dtype} is not supported; pass one of {list(_FLOATS)} "
            "(arithmetic is float32 inside; the result keeps the input's dtype)"
        )


def _unit_rows(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(
            f"{name}.stride(-1)={t.stride(-1)}: the fused ops read rows of unit stride; pass "
            f"{name}.contiguous() (leading dims may be strided)"
        )


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; move it")


# ---- rms_norm ----------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    weight_first: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally after adding the residual stream (one launch).

    Without ``residual``: returns ``y = x / sqrt(mean(x^2) + eps) * (weight + weight_offset)``.
    With ``residual``: ``h = x + residual`` (rounded to ``x.dtype``: it is the new residual
    stream), ``y = rms_norm(h)``; returns ``(y, h)`` — vLLM's ``fused_add_rms_norm``. Pass
    ``residual_out=residual`` to write ``h`` over the residual in place, as vLLM does.

    Args:
        x: ``[T, D]`` or ``[T, H, D]`` (per-head norms: Qwen3's q/k norm over a slice of the
            fused qkv projection), float16 / bfloat16 / float32, unit last stride, any
            token/head strides; ``1 <= D <= 32768``.
        weight: ``[D]`` gain, or ``[H, D]`` with a 3-D ``x`` (a gain per head: Qwen3's q and k
            norms as one call over the q and k heads of the qkv output), any float dtype
            (read as float32; the result stays in ``x.dtype`` whatever the weight's).
        eps: added to the mean square, ``>= 0``.
        residual: like ``x`` (same shape and dtype).
        out: where ``y`` goes (shape and dtype of ``x``; may be ``x`` itself); a new tensor
            if ``None``.
        residual_out: where ``h`` goes (shape and dtype of ``x``; may be ``residual`` or
            ``x``, not ``out``); a new tensor if ``None``. Needs ``residual``.
        weight_offset: added to the gain in float32: ``1.0`` for Gemma's ``(1 + weight)``.
        weight_first: multiply the gain in float32 and round once (Gemma, gpt-oss); the
            default rounds the normalized row to ``x.dtype`` first and then multiplies by the
            gain (Llama / Qwen / Mistral in transformers). Identical in float32.
        impl: ``"auto"``, ``"reference"`` or ``"triton"``.

    Arithmetic is float32 throughout.
    """
    if torch.compiler.is_compiling():
        # one opaque, mutating node (torch.ops.kv_kernels.rms_norm, registered in
        # kv_kernels.fused._ops); validation runs when the op executes
        y_buf = out if out is not None else torch.empty_like(x)
        h_buf = None
        if residual is not None:
            h_buf = residual_out if residual_out is not None else torch.empty_like(x)
        torch.ops.kv_kernels.rms_norm(
            x, weight, float(eps), residual, y_buf, h_buf, float(weight_offset),
            bool(weight_first), impl,
        )  # fmt: skip
        return y_buf if h_buf is None else (y_buf, h_buf)
    key = _fast.norm_key(
        x, weight, eps, residual, out, residual_out, weight_offset, weight_first, impl
    )
    entry = _fast.NORM.get(key)
    if entry is not None:  # validated before, alike in all the checks read (fused._fast)
        if out is not None or residual_out is not None:
            check_norm_overlaps(x, residual, out, residual_out)
        return _fast.launch_norm(
            x, weight, eps, residual, out, residual_out, weight_offset, weight_first, entry
        )
    x = _tensor("x", x, "[T, D] or [T, H, D]")
    weight = _tensor("weight", weight, "[D]")
    _float("x", x)
    if weight.dtype not in _FLOATS:
        raise TypeError(f"weight dtype {weight.dtype} must be one of {list(_FLOATS)}")
    if x.dim() not in (2, 3):
        raise ValueError(
            f"x has shape {tuple(x.shape)}; rms_norm takes [T, D] or [T, H, D] "
            "(reshape other leading dims into T)"
        )
    width = x.shape[-1]
    if not 1 <= width <= _MAX_NORM_WIDTH:
        raise ValueError(
            f"rms_norm: row width D={width} must be in [1, {_MAX_NORM_WIDTH}] (the kernel holds "
            "a row in registers); split wider rows"
        )
    per_head = x.dim() == 3 and tuple(weight.shape) == tuple(x.shape[1:])
    if not per_head and tuple(weight.shape) != (width,):
        heads = f" or [{x.shape[1]}, {width}] (a gain per head)" if x.dim() == 3 else ""
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}; expected [{width}] (x's last dim){heads}"
        )
    device = x.device
    _same_device("weight", weight, device)
    _unit_rows("weight", weight)
    _unit_rows("x", x)
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float))
        or not (math.isfinite(eps) and eps >= 0)
    ):
        raise ValueError(f"eps={eps!r} must be a finite float >= 0 (e.g. 1e-6)")
    if (
        isinstance(weight_offset, bool)
        or not isinstance(weight_offset, (int, float))
        or not (math.isfinite(weight_offset))
    ):
        raise ValueError(
            f"weight_offset={weight_offset!r} must be a finite float (1.0 for Gemma's 1 + w)"
        )
    if residual is None and residual_out is not None:
        raise ValueError("residual_out was given without residual; pass residual= too, or drop it")
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is None:
            continue
        t = _tensor(name, t, f"{list(x.shape)}")
        if tuple(t.shape) != tuple(x.shape) or t.dtype != x.dtype:
            raise ValueError(
                f"{name} is {t.dtype} {tuple(t.shape)}; it must match x: {x.dtype} "
                f"{tuple(x.shape)} (the op never converts silently)"
            )
        _same_device(name, t, device)
        _unit_rows(name, t)
    check_norm_overlaps(x, residual, out, residual_out)
    chosen = resolve_impl(impl, device, op="rms_norm")
    if chosen == "reference":
        from kv_kernels.fused.reference import rms_norm_reference

        y, h = rms_norm_reference(x, weight, float(eps), residual, weight_offset, weight_first)
        if out is not None:
            y = out.copy_(y)
        if residual is not None and residual_out is not None:
            h = residual_out.copy_(h)
    else:
        entry = _fast.NORM.put(key, Entry()) if key is not None else None
        return _fast.launch_norm(
            x, weight, eps, residual, out, residual_out, weight_offset, weight_first, entry
        )
    if residual is None:
        return y
    return y, h


# ---- silu_and_mul / gelu_tanh_and_mul -------------------------------------------------------------


def silu_and_mul(
    x: torch.Tensor, *, out: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[T, 2d]`` (the gate and up projections,
    stacked as a fused ``gate_up_proj`` writes them): ``[T, d]`` in ``x.dtype`` (or into
    ``out``), float32 inside, one launch. Any token stride, unit column stride."""
    return _act_and_mul("silu_and_mul", "silu", x, out, impl)


def gelu_tanh_and_mul(
    x: torch.Tensor, *, out: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """``gelu(x[..., :d], approximate="tanh") * x[..., d:]`` (Gemma's ``gelu_pytorch_tanh``
    MLP) for ``x`` ``[T, 2d]``; as :func:`silu_and_mul` otherwise."""
    return _act_and_mul("gelu_tanh_and_mul", "gelu_tanh", x, out, impl)


def _act_and_mul(
    op: str, act: str, x: torch.Tensor, out: torch.Tensor | None, impl: str
) -> torch.Tensor:
    if torch.compiler.is_compiling():  # (see rms_norm)
        y_buf = out if out is not None else x.new_empty(x.shape[0], x.shape[-1] // 2)
        torch.ops.kv_kernels.act_and_mul(x, y_buf, act, impl)
        return y_buf
    key = _fast.act_key(op, x, out, impl)
    entry = _fast.ACT.get(key)
    if entry is not None:  # validated before, alike in all the checks read (fused._fast)
        if out is not None and _overlap(out, x):
            raise ValueError(f"{op}: out overlaps x; the kernel reads x while writing out")
        return _fast.launch_act(x, out, act, entry)
    x = _tensor("x", x, "[T, 2d]")
    _float("x", x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(
            f"{op}: x has shape {tuple(x.shape)}; expected [T, 2d] (gate columns then up columns, "
            "an even width)"
        )
    _unit_rows("x", x)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    if out is not None:
        out = _tensor("out", out, f"[{num_tokens}, {d}]")
        if tuple(out.shape) != (num_tokens, d) or out.dtype != x.dtype:
            raise ValueError(
                f"{op}: out is {out.dtype} {tuple(out.shape)}; expected {x.dtype} "
                f"[{num_tokens}, {d}]"
            )
        _same_device("out", out, x.device)
        _unit_rows("out", out)
        if _overlap(out, x):
            raise ValueError(f"{op}: out overlaps x; the kernel reads x while writing out")
    chosen = resolve_impl(impl, x.device, op=op)
    if chosen == "reference":
        from kv_kernels.fused import reference

        fn = (
            reference.silu_and_mul_reference
            if act == "silu"
            else reference.gelu_tanh_and_mul_reference
        )
        y = fn(x)
        return out.copy_(y) if out is not None else y
    return _fast.launch_act(x, out, act, _fast.ACT.put(key, Entry()) if key is not None else None)


# ---- rotary embedding ------------------------------------------------------------------------------


def rope_cos_sin_cache(
    inv_freq: torch.Tensor,
    max_positions: int,
    *,
    scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``[max_positions, rotary_dim]`` table :func:`rotary_embedding` reads: row ``p`` is
    ``cat(cos(p * inv_freq), sin(p * inv_freq)) * scaling`` (``rotary_dim = 2 * len(inv_freq)``),
    computed in float32 like transformers and cast to ``dtype`` (float32 keeps the most bits;
    the model's dtype gives the bits of a model that rounds cos/sin before multiplying).
    ``scaling``: YaRN's attention factor (1 elsewhere); any rope scaling of the frequencies
    (linear, llama3, yarn) is already in ``inv_freq``."""
    inv_freq = _tensor("inv_freq", inv_freq, "[rotary_dim / 2]")
    if inv_freq.dim() != 1 or inv_freq.numel() == 0:
        raise ValueError(f"inv_freq has shape {tuple(inv_freq.shape)}; expected [rotary_dim / 2]")
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions={max_positions!r} must be an int >= 1")
    pos = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()
    freqs = pos[:, None] * inv_freq.float()[None, :]  # [max_positions, rotary_dim / 2]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling).to(dtype)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
    rotary_dim: int | None = None,
    impl: str = "auto",
    error_flag: torch.Tensor | None = None,
) -> None:
    """Rotate ``q`` and ``k`` in place by their tokens' positions (one launch for both).

    Args:
        positions: int64 or int32 ``[T]``; token ``t`` of ``q``/``k`` sits at ``positions[t]``.
            A negative position is padding: its rows are left as they are.
        q: ``[T', Hq, D]`` with ``T' >= T`` (the first ``T`` tokens are rotated; padded
            batches may be longer), float16 / bfloat16 / float32, unit last stride, any
            token/head strides (slices of a fused qkv projection).
        k: ``[T', Hk, D]`` like ``q`` (same dtype and ``D``), or ``None``.
        cos_sin_cache: ``[max_pos, rotary_dim]``, float: row ``p`` holds ``rotary_dim / 2``
            cosines then as many sines (:func:`rope_cos_sin_cache` builds it).
        is_neox: ``True``: column ``i`` pairs with ``i + rotary_dim / 2`` (Llama, Qwen,
            Mistral, NeoX's ``rotate_half``); ``False``: ``2i`` pairs with ``2i + 1`` (GPT-J,
            interleaved: GLM, DeepSeek's MLA rope).
        rotary_dim: the rotated leading columns (partial rotary); default: the cache's width.
            Even and ``<= D``; columns past it are left as they are.
        impl: ``"auto"``, ``"reference"`` or ``"triton"``.
        error_flag: optional int32 ``[1]`` on ``q``'s device; the Triton kernel adds the number
            of tokens whose position is ``>= max_pos`` (their rows are left unrotated).

    Positions ``>= max_pos`` raise ``ValueError`` when ``positions`` is on the CPU; on CUDA they
    are not checked here (a read-back would synchronize): such rows are left unrotated and
    counted in ``error_flag``.
    """
    if torch.compiler.is_compiling():  # (see rms_norm)
        rd = cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim
        torch.ops.kv_kernels.rotary_embedding(
            positions, q, k, cos_sin_cache, bool(is_neox), rd, impl, error_flag
        )
        return
    key = _fast.rope_key(positions, q, k, cos_sin_cache, is_neox, rotary_dim, impl, error_flag)
    entry = _fast.ROPE.get(key)
    if entry is not None:  # validated before, alike in all the checks read (fused._fast)
        _fast.launch_rope(positions, q, k, cos_sin_cache, is_neox, entry.static, error_flag, entry)
        return
    rotary_dim = _check_rope(positions, q, k, cos_sin_cache, rotary_dim)
    device = q.device
    check_error_flag(error_flag, device, op="rotary_embedding")
    chosen = resolve_impl(impl, device, op="rotary_embedding")
    if chosen == "reference":
        from kv_kernels.fused.reference import rotary_embedding_reference

        live = positions >= 0
        if positions.device.type == "cpu" and bool(live.all()):
            rotary_embedding_reference(positions, q, k, cos_sin_cache, is_neox, rotary_dim)
            return
        # padding (or, on CUDA, unchecked positions): rotate the live tokens only
        _reference_masked(positions, q, k, cos_sin_cache, is_neox, rotary_dim)
        return
    entry = _fast.ROPE.put(key, Entry(rotary_dim)) if key is not None else None
    _fast.launch_rope(positions, q, k, cos_sin_cache, is_neox, rotary_dim, error_flag, entry)


def _check_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int | None,
) -> int:
    """Check the RoPE inputs (:func:`rotary_embedding`'s rules); return ``rotary_dim``."""
    positions = _tensor("positions", positions, "[T]")
    q = _tensor("q", q, "[T, Hq, D]")
    cos_sin_cache = _tensor("cos_sin_cache", cos_sin_cache, "[max_pos, rotary_dim]")
    if positions.dtype not in (torch.int64, torch.int32) or positions.dim() != 1:
        raise ValueError(
            f"positions is {positions.dtype} {tuple(positions.shape)}; pass an int64 (or int32) "
            "[T] tensor"
        )
    if positions.numel() > 1 and positions.stride(0) != 1:
        raise ValueError(
            f"positions.stride(0)={positions.stride(0)}: the kernels read positions as one "
            "contiguous run; pass positions.contiguous()"
        )
    _float("q", q)
    if q.dim() != 3:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected [T, Hq, D]")
    num_tokens, head_size = positions.numel(), q.shape[-1]
    device = q.device
    _same_device("positions", positions, device)
    _same_device("cos_sin_cache", cos_sin_cache, device)
    for name, t in (("q", q), ("k", k)):
        if t is None:
            continue
        t = _tensor(name, t, "[T, H, D]")
        if t.dim() != 3 or t.shape[-1] != head_size or t.dtype != q.dtype:
            raise ValueError(
                f"{name} is {t.dtype} {tuple(t.shape)}; expected {q.dtype} [T', H, {head_size}] "
                "(q and k share dtype and head size)"
            )
        if t.shape[0] < num_tokens:
            raise ValueError(
                f"{name} has {t.shape[0]} tokens but positions has {num_tokens}; {name} may be "
                "longer (padded) but never shorter"
            )
        _same_device(name, t, device)
        _unit_rows(name, t)
    if k is not None and k.numel() and q.data_ptr() == k.data_ptr():
        # (slices of one qkv buffer interleave their spans, so only the same start is checked;
        # q and k must not share elements)
        raise ValueError("q and k start at the same element; pass q and k as separate heads")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.dtype not in _FLOATS:
        raise ValueError(
            f"cos_sin_cache is {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}; expected a "
            f"float [max_pos, rotary_dim] table (rope_cos_sin_cache builds it)"
        )
    _unit_rows("cos_sin_cache", cos_sin_cache)
    if rotary_dim is None:
        rotary_dim = cos_sin_cache.shape[1]
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim={rotary_dim} must be even, >= 2 and <= head_size={head_size}")
    if cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(
            f"cos_sin_cache has {cos_sin_cache.shape[1]} columns but rotary_dim={rotary_dim}; "
            "the table holds rotary_dim / 2 cosines then rotary_dim / 2 sines per position"
        )
    max_pos = cos_sin_cache.shape[0]
    if positions.device.type == "cpu" and num_tokens:
        top = int(positions.max())
        if top >= max_pos:
            raise ValueError(
                f"positions holds {top}, past the cos_sin_cache's {max_pos} rows; build the table "
                "for max_position_embeddings (or the longest context served)"
            )
    return rotary_dim


def _reference_masked(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rotary_dim: int,
) -> None:
    """The reference over the tokens whose position is inside the table (rows of the others are
    left as they are, as the kernel leaves them)."""
    from kv_kernels.fused.reference import rotary_embedding_reference

    num_tokens = positions.numel()
    live = (positions >= 0) & (positions < cos_sin_cache.shape[0])
    safe = torch.where(live, positions, torch.zeros_like(positions))
    q_new = q[:num_tokens].clone()
    k_new = None if k is None else k[:num_tokens].clone()
    rotary_embedding_reference(safe, q_new, k_new, cos_sin_cache, is_neox, rotary_dim)
    keep = live[:, None, None]
    q[:num_tokens] = torch.where(keep, q_new, q[:num_tokens])
    if k is not None and k_new is not None:
        k[:num_tokens] = torch.where(keep, k_new, k[:num_tokens])


# ---- RoPE fused into the cache write ----------------------------------------------------------------


def rope_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
    *,
    is_neox: bool = True,
    rotary_dim: int | None = None,
    impl: str = "auto",
    error_flag: torch.Tensor | None = None,
) -> None:
    """``rotary_embedding(positions, q, key, ...)`` then ``reshape_and_cache(key, value,
    kv_cache, slot_mapping, layout)`` in one launch: q and key are rotated in place, and the
    rotated K (with V) goes to the cache at each token's slot without a second read of key.

    Where the layout allows: an unquantized (``kv_quant="none"``), non-MLA cache (a quantized
    cache needs the per-row scales ``reshape_and_cache`` computes, MLA's rope columns sit inside
    the latent: call the two ops). The arguments are those of the two ops (``T =
    positions.numel() = slot_mapping.numel()``; a negative position leaves its rows unrotated,
    a negative slot writes nothing); ``error_flag`` counts both positions past the table and
    slots past the cache, on CUDA, where neither is read back.
    """
    if torch.compiler.is_compiling():  # (see rms_norm)
        rd = cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim
        torch.ops.kv_kernels.rope_and_cache(
            positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping,
            layout_json(layout), bool(is_neox), rd, impl, error_flag,
        )  # fmt: skip
        return
    key_ = _fast.rope_cache_key(
        positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping, layout, is_neox,
        rotary_dim, impl, error_flag,
    )  # fmt: skip
    entry = _fast.ROPE_CACHE.get(key_)
    if entry is not None:  # validated before, alike in all the checks read (fused._fast)
        _fast.launch_rope_cache(
            positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping, layout, is_neox,
            entry.static[0], error_flag, entry,
        )  # fmt: skip
        return
    from kv_kernels.reshape_and_cache.api import _validate as validate_cache_write

    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
    if layout.kv_quant is not KVQuantMode.NONE or layout.is_mla:
        raise ValueError(
            f"rope_and_cache: the fused write takes unquantized, non-MLA caches; this layout has "
            f"kv_quant={layout.kv_quant.value!r}, is_mla={layout.is_mla}: call rotary_embedding "
            "then reshape_and_cache"
        )
    rotary_dim = _check_rope(positions, q, key, cos_sin_cache, rotary_dim)
    validate_cache_write(key, value, kv_cache, slot_mapping, layout, None, None)
    if slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(
            f"slot_mapping.stride(0)={slot_mapping.stride(0)}: pass slot_mapping.contiguous()"
        )
    if slot_mapping.numel() != positions.numel():
        raise ValueError(
            f"slot_mapping has {slot_mapping.numel()} tokens but positions has "
            f"{positions.numel()}; pass one slot and one position per token"
        )
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but q is on {q.device}; move it")
    check_error_flag(error_flag, q.device, op="rope_and_cache")
    chosen = resolve_impl(impl, q.device, op="rope_and_cache")
    if chosen == "reference":
        # the definition: the two ops, one after the other
        from kv_kernels.reshape_and_cache.api import reshape_and_cache

        rotary_embedding(
            positions, q, key, cos_sin_cache, is_neox=is_neox, rotary_dim=rotary_dim,
            impl="reference",
        )  # fmt: skip
        reshape_and_cache(key, value, kv_cache, slot_mapping, layout, impl="reference")
        return
    # (the entry holds the layout in static: its id is in the key)
    entry = _fast.ROPE_CACHE.put(key_, Entry((rotary_dim, layout))) if key_ is not None else None
    _fast.launch_rope_cache(
        positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping, layout, is_neox,
        rotary_dim, error_flag, entry,
    )  # fmt: skip
