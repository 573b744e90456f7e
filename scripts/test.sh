#!/usr/bin/env bash
# Set-up command 2: install what is missing, build, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/install-torch.sh
bash scripts/install-python-deps.sh
bash scripts/install-cuda.sh
bash scripts/build.sh
bash scripts/check-deps.sh
ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 900
bash scripts/test-clang.sh
bash scripts/test-python312.sh
bash scripts/test-prefix-deps.sh
bash scripts/test-sanitizers.sh
