"""The fused ops' Triton kernels compiled ahead of time for sm_90 (and the norm / activation for
sm_80) on the CPU, with the constexprs the launchers pick for real models' shapes: Llama-3-8B
(hidden 4096, MLP 14336, 32 / 8 heads of 128), Gemma-2's (1 + w) norm at 2304 and GELU, Qwen3's
per-head q/k norm (rows of 128), partial and interleaved RoPE, float32 and 16-bit inputs."""

from __future__ import annotations

from typing import Any

import pytest
from kv_kernels.fused import triton as fz

_T = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _case(
    case_id: str,
    kernel: Any,
    pointers: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int,
    aligned: list[str],
    floats: tuple[str, ...] = (),
    arch: int = 90,
) -> dict[str, Any]:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return {
        "id": f"{case_id}-sm{arch}",
        "module": fz.__name__,
        "kernel": kernel.__name__,
        "signature": sig,
        "constexprs": constexprs,
        "arch": arch,
        "num_warps": num_warps,
        # pointers from the allocator and strides that are multiples of 16 (what the JIT sees)
        "divisible_by_16": [*pointers, *aligned],
    }


def _norm(name: str, dtype: str, width: int, *, residual: bool, arch: int,
          weight_first: bool = False, offset: float = 0.0,
          per_head: bool = False) -> dict[str, Any]:  # fmt: skip
    cfg = fz.norm_config(width)
    t = _T[dtype]
    pointers = {
        "x_ptr": f"*{t}",
        "res_ptr": f"*{t}",
        "w_ptr": "*bf16",
        "y_ptr": f"*{t}",
        "h_ptr": f"*{t}",
    }
    constexprs = {
        "D": width, "BLOCK_D": cfg.block_d, "BLOCK_R": cfg.block_r, "HAS_RESIDUAL": residual,
        "WEIGHT_FIRST": weight_first, "WEIGHT_OFFSET": offset, "PER_HEAD_WEIGHT": per_head,
    }  # fmt: skip
    strides = ["x_st", "res_st", "y_st", "h_st"] + (
        ["x_sh", "res_sh", "y_sh", "h_sh"] if width % 16 == 0 else []
    )
    return _case(
        f"rms_norm-{name}", fz._rms_norm_kernel, pointers, constexprs, cfg.num_warps,
        strides if width % 16 == 0 else [], floats=("eps",), arch=arch,
    )  # fmt: skip


def _act(name: str, dtype: str, d: int, act: int, arch: int) -> dict[str, Any]:
    t = _T[dtype]
    block = min(fz._ACT_BLOCK, 1 << (d - 1).bit_length())
    return _case(
        f"act_and_mul-{name}", fz._act_and_mul_kernel, {"x_ptr": f"*{t}", "out_ptr": f"*{t}"},
        {"D": d, "BLOCK": block, "ACT": act}, max(1, min(4, block // 256)),
        ["x_st", "out_st"] if d % 16 == 0 else [], arch=arch,
    )  # fmt: skip


def _rope(name: str, dtype: str, hq: int, hk: int, rotary_dim: int, neox: bool,
          cache: str = "float32", check: bool = False) -> dict[str, Any]:  # fmt: skip
    t = _T[dtype]
    half = rotary_dim // 2
    block_half = 1 << (half - 1).bit_length()
    bq, bk, num_warps = fz.rope_config(hq, hk, block_half, neox)
    pointers = {
        "pos_ptr": "*i64", "q_ptr": f"*{t}", "k_ptr": f"*{t}", "cs_ptr": f"*{_T[cache]}",
        "err_ptr": "*i32",
    }  # fmt: skip
    constexprs = {
        "HALF": half, "BLOCK_HALF": block_half, "BLOCK_HQ": bq, "BLOCK_HK": bk,
        "IS_NEOX": neox, "HAS_K": hk > 0, "CHECK": check,
    }  # fmt: skip
    return _case(
        f"rotary-{name}", fz._rotary_kernel, pointers, constexprs,
        num_warps, ["q_st", "q_sh", "k_st", "k_sh", "cs_st"],
    )  # fmt: skip


def _cases() -> list[dict[str, Any]]:
    cases = []
    for arch in (90, 80):
        cases += [
            _norm("llama-bf16-4096-residual", "bfloat16", 4096, residual=True, arch=arch),
            _norm("fp16-8192", "float16", 8192, residual=False, arch=arch),
            _norm(
                "gemma-bf16-2304",
                "bfloat16",
                2304,
                residual=True,
                arch=arch,
                weight_first=True,
                offset=1.0,
            ),
            _norm("qwen3-qk-bf16-128", "bfloat16", 128, residual=False, arch=arch, per_head=True),
            _norm("fp32-odd-1000", "float32", 1000, residual=True, arch=arch),
            _norm("bf16-32768", "bfloat16", 32768, residual=True, arch=arch),
            _act("silu-bf16-14336", "bfloat16", 14336, 0, arch),
            _act("gelu-bf16-9216", "bfloat16", 9216, 1, arch),
            _act("silu-fp32-odd-300", "float32", 300, 0, arch),
        ]
    cases += [
        _rope("llama-bf16", "bfloat16", 32, 8, 128, True),
        _rope("llama-bf16-check", "bfloat16", 32, 8, 128, True, check=True),
        _rope("gptj-partial-fp16", "float16", 16, 2, 64, False, cache="float16"),
        _rope("neox-partial-32-of-80", "bfloat16", 32, 32, 32, True, cache="bfloat16"),
        _rope("q-only-fp32", "float32", 8, 0, 64, True),
        _rope("mla-rope-64-128-heads", "bfloat16", 128, 1, 64, False),
    ]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def aot_results(aot_compile_checks) -> dict[str, dict[str, Any]]:
    return aot_compile_checks(CASES)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_fused_kernel_compiles_for_gpu(
    case_id: str, aot_results: dict[str, dict[str, Any]]
) -> None:
    result = aot_results[case_id]
    assert result["ok"], result.get("error")
    assert result["cubin_bytes"] > 0


@pytest.mark.parametrize("arch", [90, 80])
def test_bandwidth_paths_move_16_byte_vectors(
    arch: int, aot_results: dict[str, dict[str, Any]]
) -> None:
    """The hot bf16 paths of a decode step read and write 16-byte vectors (8 bf16): the norm's
    x, residual, h and y rows at 4096 and SiLU-and-mul's gate and up at 14336."""
    norm = aot_results[f"rms_norm-llama-bf16-4096-residual-sm{arch}"]
    assert norm["ld_v4"] >= 2 and norm["st_v4"] >= 2, norm
    act = aot_results[f"act_and_mul-silu-bf16-14336-sm{arch}"]
    assert act["ld_v4"] >= 2 and act["st_v4"] >= 1, act


@pytest.mark.parametrize(
    ("case", "stores"), [("llama-bf16", 4), ("gptj-partial-fp16", 1), ("mla-rope-64-128-heads", 1)]
)
def test_rotary_moves_16_byte_vectors(
    case: str, stores: int, aot_results: dict[str, dict[str, Any]]
) -> None:
    """q's rows go out in 16-byte vectors with both pairings (NeoX: two contiguous half-rows;
    GPT-J: one contiguous row split into even / odd in registers, where stride-2 loads were
    scalar), and at Llama's 8 kv heads k's too (4 stores: q's and k's halves)."""
    r = aot_results[f"rotary-{case}-sm90"]
    assert r["ld_v4"] >= 1 and r["st_v4"] >= stores, r


def _rope_cache(name: str, dtype: str, hq: int, hk: int, head: int, head_v: int, rotary_dim: int,
                neox: bool, check: bool = False) -> dict[str, Any]:  # fmt: skip
    t = _T[dtype]
    half = rotary_dim // 2
    block_half = 1 << (half - 1).bit_length()
    bq, block_hk, num_warps = fz.rope_config(hq, hk, block_half, neox, all_k=True)
    block_tail = 1 << (max(1, head - rotary_dim) - 1).bit_length()
    block_dv = 1 << (head_v - 1).bit_length()
    pointers = {
        "pos_ptr": "*i64", "slot_ptr": "*i64", "q_ptr": f"*{t}", "k_ptr": f"*{t}",
        "v_ptr": f"*{t}", "cs_ptr": "*fp32", "cache_ptr": f"*{t}", "err_ptr": "*i32",
    }  # fmt: skip
    constexprs = {
        "NUM_KV_HEADS": hk, "BLOCK_SIZE": 16, "HEAD_SIZE": head, "HEAD_SIZE_V": head_v,
        "V_OFFSET": head, "HALF": half, "BLOCK_HALF": block_half, "BLOCK_HQ": bq,
        "BLOCK_HK": block_hk, "BLOCK_TAIL": block_tail, "BLOCK_DV": block_dv, "IS_NEOX": neox,
        "CHECK": check, "cache_sc": 1,
    }  # fmt: skip
    aligned = ["q_st", "q_sh", "k_st", "k_sh", "v_st", "v_sh", "cs_st"]
    aligned += ["cache_sb", "cache_sh", "cache_sn"]
    return _case(
        f"rope_and_cache-{name}", fz._rope_and_cache_kernel, pointers, constexprs,
        num_warps, aligned,
    )  # fmt: skip


ROPE_CACHE_CASES = [
    _rope_cache("llama-bf16", "bfloat16", 32, 8, 128, 128, 128, True),
    _rope_cache("llama-bf16-check", "bfloat16", 32, 8, 128, 128, 128, True, check=True),
    _rope_cache("gptj-partial-fp16-odd", "float16", 12, 3, 80, 64, 32, False),
    _rope_cache("diffkv-192-128-fp32", "float32", 16, 4, 192, 128, 64, True),
]


@pytest.fixture(scope="module")
def rope_cache_results(aot_compile_checks) -> dict[str, dict[str, Any]]:
    return aot_compile_checks(ROPE_CACHE_CASES)


@pytest.mark.parametrize("case_id", [c["id"] for c in ROPE_CACHE_CASES])
def test_rope_and_cache_compiles_for_gpu(
    case_id: str, rope_cache_results: dict[str, dict[str, Any]]
) -> None:
    result = rope_cache_results[case_id]
    assert result["ok"], result.get("error")
    assert result["cubin_bytes"] > 0


def test_rope_and_cache_stores_16_byte_vectors(
    rope_cache_results: dict[str, dict[str, Any]],
) -> None:
    """q, the rotated k, its cache row and V go out in 16-byte vectors (a first version rotated K
    as whole rows with gathered partners and stored 8 bytes at a time)."""
    r = rope_cache_results["rope_and_cache-llama-bf16-sm90"]
    assert r["st_v4"] >= 6 and r["st_v2"] == 0, r
