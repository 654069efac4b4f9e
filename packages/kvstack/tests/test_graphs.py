"""CUDA graphs of decode-only steps (``kvstack.engine.graphs``).

On the CPU the graphs run with ``capture=False`` (replay = calling the recorded step again over
the same buffers), which checks what a GPU cannot hide: the buffer filling, the padding rows of
a batch smaller than its capture size, and which steps take the graph. On a GPU (marked ``gpu``)
the engine captures real graphs and must give the eager engine's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kvstack.engine.engine import LLMEngine
from kvstack.engine.graphs import DecodeGraphs, capture_sizes, default_graph_blas
from kvstack.engine.runner import ModelRunner
from kvstack.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


#: Five requests finishing at different steps: decode batches of 5, 4, 3, 2 and 1 requests, so
#: capture sizes 8 (three padding rows), 4, 2 and 1 are all used.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 40], [99] * 20, [3, 1, 4, 1, 5], [7] * 11]
NEW = [3, 5, 7, 9, 11]


def engine_of(model_dir: Path, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(
        block_size=4, num_blocks=80, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8
    )
    args.update(kw)
    return LLMEngine(model_dir, keep_logits=True, **args)


def run(engine: LLMEngine) -> list[Any]:
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW]
    return engine.generate(PROMPTS, params)


def with_emulated_graphs(engine: LLMEngine, cls: type[DecodeGraphs] = DecodeGraphs) -> LLMEngine:
    engine.runner.graphs = cls(engine.runner, 8, capture=False)
    return engine


def max_logit_gap(a: list[Any], b: list[Any]) -> float:
    return max(float((x.logits - y.logits).abs().max()) for x, y in zip(a, b, strict=True))


def test_capture_sizes() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            capture_sizes(bad)  # type: ignore[arg-type]


def test_cpu_runner_says_why_graphs_are_off(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    assert engine.runner.graphs is None
    assert engine.runner.cuda_graphs_reason == (
        "off: the runner is on cpu, CUDA graphs need a CUDA device"
    )
    assert "CUDA graphs off: the runner is on cpu" in engine.runner.describe()
    with pytest.raises(ValueError, match="cuda_graphs=True, but CUDA graphs cannot run here"):
        ModelRunner(llama_dir, cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs='yes' must be None, True or False"):
        ModelRunner(llama_dir, cuda_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot capture CUDA graphs here: the runner is on cpu"):
        DecodeGraphs(engine.runner, 8)


def test_emulated_graphs_give_the_eager_engines_tokens(llama_dir: Path) -> None:
    eager = run(engine_of(llama_dir))
    engine = with_emulated_graphs(engine_of(llama_dir))
    graphed = run(engine)
    graphs = engine.runner.graphs
    assert graphs is not None
    # Every decode step (not the prefills) went through the graphs, at sizes 8, 4, 2 and 1.
    assert graphs.num_replays == max(NEW) - 1
    assert sorted(graphs._graphs) == [1, 2, 4, 8]
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    # Padded rows change the matmuls' row count, not what a real row computes: float32 logits
    # agree to rounding (a wrong page moves them by > 1e-2, see the planted bug below).
    assert max_logit_gap(graphed, eager) <= 1e-5


def _cache_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    storage = engine.runner.kv_caches[0]
    return [storage] if isinstance(storage, torch.Tensor) else list(storage)


def _widths(engine: LLMEngine) -> list[int]:
    return [engine.tables.kernel_table(g).shape[1] for g in range(engine.runner.num_groups)]


def test_every_size_captured_before_the_first_request(llama_dir: Path) -> None:
    """``capture_all`` (what the engine runs at startup on a GPU) captures sizes 8, 4, 2, 1 over
    all-padding buffers, writing nothing to the cache; the requests then only replay."""
    eager = run(engine_of(llama_dir))
    engine = with_emulated_graphs(engine_of(llama_dir))
    graphs = engine.runner.graphs
    assert graphs is not None
    before = [t.clone() for t in _cache_tensors(engine)]
    assert graphs.capture_all(_widths(engine)) == 4 and graphs.num_captures == 4
    after = _cache_tensors(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "capture wrote KV"
    assert graphs.capture_all(_widths(engine)) == 0  # nothing left to capture
    graphed = run(engine)
    assert graphs.num_captures == 4, "a request's step captured a graph"
    assert graphs.num_replays == max(NEW) - 1
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    assert max_logit_gap(graphed, eager) <= 1e-5
    with pytest.raises(ValueError, match="table_widths"):
        graphs.capture_all([w + 1 for w in _widths(engine)])


def test_graphs_larger_than_the_token_budget_are_refused(llama_dir: Path) -> None:
    """A decode step holds one token a request, so no captured size may pass the runner's
    ``max_num_batched_tokens`` (32 here): the H200 run of an engine with ``max_num_seqs`` 64
    failed its startup capture at size 64 before the runner capped the sizes."""
    engine = engine_of(llama_dir, max_num_seqs=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens=32"):
        DecodeGraphs(engine.runner, 64, capture=False)
    graphs = DecodeGraphs(engine.runner, 32, capture=False)
    engine.runner.graphs = graphs
    assert graphs.sizes[-1] == 32 and graphs.capture_all(_widths(engine)) == len(graphs.sizes)


def test_startup_capture_with_a_kv_connector(llama_dir: Path) -> None:
    """An engine driving a connector captures at startup too: the connector's per-layer calls
    are left out of the capture (no step is under way: its save would have no metadata), and
    the connector is back for the steps."""
    from kv_connectors import OffloadingConfig, OffloadingConnector

    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=4)
    engine = with_emulated_graphs(engine_of(llama_dir, kv_connector=tier))
    graphs = engine.runner.graphs
    assert graphs is not None
    hooks = engine.runner.kv_layer_hooks
    assert hooks is not None
    assert graphs.capture_all(_widths(engine)) == 4
    assert engine.runner.kv_layer_hooks is hooks
    assert [c.token_ids for c in run(engine)] == [c.token_ids for c in run(engine_of(llama_dir))]


def test_planted_capture_over_narrow_tables_replays_nothing(llama_dir: Path) -> None:
    """The check above that the steps replay can fail: buffers captured narrower than the steps'
    tables make every decode step run eagerly (``size_for`` refuses a wider table)."""
    engine = with_emulated_graphs(engine_of(llama_dir))
    graphs = engine.runner.graphs
    assert graphs is not None
    graphs.capture_all([1 for _ in _widths(engine)])
    run(engine)
    assert graphs.num_replays == 0


class _StaleTables(DecodeGraphs):
    """A planted bug: the block tables are never refreshed after the first step's copy, so
    requests attend their first step's pages (the null block past them)."""

    def _fill(self, size: int, input_ids: Any, positions: Any, metadata: Any) -> None:
        keep = [t.clone() for t in self._tables] if self.num_replays else None
        super()._fill(size, input_ids, positions, metadata)
        if keep is not None:
            for t, k in zip(self._tables, keep, strict=True):
                t.copy_(k)


class _NoPadding(DecodeGraphs):
    """A planted bug: padding rows keep the previous step's slots, so the padded replay writes a
    stale token's K/V over a live page."""

    def _fill(self, size: int, input_ids: Any, positions: Any, metadata: Any) -> None:
        old = [s.clone() for s in self._slots]
        super()._fill(size, input_ids, positions, metadata)
        n = input_ids.numel()
        for s, o in zip(self._slots, old, strict=True):
            s[n:size] = o[n:size]


def test_planted_stale_tables_are_caught(llama_dir: Path) -> None:
    # Past their first step's pages the stale rows hold -1: TORCH_SDPA's table check refuses them
    # (a GPU kernel redirects them inside the cache; the logits then differ, as below).
    with pytest.raises(ValueError, match="block table references block -1"):
        run(with_emulated_graphs(engine_of(llama_dir), _StaleTables))


def test_planted_stale_padding_slots_are_caught(llama_dir: Path) -> None:
    eager = run(engine_of(llama_dir))
    graphed = run(with_emulated_graphs(engine_of(llama_dir), _NoPadding))
    assert max_logit_gap(graphed, eager) > 1e-2


def test_mixed_steps_run_eagerly(llama_dir: Path) -> None:
    # A request arriving while others decode makes a mixed step: no replay for it.
    engine = with_emulated_graphs(engine_of(llama_dir))
    engine.add_request("a", PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.step()  # a's prefill (eager)
    engine.step()  # a decode (graph)
    engine.add_request("b", PROMPTS[2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    graphs = engine.runner.graphs
    assert graphs is not None
    before = graphs.num_replays
    engine.step()  # a's decode with b's prefill: mixed, eager
    assert graphs.num_replays == before
    engine.step()  # both decode: a graph of size 2
    assert graphs.num_replays == before + 1
    while engine.has_unfinished:
        engine.step()
    assert len(engine.completion("a").token_ids) == 6


# -- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_replays_graphs_and_matches_eager(llama_dir: Path) -> None:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        eager_engine = engine_of(llama_dir, device="cuda", cuda_graphs=False)
        eager = run(eager_engine)
        engine = engine_of(llama_dir, device="cuda")
        graphed = run(engine)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    graphs = engine.runner.graphs
    assert graphs is not None, engine.runner.cuda_graphs_reason
    assert eager_engine.runner.graphs is None
    assert graphs.num_replays == max(NEW) - 1
    assert graphs.num_captures == 4
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    # float32: the graph's kernels may split KV differently (max_seq_len is max_model_len at
    # capture), which moves sums by rounding only.
    assert max_logit_gap(graphed, eager) <= 1e-4
    # blas="auto": every size timed under torch's default library and cublasLt, the faster kept
    assert set(graphs.blas) == set(graphs.sizes)
    for size, pick in graphs.blas.items():
        times = pick["ms"]
        assert isinstance(times, dict) and set(times) == {_torch_blas(), "cublaslt"}, (size, pick)
        assert pick["picked"] == min(times, key=times.__getitem__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("blas", ["default", "cublaslt"])
def test_gpu_graphs_under_one_blas_library_match_eager(
    llama_dir: Path, blas: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph captured under either library alone gives the eager tokens (float32: the
    libraries' kernels sum in other orders, so logits move by rounding only)."""
    monkeypatch.setenv("KVSTACK_GRAPH_BLAS", blas)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        eager = run(engine_of(llama_dir, device="cuda", cuda_graphs=False))
        engine = engine_of(llama_dir, device="cuda")
        graphed = run(engine)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.num_replays == max(NEW) - 1
    want = _torch_blas() if blas == "default" else "cublaslt"
    assert {p["picked"] for p in graphs.blas.values()} == {want}
    assert all(p["ms"] == {} for p in graphs.blas.values())  # one capture each, none timed
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    assert max_logit_gap(graphed, eager) <= 1e-4


def _torch_blas() -> str:
    return str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()


def test_graph_blas_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTACK_GRAPH_BLAS", "cublas-ish")
    with pytest.raises(ValueError, match=r"KVSTACK_GRAPH_BLAS='cublas-ish' is not one of"):
        default_graph_blas()
    monkeypatch.delenv("KVSTACK_GRAPH_BLAS")
    assert default_graph_blas() == "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_record_rope_fused_into_the_cache_write(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA fused ops are on by default and a backend that writes through kv-kernels'
    ``reshape_and_cache`` alone takes ``rope_and_cache`` (one launch a layer, issue 32): the
    captured decode steps give the unfused engine's tokens, and a planted fused write that stores
    K unrotated must not."""
    import kvstack.engine.attend as attend_mod
    from kv_kernels.reshape_and_cache import reshape_and_cache

    real = attend_mod.rope_and_cache
    fused_calls: list[str] = []

    def counted(*a: Any, **k: Any) -> None:
        fused_calls.append(k["impl"])
        real(*a, **k)

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        plain = engine_of(llama_dir, device="cuda", fused_ops=False)
        assert plain.runner.rope_cache_reason == "off: fused ops off"
        want = run(plain)
        monkeypatch.setattr(attend_mod, "rope_and_cache", counted)
        engine = engine_of(llama_dir, device="cuda")
        why = f"{engine.runner.backends}: {engine.runner.rope_cache_reason}"
        assert engine.runner.rope_cache_reason.startswith("on: 2 of 2"), why
        got = run(engine)
        assert fused_calls and set(fused_calls) == {"triton"}, fused_calls
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.num_replays == max(NEW) - 1
        assert [c.token_ids for c in got] == [c.token_ids for c in want], why
        assert max_logit_gap(got, want) <= 1e-4, why

        def unrotated_k(pos: Any, q: Any, k: Any, v: Any, table: Any, cache: Any, slots: Any,
                        layout: Any, **kw: Any) -> None:  # fmt: skip
            reshape_and_cache(k, v, cache, slots, layout)  # K stored before its rotation
            real(pos, q, k, v, table, cache, torch.full_like(slots, -1), layout, **kw)

        monkeypatch.setattr(attend_mod, "rope_and_cache", unrotated_k)
        buggy = run(engine_of(llama_dir, device="cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert max_logit_gap(buggy, want) > 1e-2
