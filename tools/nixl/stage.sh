#!/usr/bin/env bash
# Here: download NIXL 1.5.1's wheels for the GPU machine (Python 3.12) and split the 59 MB pair
# into two halves under the git-ignored .device/nixl/{a,b}: each half, with the working tree,
# fits one call's 64 MiB. Then two calls there, chained within the ~30 s the machine stays warm:
#   carry .device/nixl/a tools/nixl:  bash tools/nixl/install_on_device.sh a
#   carry .device/nixl/b tools/nixl:  bash tools/nixl/install_on_device.sh b && export PYTHONPATH=$PYTHONPATH:/tmp/nixl-site
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo /.device/ >> .git/info/exclude
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" nixl==1.5.1 nixl-cu13==1.5.1
rm -rf .device/nixl && mkdir -p .device/nixl/a .device/nixl/b
wheel=$(ls "$tmp"/nixl_cu13-*.whl)
basename "$wheel" > .device/nixl/b/WHEEL_NAME
split -b 30000000 "$wheel" .device/nixl/part.
mv .device/nixl/part.aa .device/nixl/a/ && mv .device/nixl/part.ab .device/nixl/b/
cp "$tmp"/nixl-1.5.1-py3-none-any.whl .device/nixl/b/
rm -rf "$tmp"
du -sh .device/nixl/a .device/nixl/b
