"""The scheduler side imports and runs without torch: prove it in a fresh interpreter that blocks
torch (and the worker-side layers), then drive a KVCacheManager through admit/decode/free."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import kv_blocktable

BLOCKED = ("torch", "triton", "numpy", "kv_kernels", "kv_backends", "kvstack", "kv_connectors")


def test_scheduler_side_runs_without_torch() -> None:
    code = textwrap.dedent(
        f"""
        import sys
        for name in {BLOCKED!r}:
            sys.modules[name] = None  # any import of these now fails
        import kv_blocktable
        from kv_blocktable import KVCacheManager, Request
        from kv_spec import FullAttentionSpec, SlidingWindowSpec, plan_kv_cache
        specs = {{
            "a": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64),
            "b": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, sliding_window=64),
        }}
        cfg = plan_kv_cache(specs, 64 * specs["a"].page_size_bytes, max_model_len=256)
        mgr = KVCacheManager(cfg, enable_events=True)
        for i in range(2):
            r = Request(f"r{{i}}", list(range(100)))
            hit, n = mgr.get_computed_blocks(r)
            assert mgr.allocate_slots(r, r.num_tokens - n, n, hit) is not None
            r.append_token_ids(5)
            mgr.allocate_slots(r, 1)
            mgr.free(r)
        assert n == 96, n
        assert mgr.usage == 0.0 and mgr.take_events()
        loaded = [m for m in {BLOCKED!r} if sys.modules.get(m) is not None]
        assert not loaded, loaded
        print("ok", kv_blocktable.__version__)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok ")


def test_version_matches_pyproject() -> None:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert kv_blocktable.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]


def test_exports_are_declared_and_torch_free() -> None:
    assert set(kv_blocktable.__all__) <= set(dir(kv_blocktable))
    assert "BlockTables" not in kv_blocktable.__all__
    assert "kv_blocktable.block_table" in (kv_blocktable.__doc__ or "")
    assert "torch" in (kv_blocktable.__doc__ or "")
