"""Every paged-attention kernel compiled ahead of time for sm_90 and sm_80 on the CPU.

The variants and tile configs come from ``kv_kernels.paged_attention.triton.aot_specs``, the same
``select_config`` the launcher uses, so CI compiles what a GPU would run (bf16 and fp8 caches,
head sizes 64 / 128 / 192-128 / 256, kernel blocks 16 / 128 (TMA prefill tiles at 128); int8 / fp8 per-token-head caches and
the MLA latent since issue 12, its fp8 latent since issue 31), through ptxas, and checks that each
fits the arch's shared memory. Compiles run in subprocesses without the interpreter (an
interpreted kernel object cannot be compiled), two at a time.

The default set covers every arch, cache dtype, head-size pair and block size at least once; the
full cross product runs with ``KV_KERNELS_AOT_FULL=1`` (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from kv_kernels.aot import SHARED_MEMORY_LIMIT

_SCRIPT = textwrap.dedent(
    r"""
    import json, re, sys, traceback, types
    import torch
    from kv_kernels.aot import aot_compile
    from kv_kernels.paged_attention.triton import aot_specs

    DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4": torch.float8_e4m3fn,
          "fp8e5": torch.float8_e5m2, "i8": torch.int8}
    def first_loop(ptx):
        # the first loop of the PTX (decode: the unmasked KV loop, as no window is compiled)
        lines = ptx.splitlines()
        labels = {m.group(1): i for i, ln in enumerate(lines)
                  if (m := re.match(r"^(\$L__BB\d+_\d+):", ln))}
        for i, ln in enumerate(lines):
            m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)
            if m and labels.get(m.group(1), i) < i:
                return "\n".join(lines[labels[m.group(1)] : i + 1])
        return ""

    def st_bytes(text):
        # bytes a thread stores to shared memory (st.shared[.vN].bW)
        n = 0
        for op in re.findall(r"st\.shared(?:\.v(\d))?\.[bsuf](\d+)", text):
            n += int(op[0] or 1) * int(op[1]) // 8
        return n

    out = {}
    for case in json.load(sys.stdin):
        arch, q, cache, d, dv, bs, *variant = case
        variant = variant[0] if variant else ""
        key = f"sm{arch}-{cache}-d{d}-{dv}-n{bs}" + (f"-{variant}" if variant else "")
        mla = variant.startswith("mla")  # "mla": 128 heads; "mla_h16": tensor-parallel 8
        try:
            specs = aot_specs(q_dtype=DT[q], cache_dtype=DT[cache], head_size=d, head_size_v=dv,
                              num_q_heads=(16 if variant == "mla_h16" else 128) if mla else 32,
                              num_kv_heads=1 if mla else 8,
                              block_size=bs, arch=arch, mla=mla,
                              scale_plane=variant.endswith("_plane"),
                              kv_quant=(variant.removesuffix("_plane")
                                        if "per_token_head" in variant else None))
        except Exception:
            out[key] = {"_specs": {"ok": False, "error": traceback.format_exc()[-3000:]}}
            continue
        res = {}
        for sp in specs:
            try:
                # aot_compile unwraps `.fn` once: hand it the JITFunction one level down
                # with the alignments the launcher's arguments have at run time
                ck = aot_compile(types.SimpleNamespace(fn=sp.kernel), sp.signature, sp.constexprs,
                                 arch=arch, num_warps=sp.num_warps, num_stages=sp.num_stages,
                                 divisible_by_16=sp.aligned, max_registers=sp.max_registers)
                ptx = ck.asm["ptx"]
                # global reads of >= 8 bytes: asynchronous copies (pipelined K/V tiles, in 8-byte
                # units: the same tile in fewer 16-byte copies counts the same) and vector loads
                # (the q tile's few, and K/V's when a config runs one stage)
                wide = sum(2 if n in ("0x10", "16") else 1 for n in re.findall(
                    r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x8|0x10|8|16),",
                    ptx))
                wide += len(re.findall(r"ld\.global(?:\.\w+)*\.v[24]\.", ptx))
                regs = re.search(r"\.maxnreg (\d+)", ptx)
                # TMA copies of whole tiles (prefill of 16-bit pages holding whole tiles)
                tma = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
                # 1-byte pages: byte-wise shared loads (an 8-bit MMA operand read element by
                # element) and the packed upcasts of KV_UPCAST
                byte_lds = len(re.findall(r"ld\.shared(?:\.\w+)*\.[bsu]8\b", ptx))
                # byte-wise global loads (a K/V tile read element by element)
                byte_gld = len(re.findall(r"ld\.global(?:\.\w+)*\.[bsu]8\b", ptx))
                # the KV loop's shared stores (bytes a thread) and transposed ldmatrix reads:
                # an fp16 copy of K / V is 128 bytes a thread each per 64-token tile, and V's is
                # read back by ldmatrix .trans
                loop = first_loop(ptx)
                loop_st = st_bytes(loop)
                loop_trans = len(re.findall(r"ldmatrix[\w.]*\.trans", loop))
                upcasts = {k: len(re.findall(p, ptx)) for k, p in (
                    ("e4m3x2", r"cvt\.rn\.f16x2\.e4m3x2"), ("bf16_f16", r"cvt(?:\.rn)?\.bf16\.f16"),
                    ("i8_magic", r"sub\.f16x2"), ("e5m2_prmt", r"prmt\.b32 [^;]*0x1404;"))}
                res[sp.name] = {"ok": True, "shared": ck.metadata.shared,
                                "mma": ("mma" in ptx), "wide": wide,
                                "maxnreg": int(regs.group(1)) if regs else 0,
                                "want_maxnreg": sp.max_registers, "tma": tma,
                                "want_tma": bool(sp.constexprs.get("TMA")),
                                "kv_upcast": bool(sp.constexprs.get("KV_UPCAST")),
                                "byte_lds": byte_lds, "byte_gld": byte_gld, "loop_st": loop_st,
                                "loop_trans": loop_trans,
                                "k_direct": bool(sp.constexprs.get("K_DIRECT")),
                                "v_direct": bool(sp.constexprs.get("V_DIRECT")), **upcasts}
            except Exception:
                res[sp.name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        out[key] = res
    print("AOT-RESULTS" + json.dumps(out))
    """
)


def _fp8(arch: int) -> str:
    # Triton has no e4m3 conversions before sm_89: A100-class GPUs use e5m2 fp8 caches.
    return "fp8e4" if arch >= 90 else "fp8e5"


HEADS = [(64, 64), (128, 128), (192, 128), (256, 256)]
FULL = [
    (arch, "bf16", cache if cache == "bf16" else _fp8(arch), d, dv, bs)
    for arch in (90, 80)
    for cache in ("bf16", "fp8")
    for d, dv in HEADS
    for bs in (16, 128)
]
DEFAULT = [
    (90, "bf16", "bf16", 128, 128, 16),
    (90, "bf16", "fp8e4", 192, 128, 128),
    (90, "bf16", "bf16", 256, 256, 128),
    # prefill tiles read by TMA (a 64-token tile inside a 128-token page)
    (90, "fp16", "fp16", 128, 128, 128),
    (80, "bf16", "bf16", 256, 256, 16),
    (80, "bf16", "fp8e5", 64, 64, 128),
    # issue 12: per-token-head caches (scales inline) and MLA's 512 + 64 latent at page 64 (the
    # 192/128 case above already runs the head split 128 + 64 instead of padding to 256)
    (90, "bf16", "i8", 128, 128, 16, "int8_per_token_head"),
    # the same scales in each page's scale plane (kv-spec's scale_plane: rows of 256 bytes)
    (90, "bf16", "i8", 128, 128, 16, "int8_per_token_head_plane"),
    (90, "bf16", "bf16", 576, 512, 64, "mla"),
    # issue 12: fp8 per tensor, the decode shape of the benchmarks (KV_UPCAST: fp16 MMAs over
    # tiles upcast by PTX; e5m2's upcast is a byte permute)
    (90, "bf16", "fp8e4", 128, 128, 16),
    (90, "fp16", "fp8e5", 128, 128, 128),
    # issue 31: DeepSeek-V3's fp8 latent at tensor-parallel 8 (16 heads: the Triton kernel's
    # bandwidth-bound decode; the sm_90 Gluon MLA kernel serves 16-bit latents only)
    (90, "bf16", "fp8e4", 576, 512, 64, "mla_h16"),
    # a token row of 80 + 72 bf16 (304 bytes) is 16-byte aligned only every other token: Triton
    # does not specialize its stride, so the kernel is told the 8-element alignment (ROW_ALIGN)
    (90, "bf16", "bf16", 80, 72, 16),
]
FULL += [
    (90, "bf16", "fp8e4", 128, 128, 16, "fp8_per_token_head"),
    (90, "bf16", "i8", 192, 128, 128, "int8_per_token_head"),
    (80, "bf16", "i8", 128, 128, 16, "int8_per_token_head"),
    (90, "bf16", "bf16", 576, 512, 64, "mla"),
    (80, "bf16", "bf16", 576, 512, 64, "mla"),
    (90, "fp16", "fp16", 576, 512, 16, "mla"),
    # fp8 latents at 128 heads (no register cap: capped at 128, ptxas refused the sm_90 build)
    (90, "bf16", "fp8e4", 576, 512, 64, "mla"),
    (80, "bf16", "fp8e5", 576, 512, 64, "mla"),
    (80, "bf16", "fp8e5", 576, 512, 64, "mla_h16"),
]


def _key(case: tuple) -> str:
    arch, _, cache, d, dv, bs, *variant = case
    return f"sm{arch}-{cache}-d{d}-{dv}-n{bs}" + (f"-{variant[0]}" if variant else "")


def _compile(cases: list[tuple]) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    chunks = [cases[i::2] for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for chunk in chunks
        if chunk
    ]
    results: dict[str, dict] = {}
    for proc, chunk in zip(procs, [c for c in chunks if c], strict=True):
        stdout, stderr = proc.communicate(json.dumps(chunk), timeout=900)
        line = next((ln for ln in stdout.splitlines() if ln.startswith("AOT-RESULTS")), None)
        if line is None:
            raise AssertionError(f"AOT subprocess failed (rc={proc.returncode}):\n{stderr[-6000:]}")
        results.update(json.loads(line[len("AOT-RESULTS") :]))
    return results


@pytest.fixture(scope="module")
def default_results() -> dict[str, dict]:
    return _compile(DEFAULT)


@pytest.fixture(scope="module")
def full_results() -> dict[str, dict]:
    return _compile(FULL)


def _check(case: tuple, results: dict[str, dict]) -> None:
    res = results[_key(case)]
    names = set(res)
    assert {
        "attn_decode",
        "attn_decode_split",
        "attn_prefill",
        "merge_splits",
        "merge_splits_decode_only",
        "merge_two",
    } <= names, names
    for name, r in res.items():
        assert r["ok"], f"{_key(case)} {name} failed to compile:\n{r.get('error')}"
        assert r["shared"] <= SHARED_MEMORY_LIMIT[case[0]], (
            f"{_key(case)} {name}: {r['shared']} B of shared memory"
        )
        if name.startswith("attn"):
            assert r["mma"], f"{_key(case)} {name}: no tensor-core instruction in the PTX"
            # K/V tiles read in >= 8-byte vectors: a per-token-head row (2 * 128 + 8 bytes) whose
            # alignment the kernel is not told reads byte by byte, at 0.17 of the copy (H200),
            # leaving only the q tile's 2-9 vector loads
            # (an fp8 latent's prefill tile, 16 tokens x 576 bytes over 8 warps, is 36 bytes a
            # thread: read in vectors, but fewer 8-byte units; and no byte-wise loads)
            fp8_latent = (
                case[2] not in ("bf16", "fp16") and len(case) > 6 and case[6].startswith("mla")
            )
            min_wide = 8 if fp8_latent else 16
            assert r["wide"] >= min_wide, f"{_key(case)} {name}: K/V read without vector loads"
            if fp8_latent:
                assert r["byte_gld"] == 0, f"{_key(case)} {name}: {r['byte_gld']} byte loads"
            # a register cap the launcher asks for reaches ptxas (1-byte pages: 128)
            assert r["maxnreg"] == r["want_maxnreg"], (_key(case), name, r)
            # TMA where the launcher's config asks for it (sm_90 prefill over whole-tile pages),
            # and nowhere else
            assert (r["tma"] > 0) == r["want_tma"], (_key(case), name, r["tma"], r["want_tma"])
            # decode over 1-byte pages upcasts (select_config's kv_upcast), reading K and V as
            # bytes in the MMA operands' layouts (k_direct / v_direct): no byte-wise shared
            # loads, the packed conversion of the cache's dtype, no fp16 copy of either tile
            one_byte = case[2] not in ("bf16", "fp16")
            decode_1b = one_byte and name.startswith("attn_decode")
            assert r["kv_upcast"] == decode_1b, (name, r)
            # (an MLA latent keeps K's fp16 copy: V is K's own tile, read from it)
            mla = len(case) > 6 and case[6].startswith("mla")
            assert r["k_direct"] == (decode_1b and not mla), (name, r)
            # (V as bytes where the warps split its width in 32-column groups: head 128 over 4
            # warps; the DiffKV and head-64 configs keep V's fp16 copy)
            # per-token-head pages keep it too: their bf16 P.V has no packed byte conversion
            pth = len(case) > 6 and "per_token_head" in case[6]
            v_bytes = decode_1b and case[4] == 128 and case[3] != 192 and not pth
            assert r["v_direct"] == v_bytes, (name, r)
            if r["k_direct"] and r["v_direct"]:
                # what is left: P's fp16 tile (16 bytes a thread) and the row reductions; the
                # fp16 copies of K and V stored 276 bytes a thread a tile
                assert r["loop_st"] <= 48, f"{_key(case)} {name}: {r['loop_st']} B stored a tile"
                assert r["loop_trans"] == 0, f"{_key(case)} {name}: V read back transposed"
            if r["kv_upcast"]:
                assert r["byte_lds"] == 0, f"{_key(case)} {name}: {r['byte_lds']} byte loads"
                # (per-token-head pages keep a bf16 P.V under bf16 queries: p * s_v may leave
                # fp16's range, so their fp8 V still widens to bf16 through f16)
                if not (len(case) > 6 and case[6].endswith("per_token_head")):
                    assert r["bf16_f16"] == 0, f"{_key(case)} {name}: element-wise fp8 -> bf16"
                want = {"fp8e4": "e4m3x2", "fp8e5": "e5m2_prmt", "i8": "i8_magic"}[case[2]]
                assert r[want] > 0, f"{_key(case)} {name}: no packed {want} upcast"


@pytest.mark.parametrize("case", DEFAULT, ids=_key)
def test_aot_compile_attention(case: tuple, default_results: dict[str, dict]) -> None:
    _check(case, default_results)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KV_KERNELS_AOT_FULL") != "1", reason="set KV_KERNELS_AOT_FULL=1"
)
@pytest.mark.parametrize("case", FULL, ids=_key)
def test_aot_compile_attention_full(case: tuple, full_results: dict[str, dict]) -> None:
    _check(case, full_results)
