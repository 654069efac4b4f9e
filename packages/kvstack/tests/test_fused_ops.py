"""The model forward through kv-kernels' fused ops (``ModelRunner(fused_ops=...)``,
``CausalLM.use_fused_ops``): RMSNorm with the residual add, SiLU/GELU-and-mul, RoPE.

On the CPU the default stays the torch code (the transformers parity tests hold its bits);
``fused_ops=True`` there runs the ops' torch references, which checks the wiring the GPU runs (the
residual flow through ``add_norm``, Gemma's ``1 + w``, per-head q/k norms, partial rotary) against
the torch path, and a planted bug shows the comparison can fail. Under ``TRITON_INTERPRET=1`` the
Triton kernels themselves run on the CPU (float32). On a GPU (marked ``gpu``) the engine runs a
tiny bf16 model with CUDA graphs both ways: each is held to a float32 oracle by the parity rule
``err_fused <= RTOL * err_unfused + ATOL`` (a bound that tightens with the problem), and planted
bugs (RoPE pairs interleaved, Gemma's offset dropped) must break it.
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
import kvstack.engine.layers as layers_mod
import kvstack.engine.rotary as rotary_mod
from kv_kernels._common import triton_interpreting
from kvstack.engine.engine import LLMEngine
from kvstack.engine.layers import GatedMLP, RMSNorm
from kvstack.engine.loader import load_model
from kvstack.engine.runner import ModelRunner
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.testing import greedy_generate, make_hf_checkpoint

#: What each family brings: Llama (plain), Qwen3 (per-head q/k norms), Gemma-2 (1 + w sandwich
#: norms, GeGLU), Gemma-3 (q/k norms with 1 + w, a RoPE per layer type), MiMo-V2-Flash (partial
#: rotary, value scale), gpt-oss (norm weight first, YaRN), DeepSeek-V3 (MLA: torch RoPE kept).
CPU_FAMILIES = ["llama", "qwen3", "gemma2", "gemma3", "mimo_v2_flash", "gpt_oss", "deepseek_v3"]
GPU_FAMILIES = ["llama", "qwen3", "gemma2", "gemma3"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(20, 40)), [3, 1, 4, 1, 5], [7] * 11]
NEW = [8, 12, 6, 10]
#: float32, fused references against the torch code: measured equal bit for bit on every family
#: here; a few ulps of slack for the norm's sum order, far below any planted bug.
CPU_RTOL = 1e-5
#: bf16 on a GPU: the fused engine's error against the float32 oracle may be at most twice the
#: unfused engine's, plus a bf16 ulp of a logit of order 10 (fewer roundings: usually smaller).
RTOL, ATOL = 2.0, 0.05

FUSED_FNS = [
    (layers_mod, "rms_norm"),
    (layers_mod, "silu_and_mul"),
    (layers_mod, "gelu_tanh_and_mul"),
    (rotary_mod, "rotary_embedding"),
    (attend_mod, "rope_and_cache"),  # RoPE in the cache write, where the backend allows
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    return {f: make_hf_checkpoint(f, root / f, seed=1) for f in CPU_FAMILIES}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts of the fused ops' calls from the model code (installed before a model is built:
    GatedMLP keeps its activation op from build time)."""
    counter: collections.Counter[str] = collections.Counter()
    for mod, name in FUSED_FNS:
        fn = getattr(mod, name)

        def counted(*a: Any, _fn: Callable[..., Any] = fn, _n: str = name, **k: Any) -> Any:
            counter[_n] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    return counter


def plant_interleaved_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused RoPE with GPT-J pairs (2i, 2i + 1) where the families rotate halves (alone
    and in the cache write)."""
    for mod, name in ((rotary_mod, "rotary_embedding"), (attend_mod, "rope_and_cache")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, **k: _f(*a, **{**k, "is_neox": False}))


def plant_no_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused norms without Gemma's ``1 + w`` (weight_offset dropped)."""
    real = layers_mod.rms_norm
    monkeypatch.setattr(
        layers_mod, "rms_norm", lambda *a, **k: real(*a, **{**k, "weight_offset": 0.0})
    )


# -- CPU -------------------------------------------------------------------------------------------


def _runner(path: Path, **kw: Any) -> ModelRunner:
    return ModelRunner(path, num_blocks=96, max_model_len=128, **kw)


def _cpu_gap(torch_runner: ModelRunner, fused_runner: ModelRunner) -> tuple[bool, float]:
    """(tokens equal, max logit gap over the logits' scale) of two runners' greedy runs."""
    a = greedy_generate(torch_runner, PROMPTS, 6, chunk_sizes=[4, 100, 2, 100])
    b = greedy_generate(fused_runner, PROMPTS, 6, chunk_sizes=[4, 100, 2, 100])
    gap = max(
        float((x - y).abs().max() / x.abs().max()) for x, y in zip(a.logits, b.logits, strict=True)
    )
    return a.tokens == b.tokens, gap


def test_cpu_default_is_the_torch_code(checkpoints: dict[str, Path]) -> None:
    runner = _runner(checkpoints["qwen3"])
    assert runner.fused_ops is False and runner.model.fused_ops is None
    norm = runner.model.decoder_layers()[0].input_layernorm
    assert "forward" not in norm.__dict__ and "add_norm" not in norm.__dict__
    assert all(r.cos_sin_cache is None for r in runner.model.rotaries.values())
    with pytest.raises(TypeError, match="fused_ops='yes' must be None, True or False"):
        _runner(checkpoints["qwen3"], fused_ops="yes")


@pytest.mark.parametrize("family", CPU_FAMILIES)
def test_fused_wiring_matches_the_torch_code(
    family: str, checkpoints: dict[str, Path], calls: collections.Counter[str]
) -> None:
    plain = _runner(checkpoints[family])
    fused = _runner(checkpoints[family], fused_ops=True)
    model = fused.model
    assert fused.fused_ops and model.fused_ops == "auto"
    assert model.fused_rope == (None if model.arch.is_mla else "auto")
    if model.fused_rope is not None:  # one table per RoPE, covering the positions served
        for rot in model.rotaries.values():
            table = rot.cos_sin_cache
            assert isinstance(table, torch.Tensor) and table.shape[0] >= 128
    same_tokens, gap = _cpu_gap(plain, fused)
    assert same_tokens and gap <= CPU_RTOL, (family, gap)
    assert calls["rms_norm"] > 0
    assert calls["silu_and_mul"] + calls["gelu_tanh_and_mul"] > 0 or model.arch.is_moe
    assert (calls["rotary_embedding"] > 0) == (not model.arch.is_mla)


@pytest.mark.parametrize(
    ("family", "plant"),
    [("llama", plant_interleaved_rope), ("gemma2", plant_no_offset)],
    ids=["rope pairs interleaved", "gemma norms without 1 + w"],
)
def test_planted_bug_breaks_the_cpu_comparison(
    family: str,
    plant: Callable[[pytest.MonkeyPatch], None],
    checkpoints: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = _runner(checkpoints[family])
    fused = _runner(checkpoints[family], fused_ops=True)
    plant(monkeypatch)
    _, gap = _cpu_gap(plain, fused)
    assert gap > 100 * CPU_RTOL, gap


def test_use_fused_ops_none_restores_the_torch_code(checkpoints: dict[str, Path]) -> None:
    runner = _runner(checkpoints["gemma3"], fused_ops=True)
    runner.model.use_fused_ops(None)
    assert runner.model.fused_ops is None and runner.model.fused_rope is None
    for m in runner.model.modules():
        if isinstance(m, RMSNorm | GatedMLP):
            assert "forward" not in m.__dict__, m
    same_tokens, gap = _cpu_gap(_runner(checkpoints["gemma3"]), runner)
    assert same_tokens and gap == 0.0


def test_engine_passes_fused_ops_to_the_runner(checkpoints: dict[str, Path]) -> None:
    engine = LLMEngine(checkpoints["llama"], fused_ops=True, num_blocks=40, max_model_len=64)
    assert engine.runner.fused_ops and engine.runner.model.fused_ops == "auto"


@pytest.mark.skipif(
    not triton_interpreting(), reason="set TRITON_INTERPRET=1 to run the Triton kernels on the CPU"
)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mimo_v2_flash"])
def test_triton_kernels_under_the_interpreter(family: str, checkpoints: dict[str, Path]) -> None:
    fused = _runner(checkpoints[family])
    fused.model.use_fused_ops("triton", max_positions=fused.max_model_len)
    same_tokens, gap = _cpu_gap(_runner(checkpoints[family]), fused)
    # float32 in the kernels too; their exp/rsqrt and sum order move the last bits
    assert same_tokens and gap <= 1e-5, gap


# -- GPU -------------------------------------------------------------------------------------------


def _gpu_engine(path: Path, fused: bool) -> LLMEngine:
    return LLMEngine(
        path, device="cuda", dtype=torch.bfloat16, fused_ops=fused, keep_logits=True,
        block_size=16, num_blocks=64, max_model_len=128, max_num_batched_tokens=64,
        max_num_seqs=4,
    )  # fmt: skip


def _oracle_errors(engine: LLMEngine, oracle: Any) -> tuple[list[float], list[list[int]]]:
    """Per request: max |engine logits - float32 oracle logits| along the engine's own tokens
    (teacher-forced: a near-tie that flips a token does not compare two different prefixes),
    and the tokens. Tokens may differ between two bf16 engines only where the oracle's two best
    logits lie within the engines' errors, so the bound on the errors is the test."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW]
    errors, tokens = [], []
    for prompt, c in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        toks = list(c.token_ids)
        seq = torch.tensor(prompt + toks[:-1], device="cuda")
        ref = oracle.forward_dense(seq)[len(prompt) - 1 :].float().cpu()  # [n, vocab]
        assert c.logits is not None
        errors.append(float((c.logits.float().cpu() - ref).abs().max()))
        tokens.append(toks)
    return errors, tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_fused_engine_matches_unfused_within_bf16(
    family: str,
    checkpoints: dict[str, Path],
    calls: collections.Counter[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 oracle in float32
    try:
        oracle = load_model(checkpoints[family], dtype=torch.float32, device="cuda")
        assert oracle.fused_ops is None  # (the loader never switches them on)
        plain = _gpu_engine(checkpoints[family], fused=False)
        err_plain, tok_plain = _oracle_errors(plain, oracle)
        assert not calls, calls  # the unfused engine never reached a fused op
        fused = _gpu_engine(checkpoints[family], fused=True)
        assert fused.runner.fused_ops and fused.runner.model.fused_rope == "auto"
        err_fused, tok_fused = _oracle_errors(fused, oracle)
        # the decode steps replayed CUDA graphs captured with the fused kernels in them
        graphs = fused.runner.graphs
        assert graphs is not None and graphs.num_replays > 0, fused.runner.cuda_graphs_reason
        # RoPE rides in the cache write where the backend writes with reshape_and_cache alone
        fused_write = fused.runner.rope_cache_reason.startswith("on:")
        rope_calls = calls["rope_and_cache" if fused_write else "rotary_embedding"]
        assert calls["rms_norm"] and rope_calls, (calls, fused.runner.rope_cache_reason)
        assert calls["silu_and_mul" if family in ("llama", "qwen3") else "gelu_tanh_and_mul"]
        pairs = zip(tok_plain, tok_fused, strict=True)
        same = sum(a == b for p, f in pairs for a, b in zip(p, f, strict=True))
        why = f"{family}: fused {err_fused}, unfused {err_plain}, {same}/{sum(NEW)} tokens equal"
        for e_f, e_p in zip(err_fused, err_plain, strict=True):
            assert e_f <= RTOL * e_p + ATOL, why

        # Planted bugs on the same path must break the bound (the comparison can fail).
        plant = plant_no_offset if family.startswith("gemma") else plant_interleaved_rope
        plant(monkeypatch)
        buggy = _gpu_engine(checkpoints[family], fused=True)
        err_bug, _ = _oracle_errors(buggy, oracle)
        assert any(e_b > RTOL * e_p + ATOL for e_b, e_p in zip(err_bug, err_plain, strict=True)), (
            family,
            err_bug,
            err_plain,
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
