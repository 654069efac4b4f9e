"""The engine's models held token for token to transformers (float32, CPU).

Each family's tiny checkpoint is written by transformers itself (random weights, fixed seed).
transformers' greedy ``generate`` (no EOS, eager attention) is the oracle; the engine runs three
prompts at once through :meth:`ModelRunner.execute` over the paged cache -- one prompt prefilled
whole, one in chunks of 5 tokens and one of 16, so chunked prefills share steps with decodes --
and must produce the same tokens and logits within :data:`LOGIT_RTOL`. ``forward_dense`` (no
cache) is held to transformers' plain forward, so a failure says whether the model or the paging
is wrong. Planted bugs (wrong RoPE scaling, K and V swapped, a swapped page, the window or the
sinks dropped) show the comparison catches each.

Tolerance: both sides compute in float32 (unit roundoff 6e-8) from identical weights, in different
orders (one gathered request at a time vs a padded batch, split-K matmuls, MoE sums). Observed
max |error| is 1-3e-6 of the largest logit; ``LOGIT_RTOL = 1e-4`` of it leaves ~30x headroom for
other BLAS builds, while every planted bug moves logits by more than 1e-2 of it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kv_backends import CommonAttentionMetadata

pytest.importorskip("transformers")

from kvstack.engine import ModelRunner, RopeConfig
from kvstack.engine.archs import FAMILIES as FAMILY_REGISTRY
from kvstack.engine.layers import rope_inv_freq
from kvstack.engine.testing import (
    TINY_CONFIGS,
    GreedyResult,
    greedy_generate,
    hf_greedy,
    make_diffkv_checkpoint,
    make_hf_checkpoint,
)

LOGIT_RTOL = 1e-4
MAX_NEW = 6
# Longer than every window (6, 8) and than Llama's 16-token "pretraining" context.
# The second holds token id 0 (first and inside): a real token, which an oracle that lets
# transformers infer an attention mask from pad_token_id=0 would hide.
PROMPTS = [list(range(3, 40)), [0, 9, 17, 0, 2, 8, 100], list(range(50, 71))]
CHUNKS = [16, 100, 5]
FAMILIES = list(TINY_CONFIGS)

Refs = list[tuple[list[int], torch.Tensor]]


# One torch thread for the whole module (see conftest's ``one_thread``).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_checkpoint(name, root / name, seed=1) for name in FAMILIES}


@pytest.fixture(scope="module")
def hf_refs(checkpoints: dict[str, Path]) -> dict[str, Refs]:
    return {
        name: [hf_greedy(path, p, MAX_NEW) for p in PROMPTS] for name, path in checkpoints.items()
    }


def runner_for(path: Path, **kw: object) -> ModelRunner:
    return ModelRunner(path, num_blocks=96, max_model_len=128, **kw)  # type: ignore[arg-type]


def logit_error(result: GreedyResult, refs: Refs) -> tuple[bool, float]:
    """(same tokens everywhere, max |logit error| / largest |logit|)."""
    same = all(ours == ref for ours, (ref, _) in zip(result.tokens, refs, strict=True))
    err = max(
        float((ours - ref).abs().max() / ref.abs().max())
        for ours, (_, ref) in zip(result.logits, refs, strict=True)
    )
    return same, err


def run(path: Path, **kw: object) -> GreedyResult:
    return greedy_generate(runner_for(path), PROMPTS, MAX_NEW, chunk_sizes=CHUNKS, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_greedy_matches_transformers(
    name: str, checkpoints: dict[str, Path], hf_refs: dict[str, Refs]
) -> None:
    result = run(checkpoints[name])
    # The batch really mixed a whole prefill, chunked prefills and decodes in one step.
    assert result.step_shapes[0] == (16, 7, 5) and result.step_shapes[1] == (16, 1, 5)
    same, err = logit_error(result, hf_refs[name])
    assert same, f"{name}: tokens {result.tokens} vs transformers {[r[0] for r in hf_refs[name]]}"
    assert err <= LOGIT_RTOL, f"{name}: logits off by {err:.2e} of the largest"


@pytest.mark.parametrize("name", FAMILIES)
def test_dense_reference_matches_transformers(
    name: str, checkpoints: dict[str, Path], hf_refs: dict[str, Refs]
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], attn_implementation="eager")
    runner = runner_for(checkpoints[name])
    prompt, (generated, _) = PROMPTS[0], hf_refs[name][0]
    ids = torch.tensor(prompt + generated)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    ours = runner.model.forward_dense(ids)
    assert float((ours - ref).abs().max() / ref.abs().max()) <= LOGIT_RTOL


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoints_exercise_what_makes_each_family_different(
    name: str, checkpoints: dict[str, Path]
) -> None:
    # Guards the fixtures: a test config that lost its window, sinks or scaling would pass
    # vacuously. Each family's module says what its tiny config must exercise.
    arch = runner_for(checkpoints[name]).arch
    assert arch.family == name
    FAMILY_REGISTRY[name].checks(arch)
    # Every window is shorter than the longest request by its last decode step.
    if arch.sliding_window is not None:
        assert arch.sliding_window < max(map(len, PROMPTS)) + MAX_NEW


def test_llama_rope_scaling_reaches_the_prompts() -> None:
    assert TINY_CONFIGS["llama"]["rope_parameters"]["original_max_position_embeddings"] < max(
        map(len, PROMPTS)
    )


@pytest.mark.parametrize(
    ("rope", "hf_type"),
    [
        (TINY_CONFIGS["llama"]["rope_parameters"], "llama3"),
        (TINY_CONFIGS["gpt_oss"]["rope_parameters"], "yarn"),
        (
            {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "truncate": True,
                "original_max_position_embeddings": 128,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
            },
            "yarn",
        ),
        ({"rope_type": "linear", "rope_theta": 5e5, "factor": 2.5}, "linear"),
    ],
)
def test_rope_frequencies_equal_transformers(rope: dict[str, object], hf_type: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = 32
    hf_cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters=dict(rope),
    )
    want, want_scale = ROPE_INIT_FUNCTIONS[hf_type](hf_cfg)
    ours = RopeConfig.from_hf(
        {"rope_parameters": dict(rope), "max_position_embeddings": 4096}, "llama"
    )
    torch.testing.assert_close(rope_inv_freq(ours, head_dim), want, rtol=1e-6, atol=0)
    assert ours.yarn_attention_factor() == pytest.approx(want_scale, rel=1e-12)


def test_diffkv_paged_matches_dense_reference(tmp_path: Path) -> None:
    # transformers has no DiffKV model: the engine's cache-free forward is the oracle.
    runner = ModelRunner(make_diffkv_checkpoint(tmp_path), num_blocks=96, max_model_len=128)
    spec = runner.kv_cache_config.groups[0].spec
    assert (spec.head_size, spec.head_size_v) == (192, 128)
    result = greedy_generate(runner, PROMPTS, MAX_NEW, chunk_sizes=CHUNKS)
    for prompt, tokens, logits in zip(PROMPTS, result.tokens, result.logits, strict=True):
        ids = torch.tensor(prompt + tokens)
        dense = runner.model.forward_dense(ids)[len(prompt) - 1 : -1]  # rows that sampled
        assert tokens == dense.argmax(-1).tolist()
        assert float((logits - dense).abs().max() / dense.abs().max()) <= LOGIT_RTOL


# -- planted bugs: the comparison must catch each ----------------------------------------------


def _edit_config(src: Path, dst: Path, edit: Callable[[dict[str, object]], None]) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _swap_rows_on_decode(
    step: int, mds: list[CommonAttentionMetadata]
) -> list[CommonAttentionMetadata]:
    # While requests 0 and 1 both decode (steps 3-7), each reads the other's pages; the slots
    # written stay right, so only the read side is wrong.
    if step < 3 or mds[0].num_reqs < 2:
        return mds
    out = []
    for md in mds:
        bt = md.block_table.clone()
        bt[[0, 1]] = bt[[1, 0]]
        out.append(dataclasses.replace(md, block_table=bt))
    return out


def test_planted_wrong_rope_scaling_is_caught(
    checkpoints: dict[str, Path], hf_refs: dict[str, Refs], tmp_path: Path
) -> None:
    def plain_rope(cfg: dict[str, object]) -> None:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}

    bad = _edit_config(checkpoints["llama"], tmp_path / "bad", plain_rope)
    _, err = logit_error(run(bad), hf_refs["llama"])
    assert err > 100 * LOGIT_RTOL


def test_planted_ignored_window_is_caught(
    checkpoints: dict[str, Path], hf_refs: dict[str, Refs], tmp_path: Path
) -> None:
    def no_window(cfg: dict[str, object]) -> None:
        cfg["sliding_window"] = None

    bad = _edit_config(checkpoints["mistral"], tmp_path / "bad", no_window)
    _, err = logit_error(run(bad), hf_refs["mistral"])
    assert err > 100 * LOGIT_RTOL


def test_planted_swapped_k_and_v_is_caught(
    checkpoints: dict[str, Path], hf_refs: dict[str, Refs], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runner_for(checkpoints["llama"])
    impl = runner.layers[1].impl
    original = impl.do_kv_cache_update

    def swapped(
        layer: object, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        original(layer, v, k, cache, slots)

    monkeypatch.setattr(impl, "do_kv_cache_update", swapped)
    result = greedy_generate(runner, PROMPTS, MAX_NEW, chunk_sizes=CHUNKS)
    _, err = logit_error(result, hf_refs["llama"])
    assert err > 100 * LOGIT_RTOL


def test_planted_swapped_pages_are_caught(
    checkpoints: dict[str, Path], hf_refs: dict[str, Refs]
) -> None:
    result = greedy_generate(
        runner_for(checkpoints["llama"]),
        PROMPTS,
        MAX_NEW,
        chunk_sizes=CHUNKS,
        metadata_hook=_swap_rows_on_decode,
    )
    _, err = logit_error(result, hf_refs["llama"])
    assert err > 100 * LOGIT_RTOL


def test_planted_dropped_sinks_are_caught(
    checkpoints: dict[str, Path], hf_refs: dict[str, Refs], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runner_for(checkpoints["gpt_oss"])
    for binding in runner.layers:
        monkeypatch.setattr(binding.impl, "sinks", None)
    result = greedy_generate(runner, PROMPTS, MAX_NEW, chunk_sizes=CHUNKS)
    _, err = logit_error(result, hf_refs["gpt_oss"])
    assert err > 100 * LOGIT_RTOL
