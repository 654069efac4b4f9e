#!/usr/bin/env bash
# There (the GPU machine): half "a" parks the first part in $HOME; half "b" joins the wheel and
# installs NIXL into /tmp/nixl-site (--no-deps: torch and numpy are there). See stage.sh.
set -euo pipefail
half=${1:?give a or b}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$HOME/nixlparts"
if [ "$half" = a ]; then
  cp "$root/.device/nixl/a/part.aa" "$HOME/nixlparts/"
  echo "part a parked; run half b within ~30 s"
  exit 0
fi
wheels=$(mktemp -d)
cat "$HOME/nixlparts/part.aa" "$root/.device/nixl/b/part.ab" > "$wheels/$(cat "$root/.device/nixl/b/WHEEL_NAME")"
cp "$root"/.device/nixl/b/nixl-*.whl "$wheels/"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nixl-site "$wheels"/*.whl
PYTHONPATH=/tmp/nixl-site python3 -c "import nixl._api; print('nixl importable from /tmp/nixl-site')"
