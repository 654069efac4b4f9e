"""``benchmarks/bench_disagg.py --quick`` on the CPU: a prefill process and this decode process
through the engines' connector path (P2P over gloo), against one colocated engine (numbers: no
claim; the tokens must be the colocated run's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_disagg.py"


def test_quick_run_moves_the_prompts_and_keeps_the_tokens(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--layerwise", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "disagg_p2p_cpu.json").read_text())
    assert record["all_tokens_equal"] and record["load_failures"] == 0
    # the KV the decode engines loaded is the prefill engine's, byte for byte: every
    # whole-request load is checked; a layer-wise one where the producer still held the blocks
    # when it took its digest (the consumer's "done" may free them first)
    assert record["all_kv_equal"] and record["kv_checks"] >= 2
    assert all(r["kv_equal"] is True for r in record["per_request"])
    assert all(r["layerwise_kv_equal"] is not False for r in record["per_request"])
    # two 100-token prompts and a warm-up round: 6 full blocks of 16 each
    assert record["loaded_tokens"] == 3 * 96
    assert len(record["per_request"]) == 2 and record["median"]["transfer_s"] > 0
    # layer-wise streaming moved the same blocks, inside the decode engine's steps
    assert record["layerwise"]["loaded_tokens"] == 3 * 96
    assert record["layerwise"]["load_failures"] == 0
    assert record["median"]["layerwise_ttft_at_decode_s"] > 0
    # the report beside the JSON: a row per request, the medians and the goal's figure
    md = (tmp_path / "disagg_p2p_cpu.md").read_text()
    assert md.count("\n| ") == 4  # (the header, two requests, the medians)
    assert "Layer-wise streaming adds" in md
    assert f"in all {record['kv_checks']} checks: yes" in md


def test_the_kv_digest_sees_a_wrong_a_swapped_and_a_dropped_page() -> None:
    """The benchmark's byte check can fail: the digest of a request's blocks changes when one
    byte of a page changes, when two pages swap places, and when a page is another block's."""
    import importlib.util
    from types import SimpleNamespace

    import torch
    from kv_kernels import allocate_kv_cache, layer_view
    from kv_spec import KVCacheLayout

    spec = importlib.util.spec_from_file_location("bench_disagg", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    layout = KVCacheLayout(
        order="LBNHC", num_layers=2, num_blocks=8, num_kv_heads=2, block_size=4, head_size=8, head_size_v=8,
        dtype="float16",
    )  # fmt: skip
    storage = allocate_kv_cache(layout, "cpu")
    g = torch.Generator().manual_seed(0)
    for layer in range(layout.num_layers):
        view = layer_view(storage, layout, layer)
        view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))
    blocks = {"r": [3, 5, 6]}
    engine = SimpleNamespace(
        runner=SimpleNamespace(layouts={0: layout}, kv_caches={0: storage}, device=torch.device("cpu")),
        block_ids=lambda rid: (list(blocks[rid]),),
    )  # fmt: skip
    want = bench._kv_digest(engine, "r", 3)
    assert bench._kv_digest(engine, "r", 3) == want
    blocks["r"] = [5, 3, 6]  # swapped pages
    assert bench._kv_digest(engine, "r", 3) != want
    blocks["r"] = [3, 5, 7]  # another block's page
    assert bench._kv_digest(engine, "r", 3) != want
    blocks["r"] = [3, 5, 6]
    assert bench._kv_digest(engine, "r", 3) == want
    page = layer_view(storage, layout, 1)[6]  # block 6 of layer 1: one value
    page[0, 0, 1] += 1.0  # (head 0, token 0, channel 1)
    assert bench._kv_digest(engine, "r", 3) != want
