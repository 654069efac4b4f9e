"""RoPE fused into the cache write (``kvstack.engine.attend``, issue 32).

With fused ops on, a layer whose backend writes its cache through kv-kernels'
``reshape_and_cache`` alone (FLEX_ATTENTION here, on the CPU; FLASH_ATTN / TRITON on a GPU)
rotates q and k and writes the rotated K with V in one ``rope_and_cache`` call instead of
``rotary_embedding`` then ``do_kv_cache_update``. On the CPU both run the kernels' torch references,
so the fused engine must give the unfused engine's logits bit for bit and the dense reference's
tokens; under ``TRITON_INTERPRET=1`` the Triton kernel itself runs in the engine. Planted bugs
(K written unrotated, a neighbour's slot, GPT-J pairs) must break each comparison. fp8 caches,
MLA, TORCH_SDPA's own write and fused ops off keep the two launches.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import kvstack.engine.attend as attend_mod
import kvstack.engine.rotary as rotary_mod
from kv_backends import AttentionImpl, get_backend
from kv_backends.testing import make_batch_impl, make_paged_batch
from kv_kernels._common import triton_interpreting
from kv_kernels.reshape_and_cache import reshape_and_cache
from kvstack.demo import check_greedy
from kvstack.engine.attend import RopeWrite, rope_cache_writes
from kvstack.engine.engine import LLMEngine
from kvstack.engine.graphs import DecodeGraphs
from kvstack.engine.runner import ModelRunner
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.testing import GreedyResult, greedy_generate, make_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

#: Llama (plain), Qwen3 (q/k norms first), Gemma-3 (a RoPE per layer type, sliding layers),
#: MiMo-V2-Flash (partial rotary, v_head_dim != head_dim, sinks, sliding), gpt-oss (YaRN,
#: sinks), DeepSeek-V3 (MLA: stays two steps).
FAMILIES = ["llama", "qwen3", "gemma3", "mimo_v2_flash", "gpt_oss", "deepseek_v3"]
FUSING = FAMILIES[:-1]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(20, 40)), [3, 1, 4, 1, 5]]
CHUNKS = [4, 100, 2]
NEW = 5
#: float32 references on both paths: measured equal bit for bit; the slack is far below any
#: planted bug (those move the logits by > 1e-2 of their scale).
CPU_RTOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rope_cache")
    return {f: make_hf_checkpoint(f, root / f, seed=1) for f in FAMILIES}


def _runner(path: Path, **kw: Any) -> ModelRunner:
    args: dict[str, Any] = dict(num_blocks=96, max_model_len=128, backend="FLEX_ATTENTION")
    return ModelRunner(path, **(args | kw))


def _generate(runner: ModelRunner) -> GreedyResult:
    return greedy_generate(runner, PROMPTS, NEW, chunk_sizes=CHUNKS)


def _gap(a: GreedyResult, b: GreedyResult) -> float:
    """Max logit gap over the logits' scale."""
    return max(
        float((x - y).abs().max() / x.abs().max()) for x, y in zip(a.logits, b.logits, strict=True)
    )


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts of the engine's calls to ``rope_and_cache``, the impls' ``do_kv_cache_update`` and
    the fused RoPE's ``rotary_embedding``."""
    counter: collections.Counter[str] = collections.Counter()
    targets = [
        (attend_mod, "rope_and_cache"),
        (rotary_mod, "rotary_embedding"),
        (AttentionImpl, "do_kv_cache_update"),
    ]
    for owner, name in targets:
        fn = getattr(owner, name)

        def counted(*a: Any, _fn: Callable[..., Any] = fn, _n: str = name, **k: Any) -> Any:
            counter[_n] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(owner, name, counted)
    return counter


def _plant(monkeypatch: pytest.MonkeyPatch, fn: Callable[..., None]) -> None:
    monkeypatch.setattr(attend_mod, "rope_and_cache", fn)


def plant_unrotated_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused write stores K before rotating it (q and k still rotated in place)."""

    def bug(pos: Any, q: Any, k: Any, v: Any, table: Any, cache: Any, slots: Any, layout: Any,
            **kw: Any) -> None:  # fmt: skip
        reshape_and_cache(k, v, cache, slots, layout)
        rotary_mod.rotary_embedding(pos, q, k, table, is_neox=True, impl="reference")

    _plant(monkeypatch, bug)


def plant_neighbour_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused write sends token ``t`` to its block neighbour's slot (``slot ^ 1``)."""
    real = attend_mod.rope_and_cache

    def bug(pos: Any, q: Any, k: Any, v: Any, table: Any, cache: Any, slots: Any, *a: Any,
            **kw: Any) -> None:  # fmt: skip
        real(pos, q, k, v, table, cache, torch.where(slots >= 0, slots ^ 1, slots), *a, **kw)

    _plant(monkeypatch, bug)


def plant_gptj_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused write rotates GPT-J pairs (2i, 2i + 1) where the families rotate halves."""
    real = attend_mod.rope_and_cache
    _plant(monkeypatch, lambda *a, **k: real(*a, **{**k, "is_neox": False}))


# -- which layers fuse --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FUSING)
def test_fused_write_is_taken_and_matches_unfused_and_dense(
    family: str, checkpoints: dict[str, Path], calls: collections.Counter[str]
) -> None:
    plain = _generate(_runner(checkpoints[family]))
    assert not calls["rope_and_cache"]  # fused ops off: the two steps
    calls.clear()
    runner = _runner(checkpoints[family], fused_ops=True)
    n = runner.arch.num_layers
    assert all(isinstance(w, RopeWrite) for w in runner.rope_writes)
    assert runner.rope_cache_reason == (
        f"on: {n} of {n} layers rotate q/k in their cache write (rope_and_cache)"
    )
    assert "RoPE in the cache write on:" in runner.describe()
    fused = _generate(runner)
    # every layer of every step: one fused call, no separate RoPE or write
    assert calls["rope_and_cache"] == n * fused.steps, calls
    assert calls["do_kv_cache_update"] == 0 and calls["rotary_embedding"] == 0, calls
    assert fused.tokens == plain.tokens
    assert _gap(plain, fused) <= CPU_RTOL
    model = runner.model
    for prompt, toks, logits in zip(PROMPTS, fused.tokens, fused.logits, strict=True):
        ref = model.forward_dense(torch.tensor(prompt + toks[:-1]))[len(prompt) - 1 :]
        assert check_greedy(ref, toks).exact
        assert float((logits - ref).abs().max()) < 1e-4


@pytest.mark.parametrize(
    "plant",
    [plant_unrotated_k, plant_neighbour_slot, plant_gptj_pairs],
    ids=["K written unrotated", "neighbour slot", "GPT-J pairs"],
)
def test_planted_fused_write_bugs_break_the_comparison(
    plant: Callable[[pytest.MonkeyPatch], None],
    checkpoints: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = _generate(_runner(checkpoints["llama"]))
    fused = _runner(checkpoints["llama"], fused_ops=True)
    plant(monkeypatch)
    assert _gap(plain, _generate(fused)) > 100 * CPU_RTOL


@pytest.mark.parametrize(
    ("family", "kw", "why"),
    [
        ("llama", {}, "off: fused ops off"),
        ("llama", {"fused_ops": True, "backend": None}, "off: KeptGatherSDPAImpl writes its "
         "cache its own way"),
        ("llama", {"fused_ops": True, "backend": None, "kv_cache_dtype": "fp8"},
         "off: the fp8_e4m3 cache's write needs its scales"),
        ("deepseek_v3", {"fused_ops": True}, "off: MLA keeps its interleaved RoPE in torch"),
    ],
    ids=["fused ops off", "TORCH_SDPA", "fp8 cache", "MLA"],
)  # fmt: skip
def test_two_steps_where_the_layer_does_not_allow_the_fusion(
    family: str,
    kw: dict[str, Any],
    why: str,
    checkpoints: dict[str, Path],
    calls: collections.Counter[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = _runner(checkpoints[family], **kw)
    assert runner.rope_writes == (None,) * runner.arch.num_layers
    assert runner.rope_cache_reason == why
    writes: list[int] = []
    for b in runner.layers:  # (TORCH_SDPA's own write does not reach the base method)
        real = b.impl.do_kv_cache_update

        def counted(*a: Any, _real: Callable[..., None] = real) -> None:
            writes.append(1)
            _real(*a)

        monkeypatch.setattr(b.impl, "do_kv_cache_update", counted)
    greedy_generate(runner, PROMPTS[:1], 2)
    assert calls["rope_and_cache"] == 0 and len(writes) == 2 * runner.arch.num_layers


def test_the_decision_reads_the_backends_write(checkpoints: dict[str, Path]) -> None:
    """TRITON impls on the CPU (nothing runs here: the decision only): an unquantized cache
    whose write runs the RoPE's implementation fuses; its fp8 twin does not (scales); a write
    of another implementation than the RoPE's does not either."""
    model = _runner(checkpoints["llama"]).model
    triton = get_backend("TRITON")
    cpu = torch.device("cpu")
    batch = make_paged_batch(query_lens=[1], seq_lens=[4])
    fp8 = make_paged_batch(query_lens=[1], seq_lens=[4], kv_cache_dtype="fp8_e4m3")
    impls = [make_batch_impl(triton, batch), make_batch_impl(triton, fp8)]
    model.use_fused_ops("triton", max_positions=128)
    writes, why = rope_cache_writes(model, impls, cpu)
    assert writes == (RopeWrite("triton", None, "triton"), None)
    assert why == (
        "on: 1 of 2 layers rotate q/k in their cache write (rope_and_cache); "
        "the others not: the fp8_e4m3 cache's write needs its scales"
    )
    model.use_fused_ops("auto", max_positions=128)  # auto is the reference on the CPU
    writes, why = rope_cache_writes(model, impls[:1], cpu)
    assert writes == (None,)
    assert why == (
        "off: the cache write runs impl='triton' and the RoPE impl='auto', not one "
        "implementation on cpu"
    )


# -- around the write: hooks, switches, graphs ---------------------------------------------------


class _Recorder:
    """Connector hooks that copy each layer's cache view as ``after_attention`` sees it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.seen: dict[int, torch.Tensor] = {}

    def before_attention(self, layer_slot: int) -> None:
        pass

    def after_attention(self, layer_slot: int) -> None:
        view = next(b.kv_cache for b in self.runner.layers if b.layer_slot == layer_slot)
        self.seen[layer_slot] = view.clone()

    def before_replay(self) -> None:
        pass


def test_connector_hooks_see_each_layer_after_its_fused_write(
    checkpoints: dict[str, Path],
) -> None:
    runner = _runner(checkpoints["llama"], fused_ops=True)
    recorder = _Recorder(runner)
    runner.kv_layer_hooks = recorder
    greedy_generate(runner, PROMPTS[:1], 1)  # one step: the prompt's prefill
    assert sorted(recorder.seen) == sorted(b.layer_slot for b in runner.layers)
    for b in runner.layers:  # what a save read is the layer's written cache, all of it
        assert torch.equal(recorder.seen[b.layer_slot], b.kv_cache)
        assert recorder.seen[b.layer_slot].abs().sum() > 0


def test_switching_fused_ops_after_the_build_keeps_the_results(
    checkpoints: dict[str, Path], calls: collections.Counter[str]
) -> None:
    plain = _generate(_runner(checkpoints["qwen3"]))
    runner = _runner(checkpoints["qwen3"], fused_ops=True)
    runner.model.use_fused_ops("reference", max_positions=128)  # not the RoPE decided for
    assert _gap(plain, _generate(runner)) <= CPU_RTOL
    assert calls["rope_and_cache"] == 0 and calls["rotary_embedding"] > 0  # the two steps
    runner.model.use_fused_ops(None)  # torch's RoPE: every layer rotates its own
    assert _gap(plain, _generate(runner)) <= CPU_RTOL
    assert calls["rope_and_cache"] == 0


def test_emulated_decode_graphs_record_the_fused_write(
    llama_dir: Path, calls: collections.Counter[str]
) -> None:
    """The decode step a CUDA graph records (``capture=False`` on the CPU: the recorded step
    called again) takes the fused write and gives the eager unfused engine's tokens."""
    prompts, new = [[5, 6, 7, 8, 9], [5, 6, 7, 40], [99] * 12], [3, 6, 4]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new]
    kw: dict[str, Any] = dict(
        block_size=16, num_blocks=40, max_model_len=64, max_num_batched_tokens=32,
        max_num_seqs=4, backend="FLEX_ATTENTION", keep_logits=True,
    )  # fmt: skip
    eager = LLMEngine(llama_dir, **kw).generate(prompts, params)
    engine = LLMEngine(llama_dir, fused_ops=True, **kw)
    assert engine.runner.rope_cache_reason.startswith("on: 2 of 2")
    engine.runner.graphs = DecodeGraphs(engine.runner, 4, capture=False)
    graphed = engine.generate(prompts, params)
    graphs = engine.runner.graphs
    assert graphs.num_replays == max(new) - 1 and calls["rope_and_cache"] > 0
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    for a, b in zip(graphed, eager, strict=True):
        assert a.logits is not None and b.logits is not None
        assert float((a.logits - b.logits).abs().max()) <= 1e-5


# -- the Triton kernel in the engine, under the interpreter ---------------------------------------


@pytest.mark.skipif(
    not triton_interpreting(), reason="set TRITON_INTERPRET=1 to run the Triton kernels on the CPU"
)
@pytest.mark.parametrize(("family", "bug"), [
    ("llama", False), ("mimo_v2_flash", False), ("qwen3", False), ("llama", True),
], ids=["llama", "mimo_v2_flash", "qwen3", "llama GPT-J pairs (planted)"])  # fmt: skip
def test_triton_fused_write_under_the_interpreter(
    family: str, bug: bool, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _generate(_runner(checkpoints[family]))
    fused = _runner(checkpoints[family], fused_ops=True)
    real = attend_mod.rope_and_cache
    extra = {"is_neox": False} if bug else {}
    ran: list[str] = []

    def on_triton(*a: Any, **k: Any) -> None:
        ran.append(k["impl"])
        real(*a, **{**k, "impl": "triton", **extra})

    _plant(monkeypatch, on_triton)
    gap = _gap(plain, _generate(fused))
    assert ran and set(ran) == {"reference"}  # what the engine chose on the CPU
    if bug:
        assert gap > 100 * CPU_RTOL, gap
    else:  # float32 in the kernel too: the same products, in registers
        assert gap <= CPU_RTOL, gap
