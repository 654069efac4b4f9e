"""A broken checkpoint's error names the file: a corrupt ``config.json``, a truncated safetensors
file, a corrupt shard index (issue 27)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvstack.engine.hf_config import checkpoint_dtype, load_arch_config
from kvstack.engine.loader import load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_config_json_names_the_file(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    (d / "config.json").write_text('{"architectures": [')
    with pytest.raises(ValueError, match=rf"{d / 'config.json'}: cannot read it as JSON"):
        load_arch_config(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{d / 'config.json'}: holds a JSON list"):
        load_arch_config(d)


def test_a_config_the_engine_refuses_names_the_file(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"{d / 'config.json'}: .*no 'vocab_size'"):
        load_arch_config(d)


def test_truncated_safetensors_names_the_file(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{f}: cannot read it as safetensors .* truncated"):
        load_model(d)


def test_corrupt_shard_index_names_the_file(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: cannot read the shard"):
        load_model(d)


@pytest.mark.parametrize(
    ("cfg", "dtype"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),
        ({"torch_dtype": "torch.float32"}, "float32"),
        ({"dtype": "float8_e4m3fn"}, None),
        ({}, None),
    ],
)
def test_checkpoint_dtype_reads_dtype_or_torch_dtype(cfg: dict[str, str], dtype: str) -> None:
    assert checkpoint_dtype(cfg) == dtype
