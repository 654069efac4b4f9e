#!/usr/bin/env bash
# Run kvstack's GPU tests and benchmarks on the GPU machine (Python 3.12, torch, triton, pytest;
# no uv, no package index). Results land in $OUT (default ./device-out):
#   device.txt, gpu_tests.log, gpu_tests_summary.txt (a line per test directory), bench.log and
#   the <bench>.json each benchmark script writes (the device tool brings back at most 8 files).
# Environment: TESTS_ONLY (test directories, default every package's), TEST_TIMEOUT (seconds a
# directory, default 500), BENCH_ONLY (benchmark scripts).
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
  # One pytest per test directory, each under its own timeout (TEST_TIMEOUT seconds, default 500:
  # a device call ends at 10 minutes, so a sweep of every package takes several calls, e.g.
  # TESTS_ONLY=packages/kv-kernels/tests). gpu_tests.log keeps every run's output; each run's
  # last line (its counts, or that the timeout cut it) goes to gpu_tests_summary.txt, so a run
  # cut short is said, not mistaken for a pass.
  args=(-m gpu -q -p no:cacheprovider -p no:logging -o addopts="" --import-mode=importlib -rfEs --tb=short)
  [ -n "$kexpr" ] && args+=(-k "$kexpr")
  : > "$out/gpu_tests.log"
  : > "$out/gpu_tests_summary.txt"
  for dir in ${TESTS_ONLY:-packages/*/tests}; do
    timeout "${TEST_TIMEOUT:-500}" python3 -m pytest "$dir" "${args[@]}" > /tmp/gpu_run.log 2>&1
    rc=$?
    { echo "== $dir (rc=$rc)"; cat /tmp/gpu_run.log; } >> "$out/gpu_tests.log"
    last=$(grep -E " in [0-9.]+s( \(.*\))?$" /tmp/gpu_run.log | tail -n 1)
    if [ "$rc" = 124 ]; then last="cut by the ${TEST_TIMEOUT:-500} s timeout"; fi
    echo "$dir: rc=$rc $last" | tee -a "$out/gpu_tests_summary.txt"
    # 5: nothing collected (no gpu tests in that directory) is not a failure
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then status=1; fi
  done
  grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -n 30
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
