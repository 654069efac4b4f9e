"""The rules every op shares, each written once: which implementation runs, how the layout travels
through a custom-op schema, and how a dequant scale is checked and shaped.

Nothing here imports an op module, so every ``api.py`` and ``_ops.py`` can import it without a
cycle.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from typing import Any

import torch
from kv_spec import KVCacheLayout

from kv_kernels import _launch

__all__ = [
    "IMPLS",
    "ScaleArg",
    "check_error_flag",
    "check_scale",
    "host_validation_requested",
    "layout_from_json",
    "layout_json",
    "resolve_impl",
    "row_align",
    "scale_tensor",
    "tma_addressable",
    "triton_interpreting",
]

#: The implementations every op accepts: ``auto`` is Triton for CUDA tensors, the reference on the CPU.
IMPLS = ("auto", "reference", "triton")

ScaleArg = float | torch.Tensor | None


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET`` truthy, as Triton reads
    it): then ``impl="triton"`` also runs on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def host_validation_requested() -> bool:
    """Debug mode: ``KV_KERNELS_VALIDATE=1`` makes every op check index values on the host even
    for CUDA tensors (one device sync per call; never inside CUDA-graph capture)."""
    return os.environ.get("KV_KERNELS_VALIDATE", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_impl(
    impl: object, device: torch.device, *, op: str, others: Iterable[torch.Tensor] = ()
) -> str:
    """The one implementation resolver: ``"reference"`` or ``"triton"`` for tensors on ``device``.

    ``others`` are tensors a Triton kernel would address besides ``device``'s (block-copy buffers):
    on CUDA each must be on ``device`` or in pinned host memory; under the interpreter on the CPU.
    Raises ``ValueError`` naming the op, the value and the valid values; never falls back.
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(
            f"{op}: impl={impl!r} is not a valid implementation; pick one of {list(IMPLS)} "
            "('auto' runs Triton for CUDA tensors and the torch reference on the CPU)"
        )
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "reference"
    if impl == "reference":
        return impl
    if device.type == "cuda":
        current = _launch._current_device()  # (Triton's launch device; stubbed in CPU tests)
        if device.index is not None and device.index != current:
            # Triton launches on the current device: these pointers belong to another context
            # (an error there, or with peer access a launch on the wrong GPU, off its stream).
            raise ValueError(
                f"{op}: the tensors are on {device} but the current CUDA device is cuda:{current}; "
                f"Triton launches on the current device: call under `with torch.cuda.device("
                f"{device.index})` (or torch.cuda.set_device({device.index}) in this thread)"
            )
        for t in others:
            if t.device == device or (t.device.type == "cpu" and t.is_pinned()):
                continue
            kind = "pageable CPU" if t.device.type == "cpu" else str(t.device)
            raise ValueError(
                f"{op}: impl='triton' addresses every tensor from the kernel, so they must be on "
                f"{device} or in pinned host memory (torch.empty(..., pin_memory=True)); got a {kind} "
                "tensor: pin it or use impl='reference'"
            )
        return impl
    if not triton_interpreting():
        raise ValueError(
            f"{op}: impl='triton' needs CUDA tensors (got {device.type}); use impl='reference' on "
            "the CPU, or set TRITON_INTERPRET=1 before the first import of kv_kernels"
        )
    for t in others:
        if t.device.type != "cpu":
            raise ValueError(
                f"{op}: under the Triton interpreter every tensor must be on the CPU, got {t.device}"
            )
    return impl


def check_error_flag(flag: object, device: torch.device, *, op: str) -> torch.Tensor | None:
    """The optional device-side error counter every kernel op takes: an int32 tensor of one
    element on ``device`` (the caller zeroes it, the kernels add to it, the caller reads it when a
    sync is cheap: a nonzero value means some index was out of range and was skipped)."""
    if flag is None:
        return None
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.int32 or flag.numel() != 1:
        got = f"{flag.dtype} {tuple(flag.shape)}" if isinstance(flag, torch.Tensor) else type(flag)
        raise ValueError(
            f"{op}: error_flag must be an int32 tensor of one element, e.g. "
            f"torch.zeros(1, dtype=torch.int32, device={str(device)!r}); got {got}"
        )
    if flag.device != device:
        raise ValueError(f"{op}: error_flag is on {flag.device}; put it on {device}")
    return flag


# ---- the layout in custom-op schemas ---------------------------------------------------------------


def layout_json(layout: KVCacheLayout) -> str:
    """The layout as the JSON string the custom-op schemas carry (``layout_from_json`` reads it).

    Written with an f-string over the fields rather than ``layout.to_json()``: under torch.compile
    dynamo folds attribute reads and string formatting of constants into one constant string,
    while it cannot trace ``json.dumps``. Every field is an int, a bool or a plain identifier, so no
    escaping is needed; ``KVCacheLayout.from_json`` accepts it (a test checks the round trip and
    that it equals ``to_json()`` as a value).
    """
    return (
        f'{{"order":"{layout.order.value}","num_layers":{layout.num_layers},'
        f'"num_blocks":{layout.num_blocks},"num_kv_heads":{layout.num_kv_heads},'
        f'"block_size":{layout.block_size},"head_size":{layout.head_size},'
        f'"head_size_v":{layout.head_size_v},"dtype":"{layout.dtype}",'
        f'"kv_quant":"{layout.kv_quant.value}","is_mla":{"true" if layout.is_mla else "false"},'
        f'"page_size_bytes":{layout.page_size_bytes}}}'
    )


@functools.lru_cache(maxsize=256)
def layout_from_json(text: str) -> KVCacheLayout:
    """Parse a schema's layout once per distinct JSON (layouts are frozen values)."""
    return KVCacheLayout.from_json(text)


# ---- dequant scales ---------------------------------------------------------------------------------


def check_scale(
    name: str, value: object, *, num_heads: int, device: torch.device
) -> float | torch.Tensor:
    """Check one fp8 dequant scale: a finite positive float, or a floating tensor of 1 element
    (0-d or ``[1]``) or ``[num_heads]`` (per kv head) on ``device``.

    Returns the float, or the tensor as float32 ``[1]`` / ``[num_heads]``. Tensor values are
    checked when the tensor is on the CPU (on CUDA that would synchronize).
    """
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")
        if value.dim() > 1 or value.numel() not in (1, num_heads):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; pass a float, a 1-element tensor (per "
                f"tensor) or a per-head [{num_heads}] tensor (one per kv head)"
            )
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the cache is on {device}; move it")
        if value.device.type == "cpu" and not bool((torch.isfinite(value) & (value > 0)).all()):
            raise ValueError(f"{name} must be finite and > 0, got {value.tolist()}")
        return value.reshape(-1).to(torch.float32).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value} must be finite and > 0 (the dequant multiplier)")
    return float(value)


def scale_tensor(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A checked scale as a float32 tensor on ``device`` (``torch.full``: a fill kernel, no
    host-to-device copy and nothing to synchronize)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def row_align(strides: Iterable[int]) -> int:
    """The alignment (elements, <= 16) a Triton kernel may assume of every page, head and token
    offset built from ``strides`` (a cache's block, head and token strides), for when Triton
    cannot see it: a stride that is not a multiple of 16 (per-token-head rows of ``2 * 128 + 8``
    bytes) makes Triton move the rows byte by byte (H200: 0.17 of the copy bandwidth), while the
    strides' gcd still proves 8-byte rows. 1 when all are multiples of 16 (Triton specializes
    them itself, and the compiled variant stays the same)."""
    align = math.gcd(16, *strides)
    return 1 if align == 16 else align


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``t`` as it is: a unit last stride, a 16-byte
    aligned base and every other stride a multiple of 16 bytes (else a kernel gathers by
    pointers)."""
    es = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(st * es % 16 == 0 for st in t.stride()[:-1])
    )


def require_unit_rows(kernel: str, tensors: dict[str, torch.Tensor]) -> None:
    """A ``ValueError`` naming the first of ``tensors`` whose last dimension is strided: ``kernel``
    (e.g. "the sm_90 decode kernel") reads rows of unit stride."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}.stride(-1)={t.stride(-1)}: {kernel} reads rows of unit stride; pass "
                f"{name} with a contiguous last dimension"
            )


def sm90_gluon_allowed(
    kind: str,
    *,
    arch: int,
    compiled: bool,
    q_dtype: torch.dtype,
    group: int,
    scale: float,
    features: dict[str, Any],
    unserved: tuple[str, ...],
    aligned_rows: bool = True,
    groups: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> bool:
    """What every sm_90 Gluon paged-attention kernel (``kind`` "prefill" / "decode" / "mla")
    needs before its own rule: kernels run compiled (Gluon has no interpreter), exactly sm_90
    (later chips lack its MMAs), ``KV_KERNELS_SM90_<KIND>`` is not "0", 16-bit queries, a GQA
    group in ``groups`` (1-16 by default; MLA: 64 or 128 heads over its latent), a positive
    scale, ``aligned_rows`` (unit-stride rows and a 16-byte-aligned cache: its copies move 8-16
    bytes at a time), and none of ``unserved`` in ``features``."""
    return (
        compiled
        and arch == 90
        and os.environ.get(f"KV_KERNELS_SM90_{kind.upper()}", "1") != "0"
        and q_dtype in (torch.bfloat16, torch.float16)
        and group in groups
        and scale > 0
        and aligned_rows
        and not any(features.get(k) for k in unserved)
    )
