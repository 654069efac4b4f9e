"""Tensors on a CUDA device other than the current one are refused by name.

Triton launches on the current device: a call with ``cuda:1`` tensors while ``cuda:0`` is current
either fails inside Triton ("Pointer argument cannot be accessed") or, with peer access enabled,
runs on the wrong GPU off the tensors' stream. ``resolve_impl`` (every op's first check) says
which device is current and how to switch. The device query is stubbed: this runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from kv_kernels import _launch
from kv_kernels._common import resolve_impl


def test_another_cuda_device_than_the_current_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    with pytest.raises(
        ValueError,
        match=r"on cuda:1 but the current CUDA device is cuda:0.*torch\.cuda\.device\(1\)",
    ):
        resolve_impl("auto", torch.device("cuda", 1), op="paged_attention")
    with pytest.raises(ValueError, match="current CUDA device"):
        resolve_impl("triton", torch.device("cuda", 1), op="rms_norm")
    # the current device, and the reference on any device, pass
    assert resolve_impl("auto", torch.device("cuda", 0), op="paged_attention") == "triton"
    assert resolve_impl("reference", torch.device("cuda", 1), op="paged_attention") == "reference"


def test_the_device_of_the_thread_is_what_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensors pass once their device is current (what ``torch.cuda.device`` does)."""
    monkeypatch.setattr(_launch, "_current_device", lambda: 1)
    assert resolve_impl("auto", torch.device("cuda", 1), op="paged_attention") == "triton"
    with pytest.raises(ValueError, match="on cuda:0 but the current CUDA device is cuda:1"):
        resolve_impl("auto", torch.device("cuda", 0), op="paged_attention")
