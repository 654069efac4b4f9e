"""Hugging Face safetensors checkpoints -> :class:`kvstack.engine.models.CausalLM`.

The module's parameter names *are* the checkpoint's tensor names, so the mapping is the identity,
plus three rules:

- tied embeddings: with ``tie_word_embeddings`` the checkpoint may omit ``lm_head.weight`` (and
  if it has one, it must equal the embedding; transformers would ignore it);
- buffers older exporters saved (``rotary_emb.inv_freq``) are skipped: the engine recomputes them;
- a family's ``renames`` (:mod:`kvstack.engine.archs`) map the names transformers saves to the
  engine's where they differ (MiMo-V2-Flash's ``attention_sink_bias`` is its ``sinks``), and a
  family that ``skips_extra_layers`` (DeepSeek-V3's multi-token-prediction layer) drops tensors of
  layers past ``num_hidden_layers``, as transformers does;
- everything else must match exactly: a missing tensor, an unexpected one or a wrong shape is a
  ``ValueError`` that lists them, never a silently random or dropped weight.

Sharded checkpoints (``model.safetensors.index.json``) and single files are both read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvstack.engine.archs import family_of
from kvstack.engine.hf_config import ArchConfig, load_arch_config
from kvstack.engine.models import CausalLM

__all__ = ["checkpoint_files", "load_model"]

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
_MAX_LISTED = 8


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (from the shard index when there is one)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(
                f"{index}: cannot read the shard index ({e}); it must be a JSON object with a "
                "'weight_map' of tensor name -> file (re-save the checkpoint, or delete the index "
                "for a single-file checkpoint)"
            ) from None
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{root} holds no *.safetensors files; the engine loads safetensors checkpoints only "
            "(convert .bin/.pt weights with transformers' save_pretrained(safe_serialization=True))"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the shard index names files that do not exist: {missing}")
    return files


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield name, handle.get_tensor(name)
        except (OSError, SafetensorError) as e:
            # safetensors' own message names no file ("incomplete metadata, file not fully covered")
            raise ValueError(
                f"{f}: cannot read it as safetensors ({e}); the file is truncated or corrupt: "
                "download or save it again"
            ) from None


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def _unexpected_hint(names: list[str]) -> str:
    if any(n.endswith(("_blocks", "_scales")) for n in names):
        return (
            " These look like MXFP4-quantized experts (gpt-oss releases): the engine reads "
            "unquantized weights; dequantize to bf16 first (transformers: "
            "Mxfp4Config(dequantize=True), then save_pretrained)."
        )
    if any(n.endswith("weight_scale_inv") for n in names):
        return (
            " These look like block-quantized FP8 weights with their inverse scales (the "
            "DeepSeek-V3 release): the engine reads unquantized weights; dequantize to bf16 first "
            "(transformers: FineGrainedFP8Config(dequantize=True), then save_pretrained)."
        )
    return ""


@torch.no_grad()
def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    arch: ArchConfig | None = None,
) -> CausalLM:
    """Build the model ``config.json`` describes and fill it from the checkpoint's tensors.

    Weights are cast to ``dtype`` (but a family's ``keep_fp32`` parameters stay float32) and
    moved to ``device``; the model is returned in eval mode.
    """
    arch = arch if arch is not None else load_arch_config(model_dir)
    # Parameters start uninitialised (no random init, untouched pages); each is replaced below.
    model = CausalLM(arch)
    expected = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    shape_errors: list[str] = []
    tied_head: torch.Tensor | None = None
    family = family_of(arch.architecture)
    renames = family.renames
    for name, tensor in _tensors(checkpoint_files(model_dir)):
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        if family.skips_extra_layers:
            m = _LAYER_INDEX.match(name)
            if m is not None and int(m.group(1)) >= arch.num_layers:
                continue
        for suffix, ours in renames.items():
            if name.endswith(suffix):
                name = name[: -len(suffix)] + ours
                break
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            tied_head = tensor
            continue
        param = expected.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            shape_errors.append(
                f"{name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
            )
            continue
        keep = family.keep_fp32 and name.endswith(family.keep_fp32)
        loaded[name] = tensor.to(device=device, dtype=torch.float32 if keep else dtype)
    missing = sorted(set(expected) - set(loaded))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listed(missing)}")
    if unexpected:
        problems.append(
            f"unexpected tensors: {_listed(sorted(unexpected))}.{_unexpected_hint(unexpected)}"
        )
    if shape_errors:
        problems.append(f"shape mismatches: {_listed(shape_errors)}")
    if problems:
        raise ValueError(
            f"checkpoint {model_dir} does not match {arch.architecture} as config.json describes "
            f"it ({arch.num_layers} layers, hidden {arch.hidden_size}, heads "
            f"{arch.num_q_heads}q/{arch.num_kv_heads}kv x {arch.head_dim}): " + "; ".join(problems)
        )
    if tied_head is not None:
        embed = loaded["model.embed_tokens.weight"]
        if not torch.equal(tied_head.to(device=device, dtype=dtype), embed):
            raise ValueError(
                "config.json sets tie_word_embeddings=true but the checkpoint's lm_head.weight "
                "differs from model.embed_tokens.weight; fix the config (tie_word_embeddings=false) "
                "or drop lm_head.weight"
            )
    # Every parameter is replaced (missing ones raised above).
    model.load_state_dict(loaded, strict=True, assign=True)
    # The rotary frequencies are a non-persistent buffer: put them on the device, in float32
    # whatever the weights' dtype, as transformers does.
    model.reset_rotaries(device)
    model.stack_projections()
    return model.eval()
