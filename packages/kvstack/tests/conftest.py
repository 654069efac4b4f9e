"""Shared test setup for kvstack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_backends.testing import fresh_dynamo_for_gpu_test
from kvstack.demo import write_random_checkpoint

#: A tiny random-weight Llama (2 layers, GQA 4/2, head 16) for tests that need any real model.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "eos_token_id": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of :data:`TINY_LLAMA` (torch + safetensors only), one per test module."""
    return write_random_checkpoint(tmp_path_factory.mktemp("llama"), TINY_LLAMA)


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
