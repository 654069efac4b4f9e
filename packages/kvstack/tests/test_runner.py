"""ModelRunner: the plan, the backend choice and the cache it builds, and execute() held to the
model's own cache-free forward across block sizes, layouts, padding and backends.

The checkpoints here are written by the engine itself (no transformers needed); parity with
transformers lives in test_models_hf.py. The oracle is ``model.forward_dense`` over each whole
sequence; float32 on both sides, differing only in summation order, so ``RTOL`` (1e-4 of the
largest logit, observed ~1e-6) is loose for them and tight for any addressing bug.
In bf16 the final logits of the MoE model are no test of attention (routing flips under rounding):
there each attention call is held to float64 attention on the same q/k/v (``kvstack.engine.testing.AttentionCalls``), and
end-to-end logits are compared only for a model without experts.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_backends import CommonAttentionMetadata
from kv_kernels.testing import plant_wrong_page
from kvstack.engine import ModelRunner
from kvstack.engine.kept_sdpa import KeptGatherSDPAImpl
from kvstack.engine.testing import (
    AttentionCalls,
    GreedyResult,
    diffkv_config,
    greedy_generate,
    write_checkpoint,
)

RTOL = 1e-4
PROMPTS = [list(range(3, 30)), [5, 9, 17, 33, 2], list(range(60, 79))]
CHUNKS = [8, 100, 5]
MAX_NEW = 4
# CI-sized; KVSTACK_HYPOTHESIS_EXAMPLES=200 for a longer run.
EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "8"))


# One torch thread for the whole module (see conftest's ``one_thread``).
pytestmark = pytest.mark.usefixtures("one_thread")


def small_config(**overrides: Any) -> dict[str, Any]:
    """A tiny 3-layer, 4q/2kv-head, head-16 model with a 6-token window, plus ``overrides``."""
    cfg = diffkv_config(head_dim=16, v_head_dim=16)
    del cfg["v_head_dim"]
    cfg.update(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, sliding_window=6)
    cfg.update(overrides)
    return cfg


def gpt_oss_config() -> dict[str, Any]:
    return small_config(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=2.0,
    )


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(gpt_oss_config(), tmp_path_factory.mktemp("gpt_oss"), seed=3)


def make(path: Path, **kw: Any) -> ModelRunner:
    kw.setdefault("num_blocks", 96)
    return ModelRunner(path, max_model_len=64, **kw)


def assert_matches_dense(runner: ModelRunner, result: GreedyResult) -> None:
    for prompt, tokens, logits in zip(PROMPTS, result.tokens, result.logits, strict=True):
        dense = runner.model.forward_dense(torch.tensor(prompt + tokens))[len(prompt) - 1 : -1]
        assert tokens == dense.argmax(-1).tolist()
        assert float((logits - dense).abs().max() / dense.abs().max()) <= RTOL


def generate(runner: ModelRunner, **kw: Any) -> GreedyResult:
    return greedy_generate(runner, PROMPTS, MAX_NEW, chunk_sizes=CHUNKS, **kw)


# -- what the runner builds ----------------------------------------------------------------------


def test_hybrid_model_gets_two_groups_sharing_layer_slots(gpt_oss: Path) -> None:
    runner = make(gpt_oss)
    cfg = runner.kv_cache_config
    kinds = [g.spec.kind for g in cfg.groups]
    assert sorted(kinds) == ["full", "sliding_window", "sliding_window"]
    # 2 sliding + 1 full layers -> groups of one slot each; layers 0 and 2 are different groups
    # in the same slot, which is why every group needs its own block ids.
    assert cfg.num_layer_slots == 1
    assert cfg.group_of("model.layers.0.self_attn") != cfg.group_of("model.layers.2.self_attn")
    assert len(runner.kernel_block_sizes) == runner.num_groups == 3
    assert runner.backends == {0: "TORCH_SDPA", 1: "TORCH_SDPA", 2: "TORCH_SDPA"}
    assert "TORCH_SDPA" in str(runner.selections[0]) and "sinks" in str(runner.selections[0])
    text = runner.describe()
    assert "GptOssForCausalLM" in text and "group 2" in text
    # One storage: every layer view aliases the same bytes.
    ptrs = {b.kv_cache.untyped_storage().data_ptr() for b in runner.layers}
    assert len(ptrs) == 1


def test_paged_generation_matches_dense_reference(gpt_oss: Path) -> None:
    runner = make(gpt_oss)
    assert_matches_dense(runner, generate(runner))


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_sizes_do_not_change_results(gpt_oss: Path, block_size: int) -> None:
    runner = make(gpt_oss, block_size=block_size, num_blocks=96 * 16 // block_size)
    assert all(g.spec.block_size == block_size for g in runner.kv_cache_config.groups)
    assert_matches_dense(runner, generate(runner))


@pytest.mark.parametrize("order", ["LBHNC", "LHBNC", "BLNHC", "BHLNC"])
def test_every_layout_order_gives_the_same_logits(gpt_oss: Path, order: str) -> None:
    base = generate(make(gpt_oss))
    other = generate(make(gpt_oss, layout_order=order))
    assert other.tokens == base.tokens
    for a, b in zip(base.logits, other.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_padding_tokens_are_ignored(gpt_oss: Path) -> None:
    base = generate(make(gpt_oss))
    padded = generate(make(gpt_oss), pad_tokens=3)
    assert padded.tokens == base.tokens
    for a, b in zip(base.logits, padded.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_diffkv_runs_on_a_backend_with_head_size_v(tmp_path: Path) -> None:
    runner = make(write_checkpoint(diffkv_config(head_dim=48, v_head_dim=32), tmp_path))
    layout = runner.layouts[0]
    assert (layout.head_size, layout.head_size_v) == (48, 32)
    assert_matches_dense(runner, generate(runner))


@pytest.mark.slow
def test_flex_attention_backend_matches_dense_reference(gpt_oss: Path) -> None:
    runner = make(gpt_oss, backend="FLEX_ATTENTION")
    assert set(runner.backends.values()) == {"FLEX_ATTENTION"}
    assert_matches_dense(runner, generate(runner))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    prompt_lens=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    chunks=st.lists(st.integers(1, 9), min_size=4, max_size=4),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    pad=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_any_batch_shape_matches_dense_reference(
    gpt_oss: Path, prompt_lens: list[int], chunks: list[int], block_size: int, pad: int, seed: int
) -> None:
    # Random prompt lengths (windows of 6 crossed or not), chunk sizes, block sizes (a window
    # spanning 1..6 blocks), padding and block order: paged == cache-free, token for token.
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in prompt_lens]
    # Default sizing: room for 4 requests of max_model_len, the most this draws.
    runner = make(gpt_oss, block_size=block_size, num_blocks=None)
    result = greedy_generate(
        runner, prompts, 3, chunk_sizes=chunks[: len(prompts)], seed=seed, pad_tokens=pad
    )
    for prompt, tokens, logits in zip(prompts, result.tokens, result.logits, strict=True):
        dense = runner.model.forward_dense(torch.tensor(prompt + tokens))[len(prompt) - 1 : -1]
        assert tokens == dense.argmax(-1).tolist()
        assert float((logits - dense).abs().max() / dense.abs().max()) <= RTOL


# -- sizing ------------------------------------------------------------------------------------


def test_cache_sizing(gpt_oss: Path) -> None:
    runner = make(gpt_oss, num_blocks=None)
    cfg = runner.kv_cache_config
    assert cfg.num_blocks == 4 * cfg.blocks_per_request(64) + 1  # and the null block
    assert cfg.max_concurrency(64) == 4.0
    by_bytes = make(gpt_oss, num_blocks=None, kv_cache_memory=cfg.page_size_bytes * 100)
    assert by_bytes.kv_cache_config.num_blocks == 100
    with pytest.raises(ValueError, match="not both"):
        make(gpt_oss, kv_cache_memory=1 << 20, num_blocks=10)
    with pytest.raises(
        ValueError, match="num_blocks=3 cannot hold one request of max_model_len=64"
    ):
        make(gpt_oss, num_blocks=3)
    # exactly one request's blocks is one short: block 0 is the allocator's null block
    need = cfg.blocks_per_request(64)
    with pytest.raises(ValueError, match=f"so at least {need + 1}"):
        make(gpt_oss, num_blocks=need)
    assert make(gpt_oss, num_blocks=need + 1).kv_cache_config.max_concurrency(64) == 1.0


def test_kept_decode_gathers_are_bounded_by_the_cache_size(gpt_oss: Path) -> None:
    """On the CPU every TORCH_SDPA layer is the engine's ``KeptGatherSDPAImpl`` (kv-backends'
    reference keeps nothing), and all the layers together keep at most a quarter of the KV
    cache's bytes (or 1 MiB a layer, for tiny caches), so the kept float32 copies never double
    the memory the plan promised; a larger cache allows more. FLEX_ATTENTION layers get no such
    option."""
    budgets = {}
    for blocks in (96, 20_000):
        runner = make(gpt_oss, num_blocks=blocks)
        assert all(isinstance(b.impl, KeptGatherSDPAImpl) for b in runner.layers)
        layers = runner.arch.num_layers
        limits = [b.impl.keep_decode_gather_bytes for b in runner.layers]  # type: ignore[attr-defined]
        assert len(limits) == layers and all(n > 0 for n in limits)
        total = runner.kv_cache_config.total_bytes
        assert sum(limits) <= max(total // 4, layers * 2**20)
        budgets[blocks] = sum(limits)
    assert budgets[20_000] > budgets[96]
    flex = make(gpt_oss, backend="FLEX_ATTENTION")
    assert not any(hasattr(b.impl, "keep_decode_gather_bytes") for b in flex.layers)


def test_forced_backend_that_cannot_serve_says_why(gpt_oss: Path) -> None:
    with pytest.raises(ValueError, match="prefer=FLASH_ATTN cannot serve .*needs a CUDA GPU"):
        make(gpt_oss, backend="FLASH_ATTN")


# -- bad input ---------------------------------------------------------------------------------


def one_request(runner: ModelRunner, n: int = 5) -> list[CommonAttentionMetadata]:
    return [
        CommonAttentionMetadata.from_lists(
            query_lens=[n], seq_lens=[n], block_table=[[g]], block_size=runner.kernel_block_sizes[g]
        )
        for g in range(runner.num_groups)
    ]


def test_execute_rejects_inconsistent_batches(gpt_oss: Path) -> None:
    runner = make(gpt_oss)
    ids, pos, md, rows = torch.arange(5), torch.arange(5), one_request(runner), torch.tensor([4])
    assert runner.execute(ids, pos, md, rows).shape == (1, 256)
    with pytest.raises(ValueError, match="3 KV groups"):
        runner.execute(ids, pos, md[:1], rows)
    with pytest.raises(ValueError, match="input_ids must be int64"):
        runner.execute(ids.int(), pos, md, rows)
    with pytest.raises(ValueError, match="positions disagree with the metadata"):
        runner.execute(ids, pos + 1, md, rows)
    with pytest.raises(ValueError, match=r"logits_indices must lie in \[0, 5\)"):
        runner.execute(ids, pos, md, torch.tensor([5]))
    short = [
        dataclasses.replace(m, slot_mapping=m.slot_mapping[:4], num_actual_tokens=4) for m in md
    ]
    with pytest.raises(ValueError, match="slot_mapping has 4 entries; input_ids has 5"):
        runner.execute(ids, pos, short, rows)


def test_engine_skips_the_checks_that_execute_keeps(
    gpt_oss: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine builds its batches itself and calls execute_trusted; execute, the path for
    # everyone else, still checks every call.
    from kvstack.engine import LLMEngine, SamplingParams

    runner = make(gpt_oss)
    checks: list[int] = []
    check = runner._check_inputs
    monkeypatch.setattr(runner, "_check_inputs", lambda *a: checks.append(1) or check(*a))
    LLMEngine(runner=runner, max_num_seqs=4).generate(
        [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=3)
    )
    assert checks == []
    ids, pos, md, rows = torch.arange(5), torch.arange(5), one_request(runner), torch.tensor([4])
    with pytest.raises(ValueError, match="positions disagree with the metadata"):
        runner.execute(ids, pos + 1, md, rows)
    assert checks == [1]


def test_execute_logits_are_float32_even_for_bf16_models(gpt_oss: Path) -> None:
    runner = make(gpt_oss, dtype=torch.bfloat16)
    assert runner.layouts[0].dtype == "bfloat16"
    out = runner.execute(
        torch.arange(5), torch.arange(5), one_request(runner), torch.tensor([0, 4])
    )
    assert out.dtype == torch.float32 and out.shape == (2, 256)
    dense = runner.model.forward_dense(torch.arange(5))[[0, 4]]
    # bf16 weights and cache: one rounding of 2^-8 per op, a few layers deep.
    assert float((out - dense).abs().max() / dense.abs().max()) <= 5e-2


# -- GPU ---------------------------------------------------------------------------------------


GPU_BACKENDS = [None, "TORCH_SDPA", "TRITON", "FLEX_ATTENTION", "FLASH_ATTN"]


def _gpu_runner(gpt_oss: Path, dtype: torch.dtype, backend: str | None) -> ModelRunner:
    try:
        return make(gpt_oss, dtype=dtype, device="cuda", backend=backend)
    except ValueError as e:  # e.g. FLASH_ATTN not installed or head 16 unsupported: say why
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_float32_match_the_cpu_reference(gpt_oss: Path, backend: str | None) -> None:
    # float32 on the GPU (TF32 off) is held tightly to the float32 CPU dense forward: a wrong or
    # dropped page moves the logits by far more than 1e-3 of their max (the planted-bug tests
    # above measure > 1e-2 on the CPU).
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        runner = _gpu_runner(gpt_oss, torch.float32, backend)
        cpu = make(gpt_oss)
        result = generate(runner)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    for prompt, tokens, logits in zip(PROMPTS, result.tokens, result.logits, strict=True):
        dense = cpu.model.forward_dense(torch.tensor(prompt + tokens))[len(prompt) - 1 : -1]
        assert float((logits - dense).abs().max() / dense.abs().max()) <= 1e-3, runner.describe()


# -- per attention call: each backend call against the float64 oracle on the same q/k/v -----------
#
# A model-level bf16 check (final logits within 5e-2 of the same model's dense bf16 forward) cannot
# tell paging from rounding on gpt-oss: MoE top-k routing flips on a one-ulp change of an attention
# output, so noise of half a bf16 step on every attention output fails that check in 7 of 8 runs of
# TORCH_SDPA. The checks below look at each attention call instead: the backend's output against
# float64 attention over the same q and the K/V the model produced for that request (kept by the
# test from the model's own k/v, never read from the cache or through the block table), with the
# flash-attention parity rule of kv-kernels (bound = 2 x a plain torch run's error in the dtype +
# a few units of the dtype's rounding of the row). The model's own ``dense_attention`` over the same
# q/k/v is held to the same oracle and rule, so the oracle's window and sink conventions are the
# model's.


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_bf16_attention_matches_the_oracle_per_call(
    gpt_oss: Path, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every attention call of a bf16 gpt-oss run (sinks, sliding and full layers, chunked prefill
    # and decodes in one batch) against float64 attention on the same q/k/v. No logit comparison:
    # on this MoE model it measures routing flips, not attention (see the section comment).
    runner = _gpu_runner(gpt_oss, torch.bfloat16, backend)
    calls = AttentionCalls(runner, monkeypatch)
    result = generate(runner)
    calls.assert_ok()
    assert all(torch.isfinite(lg).all() for lg in result.logits)


def generate_steps() -> int:
    """Steps ``generate`` takes: the longest prompt's prefill chunks, then one per new token."""
    return max(-(-len(p) // c) for p, c in zip(PROMPTS, CHUNKS, strict=True)) + MAX_NEW - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "FLEX_ATTENTION"])
def test_attention_matches_the_oracle_per_call(
    gpt_oss: Path, backend: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU test's logic on the CPU (eager FLEX, TORCH_SDPA), so CI runs it.
    runner = make(gpt_oss, dtype=dtype, backend=backend)
    calls = AttentionCalls(runner, monkeypatch)
    generate(runner)
    calls.assert_ok()
    assert len(calls.calls) == runner.arch.num_layers * generate_steps()


def test_attention_matches_the_oracle_per_call_with_the_rope_in_the_cache_write(
    gpt_oss: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fused ops on the CPU (their references) over FLEX_ATTENTION's plain cache write: every
    # layer's RoPE rides in its cache write, as on CUDA, so each call goes through rope_attend,
    # which the recorder wraps too (the GPU test above recorded no call before it did, and
    # failed "no attention call was recorded" on every backend).
    runner = make(gpt_oss, dtype=torch.float32, backend="FLEX_ATTENTION", fused_ops=True)
    deferred: list[bool] = []
    forward = runner.model.forward

    def spy(*a: Any, **kw: Any) -> Any:
        deferred.append(kw.get("rope_attend") is not None)
        return forward(*a, **kw)

    monkeypatch.setattr(runner.model, "forward", spy)
    calls = AttentionCalls(runner, monkeypatch)
    generate(runner)
    calls.assert_ok()
    assert deferred and all(deferred), runner.rope_cache_reason
    assert len(calls.calls) == runner.arch.num_layers * generate_steps()


def _wrong_page(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    # Once request 0 (the 27-token prompt) spans 2 pages, every group's attention reads one wrong
    # page of it (kv-kernels' plant_wrong_page): the bug of a block-table builder or of a kernel's
    # page walk. Writes (slot_mapping) stay right, as does the metadata the recorder reads.
    execute, num_blocks = runner.execute, runner.kv_cache_config.num_blocks

    def bad(ids: Any, pos: Any, metadata: list[CommonAttentionMetadata], rows: Any) -> Any:
        planted = []
        for gid, md in enumerate(metadata):
            kbs, table = runner.kernel_block_sizes[gid], md.block_table
            if -(-int(md.seq_lens[0]) // kbs) >= 2:
                table = plant_wrong_page(table, md.seq_lens, kbs, num_blocks)
            planted.append(dataclasses.replace(md, block_table=table))
        return execute(ids, pos, planted, rows)

    monkeypatch.setattr(runner, "execute", bad)


def _no_sink(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every impl built with its sinks at -1e4 (exp(sink) = 0): the sink dropped.
    layers = list(runner.layers)
    for i, b in enumerate(layers):
        sel = runner.selections[b.group_id]
        config = sel.config.with_kernel_block_size(runner.kernel_block_sizes[b.group_id])
        sinks = runner.model.layer_sinks(i)
        assert sinks is not None
        impl = sel.backend.make_impl(
            config,
            runner.layouts[b.group_id],
            scale=runner.model.scale,
            sinks=torch.full_like(sinks.detach().float(), -1e4),
        )
        layers[i] = dataclasses.replace(b, impl=impl)
    monkeypatch.setattr(runner, "layers", layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("plant", [_wrong_page, _no_sink], ids=["wrong_page", "no_sink"])
def test_per_call_check_catches_planted_bugs(
    gpt_oss: Path, plant: Any, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make(gpt_oss, dtype=dtype, backend="TORCH_SDPA")
    plant(runner, monkeypatch)  # under the recorder: it sees the metadata the caller built
    calls = AttentionCalls(runner, monkeypatch)
    generate(runner)
    bad = calls.failures()
    assert bad and all(": backend: " in f for f in bad), bad
    worst = max(c.backend.err / c.backend.bound for c in calls.calls)
    assert worst > 3, worst  # well past the bound, not at its edge


# End to end in bf16, only where it means something: a model without experts (Qwen3-like, same
# attention shapes and windows as gpt_oss_config, no sinks), whose logits move smoothly with
# rounding. Measured on the CPU: TORCH_SDPA / FLEX 0.000-0.020 of the max logit from the same
# model's dense bf16 forward, <= 0.028 with half a bf16 step of noise on every attention output
# (the perturbation that fails the MoE model's logit check 7 times in 8), 1.4 with one wrong page.
# Greedy tokens are not compared: near-ties flip under that noise.


def dense_config() -> dict[str, Any]:
    return small_config(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(dense_config(), tmp_path_factory.mktemp("dense"), seed=3)


def assert_bf16_logits_match_dense(runner: ModelRunner) -> None:
    result = generate(runner)
    for prompt, tokens, logits in zip(PROMPTS, result.tokens, result.logits, strict=True):
        ids = torch.tensor(prompt + tokens, device=runner.device)
        dense = runner.model.forward_dense(ids)[len(prompt) - 1 : -1].cpu()
        assert torch.isfinite(logits).all()
        assert float((logits - dense).abs().max() / dense.abs().max()) <= 5e-2, runner.describe()


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "FLEX_ATTENTION"])
def test_bf16_dense_model_logits_match_its_dense_forward(dense_model: Path, backend: str) -> None:
    assert_bf16_logits_match_dense(make(dense_model, dtype=torch.bfloat16, backend=backend))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_bf16_dense_model_logits_match_its_dense_forward(
    dense_model: Path, backend: str | None
) -> None:
    assert_bf16_logits_match_dense(_gpu_runner(dense_model, torch.bfloat16, backend))


# -- with kv-blocktable's block tables ---------------------------------------------------------


def test_execute_takes_kv_blocktable_metadata(gpt_oss: Path) -> None:
    # The metadata a real engine builds (kv-blocktable's BlockTables) instead of from_lists.
    block_table = pytest.importorskip("kv_blocktable.block_table")
    runner = make(gpt_oss, block_size=4, num_blocks=200)
    cfg = runner.kv_cache_config
    tables = block_table.BlockTables.from_config(
        cfg,
        runner.kernel_block_sizes,
        max_num_reqs=4,
        max_model_len=64,
        max_num_batched_tokens=runner.max_num_batched_tokens,
    )
    next_block = iter(range(1, cfg.num_blocks))  # block 0 is the pool's null block
    held: list[list[int]] = [[] for _ in PROMPTS]  # manager blocks per request, every group
    tokens = [list(p) for p in PROMPTS]
    computed = [0] * len(PROMPTS)
    logits: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    for _ in range(MAX_NEW):
        qlens = [len(t) - c for t, c in zip(tokens, computed, strict=True)]
        seq_lens = [len(t) for t in tokens]
        for r, s in enumerate(seq_lens):
            new = [[next(next_block) for _ in range(-(-s // 4) - len(held[r]))] for _ in cfg.groups]
            if held[r]:
                tables.append_row(r, tuple(new))
            else:
                tables.add_row(r, tuple(new))
            held[r] += new[0]  # counts blocks (every group holds as many)
        tables.commit(len(PROMPTS))
        metadata = tables.build_common_metadata(len(PROMPTS), qlens, seq_lens)
        ids = [t for r, tok in enumerate(tokens) for t in tok[computed[r] :]]
        pos = [p for r, tok in enumerate(tokens) for p in range(computed[r], len(tok))]
        rows = torch.tensor(qlens).cumsum(0) - 1
        out = runner.execute(torch.tensor(ids), torch.tensor(pos), list(metadata), rows)
        for r, row in enumerate(out):
            logits[r].append(row)
            computed[r] = len(tokens[r])
            tokens[r].append(int(row.argmax()))
    result = GreedyResult(
        [t[len(p) :] for t, p in zip(tokens, PROMPTS, strict=True)],
        [torch.stack(lg) for lg in logits],
        MAX_NEW,
    )
    assert_matches_dense(runner, result)
