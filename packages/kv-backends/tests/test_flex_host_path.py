"""FLEX_ATTENTION's per-forward host path (issue 32): Dynamo's recompile limits are raised only
for the first compiled forward of each kind of layer over a metadata
(``FlexAttentionMetadata.compiled_keys``), later layers call Flex as is, and a call that misses
its graphs past the process's own limit runs again with them raised.

The marker must be per metadata: planted twins carry a stale marker into a new batch (its
graphs not compiled yet) with the retry switched off, and the forward fails; with the retry it
still succeeds. Flex is compiled with Dynamo's ``eager`` backend (Dynamo's guards and limits are
what is tested, not inductor), the process's own limit set to 1 graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends.flex import impl as flex_module
from kv_backends.testing import make_paged_batch, oracle_attention

TOL: dict[str, Any] = {"atol": 2e-5, "rtol": 1e-4}


@pytest.fixture
def strict_dynamo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Compiled Flex through Dynamo's eager backend, a fresh cache, the process's limit at 1."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False, backend="eager")
    monkeypatch.setattr(flex_module, "compiled_flex", lambda static=False: fn)
    with torch._dynamo.config.patch(recompile_limit=1):
        yield
    torch._dynamo.reset()


def _setup(**kw: Any) -> tuple[Any, Any, Any]:
    first = make_paged_batch(query_lens=[1], seq_lens=[40], num_blocks=64, **kw)
    backend = get_backend("FLEX_ATTENTION")
    builder = backend.make_builder(
        first.config, first.layout, static_shapes=True, max_num_batched_tokens=64, max_num_seqs=8
    )
    layers = [backend.make_impl(first.config, first.layout, compiled=True) for _ in range(2)]
    return builder, layers, backend


def _decodes(n: int, seed: int) -> Any:
    # n decode requests: the decode call's batch is n rows (a power of 2), one graph per n
    return make_paged_batch(
        query_lens=[1] * n, seq_lens=[9 + 7 * i for i in range(n)], num_blocks=64, seed=seed
    )


def _check(out: torch.Tensor, b: Any) -> None:
    t = b.q.shape[0]
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)


def test_marker_is_fresh_per_metadata() -> None:
    builder, (impl, _), _ = _setup()
    b = _decodes(2, 0)
    md = builder.build(b.common)
    assert md.compiled_keys == set()
    impl.forward(None, b.q, b.kv_cache, md)  # eager on the CPU (compiled=None): no marker
    md2 = builder.build(b.common)
    assert md2.compiled_keys is not md.compiled_keys and md2.compiled_keys == set()
    assert dataclasses.replace(md, num_reqs=md.num_reqs).compiled_keys == set()


def test_layers_of_a_step_share_the_raised_limits(strict_dynamo: None) -> None:
    builder, (layer0, layer1), _ = _setup()
    assert layer0.compile_key == layer1.compile_key
    for step, n in enumerate((2, 4, 2, 4)):  # two graphs: past the process's limit of 1
        b = _decodes(n, step)
        md = builder.build(b.common)
        _check(layer0.forward(None, b.q, b.kv_cache, md), b)
        assert md.compiled_keys == {layer0.compile_key}
        _check(layer1.forward(None, b.q, b.kv_cache, md), b)  # no limits raised: graphs exist


def test_stale_marker_without_retry_fails(
    strict_dynamo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder, (layer0, _), _ = _setup()
    b = _decodes(2, 0)
    _check(layer0.forward(None, b.q, b.kv_cache, builder.build(b.common)), b)
    b4 = _decodes(4, 1)
    md4 = builder.build(b4.common)
    # Planted: the marker carried over from the last batch (its graphs are not this one's) and
    # the retry off: the call compiles past the process's limit without raising it.
    md4.compiled_keys.add(layer0.compile_key)
    monkeypatch.setattr(flex_module, "recompile_limit_hit", lambda: ())
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        layer0.forward(None, b4.q, b4.kv_cache, md4)


def test_stale_marker_is_caught_by_the_retry(strict_dynamo: None) -> None:
    builder, (layer0, _), _ = _setup()
    b = _decodes(2, 0)
    _check(layer0.forward(None, b.q, b.kv_cache, builder.build(b.common)), b)
    b4 = _decodes(4, 1)
    md4 = builder.build(b4.common)
    md4.compiled_keys.add(layer0.compile_key)  # a miss the marker did not foresee
    _check(layer0.forward(None, b4.q, b4.kv_cache, md4), b4)
    assert torch._dynamo.config.recompile_limit == 1  # put back after the retry


def test_compile_key_tells_layer_kinds_apart() -> None:
    b = make_paged_batch(query_lens=[1], seq_lens=[40], num_blocks=64)
    w = make_paged_batch(query_lens=[1], seq_lens=[40], num_blocks=64, sliding_window=9)
    backend = get_backend("FLEX_ATTENTION")

    def key(batch: Any, **kw: Any) -> Any:
        impl: Any = backend.make_impl(batch.config, batch.layout, compiled=True, **kw)
        return impl.compile_key

    assert key(b) == key(b)
    assert key(b) != key(w)
    assert key(b) != key(b, scale=0.5)


def test_bench_flex_host_runs(tmp_path: Any) -> None:
    """``benchmarks/bench_flex_host.py`` (the host harness these changes were measured with)
    end to end on two cases (numbers: no claim)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_flex_host.py"
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(script), "--only", "mixed", "--calls", "2", "--rounds", "2"]
    res = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert {r["impl"] for r in records} == {"FLEX_ATTENTION", "prefill=gather"}
    assert all(r["decode_call"] and r["windows"] == 1 for r in records)
    assert all(0 < r["forward_host_us_min"] <= r["forward_host_us"] for r in records)
