#!/usr/bin/env bash
# Configures and builds kvcomp into ./build (Release).
set -euo pipefail
cd "$(dirname "$0")/.."
# The CUDA backend is built when a CUDA toolkit with cuBLAS is found (KVCOMP_CUDA=AUTO): the one
# scripts/install-cuda.sh puts in $KVCOMP_CUDA_HOME first, else CMake's own search (nvcc on PATH).
cuda_home=${KVCOMP_CUDA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcomp/cuda-13.0}
cuda_args=()
if [ -x "$cuda_home/bin/nvcc" ]; then
  cuda_args=(-DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" -DCUDAToolkit_ROOT="$cuda_home")
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_WERROR=ON "${cuda_args[@]}" >/dev/null
cmake --build build --parallel "$(nproc)"
