#!/usr/bin/env bash
# Installs a CUDA 13.0 toolkit from PyPI (the version of the GPU machines' driver) for building the
# CUDA backend on a machine without one: nvcc, the runtime, the CRT headers, NVVM, CCCL and cuBLAS,
# pinned to 13.0.*, unpacked into $KVCOMP_CUDA_HOME (default ~/.cache/kvcomp/cuda-13.0) as a
# toolkit folder CMake accepts (bin/nvcc, include/, lib64/ with the libX.so links the linker needs).
# scripts/build.sh builds the CUDA backend with it. Does nothing when it is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
home=${KVCOMP_CUDA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcomp/cuda-13.0}
if [ -x "$home/bin/nvcc" ] && [ -e "$home/lib64/libcublasLt.so" ]; then
  exit 0
fi
python=${PYTHON:-python3}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
echo "[kvcomp] installing the CUDA 13.0 toolkit from PyPI into $home"
"$python" -m pip install --quiet --no-deps --disable-pip-version-check --target "$stage" \
  'nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-crt==13.0.*' 'nvidia-nvvm==13.0.*' \
  'nvidia-cuda-cccl==13.0.*' 'nvidia-cublas==13.0.*'
[ -x "$stage/nvidia/cu13/bin/nvcc" ] || { echo "[kvcomp] the wheels hold no nvidia/cu13/bin/nvcc" >&2; exit 1; }
rm -rf "$home"
mkdir -p "$(dirname "$home")"
mv "$stage/nvidia/cu13" "$home"
# nvcc.profile and CMake look in lib64; the wheels ship lib/ and only versioned sonames.
ln -s lib "$home/lib64"
for l in cudart cublas cublasLt; do
  ln -sf "lib$l.so.13" "$home/lib/lib$l.so"
done
"$home/bin/nvcc" --version | tail -1
