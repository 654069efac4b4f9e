"""The engine's start (issue 27's cold start, issue 32's startup report): every KV group's
kernels are built before the first request, over the block tables the steps will pass (their
width and row pitch are part of what the kernels specialize on), and the start's stages are
reported in seconds. On the CPU the backends compile nothing ahead (``{}``); the GPU side is
kv_kernels' ``test_warmup.py`` (no build after the warmup)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kv_backends.impl import AttentionImpl
from kvstack.engine.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")
_ARGS = dict(block_size=4, num_blocks=80, max_model_len=64, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two KV groups: full attention and a sliding window."""
    pytest.importorskip("transformers")
    from kvstack.engine.testing import make_hf_checkpoint

    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[AttentionImpl, dict[str, Any]]]:
    seen: list[tuple[AttentionImpl, dict[str, Any]]] = []

    def warmup(self: AttentionImpl, kv_cache: Any, **kw: Any) -> dict[str, float]:
        seen.append((self, kw))
        return {}

    monkeypatch.setattr(AttentionImpl, "warmup", warmup)
    return seen


def test_every_group_warms_over_its_own_block_table(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _recording(monkeypatch)
    engine = LLMEngine(qwen3_dir, **_ARGS)
    groups = engine.runner.kv_cache_config.groups
    assert len(groups) == 2 and len(seen) == 2
    group_of = {id(b.impl): b.group_id for b in engine.runner.layers}
    assert sorted(group_of[id(impl)] for impl, _ in seen) == [0, 1]
    for impl, kw in seen:
        table = engine.tables.kernel_table(group_of[id(impl)])
        assert kw == {"block_table_width": table.shape[1], "block_table_stride": table.stride(0)}
    startup = engine.stats().startup_seconds
    assert {"load", "plan", "compile"} <= set(startup) and all(v >= 0 for v in startup.values())


def test_warmup_off_builds_nothing_ahead(qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording(monkeypatch)
    engine = LLMEngine(qwen3_dir, warmup=False, **_ARGS)
    assert seen == [] and "compile" not in engine.stats().startup_seconds


def test_warmup_takes_a_bool(qwen3_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"warmup='yes' is a str; give True or False"):
        LLMEngine(qwen3_dir, warmup="yes", **_ARGS)


def test_max_model_len_past_the_trained_positions_needs_the_override(qwen3_dir: Path) -> None:
    """vLLM's rule, in the engine as in the CLI: max_model_len above max_position_embeddings
    only with allow_long_max_model_len=True."""
    from kvstack.engine.hf_config import load_arch_config

    mpe = load_arch_config(qwen3_dir).max_position_embeddings
    args = dict(_ARGS, max_model_len=mpe + 1, num_blocks=None, kv_cache_memory=2**24)
    with pytest.raises(ValueError, match=rf"max_model_len={mpe + 1} is above .*={mpe}.*allow_long"):
        LLMEngine(qwen3_dir, warmup=False, **args)
    engine = LLMEngine(qwen3_dir, warmup=False, allow_long_max_model_len=True, **args)
    assert engine.runner.max_model_len == mpe + 1


def test_started_engine_freezes_the_heap_until_the_last_is_freed(qwen3_dir: Path) -> None:
    """``freeze_gc`` (default): once started, the engine's heap is in the collector's permanent
    generation (oldest-generation passes no longer walk it inside steps) for as long as an
    engine that froze it lives; freeing the last one hands the heap back to the collector.
    ``freeze_gc=False`` leaves the collector alone."""
    import gc
    import weakref

    from kvstack.engine import _gc

    before = _gc.frozen_owners()
    engine = LLMEngine(qwen3_dir, **_ARGS)
    assert _gc.frozen_owners() == before + 1 and gc.get_freeze_count() > 0
    assert engine.stats().startup_seconds["gc_freeze"] >= 0
    other = LLMEngine(qwen3_dir, freeze_gc=False, **_ARGS)
    assert _gc.frozen_owners() == before + 1
    assert "gc_freeze" not in other.stats().startup_seconds
    runner = weakref.ref(engine.runner)
    del engine  # (freed by reference counting: no cycle holds an engine, or its runner)
    assert _gc.frozen_owners() == before and runner() is None
    if before == 0:
        assert gc.get_freeze_count() == 0
    del other
    with pytest.raises(TypeError, match=r"freeze_gc=1 is a int; give True or False"):
        LLMEngine(qwen3_dir, freeze_gc=1, **_ARGS)
