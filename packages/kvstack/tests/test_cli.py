"""The ``kvstack`` command line, run as a user runs it: through a subprocess.

Every command and every error path: errors are one ``error:`` line on stderr, exit 2, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def kvstack(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstack.cli", *argv],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        timeout=300,
    )


def assert_clean_error(res: subprocess.CompletedProcess[str], needle: str, code: int = 2) -> None:
    assert res.returncode == code, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    assert needle in res.stderr, res.stderr


def test_plan_prints_hand_checked_numbers() -> None:
    res = kvstack("plan", "Llama-3-8B", "--memory", "40GiB")
    assert res.returncode == 0, res.stderr
    # 40 GiB / (64 KiB page * 32 layers) = 20480 blocks; 8192-token requests: 512 blocks each -> 40
    assert "20,480" in res.stdout and "64.00 KiB" in res.stdout and "40.00" in res.stdout


def test_plan_json_for_scripts_with_tp_and_fp8() -> None:
    res = kvstack(
        "plan", "gpt-oss-120b", "--memory", "40GiB", "--max-model-len", "32768",
        "--block-size", "16", "--tp", "2", "--kv-quant", "fp8_per_tensor", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    [plan] = json.loads(res.stdout)
    # TP 2: 4 of 8 KV heads per rank; fp8: 1 byte; page = 16 tokens * 4 heads * (64 + 64) = 8 KiB
    assert plan["page_size_bytes"] == 16 * 4 * 128
    # 18 sliding + 18 full layers -> 2 groups of 18 sharing 18 layer slots
    assert plan["num_layer_slots"] == 18 and len(plan["groups"]) == 2
    assert plan["num_blocks"] == 40 * 2**30 // (8192 * 18)
    kinds = {g["kind"]: g for g in plan["groups"]}
    assert kinds["sliding_window"]["sliding_window"] == 128
    assert kinds["full"]["kv_quant"] == "fp8_per_tensor" and kinds["full"]["dtype"] == "fp8_e4m3"
    assert len(kinds["full"]["layout_hash"]) == 32
    # full group: 32768 / 16 = 2048 blocks; sliding: (127 + 8192) / 16 -> 520 + 1 = 521 blocks
    assert plan["bytes_per_request"] == (2048 + 521) * 8192 * 18


def test_plan_with_a_scale_plane() -> None:
    """``--scales``: per-token-head quant gets a plane by default (``auto``) as with ``plane``:
    the same page bytes as ``inline``, a layout (hence hash) of its own; the title says where
    the scales went; ``plane`` without per-token-head scales is refused with kv-spec's reason."""
    args = ("plan", "Llama-3-8B", "--memory", "8GiB", "--kv-quant", "int8_per_token_head")
    runs = {s: kvstack(*args, "--json", "--scales", s) for s in ("auto", "plane", "inline")}
    assert all(r.returncode == 0 for r in runs.values()), runs["auto"].stderr
    auto, plane, inline = (json.loads(runs[s].stdout)[0] for s in ("auto", "plane", "inline"))
    # 16 tokens * 8 heads * (128 + 128 + 8) bytes either way
    assert auto["page_size_bytes"] == inline["page_size_bytes"] == 16 * 8 * 264
    assert (auto["scale_plane"], plane["scale_plane"], inline["scale_plane"]) == (True, True, False)
    assert auto["groups"][0]["layout_hash"] == plane["groups"][0]["layout_hash"]
    assert auto["groups"][0]["layout_hash"] != inline["groups"][0]["layout_hash"]
    assert "(scales in a plane)" in kvstack(*args).stdout
    assert "(scales inline)" in kvstack(*args, "--scales", "inline").stdout
    res = kvstack("plan", "Llama-3-8B", "--memory", "8GiB", "--scales", "plane")
    assert res.returncode != 0 and "no layer stores per-token-head scales" in res.stderr
    assert "Traceback" not in res.stderr


def test_plan_that_cannot_serve_one_request_exits_nonzero() -> None:
    res = kvstack("plan", "MiMo-V2-Flash", "--memory", "4GiB")
    assert res.returncode == 1
    assert "one request needs" in res.stdout and "cannot hold one request" in res.stderr


def test_plan_reads_a_config_json(tmp_path: Path) -> None:
    cfg = {
        "model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 64, "max_position_embeddings": 512,
        "sliding_window": 64, "dtype": "float32",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    res = kvstack("plan", str(tmp_path), "--memory", "1MiB", "--json")
    assert res.returncode == 0, res.stderr
    [plan] = json.loads(res.stdout)
    # head 16, 2 kv heads, fp32, block 16: page = 16 * 2 * 32 * 4 bytes = 4 KiB; 2 layer slots
    assert plan["page_size_bytes"] == 4096 and plan["num_blocks"] == 2**20 // (4096 * 2)
    assert [g["kind"] for g in plan["groups"]] == ["sliding_window"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("plan", "GPT-5"), "model 'GPT-5' is not in the catalogue"),
        (("plan", "Llama-3-8B", "--memory", "abc"), "cannot read 'abc' as a byte size"),
        (("plan", "Llama-3-8B", "--memory=-1"), "is negative"),
        (("plan", "Llama-3-8B", "--memory", "1e400"), "is larger than"),
        (("plan", "Llama-3-8B", "--block-size", "abc"), "--block-size='abc' is not a whole number"),
        (("plan", "Llama-3-8B", "--max-model-len=-1"), "must be at least 1"),
        (("plan", "Llama-3-8B", "--tp", "3"), "--tp=3 does not divide Llama-3-8B's 32 query heads"),
        (("plan", "Llama-3-8B", "--kv-quant", "int4"), "invalid choice: 'int4'"),
        (("plan", "/nonexistent/config.json"), "no such config file"),
        (("backends", "Llama-3-8B", "--platform", "tpu"), "--platform='tpu' is not"),
        (("bench", "everything"), "unknown benchmark suite(s) ['everything']"),
        (("frobnicate",), "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_clear_line_on_stderr(argv: tuple[str, ...], needle: str) -> None:
    res = kvstack(*argv)
    assert_clean_error(res, needle)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_tp_that_splits_a_kv_head_is_an_error(tmp_path: Path) -> None:
    cfg = {
        "num_hidden_layers": 1,
        "num_attention_heads": 24,
        "num_key_value_heads": 6,
        "hidden_size": 768,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = kvstack("plan", str(tmp_path), "--tp", "4")
    assert_clean_error(res, "--tp=4 neither divides")


def test_tp_that_is_a_multiple_of_few_kv_heads_replicates() -> None:
    # Qwen3-32B: 64 q / 8 kv heads; TP 16 is a multiple of 8, so each rank holds one KV head replica.
    res = kvstack("plan", "Qwen3-32B", "--tp", "16", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["groups"][0]["num_kv_heads"] == 1


def test_models_lists_the_catalogue() -> None:
    res = kvstack("models")
    assert res.returncode == 0, res.stderr
    for name in ("Llama-3-70B", "DeepSeek-V3", "gpt-oss-120b", "MiMo-V2-Flash"):
        assert name in res.stdout


def test_backends_chooses_per_group_and_gives_every_reason() -> None:
    res = kvstack("backends", "gpt-oss-120b", "--platform", "cpu")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "sliding_window (18 layers)" in out and "full (18 layers)" in out
    assert out.count("chosen") == 2 and "TORCH_SDPA" in out
    assert "needs a CUDA GPU" in out  # TRITON / FLASH_ATTN rejected on a CPU, with the reason
    res = kvstack("backends", "MiMo-V2-Flash", "--platform", "sm_90")
    assert res.returncode == 0, res.stderr
    # head 192/128: the DiffKV backend is the only one that takes head_size_v != head_size first
    assert "FLASH_ATTN_DIFFKV" in res.stdout and "rejected" in res.stdout


@pytest.mark.parametrize(
    "command", [(), ("demo",), ("generate",), ("plan",), ("models",), ("backends",), ("bench",)]
)
def test_help_everywhere(command: tuple[str, ...]) -> None:
    res = kvstack(*command, "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: kvstack"), res.stderr


def test_generate_streams_token_ids_and_refuses_text_without_a_tokenizer(tmp_path: Path) -> None:
    from kvstack.demo import write_random_checkpoint

    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64, "max_position_embeddings": 128,
        "eos_token_id": None,
    }  # fmt: skip
    model_dir = write_random_checkpoint(tmp_path / "m", cfg)
    res = kvstack("generate", str(model_dir), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6")
    assert res.returncode == 0, res.stderr
    ids = [int(t) for t in res.stdout.split()]
    assert len(ids) == 6 and all(0 <= t < 64 for t in ids)
    assert "6 tokens in" in res.stderr
    res = kvstack("generate", str(model_dir), "--prompt", "hello there")
    assert_clean_error(res, "has no tokenizer")
    res = kvstack("generate", str(tmp_path / "missing"), "--prompt-ids", "1")
    assert_clean_error(res, "does not exist; give a Hugging Face checkpoint directory")
    res = kvstack("generate", str(model_dir), "--prompt-ids", "1 2", "--max-new-tokens", "0")
    assert_clean_error(res, "--max-new-tokens='0' must be at least 1")


@pytest.mark.slow
def test_demo_runs_as_a_user_runs_it() -> None:
    res = kvstack("demo")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "KV-cache plans" in out and "Llama-3-8B" in out
    assert "RANDOM weights" in out and "prefix cache" in out and "hit rate" in out
    assert "TORCH_SDPA" in out  # the backend per group, on this CPU
    assert "CUDA graphs" in out and "off: the runner is on cpu" in out  # and why no graphs
    assert "16/16 token for token" in out  # the dense reference (and transformers when installed)
    assert "✓ match" in out and "all tokens match" in out  # the prefill -> decode handoff


def test_generate_streams_text_with_a_tokenizer_in_the_directory(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from kvstack.demo import write_random_checkpoint

    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64, "max_position_embeddings": 128,
        "eos_token_id": None,
    }  # fmt: skip
    model_dir = write_random_checkpoint(tmp_path / "m", cfg)
    words = [f"w{i}" for i in range(64)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(model_dir / "tokenizer.json"))
    res = kvstack("generate", str(model_dir), "--prompt", "w1 w2 w3", "--max-new-tokens", "5")
    assert res.returncode == 0, res.stderr
    out = res.stdout.split()
    assert len(out) == 5 and all(w in words for w in out), res.stdout


def test_python_dash_m_kvstack_is_the_same_command() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvstack", "plan", "Llama-3-8B", "--memory", "4GiB", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == kvstack("plan", "Llama-3-8B", "--memory", "4GiB", "--json").stdout
