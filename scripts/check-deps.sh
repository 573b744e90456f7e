#!/usr/bin/env bash
# The guard against relying on a package installed by hand (scripts/check_deps.py): the configure and
# the finished build in ./build may use development files of Debian packages that
# scripts/install-deps.sh installs, and of no other. From the same observation, libdnnl-dev taken off
# the list must be caught, which shows that the check sees what the build uses.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" scripts/check_deps.py build --self-check libdnnl-dev -- -DCMAKE_BUILD_TYPE=Release
