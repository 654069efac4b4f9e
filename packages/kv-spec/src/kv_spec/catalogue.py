"""Published attention configurations of real models, as plain data.

Only the fields that shape the KV cache are kept (from each model's released ``config.json``).
:meth:`ModelConfig.kv_specs` turns one into per-layer specs for :func:`kv_spec.plan_kv_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kv_spec._checks import check_positive_int
from kv_spec.quant import KVQuantMode
from kv_spec.specs import AttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

__all__ = ["CATALOGUE", "ModelConfig", "get_model"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The KV-relevant part of a model config.

    ``sliding_layers`` lists the layers that use the sliding window (empty: all full attention,
    ``None`` with ``sliding_window`` set: every layer slides). Sliding layers may have their own
    head count (``swa_num_kv_heads``).
    """

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int | None = None
    max_model_len: int
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = ()
    swa_num_kv_heads: int | None = None
    has_sinks: bool = False
    #: With ``has_sinks``: only the sliding-window layers carry sink logits (MiMo-V2-Flash).
    sinks_on_sliding_only: bool = False
    mla: bool = False
    source: str = ""

    def layer_has_sinks(self, layer: int) -> bool:
        """Whether layer ``layer`` has per-head attention-sink logits."""
        return self.has_sinks and (not self.sinks_on_sliding_only or self.is_sliding(layer))

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.sliding_layers is None or layer in self.sliding_layers

    def check_tensor_parallel(self, tensor_parallel_size: object) -> int:
        """``tensor_parallel_size`` if this model's heads split evenly over it, else ``ValueError``.

        vLLM's rule: query heads must divide evenly (``num_q_heads % tp == 0``); KV heads are
        split when ``tp <= num_kv_heads`` (``num_kv_heads % tp == 0``) and replicated when
        ``tp > num_kv_heads`` (``tp % num_kv_heads == 0``, one head a rank). MLA's single latent
        is replicated on every rank. (kv_backends.check_tensor_parallel states the same rule.)
        """
        tp = check_positive_int(self.name, "tensor_parallel_size", tensor_parallel_size)
        if self.num_q_heads % tp:
            divisors = [d for d in range(1, self.num_q_heads + 1) if self.num_q_heads % d == 0]
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide {self.name}'s {self.num_q_heads} query "
                f"heads; use one of {divisors}"
            )
        if self.mla:
            return tp
        for heads in sorted({self.num_kv_heads, self.swa_num_kv_heads or self.num_kv_heads}):
            if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
                raise ValueError(
                    f"tensor_parallel_size={tp} neither divides {self.name}'s {heads} KV heads nor "
                    f"is a multiple of them (to replicate one head per rank); use a divisor of "
                    f"{heads} or a multiple of {heads} that divides {self.num_q_heads}"
                )
        return tp

    def kv_specs(
        self,
        *,
        block_size: int = 16,
        dtype: str | None = None,
        kv_quant: KVQuantMode | str = KVQuantMode.NONE,
        tensor_parallel_size: int = 1,
    ) -> dict[str, AttentionSpec]:
        """Per-layer specs (``model.layers.{i}.self_attn``) as one tensor-parallel rank holds them.

        ``tensor_parallel_size`` must split the heads evenly (:meth:`check_tensor_parallel`);
        nothing is floored.
        """
        tp = self.check_tensor_parallel(tensor_parallel_size)
        cache_dtype = dtype or self.dtype
        kv_quant = KVQuantMode.parse(kv_quant)
        out: dict[str, AttentionSpec] = {}
        for i in range(self.num_layers):
            name = f"model.layers.{i}.self_attn"
            spec: AttentionSpec
            if self.mla:
                # MLA keeps one latent per token; tensor parallelism replicates it.
                spec = MLAAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=self.head_size,
                    dtype=cache_dtype,
                    kv_quant=kv_quant,
                )
            else:
                sliding = self.is_sliding(i)
                heads = (
                    self.swa_num_kv_heads
                    if sliding and self.swa_num_kv_heads
                    else self.num_kv_heads
                )
                # KV heads split across ranks; with fewer heads than ranks (tp a multiple of
                # them, checked above) each rank keeps one replicated head.
                local = heads // tp if tp <= heads else 1
                common = dict(
                    block_size=block_size,
                    num_kv_heads=local,
                    head_size=self.head_size,
                    head_size_v=self.head_size_v,
                    dtype=cache_dtype,
                    kv_quant=kv_quant,
                )
                if sliding:
                    assert self.sliding_window is not None
                    spec = SlidingWindowSpec(sliding_window=self.sliding_window, **common)  # type: ignore[arg-type]
                else:
                    spec = FullAttentionSpec(**common)  # type: ignore[arg-type]
            out[name] = spec
        return out


_GPT_OSS_SLIDING: Final = tuple(range(0, 36, 2))  # layer_types alternate, sliding first
_MIMO_FULL: Final = (0, 5, 11, 17, 23, 29, 35, 41, 47)  # hybrid_layer_pattern: 9 full, 39 SWA

CATALOGUE: Final[dict[str, ModelConfig]] = {
    m.name: m
    for m in (
        ModelConfig(
            name="Llama-3-8B",
            num_layers=32,
            num_q_heads=32,
            num_kv_heads=8,
            head_size=128,
            max_model_len=8192,
            source="meta-llama/Meta-Llama-3-8B",
        ),
        ModelConfig(
            name="Llama-3-70B",
            num_layers=80,
            num_q_heads=64,
            num_kv_heads=8,
            head_size=128,
            max_model_len=8192,
            source="meta-llama/Meta-Llama-3-70B",
        ),
        ModelConfig(
            name="Qwen3-32B",
            num_layers=64,
            num_q_heads=64,
            num_kv_heads=8,
            head_size=128,
            max_model_len=40960,
            source="Qwen/Qwen3-32B",
        ),
        ModelConfig(
            name="Mistral-7B",
            num_layers=32,
            num_q_heads=32,
            num_kv_heads=8,
            head_size=128,
            max_model_len=32768,
            sliding_window=4096,
            sliding_layers=None,
            source="mistralai/Mistral-7B-v0.1",
        ),
        ModelConfig(
            name="gpt-oss-120b",
            num_layers=36,
            num_q_heads=64,
            num_kv_heads=8,
            head_size=64,
            max_model_len=131072,
            sliding_window=128,
            sliding_layers=_GPT_OSS_SLIDING,
            has_sinks=True,
            source="openai/gpt-oss-120b",
        ),
        ModelConfig(
            name="DeepSeek-V3",
            num_layers=61,
            num_q_heads=128,
            num_kv_heads=1,
            head_size=512 + 64,
            max_model_len=163840,
            mla=True,
            source="deepseek-ai/DeepSeek-V3",
        ),
        ModelConfig(
            name="MiMo-V2-Flash",
            num_layers=48,
            num_q_heads=64,
            num_kv_heads=4,
            head_size=192,
            head_size_v=128,
            max_model_len=262144,
            sliding_window=128,
            sliding_layers=tuple(i for i in range(48) if i not in _MIMO_FULL),
            swa_num_kv_heads=8,
            has_sinks=True,
            sinks_on_sliding_only=True,  # add_swa_attention_sink_bias, no full-attention sink bias
            source="XiaomiMiMo/MiMo-V2-Flash",
        ),
    )
}


def get_model(name: str) -> ModelConfig:
    """The catalogue entry for ``name`` (case-insensitive)."""
    for key, model in CATALOGUE.items():
        if key.lower() == name.lower():
            return model
    raise ValueError(f"model {name!r} is not in the catalogue; known models: {sorted(CATALOGUE)}")
