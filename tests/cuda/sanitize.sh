#!/usr/bin/env bash
# Runs part of the GPU suite under compute-sanitizer (memcheck or racecheck).
# usage: sanitize.sh <compute-sanitizer or empty> <tool> <test_cuda> <gtest filter>
# Exit 77 (ctest: skipped) without the tool or a GPU.
set -u
sanitizer=$1 tool=$2 exe=$3 filter=$4
if [[ -z "$sanitizer" || "$sanitizer" == *NOTFOUND ]]; then
  echo "SKIPPED: compute-sanitizer not found"
  exit 77
fi
if ! "$exe" --gtest_filter=CudaRuntime.SeesTheDevices 2>&1 | grep -q '\[       OK \]'; then
  echo "SKIPPED: no CUDA device on this machine"
  exit 77
fi
exec "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 20 "$exe" --gtest_filter="$filter"
