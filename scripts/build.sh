#!/usr/bin/env bash
# Configures and builds kvcomp into ./build (Release).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_WERROR=ON >/dev/null
cmake --build build --parallel "$(nproc)"
