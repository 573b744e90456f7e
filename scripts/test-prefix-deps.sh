#!/usr/bin/env bash
# Dependencies under a prefix (part of the test command, scripts/test.sh): oneDNN (and the OpenCL
# files its CMake package asks for) unpacked from Debian's .deb files into a scratch prefix, the
# system's copy of its CMake package hidden in a private mount namespace, the project configured with
# CMAKE_PREFIX_PATH=<prefix>/usr, and example.downstream_build run there: the installed kvcomp must be
# found and linked by a downstream project, and run, with no LD_LIBRARY_PATH. This is how the GPU
# machine (no Debian packages) and anyone not using system packages build kvcomp.
# Needs root (unshare -m, mount --bind) and apt-get download; skipped with a message otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ] || ! command -v unshare >/dev/null 2>&1; then
  echo "[kvcomp] prefix-deps check SKIPPED: needs root and unshare" >&2
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -qq libdnnl2 libdnnl-dev ocl-icd-libopencl1 ocl-icd-opencl-dev opencl-c-headers)
for f in "$work"/*.deb; do dpkg -x "$f" "$work/prefix"; done
mkdir -p "$work/empty"
unshare -m bash -euo pipefail -c '
  work=$1
  mount --bind "$work/empty" /usr/lib/x86_64-linux-gnu/cmake/dnnl  # only in this namespace
  unset LD_LIBRARY_PATH
  cmake -S . -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_BUILD_PYTHON=OFF \
    -DCMAKE_PREFIX_PATH="$work/prefix/usr" -DKVCOMP_CUDA=OFF >/dev/null
  grep -q "^dnnl_DIR:PATH=$work/prefix/" "$work/build/CMakeCache.txt" || { echo "oneDNN not taken from the prefix"; exit 1; }
  cmake --build "$work/build" --parallel "$(nproc)" --target kvcomp kvcomp_aclnn kvcomp_cli kvcomp_expected_output
  ctest --test-dir "$work/build" --output-on-failure -R "^example\.downstream_build$"
' _ "$work"
echo "[kvcomp] prefix-deps check passed: downstream build against dependencies under a prefix"
