"""config.json parsing and checkpoint loading: every refusal names the field, the value and the fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from kvstack.engine import ArchConfig, load_arch_config, load_model
from kvstack.engine.testing import diffkv_config, write_checkpoint
from safetensors.torch import load_file, save_file

# One torch thread for the whole module (see conftest's ``one_thread``).
pytestmark = pytest.mark.usefixtures("one_thread")


def llama_config(**overrides: Any) -> dict[str, Any]:
    cfg = diffkv_config(head_dim=16, v_head_dim=16)
    cfg.update(num_attention_heads=4, num_key_value_heads=2)
    cfg.pop("v_head_dim")
    cfg.update(overrides)
    return cfg


def gpt_oss_config(**overrides: Any) -> dict[str, Any]:
    cfg = llama_config(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        num_hidden_layers=3,
    )
    cfg.update(overrides)
    return cfg


def rewrite_tensors(path: Path, edit: Any) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


# -- config.json ---------------------------------------------------------------------------------


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(
        ValueError, match=r"architectures=\['FalconForCausalLM'\].*LlamaForCausalLM"
    ):
        ArchConfig.from_hf(llama_config(architectures=["FalconForCausalLM"]))


def test_layer_types_follow_transformers_per_family() -> None:
    mistral = ArchConfig.from_hf(
        llama_config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    )
    assert mistral.layer_types == ("sliding_attention",) * 2 and mistral.layer_window(1) == 8
    # Qwen3 without layer_types: windows only with use_sliding_window, from max_window_layers on.
    qwen = llama_config(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_hidden_layers=3,
        sliding_window=4,
        max_window_layers=1,
    )
    assert ArchConfig.from_hf(qwen).layer_types == ("full_attention",) * 3
    qwen["use_sliding_window"] = True
    assert ArchConfig.from_hf(qwen).layer_types == (
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    )
    gpt = ArchConfig.from_hf(gpt_oss_config())
    assert [gpt.layer_window(i) for i in range(3)] == [8, None, 8]
    specs = gpt.kv_specs(block_size=16, dtype="float32")
    assert [s.kind for s in specs.values()] == ["sliding_window", "full", "sliding_window"]
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(3)]


def test_sliding_layers_without_a_window_are_refused() -> None:
    cfg = gpt_oss_config(sliding_window=None)
    with pytest.raises(ValueError, match="sliding_window=None"):
        ArchConfig.from_hf(cfg)


def test_layer_types_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ValueError, match="layer_types has 1 entries; num_hidden_layers=3"):
        ArchConfig.from_hf(gpt_oss_config(layer_types=["full_attention"]))


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' NTK depends on the batch"),
        ({"rope_type": "longrope"}, "rope_type='longrope' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "no 'low_freq_factor'"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_rope_variants_the_engine_cannot_honour_are_refused(
    rope: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf(llama_config(rope_parameters=rope))


def test_legacy_rope_scaling_and_top_level_theta_are_read() -> None:
    cfg = llama_config(rope_theta=5e5)
    del cfg["rope_parameters"]
    cfg["rope_scaling"] = {"type": "linear", "factor": 4.0}
    rope = ArchConfig.from_hf(cfg).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("linear", 5e5, 4.0)


def test_diffkv_flag_is_for_llama_like_configs_only() -> None:
    arch = ArchConfig.from_hf(diffkv_config())
    assert (arch.head_dim, arch.v_head_dim) == (192, 128)
    spec = arch.kv_specs(block_size=16, dtype="bfloat16")["model.layers.0.self_attn"]
    assert (spec.head_size, spec.head_size_v) == (192, 128)
    with pytest.raises(ValueError, match="v_head_dim=8 .* Llama-like configs only"):
        ArchConfig.from_hf(gpt_oss_config(v_head_dim=8))


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(llama_config(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert load_arch_config(tmp_path).eos_token_ids == (2, 7)


def test_missing_config_says_what_is_needed(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_arch_config(tmp_path)


# -- weights -----------------------------------------------------------------------------------


def test_round_trip_loads_every_tensor_in_the_requested_dtype(tmp_path: Path) -> None:
    path = write_checkpoint(gpt_oss_config(), tmp_path)
    model = load_model(path, dtype=torch.bfloat16)
    saved = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(params) == set(saved)
    for name, tensor in saved.items():
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name], tensor.to(torch.bfloat16)), name
    # RoPE frequencies stay float32 whatever the weights' dtype.
    assert model.rotary.inv_freq.dtype == torch.float32


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_checkpoint(llama_config(), tmp_path)
    rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_model(path)


def test_unexpected_mxfp4_tensors_get_a_dequantize_hint(tmp_path: Path) -> None:
    path = write_checkpoint(gpt_oss_config(), tmp_path)

    def quantize(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.experts.down_proj_blocks"] = t.pop(
            "model.layers.0.mlp.experts.down_proj"
        )

    rewrite_tensors(path, quantize)
    with pytest.raises(
        ValueError, match="(?s)missing tensors.*unexpected tensors.*MXFP4.*dequantize"
    ):
        load_model(path)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    path = write_checkpoint(llama_config(), tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"gate_proj\.weight: checkpoint \(96, 64\), model \(64, 64\)"
    ):
        load_model(path)


def test_tied_embeddings_use_the_embedding_matrix(tmp_path: Path) -> None:
    path = write_checkpoint(llama_config(tie_word_embeddings=True), tmp_path)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load_model(path)
    hidden = torch.randn(3, 64)
    want = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), want)


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    path = write_checkpoint(llama_config(tie_word_embeddings=True), tmp_path)
    rewrite_tensors(path, lambda t: t.__setitem__("lm_head.weight", torch.randn(256, 64)))
    with pytest.raises(ValueError, match="tie_word_embeddings=true but .* differs"):
        load_model(path)


def test_sharded_checkpoint_loads_like_one_file(tmp_path: Path) -> None:
    one = write_checkpoint(llama_config(), tmp_path / "one")
    tensors = load_file(str(one / "model.safetensors"))
    shards = tmp_path / "sharded"
    shards.mkdir()
    (shards / "config.json").write_text((one / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(shards / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(one), load_model(shards)
    ids = torch.tensor([1, 5, 9, 3])
    assert torch.equal(a.forward_dense(ids), b.forward_dense(ids))


def test_no_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(copy.deepcopy(llama_config())))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_model(tmp_path)
