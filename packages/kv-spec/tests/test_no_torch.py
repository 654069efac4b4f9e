"""kv_spec must import and plan with torch absent: prove it in a fresh interpreter that blocks torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_and_plan_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        # Make any import of torch/triton/numpy fail, whether or not they are installed.
        for name in ("torch", "triton", "numpy"):
            sys.modules[name] = None
        import kv_spec
        from kv_spec import get_model, plan_kv_cache
        cfg = plan_kv_cache(get_model("Llama-3-8B").kv_specs(), 2**30, max_model_len=8176)
        assert cfg.num_blocks == 2**30 // (65536 * 32), cfg.num_blocks
        loaded = [m for m in ("torch", "triton", "numpy") if sys.modules.get(m) is not None]
        assert not loaded, loaded
        print("ok", kv_spec.__version__)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok ")
