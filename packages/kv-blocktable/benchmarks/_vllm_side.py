"""The vLLM side of bench_blocktable.py: run by it in a separate interpreter that has vLLM.

    /tmp/vllm-env/bin/python _vllm_side.py '{"num_blocks": 16384, ...}'

It builds every workload and prints one JSON line describing them, then serves: for each
workload name read on stdin it runs that workload once and prints its timing as a JSON line, so
the driver can alternate kvstack and vLLM runs (both sides see the same machine load). It
imports vLLM only — no kvstack package — and calls vLLM's own v1 classes directly, exactly as described in each measurement's "how" field:
the same workloads bench_blocktable.py runs on kv-blocktable. Not collected by pytest.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
import types
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
logging.disable(logging.WARNING)


def alloc_free(p: dict[str, Any], caching: bool) -> tuple[Callable[[], float], str]:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash

    n, batch, iters = p["num_blocks"], p["batch"], p["alloc_iters"]
    pool = BlockPool(num_gpu_blocks=n, enable_caching=caching, hash_block_size=16)
    # Distinct hashes for every batch of a pass through the pool (twice the pool), so a hash is
    # never cached twice: each allocation evicts the blocks cached `n` allocations ago.
    reqs = [
        types.SimpleNamespace(
            block_hashes=[
                BlockHash(i.to_bytes(4, "little") + j.to_bytes(28, "little")) for j in range(batch)
            ]
        )
        for i in range(2 * n // batch)
    ]
    state = {"i": 0}

    def run() -> float:
        get, free, cache = pool.get_new_blocks, pool.free_blocks, pool.cache_full_blocks
        t0 = time.perf_counter()
        if caching:
            i0 = state["i"]
            for i in range(i0, i0 + iters):
                blocks = get(batch)
                cache(reqs[i % len(reqs)], blocks, 0, batch, 16, 0)
                free(blocks)
            state["i"] = i0 + iters
        else:
            for _ in range(iters):
                free(get(batch))
        return time.perf_counter() - t0

    cached = (
        "cache_full_blocks(req, blocks, 0, 16, 16, 0) with 16 fresh hashes; " if caching else ""
    )
    how = (
        f"BlockPool(num_gpu_blocks, enable_caching={caching}, hash_block_size=16); loop: "
        f"blocks = get_new_blocks(16); {cached}free_blocks(blocks)"
    )
    return run, how


def hashing(p: dict[str, Any], algo: str) -> tuple[Callable[[], float], str]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    hasher = get_request_block_hasher(16, fn)
    tokens = list(range(p["hash_blocks"] * 16))
    fn(b"probe")  # fail here (e.g. xxhash missing), not in the timing loop

    def run() -> float:
        total = 0.0
        for r in range(p["hash_iters"]):
            req = Request(f"h{r}", tokens, SamplingParams(max_tokens=1), None)
            t0 = time.perf_counter()
            hashes = hasher(req)
            total += time.perf_counter() - t0
            assert len(hashes) == p["hash_blocks"]
        return total

    how = (
        f"get_request_block_hasher(16, get_hash_fn_by_name({algo!r}))(request) over a fresh "
        f"Request of {p['hash_blocks'] * 16} prompt tokens (only the hasher call is timed)"
    )
    return run, how


def decode_step(p: dict[str, Any]) -> tuple[Callable[[], list[float]], str]:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    cfg = KVCacheConfig(
        num_blocks=p["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)],
    )
    mgr = KVCacheManager(
        cfg,
        max_model_len=p["max_model_len"],
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
    )
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(16, fn)
    reqs = []
    for i in range(p["num_reqs"]):
        prompt = [i] * 8 + list(range(p["prompt_len"] - 8 + i % 16))
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=10**6), None, block_hasher=hasher)
        blocks, n_hit, *_ = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        reqs.append(req)
    state = {"s": 0}

    def run() -> list[float]:
        times = []
        for _ in range(p["decode_chunk"]):
            tok = state["s"] % 100
            state["s"] += 1
            t0 = time.perf_counter()
            for req in reqs:
                req.append_output_token_ids(tok)
                assert mgr.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
            times.append(time.perf_counter() - t0)
        return times

    how = (
        "KVCacheManager(FullAttentionSpec(16, 8, 128, bf16) group, enable_caching=True, sha256); "
        "per step and request: append_output_token_ids(tok); allocate_slots(req, 1); "
        "num_computed_tokens += 1 (the KV manager alone: no block table, no slot mapping)"
    )
    return run, how


def main() -> None:
    """Serve: build every workload, print its description, then answer one timing per line."""
    p = json.loads(sys.argv[1])
    import vllm

    runners: dict[str, Callable[[], Any]] = {}
    info: dict[str, Any] = {"vllm_version": vllm.__version__, "python": platform.python_version()}
    builders: dict[str, Callable[[], tuple[Callable[[], Any], str]]] = {
        "alloc_free_nocache": lambda: alloc_free(p, caching=False),
        "alloc_free_cache": lambda: alloc_free(p, caching=True),
        "hash_sha256": lambda: hashing(p, "sha256"),
        "hash_xxhash128": lambda: hashing(p, "xxhash"),
        "decode_step": lambda: decode_step(p),
    }
    for key, build in builders.items():
        try:
            runners[key], how = build()
            info[key] = {"how": how}
        except Exception as e:  # e.g. vLLM's xxhash needs the xxhash package in its env
            info[key] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        key = line.strip()
        if not key:
            break
        print(json.dumps(runners[key]()), flush=True)


if __name__ == "__main__":
    main()
