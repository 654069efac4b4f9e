"""``kvstack plan`` / ``kvstack models`` (issue 27): ``--dtype fp8`` points to ``--kv-quant``, a path
that does not exist is called one (not "not in the catalogue"), ``models --json``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from kv_spec import CATALOGUE
from kvstack.cli import main


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code: int, err: str, needle: str) -> None:
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


@pytest.mark.parametrize(
    ("dtype", "needle"),
    [
        ("fp8", "--dtype='fp8' is a quantized cache dtype, which --kv-quant chooses: give "
                "--kv-quant fp8_per_tensor or fp8_per_token_head"),
        ("fp8_e5m2", "--kv-quant fp8_per_tensor or fp8_per_token_head"),
        ("int8", "--kv-quant int8_per_token_head"),
        ("abc", "--dtype='abc' is not a KV-cache dtype; use float32, float16 or bfloat16"),
    ],
)  # fmt: skip
def test_plan_dtype_points_to_kv_quant(
    capsys: pytest.CaptureFixture[str], dtype: str, needle: str
) -> None:
    code, _, err = cli(capsys, "plan", "Llama-3-8B", "--dtype", dtype)
    one_error(code, err, needle)
    assert "FullAttentionSpec" not in err


def test_plan_dtype_that_fits_the_quant_mode_still_plans(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = cli(capsys, "plan", "Llama-3-8B", "--dtype", "float16", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["groups"][0]["dtype"] == "float16"


@pytest.mark.parametrize("path", ["./no-such-model", "no/such/dir", "~/nope"])
def test_a_missing_path_is_called_missing(capsys: pytest.CaptureFixture[str], path: str) -> None:
    code, _, err = cli(capsys, "plan", path)
    one_error(code, err, f"{path!r}: no such file or directory")
    assert "not in the catalogue" not in err


def test_an_unknown_name_is_still_not_in_the_catalogue(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = cli(capsys, "plan", "GPT-5")
    one_error(code, err, "model 'GPT-5' is not in the catalogue")


def test_models_json_is_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "models", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [m["name"] for m in data] == list(CATALOGUE)
    assert data == [json.loads(json.dumps(dataclasses.asdict(m))) for m in CATALOGUE.values()]
    mla = {m["name"]: m["mla"] for m in data}
    assert mla["DeepSeek-V3"] and not mla["Llama-3-8B"]
