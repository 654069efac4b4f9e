"""Build FlashMLA's sm90 dense MLA decode only (kvstack's trimmed copy of its setup.py).

Upstream's setup.py also compiles the sm90 sparse decode and prefill and every sm100 kernel, and runs
``git submodule update``; this one compiles the four sources that ``dense_decode_fwd`` needs, for
``sm_90a`` alone, with upstream's nvcc flags. fp16 is left out (``FLASH_MLA_DISABLE_FP16``): the
benchmark compares bf16. ``NVCC_THREADS`` (default 4) and ``MAX_JOBS`` (ninja) set the parallelism.
"""

import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

assert CUDA_HOME is not None, "PyTorch must be compiled with CUDA support"
this_dir = Path(__file__).resolve().parent
features = ["-DFLASH_MLA_DISABLE_FP16"]
nvcc_flags = [
    "-O3",
    "-std=c++20",
    "-DNDEBUG",
    "-D_USE_MATH_DEFINES",
    "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "--ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage",
    "-lineinfo",
    "-gencode",
    "arch=compute_90a,code=sm_90a",
    "--threads",
    os.getenv("NVCC_THREADS", "4"),
    *features,
]
# CUDA 13 keeps libcu++ / CUB (``cuda/std/...``) under include/cccl: nvcc finds it itself, the host
# compiler building api.cpp (which includes cutlass headers) does not.
cccl = [str(p) for p in [Path(CUDA_HOME) / "include" / "cccl"] if p.is_dir()]
# torch's CUDA headers include cusparse.h / cublas.h; where the toolkit lacks them, the ones of the
# pip CUDA wheels that torch itself loads, searched last (api.cpp only: no .cu file includes torch)
fallback = []
if not (Path(CUDA_HOME) / "include" / "cusparse.h").exists():
    try:
        import nvidia

        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        for sub in ("cu13/include", "cu12/include"):
            if (Path(root) / sub / "cusparse.h").exists():
                fallback = ["-idirafter", str(Path(root) / sub)]
cxx_flags = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations", *features, *fallback]

setup(
    name="flash_mla",
    version="1.0.0+sm90dense",
    packages=["flash_mla"],
    ext_modules=[
        CUDAExtension(
            name="flash_mla.cuda",
            sources=[
                "csrc/api/api.cpp",
                "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
                "csrc/smxx/decode/combine/combine.cu",
                "csrc/sm90/decode/dense/instantiations/bf16.cu",
            ],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            include_dirs=[
                str(this_dir / "csrc"),
                str(this_dir / "csrc" / "kerutils" / "include"),
                str(this_dir / "csrc" / "sm90"),
                str(this_dir / "csrc" / "cutlass" / "include"),
                *cccl,
            ],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
