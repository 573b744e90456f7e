#!/usr/bin/env bash
# The guard against relying on a package installed by hand (scripts/check_deps.py): the configure and
# the finished build in ./build may use development files of Debian packages that
# scripts/install-deps.sh installs, and of no other. Then the same check with libdnnl-dev taken off
# the list must fail, which shows that the check sees what the build uses.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" scripts/check_deps.py build -- -DCMAKE_BUILD_TYPE=Release
if "$python" scripts/check_deps.py build --without libdnnl-dev -- -DCMAKE_BUILD_TYPE=Release 2>/dev/null; then
  echo "[kvcomp] check-deps: with libdnnl-dev off the list the check still passed: it is blind" >&2
  exit 1
fi
echo "[kvcomp] check-deps: self-check passed (libdnnl-dev off the list is caught)"
