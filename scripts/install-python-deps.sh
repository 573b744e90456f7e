#!/usr/bin/env bash
# Installs what the CLI end-to-end test (tests/cli) needs: numpy and pytest, and nothing else.
# Does nothing when both are already importable by python3 (or $PYTHON).
#
# Uses pip first. A Debian 12 system interpreter refuses pip installs (PEP 668,
# "externally-managed-environment") and may have no pip at all; the same two packages then come
# from Debian (python3-numpy, python3-pytest).
set -euo pipefail

python=${PYTHON:-python3}
have_deps() { "$python" -c "import numpy, pytest" >/dev/null 2>&1; }

have_deps && exit 0

echo "[kvcomp] installing Python packages: numpy pytest"
if "$python" -m pip install --quiet numpy pytest && have_deps; then
  exit 0
fi

if command -v apt-get >/dev/null 2>&1 && [ "$(command -v "$python")" = /usr/bin/python3 ]; then
  echo "[kvcomp] pip could not install them; installing Debian packages python3-numpy python3-pytest"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends python3-numpy python3-pytest
  have_deps && exit 0
fi

echo "[kvcomp] could not install numpy and pytest for $python; the CLI end-to-end test will be skipped" >&2
exit 1
