"""No Triton kernel is compiled while the engine serves (issue 32: "kernels for the served shapes
are compiled at startup, not inside the first requests"). Every compile after ``LLMEngine(...)``
returned is counted by Triton's JIT hook while requests of many lengths arrive, decode, mix and
finish: steps of 1 to 9 rows, token counts on and off the multiples of 16 that Triton
specializes integer arguments on. An H200 mixed step took 93-133 ms instead of ~32 when the
slot-mapping kernel compiled a new specialization in the middle of serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kvstack.engine.engine import LLMEngine
from kvstack.engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

LENGTHS = [1, 2, 5, 16, 17, 31, 32, 33, 47]


def _compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the Triton kernels compiled from now on (the JIT's pre-compile hook)."""
    knobs = pytest.importorskip("triton").knobs
    seen: list[str] = []

    def hook(*, repr: str, **_: Any) -> bool:  # (Triton passes repr=)
        seen.append(repr.split("[", 1)[0])
        return False  # compile as usual

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    return seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_compiles_no_kernel_after_startup(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(
        llama_dir, device="cuda", block_size=16, num_blocks=64, max_model_len=128,
        max_num_batched_tokens=128, max_num_seqs=16,
    )  # fmt: skip
    seen = _compiles(monkeypatch)
    g = torch.Generator().manual_seed(0)
    for wave in range(3):  # arrivals while earlier requests decode: mixed steps, then decodes
        for i, n in enumerate(LENGTHS[wave::3]):
            prompt = torch.randint(0, 100, (n,), generator=g).tolist()
            engine.add_request(f"{wave}-{i}", prompt, SamplingParams(max_new_tokens=6 + i))
        for _ in range(3):
            engine.step()
    while engine.has_unfinished:
        engine.step()
    assert seen == [], f"compiled while serving: {seen}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_planted_a_kernel_compiled_while_serving_is_caught(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook sees compiles: a kernel first launched after startup is counted (a new Triton
    function, so nothing of it is cached in this process)."""
    import triton
    import triton.language as tl

    LLMEngine(
        llama_dir, device="cuda", block_size=16, num_blocks=64, max_model_len=128,
        max_num_batched_tokens=128,
    )  # fmt: skip
    seen = _compiles(monkeypatch)

    @triton.jit
    def _planted(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(8, device="cuda")
    _planted[(1,)](x, 8, BLOCK=8)
    assert [name.rsplit(".", 1)[-1] for name in seen] == ["_planted"], seen
