"""Issue 27, "a newcomer's first hour": install hints that run where the user stands,
``kvstack --version``, defaults in every ``--help``, and ``kvstack generate``'s input checks
(``--prompt-ids``, ``--dtype auto``, ``--max-model-len``, sampling flags, ``--device``, ``--seed``).

The CLI runs in this process (``kvstack.cli.main``): the same code as the console script, without
a torch import per call."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from kvstack import _hints
from kvstack._hints import install_hint, workspace_root
from kvstack.cli import DISTRIBUTIONS, build_parser, main
from kvstack.cli.generate import choose_dtype

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(_hints.__file__).parent
ROOT = Path(__file__).resolve().parents[3]
#: uv installs workspace members editable: kvstack is imported from this checkout's tree
from_checkout = pytest.mark.skipif(
    workspace_root() != ROOT, reason="kvstack is not imported from this checkout"
)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kvstack argv...`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert err.count("error:") == 1 and len(err.strip().splitlines()) == 1, err
    assert needle in err, err
    assert "Traceback" not in err


# -- install hints --------------------------------------------------------------------------------


@from_checkout
def test_hint_from_the_checkout_is_uv_run_with_the_group(tmp_path: Path) -> None:
    assert install_hint("hf", "kvstack demo", cwd=ROOT) == "uv run --group hf kvstack demo"
    assert install_hint("nixl", cwd=ROOT / "packages") == "uv run --group nixl kvstack ..."
    # outside the checkout, uv must be told where the project is
    assert install_hint("hf", cwd=tmp_path) == f"uv run --project {ROOT} --group hf kvstack ..."


def test_hint_outside_a_checkout_is_pip_install_of_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = tmp_path / "site-packages" / "kvstack"
    wheel.mkdir(parents=True)
    assert workspace_root(wheel / "__init__.py") is None
    # a tree shaped like the workspace is one (what the editable install points into)
    fake = tmp_path / "ws"
    pkg = fake / "packages" / "kvstack" / "src" / "kvstack"
    pkg.mkdir(parents=True)
    (fake / "packages" / "kvstack" / "pyproject.toml").write_text("[project]\nname = 'kvstack'\n")
    (fake / "pyproject.toml").write_text('[tool.uv.workspace]\n[dependency-groups]\nhf = ["x"]\n')
    assert workspace_root(pkg / "__init__.py") == fake
    monkeypatch.setattr(_hints, "workspace_root", lambda: None)
    assert install_hint("hf", "kvstack demo") == "pip install 'kvstack[hf]'"
    assert install_hint("nixl") == "pip install 'kv-connectors[nixl]'"


#: kvstack modules that still spell a pip command themselves, owned outside this change (issue 27
#: asks for one helper everywhere: move each to kvstack._hints.install_hint, then drop it here).
_NOT_YET: set[str] = set()


def test_every_install_hint_in_kvstack_comes_from_the_helper() -> None:
    spelled = sorted(
        str(f.relative_to(SRC))
        for f in SRC.rglob("*.py")
        if f.name != "_hints.py" and "pip install" in f.read_text()
    )
    assert set(spelled) <= _NOT_YET, spelled


@from_checkout
def test_generate_help_gives_the_command_that_works_here(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = cli(capsys, "generate", "--help")
    assert code == 0
    assert "uv run --group hf kvstack generate" in " ".join(out.split())
    assert "pip install" not in out


# -- --version, --help ----------------------------------------------------------------------------


def test_version_lists_every_package(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    code, out, _ = cli(capsys, "--version")
    assert code == 0
    for dist in DISTRIBUTIONS:
        assert f"{dist} {version(dist)}" in out.splitlines()


def test_every_option_says_its_default() -> None:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, p in sub.choices.items():
        fmt = p._get_formatter()
        for action in p._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._AppendAction):  # repeatable: nothing by default
                continue
            text = fmt._get_help_string(action) or ""
            if "default" not in text:
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
    help_text = sub.choices["generate"].format_help()
    assert "(default: 64MiB)" in help_text and "(default: auto)" in help_text


# -- kvstack generate -----------------------------------------------------------------------------


def _word_tokenizer(model_dir: Path, vocab: int) -> dict[str, int]:
    """A word-level tokenizer.json whose word "i" is NOT token id i."""
    tokenizers = pytest.importorskip("tokenizers")
    words = {str(i): (i + 7) % vocab for i in range(vocab)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(model_dir / "tokenizer.json"))
    return words


def test_digits_in_prompt_are_text_when_there_is_a_tokenizer(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = shutil.copytree(llama_dir, tmp_path / "m")
    words = _word_tokenizer(d, 128)
    as_text = cli(capsys, "generate", str(d), "--prompt", "1 2 3", "--max-new-tokens", "5")
    ids = ",".join(str(words[w]) for w in ("1", "2", "3"))
    as_ids = cli(capsys, "generate", str(d), "--prompt-ids", ids, "--max-new-tokens", "5")
    raw = cli(capsys, "generate", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "5")
    assert as_text[0] == as_ids[0] == raw[0] == 0, as_text[2]
    assert as_text[1] == as_ids[1]  # "1 2 3" went through the tokenizer ...
    assert as_text[1] != raw[1]  # ... and was not read as the ids 1, 2, 3


def test_prompt_ids_and_the_whole_text_of_each_request_at_the_end(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(
        capsys, "generate", str(llama_dir), "--prompt-ids", "1,2,3", "--prompt-ids", "4 5",
        "--max-new-tokens", "4",
    )  # fmt: skip
    assert code == 0, err
    streamed: dict[str, list[str]] = {"0": [], "1": []}
    lines = [ln for ln in out.splitlines() if ln.strip()]
    for ln in lines[:-2]:
        rid, tok = ln.split("] ")
        streamed[rid.lstrip("[")].append(tok.strip())
    # after the interleaved stream, one line per request with its whole output, in order
    assert lines[-2:] == [f"[0] {' '.join(streamed['0'])}", f"[1] {' '.join(streamed['1'])}"]
    assert all(len(v) == 4 for v in streamed.values())
    assert "dtype: float32 (auto: checkpoint" in err


def _edited(src: Path, dst: Path, **fields: object) -> Path:
    d = shutil.copytree(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **fields}))
    return d


def test_dtype_auto_follows_the_checkpoint_and_says_so(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _edited(llama_dir, tmp_path / "bf16", torch_dtype="bfloat16")
    code, _, err = cli(capsys, "generate", str(d), "--prompt-ids", "1", "--max-new-tokens", "1")
    assert code == 0, err
    assert "dtype: float32 (auto: checkpoint bfloat16, computed in float32 on the CPU" in err
    code, _, err = cli(
        capsys, "generate", str(d), "--prompt-ids", "1", "--max-new-tokens", "1",
        "--dtype", "bfloat16",
    )  # fmt: skip
    assert code == 0 and "dtype: bfloat16 (--dtype)" in err, err


@pytest.mark.parametrize(
    ("requested", "checkpoint", "device", "chosen"),
    [
        ("auto", "bfloat16", "cuda", "bfloat16"),
        ("auto", "float16", "cuda", "float16"),
        ("auto", "float32", "cuda", "bfloat16"),  # vLLM: fp32 checkpoints run in bf16 on a GPU
        ("auto", None, "cuda", "bfloat16"),
        ("auto", "bfloat16", "cpu", "float32"),
        ("auto", None, "cpu", "float32"),
        ("float16", "bfloat16", "cpu", "float16"),
    ],
)
def test_choose_dtype(requested: str, checkpoint: str | None, device: str, chosen: str) -> None:
    assert choose_dtype(requested, checkpoint, device)[0] == chosen


def test_max_model_len_above_the_model_needs_the_override(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ("generate", str(llama_dir), "--prompt-ids", "1", "--max-new-tokens", "2")
    code, _, err = cli(capsys, *argv, "--max-model-len", "512")
    one_error(code, err, "--max-model-len=512 is above the model's max_position_embeddings=256")
    assert "--allow-long-max-model-len" in err
    code, _, err = cli(capsys, *argv, "--max-model-len", "512", "--allow-long-max-model-len")
    assert code == 0 and "warning: --max-model-len=512 is above" in err, err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ("--prompt-ids", "1", "--top-p", "1.5"),
            "argument --top-p: --top-p='1.5' must be in (0, 1]",
        ),
        (("--prompt-ids", "1", "--top-p", "0"), "--top-p='0' must be in (0, 1]"),
        (("--prompt-ids", "1", "--temperature", "nan"), "--temperature='nan' must be a finite"),
        (("--prompt-ids", "1", "--temperature=-1"), "--temperature='-1' must be a finite"),
        # the engine's own check (SamplingParams), named as the flag
        (("--prompt-ids", "1", "--temperature", "1e-6"), "error: --temperature=1e-06 is below"),
        (("--prompt-ids", "1", "--seed", str(2**64)), f"--seed='{2**64}' is beyond 2^64 - 1"),
        (("--prompt-ids", "1", "--seed=-1"), "--seed='-1' must be a whole number in [0, 2^64 - 1]"),
        (("--prompt-ids", "1,x"), "--prompt-ids='1,x' is not a list of token ids"),
        (("--prompt-ids", "1,999"), "--prompt-ids: token ids [999] are outside"),
        (("--prompt", "hello"), "--prompt='hello' needs a tokenizer"),
        (("--prompt", "1 2 3"), "or give token ids with --prompt-ids 1,2,3"),
        ((), "give at least one --prompt TEXT or --prompt-ids 1,2,3"),
        (
            ("--prompt-ids", "1", "--device", "cuda:banana"),
            "--device='cuda:banana' is not a device",
        ),
    ],
)
def test_generate_bad_input_is_one_line_naming_the_flag(
    llama_dir: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], needle: str
) -> None:
    code, _, err = cli(capsys, "generate", str(llama_dir), *extra)
    one_error(code, err, needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "generate", str(llama_dir), "--prompt-ids", "1", "--device", "cuda")
    one_error(code, err, "--device='cuda' but no CUDA GPU is visible here")
    assert "use --device cpu" in err


def test_largest_seed_runs(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(
        capsys, "generate", str(llama_dir), "--prompt-ids", "1", "--max-new-tokens", "2",
        "--temperature", "1", "--seed", str(2**64 - 1),
    )  # fmt: skip
    assert code == 0, err
    assert len(out.split()) == 2


def test_missing_dir_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "generate", str(tmp_path / "nope"), "--prompt-ids", "1")
    one_error(code, err, "nope' does not exist")
    code, _, err = cli(capsys, "generate", str(tmp_path), "--prompt-ids", "1")
    one_error(code, err, "has no config.json")


def test_a_tokenizer_no_library_reads_gets_the_install_hint(
    llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = shutil.copytree(llama_dir, tmp_path / "m")
    (d / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    code, _, err = cli(capsys, "generate", str(d), "--prompt", "hi")
    one_error(code, err, "has tokenizer.json but neither transformers nor tokenizers")
    assert install_hint("hf", "kvstack generate ...") in err
    # token ids still run, with a note that text needs the library
    code, _, err = cli(capsys, "generate", str(d), "--prompt-ids", "1", "--max-new-tokens", "1")
    assert code == 0 and "note:" in err and install_hint("hf", "kvstack generate ...") in err, err


def test_an_unreadable_tokenizer_names_the_directory(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tokenizers")
    d = shutil.copytree(llama_dir, tmp_path / "m")
    (d / "tokenizer.json").write_text("")
    code, _, err = cli(capsys, "generate", str(d), "--prompt", "hi")
    one_error(code, err, f"{d}: cannot read its tokenizer (tokenizer.json)")


@from_checkout
def test_hint_from_a_removed_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # Path.cwd() now raises FileNotFoundError
    assert install_hint("hf") == f"uv run --project {ROOT} --group hf kvstack ..."
