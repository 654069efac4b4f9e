"""The engine against transformers, token for token, on a continuous-batching schedule.

For each architecture of the registry (:data:`kvstack.engine.archs.FAMILIES`) a tiny random-weight model is built by
transformers itself and saved as safetensors; the kvstack engine serves it with requests that
arrive at different steps, share prompt prefixes (prefix-cache hits), are prefilled in chunks
under a small token budget, and outgrow a tiny pool (at least one preemption, resumed from a
prefix hit). DeepSeek-V3 caches its MLA latent and attends the prefill rows of a step over
decompressed K/V (prefix hits and earlier chunks read back from the latent cache), its decode
rows absorbed (:mod:`kvstack.engine.mla_prefill`). Every request's greedy tokens must equal
transformers' ``generate`` (no EOS), and
every step's logits must agree within ``LOGIT_ATOL`` (float32 on the CPU: the paged, chunked
computation sums in a different order than transformers' dense one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvstack.engine.archs import FAMILIES
from kvstack.engine.engine import LLMEngine
from kvstack.engine.runner import ModelRunner
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.scheduler import SchedulerOutput
from kvstack.engine.testing import make_hf_checkpoint

#: float32 logits of order 1-10: 1e-3 is ~1e-4 relative, far below any real disagreement
#: (a wrong page, position or window moves logits by O(1)).
LOGIT_ATOL = 1e-3
MAX_NEW = 8
MAX_MODEL_LEN = 64
BUDGET = 16  # tokens per step: prompts of 15-26 tokens are prefilled in chunks


def _workload(vocab: int) -> list[tuple[int, list[int]]]:
    """(arrival step, prompt): a 12-token shared prefix, different tails, one exact repeat."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (12,), generator=g).tolist()
    tails = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 14, 7, 10)]
    prompts = [shared + t for t in tails]
    other = torch.randint(0, vocab, (9,), generator=g).tolist()
    other[0] = other[4] = 0  # id 0 is a real token (the oracle must not take it for padding)
    return [
        (0, prompts[0]),
        (0, prompts[1]),
        (2, prompts[2]),
        (2, other),
        (3, prompts[3]),
        (6, prompts[1]),
    ]


def _hf_reference(
    model_dir: Path, prompts: list[list[int]]
) -> list[tuple[list[int], torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            res = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # id 0 is a token here, not padding
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = res.sequences[0, len(p) :].tolist()
            out.append((tokens, torch.cat([step.float() for step in res.logits])))
    return out


def _tiny_pool_runner(model_dir: Path) -> ModelRunner:
    """A runner whose pool holds one max-length request and nothing more (block 0 is the null
    block): the workload's concurrent requests outgrow it, so the scheduler must preempt."""
    probe = ModelRunner(
        model_dir, block_size=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BUDGET
    )
    need = probe.kv_cache_config.blocks_per_request()
    return ModelRunner(
        model_dir, block_size=4, num_blocks=need + 1, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BUDGET,
    )  # fmt: skip


def _serve(engine: LLMEngine, workload: list[tuple[int, list[int]]]) -> bool:
    """Add requests at their arrival steps and step until done; whether a prompt was chunked."""
    chunked = False
    schedule = engine.scheduler.schedule

    def spy(**kw: bool) -> SchedulerOutput:  # (ahead=, one step ahead)
        nonlocal chunked
        out = schedule(**kw)
        chunked |= any(c.end < c.seq.prompt_len for c in out.chunks)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    step = 0
    pending = list(enumerate(workload))
    while pending or engine.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt) = pending.pop(0)
            engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=MAX_NEW))
        engine.step()
        step += 1
    return chunked


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_engine_matches_transformers_greedy(arch: str, tmp_path: Path) -> None:
    model_dir = make_hf_checkpoint(arch, tmp_path / arch)
    engine = LLMEngine(runner=_tiny_pool_runner(model_dir), max_num_seqs=8, keep_logits=True)
    workload = _workload(engine.runner.arch.vocab_size)
    chunked = _serve(engine, workload)
    stats = engine.scheduler.stats
    # The schedule exercised what it claims to.
    assert stats.num_preemptions >= 1 and stats.num_resumes >= 1
    assert stats.prefix_hit_tokens >= 12  # the shared 12-token prefix, hit by a later request
    assert chunked
    mla = engine.runner.mla_prefill
    if mla is not None:  # DeepSeek-V3's latent cache: prefill rows over decompressed K/V, read
        # from the cache (prefix hits, earlier chunks), beside absorbed decodes in mixed steps
        assert mla.stats.rows and mla.stats.cached_keys and mla.stats.decode_rows, mla.stats
    reference = _hf_reference(model_dir, [p for _, p in workload])
    for i, (want_tokens, want_logits) in enumerate(reference):
        got = engine.completion(str(i))
        assert list(got.token_ids) == want_tokens, f"{arch} request {i}"
        assert got.logits is not None
        err = (got.logits - want_logits).abs().max().item()
        assert err <= LOGIT_ATOL, f"{arch} request {i}: max |logit error| {err:.2e} > {LOGIT_ATOL}"
