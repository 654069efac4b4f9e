"""An engine on a CUDA device other than the current one (``kvstack.engine._device``).

Found on two H200s: a decode engine on ``cuda:1`` (the disaggregated benchmark's consumer) failed
in its first step, because Triton, CUDA graphs and events act on the *current* device, which is
``cuda:0`` in every thread that did not set one. The engine now makes its device current in each
entry point. On the CPU the tests check that plumbing (which calls enter which device) with the
device query stubbed; on two GPUs (marked ``gpu``) an engine on ``cuda:1``, called while
``cuda:0`` is current, must give the tokens of an engine on ``cuda:0``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvstack.engine import _device
from kvstack.engine.engine import LLMEngine
from kvstack.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 40], [99] * 20]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 9, 4)]


def engine_of(model_dir: Path, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(
        block_size=4, num_blocks=80, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8
    )
    args.update(kw)
    return LLMEngine(model_dir, **args)


def test_device_context_switches_only_to_another_cuda_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    other = _device.device_context("cuda:1")
    assert isinstance(other, torch.cuda.device) and other.idx == 1
    for same in (
        "cuda:0",
        torch.device("cuda", 0),
        "cpu",
        torch.device("cpu"),
        None,
        3,
        "nonsense",
    ):
        assert isinstance(_device.device_context(same), contextlib.nullcontext), same
    # "cuda" without an index means the current device: nothing to switch
    assert isinstance(_device.device_context("cuda"), contextlib.nullcontext)


def test_planted_a_guard_that_never_switches_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails for a guard that ignores the device (the bug this file is about)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_device, "device_context", lambda device: contextlib.nullcontext())
    with pytest.raises(AssertionError):
        test_device_context_switches_only_to_another_cuda_device(monkeypatch)


def _record_entries(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    real = _device.device_context

    @contextlib.contextmanager
    def recording(device: object) -> Iterator[None]:
        seen.append(device)
        with real(device):
            yield

    monkeypatch.setattr(_device, "device_context", recording)
    return seen


def test_entry_points_run_on_the_engines_device(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _record_entries(monkeypatch)
    engine = engine_of(llama_dir, device="cpu")
    assert seen == ["cpu"], "the constructor builds on the device it was given"
    seen.clear()
    engine.add_request("a", PROMPTS[0], PARAMS[0])
    engine.step()
    engine.abort_request("a")
    assert seen == [engine.device] * 3
    assert engine.device == engine.runner.device
    # A runner given instead of a device: the runner's device is the one made current.
    seen.clear()
    LLMEngine(runner=engine.runner)
    assert seen == [engine.runner.device]


# The planted twin of the test above: with the decorators gone, nothing records.
def test_planted_an_undecorated_step_is_caught(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _record_entries(monkeypatch)
    engine = engine_of(llama_dir, device="cpu")
    monkeypatch.setattr(LLMEngine, "step", LLMEngine.step.__wrapped__)  # type: ignore[attr-defined]
    seen.clear()
    engine.add_request("a", PROMPTS[0], PARAMS[0])
    engine.step()
    assert seen == [engine.device], "only add_request entered the device"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_engine_on_the_second_device_matches_the_first(llama_dir: Path) -> None:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.cuda.set_device(0)
        first = [
            c.token_ids for c in engine_of(llama_dir, device="cuda:0").generate(PROMPTS, PARAMS)
        ]
        second_engine = engine_of(llama_dir, device="cuda:1")  # built while cuda:0 is current
        assert torch.cuda.current_device() == 0
        second = [c.token_ids for c in second_engine.generate(PROMPTS, PARAMS)]
        assert torch.cuda.current_device() == 0, "the engine restores the caller's device"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    graphs = second_engine.runner.graphs
    assert graphs is not None and graphs.num_replays > 0, "the decode steps replayed graphs"
    assert second == first
