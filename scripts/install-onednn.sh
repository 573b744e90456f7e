#!/usr/bin/env bash
# oneDNN for the C++ build: the PyPI wheels that `pip install .` builds with (pyproject.toml),
# onednn-devel-cpu-gomp (headers, CMake package) and onednn-cpu-gomp (libdnnl.so.3, GNU OpenMP), unpacked
# by pip into a prefix under the cache, ${XDG_CACHE_HOME:-~/.cache}/kvcomp/onednn-<version>
# ($KVCOMP_ONEDNN_PREFIX). The top-level CMakeLists.txt looks there last (after CMAKE_PREFIX_PATH, a
# PyPI oneDNN of the Python environment and the system's), so scripts/build.sh and the other scripts
# need no flag; anyone else passes -DCMAKE_PREFIX_PATH=<that prefix>. Does nothing when the prefix is
# complete. Prints the prefix on stdout. Uses python3's pip, or $PYTHON's.
#
# `pip install --prefix` installs data files (include/, lib/) into the prefix, and is not refused by an
# externally managed interpreter (PEP 668): it does not touch the interpreter's own environment.
set -euo pipefail
cd "$(dirname "$0")/.."
version=2023.2.0  # oneDNN 3.2; keep in step with pyproject.toml
prefix=${KVCOMP_ONEDNN_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcomp/onednn-$version}
python=${PYTHON:-python3}

if [ ! -f "$prefix/lib/cmake/dnnl/dnnl-config.cmake" ] || [ ! -e "$prefix/lib/libdnnl.so.3" ]; then
  echo "[kvcomp] installing oneDNN $version from PyPI into $prefix" >&2
  mkdir -p "$(dirname "$prefix")"
  tmp=$(mktemp -d "$prefix.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  "$python" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --no-deps \
    --prefix "$tmp" "onednn-devel-cpu-gomp==$version" "onednn-cpu-gomp==$version" >&2
  rm -rf "$prefix"
  mv "$tmp" "$prefix"  # complete or absent: a run cut short leaves only the temporary folder
  trap - EXIT
fi
echo "$prefix"
