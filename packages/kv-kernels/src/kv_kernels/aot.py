"""Ahead-of-time compilation of Triton kernels for a GPU target, on a machine with no GPU.

CI has no GPU; compiling every kernel for sm_90 / sm_80 with ``triton.compile`` and a ``GPUTarget``
runs the whole backend pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin through ptxas), so errors
that only show on a GPU (layouts, shared-memory limits, unsupported casts) fail CI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SHARED_MEMORY_LIMIT", "aot_case_spec", "aot_compile", "build_problems"]

#: The most shared memory (bytes) a block may opt into, by arch: sm_90 227 KiB, sm_80 163 KiB.
#: A kernel built for a target must fit it (the AOT tests check every build against it).
SHARED_MEMORY_LIMIT = {90: 232448, 80: 166912}


def aot_compile(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    *,
    arch: int = 90,
    num_warps: int = 4,
    num_stages: int = 3,
    divisible_by_16: tuple[str, ...] = (),
    max_registers: int = 0,
) -> Any:
    """Compile ``kernel`` (a ``@triton.jit`` or ``@gluon.jit`` function) for ``cuda`` sm_``arch``
    and return the compiled kernel (``.asm`` holds ``ttir``, ``ptx`` and ``cubin``).

    ``signature`` maps every argument to a Triton type (``"*bf16"``, ``"i64"``, ``"fp32"``) or
    ``"constexpr"``; ``constexprs`` gives the constexpr values by name. ``divisible_by_16`` names
    the pointer / int arguments the launcher would specialize as 16-divisible (aligned pointers,
    strides and sizes), so the AOT build vectorizes like the JIT build on a GPU does;
    ``max_registers``: ptxas's ``maxnreg`` (0: its own choice).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    inner = kernel  # unwrap @triton.autotune / @triton.heuristics down to the JITFunction
    while not hasattr(inner, "arg_names") and hasattr(inner, "fn"):
        inner = inner.fn
    if not hasattr(inner, "arg_names"):
        raise ValueError(f"aot_compile: {kernel!r} is not a @triton.jit kernel")
    missing = [a for a in inner.arg_names if a not in signature]
    if missing:
        raise ValueError(f"aot_compile: signature lacks arguments {missing} of {inner.__name__}")
    unknown = [a for a in divisible_by_16 if a not in inner.arg_names]
    if unknown:
        raise ValueError(f"aot_compile: divisible_by_16 names unknown arguments {unknown}")
    attrs = {(inner.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible_by_16}
    if inner.is_gluon():
        # (a Gluon kernel's module needs its target and warp count before its layouts verify)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn=inner, signature=signature, constexprs=constexprs, attrs=attrs)
    else:
        src = ASTSource(fn=inner, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={
            "num_warps": num_warps,
            "num_stages": num_stages,
            **({"maxnreg": max_registers} if max_registers else {}),
        },
    )


def aot_case_spec(
    kernel: Any,
    *,
    module: str,
    pointers: dict[str, str],
    floats: tuple[str, ...],
    constexprs: dict[str, Any],
    aligned_strides: tuple[str, ...] | list[str],
    arch: int = 90,
    descriptors: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A launcher's build as :func:`aot_compile` keywords (plus ``module`` and ``kernel``, the
    kernel's name there): every argument of ``kernel`` typed from ``pointers`` (name -> pointer
    type), ``descriptors`` (name -> ``tensordesc<...>`` type: TMA descriptors), ``floats``
    (float32 scalars), ``constexprs`` (whose ``num_warps`` is the build's), and otherwise ``i64``
    for ``stride_*`` and ``i32`` for the rest; ``divisible_by_16``: every pointer and
    ``aligned_strides``, what a launch from contiguous tensors aligns."""
    sig = {}
    for name in kernel.arg_names:
        sig[name] = pointers.get(name, "i64" if name.startswith("stride_") else "i32")
    sig.update(descriptors or {})
    sig.update(dict.fromkeys(floats, "fp32"))
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    return {
        "module": module,
        "kernel": kernel.__name__,
        "signature": sig,
        "constexprs": constexprs,
        "arch": arch,
        "num_warps": constexprs["num_warps"],
        "divisible_by_16": [*pointers, *aligned_strides],
    }


def build_problems(result: dict[str, Any], *, arch: int, present: tuple[str, ...]) -> list[str]:
    """What is wrong with one AOT build's result (the test fixtures' ``{"ok", "error"?, "shared"?,
    "counts"?}``): it failed, its shared memory passes :data:`SHARED_MEMORY_LIMIT`, or one of the
    ``present`` PTX patterns counted none. Empty when the build is sound."""
    if not result.get("ok"):
        return [f"the build failed: {result.get('error')}"]
    problems = []
    shared = result.get("shared", 0)
    if shared > SHARED_MEMORY_LIMIT[arch]:
        problems.append(
            f"{shared} bytes of shared memory > sm_{arch}'s {SHARED_MEMORY_LIMIT[arch]}"
        )
    counts = result.get("counts", {})
    problems += [f"no {name} in the PTX: {counts}" for name in present if not counts.get(name)]
    return problems
