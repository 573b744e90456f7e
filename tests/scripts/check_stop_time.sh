#!/usr/bin/env bash
# ctest_stop_time (scripts/device/stop-time.sh) gives a --stop-time that ctest honours: a scratch project of
# four 3-second tests, run one at a time with a stop 4 s ahead, must not run to the end (about 12 s);
# a --stop-time ctest cannot parse is silently ignored, and all four would pass.
# Usage: check_stop_time.sh CMAKE CTEST
set -euo pipefail
cmake=$1 ctest=$2
source "$(dirname "$0")/../../scripts/device/stop-time.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(stop_time NONE)
enable_testing()
foreach(i 1 2 3 4)
  add_test(NAME sleep${i} COMMAND sleep 3)
endforeach()
CM
"$cmake" -S "$work" -B "$work/b" >/dev/null
stop=$(ctest_stop_time 4)
t0=$(date +%s)
"$ctest" --test-dir "$work/b" --stop-time "$stop" >"$work/log" 2>&1 || true
took=$(($(date +%s) - t0))
cat "$work/log"
passed=$(grep -c 'Passed' "$work/log" || true)
echo "stop time '$stop': $passed of 4 passed in $took s"
if ((passed >= 4 || took >= 11)); then
  echo "FAILED: ctest ignored --stop-time '$stop'"
  exit 1
fi
