#!/usr/bin/env bash
# On the GPU machine: bench_paged_attention.py with FlashMLA as the MLA cases' peer.
# flash_mla is taken from $FLASHMLA_SITE (default $HOME/flashmla-site, where build_on_device.sh
# installs it in the same call), else from a carried .device/flashmla-built/ (the unpacked
# flashmla_build.tar.gz). Arguments go to the benchmark (default: --only flashmla).
# Output: $OUT/paged_attention.{json,md,png} and $OUT/bench_flashmla.log (every JSON line, also when
# BENCH_TIMEOUT, default 540 s, stops the run before the report is written).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-/tmp/flashmla-out}
mkdir -p "$out"
site=${FLASHMLA_SITE:-$HOME/flashmla-site}
if [ ! -d "$site/flash_mla" ] && [ -d "$root/.device/flashmla-built/flash_mla" ]; then
  site=$root/.device/flashmla-built
fi
src=$(ls -d "$root"/packages/*/src | paste -sd: -)
export PYTHONPATH="$site:$src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -f "$site/flash_mla/COMMIT" ] && head -2 "$site/flash_mla/COMMIT"
[ -f "$site/flash_mla/BUILD_INFO" ] && cat "$site/flash_mla/BUILD_INFO"
[ $# -gt 0 ] || set -- --only flashmla
set -o pipefail
timeout "${BENCH_TIMEOUT:-540}" python3 packages/kv-kernels/benchmarks/bench_paged_attention.py \
  --out "$out" "$@" 2>&1 | tee "$out/bench_flashmla.log"
