#!/usr/bin/env bash
# Set-up command 2: install what is missing, build, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step's wall time is printed, so that a CI log shows where its minutes go (target: < 30 in all).
step() {
  local t0=$SECONDS
  "$@"
  echo "[kvcomp] step took $((SECONDS - t0)) s: $*"
}
step bash scripts/install-deps.sh
step bash scripts/install-torch.sh
step bash scripts/install-python-deps.sh
step bash scripts/install-cuda.sh
step bash scripts/build.sh
step bash scripts/check-deps.sh
step ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 900
step bash scripts/test-python312.sh
step bash scripts/test-prefix-deps.sh
step bash scripts/test-sanitizers.sh
echo "[kvcomp] test command passed in $SECONDS s"
