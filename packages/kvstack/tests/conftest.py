"""Shared test setup for kvstack."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_dynamo_for_gpu_tests(request: pytest.FixtureRequest) -> None:
    """GPU tests compile Flex for many tile/shape parametrizations in one process: each static
    graph counts against Dynamo's per-code-object recompile limit (64 inside our calls), which a
    whole test session passes although no single model or serving loop does. Start each GPU test
    from an empty Dynamo cache so a test's verdict does not depend on how many ran before it."""
    if request.node.get_closest_marker("gpu") is not None:
        import torch

        torch._dynamo.reset()
