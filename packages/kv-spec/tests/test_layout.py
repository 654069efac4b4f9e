from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_spec import FullAttentionSpec, KVCacheLayout, LayoutOrder, MLAAttentionSpec, resolve_layout

ORDERS = list(LayoutOrder)


def layout(**kw: object) -> KVCacheLayout:
    args: dict[str, object] = dict(
        order="LBNHC",
        num_layers=2,
        num_blocks=3,
        num_kv_heads=2,
        block_size=4,
        head_size=3,
        head_size_v=2,
        dtype="float16",
    )
    args.update(kw)
    return KVCacheLayout(**args)  # type: ignore[arg-type]


@st.composite
def layouts(draw: st.DrawFn, *, small: bool = False) -> KVCacheLayout:
    hi = 4 if small else 64
    quant = draw(
        st.sampled_from(["none", "int8_per_token_head", "fp8_per_token_head", "fp8_per_tensor"])
    )
    dtype = {
        "none": draw(st.sampled_from(["float16", "bfloat16", "float32"])),
        "int8_per_token_head": "int8",
    }.get(quant, "fp8_e4m3")
    mla = draw(st.booleans())
    return KVCacheLayout(
        order=draw(st.sampled_from(ORDERS)),
        num_layers=draw(st.integers(1, hi)),
        num_blocks=draw(st.integers(1, hi)),
        num_kv_heads=1 if mla else draw(st.integers(1, 4 if small else 16)),
        block_size=draw(st.integers(1, hi)),
        head_size=draw(st.integers(1, 4 if small else 256)),
        head_size_v=0 if mla else draw(st.integers(1, 4 if small else 256)),
        dtype=dtype,
        kv_quant=quant,
        is_mla=mla,
    )


def test_default_order_strides_by_hand() -> None:
    lay = layout()
    assert lay.content_size == 5
    assert lay.logical_shape == (2, 3, 2, 4, 5)
    assert lay.physical_shape == (2, 3, 4, 2, 5)  # L B N H C
    assert lay.strides == (120, 40, 5, 10, 1)  # logical (L, B, H, N, C)
    assert lay.byte_strides == (240, 80, 10, 20, 2)
    assert lay.page_bytes == 80 and lay.block_stride_bytes == 80
    assert lay.layer_byte_offset(1) == 240
    assert lay.k_range == (0, 3) and lay.v_range == (3, 5) and lay.scale_range is None


def test_cross_layer_block_is_contiguous_over_layers() -> None:
    lay = layout(order="BLHNC")
    assert lay.physical_shape == (3, 2, 2, 4, 5)
    assert lay.strides == (40, 80, 20, 5, 1)
    assert lay.block_bytes == 2 * 80 and lay.blocks_contiguous
    assert not layout(order="LHBNC").blocks_contiguous


@settings(max_examples=150, deadline=None)
@given(layouts(small=True))
def test_every_order_addresses_each_element_exactly_once(lay: KVCacheLayout) -> None:
    L, B, H, N, C = lay.logical_shape
    s = lay.strides
    offsets = [
        l * s[0] + b * s[1] + h * s[2] + n * s[3] + c * s[4]
        for l, b, h, n, c in itertools.product(range(L), range(B), range(H), range(N), range(C))
    ]
    assert sorted(offsets) == list(range(lay.total_elements))
    # physical strides are the logical ones in physical order, outermost the largest
    assert (
        sorted(lay.physical_strides, reverse=True) == list(lay.physical_strides)
        or 1 in lay.physical_shape
    )


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_layouts_round_trip_through_json(lay: KVCacheLayout) -> None:
    back = KVCacheLayout.from_json(lay.to_json())
    assert back == lay
    assert back.compatibility_hash() == lay.compatibility_hash()


def test_padded_page_strides_step_over_padding() -> None:
    lay = layout(page_size_bytes=96)  # real page 80 bytes (2*4*5 fp16), padded to 96
    assert lay.strides[1] == 48  # block stride in elements = 96 / 2
    assert lay.total_bytes == 2 * 3 * 96
    L, B, H, N, C = lay.logical_shape
    s = lay.strides
    offs = {
        l * s[0] + b * s[1] + h * s[2] + n * s[3] + c * s[4]
        for l, b, h, n, c in itertools.product(range(L), range(B), range(H), range(N), range(C))
    }
    assert len(offs) == L * B * H * N * C and max(offs) < lay.total_elements
    with pytest.raises(ValueError, match="padded page .* needs a page-contiguous order"):
        layout(order="LHBNC", page_size_bytes=96)
    with pytest.raises(ValueError, match="page_size_bytes=70 is below the real page size 80"):
        layout(page_size_bytes=70)


def test_per_token_head_scales_sit_inline_after_v() -> None:
    lay = layout(dtype="int8", kv_quant="int8_per_token_head")
    assert lay.content_size == 3 + 2 + 8  # two float32 scales as 8 one-byte elements
    assert lay.scale_range == (5, 13) and lay.scale_placement == "inline"
    assert layout(dtype="fp8_e4m3", kv_quant="fp8_per_tensor").scale_placement == "external"


def test_from_spec_matches_spec_page() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=192, head_size_v=128)
    lay = KVCacheLayout.from_spec(spec, num_blocks=10, num_layers=3, order="BLNHC")
    assert lay.page_bytes == spec.page_size_bytes == lay.real_page_size_bytes
    assert lay.v_range == (192, 320)
    mla = KVCacheLayout.from_spec(
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576), num_blocks=4
    )
    assert mla.is_mla and mla.v_range is None and mla.content_size == 576


def test_offsets_past_int32_are_exact() -> None:
    # A Llama-3-70B-sized cache: every offset is an exact Python int, far past 2^31.
    lay = KVCacheLayout(
        order="BLNHC",
        num_layers=80,
        num_blocks=20000,
        num_kv_heads=8,
        block_size=16,
        head_size=128,
        head_size_v=128,
        dtype="bfloat16",
    )
    assert lay.total_elements == 80 * 20000 * 16 * 8 * 256 > 2**31
    last = sum((d - 1) * s for d, s in zip(lay.logical_shape, lay.strides, strict=True))
    assert last == lay.total_elements - 1


def test_compatibility_hash_is_stable_and_ignores_num_blocks() -> None:
    lay = layout()
    assert lay.compatibility_hash() == lay.with_num_blocks(999).compatibility_hash()
    assert lay.compatibility_hash() != layout(order="LBHNC").compatibility_hash()
    assert lay.compatibility_hash() != layout(dtype="bfloat16").compatibility_hash()
    # Pinned value: the hash must not change across processes, Python versions or releases.
    assert lay.compatibility_hash() == EXPECTED_HASH
    code = "from kv_spec import KVCacheLayout as K; import sys; print(K.from_json(sys.argv[1]).compatibility_hash())"
    out = subprocess.run(
        [sys.executable, "-c", code, lay.to_json()],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout.strip()
    assert out == EXPECTED_HASH


EXPECTED_HASH = "90694eded4b5257b91b89d1d84cd7f59"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(order="XYZ"), r"layout order 'XYZ' is not one of"),
        (dict(num_blocks=0), r"KVCacheLayout.num_blocks=0 must be >= 1"),
        (dict(head_size_v=0), r"head_size_v=0 is only valid for MLA"),
        (dict(is_mla=True), r"head_size_v=2 must be 0 for MLA"),
        (
            dict(dtype="bfloat16", kv_quant="int8_per_token_head"),
            r"dtype='bfloat16' cannot hold kv_quant",
        ),
        (dict(num_blocks=2**62), r"exceeds the int64 range"),
    ],
)
def test_layout_validation(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout(**kw)


def test_from_dict_rejects_unknown_fields_and_formats() -> None:
    d = layout().to_dict()
    with pytest.raises(ValueError, match=r"unknown layout fields \['colour'\]"):
        KVCacheLayout.from_dict({**d, "colour": 1})
    with pytest.raises(ValueError, match="layout format 2 is not supported"):
        KVCacheLayout.from_dict({**d, "format": 2})


def test_order_properties() -> None:
    assert LayoutOrder.LBNHC.permutation == (0, 1, 3, 2, 4)
    assert [o.value for o in LayoutOrder if o.layer_outer] == ["LBNHC", "LBHNC", "LHBNC"]
    assert [o.value for o in LayoutOrder if o.token_major] == ["LBNHC", "BLNHC"]
    assert not LayoutOrder.BHLNC.page_contiguous and LayoutOrder.BLHNC.page_contiguous


class TestResolveLayout:
    def test_default(self) -> None:
        assert resolve_layout() == (LayoutOrder.LBNHC, "LBNHC: default")

    def test_override_beats_everything_but_conflicts_raise(self) -> None:
        choice = resolve_layout(override="BLNHC", connector_preferred="LBHNC")
        assert choice.order is LayoutOrder.BLNHC and "explicit override" in choice.reason
        with pytest.raises(
            ValueError, match="override BLNHC conflicts with the backend's required layout LBHNC"
        ):
            resolve_layout(override="BLNHC", backend_required="LBHNC")
        with pytest.raises(
            ValueError, match=r"not readable by the selected backends \(they support \['LBNHC'\]\)"
        ):
            resolve_layout(override="BLNHC", backend_supported=("LBNHC",))

    def test_backend_requirement_beats_connector(self) -> None:
        choice = resolve_layout(backend_required="LBHNC", connector_preferred="BLNHC")
        assert choice.order is LayoutOrder.LBHNC
        assert (
            "required by the attention backend; connector preference BLNHC not honoured"
            in choice.reason
        )

    def test_connector_preference_within_backend_support(self) -> None:
        assert resolve_layout(connector_preferred="BLNHC").order is LayoutOrder.BLNHC
        choice = resolve_layout(connector_preferred="BLHNC", backend_supported=("LBNHC", "BLNHC"))
        assert choice.order is LayoutOrder.LBNHC and "not readable by the backends" in choice.reason

    def test_default_outside_support_takes_first_supported(self) -> None:
        choice = resolve_layout(backend_supported=("LBHNC", "BLHNC"))
        assert (
            choice.order is LayoutOrder.LBHNC
            and "first order the backends support" in choice.reason
        )


def _pth(order: str = "LBNHC", **kw: object) -> KVCacheLayout:
    base: dict[str, object] = dict(
        order=order, num_layers=2, num_blocks=5, num_kv_heads=8, block_size=16, head_size=128,
        head_size_v=128, dtype="int8", kv_quant="int8_per_token_head",
    )  # fmt: skip
    base.update(kw)
    return KVCacheLayout(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_scale_plane_follows_each_pages_data(order: str) -> None:
    """A scale plane keeps the page size and moves the scales out of the rows: C is K + V, the
    plane ``[H, N, 2]`` float32 starts right after the page's data, and every data element and
    scale of a page is addressed once inside that page."""
    inline, plane = _pth(order), _pth(order, scale_plane=True)
    assert plane.page_bytes == inline.page_bytes == 16 * 8 * 264
    assert plane.content_size == 256 and inline.content_size == 264
    assert plane.scale_range is None and inline.scale_range == (256, 264)
    assert plane.scale_placement == "plane" and inline.scale_placement == "inline"
    offset, head_stride, token_stride = plane.scale_plane_geometry  # type: ignore[misc]
    assert (offset, head_stride, token_stride) == (16 * 8 * 256, 16 * 8, 8)
    _, sb, sh, sn, sc = plane.byte_strides
    touched = set()
    for h, n, c in itertools.product(range(8), range(16), range(256)):
        touched.add(h * sh + n * sn + c * sc)
    for h, n, k in itertools.product(range(8), range(16), range(8)):
        touched.add(offset + h * head_stride + n * token_stride + k)
    assert touched == set(range(plane.page_bytes))  # data and plane tile the page exactly
    assert sb == plane.page_bytes * (2 if order.startswith("B") else 1)
    assert inline.to_dict().get("scale_plane") is None  # old layouts keep their JSON and hash
    assert KVCacheLayout.from_json(plane.to_json()) == plane
    assert plane.compatibility_hash() != inline.compatibility_hash()
    assert inline.scale_plane_geometry is None
    # one geometry for both placements: inline, the row's end through the rows' own strides
    _, _, ish, isn, _ = inline.byte_strides
    assert inline.scale_geometry == (256, ish, isn) and plane.scale_geometry == (offset, 128, 8)


def test_scale_plane_mla_and_kernel_blocks() -> None:
    mla = KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=3, num_kv_heads=1, block_size=64, head_size=576,
        head_size_v=0, dtype="fp8_e4m3", kv_quant="fp8_per_token_head", is_mla=True,
        scale_plane=True,
    )  # fmt: skip
    assert mla.content_size == 576 and mla.scale_plane_geometry == (64 * 576, 64 * 4, 4)
    problem = _pth(scale_plane=True).kernel_block_problem(8)
    assert problem is not None and "scale plane" in problem


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(kv_quant="fp8_per_tensor", dtype="fp8_e4m3", scale_plane=True), "per-token-head"),
        (dict(order="LHBNC", scale_plane=True), "page-contiguous"),
        (dict(head_size=3, head_size_v=2, block_size=1, num_kv_heads=1, scale_plane=True), "16"),
        (dict(scale_plane=1), "must be a bool"),
    ],
)
def test_scale_plane_validation(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _pth(**kw)
