"""Run the engine's work with its CUDA device current, whichever device the caller had current.

Triton launches on the *current* CUDA device and its current stream, and so do CUDA graphs,
events, streams and the graph memory pool: an engine on ``cuda:1`` called from a thread whose
current device is ``cuda:0`` (every thread starts there) would launch its kernels into the
other device's context. Found on two H200s: a decode engine on ``cuda:1`` beside a prefill
engine on ``cuda:0`` failed in its first step ("Pointer argument cannot be accessed from
Triton"); with peer access enabled the same launch would instead have run on the wrong GPU,
unordered with the engine's stream. So the engine's entry points switch to the engine's device
for their duration (torch's own ``torch.cuda.device`` guard) and back, as vLLM's CUDA ops do
with their device guards. Costs nothing where the device is already current.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["device_context", "on_built_device", "on_device"]

F = TypeVar("F", bound=Callable[..., Any])


def device_context(device: object) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` where ``device`` is a CUDA device other than the current
    one; a no-op context otherwise (the CPU, the current device, or a value that is not a device:
    the caller's own argument check reports that)."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return contextlib.nullcontext()
    if not isinstance(device, torch.device) or device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def on_device(method: F) -> F:
    """Decorate a method of an object with a ``device`` attribute: the call runs with that device
    current (:func:`device_context`)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with device_context(self.device):
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def on_built_device(init: F) -> F:
    """Decorate ``__init__(self, ..., runner=None, device=...)``: it runs with the device it
    builds on current -- ``runner.device`` when a runner is given, else the ``device`` keyword
    (weights, the cache, kernel builds and the CUDA graphs' memory pool land there)."""

    @functools.wraps(init)
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        runner = kwargs.get("runner")
        device = getattr(runner, "device", None) if runner is not None else kwargs.get("device")
        with device_context(device):
            init(self, *args, **kwargs)

    return run  # type: ignore[return-value]
