"""Planted bugs in what the newer families add: the transformers parity of
``test_models_hf.py`` must catch each (a bug that moved no logit would let a family's switch be
dropped unseen). Same prompts, schedule and tolerance as there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvstack.engine.archs import ARCHITECTURES, FAMILIES
from kvstack.engine.hf_config import ArchConfig
from kvstack.engine.models import Attention, MLAAttention
from kvstack.engine.runner import ModelRunner
from kvstack.engine.testing import greedy_generate, hf_greedy, make_hf_checkpoint

LOGIT_RTOL = 1e-4  # as test_models_hf.py
MAX_NEW = 6
PROMPTS = [list(range(3, 40)), [0, 9, 17, 0, 2, 8, 100], list(range(50, 71))]
CHUNKS = [16, 100, 5]
NAMES = ["gemma2", "gemma3", "mimo_v2_flash", "deepseek_v3"]

pytestmark = pytest.mark.usefixtures("one_thread")

Refs = list[tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("planted")
    return {n: make_hf_checkpoint(n, root / n, seed=1) for n in NAMES}


@pytest.fixture(scope="module")
def hf_refs(checkpoints: dict[str, Path]) -> dict[str, Refs]:
    return {n: [hf_greedy(p, q, MAX_NEW) for q in PROMPTS] for n, p in checkpoints.items()}


def _error(runner: ModelRunner, refs: Refs) -> float:
    result = greedy_generate(runner, PROMPTS, MAX_NEW, chunk_sizes=CHUNKS)
    return max(
        float((ours - ref).abs().max() / ref.abs().max())
        for ours, (_, ref) in zip(result.logits, refs, strict=True)
    )


def _attn(runner: ModelRunner) -> list[Attention | MLAAttention]:
    return [layer.self_attn for layer in runner.model.decoder_layers()]


def _full_rotary(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    for attn in _attn(runner):  # rotate all 192 dims instead of the first 64
        mp.setattr(attn, "rotary_dim", attn.head_dim)
    runner.model.reset_rotaries()
    for key, rot in runner.model.rotaries.items():
        wide = type(rot)(runner.arch.rope_by_type["full_attention"], runner.arch.head_dim)
        runner.model.rotaries[key] = wide


def _drop_sinks(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    for binding in runner.layers:
        mp.setattr(binding.impl, "sinks", None)
        mp.setattr(binding.impl, "_params", {})  # (the per-device copy the first step made)


def _drop_v_scale(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    for attn in _attn(runner):
        mp.setattr(attn, "v_scale", 1.0)


def _drop_softcap(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    for binding in runner.layers:
        mp.setattr(binding.impl, "softcap", 0.0)


def _drop_final_softcap(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    import dataclasses

    mp.setattr(runner.model, "arch", dataclasses.replace(runner.arch, final_softcap=0.0))


def _plain_norms(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    for layer in runner.model.decoder_layers():  # x * w instead of x * (1 + w)
        mp.setattr(layer.input_layernorm, "offset", 0.0)


def _no_interleave(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    for attn in _attn(runner):
        mp.setattr(attn, "interleave", False)


def _shared_rope(runner: ModelRunner, mp: pytest.MonkeyPatch) -> None:
    # every layer with the sliding layers' RoPE (Gemma-3's global layers have their own)
    keys = list(runner.model.rotary_keys)
    mp.setattr(runner.model, "rotary_keys", [keys[0]] * len(keys))


PLANTED: list[tuple[str, str, Callable[[ModelRunner, pytest.MonkeyPatch], None]]] = [
    ("mimo_v2_flash", "rotary over the whole head", _full_rotary),
    ("mimo_v2_flash", "sinks dropped", _drop_sinks),
    ("mimo_v2_flash", "attention_value_scale dropped", _drop_v_scale),
    ("gemma2", "attention softcap dropped", _drop_softcap),
    ("gemma2", "final softcap dropped", _drop_final_softcap),
    ("gemma2", "norms without the 1 + w offset", _plain_norms),
    ("gemma3", "one RoPE for every layer type", _shared_rope),
    ("deepseek_v3", "rope pairs not interleaved", _no_interleave),
]


@pytest.mark.parametrize(("name", "bug", "plant"), PLANTED, ids=[p[1] for p in PLANTED])
def test_planted_bug_is_caught(
    name: str,
    bug: str,
    plant: Callable[[ModelRunner, pytest.MonkeyPatch], None],
    checkpoints: dict[str, Path],
    hf_refs: dict[str, Refs],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = ModelRunner(checkpoints[name], num_blocks=96, max_model_len=128)
    assert _error(runner, hf_refs[name]) <= LOGIT_RTOL  # the unplanted runner agrees
    plant(runner, monkeypatch)
    assert _error(runner, hf_refs[name]) > 100 * LOGIT_RTOL, f"{name}: {bug} went unseen"


def test_registry_is_the_one_list() -> None:
    from kvstack.engine.hf_config import SUPPORTED_ARCHITECTURES
    from kvstack.engine.testing import TINY_CONFIGS

    assert set(TINY_CONFIGS) == set(FAMILIES)
    assert {a: f.name for a, f in ARCHITECTURES.items()} == SUPPORTED_ARCHITECTURES
    for family in FAMILIES.values():
        assert family.architectures and family.summary


@pytest.mark.parametrize(
    ("name", "edit", "needle"),
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("mimo_v2_flash", {"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
        ("mimo_v2_flash", {"head_dim": 16}, "rotates 5 dims of head_dim=16"),
        ("deepseek_v3", {"n_group": 3}, "n_group=3 must divide"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
        ("deepseek_v3", {"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
        ("qwen3_moe", {"mlp_only_layers": [9]}, "mlp_only_layers=[9]"),
        ("qwen2", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "keyed by"),
    ],
)
def test_unsupported_fields_are_refused_by_name(
    name: str, edit: dict[str, object], needle: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import json

    from transformers import AutoConfig

    if name in checkpoints:
        cfg = json.loads((checkpoints[name] / "config.json").read_text())
    else:
        from kvstack.engine.testing import _COMMON

        tiny = {**_COMMON, **FAMILIES[name].tiny}
        cfg = AutoConfig.for_model(tiny.pop("model_type"), **tiny).to_dict()
        cfg["architectures"] = list(FAMILIES[name].architectures)
    cfg.update(edit)
    with pytest.raises(ValueError) as err:
        ArchConfig.from_hf(cfg)
    assert needle in str(err.value)


def test_deepseek_mtp_layer_tensors_are_skipped(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    # Released DeepSeek-V3 checkpoints carry a multi-token-prediction layer past
    # num_hidden_layers (layer 61 of 61); transformers drops it, so does the loader. Any other
    # family still refuses such a tensor.
    import shutil

    from kvstack.engine.loader import load_model
    from safetensors.torch import load_file, save_file

    for name in ("deepseek_v3", "gemma2"):
        dst = tmp_path / name
        shutil.copytree(checkpoints[name], dst)
        tensors = load_file(str(dst / "model.safetensors"))
        tensors["model.layers.9.input_layernorm.weight"] = torch.ones(64)
        save_file(tensors, str(dst / "model.safetensors"))
        if name == "deepseek_v3":
            load_model(dst)
        else:
            with pytest.raises(ValueError, match="unexpected tensors: model.layers.9"):
                load_model(dst)


def test_grouped_router_stays_float32_in_a_bf16_model(checkpoints: dict[str, Path]) -> None:
    # transformers keeps DeepSeek-V3's and MiMo-V2-Flash's router (weight and correction bias)
    # in float32 under a bf16 model (_keep_in_fp32_modules_strict); so does the loader.
    from kvstack.engine.layers import SparseMoE
    from kvstack.engine.loader import load_model

    for name in ("deepseek_v3", "mimo_v2_flash"):
        model = load_model(checkpoints[name], dtype=torch.bfloat16)
        moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        assert moes
        for moe in moes:
            assert moe.gate.weight.dtype == torch.float32
            assert moe.gate.e_score_correction_bias is not None
            assert moe.gate.e_score_correction_bias.dtype == torch.float32
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_older_config_fields_are_read_as_transformers_reads_them() -> None:
    # Released Gemma-3 configs carry rope_theta / rope_local_base_freq / rope_scaling instead of
    # rope_parameters; MiMo-V2-Flash's sliding_window_size is the window minus the query; with no
    # rope_parameters MiMo takes transformers' default thetas. Each read as transformers does.
    from kvstack.engine.testing import _COMMON
    from transformers import AutoConfig

    legacy = dict(
        rope_theta=500000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    kw = {**_COMMON, "num_hidden_layers": 3, "sliding_window": 6, "sliding_window_pattern": 2}
    hf = AutoConfig.for_model("gemma3_text", **kw, **legacy)
    cfg = {k: v for k, v in hf.to_dict().items() if k != "rope_parameters"}
    cfg.update(legacy, architectures=["Gemma3ForCausalLM"])
    ours = ArchConfig.from_hf(cfg).rope_by_type
    for t, want in hf.rope_parameters.items():
        assert (ours[t].rope_type, ours[t].theta) == (want["rope_type"], want["rope_theta"])
        assert ours[t].factor == want.get("factor", 1.0)

    tiny = {**_COMMON, **FAMILIES["mimo_v2_flash"].tiny}
    tiny.pop("model_type")
    tiny.pop("sliding_window")
    tiny.pop("rope_parameters")
    hf = AutoConfig.for_model("mimo_v2_flash", **tiny, sliding_window_size=5)
    cfg = {k: v for k, v in hf.to_dict().items() if k not in ("rope_parameters", "sliding_window")}
    cfg.update(sliding_window_size=5, architectures=["MiMoV2FlashForCausalLM"])
    arch = ArchConfig.from_hf(cfg)
    assert arch.sliding_window == hf.sliding_window == 6
    assert {t: r.theta for t, r in arch.rope_by_type.items()} == {
        t: p["rope_theta"] for t, p in hf.rope_parameters.items()
    }
    with pytest.raises(ValueError, match="rope_theta=1000.0 without rope_parameters"):
        ArchConfig.from_hf({**cfg, "rope_theta": 1000.0})


def test_fp8_block_quantized_weights_say_how_to_dequantize(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    from kvstack.engine.loader import load_model
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "fp8"
    shutil.copytree(checkpoints["deepseek_v3"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weight_scale_inv.*FineGrainedFP8Config\(dequantize"):
        load_model(dst)
