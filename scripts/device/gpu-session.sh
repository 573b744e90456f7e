#!/usr/bin/env bash
# The prepared runs for the GPU machine. Device time is short (15 minutes a task, start-up included;
# one `run` call at most 600 s): each phase below is one call that ends with its summary well inside
# its limit (every ctest has a stop time, every other step a timeout). From the repository root there,
# with .device/ carried (scripts/device/prepare.sh makes it here: the Debian .debs):
#
#   call  phase      command time  what
#   1     cuda       <= 480 s      configure (KVCOMP_CUDA=ON, sm_90 only) and build build-gpu (~3 min on
#                                  16 cores), ctest -L cuda without the sanitizers and CudaLarge
#                                  (8 processes x 2 OpenMP threads, stop at 420 s), `kvcomp info`
#   2     measure    <= 400 s      what only a GPU can answer (docs/cuda-design.md, "First GPU run"):
#                                  the demo at H = 4096 on the GPU with the tensor-core products and with
#                                  the split-K switch (KVCOMP_KERNELS=+splitk), the bench at H = 20
#                                  and 4096 (cuBLASLt's algorithm for odd pitches, time per call)
#   3     sanitize   <= 420 s      compute-sanitizer memcheck and racecheck over the small sweep, one
#                                  process each (stop at 400 s)
#   4     large      <= 420 s      CudaLarge (a 4.2 GB state cache; GPU against the CPU backend), one
#                                  process with 16 OpenMP threads (stop at 330 s), then
#                                  `kvcomp demo --device cuda` (T = 65536, against the float64 oracle)
#   5     python     <= 480 s      ctest -L 'python|cli' (their CUDA cases), the SIGSEGV probe
#   6     bench      <= 420 s      issue 12's figures: `kvcomp bench --device cuda` and
#                                  bench/torch_baselines.py
#   7     amx        <= 500 s      issue 17's CPU targets on this machine's host CPU, which has AMX-BF16
#                                  (the CPU they are set for; no development VM has it):
#                                  scripts/device/cpu-targets.sh, 2 threads on two physical cores
#   8     cpu        <= 480 s      the C++ CPU suites (ctest -LE 'cuda|python|cli') on that CPU: the AMX
#                                  product path for real, where every other run emulates its packing
#                                  (the Python suite's CPU cases run there in call 5)
#
#   LOG_DIR=$OUT bash scripts/device/gpu-session.sh <phase>
#
# In that order: a session with 15 minutes gets calls 1 and 2 (and 3 if start-up was quick); the
# others go to the next session. Calls 7 and 8 need no GPU and stand apart from issue 19's order.
# Every phase but cuda builds incrementally (a no-op while the machine stays warm; a fresh machine
# rebuilds, ~3 min, inside the same limit). Logs and a summary go to $LOG_DIR (default
# build-gpu/logs); keep them in the repository (docs/device-runs/<date>/).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-cuda}
out=${LOG_DIR:-${OUT:-build-gpu/logs}}
mkdir -p "$out"
start=$(date +%s)
stamp() { echo "[gpu-session $phase] $(($(date +%s) - start)) s: $*" | tee -a "$out/gpu-session.txt"; }
ondev=scripts/device/on-device.sh
export LD_LIBRARY_PATH=$PWD/.device/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
kvcomp=build-gpu/cli/kvcomp
case $phase in
  cuda)
    stamp "build, then ctest -L cuda without the sanitizers and the large cases"
    LOG_DIR=$out STOP_AFTER=420 TEST_JOBS=8 OMP_NUM_THREADS=2 timeout 470 bash $ondev -L cuda \
      -E 'sanitizer|CudaLarge'
    stamp "on-device.sh rc=$?"
    timeout 10 $kvcomp info | tee "$out/info.txt"
    ;;
  measure)
    stamp "build (incremental)"
    LOG_DIR=$out timeout 200 bash $ondev --build-only >/dev/null || { stamp "build failed"; exit 1; }
    for products in tensor splitk; do
      kernels=""; [ "$products" = splitk ] && kernels=+splitk
      KVCOMP_KERNELS=$kernels timeout 80 $kvcomp demo --device cuda --hidden 4096 --tokens 16384 \
        --repeat 3 >"$out/demo-h4096-$products.txt" 2>&1
      stamp "demo --device cuda H=4096 products=$products rc=$?"
      tail -22 "$out/demo-h4096-$products.txt"
    done
    for h in 20 4096; do
      timeout 60 $kvcomp bench --device cuda --hidden $h --tokens 16384 --repeat 5 >"$out/bench-h$h.txt" 2>&1
      stamp "bench --device cuda H=$h rc=$?"
      tail -8 "$out/bench-h$h.txt"
    done
    ;;
  sanitize)
    stamp "compute-sanitizer memcheck and racecheck"
    LOG_DIR=$out STOP_AFTER=400 TEST_JOBS=2 OMP_NUM_THREADS=4 timeout 450 bash $ondev -R '^cuda\.sanitizer_'
    stamp "on-device.sh rc=$?"
    ;;
  large)
    stamp "CudaLarge"
    LOG_DIR=$out STOP_AFTER=330 TEST_JOBS=1 OMP_NUM_THREADS=16 timeout 380 bash $ondev -R 'CudaLarge'
    stamp "on-device.sh rc=$?"
    timeout 60 $kvcomp demo --device cuda --tokens 65536 --repeat 5 >"$out/demo-cuda.txt" 2>&1
    stamp "demo --device cuda rc=$?"
    grep -E "result|forward|backward" "$out/demo-cuda.txt"
    ;;
  python)
    stamp "ctest -L 'python|cli'"
    LOG_DIR=$out STOP_AFTER=330 TEST_JOBS=8 OMP_NUM_THREADS=2 timeout 380 bash $ondev -L 'python|cli' \
      -E python_pip_install
    stamp "on-device.sh rc=$?"
    timeout 90 bash scripts/device/probe-python-crash.sh "$out"
    stamp "probe rc=$?"
    ;;
  bench)
    stamp "build (incremental)"
    LOG_DIR=$out timeout 200 bash $ondev --build-only >/dev/null || { stamp "build failed"; exit 1; }
    timeout 120 $kvcomp bench --device cuda --tokens 16384 65536 --repeat 10 >"$out/bench-cuda.txt" 2>&1
    stamp "kvcomp bench --device cuda rc=$?"
    cat "$out/bench-cuda.txt"
    PYTHONPATH=$PWD/build-gpu/python timeout 90 python3 bench/torch_baselines.py --tokens 16384 65536 \
      --json "$out/baselines.json" >"$out/baselines.txt" 2>&1
    stamp "baselines rc=$?"
    tail -12 "$out/baselines.txt"
    ;;
  amx)
    stamp "build (incremental)"
    LOG_DIR=$out timeout 200 bash $ondev --build-only >/dev/null || { stamp "build failed"; exit 1; }
    timeout 290 bash scripts/device/cpu-targets.sh build-gpu "$out"
    stamp "cpu-targets.sh rc=$?"
    ;;
  cpu)
    stamp "ctest of the C++ CPU suites"
    LOG_DIR=$out STOP_AFTER=420 TEST_JOBS=8 OMP_NUM_THREADS=2 timeout 470 bash $ondev -LE 'cuda|python|cli'
    stamp "on-device.sh rc=$?"
    ;;
  *)
    echo "usage: gpu-session.sh cuda|measure|sanitize|large|python|bench|amx|cpu" >&2
    exit 2
    ;;
esac
cat "$out/gpu-session.txt"
