#!/usr/bin/env bash
# Run kvstack's GPU tests and benchmarks on the GPU machine (Python 3.12, torch, triton, pytest;
# no uv, no package index). Results land in $OUT (default ./device-out):
#   device.txt, gpu_tests.log, bench.log and the <bench>.json each benchmark script writes
#   (the device tool brings back at most 8 files).
#
# Usage (from the repo root):  bash tools/device_run.sh [tests|bench|all] [pytest -k expression]
# FlashAttention-4, when staged into $HOME/fa4-site (see the device notes), is put on PYTHONPATH.
set -uo pipefail
what="${1:-all}"
kexpr="${2:-}"
out="${OUT:-$PWD/device-out}"
mkdir -p "$out"
src=$(ls -d "$PWD"/packages/*/src | paste -sd: -)
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$HOME/fa4-site" ]; then
  export PYTHONPATH="$HOME/fa4-site:$HOME/fa4-site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
python3 -c "import flash_attn.cute; print('flash-attn-4 importable')" 2>/dev/null | tee -a "$out/device.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  args=(-m gpu -q -p no:cacheprovider -o addopts="" --import-mode=importlib -rfEs --tb=short)
  [ -n "$kexpr" ] && args+=(-k "$kexpr")
  python3 -m pytest ${TESTS_ONLY:-packages/*/tests} "${args[@]}" > "$out/gpu_tests.log" 2>&1
  status=${PIPESTATUS[0]}
  tail -n 30 "$out/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for script in ${BENCH_ONLY:-packages/*/benchmarks/bench_*.py}; do
    name=$(basename "$script" .py)
    echo "== $name"
    echo "== $name" >> "$out/bench.log"
    timeout 400 python3 "$script" --out "$out" > "/tmp/$name.log" 2>&1 || { echo "$name failed"; status=1; }
    tail -n 60 "/tmp/$name.log" | tee -a "$out/bench.log"
  done
fi
exit $status
