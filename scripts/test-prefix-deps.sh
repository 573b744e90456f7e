#!/usr/bin/env bash
# Dependencies under a prefix (part of the test command, scripts/test.sh): oneDNN from PyPI's wheels
# (scripts/install-onednn.sh) copied to a scratch prefix, every other copy of oneDNN hidden in a
# private mount namespace (Debian's CMake package and headers where a libdnnl-dev is installed, and the
# cache prefix the top-level CMakeLists.txt falls back to), the project configured with
# CMAKE_PREFIX_PATH=<prefix>, and example.downstream_build run there: the installed kvcomp must be found
# and linked by a downstream project, and run, with no LD_LIBRARY_PATH. This is how the GPU machine (no
# Debian packages) and anyone not using system packages build kvcomp.
# Needs root (unshare -m, mount --bind); skipped with a message otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ] || ! command -v unshare >/dev/null 2>&1; then
  echo "[kvcomp] prefix-deps check SKIPPED: needs root and unshare" >&2
  exit 0
fi
cached=$(bash scripts/install-onednn.sh)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -a "$cached" "$work/prefix"
mkdir -p "$work/empty"
unshare -m bash -euo pipefail -c '
  work=$1 cached=$2
  # Only in this namespace: no oneDNN but the one under $work/prefix.
  for d in "$cached" /usr/lib/x86_64-linux-gnu/cmake/dnnl /usr/include/oneapi; do
    [ -d "$d" ] && mount --bind "$work/empty" "$d"
  done
  unset LD_LIBRARY_PATH CMAKE_PREFIX_PATH dnnl_DIR
  cmake -S . -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_BUILD_PYTHON=OFF \
    -DCMAKE_PREFIX_PATH="$work/prefix" -DKVCOMP_CUDA=OFF >/dev/null
  grep -q "^dnnl_DIR:PATH=$work/prefix/" "$work/build/CMakeCache.txt" || { echo "oneDNN not taken from the prefix"; exit 1; }
  cmake --build "$work/build" --parallel "$(nproc)" --target kvcomp kvcomp_aclnn kvcomp_cli kvcomp_expected_output
  ctest --test-dir "$work/build" --output-on-failure -R "^example\.downstream_build$"
' _ "$work" "$cached"
echo "[kvcomp] prefix-deps check passed: downstream build against oneDNN from PyPI under a prefix"
