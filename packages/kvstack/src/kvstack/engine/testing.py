"""Tiny random checkpoints and a greedy driver, for tests and for checking the engine by hand.

- :func:`make_hf_checkpoint` builds a tiny model of a real family with transformers itself
  (random weights under a fixed seed, saved as safetensors) -- the oracle's own code writes the
  checkpoint the engine must read. Needs the ``hf`` extra (transformers).
- :func:`make_diffkv_checkpoint` writes a Llama-like checkpoint with ``v_head_dim != head_dim``
  (kvstack's DiffKV flag; transformers has no such model, so the engine's weights are the source).
- :func:`greedy_generate` drives :meth:`ModelRunner.execute` like a minimal scheduler: every
  request gets its own shuffled blocks per KV group (one block-id space), prompts are prefilled in
  chunks, decodes share steps with other requests' prefills.
- :func:`make_text_checkpoint` writes a tiny random Llama with a word-level tokenizer
  (``tokenizer.json``, BOS added to text, a chat template): the text API's test model. Needs the
  ``tokenizers`` package (transformers brings it).
- :func:`hf_greedy` is transformers' ``generate`` (greedy, no EOS) for one prompt (an explicit
  all-ones attention mask: token id 0 is a real token, not padding).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kv_backends import CommonAttentionMetadata
from kv_kernels.testing import (
    OracleCheck,
    attention_lowprec,
    attention_oracle,
    check_close_to_oracle,
)

from kvstack.engine.archs import FAMILIES
from kvstack.engine.hf_config import ArchConfig
from kvstack.engine.models import CausalLM, RopeAttend, dense_attention
from kvstack.engine.runner import ModelRunner

__all__ = [
    "TINY_CONFIGS",
    "AttentionCall",
    "AttentionCalls",
    "GreedyResult",
    "diffkv_config",
    "greedy_generate",
    "hf_greedy",
    "make_diffkv_checkpoint",
    "make_hf_checkpoint",
    "make_text_checkpoint",
    "write_checkpoint",
]

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    # transformers' default 0.02 makes q.k ~ 0 (uniform attention: RoPE, windows and pages would
    # barely matter); 0.2 gives logits of order 1-10, so a wrong position or page shows.
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
)

#: Tiny configs of each family (from its module in :mod:`kvstack.engine.archs`), each
#: exercising what makes the family different.
TINY_CONFIGS: dict[str, dict[str, Any]] = {name: dict(f.tiny) for name, f in FAMILIES.items()}


def make_hf_checkpoint(name: str, path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny transformers model of ``TINY_CONFIGS[name]`` (plus ``overrides``) to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in TINY_CONFIGS:
        raise ValueError(f"name={name!r} is not one of {sorted(TINY_CONFIGS)}")
    kw = {**_COMMON, **TINY_CONFIGS[name], **overrides}
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # transformers initialises norms to exactly 1; random gains catch a norm applied to the
        # wrong tensor (or not at all).
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = Path(path)
    model.save_pretrained(out)
    return out


def write_checkpoint(config: dict[str, Any], path: str | Path, *, seed: int = 0) -> Path:
    """Write ``config`` as ``config.json`` and random weights of the engine's own model for it
    (``N(0, 0.2)``, norm gains in ``[0.5, 1.5]``) as ``model.safetensors``."""
    from safetensors.torch import save_file

    arch = ArchConfig.from_hf(config)
    torch.manual_seed(seed)
    model = CausalLM(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def diffkv_config(*, head_dim: int = 192, v_head_dim: int = 128) -> dict[str, Any]:
    """A tiny Llama-like ``config.json`` with kvstack's DiffKV flag ``v_head_dim``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "v_head_dim": v_head_dim,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }


def make_diffkv_checkpoint(
    path: str | Path, *, seed: int = 0, head_dim: int = 192, v_head_dim: int = 128
) -> Path:
    """A Llama-like checkpoint whose values have ``v_head_dim`` columns per head (DiffKV)."""
    return write_checkpoint(
        diffkv_config(head_dim=head_dim, v_head_dim=v_head_dim), path, seed=seed
    )


#: The word-level vocabulary of :func:`make_text_checkpoint` (64 words: ids 0-63).
TEXT_WORDS: tuple[str, ...] = (
    "<unk>", "<s>", "</s>", "user", "assistant", "system", ":", ".", ",", "!", "?",
    "hello", "world", "the", "a", "cat", "dog", "sat", "on", "mat", "red", "blue", "green",
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "is", "was",
    "and", "or", "not", "yes", "no", "big", "small", "fast", "slow", "sun", "moon", "star",
    "tree", "sea", "sky", "rain", "snow", "wind", "fire", "stone", "bird", "fish", "cloud",
    "river", "hill", "road", "house", "door", "end",
)  # fmt: skip
#: Its chat template: ``<s>`` once, then ``role : content .`` per message.
TEXT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def make_text_checkpoint(path: str | Path, *, seed: int = 0) -> Path:
    """A tiny random-weight Llama (vocabulary :data:`TEXT_WORDS`) with a word-level tokenizer:
    ``tokenizer.json`` (whitespace words, ``<s>`` prepended to encoded text, decoded words joined
    by spaces) and ``tokenizer_config.json`` (BOS ``<s>``, EOS ``</s>``,
    :data:`TEXT_CHAT_TEMPLATE`). The model has no EOS in ``config.json``, so random weights run to
    ``max_new_tokens``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": len(TEXT_WORDS),
        "max_position_embeddings": 256, "eos_token_id": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }  # fmt: skip
    out = write_checkpoint(config, path, seed=seed)
    vocab = {w: i for i, w in enumerate(TEXT_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": TEXT_CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return out


def hf_greedy(
    model_dir: str | Path, prompt: Sequence[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``prompt`` and its logits ``[max_new_tokens, vocab]``
    (float32, eager attention so gpt-oss's sinks are honoured)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            # Every prompt token is real: without a mask, transformers infers one from
            # pad_token_id and would hide every prompt token whose id is 0.
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.cat([step.float() for step in out.logits], dim=0)  # [max_new, vocab]
    return tokens, logits


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # generated tokens per request
    logits: list[torch.Tensor]  # [max_new_tokens, vocab] per request
    steps: int
    step_shapes: list[tuple[int, ...]] = field(default_factory=list)  # query lens per step


@dataclass
class _Request:
    prompt: list[int]
    tokens: list[int]
    chunk: int
    computed: int = 0
    blocks: dict[int, list[int]] = field(default_factory=dict)  # group -> manager blocks
    logits: list[torch.Tensor] = field(default_factory=list)


MetadataHook = Callable[[int, list[CommonAttentionMetadata]], list[CommonAttentionMetadata]]


def greedy_generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    chunk_sizes: Sequence[int] | None = None,
    seed: int = 0,
    pad_tokens: int = 0,
    metadata_hook: MetadataHook | None = None,
) -> GreedyResult:
    """Greedy decoding of every prompt at once over the runner's paged cache.

    ``chunk_sizes[r]`` caps request ``r``'s prefill tokens per step (chunked prefill); blocks come
    from a shuffled free list shared by all groups; ``pad_tokens`` appends padding tokens (slot
    ``-1``) to every step; ``metadata_hook(step, metadata)`` may rewrite a step's metadata (tests
    plant bugs with it).
    """
    cfg = runner.kv_cache_config
    free = list(range(cfg.num_blocks))
    random.Random(seed).shuffle(free)
    chunks = list(chunk_sizes) if chunk_sizes is not None else [1 << 30] * len(prompts)
    reqs = [_Request(list(p), list(p), c) for p, c in zip(prompts, chunks, strict=True)]
    result = GreedyResult([], [], 0)
    while any(len(r.tokens) - len(r.prompt) < max_new_tokens for r in reqs):
        active = [r for r in reqs if len(r.tokens) - len(r.prompt) < max_new_tokens]
        qlens = [
            min(r.chunk, len(r.prompt) - r.computed) if r.computed < len(r.prompt) else 1
            for r in active
        ]
        seq_lens = [r.computed + q for r, q in zip(active, qlens, strict=True)]
        metadata = []
        for g in cfg.groups:
            block = g.spec.block_size
            kbs = runner.kernel_block_sizes[g.group_id]
            rows = []
            for r, s in zip(active, seq_lens, strict=True):
                have = r.blocks.setdefault(g.group_id, [])
                while len(have) * block < s:
                    have.append(free.pop())
                rows.append([b * (block // kbs) + i for b in have for i in range(block // kbs)])
            width = max(len(row) for row in rows)
            metadata.append(
                CommonAttentionMetadata.from_lists(
                    query_lens=qlens,
                    seq_lens=seq_lens,
                    block_table=[row + [0] * (width - len(row)) for row in rows],
                    block_size=kbs,
                    pad_tokens_to=sum(qlens) + pad_tokens,
                    device=runner.device,
                )
            )
        if metadata_hook is not None:
            metadata = metadata_hook(result.steps, metadata)
        ids, pos, sample_rows, sampled = [], [], [], []
        for r, q in zip(active, qlens, strict=True):
            ids += r.tokens[r.computed : r.computed + q]
            pos += list(range(r.computed, r.computed + q))
            r.computed += q
            if r.computed == len(r.tokens):  # the last known token was fed: sample the next
                sample_rows.append(len(ids) - 1)
                sampled.append(r)
        ids += [0] * pad_tokens
        pos += [0] * pad_tokens
        logits = runner.execute(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(pos, dtype=torch.int64),
            metadata,
            torch.tensor(sample_rows, dtype=torch.int64),
        )
        for r, row in zip(sampled, logits.cpu(), strict=True):
            r.logits.append(row)
            r.tokens.append(int(row.argmax()))
        result.steps += 1
        result.step_shapes.append(tuple(qlens))
    result.tokens = [r.tokens[len(r.prompt) :] for r in reqs]
    result.logits = [torch.stack(r.logits) for r in reqs]
    return result


@dataclass(frozen=True)
class AttentionCall:
    """One recorded attention call and its two checks against the float64 oracle."""

    step: int
    layer: int
    q_lens: tuple[int, ...]
    backend: OracleCheck  # the paged backend's output vs the oracle
    dense: OracleCheck  # the model's dense_attention on the same q/k/v vs the oracle


class AttentionCalls:
    """Records every attention call of ``runner`` and checks it against the float64 oracle.

    Two test-only wrappers (set with ``monkeypatch.setattr``, pytest's fixture, so they are undone
    after the test), no engine change: ``runner.execute`` (to read each step's request
    boundaries and identities from the metadata the caller built) and ``runner.model.forward`` (to
    wrap the ``attend(layer, q, k, v)`` callback the runner hands the model, the seam between the
    projections and attention, see models.py, and its ``rope_attend`` twin where the RoPE rides
    in the cache write, which rotates q and k in place before they are checked). A request is identified by the first entry of its
    group-0 block-table row as the caller built it (blocks are never freed in ``greedy_generate``);
    its K/V history per layer is the k/v the model handed to ``attend``, never read from the cache.
    """

    def __init__(self, runner: ModelRunner, monkeypatch: Any) -> None:
        self.runner = runner
        self.calls: list[AttentionCall] = []
        # (layer, request key) -> (q chunks, k chunks, v chunks), on the CPU
        self._history: dict[tuple[int, int], tuple[list[torch.Tensor], ...]] = {}
        self._step: tuple[list[int], list[int], list[int]] | None = None
        self._steps = 0
        execute, forward = runner.execute, runner.model.forward

        def execute_hook(
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            metadata: list[CommonAttentionMetadata],
            logits_indices: torch.Tensor,
        ) -> torch.Tensor:
            md = metadata[0]
            n = md.query_start_loc.numel() - 1
            self._step = (
                md.query_start_loc.tolist(),
                md.seq_lens.tolist(),
                md.block_table[:n, 0].tolist(),
            )
            try:
                return execute(input_ids, positions, metadata, logits_indices)
            finally:
                self._step = None
                self._steps += 1

        def forward_hook(
            input_ids: torch.Tensor, positions: torch.Tensor, attend: Any, **kw: Any
        ) -> Any:
            if self._step is None:  # forward_dense, not a runner step
                return forward(input_ids, positions, attend, **kw)

            def attend_hook(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
                out = attend(i, q, k, v)
                self._check(i, q, k, v, out)
                return out

            deferred = kw.get("rope_attend")
            if deferred is not None:  # (the fused RoPE rides in the cache write: on CUDA)

                def rope_hook(
                    i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Any
                ) -> Any:
                    out = deferred.attend(i, q, k, v, rope)  # rotates q and k in place
                    self._check(i, q, k, v, out)
                    return out

                kw = {**kw, "rope_attend": RopeAttend(deferred.layers, rope_hook)}
            return forward(input_ids, positions, attend_hook, **kw)

        monkeypatch.setattr(runner, "execute", execute_hook)
        monkeypatch.setattr(runner.model, "forward", forward_hook)

    def _check(
        self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> None:
        assert self._step is not None, "attend outside runner.execute"
        qsl, seq_lens, keys = self._step
        q_lens = [b - a for a, b in itertools.pairwise(qsl)]
        t = qsl[-1]
        q, k, v = (x[:t].detach().cpu() for x in (q, k, v))
        model, arch = self.runner.model, self.runner.arch
        window, sinks = arch.layer_window(i), model.layer_sinks(i)
        sinks = None if sinks is None else sinks.detach().cpu()  # the references run on the CPU
        qs, ks, vs, dense = [], [], [], []
        for r, (a, b) in enumerate(itertools.pairwise(qsl)):
            hq, hk, hv = self._history.setdefault((i, keys[r]), ([], [], []))
            assert sum(x.shape[0] for x in hk) == seq_lens[r] - (b - a), "history out of step"
            hq.append(q[a:b])
            hk.append(k[a:b])
            hv.append(v[a:b])
            qs.append(torch.cat(hq))
            ks.append(torch.cat(hk))
            vs.append(torch.cat(hv))
            # The model's own cache-free attention over the request's whole history.
            full = dense_attention(
                qs[-1], ks[-1], vs[-1], scale=model.scale, sliding_window=window, sinks=sinks
            )
            dense.append(full[full.shape[0] - (b - a) :])
        oracle, _ = attention_oracle(
            q, ks, vs, q_lens, scale=model.scale, sliding_window=window, sinks=sinks
        )
        low = attention_lowprec(
            q, ks, vs, q_lens, scale=model.scale, sliding_window=window, sinks=sinks
        )
        self.calls.append(
            AttentionCall(
                self._steps,
                i,
                tuple(q_lens),
                check_close_to_oracle(out[:t], oracle, lowprec_reference=low),
                check_close_to_oracle(torch.cat(dense), oracle, lowprec_reference=low),
            )
        )

    def failures(self) -> list[str]:
        return [
            f"step {c.step} layer {c.layer} q_lens {c.q_lens}: {name}: {chk.message}"
            for c in self.calls
            for name, chk in (("backend", c.backend), ("dense_attention", c.dense))
            if not chk.ok
        ]

    def assert_ok(self) -> None:
        assert self.calls, "no attention call was recorded"
        bad = self.failures()
        assert not bad, f"{len(bad)} failed checks of {len(self.calls)} attention calls:\n" + (
            "\n".join(bad[:10]) + "\n" + self.runner.describe()
        )
