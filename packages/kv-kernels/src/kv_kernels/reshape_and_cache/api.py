"""``reshape_and_cache``: write new tokens' K and V into a paged KV cache at their slots.

Validates every input, then dispatches on an explicit ``impl``: ``"reference"`` (torch, any device),
``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (triton for CUDA tensors,
reference for CPU ones). Nothing falls back silently: an impl that cannot run raises and says why.
"""

from __future__ import annotations

from typing import Any

import torch
from kv_spec import KVCacheLayout, KVQuantMode, to_torch_dtype

from kv_kernels import _call_cache, _op_calls
from kv_kernels._call_cache import CallCache, Entry, scalar_key, tensor_key
from kv_kernels._common import check_error_flag, check_scale, resolve_impl, scale_tensor

__all__ = ["reshape_and_cache"]

_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    *,
    impl: str = "auto",
    error_flag: torch.Tensor | None = None,
) -> None:
    """Write the first ``T = slot_mapping.numel()`` tokens of ``key``/``value`` into ``kv_cache``.

    Args:
        key: ``[T', H, head_size]`` with ``T' >= T`` (longer when padded for CUDA graphs); for MLA
            layouts the latent, ``[T', 1, head_size]``.
        value: ``[T', H, head_size_v]``; ``None`` for MLA layouts.
        kv_cache: the ``[B, H, N, C]`` layer view from :func:`kv_kernels.layer_view` (any strides).
        slot_mapping: int64 ``[T]``; ``slot = block * N + offset``, ``slot < 0`` is skipped.
        layout: the cache's :class:`~kv_spec.KVCacheLayout` (K goes to ``k_range``, V to ``v_range``).
        k_scale, v_scale: ``FP8_PER_TENSOR`` only (and required there): the cache stores
            ``x / scale``; a positive float, a 1-element (or 0-d) tensor, or a per-head ``[H]``
            float tensor on the cache's device. MLA takes ``k_scale`` only.
        impl: ``"auto"``, ``"reference"`` or ``"triton"``.
        error_flag: optional int32 ``[1]`` tensor on the cache's device; the Triton kernel adds
            the number of slots past the cache to it (they are never written), so a caller can
            check a CUDA slot mapping without a sync per call.

    Per-token-head modes compute one float32 scale per token and head for K and one for V
    (``absmax / qmax``), write the quantized rows and store the scales inline in ``scale_range``.

    Slot range: slots ``>= B * N`` raise ``ValueError`` when ``slot_mapping`` is on the CPU. A CUDA
    ``slot_mapping`` is not range-checked here, because reading it back would synchronize the
    stream on every call (and break CUDA-graph capture); the Triton kernel never writes outside
    the cache and leaves such slots unwritten, so check your slot mapping upstream (e.g. with
    ``compute_slot_mapping``, which produces in-range slots or -1).
    """
    if torch.compiler.is_compiling():
        # Inside torch.compile the registered custom op stands for the whole call (validation runs
        # when the op executes), so tracing sees one opaque, mutating node.
        _op_calls.reshape_and_cache_op(
            key, value, kv_cache, slot_mapping, layout, k_scale, v_scale, impl=impl,
            error_flag=error_flag,
        )  # fmt: skip
        return
    call_key = None
    if isinstance(kv_cache, torch.Tensor) and kv_cache.is_cuda:  # (only CUDA calls are kept)
        call_key = _call_key(
            key, value, kv_cache, slot_mapping, layout, k_scale, v_scale, impl, error_flag
        )
        entry = _CALLS.get(call_key) if call_key is not None else None
        if entry is not None:
            # validated before with inputs alike in all the checks read (kv_kernels._call_cache)
            k_scale_t = v_scale_t = None
            if k_scale is not None:
                k_scale_t = scale_tensor(_rescale(k_scale), kv_cache.device)
            if v_scale is not None:
                v_scale_t = scale_tensor(_rescale(v_scale), kv_cache.device)
            _triton_write()(
                key, value, kv_cache, slot_mapping, layout, k_scale_t, v_scale_t, error_flag,
                plan_slot=entry,
            )  # fmt: skip
            return
    k_scale_t, v_scale_t = _validate(key, value, kv_cache, slot_mapping, layout, k_scale, v_scale)
    chosen = _resolve_impl(impl, kv_cache)
    check_error_flag(error_flag, kv_cache.device, op="reshape_and_cache")
    if chosen == "reference":
        from kv_kernels.reshape_and_cache.reference import reshape_and_cache_reference

        reshape_and_cache_reference(
            key, value, kv_cache, slot_mapping, layout, k_scale_t, v_scale_t
        )
    else:
        entry = None
        if call_key is not None:
            entry = _CALLS.put(call_key, Entry(layout))  # (holds the layout: its id is in the key)
        _triton_write()(
            key, value, kv_cache, slot_mapping, layout, k_scale_t, v_scale_t, error_flag,
            plan_slot=entry,
        )  # fmt: skip


#: validated CUDA calls (kv_kernels._call_cache)
_CALLS = CallCache("reshape_and_cache")
_TRITON: list[Any] = []


def _triton_write() -> Any:
    """:func:`.triton.reshape_and_cache_triton` (imported on first use)."""
    if not _TRITON:
        from kv_kernels.reshape_and_cache.triton import reshape_and_cache_triton

        _TRITON.append(reshape_and_cache_triton)
    return _TRITON[0]


def _call_key(
    key: object,
    value: object,
    kv_cache: torch.Tensor,
    slot_mapping: object,
    layout: object,
    k_scale: object,
    v_scale: object,
    impl: object,
    error_flag: object,
) -> tuple[Any, ...] | None:
    """The call's key (kv_kernels._call_cache), or None when the cache cannot describe an input
    (then the full path runs and raises its own error). Slot values are not in it: on CUDA no
    check reads them (the kernel skips slots < 0 and never writes past the cache)."""
    if not _call_cache.fast_path_allowed():
        return None
    try:
        return (
            id(layout), tensor_key(key), tensor_key(value), tensor_key(kv_cache),
            tensor_key(slot_mapping), _scale_key(k_scale), _scale_key(v_scale),
            scalar_key(impl), tensor_key(error_flag),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def _scale_key(x: object) -> Any:
    # a tensor scale by its tensor key; a float by type and value (its check reads the value)
    return tensor_key(x) if isinstance(x, torch.Tensor) else scalar_key(x)


def _rescale(value: float | torch.Tensor) -> float | torch.Tensor:
    """A checked scale as :func:`kv_kernels._common.check_scale` returns it (on CUDA it reads
    only what the key holds: the float, or the tensor's shape, dtype and device)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(torch.float32).contiguous()
    return float(value)


def _resolve_impl(impl: str, kv_cache: torch.Tensor) -> str:
    chosen = resolve_impl(impl, kv_cache.device, op="reshape_and_cache")
    if chosen == "triton" and kv_cache.is_cuda and kv_cache.dtype == torch.float8_e4m3fn:
        capability = torch.cuda.get_device_capability(kv_cache.device)
        if capability < (8, 9):
            raise ValueError(
                f"reshape_and_cache: the Triton cache write cannot store float8_e4m3fn on "
                f"sm_{capability[0]}{capability[1]} (Triton has e4m3 from sm_89 on); use "
                "impl='reference' or an fp8_e5m2 cache"
            )
    return chosen


def _validate(
    key: torch.Tensor,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Check every input against ``layout``; return the scales as float32 tensors on the cache's
    device (or ``None``)."""
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
    for name, t in (("key", key), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    expected_cache = (
        layout.num_blocks,
        layout.num_kv_heads,
        layout.block_size,
        layout.content_size,
    )
    if tuple(kv_cache.shape) != expected_cache:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)} but the layout's [B, H, N, C] layer view is "
            f"{expected_cache}; pass layer_view(storage, layout, layer)"
        )
    cache_dtype = to_torch_dtype(layout.dtype)
    if kv_cache.dtype != cache_dtype:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} does not match layout dtype {layout.dtype}"
        )
    device = kv_cache.device

    if slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping dtype {slot_mapping.dtype} must be torch.int64 (slots of large caches "
            "overflow int32); pass slot_mapping.long()"
        )
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [T], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but kv_cache is on {device}")
    num_tokens = slot_mapping.numel()
    num_slots = layout.num_blocks * layout.block_size
    if slot_mapping.device.type == "cpu" and num_tokens:
        top = int(slot_mapping.max())
        if top >= num_slots:
            raise ValueError(
                f"slot_mapping holds slot {top}, past the cache's {num_slots} slots "
                f"(num_blocks={layout.num_blocks} x block_size={layout.block_size}); slots must be "
                "< num_blocks * block_size, or -1 for padding"
            )

    heads = layout.num_kv_heads
    _check_tokens("key", key, num_tokens, heads, layout.head_size, device)
    if layout.is_mla:
        if value is not None:
            raise ValueError(
                "value must be None for an MLA layout: key carries the latent [T, 1, head_size]"
            )
    else:
        if value is None:
            raise ValueError(
                f"value is None but the layout is not MLA; pass V as [T, {heads}, {layout.head_size_v}]"
            )
        _check_tokens("value", value, num_tokens, heads, layout.head_size_v, device)

    mode = layout.kv_quant
    inputs = [key] if value is None else [key, value]
    for name, t in zip(("key", "value"), inputs, strict=False):
        if mode is KVQuantMode.NONE:
            if t.dtype != cache_dtype:
                raise ValueError(
                    f"{name} dtype {t.dtype} differs from the unquantized cache dtype {cache_dtype}; "
                    f"cast it with .to({cache_dtype}) (the op never converts silently)"
                )
        elif t.dtype not in _FLOAT_INPUTS:
            raise ValueError(
                f"{name} dtype {t.dtype} must be one of {_FLOAT_INPUTS} to quantize into {layout.dtype}"
            )

    if mode is KVQuantMode.FP8_PER_TENSOR:
        k_t = _check_scale("k_scale", k_scale, heads, device)
        if layout.is_mla:
            if v_scale is not None:
                raise ValueError(
                    "v_scale must be None for an MLA layout (the latent takes k_scale)"
                )
            v_t = None
        else:
            v_t = _check_scale("v_scale", v_scale, heads, device)
        return k_t, v_t
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None:
            raise ValueError(
                f"{name} was given but the layout's kv_quant={mode.value!r} takes no external scale "
                "(only fp8_per_tensor does; per-token-head modes compute theirs); drop it"
            )
    return None, None


def _check_tokens(
    name: str, t: torch.Tensor, num_tokens: int, heads: int, size: int, device: torch.device
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor [T, {heads}, {size}], got {type(t).__name__}"
        )
    if t.dim() != 3 or tuple(t.shape[1:]) != (heads, size):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected [T', {heads}, {size}] for this layout"
        )
    if t.shape[0] < num_tokens:
        raise ValueError(
            f"{name} has {t.shape[0]} tokens but slot_mapping has {num_tokens}; {name} may be "
            "longer (padded) but never shorter"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but kv_cache is on {device}")


def _check_scale(
    name: str, scale: float | torch.Tensor | None, heads: int, device: torch.device
) -> torch.Tensor:
    """A float32 tensor of 1 or ``heads`` elements on ``device``."""
    if scale is None:
        raise ValueError(
            f"{name} is required for an fp8_per_tensor cache (the cache stores x / {name}); pass "
            f"a float, a 1-element tensor or a per-head [{heads}] tensor"
        )
    return scale_tensor(check_scale(name, scale, num_heads=heads, device=device), device)
