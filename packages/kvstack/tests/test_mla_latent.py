"""DeepSeek-V3's latent cache, model side: one ``kv_lora_rank + qk_rope_head_dim`` row per token
(kv-spec's ``MLAAttentionSpec``), attended in the absorbed form, held to transformers.

On the CPU the engine caches the latent through TORCH_SDPA, whose MLA path is kv-kernels'
``paged_attention(kv_lora_rank=)`` reference (TRITON_MLA serves it on a GPU). These tests hold
the absorbed form the latent cache needs: ``forward_dense(mla_latent=True)`` against transformers' forward, and a paged run
whose attention is kv-kernels' own ``paged_attention(kv_lora_rank=)`` reference over latent rows
written by ``reshape_and_cache`` through shuffled block tables (two requests, chunked prefill,
decodes sharing steps with a prefill) against transformers' greedy ``generate``. A planted bug
(the output through ``W_UK`` instead of ``W_UV``) must be caught. Then the runner itself: the
latent cache through TORCH_SDPA on the CPU -- decode rows absorbed, prefill rows (chunks, whose
context is read back from the cache) over decompressed K/V (:mod:`kvstack.engine.mla_prefill`,
held to the absorbed form in ``test_mla_prefill.py``) -- tokens and logits equal to
transformers' greedy ``generate``; a backend that declares no MLA gets decompressed K/V.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from kv_kernels import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.reshape_and_cache import reshape_and_cache
from kv_spec import KVCacheLayout, MLAAttentionSpec, plan_kv_cache

pytest.importorskip("transformers")

from kvstack.engine.loader import load_model
from kvstack.engine.models import AttendFn, CausalLM, MLAAttention
from kvstack.engine.testing import hf_greedy, make_hf_checkpoint

LOGIT_RTOL = 1e-4  # as test_models_hf.py
PROMPTS = [list(range(3, 30)), [0, 9, 17, 0, 2, 8, 100]]
MAX_NEW = 6
BLOCK = 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mla") / "ds", seed=1)


def test_absorbed_dense_forward_matches_transformers(ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_model(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager")
    ids = torch.tensor(PROMPTS[0])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    for latent in (False, True):
        ours = model.forward_dense(ids, mla_latent=latent)
        assert float((ours - ref).abs().max() / ref.abs().max()) <= LOGIT_RTOL


def _latent_attend(
    views: list[torch.Tensor],
    layout: KVCacheLayout,
    slot_mapping: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    qsl: torch.Tensor,
    max_query_len: int,
    scale: float,
    rank: int,
) -> AttendFn:
    """One step's ``attend``: the latent rows ``k`` ``[T, 1, rank + rope]`` are written once (V
    is a view of their latent part), then attended absorbed by kv-kernels' reference."""

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        reshape_and_cache(k, None, views[i], slot_mapping, layout, impl="reference")
        out = paged_attention(
            q,
            views[i],
            layout,
            table,
            seq_lens,
            qsl,
            max_query_len,
            scale=scale,
            kv_lora_rank=rank,
            impl="reference",
        )
        assert isinstance(out, torch.Tensor)
        return out

    return attend


def _paged_greedy(model: CausalLM) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy decoding of :data:`PROMPTS` over a paged latent cache (chunks of 5 for the first
    prompt, whole for the second; both requests in every step)."""
    arch = model.arch
    specs = arch.kv_specs(block_size=BLOCK, dtype="float32", mla_latent=True)
    assert all(isinstance(s, MLAAttentionSpec) for s in specs.values())
    cfg = plan_kv_cache(specs, 1 << 22, max_model_len=64)
    layout = cfg.layout(0)
    storage = allocate_kv_cache(layout, "cpu")
    views = [
        layer_view(storage, layout, cfg.layer_slot(arch.layer_name(i)))
        for i in range(arch.num_layers)
    ]
    for v in views:
        v.fill_(float("nan"))  # a read outside a request's rows shows up
    free = list(range(1, cfg.num_blocks))
    random.Random(0).shuffle(free)
    blocks: list[list[int]] = [[], []]
    tokens = [list(p) for p in PROMPTS]
    done = [0, 0]  # tokens whose rows are cached
    logits: list[list[torch.Tensor]] = [[], []]
    chunks = [5, 100]
    rank = arch.mla_kv_lora_rank
    while any(len(t) - len(p) < MAX_NEW for t, p in zip(tokens, PROMPTS, strict=True)):
        live = [r for r in range(2) if len(tokens[r]) - len(PROMPTS[r]) < MAX_NEW]
        qlens = [min(chunks[r], len(tokens[r]) - done[r]) for r in live]
        ids, pos, slots, rows = [], [], [], []
        for r, q in zip(live, qlens, strict=True):
            while len(blocks[r]) * BLOCK < done[r] + q:
                blocks[r].append(free.pop())
            for p in range(done[r], done[r] + q):
                ids.append(tokens[r][p])
                pos.append(p)
                slots.append(blocks[r][p // BLOCK] * BLOCK + p % BLOCK)
            done[r] += q
            rows.append(len(ids) - 1)
        width = max(len(blocks[r]) for r in live)
        table = torch.tensor([blocks[r] + [0] * (width - len(blocks[r])) for r in live])
        seq_lens = torch.tensor([done[r] for r in live], dtype=torch.int32)
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)

        attend = _latent_attend(
            views, layout, slot_mapping, table, seq_lens, qsl, max(qlens), model.scale, rank
        )
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(pos), attend, mla_latent=True)
            step = model.compute_logits(hidden[torch.tensor(rows)])
        for r, row in zip(live, step, strict=True):
            if done[r] == len(tokens[r]):  # the last known token was fed: sample the next
                logits[r].append(row)
                tokens[r].append(int(row.argmax()))
    return [(t[len(p) :], lg) for t, p, lg in zip(tokens, PROMPTS, logits, strict=True)]


def _max_error(model: CausalLM, refs: list[tuple[list[int], torch.Tensor]]) -> tuple[bool, float]:
    got = _paged_greedy(model)
    same = all(g[0] == r[0] for g, r in zip(got, refs, strict=True))
    err = max(
        float((torch.stack(g[1]) - r[1]).abs().max() / r[1].abs().max())
        for g, r in zip(got, refs, strict=True)
    )
    return same, err


def test_paged_latent_cache_matches_transformers_greedy(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = [hf_greedy(ckpt, p, MAX_NEW) for p in PROMPTS]
    model = load_model(ckpt)
    same, err = _max_error(model, refs)
    assert same and err <= LOGIT_RTOL, err

    # Planted: the latent output through W_UK (same shape here, nope == v) instead of W_UV.
    def wrong_out(self: MLAAttention, o_latent: torch.Tensor) -> torch.Tensor:
        w_uk, _ = self._w_uk_uv()
        return torch.einsum("thr,hvr->thv", o_latent, w_uk)

    monkeypatch.setattr(MLAAttention, "absorb_out", wrong_out)
    _, bad = _max_error(model, refs)
    assert bad > 100 * LOGIT_RTOL


def test_runner_serves_the_latent_cache_on_the_cpu(ckpt: Path) -> None:
    # TORCH_SDPA declares MLA (kv-kernels' paged_attention reference, absorbed), so the runner's
    # latent path -- the MLA spec, the latent write (value=None), the absorbed attention and
    # W_UV -- runs on the CPU as TRITON_MLA's does on a GPU.
    from kvstack.engine.runner import ModelRunner
    from kvstack.engine.testing import greedy_generate

    runner = ModelRunner(ckpt, num_blocks=96, max_model_len=64)
    assert runner.mla_latent and runner.backends == {0: "TORCH_SDPA"}
    assert "one latent row of 48 per token, attended absorbed (TORCH_SDPA)" in runner.describe()
    spec = runner.kv_cache_config.groups[0].spec
    assert isinstance(spec, MLAAttentionSpec) and spec.head_size == 48
    # a latent page is 48 floats a token; the decompressed one 4 heads x (32 + 16)
    arch = runner.arch
    decompressed = plan_kv_cache(
        arch.kv_specs(block_size=spec.block_size, dtype="float32"), 1 << 22, max_model_len=64
    )
    assert runner.kv_cache_config.page_size_bytes * 4 == decompressed.page_size_bytes
    refs = [hf_greedy(ckpt, p, MAX_NEW) for p in PROMPTS]
    result = greedy_generate(runner, PROMPTS, MAX_NEW, chunk_sizes=[5, 100])
    for (want, ref), got, logits in zip(refs, result.tokens, result.logits, strict=True):
        assert got == want
        assert float((logits - ref).abs().max() / ref.abs().max()) <= LOGIT_RTOL
    # every prompt token was a prefill row over decompressed K/V, the chunks' context read back
    stats = runner.mla_prefill.stats if runner.mla_prefill is not None else None
    assert stats is not None and stats.rows == sum(map(len, PROMPTS)) and stats.cached_keys > 0


def test_a_backend_without_mla_gets_decompressed_kv(ckpt: Path) -> None:
    from kv_backends import get_backend
    from kvstack.engine.runner import ModelRunner

    assert not get_backend("FLEX_ATTENTION").CAPABILITIES.mla
    forced = ModelRunner(ckpt, num_blocks=96, max_model_len=64, backend="FLEX_ATTENTION")
    assert not forced.mla_latent
    assert "backend='FLEX_ATTENTION' serves no MLA" in forced.describe()
