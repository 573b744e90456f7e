#!/usr/bin/env bash
# The guard against relying on a package installed by hand (scripts/check_deps.py): the configure and
# the finished build in ./build may use development files of Debian packages that
# scripts/install-deps.sh installs, and of no other, and oneDNN only from the PyPI prefix of
# scripts/install-onednn.sh. From the same observation, nlohmann-json3-dev taken off the list must be
# caught (no other listed package depends on it, as libgmock-dev does on libgtest-dev), which shows
# that the check sees what the build uses.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" scripts/check_deps.py build --self-check nlohmann-json3-dev -- -DCMAKE_BUILD_TYPE=Release
