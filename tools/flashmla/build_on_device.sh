#!/usr/bin/env bash
# Build FlashMLA's sm90 dense MLA decode on the GPU machine from the carried source tree
# (.device/flashmla, staged by tools/flashmla/stage.sh), check it against a torch reference on a
# small case, install it under $FLASHMLA_SITE (default $HOME/flashmla-site) for the rest of this
# call, and pack the importable package (python files + the built .so) into
# $OUT/flashmla_build.tar.gz, to be kept as .device/flashmla-built/ and carried next time.
# Log: $OUT/flashmla_build.log.  See tools/flashmla/README.md for the two-call recipe.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
src=${FLASHMLA_SRC:-$root/.device/flashmla}
out=${OUT:-/tmp/flashmla-out}
site=${FLASHMLA_SITE:-$HOME/flashmla-site}
work=${FLASHMLA_WORK:-/tmp/flashmla-build}
mkdir -p "$out"
log=$out/flashmla_build.log
exec > >(tee -a "$log") 2>&1

[ -f "$src/setup.py" ] || { echo "no $src/setup.py: carry .device/flashmla (bash tools/flashmla/stage.sh)"; exit 2; }
echo "== FlashMLA build $(date -u +%FT%TZ) on $(hostname), $(nproc) cores"
cat "$src/COMMIT"

# CUDA_HOME: a set one, else the toolkit that nvcc resolves to (torch's own guess can miss it when
# nvcc on PATH is a wrapper script), else /usr/local/cuda.
if [ -z "${CUDA_HOME:-}" ]; then
  for cand in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" /usr/local/cuda; do
    if [ -x "$cand/bin/nvcc" ] && [ -f "$cand/include/cuda_runtime.h" ]; then CUDA_HOME=$cand; break; fi
  done
fi
export CUDA_HOME
echo "CUDA_HOME=$CUDA_HOME"
"$CUDA_HOME/bin/nvcc" --version | tail -2
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
command -v ninja >/dev/null && echo "ninja $(ninja --version)" || echo "no ninja: setuptools compiles the 4 sources one by one"

rm -rf "$work"; mkdir -p "$work"
cp -r "$src/." "$work/"
cd "$work"
# 4 translation units (bf16.cu is the long one): one ninja job each; nvcc --threads only helps
# with several -gencode targets, so keep it small.
export MAX_JOBS=${MAX_JOBS:-4} NVCC_THREADS=${NVCC_THREADS:-2}
# (setup_sm90.py passes its own -gencode, which torch then leaves alone; this only backs it up)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
t0=$(date +%s)
python3 setup.py build_ext --inplace
t1=$(date +%s)
echo "== build took $((t1 - t0)) s"
so=$(ls flash_mla/cuda*.so)
ls -la "$so"
# host-side debug info only (~11 of ~13 MB); the kernels' -lineinfo stays in the fatbin
if command -v strip >/dev/null; then strip --strip-debug "$so" && ls -la "$so"; fi
cp COMMIT flash_mla/COMMIT
{
  echo "built $(date -u +%FT%TZ) by tools/flashmla/build_on_device.sh in $((t1 - t0)) s"
  "$CUDA_HOME/bin/nvcc" --version | tail -1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} > flash_mla/BUILD_INFO

# installed for the rest of this call (PYTHONPATH=$FLASHMLA_SITE)
rm -rf "$site/flash_mla"; mkdir -p "$site"; cp -r flash_mla "$site/"
tar -czf "$out/flashmla_build.tar.gz" flash_mla
ls -la "$out/flashmla_build.tar.gz"

# a small check against a torch reference (does not stop the packing: the tarball is already out)
PYTHONPATH=$site python3 "$root/tools/flashmla/check_flashmla.py" || echo "== check FAILED (see above)"
echo "== done: PYTHONPATH=$site has flash_mla; keep $out/flashmla_build.tar.gz as .device/flashmla-built/"
