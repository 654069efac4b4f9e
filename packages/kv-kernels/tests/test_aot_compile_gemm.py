"""The skinny GEMM's kernels compiled ahead of time for sm_90 on the CPU (``triton.compile`` +
``GPUTarget``, through ptxas) with the configs the launcher picks: every config of the table and
the heuristic's for Llama-3-8B's projections (qkv, o_proj, gate_up, down, lm_head) at each M
bucket, M = 1 (Triton specializes it as a constant), ragged K slices, fp16 and IEEE fp32, and the
split-K reduce at each split count those use. Each build must fit sm_90's shared memory, and
the 16-bit builds must use the warpgroup MMA (``wgmma``) fed by ``cp.async`` pipelines, except
where the tile's MMA M side (``block_n``, the weight rows) is under a warpgroup's 64 rows:
Triton then emits ``mma.sync`` (the table's o_proj config at M <= 16 has ``block_n`` 32)."""

from __future__ import annotations

from typing import Any

import pytest
from kv_kernels.aot import build_problems
from kv_kernels.gemm import triton as gt
from kv_kernels.gemm.configs import M_BUCKETS, TABLE, GemmConfig, pick_config

_T = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
LLAMA = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
         "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip


def _mma(cfg: GemmConfig) -> str:
    """The MMA a 16-bit build of ``cfg`` uses on sm_90: Triton's wgmma takes an M side (here the
    ``block_n`` weight rows) of a multiple of 64 and whole warpgroups; else ``mma.sync``."""
    return "wgmma" if cfg.block_n % 64 == 0 and cfg.num_warps % 4 == 0 else "mma_sync"


def _gemm_case(m: int, n: int, k: int, cfg: GemmConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The launch of ``cfg`` on contiguous ``x [m, k]``, ``W [n, k]``, ``y [m, n]`` as the JIT
    specializes it: unit strides and ``M = 1`` as constants, 16-divisible sizes and pointers."""
    per, even_k = gt.split_geometry(k, cfg)
    t = _T[dtype]
    kernel = gt._skinny_gemm_kernel
    constexprs: dict[str, Any] = {
        "stride_xk": 1, "stride_wk": 1, "stride_yn": 1, "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SPLIT": cfg.split_k > 1,
        "HAS_BIAS": False, "EVEN_K": even_k, "IEEE": dtype == "float32",
    }  # fmt: skip
    if m == 1:
        constexprs["M"] = 1
    pointers = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "b_ptr": f"*{t}", "y_ptr": f"*{t}",
                "ws_ptr": "*fp32"}  # fmt: skip
    sig = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in kernel.arg_names}
    ints = {"M": m, "N": n, "K": k, "K_PER_SPLIT": per, "stride_xm": k, "stride_wn": k,
            "stride_ym": n}  # fmt: skip
    return {
        "id": f"gemm-{m}x{n}x{k}-{dtype}-{'-'.join(map(str, cfg))}",
        "module": gt.__name__,
        "kernel": kernel.__name__,
        "signature": sig,
        "constexprs": constexprs,
        "arch": 90,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "divisible_by_16": [*pointers, *(a for a, v in ints.items() if v % 16 == 0 and v != 1)],
        "count": {
            "wgmma": r"wgmma\.mma_async",
            "mma_sync": r"mma\.sync\.aligned",
            "cp_async": r"cp\.async",
        },
        "wants": () if dtype == "float32" else (_mma(cfg), "cp_async"),
    }


def _reduce_case(split: int) -> dict[str, Any]:
    kernel = gt._splitk_reduce_kernel
    constexprs = {"stride_yn": 1, "SPLIT_K": split, "BLOCK_M": gt._REDUCE_BLOCK_M,
                  "BLOCK_N": gt._REDUCE_BLOCK_N, "HAS_BIAS": True}  # fmt: skip
    pointers = {"ws_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    sig = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in kernel.arg_names}
    return {
        "id": f"reduce-split{split}", "module": gt.__name__, "kernel": kernel.__name__,
        "signature": sig, "constexprs": constexprs, "arch": 90, "num_warps": 4,
        "divisible_by_16": [*pointers, "M", "N", "stride_ym"],
    }  # fmt: skip


def _launches(
    shapes: tuple[str, ...], ms: tuple[int, ...] = (1, *M_BUCKETS)
) -> list[tuple[int, int, int, GemmConfig, str]]:
    return [(m, *LLAMA[s], pick_config(m, *LLAMA[s]), "bfloat16") for s in shapes for m in ms]


def _cases(
    launches: list[tuple[int, int, int, GemmConfig, str]], skip: frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """One build per distinct specialization of ``launches`` (shapes that differ only in value
    share one) plus the reduce at each split count, less the ids in ``skip``."""
    cases: dict[tuple[Any, ...], dict[str, Any]] = {}
    splits = set()
    for m, n, k, cfg, dtype in launches:
        case = _gemm_case(m, n, k, cfg, dtype)
        key = (m == 1, tuple(cfg), dtype, case["constexprs"]["EVEN_K"])
        cases.setdefault(key, case)
        if cfg.split_k > 1:
            splits.add(cfg.split_k)
    out = [*cases.values(), *(_reduce_case(s) for s in sorted(splits))]
    return [c for c in out if c["id"] not in skip]


# CI: qkv (split and unsplit, M = 1 and four buckets) and down, ragged slices, fp16, fp32; slow:
# every other shape and bucket the launcher picks, and the table's configs, that CI did not build
CI_CASES = _cases([
    *_launches(("qkv",), (1, 16, 64, 128, 256)),
    *_launches(("down",), (64,)),
    (64, 4096, 11008, GemmConfig(64, 64, 128, 4, 4, 4), "bfloat16"),  # ragged slices
    (16, 6144, 4096, pick_config(16, 6144, 4096, 2), "float16"),
    (16, 6144, 4096, pick_config(16, 6144, 4096, 4), "float32"),
])  # fmt: skip
SLOW_CASES = _cases(
    [
        *_launches(("qkv", "o_proj", "gate_up", "down", "lm_head")),
        *((b, n, k, cfg, "bfloat16") for (b, n, k), cfg in TABLE.items()),
    ],
    skip=frozenset(c["id"] for c in CI_CASES),
)


@pytest.fixture(scope="module")
def ci_results(aot_compile_checks) -> dict[str, dict[str, Any]]:
    return aot_compile_checks(CI_CASES)


@pytest.fixture(scope="module")
def slow_results(aot_compile_checks) -> dict[str, dict[str, Any]]:
    return aot_compile_checks(SLOW_CASES)


def _problems(case: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[str]:
    """Builds, fits shared memory; the 16-bit GEMMs use their MMA (:func:`_mma`) and cp.async
    (fp32 IEEE dots are FMA loops, no MMA)."""
    return build_problems(results[case["id"]], arch=90, present=tuple(case.get("wants", ())))


@pytest.mark.parametrize("case", CI_CASES, ids=[c["id"] for c in CI_CASES])
def test_gemm_kernels_compile_for_sm90(case: dict[str, Any], ci_results) -> None:
    assert _problems(case, ci_results) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c["id"] for c in SLOW_CASES])
def test_every_picked_config_compiles_for_sm90(case: dict[str, Any], slow_results) -> None:
    assert _problems(case, slow_results) == []


def test_case_count_stays_ci_sized() -> None:
    """Each build is ~0.5-1 s on a CI core: the list stays deduplicated and small."""
    assert 6 <= len(CI_CASES) <= 16, [c["id"] for c in CI_CASES]
