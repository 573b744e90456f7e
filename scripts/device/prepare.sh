#!/usr/bin/env bash
# Prepares .device/ for the GPU machine (../shared/device/README.md): the Debian 12 packages and PyPI's
# oneDNN wheels the build needs there (it has no network and no Debian archive) and on-device.sh. .device/ stays out of git.
# Run once per checkout, on this (Debian) machine, from anywhere:
#   bash scripts/device/prepare.sh
# then, with the device tool: LOG_DIR=$OUT bash scripts/device/gpu-session.sh <phase>, carry [".device"]
# (the phases and their order: scripts/device/gpu-session.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF /.device/ .git/info/exclude 2>/dev/null || echo /.device/ >>.git/info/exclude
mkdir -p .device/debs .device/wheels
(cd .device/debs && apt-get update -qq && apt-get download -qq \
  libgtest-dev libgmock-dev googletest libbenchmark-dev libbenchmark1debian nlohmann-json3-dev libcli11-dev)
# oneDNN: PyPI's wheels (as scripts/install-onednn.sh), unpacked there by on-device.sh.
"${PYTHON:-python3}" -m pip download --quiet --no-deps -d .device/wheels \
  onednn-devel-cpu-gomp==2023.2.0 onednn-cpu-gomp==2023.2.0
# The project's own on-device.sh (KVCOMP_CUDA=ON, ctest --no-tests=error, a stop time so that each
# call prints its summary inside its limit), not the shared folder's generic one.
cp scripts/device/on-device.sh scripts/device/stop-time.sh .device/
du -sh .device
