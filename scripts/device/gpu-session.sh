#!/usr/bin/env bash
# The prepared runs for the GPU machine (device time is short: each phase is one `run` call, under its
# 600 s limit). From the repository root there, with .device/ carried (scripts/device/prepare.sh makes
# it here: the Debian .debs and on-device.sh):
#   LOG_DIR=$OUT bash scripts/device/gpu-session.sh cuda     # then, if time is left:
#   LOG_DIR=$OUT bash scripts/device/gpu-session.sh python   # and then:
#   LOG_DIR=$OUT bash scripts/device/gpu-session.sh bench
# cuda:   .device/on-device.sh builds build-gpu (CUDA backend with the machine's toolkit) and runs the
#         ctest label cuda (the GPU suite, compute-sanitizer memcheck / racecheck, the large cases);
#         then `kvcomp info` and `kvcomp demo --device cuda` (the GPU result against the float64 oracle).
# python: the ctest labels python and cli (their CUDA cases run: torch-op sweep, opcheck,
#         torch.compile, streams, `kvcomp fwd/grad/demo/bench --device cuda`);
#         scripts/device/probe-python-crash.sh (the SIGSEGV of issue "Set-up on a fresh machine").
# bench:  `kvcomp bench --device cuda` (issue 12's figures: each operator against its products) and
#         bench/torch_baselines.py (the products / eager / torch.compile anchors, and kvcomp through
#         Python).
# Each phase rebuilds incrementally (build-gpu is kept while the machine stays warm). Logs and a
# summary go to $LOG_DIR (default build-gpu/logs); keep them in the repository (docs/device-runs/<date>/).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-cuda}
out=${LOG_DIR:-${OUT:-build-gpu/logs}}; mkdir -p "$out"
start=$(date +%s)
stamp() { echo "[gpu-session $phase] $(( $(date +%s) - start )) s: $*" | tee -a "$out/gpu-session.txt"; }
case $phase in
  cuda)
    stamp "on-device build and tests (label cuda)"
    LOG_DIR=$out timeout 450 bash .device/on-device.sh -L cuda
    stamp "on-device.sh rc=$?"
    export LD_LIBRARY_PATH=$PWD/.device/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    build-gpu/cli/kvcomp info | tee "$out/info.txt"
    timeout 90 build-gpu/cli/kvcomp demo --device cuda --tokens 65536 --repeat 5 >"$out/demo-cuda.txt" 2>&1
    stamp "demo --device cuda rc=$?"
    grep -E "result|forward|backward" "$out/demo-cuda.txt"
    ;;
  python)
    stamp "on-device build and tests (labels python, cli)"
    LOG_DIR=$out timeout 400 bash .device/on-device.sh -L 'python|cli' -E python_pip_install
    stamp "on-device.sh rc=$?"
    timeout 120 bash scripts/device/probe-python-crash.sh "$out"
    stamp "probe rc=$?"
    ;;
  bench)
    stamp "build (no tests)"
    LOG_DIR=$out timeout 200 bash .device/on-device.sh -R '^$' >/dev/null
    export LD_LIBRARY_PATH=$PWD/.device/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    timeout 200 build-gpu/cli/kvcomp bench --device cuda --tokens 16384 65536 --repeat 10 \
      >"$out/bench-cuda.txt" 2>&1
    stamp "kvcomp bench --device cuda rc=$?"
    cat "$out/bench-cuda.txt"
    PYTHONPATH=$PWD/build-gpu/python timeout 150 python3 bench/torch_baselines.py --tokens 16384 65536 \
      --json "$out/baselines.json" >"$out/baselines.txt" 2>&1
    stamp "baselines rc=$?"
    tail -12 "$out/baselines.txt"
    ;;
  *)
    echo "usage: gpu-session.sh cuda|python|bench" >&2
    exit 2
    ;;
esac
cat "$out/gpu-session.txt"
