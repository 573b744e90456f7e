#!/usr/bin/env bash
# Runs on the GPU machine from the project root: unpack the Debian packages and oneDNN wheels that
# scripts/device/prepare.sh put in .device/debs and .device/wheels, configure with the CUDA backend required, build
# (incrementally: build-gpu stays while the machine is warm), then run ctest so that its summary is
# printed before a deadline. scripts/device/gpu-session.sh calls it once per phase.
#
# Usage: bash scripts/device/on-device.sh [--build-only] [ctest arguments, e.g. -L cuda]
#        (prepare.sh also copies it to .device/on-device.sh, the name the shared notes use)
# Environment:
#   DEVICE_DIR     the folder holding debs/ (default ./.device)
#   LOG_DIR        where the logs go (default $OUT, else build-gpu/logs)
#   STOP_AFTER     seconds from the start of this script at which ctest stops every test
#                  (ctest --stop-time) so that its summary comes out in time; default 420
#   TEST_JOBS      ctest --parallel (default 8)
#   OMP_NUM_THREADS  OpenMP threads per test process (default 2: TEST_JOBS processes share 16 cores)
#
# KVCOMP_CUDA=ON: a build whose CUDA detection fails stops at configure instead of building the CPU
# product and reporting "No tests were found" as success; --no-tests=error makes an empty selection
# an error too.
set -uo pipefail
start=$(date +%s)
source "$(dirname "$0")/stop-time.sh"
here=${DEVICE_DIR:-$PWD/.device}  # the carried packages
build_only=0
if [[ ${1:-} == --build-only ]]; then
  build_only=1
  shift
fi
prefix=$here/prefix
mkdir -p "$prefix"
if [[ ! -e $prefix/.unpacked ]]; then
  for f in "$here"/debs/*.deb; do dpkg -x "$f" "$prefix"; done
  # PyPI's oneDNN wheels: their <name>.data/data/ tree (include/, lib/) into $prefix/onednn.
  python3 - "$prefix/onednn" "$here"/wheels/*.whl <<'PY'
import os, shutil, sys, zipfile
dest = sys.argv[1]
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if len(parts) > 2 and parts[0].endswith(".data") and parts[1] == "data" and parts[-1]:
                out = os.path.join(dest, *parts[2:])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(name) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
PY
  touch "$prefix/.unpacked"
fi
export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu:$prefix/onednn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
out=${LOG_DIR:-${OUT:-build-gpu/logs}}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
# Configured every time (seconds when nothing changed), so that a build-gpu left by an older script
# with KVCOMP_CUDA=AUTO is turned into one that requires the backend.
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_PREFIX_PATH="$prefix/usr;$prefix/onednn" >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
grep -h "kvcomp: CUDA backend" "$out/configure.log" | tail -1
cmake --build build-gpu --parallel "$(nproc)" >"$out/build.log" 2>&1 ||
  { grep -m20 -E "error|FAILED" "$out/build.log"; exit 1; }
echo "[on-device] built in $(($(date +%s) - start)) s"
((build_only)) && exit 0
stop_after=${STOP_AFTER:-420}
left=$((stop_after - ($(date +%s) - start)))
((left > 30)) || { echo "[on-device] no time left for tests ($left s)"; exit 1; }
stop=$(ctest_stop_time "$left")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
echo "[on-device] ctest $* (stop at $stop, ${TEST_JOBS:-8} jobs, $OMP_NUM_THREADS OpenMP threads each)"
# The backstop timeout only fires if ctest itself ignores its stop time.
timeout $((left + 45)) ctest --test-dir build-gpu --parallel "${TEST_JOBS:-8}" --no-tests=error --stop-time "$stop" \
  --output-on-failure "$@" >"$out/ctest.log" 2>&1
rc=$?
grep -E "tests passed|tests failed|\*\*\*|Failed|SEGFAULT|Not Run|Timeout" "$out/ctest.log" | tail -30
echo "[on-device] ctest rc=$rc after $(($(date +%s) - start)) s"
exit $rc
