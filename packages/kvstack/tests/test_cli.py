from __future__ import annotations

import subprocess
import sys

import pytest
from kvstack.cli import main
from kvstack.units import format_bytes, parse_bytes


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_plan_prints_hand_checked_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "plan", "Llama-3-8B", "--memory", "40GiB")
    assert code == 0
    # 40 GiB / (64 KiB page * 32 layers) = 20480 blocks; 8192-token requests: 512 blocks each -> 40
    assert "20,480" in out and "64.00 KiB" in out and "40.00" in out


def test_plan_says_how_much_a_request_needs_when_it_does_not_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = run(capsys, "plan", "MiMo-V2-Flash", "--memory", "4GiB")
    assert code == 0
    assert "one request needs" in out and "GiB" in out


def test_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "plan", "GPT-5", "--memory", "1GiB")
    assert code == 2 and "model 'GPT-5' is not in the catalogue" in out
    code, out = run(capsys, "plan", "--memory", "lots")
    assert code == 2 and "cannot read 'lots' as a byte size" in out


def test_models_lists_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "models")
    assert code == 0
    for name in ("Llama-3-70B", "DeepSeek-V3", "gpt-oss-120b", "MiMo-V2-Flash"):
        assert name in out


def test_demo_runs_as_a_user_runs_it() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstack.cli", "demo"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stderr
    assert "KV-cache plans" in res.stdout and "Llama-3-8B" in res.stdout
    # step 2 serves the tiny model through the real stack and holds each backend to the oracle
    assert "continuous batching over one paged cache" in res.stdout
    assert "TORCH_SDPA selected on cpu" in res.stdout and "disagreed" not in res.stdout


@pytest.mark.parametrize(
    ("text", "n"), [("40GiB", 40 * 2**30), ("512 MiB", 2**29), ("1e9", 10**9), ("2kb", 2000)]
)
def test_parse_bytes(text: str, n: int) -> None:
    assert parse_bytes(text) == n


def test_format_bytes() -> None:
    assert format_bytes(65536) == "64.00 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(12) == "12 B"
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_bytes("0.5b")
