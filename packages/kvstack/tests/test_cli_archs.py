"""``kvstack generate`` on a saved tiny MiMo-V2-Flash and DeepSeek-V3 checkpoint (written by
transformers itself), as a user runs it: a subprocess, prompts as token ids. Its greedy tokens
must equal transformers' ``generate`` for each prompt (one holds token id 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvstack.engine.testing import hf_greedy, make_hf_checkpoint

PROMPTS = [list(range(3, 15)), [0, 9, 17, 0, 2, 8, 100]]
MAX_NEW = 6


@pytest.mark.parametrize("name", ["mimo_v2_flash", "deepseek_v3"])
def test_generate_serves_the_checkpoint_token_for_token(name: str, tmp_path: Path) -> None:
    model_dir = make_hf_checkpoint(name, tmp_path / name, seed=2)
    argv = [sys.executable, "-m", "kvstack", "generate", str(model_dir)]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    argv += ["--max-new-tokens", str(MAX_NEW), "--max-model-len", "64"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # Streamed "[i] token" lines, then one "[i] all tokens" line per request.
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[")][-len(PROMPTS) :]
    got = [[int(t) for t in ln.split("]", 1)[1].split()] for ln in lines]
    want = [hf_greedy(model_dir, p, MAX_NEW)[0] for p in PROMPTS]
    assert got == want, f"{name}: kvstack generate {got} vs transformers {want}"
