"""Test setup: the Triton interpreter on GPU-less machines, and a fixture that skips Triton
tests where the interpreter cannot run.

The default CPU run is CI-sized: each compiled-Flex feature once (inductor's CPU template takes
~20-45 s a graph on two cores), the sink and recompile matrices pairwise. The rest of those
matrices is marked ``slow``; hypothesis tests take ``KVSTACK_HYPOTHESIS_EXAMPLES``::

    .venv/bin/python -m pytest packages/kv-backends/tests -m "slow and not gpu" -q
    KVSTACK_HYPOTHESIS_EXAMPLES=500 .venv/bin/python -m pytest packages/kv-backends/tests -q
"""

from __future__ import annotations

import os

import torch

# The Triton interpreter decides at kernel-definition time; set it before anything imports
# kv_kernels' Triton modules, and only where there is no GPU (the GPU run uses real kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from kv_backends.testing import fresh_dynamo_for_gpu_test


@pytest.fixture
def triton_interpreter() -> None:
    """Skip unless the Triton interpreter can run here (CPU tests need numpy for it)."""
    if torch.cuda.is_available():
        return
    pytest.importorskip("numpy", reason="the Triton interpreter (TRITON_INTERPRET=1) needs numpy")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET was not 1 when this process started")


@pytest.fixture(autouse=True)
def _fresh_dynamo_for_gpu_tests(request: pytest.FixtureRequest) -> None:
    """An empty Dynamo cache for each GPU test (see kv_backends.testing.fresh_dynamo_for_gpu_test)."""
    fresh_dynamo_for_gpu_test(request.node)
