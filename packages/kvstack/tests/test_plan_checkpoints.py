"""``kvstack plan DIR`` / ``kvstack backends DIR`` on checkpoints of the architectures the engine
serves describe the cache the engine allocates (issue 29): the plan's page size, layer slots and
groups equal the runner's ``kv_cache_config`` for tiny MiMo-V2-Flash and DeepSeek-V3
checkpoints, the backends' configs the runner's (Gemma-2's softcap included); the released shapes read as the catalogue declares them (MiMo's sliding layers with
their own KV heads and sinks, DeepSeek-V3's 576-wide MLA latent); on sm_90 with FA4 MiMo's
groups get FLASH_ATTN_DIFFKV (TRITON, with the reason, for a float32 checkpoint) and
DeepSeek-V3 TRITON_MLA."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from kv_spec import CATALOGUE

pytest.importorskip("transformers")

from kvstack.cli import main
from kvstack.engine.archs import FAMILIES
from kvstack.engine.runner import ModelRunner
from kvstack.engine.testing import make_hf_checkpoint
from kvstack.planning import model_from_hf_config, plan_model, resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILY_NAMES = ("mimo_v2_flash", "deepseek_v3")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan")
    return {n: make_hf_checkpoint(n, root / n, seed=1) for n in (*FAMILY_NAMES, "gemma2")}


def _groups(cfg: Any) -> list[tuple[Any, ...]]:
    return [(g.spec, tuple(g.layer_names)) for g in cfg.groups]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_plan_of_a_checkpoint_is_what_the_runner_allocates(
    ckpts: dict[str, Path], family: str
) -> None:
    runner = ModelRunner(ckpts[family], num_blocks=64, max_model_len=64)
    ours = runner.kv_cache_config
    report = plan_model(
        resolve_model(str(ckpts[family])),
        ours.total_bytes,
        max_model_len=64,
        block_size=16,
        dtype="float32",
        max_num_batched_tokens=runner.max_num_batched_tokens,
    )
    cfg = report.config
    assert cfg is not None
    assert cfg.page_size_bytes == ours.page_size_bytes
    assert cfg.num_layer_slots == ours.num_layer_slots
    assert cfg.num_blocks == ours.num_blocks
    assert _groups(cfg) == _groups(ours)
    if family == "deepseek_v3":
        assert runner.mla_latent  # the latent, not decompressed K/V, on the CPU too
        assert {g.spec.kind for g in cfg.groups} == {"mla"}
    else:
        kinds = {g.spec.kind: g.spec.num_kv_heads for g in cfg.groups}
        assert kinds == {"full": 1, "sliding_window": 2}  # sliding layers: twice the heads


def _backends(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> dict[str, Any]:
    code = main(["backends", str(path), "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


# Gemma-2: the attention softcap, which a ModelConfig does not carry, reaches the selector
@pytest.mark.parametrize("family", [*FAMILY_NAMES, "gemma2"])
def test_backends_of_a_checkpoint_agree_with_the_runner_on_the_cpu(
    ckpts: dict[str, Path], family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = ModelRunner(ckpts[family], num_blocks=64, max_model_len=64)
    data = _backends(capsys, ckpts[family], "--platform", "cpu")
    (model,) = data["models"]

    from kv_backends import describe_config

    want = {describe_config(s.config).split(", block ")[0] for s in runner.selections.values()}
    # the CLI's configs are per distinct layer config at --block-size; the runner's per planned
    # group (whose block size the planner may grow): the same apart from the block size
    assert {g["config"].split(", block ")[0] for g in model["groups"]} == want
    assert {g["chosen"] for g in model["groups"]} == set(runner.backends.values()) == {"TORCH_SDPA"}
    if family == "gemma2":
        assert all(s.config.softcap > 0 for s in runner.selections.values())
        assert all("softcap" in g["config"] for g in model["groups"])


def _bf16(src: Path, dst: Path) -> Path:
    """``src``'s config.json as a bf16 checkpoint's (planning reads nothing else)."""
    config = json.loads((src / "config.json").read_text())
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return dst


def test_backends_on_sm90_name_the_issues_backends(
    ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sm90 = ("--platform", "sm_90", "--installed", "flash_attn.cute")
    mimo = _backends(capsys, _bf16(ckpts["mimo_v2_flash"], tmp_path / "mimo"), *sm90)
    groups = mimo["models"][0]["groups"]
    assert [g["chosen"] for g in groups] == ["FLASH_ATTN_DIFFKV"] * 2, groups
    assert any("sinks" in g["config"] and "4q/2kv" in g["config"] for g in groups)
    # the float32 tiny checkpoint: FA takes 16-bit only, so TRITON, and the reason is given
    mimo32 = _backends(capsys, ckpts["mimo_v2_flash"], *sm90)
    for g in mimo32["models"][0]["groups"]:
        assert g["chosen"] == "TRITON"
        (diffkv,) = [b for b in g["backends"] if b["backend"] == "FLASH_ATTN_DIFFKV"]
        assert any("dtype float32 not supported" in r for r in diffkv["reasons"])
    for path in (ckpts["deepseek_v3"], _bf16(ckpts["deepseek_v3"], tmp_path / "ds")):
        ds = _backends(capsys, path, *sm90)
        assert [g["chosen"] for g in ds["models"][0]["groups"]] == ["TRITON_MLA"]


def _released(family: str, **sizes: Any) -> dict[str, Any]:
    """The family's tiny config at released attention sizes, as a config.json dict."""
    tiny = dict(FAMILIES[family].tiny)
    arch = {"mimo_v2_flash": "MiMoV2FlashForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
    base = dict(hidden_size=64, intermediate_size=96, vocab_size=256, max_position_embeddings=512)
    return {**base, **tiny, **sizes, "architectures": [arch[family]], "dtype": "bfloat16"}


def _same_kv(a: Any, b: Any) -> None:
    skip = {"name", "max_model_len", "source"}
    diff = {
        f.name: (getattr(a, f.name), getattr(b, f.name))
        for f in dataclasses.fields(a)
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)
    }
    assert not diff, diff


def test_released_shapes_read_as_the_catalogue_declares_them() -> None:
    full = {0, 5, 11, 17, 23, 29, 35, 41, 47}
    mimo = _released(
        "mimo_v2_flash", num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=4,
        head_dim=192, v_head_dim=128, sliding_window_size=127,
        layer_types=["full_attention" if i in full else "sliding_attention" for i in range(48)],
        mlp_layer_types=["dense"] + ["sparse"] * 47,
    )  # fmt: skip
    _same_kv(model_from_hf_config(mimo), CATALOGUE["MiMo-V2-Flash"])
    ds = _released(
        "deepseek_v3", num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    )  # fmt: skip
    m = model_from_hf_config(ds)
    assert m.mla and m.head_size == 576
    _same_kv(m, CATALOGUE["DeepSeek-V3"])
