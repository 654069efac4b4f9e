"""DeepSeek-V3's prefill rows over decompressed K/V (:mod:`kvstack.engine.mla_prefill`, issue 29).

- The pass planner (host only): contexts that fit the workspace are one causal pass; a longer
  one is a causal tail holding its new tokens plus non-causal earlier pieces, every key once;
  passes stay within the workspace; bad options are refused by name.
- Parity (float32, the CPU's latent cache through TORCH_SDPA): one schedule -- chunked prefill
  (the context only in the cache), mixed steps (decodes beside a prefill chunk), padding rows --
  served with prefill rows decompressed and with every row absorbed (``runner.mla_prefill =
  None``). Every MLA layer's attention output and every logit agree within ``TOL`` of their
  largest magnitude; also with a workspace small enough to split contexts over passes merged by
  their LSEs.
- Planted bugs the same bound must catch: the prefix context dropped from the decompressed K/V,
  another request's pages, the shared rope key missing from K, the causal mask off, and (split
  contexts) the earlier passes dropped.
- The workspace's kernels at DeepSeek-V3's heads (bf16 192 / 128, one KV head per query head,
  128-token pages; causal, and non-causal with LSE) compile for sm_90 on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from kvstack.engine import mla_prefill
from kvstack.engine.mla import MLAAttention
from kvstack.engine.mla_prefill import MLAPrefill, Pass, Piece, plan_passes
from kvstack.engine.runner import ModelRunner
from kvstack.engine.testing import GreedyResult, greedy_generate, make_hf_checkpoint

#: float32, the same math summed in another order (absorbed: q . W_UK c; decompressed:
#: q . (W_UK c)): measured ~2e-6 of the largest value; a wrong key, page or mask moves outputs
#: by O(1) of it.
TOL = 2e-5
PROMPTS = [list(range(3, 30)), [0, 9, 17, 0, 2, 8, 100]]
MAX_NEW = 5

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mla") / "ds", seed=1)


# -- the planner --------------------------------------------------------------------------------


def test_contexts_that_fit_are_one_causal_pass() -> None:
    passes = plan_passes([5, 1, 7, 0], [20, 9, 7, 3], block=8, capacity=64)
    assert passes == [Pass(True, (Piece(0, 0, 20), Piece(2, 0, 7)))]  # decodes and empties out


def test_pieces_cover_every_key_once_within_the_workspace() -> None:
    rng = random.Random(0)
    for _ in range(300):
        block = rng.choice([1, 4, 16])
        capacity = block * rng.randint(2, 12)
        n = rng.randint(1, 6)
        qlens = [rng.choice([0, 1, rng.randint(2, capacity)]) for _ in range(n)]
        seqs = [q + rng.choice([0, rng.randint(0, 5 * capacity)]) for q in qlens]
        passes = plan_passes(qlens, seqs, block=block, capacity=capacity)
        for p in passes:
            assert len({x.req for x in p.pieces}) == len(p.pieces)  # a request once a pass
            assert sum(-(-(x.stop - x.start) // block) for x in p.pieces) <= capacity // block
        for r, (q, s) in enumerate(zip(qlens, seqs, strict=True)):
            mine = [(p.causal, x) for p in passes for x in p.pieces if x.req == r]
            if q <= 1:
                assert mine == []
                continue
            keys = sorted(k for _, x in mine for k in range(x.start, x.stop))
            assert keys == list(range(s))
            (tail,) = [x for c, x in mine if c]
            assert tail.stop == s and tail.stop - tail.start >= q  # holds every new token
            assert all(x.stop <= s - q for c, x in mine if not c)  # before every query


def test_step_metadata_parts_start_16_byte_aligned() -> None:
    """Each part of a step's uploaded metadata starts on 16 bytes, as the warmup's tensors do:
    Triton specializes pointer arguments on that, and parts packed back to back (3, 5 and 2
    int32s) compiled new attention variants inside serving on the H200. Values round-trip."""
    import numpy as np

    for dtype, npt in ((torch.int32, np.int32), (torch.int64, np.int64)):
        parts = [np.arange(n, dtype=npt) + 10 * n for n in (3, 5, 2, 0, 7)]
        parts[1] = parts[1].reshape(5, 1)
        out = mla_prefill._to_device(parts, dtype, torch.device("cpu"))
        for t, p in zip(out, parts, strict=True):
            assert t.data_ptr() % 16 == 0, (dtype, p.size)
            assert t.dtype == dtype and t.shape == p.shape
            assert np.array_equal(t.numpy(), p)


def test_bad_options_and_steps_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="query_len=9 must be <= seq_len=20 and <= the MLA"):
        plan_passes([9], [20], block=4, capacity=8)
    with pytest.raises(ValueError, match="2 query_lens and 1 seq_lens"):
        plan_passes([2, 2], [4], block=4, capacity=8)
    with pytest.raises(ValueError, match=r"workspace_tokens=100 must be a multiple .* give 128"):
        MLAPrefill(max_query_len=64, workspace_tokens=100)
    with pytest.raises(ValueError, match=r">= 256 \(max_query_len=200 rounded up"):
        MLAPrefill(max_query_len=200, workspace_tokens=128)
    with pytest.raises(TypeError, match="workspace_tokens='8' is a str"):
        MLAPrefill(max_query_len=8, workspace_tokens="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_query_len=0 must be a positive int"):
        MLAPrefill(max_query_len=0)
    with pytest.raises(TypeError, match="block=16.0 is a float; give an int"):
        MLAPrefill(max_query_len=8, block=16.0)  # type: ignore[arg-type]
    assert MLAPrefill(max_query_len=40000).workspace_tokens == 40064  # (whole 128-token pages)


# -- parity with the absorbed form --------------------------------------------------------------


def _record(mp: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every MLA layer's attention output ``[T, H, v]`` from now on, in call order."""
    outs: list[torch.Tensor] = []
    attend_latent = MLAAttention.attend_latent

    def record(self: MLAAttention, *args: Any) -> torch.Tensor:
        out = attend_latent(self, *args)
        outs.append(out.detach().clone())
        return out

    mp.setattr(MLAAttention, "attend_latent", record)
    return outs


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    return _record(monkeypatch)


def _serve(
    ckpt: Path, outs: list[torch.Tensor], *, decompressed: bool, small: bool
) -> tuple[GreedyResult, list[torch.Tensor], ModelRunner]:
    """The schedule, recorded: ``small`` caps the step at 8 tokens and the workspace at 8 (pages
    of 4), so the 27-token prompt's context is split over passes."""
    batched = 8 if small else 64
    runner = ModelRunner(ckpt, num_blocks=96, max_model_len=64, max_num_batched_tokens=batched)
    if not decompressed:
        runner.mla_prefill = None
    elif small:
        runner.mla_prefill = MLAPrefill(max_query_len=8, workspace_tokens=8, block=4)
    outs.clear()
    chunks, pad = ([4, 4], 0) if small else ([5, 100], 2)
    result = greedy_generate(runner, PROMPTS, MAX_NEW, chunk_sizes=chunks, pad_tokens=pad)
    return result, list(outs), runner


def _error(got: tuple[GreedyResult, list[torch.Tensor], Any], want: tuple[Any, ...]) -> float:
    """The largest error of any layer output or logit row, relative to its largest magnitude."""
    pairs = list(zip(got[1], want[1], strict=True)) + list(
        zip(got[0].logits, want[0].logits, strict=True)
    )
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)


@pytest.fixture(scope="module")
def absorbed(
    ckpt: Path, one_thread: None
) -> dict[bool, tuple[GreedyResult, list[torch.Tensor], ModelRunner]]:
    """The reference runs (every row absorbed), for both step caps."""
    with pytest.MonkeyPatch.context() as mp:
        outs = _record(mp)
        return {
            small: _serve(ckpt, outs, decompressed=False, small=small) for small in (False, True)
        }


@pytest.mark.parametrize("small", [False, True], ids=["one_pass", "split_contexts"])
def test_decompressed_prefill_equals_absorbed(
    ckpt: Path, absorbed: dict[bool, Any], recorded: list[torch.Tensor], small: bool
) -> None:
    got = _serve(ckpt, recorded, decompressed=True, small=small)
    result, _, runner = got
    want = absorbed[small]
    assert result.tokens == want[0].tokens
    assert _error(got, want) <= TOL
    # The schedule held what the path must handle, and only steps with prefill rows split.
    stats = runner.mla_prefill.stats
    prefill_steps = sum(max(shape) > 1 for shape in result.step_shapes)
    assert stats.steps == prefill_steps < result.steps
    assert stats.rows == sum(map(len, PROMPTS))  # every prompt token, in chunks
    assert stats.cached_keys > 0 and stats.decode_rows > 0  # chunks' context, mixed steps
    assert (stats.split_requests > 0) == small
    assert (stats.passes > stats.steps) == small
    assert "MLA prefill: prefill rows (query_len > 1) attend decompressed" in runner.describe()


def _drop_prefix(q: list[int], s: list[int], **kw: Any) -> list[Pass]:
    passes = _PLAN(q, s, **kw)
    return [
        Pass(True, tuple(Piece(x.req, max(x.start, s[x.req] - q[x.req]), x.stop) for x in p.pieces))
        for p in passes
        if p.causal
    ]


def _causal_off(q: list[int], s: list[int], **kw: Any) -> list[Pass]:
    return [Pass(False, p.pieces) for p in _PLAN(q, s, **kw)]


def _only_tails(q: list[int], s: list[int], **kw: Any) -> list[Pass]:
    return [p for p in _PLAN(q, s, **kw) if p.causal]


def _other_pages(table: torch.Tensor, *args: Any) -> torch.Tensor:
    return _SLOTS(table.flip(0), *args)


def _no_rope_key(ws: torch.Tensor, dst: torch.Tensor, k_nope: Any, k_pe: Any, v: Any) -> None:
    _FILL(ws, dst, k_nope, torch.zeros_like(k_pe), v)


_PLAN, _SLOTS, _FILL = plan_passes, mla_prefill.context_slots, mla_prefill.fill_workspace
PLANTS = [
    ("prefix dropped", "plan_passes", _drop_prefix, False),
    ("another request's pages", "context_slots", _other_pages, False),
    ("rope key missing from K", "fill_workspace", _no_rope_key, False),
    ("causal mask off", "plan_passes", _causal_off, False),
    ("earlier passes dropped", "plan_passes", _only_tails, True),
]


@pytest.mark.parametrize(("name", "attr", "plant", "small"), PLANTS, ids=[p[0] for p in PLANTS])
def test_planted_bugs_fail_the_bound(
    ckpt: Path, absorbed: dict[bool, Any], recorded: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch, name: str, attr: str, plant: Any, small: bool,
) -> None:  # fmt: skip
    monkeypatch.setattr(mla_prefill, attr, plant)
    err = _error(_serve(ckpt, recorded, decompressed=True, small=small), absorbed[small])
    assert err > 100 * TOL, f"{name}: {err:.2e}"


def test_runners_without_a_latent_cache_have_no_split(llama_dir: Path, ckpt: Path) -> None:
    assert ModelRunner(llama_dir, num_blocks=64, max_model_len=64).mla_prefill is None
    forced = ModelRunner(ckpt, num_blocks=96, max_model_len=64, backend="FLEX_ATTENTION")
    assert not forced.mla_latent and forced.mla_prefill is None  # K/V decompressed in the cache


def test_startup_warms_the_workspace_attention(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm_kernels`` builds the workspace attention's kernels too (its variants compiled in
    the first mixed steps of a GPU run otherwise), with the options :func:`attend_split` uses;
    each warmup launch runs here through the reference (on the CPU nothing compiles), so the
    one-page layout and the keywords are ones ``paged_attention`` takes."""
    from kv_kernels.cache import allocate_kv_cache, layer_view
    from kv_kernels.warmup import _run, warmup_calls

    runner = ModelRunner(ckpt, num_blocks=96, max_model_len=64)
    prefill = runner.mla_prefill
    assert prefill is not None
    seen: list[tuple[Any, ...]] = []

    def record(attn: MLAAttention, dtype: torch.dtype, device: Any, max_len: int, scale: float):
        seen.append((attn, dtype, max_len, scale))
        return {}

    monkeypatch.setattr(prefill, "warmup", record)
    done = runner.warm_kernels(lambda g: torch.zeros(1, 8, dtype=torch.int32))
    assert "mla prefill workspace" in done
    ((attn, dtype, max_len, scale),) = seen
    assert isinstance(attn, MLAAttention) and dtype == runner.dtype
    assert (max_len, scale) == (64, runner.model.scale)
    layout, kw = MLAPrefill.warmup_args(prefill, attn, dtype, max_len, scale)
    assert layout.num_blocks == 1 and (layout.head_size, layout.head_size_v) == (
        attn.head_dim, attn.v_head_dim,
    )  # fmt: skip
    view = layer_view(allocate_kv_cache(layout, "cpu"), layout, 0)
    heads = kw.pop("num_q_heads")
    calls = warmup_calls(layout, max_seq_len=kw.pop("max_seq_len"))
    assert {c.op for c in calls} == {"write", "attention"}
    for call in calls:
        _run(call, view, layout, num_q_heads=heads, q_dtype=dtype, scratch_block=0,
             attention_kwargs=dict(kw))  # fmt: skip


# -- the workspace's kernels compile for sm_90 --------------------------------------------------

_AOT = textwrap.dedent(
    r"""
    import importlib, json, re, sys, types, traceback
    import torch
    from kv_kernels.aot import aot_compile, build_problems
    from kv_kernels.paged_attention._sm90_prefill import aot_case
    from kv_kernels.paged_attention.triton import aot_specs

    def build(name):
        if name == "triton":  # the Triton kernel's prefill: off sm_90, fp32, or
            # KV_KERNELS_SM90_PREFILL=0 (the workspace's sequences all have query_len > 1)
            sp, = [sp for sp in aot_specs(
                q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, head_size=192,
                head_size_v=128, num_q_heads=16, num_kv_heads=16, block_size=128, arch=90,
            ) if sp.name == "attn_prefill"]
            ck = aot_compile(types.SimpleNamespace(fn=sp.kernel), sp.signature, sp.constexprs,
                             arch=90, num_warps=sp.num_warps, num_stages=sp.num_stages,
                             divisible_by_16=sp.aligned, max_registers=sp.max_registers)
            return build_problems({"ok": True, "shared": ck.metadata.shared}, arch=90,
                                  present=())
        # the Gluon prefill kernel: 16-bit, heads 192 / 128, group 1, TMA tiles of the pages
        causal, lse = name == "causal" or name == "causal_lse", name.endswith("lse")
        c = aot_case(dtype="bf16", head=192, head_v=128, group=1, block_size=128,
                     causal=causal, write_lse=lse)
        kernel = getattr(importlib.import_module(c["module"]), c["kernel"])
        ck = aot_compile(kernel, c["signature"], c["constexprs"], arch=90,
                         num_warps=c.get("num_warps", 4), num_stages=c.get("num_stages", 3),
                         divisible_by_16=tuple(c.get("divisible_by_16", ())))
        ptx = ck.asm["ptx"]
        counts = {"wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                  "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx))}
        res = {"ok": True, "shared": ck.metadata.shared, "counts": counts}
        return build_problems(res, arch=90, present=("wgmma", "tma"))

    out = {}
    for name in json.load(sys.stdin):
        try:
            out[name] = build(name)
        except Exception:
            out[name] = [traceback.format_exc()[-3000:]]
    print("AOT-RESULTS" + json.dumps(out))
    """
)


def _compile(names: list[str]) -> dict[str, list[str]]:
    """Problems of each named build for sm_90 (:func:`kv_kernels.aot.build_problems`), compiled
    in a subprocess without the Triton interpreter."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _AOT], input=json.dumps(names), capture_output=True, text=True,
        env=env, timeout=600, check=False,
    )  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AOT-RESULTS")), None)
    assert line is not None, proc.stderr[-4000:]
    results: dict[str, list[str]] = json.loads(line[len("AOT-RESULTS") :])
    assert set(results) == set(names), results
    return results


def test_workspace_prefill_kernel_compiles_for_sm90() -> None:
    """The one-pass step's launch (causal, no LSE): ~7 s cold on a CI core."""
    assert _compile(["causal"]) == {"causal": []}


@pytest.mark.slow
def test_every_workspace_kernel_compiles_for_sm90() -> None:
    """Split contexts (causal and non-causal passes with LSE) and the Triton kernel's prefill."""
    names = ["causal_lse", "noncausal_lse", "triton"]
    assert _compile(names) == {name: [] for name in names}
