#!/usr/bin/env bash
# The second toolchain (part of the test command, scripts/test.sh): the whole project built with
# Debian's clang (C++ library, CLI, aclnn front door, examples, the Python extension) with warnings as
# errors, and the whole ctest suite run there. clang's OpenMP runtime is libomp (libomp-14-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
CC=clang CXX=clang++ cmake -S . -B build-clang -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_WERROR=ON \
  -DKVCOMP_CUDA=OFF >/dev/null
cmake --build build-clang --parallel "$(nproc)"
ctest --test-dir build-clang --output-on-failure --parallel "$(nproc)" --timeout 900
echo "[kvcomp] clang suite passed ($(clang++ --version | head -1))"
