#!/usr/bin/env bash
# Stage a minimal FlashMLA source tree (sm90 dense decode only) into .device/flashmla/
# from the bare mirrors that the search tool's `fetch` leaves under /work/.mirror.
# Usage (repo root):  bash tools/flashmla/stage.sh [FLASHMLA_MIRROR] [CUTLASS_MIRROR]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
fm=${1:-/work/.mirror/deepseek-ai+FlashMLA/repo}
cm=${2:-/work/.mirror/NVIDIA+cutlass/repo}
dst=$root/.device/flashmla
git -C "$root" check-ignore -q "$dst" || { echo ".device/ is not git-ignored; add /.device/ to .git/info/exclude" >&2; exit 1; }

fm_rev=$(git -C "$fm" rev-parse HEAD)
cutlass_rev=$(git -C "$fm" ls-tree HEAD csrc/cutlass | awk '{print $3}')
git -C "$cm" cat-file -e "$cutlass_rev^{commit}" || { echo "cutlass mirror lacks $cutlass_rev" >&2; exit 1; }

rm -rf "$dst"; mkdir -p "$dst"
# FlashMLA: python package, licence, and the sources of the sm90 dense decode path only.
git -C "$fm" archive "$fm_rev" \
  LICENSE README.md setup.py flash_mla \
  csrc/defines.h csrc/params.h csrc/utils.h csrc/kerutils \
  csrc/api/api.cpp csrc/api/common.h csrc/api/dense_decode.h \
  csrc/sm90/helpers.h csrc/sm90/decode/dense \
  csrc/smxx/decode \
  tests/test_flash_mla_dense_decoding.py tests/kernelkit \
  | tar -x -C "$dst"
mv "$dst/setup.py" "$dst/setup.upstream.py"   # kept for reference; tools/flashmla/setup_sm90.py builds

# api.cpp binds only what was staged: the dense decode.
cat > "$dst/csrc/api/api.cpp" <<'CPP'
// Trimmed by kvstack tools/flashmla/stage.sh: sm90 dense decode only
// (upstream also binds sparse decode, sparse prefill and the sm100 dense prefill).
#include <pybind11/pybind11.h>

#include "dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA (sm90 dense decode only)";
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
CPP

# CUTLASS at the submodule's pinned commit: headers only, and of those the ones this build can
# reach. A local nvcc 13.0 build of these sources (strace of every opened file) read 135 headers,
# all under include/cute and include/cutlass/{., arch, detail, layout, platform}, none under
# tools/util/include; cute/ is kept whole, and cutlass/'s GEMM, conv, epilogue and other
# subfolders (~13 MiB) are left out.
mkdir -p "$dst/csrc/cutlass"
# (a mirror may lack unrelated media blobs: git warns about them, and the archive of these paths is whole)
git -C "$cm" archive "$cutlass_rev" LICENSE.txt include/cute include/cutlass \
  2> >(grep -v "invalid object" >&2 || true) | tar -x -C "$dst/csrc/cutlass"
for sub in conv epilogue experimental gemm reduction transform; do
  rm -rf "$dst/csrc/cutlass/include/cutlass/$sub"
done

cp "$root/tools/flashmla/setup_sm90.py" "$dst/setup.py"
{
  echo "flashmla $fm_rev"
  echo "cutlass $cutlass_rev"
  echo "staged $(date -u +%Y-%m-%dT%H:%M:%SZ) by tools/flashmla/stage.sh (sm90 dense decode only)"
} > "$dst/COMMIT"
du -sh "$dst"
