#!/usr/bin/env bash
# One prepared run for the GPU machine (device time is short: everything in one call). From the
# repository root there, with .device/ carried (../shared/device/README.md: the Debian .debs and
# on-device.sh):
#   LOG_DIR=$OUT bash scripts/device/gpu-session.sh
# 1. .device/on-device.sh: unpack the .debs, configure (CUDA backend ON with the machine's toolkit),
#    build into build-gpu, run the cuda and python ctest labels;
# 2. scripts/device/probe-python-crash.sh: the SIGSEGV of issue "Set-up on a fresh machine" (names
#    the case, plugins on/off, a cuda-gdb backtrace);
# 3. bench/torch_baselines.py: issue 12's anchor table (products, eager, torch.compile) on the H200.
# Logs and a summary go to $LOG_DIR (default build-gpu/logs); keep them in the repository
# (docs/device-runs/<date>/).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${LOG_DIR:-${OUT:-build-gpu/logs}}; mkdir -p "$out"
start=$(date +%s)
stamp() { echo "[gpu-session] $(( $(date +%s) - start )) s: $*" | tee -a "$out/gpu-session.txt"; }
stamp "on-device build and tests (labels cuda, python)"
LOG_DIR=$out timeout 420 bash .device/on-device.sh -L 'cuda|python' -E python_pip_install
stamp "on-device.sh rc=$?"
timeout 240 bash scripts/device/probe-python-crash.sh "$out"
stamp "probe rc=$?"
PYTHONPATH=$PWD/build-gpu/python timeout 300 python3 bench/torch_baselines.py --tokens 16384 65536 \
  --json "$out/baselines.json" >"$out/baselines.txt" 2>&1
stamp "baselines rc=$?"
tail -12 "$out/baselines.txt"
cat "$out/gpu-session.txt"
