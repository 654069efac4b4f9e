"""``skinny_linear``: validate, pick a config, dispatch (Triton on CUDA, the reference on the CPU).

Nothing falls back silently: a shape the kernel does not take (``M > 256``) raises and says to
use torch's matmul; ``impl="triton"`` on a CPU tensor without the interpreter raises.
"""

from __future__ import annotations

import torch

from kv_kernels._call_cache import CallCache, Entry, fast_path_allowed, scalar_key, tensor_key
from kv_kernels._common import resolve_impl
from kv_kernels.gemm.configs import MAX_M, GemmConfig, check_config, pick_config

__all__ = ["skinny_linear", "supports", "unsupported_reason"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
#: validated CUDA calls by what the checks and the launch read (kv_kernels._call_cache): a
#: decode step calls each projection alike layer after layer, so the checks run once per shape
_CALLS = CallCache("skinny_linear")


def _call_key(x: object, weight: object, bias: object, out: object, config: object,
              impl: object) -> tuple[object, ...] | None:  # fmt: skip
    """The call cache's key (None: not a CUDA call, the cache off, or an input no key covers)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and fast_path_allowed()):
        return None
    return _key_of(x, weight, bias, out, config, impl)


def _key_of(x: object, weight: object, bias: object, out: object, config: object,
            impl: object) -> tuple[object, ...] | None:  # fmt: skip
    """Every tensor's :func:`tensor_key`, the config by its type and each field's type and
    value (16 and 16.0 are not one config), the impl; None for what no key describes."""
    try:
        cfg = None if config is None else (type(config), *map(scalar_key, config))  # type: ignore[call-overload]
        return (
            tensor_key(x), tensor_key(weight), tensor_key(bias), tensor_key(out), cfg,
            scalar_key(impl),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def _check_out_overlaps(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> None:  # fmt: skip
    """Addresses, so run per call (never part of a cached decision)."""
    for name, src in (("x", x), ("weight", weight), ("bias", bias)):
        if src is not None and _overlaps(out, src):
            raise ValueError(f"out overlaps {name} in memory; pass a separate out buffer")


def unsupported_reason(m: int, n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why ``skinny_linear`` would refuse an ``[m, k] x [n, k]^T`` product of ``dtype``, or
    ``None`` when it takes it (the engine's predicate before it routes a projection here)."""
    if dtype not in _FLOATS:
        return f"dtype {dtype} is not one of {list(_FLOATS)}"
    if not 0 <= m <= MAX_M:
        return (
            f"M={m} tokens is outside [0, {MAX_M}]: past {MAX_M} the GEMM is compute-bound; "
            "use torch's matmul (F.linear)"
        )
    if n < 1 or k < 1:
        return f"N={n} and K={k} must be >= 1"
    return None


def supports(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether ``skinny_linear`` takes ``x [m, k]``, ``weight [n, k]`` of ``dtype``."""
    return unsupported_reason(m, n, k, dtype) is None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of ``a`` and ``b`` intersect (conservative: spans, not elements)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:  # [first byte, one past the last byte)
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``y = x @ weight.T + bias`` for a few tokens (``nn.Linear``'s product), float32 accumulate.

    Args:
        x: ``[M, K]``, ``0 <= M <= 256``, bfloat16 / float16 (float32 too: CPU tests, IEEE dot);
            any strides.
        weight: ``[N, K]`` as ``nn.Linear`` stores it, ``x``'s dtype and device; any strides.
        bias: ``[N]`` of any float dtype (added in float32 before the one rounding), or None.
        config: a :class:`~kv_kernels.gemm.GemmConfig` to use instead of the table's (the
            benchmark's sweep); checked against its bounds and sm_90's shared memory.
        out: ``[M, N]`` of ``x``'s dtype to write into (any strides, not overlapping an
            input, no two elements at one address); a new contiguous tensor if None.
        impl: ``"auto"`` (Triton for CUDA tensors, the reference on the CPU), ``"reference"``
            or ``"triton"`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``).

    Returns ``out``: ``[M, N]`` in ``x``'s dtype. Deterministic: with ``split_k > 1`` the K
    slices' float32 partials are summed in a fixed order by a second kernel.
    """
    key = _call_key(x, weight, bias, out, config, impl)
    entry = _CALLS.get(key)
    if entry is not None:  # alike a validated call in everything the checks read
        if out is None:
            out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        else:
            _check_out_overlaps(out, x, weight, bias)
        if entry.static is None:  # (M = 0)
            return out
        from kv_kernels.gemm.triton import launch_skinny_linear

        return launch_skinny_linear(x, weight, bias, out, entry.static)
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            shape = "[M, K]" if name == "x" else "[N, K] (nn.Linear's layout)"
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; skinny_linear takes {name} {shape}"
            )
    m, k = x.shape
    n, kw = weight.shape
    if kw != k:
        raise ValueError(
            f"weight has K={kw} columns but x has K={k}; weight must be [N, K] as nn.Linear "
            "stores it (pass weight, not weight.T)"
        )
    if weight.dtype != x.dtype:
        raise TypeError(
            f"weight dtype {weight.dtype} != x dtype {x.dtype}; the kernel never converts: cast one"
        )
    reason = unsupported_reason(m, n, k, x.dtype)
    if reason is not None:
        raise ValueError(f"skinny_linear: {reason}")
    device = x.device
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device} but x is on {device}; move it")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [{n}] (weight's N)")
        if bias.dtype not in _FLOATS:
            raise TypeError(f"bias dtype {bias.dtype} must be one of {list(_FLOATS)}")
        if bias.device != device:
            raise ValueError(f"bias is on {bias.device} but x is on {device}; move it")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (m, n) or out.dtype != x.dtype:
            raise ValueError(
                f"out is {out.dtype} {tuple(out.shape)}; it must be {x.dtype} [{m}, {n}] "
                "(x's dtype; the op never converts)"
            )
        if out.device != device:
            raise ValueError(f"out is on {out.device} but x is on {device}; move it")
        if any(st == 0 and sz > 1 for sz, st in zip(out.shape, out.stride(), strict=True)):
            raise ValueError(
                f"out has stride {out.stride()} with a 0 over a dim of size > 1 (an expanded "
                "tensor: several results at one address); pass a dense out"
            )
        _check_out_overlaps(out, x, weight, bias)
    elem = x.element_size()
    cfg = check_config(config, elem_bytes=elem) if config is not None else None
    chosen = resolve_impl(impl, device, op="skinny_linear")
    if chosen == "reference":
        from kv_kernels.gemm.reference import skinny_linear_reference

        y = skinny_linear_reference(x, weight, bias)
        return out.copy_(y) if out is not None else y
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0:
        if key is not None:
            _CALLS.put(key, Entry(None))
        return out
    if cfg is None:
        cfg = pick_config(m, n, k, elem)
    if key is not None:
        _CALLS.put(key, Entry(cfg))
    from kv_kernels.gemm.triton import launch_skinny_linear

    return launch_skinny_linear(x, weight, bias, out, cfg)
