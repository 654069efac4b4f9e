"""The selector: which backend every catalogue model gets on cpu / sm_80 / sm_90 / sm_100 and why
the others were rejected; FlashAttention version rules; prefer=; kernel block sizes."""

from __future__ import annotations

import dataclasses
import re

import pytest
from kv_backends import (
    BACKEND_PRIORITY,
    AttentionConfig,
    NoBackendError,
    Platform,
    Selection,
    configs_for_model,
    get_backend,
    prepare_kernel_block_sizes,
    select_backend,
)
from kv_backends.backends.flash_attn import resolve_fa_version
from kv_spec import CATALOGUE, FullAttentionSpec, KVCacheLayout, KVQuantMode, LayoutOrder

# The machines we reason about. Installed modules are injected: on our H100 only FA4 installs;
# an A100 box typically has flash-attn 2.
PLATFORMS = {
    "cpu": Platform.cpu(),
    "sm_80": Platform.cuda((8, 0), installed={"flash_attn_2_cuda"}),
    "sm_90": Platform.cuda((9, 0), installed={"flash_attn.cute"}),
    "sm_100": Platform.cuda((10, 0), installed={"flash_attn.cute"}),
}

# model -> layer kind -> platform -> (backend or None, substrings that must appear in the rendering)
EXPECTED = {
    "Llama-3-8B": {
        "full": {
            "cpu": ("TORCH_SDPA", []),
            "sm_80": (
                "TRITON",
                ["FA2 needs kernel block sizes that are multiples of 256 (got 16)"],
            ),
            "sm_90": ("FLASH_ATTN", ["runs FA4", "FA3: flash_attn_interface not installed"]),
            "sm_100": ("FLASH_ATTN", ["runs FA4"]),
        }
    },
    "Mistral-7B": {
        "sliding_window": {
            "cpu": ("TORCH_SDPA", []),
            "sm_80": ("TRITON", ["multiples of 256"]),
            "sm_90": ("FLASH_ATTN", ["runs FA4"]),
            "sm_100": ("FLASH_ATTN", ["runs FA4"]),
        }
    },
    "gpt-oss-120b": {
        k: {
            "cpu": ("TORCH_SDPA", []),
            "sm_80": ("TRITON", ["FA2 has no attention sinks"]),
            "sm_90": ("FLASH_ATTN", ["runs FA4", "FA3 has no attention sinks"]),
            "sm_100": ("FLASH_ATTN", ["runs FA4"]),
        }
        for k in ("full", "sliding_window")
    },
    "MiMo-V2-Flash": {
        k: {
            "cpu": ("TORCH_SDPA", []),
            "sm_80": (
                "TRITON",
                [
                    "FLASH_ATTN_DIFFKV: needs compute capability >= 9.0 (device has 8.0)",
                    "FLASH_ATTN: head_size_v 128 != head_size 192 not supported",
                ],
            ),
            # Only MiMo's sliding-window layers carry sinks: they force FA4; the full layers
            # would take FA3, which does not install here, so they fall back to FA4 and say so.
            "sm_90": (
                "FLASH_ATTN_DIFFKV",
                [
                    "FA3 -> FA4 on sm_90 because the layer has attention sinks and head_size_v != head_size"
                    if k == "sliding_window"
                    else "FA3: flash_attn_interface not installed"
                ],
            ),
            "sm_100": ("FLASH_ATTN_DIFFKV", ["runs FA4"]),
        }
        for k in ("full", "sliding_window")
    },
    "DeepSeek-V3": {
        "mla": {
            "cpu": ("TORCH_SDPA", []),
            **{
                p: ("TRITON_MLA", ["FLASH_ATTN: head_size 576 not supported"])
                for p in ("sm_80", "sm_90", "sm_100")
            },
        }
    },
}
EXPECTED["Llama-3-70B"] = EXPECTED["Qwen3-32B"] = EXPECTED["Llama-3-8B"]


def _cases():
    for model, kinds in EXPECTED.items():
        for kind, plats in kinds.items():
            for plat, (backend, needles) in plats.items():
                yield pytest.param(model, kind, plat, backend, needles, id=f"{model}-{kind}-{plat}")


def test_every_catalogue_model_is_in_the_table() -> None:
    assert set(EXPECTED) == set(CATALOGUE)
    for model, kinds in EXPECTED.items():
        assert {c.kind for c in configs_for_model(model).values()} == set(kinds), model


@pytest.mark.parametrize(("model", "kind", "plat", "backend", "needles"), list(_cases()))
def test_catalogue_selection(
    model: str, kind: str, plat: str, backend: str | None, needles: list[str]
) -> None:
    (cfg,) = [c for c in configs_for_model(model).values() if c.kind == kind]
    platform = PLATFORMS[plat]
    if backend is None:
        with pytest.raises(NoBackendError) as info:
            select_backend(cfg, platform)
        text = str(info.value)
        assert all(r.reasons for r in info.value.rejected)
    else:
        sel = select_backend(cfg, platform)
        assert sel.name == backend
        text = str(sel)
        assert text.startswith(f"{backend} selected on {platform.label} for {kind}")
        # Everything before the winner in the priority list is listed with its reasons.
        order = BACKEND_PRIORITY[platform.name]
        assert [r.name for r in sel.rejected] == list(order[: order.index(backend)])
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text}"


def test_selection_renders_readably() -> None:
    (cfg,) = configs_for_model("Llama-3-8B").values()
    text = str(select_backend(cfg, PLATFORMS["sm_90"]))
    assert text.splitlines() == [
        "FLASH_ATTN selected on sm_90 for full, 32q/8kv heads, head 128, bfloat16 (kv bfloat16), block 16, LBNHC",
        "  rejected FLASH_ATTN_DIFFKV: serves only layers with head_size_v != head_size (got 128/128)",
        "  note: runs FA4 (flash_attn.cute): FA3 preferred on sm_90; FA3: flash_attn_interface not installed",
    ]


# -- FlashAttention version rules -------------------------------------------------------------


def _cfg(**kw) -> AttentionConfig:
    base = dict(num_q_heads=8, num_kv_heads=2, head_size=128, head_size_v=128, block_size=16)
    base.update(kw)
    return AttentionConfig(**base)


@pytest.mark.parametrize(
    ("cc", "installed", "cfg", "version", "note"),
    [
        ((9, 0), {"flash_attn_interface", "flash_attn.cute"}, {}, 3, None),
        (
            (9, 0),
            {"flash_attn_interface", "flash_attn.cute"},
            {"has_sinks": True},
            4,
            "FA3 has no attention sinks",
        ),
        (
            (9, 0),
            {"flash_attn_interface", "flash_attn.cute"},
            {"has_sinks": True, "head_size": 192},
            4,
            "FA3 -> FA4 on sm_90",
        ),
        (
            (9, 0),
            {"flash_attn_2_cuda"},
            {"block_size": 256},
            2,
            "FA3: flash_attn_interface not installed",
        ),
        (
            (9, 0),
            {"flash_attn_2_cuda"},
            {},
            None,
            "FA2 needs kernel block sizes that are multiples of 256",
        ),
        ((10, 0), {"flash_attn.cute", "flash_attn_2_cuda"}, {}, 4, None),
        (
            (10, 0),
            {"flash_attn_2_cuda"},
            {"block_size": 512},
            2,
            "FA4: flash_attn.cute not installed",
        ),
        ((8, 6), {"flash_attn_2_cuda", "flash_attn.cute"}, {"block_size": 256}, 2, None),
        ((8, 0), {"flash_attn.cute"}, {}, None, "FA4 runs on compute capability 9.0-11.9, not 8.0"),
        # FA4 installed makes the `flash_attn` namespace importable; FA2 is probed by its compiled
        # extension, so ALiBi (FA2 only) is refused instead of selecting an FA2 that cannot import
        (
            (9, 0),
            {"flash_attn", "flash_attn.cute"},
            {"use_alibi": True, "block_size": 256},
            None,
            "FA2: flash_attn_2_cuda not installed",
        ),
    ],
)
def test_fa_version_rules(cc, installed, cfg, version, note) -> None:
    choice = resolve_fa_version(_cfg(**cfg), Platform.cuda(cc, installed=installed))
    assert choice.version == version
    text = "; ".join(choice.notes + choice.reasons)
    if note is not None:
        assert note in text, text


def test_fa_explicit_version_is_validated() -> None:
    sm100 = Platform.cuda((10, 0), installed={"flash_attn.cute", "flash_attn_interface"})
    choice = resolve_fa_version(_cfg(flash_attn_version=3), sm100)
    assert choice.version is None
    assert "FA3 runs on compute capability 9.0-9.0, not 10.0" in choice.reasons
    with pytest.raises(
        ValueError, match="prefer=FLASH_ATTN cannot serve .* FA3 runs on compute capability"
    ):
        select_backend(_cfg(flash_attn_version=3), sm100, prefer="FLASH_ATTN")
    sm90 = Platform.cuda((9, 0), installed={"flash_attn.cute"})
    sel = select_backend(_cfg(flash_attn_version=4), sm90, prefer="FLASH_ATTN")
    assert sel.explicit and "requested by flash_attn_version" in str(sel)
    missing = resolve_fa_version(_cfg(flash_attn_version=2, block_size=256), sm90)
    assert missing.version is None and any(
        "flash_attn_2_cuda is not installed" in r for r in missing.reasons
    )


def test_fa_with_nothing_installed_is_rejected_with_reasons() -> None:
    reasons = get_backend("FLASH_ATTN").validate(_cfg(), Platform.cuda((9, 0), installed=()))
    assert any("flash_attn_interface not installed" in r for r in reasons)
    assert any("flash_attn.cute not installed" in r for r in reasons)


# -- prefer= ----------------------------------------------------------------------------------


def test_prefer_unusable_raises_with_reasons() -> None:
    cfg = _cfg(dtype="float32", kv_cache_dtype="float32", layout_order="LBHNC")
    with pytest.raises(ValueError, match=r"prefer=FLASH_ATTN cannot serve .*needs a CUDA GPU"):
        select_backend(cfg, Platform.cpu(), prefer="FLASH_ATTN")
    with pytest.raises(
        ValueError, match=r"prefer=FLEX_ATTENTION cannot serve .*layout LBHNC not supported"
    ):
        select_backend(cfg, Platform.cpu(), prefer="flex_attention")
    with pytest.raises(ValueError, match="unknown attention backend 'NOPE'"):
        select_backend(cfg, Platform.cpu(), prefer="NOPE")


def test_prefer_usable_is_explicit() -> None:
    cfg = _cfg(dtype="float32", kv_cache_dtype="float32")
    sel = select_backend(cfg, Platform.cpu(), prefer=get_backend("FLEX_ATTENTION"))
    assert isinstance(sel, Selection) and sel.explicit and sel.rejected == ()
    assert str(sel).startswith("FLEX_ATTENTION requested on cpu")


def test_cpu_default_is_sdpa_and_gpu_only_backends_say_why() -> None:
    cfg = _cfg()
    assert select_backend(cfg, Platform.cpu()).name == "TORCH_SDPA"
    assert get_backend("TRITON").validate(cfg, Platform.cpu()) == ["needs a CUDA GPU"]


# -- kernel block sizes -------------------------------------------------------------------------


def test_prepare_kernel_block_sizes() -> None:
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=128)
    assert prepare_kernel_block_sizes(
        [spec, 48], [["FLEX_ATTENTION", "TRITON"], ["FLEX_ATTENTION"]]
    ) == [64, 16]
    sm80 = Platform.cuda((8, 0), installed={"flash_attn_2_cuda"})
    fa2 = select_backend(_cfg(block_size=512), sm80)
    assert fa2.name == "FLASH_ATTN"
    # FA2's rule comes from the selection's version: 512 works, 256 would too, 128 would not.
    assert prepare_kernel_block_sizes([512], [[fa2, "TRITON"]]) == [512]
    with pytest.raises(
        ValueError,
        match=r"group 0: no kernel block size divides the manager block size 128.*FLASH_ATTN takes none of them",
    ):
        prepare_kernel_block_sizes([128], [[fa2]])
    with pytest.raises(
        ValueError,
        match="group 0: no kernel block size divides the manager block size 8.*FLEX_ATTENTION takes none",
    ):
        prepare_kernel_block_sizes([8], [["FLEX_ATTENTION", "TORCH_SDPA"]])
    with pytest.raises(ValueError, match="got 2 groups and 1 backend lists"):
        prepare_kernel_block_sizes([16, 16], [["TRITON"]])


@pytest.mark.parametrize(
    ("backend", "kv_quant", "cache_dtype", "layout_kw", "reason"),
    [
        (
            "TRITON",
            "int8_per_token_head",
            "int8",
            {"scale_plane": True},
            "a page's scale plane follows its data, so kernel blocks are no plain view",
        ),
        (
            "TORCH_SDPA",
            "none",
            "float32",
            {"page_size_bytes": 64 * 2 * 64 * 4 + 256},  # 256 bytes of padding a page
            r"needs unpadded pages \(page_size_bytes=33024 > real 32768\)",
        ),
    ],
    ids=["scale_plane", "padded"],
)
def test_validate_asks_kv_spec_kernel_block_rule_of_the_layout(
    backend: str, kv_quant: str, cache_dtype: str, layout_kw: dict, reason: str
) -> None:
    """Manager blocks of 64 as kernel blocks of 16 need pages without a scale plane and without
    padding (kv-spec's KVCacheLayout.kernel_block_problem). kv-backends' validate used to ask
    only the order and the sizes, so it passed such caches and the impl failed at the first
    forward; with the layout it now names the reason, and make_impl refuses."""
    cfg = AttentionConfig(
        num_q_heads=4, num_kv_heads=2, head_size=32, head_size_v=32, dtype="float32",
        kv_cache_dtype=cache_dtype, kv_quant=kv_quant, block_size=64, kernel_block_size=16,
    )  # fmt: skip
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=4, num_kv_heads=2, block_size=64,
        head_size=32, head_size_v=32, dtype=cache_dtype, kv_quant=KVQuantMode(kv_quant),
        **layout_kw,
    )  # fmt: skip
    b = get_backend(backend)
    assert b.validate(cfg) == []  # a config cannot tell a plane or padding
    reasons = b.validate(cfg, layout=layout)
    assert len(reasons) == 1 and re.search(reason, reasons[0]), reasons
    with pytest.raises(ValueError, match=reason):
        b.make_impl(cfg, layout)
    plain = dataclasses.replace(layout, scale_plane=False, page_size_bytes=None)
    assert b.validate(cfg, layout=plain) == []


# -- config and platform ----------------------------------------------------------------------


def test_attention_config_validation() -> None:
    with pytest.raises(ValueError, match="num_q_heads=6 must be a multiple of num_kv_heads=4"):
        _cfg(num_q_heads=6, num_kv_heads=4)
    with pytest.raises(
        ValueError, match="kernel_block_size=24 must be a positive divisor of block_size=64"
    ):
        _cfg(block_size=64, kernel_block_size=24)
    with pytest.raises(ValueError, match="flash_attn_version=5"):
        _cfg(flash_attn_version=5)
    cfg = _cfg(block_size=64, kernel_block_size=16)
    assert cfg.kernel_blocks_per_block == 4
    reasons = get_backend("TORCH_SDPA").validate(
        cfg.__class__(**{**cfg.__dict__, "layout_order": "BLNHC"})
    )
    assert any("needs order LBNHC or LHBNC" in r for r in reasons)


def test_platform() -> None:
    with pytest.raises(ValueError, match="needs compute_capability"):
        Platform("cuda")
    with pytest.raises(ValueError, match="'tpu' must be 'cpu' or 'cuda'"):
        Platform("tpu")
    p = Platform.cuda((9, 0), installed={"flash_attn.cute"})
    assert p.label == "sm_90" and p.has_module("flash_attn.cute") and not p.has_module("flash_attn")
    probed = Platform("cpu", probe=lambda m: m == "x")
    assert probed.has_module("x") and not probed.has_module("y")
    assert Platform.detect().name in ("cpu", "cuda")


def test_configs_for_model_groups_layers() -> None:
    cfgs = configs_for_model("gpt-oss-120b", tensor_parallel_size=2)
    assert set(cfgs) == {"sliding_window (18 layers)", "full (18 layers)"}
    sw = cfgs["sliding_window (18 layers)"]
    assert (sw.num_q_heads, sw.num_kv_heads, sw.sliding_window, sw.has_sinks) == (32, 4, 128, True)
