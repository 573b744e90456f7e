#!/usr/bin/env bash
# Python 3.12 (part of the test command, scripts/test.sh): `pip install .` of the repository into a
# clean Python 3.12 venv, with the Python stack of the GPU machine (torch 2.11.0, numpy 2.5.2; torch
# from PyPI is the CUDA 13.0 build, about 4.7 GB in the venv, which runs on the CPU here), then the
# whole Python test suite against that install, then `pip uninstall` (tests/python/pip_install_check.py).
# The interpreter: $KVCOMP_PYTHON312, else python3.12 on PATH, else pyenv's newest 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${KVCOMP_PYTHON312:-}
if [ -z "$py" ]; then
  py=$(command -v python3.12 || true)
fi
if [ -z "$py" ] && command -v pyenv >/dev/null 2>&1; then
  v=$(pyenv versions --bare | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -1 || true)
  [ -n "$v" ] && py="$(pyenv root)/versions/$v/bin/python3.12"
fi
if [ -z "$py" ] || ! "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "[kvcomp] Python 3.12 run SKIPPED: no Python 3.12 interpreter (set KVCOMP_PYTHON312)" >&2
  exit 0
fi
tests=$(cd tests/python && ls test_*.py)
# shellcheck disable=SC2086
python3 tests/python/pip_install_check.py --python "$py" --modes regular \
  --deps "torch==2.11.0 numpy==2.5.2 pytest hypothesis" --tests $tests
echo "[kvcomp] Python 3.12 run passed ($("$py" --version))"
