"""Shared test setup for kvstack."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kv_backends.testing import fresh_dynamo_for_gpu_test


@pytest.fixture(autouse=True)
def _fresh_dynamo_for_gpu_tests(request: pytest.FixtureRequest) -> None:
    """An empty Dynamo cache for each GPU test (see kv_backends.testing.fresh_dynamo_for_gpu_test)."""
    fresh_dynamo_for_gpu_test(request.node)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    Tiny tensors: OpenMP workers only add wake-up latency, and on a busy 2-core CI machine a
    descheduled worker stalls every op (greedy generation measured 60x slower with 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
