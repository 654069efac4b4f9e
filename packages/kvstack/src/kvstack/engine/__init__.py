"""kvstack's reference engine: Hugging Face checkpoints of real architectures (the registry
:data:`kvstack.engine.archs.FAMILIES`: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, gpt-oss,
Gemma-2, Gemma-3, MiMo-V2-Flash, DeepSeek-V3, and a DiffKV Llama variant) in plain torch, attending through kv-backends over a
paged cache that kv-spec plans and kv-blocktable addresses, served by a continuous-batching
:class:`LLMEngine` (chunked prefill, prefix caching, preemption, greedy and seeded sampling).

Generate::

    from kvstack.engine import LLMEngine, SamplingParams

    engine = LLMEngine("path/to/checkpoint")
    outputs = engine.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_new_tokens=16))
    texts = engine.generate(["Hello"], SamplingParams(stop=["."]))  # with the checkpoint's tokenizer

Run one step over the paged cache::

    from kv_backends import CommonAttentionMetadata
    from kvstack.engine import ModelRunner

    runner = ModelRunner("path/to/checkpoint", num_blocks=64)
    md = CommonAttentionMetadata.from_lists(query_lens=[5], seq_lens=[5], block_table=[[0]],
                                            block_size=runner.kernel_block_sizes[0])
    logits = runner.execute(ids, torch.arange(5), [md] * runner.num_groups, torch.tensor([4]))

``runner.model.forward_dense(ids)`` is the cache-free reference of the same model.
"""

from __future__ import annotations

from kvstack.engine.engine import Completion, EngineStats, LLMEngine, TokenEvent
from kvstack.engine.hf_config import (
    SUPPORTED_ARCHITECTURES,
    ArchConfig,
    RopeConfig,
    load_arch_config,
)
from kvstack.engine.loader import checkpoint_files, load_model
from kvstack.engine.models import CausalLM, dense_attention
from kvstack.engine.outputs import RequestMetrics
from kvstack.engine.runner import DEFAULT_CACHE_REQUESTS, LayerBinding, ModelRunner
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "DEFAULT_CACHE_REQUESTS",
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "CausalLM",
    "Completion",
    "EngineStats",
    "LLMEngine",
    "LayerBinding",
    "ModelRunner",
    "RequestMetrics",
    "RopeConfig",
    "SamplingParams",
    "TextTokenizer",
    "TokenEvent",
    "checkpoint_files",
    "dense_attention",
    "load_arch_config",
    "load_model",
    "load_tokenizer",
]
