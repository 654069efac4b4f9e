"""Small KV-cache plans for the manager tests: one per group kind, and hybrids."""

from __future__ import annotations

from kv_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan_kv_cache,
)


def plan(specs: dict[str, object], num_blocks: int, max_model_len: int = 64) -> KVCacheConfig:
    """A plan whose num_blocks is exactly ``num_blocks`` (budget = blocks x page x slots)."""
    probe = plan_kv_cache(specs, 2**30)  # type: ignore[arg-type]
    budget = num_blocks * probe.page_size_bytes * probe.num_layer_slots
    return plan_kv_cache(specs, budget, max_model_len=max_model_len)  # type: ignore[arg-type]


def full(bs: int = 4, heads: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=8)


def sliding(bs: int = 4, window: int = 7, heads: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=8, sliding_window=window)


def chunked(bs: int = 4, chunk: int = 8, heads: int = 1) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=bs, num_kv_heads=heads, head_size=8, attention_chunk_size=chunk
    )


def mla(bs: int = 4) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16)


CONFIGS: dict[str, KVCacheConfig] = {
    "full": plan({"l0": full(), "l1": full()}, 40),
    "mla": plan({"l0": mla()}, 40),
    "sliding": plan({"l0": sliding(window=7)}, 30),
    "sliding_w1": plan({"l0": sliding(window=1)}, 30),
    "chunked": plan({"l0": chunked(chunk=8)}, 30),
    "chunked_unaligned": plan({"l0": chunked(chunk=6)}, 30),
    # Hybrid, equal block sizes: full + sliding share one pool.
    "full+sliding": plan({"f0": full(), "s0": sliding(window=6)}, 50),
    # Hybrid with different block sizes: the sliding group's pages are half as big, so the
    # planner doubles its block size (8) — hash block size gcd(4, 8) = 4.
    "full+sliding(bs8)": plan({"f0": full(heads=2), "s0": sliding(window=9, heads=1)}, 50),
    "full+chunked+sliding": plan(
        {"f0": full(), "c0": chunked(chunk=8), "s0": sliding(window=5)}, 60
    ),
}
