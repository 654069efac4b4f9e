"""Every Triton kernel of the cache write, block copies and slot mapping compiled ahead of time for
sm_90 and sm_80 (``triton.compile`` + ``GPUTarget``, through ptxas), with the constexprs real layouts
produce: bf16/fp16/fp32 caches, fp8 (e4m3 on sm_90 only: Triton has no e4m3 on sm_80, and the api
refuses it there), int8 with inline scales, MLA, odd head sizes, aligned and unaligned copies."""

from __future__ import annotations

import math
from typing import Any

import pytest
from kv_kernels._common import row_align
from kv_kernels.block_copy import triton as copy_mod
from kv_kernels.reshape_and_cache import triton as rc_mod
from kv_kernels.slot_mapping import triton as sm_mod
from kv_spec import KVCacheLayout

_TRITON_DTYPE = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "fp8_e4m3": "fp8e4nv",
    "fp8_e5m2": "fp8e5",
    "int8": "i8",
}


def _signature(
    kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any], int_type: str
) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = int_type
    return sig


def _scale_word(layout: KVCacheLayout) -> int:
    geometry = layout.scale_geometry
    if geometry is None:
        return 0
    align = math.gcd(16, layout.page_bytes, *geometry)
    return 8 if layout.num_scales == 2 and align % 8 == 0 else 4 if align % 4 == 0 else 1


def _reshape_case(
    name: str, arch: int, layout: KVCacheLayout, key_dtype: str, int_type: str = "i32"
) -> dict[str, Any]:
    kernel = rc_mod._reshape_and_cache_kernel
    cfg = rc_mod.launch_config(layout, layout.element_bytes)
    quant = rc_mod._QUANT_CODE[layout.kv_quant]
    qmax = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}.get(layout.dtype, 0.0)
    constexprs = {
        "NUM_HEADS": layout.num_kv_heads,
        "BLOCK_SIZE": layout.block_size,
        "HEAD_SIZE": layout.head_size,
        "HEAD_SIZE_V": max(layout.head_size_v, 1),
        "V_OFFSET": layout.v_range[0] if layout.v_range else 0,
        "SCALE_OFFSET": layout.scale_geometry[0] if layout.scale_geometry else 0,
        "SCALE_PLANE": layout.scale_plane,
        "HAS_V": not layout.is_mla,
        "QUANT": quant,
        "QMAX": qmax if quant else 0.0,
        "QMAX_RCP": rc_mod._reciprocal_f32(qmax) if quant >= 2 else 0.0,
        "BLOCK_T": cfg.block_t,
        "BLOCK_H": cfg.block_h,
        "BLOCK_D": cfg.block_d,
        "BLOCK_DV": cfg.block_dv,
        "ROW_SPLIT": cfg.row_split,
        "CHECK": arch == 90,  # compile both error-flag variants
        "ROW_ALIGN": row_align(
            (layout.block_size * layout.num_kv_heads * layout.content_size, layout.content_size)
        ),
        # the launcher's inline-scale store width for a 16-byte aligned LBNHC cache
        "SCALE_WORD": _scale_word(layout),
        "ROUND_DOWN": True,  # what a compiled launch passes (the interpreter's path is plain Triton)
        # the JIT specializes unit strides; do the same here
        "key_sd": 1,
        "value_sd": 1,
        "cache_sc": 1,
    }
    kv = _TRITON_DTYPE[key_dtype]
    pointers = {
        "key_ptr": f"*{kv}",
        "value_ptr": f"*{kv}",
        "cache_ptr": f"*{_TRITON_DTYPE[layout.dtype]}",
        "cache_bytes_ptr": "*u8",
        "slot_ptr": "*i64",
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        "err_ptr": "*i32",
    }
    # What the JIT launcher would specialize as 16-divisible for a contiguous key/value and an
    # LBNHC cache of this layout: the pointers, and the strides that are multiples of 16.
    c = layout.content_size
    strides = {
        "key_st": layout.num_kv_heads * layout.head_size,
        "key_sh": layout.head_size,
        "value_st": layout.num_kv_heads * max(layout.head_size_v, 1),
        "value_sh": max(layout.head_size_v, 1),
        "cache_sb": layout.block_size * layout.num_kv_heads * c,
        "cache_sn": layout.num_kv_heads * c,
        "cache_sh": c,
        "num_slots": layout.num_blocks * layout.block_size,
    }
    div16 = [name for name in pointers if name not in ("k_scale_ptr", "v_scale_ptr", "err_ptr")]
    div16 += [name for name, v in strides.items() if v % 16 == 0]
    return {
        "divisible_by_16": div16,
        "id": f"reshape_and_cache-{name}-sm{arch}",
        "module": rc_mod.__name__,
        "kernel": "_reshape_and_cache_kernel",
        "signature": _signature(kernel, pointers, constexprs, int_type),
        "constexprs": constexprs,
        "arch": arch,
        "num_warps": cfg.num_warps,
    }


def _layout(
    dtype: str,
    kv_quant: str = "none",
    *,
    heads: int = 8,
    head: int = 128,
    head_v: int = 128,
    mla: bool = False,
    plane: bool = False,
):
    return KVCacheLayout(
        order="LBNHC", num_layers=1, num_blocks=1024, num_kv_heads=1 if mla else heads, block_size=16,
        head_size=head, head_size_v=0 if mla else head_v, dtype=dtype, kv_quant=kv_quant, is_mla=mla,
        scale_plane=plane,
    )  # fmt: skip


def _reshape_cases() -> list[dict[str, Any]]:
    cases = []
    for arch in (90, 80):
        fp8 = "fp8_e4m3" if arch == 90 else "fp8_e5m2"
        cases += [
            _reshape_case("bf16", arch, _layout("bfloat16"), "bfloat16"),
            _reshape_case(
                "fp16-odd-heads", arch, _layout("float16", heads=3, head=80, head_v=72), "float16"
            ),
            _reshape_case(
                "fp32-i64-strides",
                arch,
                _layout("float32", heads=32, head=256, head_v=256),
                "float32",
                "i64",
            ),
            _reshape_case("fp8-per-tensor", arch, _layout(fp8, "fp8_per_tensor"), "bfloat16"),
            _reshape_case(
                "fp8-per-token-head", arch, _layout(fp8, "fp8_per_token_head"), "bfloat16"
            ),
            _reshape_case(
                "int8-per-token-head",
                arch,
                _layout("int8", "int8_per_token_head", head=96),
                "float16",
            ),
            _reshape_case(
                "int8-per-token-head-plane",
                arch,
                _layout("int8", "int8_per_token_head", plane=True),
                "bfloat16",
            ),
            _reshape_case(
                "mla-fp8-per-token-head-plane",
                arch,
                _layout(fp8, "fp8_per_token_head", head=576, mla=True, plane=True),
                "bfloat16",
            ),
            _reshape_case("mla-bf16", arch, _layout("bfloat16", head=576, mla=True), "bfloat16"),
            _reshape_case(
                "mla-fp8-per-token-head",
                arch,
                _layout(fp8, "fp8_per_token_head", head=576, mla=True),
                "bfloat16",
            ),
        ]
    cases.append(
        _reshape_case("fp8_e5m2-per-tensor", 90, _layout("fp8_e5m2", "fp8_per_tensor"), "float16")
    )
    return cases


def _copy_case(name: str, arch: int, **constexprs: Any) -> dict[str, Any]:
    kernel = copy_mod._copy_pages_kernel
    pointers = {
        "src_ptr": "*u8",
        "dst_ptr": "*u8",
        "src_layer_ptr": "*i64",
        "dst_layer_ptr": "*i64",
        "src_ids_ptr": "*i64",
        "dst_ids_ptr": "*i64",
        "err_ptr": "*i32",
    }
    num_warps = max(1, min(4, constexprs["SPAN"] // 4096))
    aligned = constexprs["ALIGN"] == 16
    ints = [
        "src_layer_stride", "dst_layer_stride", "src_row_stride", "dst_row_stride",
        "src_chunk_stride", "dst_chunk_stride", "chunk_bytes",
    ]  # fmt: skip
    return {
        "divisible_by_16": [*pointers, *ints] if aligned else [],
        "id": f"copy_pages-{name}-sm{arch}",
        "module": copy_mod.__name__,
        "kernel": "_copy_pages_kernel",
        "signature": _signature(kernel, pointers, constexprs, "i64"),
        "constexprs": constexprs,
        "arch": arch,
        "num_warps": num_warps,
    }


def _copy_cases() -> list[dict[str, Any]]:
    cases = []
    for arch in (90, 80):
        base = {"ALIGN": 16, "SPAN": 16384, "CHECK": arch == 90}  # both error-flag variants
        cases += [
            _copy_case(
                "gather-per-layer",
                arch,
                SRC_TABLE=True,
                DST_TABLE=False,
                SRC_IDS=True,
                DST_IDS=False,
                **base,
            ),
            _copy_case(
                "scatter-slab",
                arch,
                SRC_TABLE=False,
                DST_TABLE=False,
                SRC_IDS=False,
                DST_IDS=True,
                **base,
            ),
            _copy_case(
                "copy-per-layer",
                arch,
                SRC_TABLE=True,
                DST_TABLE=True,
                SRC_IDS=True,
                DST_IDS=True,
                **base,
            ),
        ]
        small = {
            "SRC_TABLE": False,
            "DST_TABLE": False,
            "SRC_IDS": True,
            "DST_IDS": False,
            "ALIGN": 2,
            "SPAN": 64,
            "CHECK": True,
        }
        cases.append(_copy_case("gather-unaligned-small", arch, **small))
    return cases


def _slot_cases() -> list[dict[str, Any]]:
    cases = []
    for arch in (90, 80):
        for table in ("i32", "i64"):
            c = {"BLOCK_SIZE": 16, "BLOCK": 256}
            ptrs = {
                "table_ptr": f"*{table}",
                "pos_ptr": "*i64",
                "qsl_ptr": "*i32",
                "out_ptr": "*i64",
            }
            cases.append(
                {
                    "id": f"slot_mapping-{table}-sm{arch}",
                    "module": sm_mod.__name__,
                    "kernel": "_slot_mapping_kernel",
                    "signature": _signature(sm_mod._slot_mapping_kernel, ptrs, c, "i32"),
                    "constexprs": c,
                    "arch": arch,
                }
            )
            c = {"K": 4, "BLOCK": 256}
            ptrs = {"table_ptr": f"*{table}", "out_ptr": f"*{table}"}
            cases.append(
                {
                    "id": f"expand_block_table-{table}-sm{arch}",
                    "module": sm_mod.__name__,
                    "kernel": "_expand_block_table_kernel",
                    "signature": _signature(sm_mod._expand_block_table_kernel, ptrs, c, "i32"),
                    "constexprs": c,
                    "arch": arch,
                }
            )
    return cases


CASES = _reshape_cases() + _copy_cases() + _slot_cases()


@pytest.fixture(scope="module")
def aot_results(aot_compile_checks) -> dict[str, dict[str, Any]]:
    return aot_compile_checks(CASES)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_kernel_compiles_for_gpu(case_id: str, aot_results: dict[str, dict[str, Any]]) -> None:
    result = aot_results[case_id]
    assert result["ok"], result.get("error")
    assert result["cubin_bytes"] > 0


@pytest.mark.parametrize("arch", [90, 80])
def test_hot_paths_use_16_byte_vectors(arch: int, aot_results: dict[str, dict[str, Any]]) -> None:
    """The bandwidth-bound paths keep 16-byte vector accesses (a regression here costs ~2x)."""
    bf16 = aot_results[f"reshape_and_cache-bf16-sm{arch}"]
    assert bf16["ld_v4"] >= 2 and bf16["st_v4"] >= 2, bf16  # one K and one V row vector each
    for name in ("gather-per-layer", "scatter-slab", "copy-per-layer"):
        r = aot_results[f"copy_pages-{name}-sm{arch}"]
        # 16 KiB per program over 128 threads: 8 vectors of 16 bytes in, 8 out
        assert r["ld_v4"] >= 8 and r["st_v4"] >= 8, (name, r)


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("case", ["fp8-per-token-head", "int8-per-token-head", "fp16-odd-heads"])
def test_rows_without_16_byte_strides_are_written_in_vectors(
    arch: int, case: str, aot_results: dict[str, dict[str, Any]]
) -> None:
    """A per-token-head row (K, V, 8 bytes of scales: 264 bytes at head 128) and a row of 80 + 72
    fp16 (304 bytes) are 8- but not 16-byte aligned, so Triton does not specialize their strides;
    told the alignment (``ROW_ALIGN``), the write stores K and V in vectors instead of byte by
    byte (H200: the per-token-head decode read went from 0.17 to 0.41 of the copy with it)."""
    r = aot_results[f"reshape_and_cache-{case}-sm{arch}"]
    assert r["st_v2"] + r["st_v4"] >= 2, r
