"""``kvstack backends`` (issue 27): the no-model default lists every catalogue model and exits 0
on a CPU, ``--platform`` takes real compute capabilities only, ``--installed`` says what the target
would have, ``--json`` for scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_spec import CATALOGUE
from kvstack.cli import main
from kvstack.cli.backends import COMPUTE_CAPABILITIES, EXIT_NOT_SERVED, parse_platform


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_no_model_lists_every_model_and_exits_0_on_a_cpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = cli(capsys, "backends", "--platform", "cpu")
    assert code == 0, err
    summary = out[out.index("summary: the backend per KV group on cpu") :]
    for name in CATALOGUE:
        assert name in summary
    # DeepSeek-V3's MLA is served on the CPU too (TORCH_SDPA's latent path): every group is
    assert "none serves it on cpu" not in summary and "DeepSeek-V3" in summary
    assert "TORCH_SDPA (kernel block 16)" in summary


def test_a_named_model_no_backend_serves_exits_nonzero(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # heads of 2048: wider than any backend takes (TORCH_SDPA's reference stops at 1024)
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "hidden_size": 4096,
        "head_dim": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = cli(capsys, "backends", str(tmp_path), "--platform", "cpu")
    assert code == EXIT_NOT_SERVED == 1
    assert "no backend on cpu serves" in err and "full (2 layers)" in err


@pytest.mark.parametrize("text", ["sm_10000", "sm_91", "sm_35", "sm_99"])
def test_platform_must_be_a_real_compute_capability(
    capsys: pytest.CaptureFixture[str], text: str
) -> None:
    code, _, err = cli(capsys, "backends", "Llama-3-8B", "--platform", text)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--platform={text!r} is not a CUDA compute capability (from sm_50 to sm_121" in err


@pytest.mark.parametrize("text", ["sm_80", "sm90", "sm_90a", "sm_100", "sm_120"])
def test_real_compute_capabilities_are_accepted(text: str) -> None:
    assert parse_platform(text).compute_capability in COMPUTE_CAPABILITIES


def _chosen(out: str) -> list[str]:
    data = json.loads(out)
    return [g["chosen"] for m in data["models"] for g in m["groups"]]


def test_installed_says_what_the_target_would_have(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("backends", "Llama-3-8B", "--platform", "sm_90", "--json")
    code, out, err = cli(capsys, *argv, "--installed", "fa3")
    assert code == 0, err
    assert _chosen(out) == ["FLASH_ATTN"]
    [row] = [
        r for r in json.loads(out)["models"][0]["groups"][0]["backends"] if r["status"] == "chosen"
    ]
    assert row["backend"] == "FLASH_ATTN" and any("FA3" in r for r in row["reasons"])
    code, out, _ = cli(capsys, *argv, "--installed", "flash_attn.cute")
    assert _chosen(out) == ["FLASH_ATTN"] and "FA4" in out
    code, out, _ = cli(capsys, *argv, "--installed", "")
    assert _chosen(out) == ["TRITON"]
    code, _, err = cli(capsys, *argv, "--installed", "fa9")
    assert code == 2 and "--installed='fa9': 'fa9' is not a module the backends probe" in err


def test_json_has_every_backend_with_its_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "backends", "gpt-oss-120b", "--platform", "cpu", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["platform"] == "cpu"
    [model] = data["models"]
    assert [g["chosen"] for g in model["groups"]] == ["TORCH_SDPA", "TORCH_SDPA"]
    for g in model["groups"]:
        assert g["kernel_block_size"] == 16
        rejected = {r["backend"]: r["reasons"] for r in g["backends"] if r["status"] == "rejected"}
        assert any("needs a CUDA GPU" in r for r in rejected["TRITON"])
