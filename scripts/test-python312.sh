#!/usr/bin/env bash
# Python 3.12 (part of the test command, scripts/test.sh): `pip install .` of the repository into a
# Python 3.12 venv that holds only the Python stack of the GPU machine (torch 2.11.0, numpy 2.5.2; torch
# from PyPI is the CUDA 13.0 build, about 4.7 GB in the venv, which runs on the CPU here), then the
# Python test suite (all files but one, below) against that install, then `pip uninstall`
# (tests/python/pip_install_check.py). The venv is kept under ~/.cache/kvcomp/py312-venv
# ($KVCOMP_PY312_VENV) and reused while the interpreter and the pinned deps are unchanged.
# The interpreter: $KVCOMP_PYTHON312, else pyenv's newest 3.12, else python3.12 on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
# Candidates in order; the first that runs and is 3.12 is taken (pyenv's shim named python3.12 is on
# PATH even when 3.12 is not the selected version, and then refuses to run: hence the check).
candidates=()
[ -n "${KVCOMP_PYTHON312:-}" ] && candidates+=("$KVCOMP_PYTHON312")
if command -v pyenv >/dev/null 2>&1; then
  while read -r v; do candidates+=("$(pyenv root)/versions/$v/bin/python3.12"); done \
    < <(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -rV)
fi
command -v python3.12 >/dev/null 2>&1 && candidates+=("$(command -v python3.12)")
py=
for c in "${candidates[@]}"; do
  if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then py=$c; break; fi
done
if [ -z "$py" ]; then
  echo "[kvcomp] Python 3.12 run SKIPPED: no Python 3.12 interpreter (set KVCOMP_PYTHON312)" >&2
  exit 0
fi
# Every file but test_products.py: which product kernels each KVCOMP_PRODUCTS setting selects, checked
# in child processes, is C++ behaviour that the Python version does not change (the g++ run has it).
# (pytest-xdist was tried here: 2 workers took 140-157 s against 168 s in one process, the tests
# being multi-threaded already.)
tests=$(cd tests/python && ls test_*.py | grep -vx test_products.py)
# The venv with those deps is kept between runs (torch's 4.7 GB took about 110 s to install into each
# fresh one); kvcomp itself is installed, tested and uninstalled in it on every run.
venv=${KVCOMP_PY312_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcomp/py312-venv}
# pip alone provides oneDNN (the build requirement onednn-devel-cpu-gomp, the dependency
# onednn-cpu-gomp, found through libkvcomp's RUNPATH): where root can make a private mount namespace,
# every other copy is hidden in it, Debian's (where a libdnnl-dev is installed) and the prefix of
# scripts/install-onednn.sh, and pip_install_check.py requires the libdnnl.so.3 loaded to be the venv's.
hide=()
if [ "$(id -u)" -eq 0 ] && command -v unshare >/dev/null 2>&1; then
  empty=$(mktemp -d)
  trap 'rmdir "$empty"' EXIT
  hide=(unshare -m bash -euo pipefail -c '
    empty=$1; shift
    for d in /usr/lib/x86_64-linux-gnu/cmake/dnnl /usr/include/oneapi \
             "${XDG_CACHE_HOME:-$HOME/.cache}/kvcomp/onednn-2023.2.0"; do
      [ -d "$d" ] && mount --bind "$empty" "$d"
    done
    exec "$@"' _ "$empty")
else
  echo "[kvcomp] Python 3.12 run: other copies of oneDNN not hidden (needs root and unshare)" >&2
fi
# shellcheck disable=SC2086
env -u LD_LIBRARY_PATH -u CMAKE_PREFIX_PATH -u dnnl_DIR "${hide[@]}" \
  python3 tests/python/pip_install_check.py --python "$py" --modes regular --keep-venv "$venv" \
  --deps "torch==2.11.0 numpy==2.5.2 pytest hypothesis" --tests $tests
echo "[kvcomp] Python 3.12 run passed ($("$py" --version))"
