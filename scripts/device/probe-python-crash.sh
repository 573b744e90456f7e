#!/usr/bin/env bash
# For the GPU machine (issue: SIGSEGV in kvcomp._C.forward on Ubuntu 24.04 / Python 3.12.3 /
# torch 2.11.0+cu130, not reproduced on Debian 12 with the same torch, numpy, nanobind and Python
# minor version, nor under ASan + UBSan or valgrind there). Run after .device/on-device.sh has built
# build-gpu (it configures the Python package for that machine's python3):
#   LOG_DIR=$OUT bash .device/on-device.sh -R python && bash scripts/device/probe-python-crash.sh $OUT
# Writes its logs to the folder given (default build-gpu/logs) and prints a short summary:
#   1. test_bad_inputs.py: every bad input in a child interpreter; a crash names its case;
#   2. test_functional.py with the image's pytest plugins (xdist, cov, timeout, mock, anyio, ...) and
#      with plugin autoloading off: a crash only in the first points at a plugin loaded into the process;
#   3. test_functional with 2 OpenMP threads, with the AVX2 kernels, with oneDNN capped at AVX2;
#   4. the crashing case alone under cuda-gdb (the image has no gdb; cuda-gdb debugs host code too) for
#      a native backtrace of the fault.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build-gpu/logs}; mkdir -p "$out"
export PYTHONPATH=$PWD/build-gpu/python PYTHONFAULTHANDLER=1 PYTHONDONTWRITEBYTECODE=1
py=python3
summary() { printf '%-44s %s\n' "$1" "$2" | tee -a "$out/probe-summary.txt"; }
: >"$out/probe-summary.txt"
$py -c 'import sys, torch, numpy, nanobind; print(sys.version, torch.__version__, numpy.__version__, nanobind.__version__)' \
  >"$out/probe-versions.txt" 2>&1
$py -m pytest -q -p no:cacheprovider tests/python/test_bad_inputs.py >"$out/probe-bad-inputs.log" 2>&1
summary "test_bad_inputs (plugins autoloaded)" "rc=$?"
$py -m pytest -v -p no:cacheprovider tests/python/test_functional.py >"$out/probe-functional.log" 2>&1
summary "test_functional (plugins autoloaded)" "rc=$?"
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $py -m pytest -v -p no:cacheprovider -p hypothesis tests/python/test_functional.py \
  >"$out/probe-functional-noplugins.log" 2>&1
summary "test_functional (no plugin autoload)" "rc=$?"
# Hypotheses that differ between that machine and the ones where it passed: 16 OpenMP threads in the
# earlier forwards of the same process, the AVX-512 kernels (that CPU also has AMX and avx512_fp16,
# which oneDNN may pick), so each is switched off in turn.
for variant in "OMP_NUM_THREADS=2" "KVCOMP_ISA=avx2" "ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2"; do
  env $variant $py -m pytest -q -p no:cacheprovider tests/python/test_functional.py \
    >"$out/probe-functional-${variant%%=*}.log" 2>&1
  summary "test_functional with $variant" "rc=$?"
done
case=$(grep -oE '(fwd|bwd)\.[a-z0-9_]+: crashed' "$out/probe-bad-inputs.log" | head -1 | cut -d: -f1)
if [ -n "$case" ] && command -v cuda-gdb >/dev/null 2>&1; then
  child=$($py - <<'PY'
import sys
sys.path.insert(0, "tests/python")
import test_bad_inputs as t
print(t.CHILD)
PY
)
  printf '%s' "$child" >"$out/probe-child.py"
  (cd tests/python && PYTHONPATH=$PWD:$PYTHONPATH timeout 300 cuda-gdb -batch -ex run -ex bt -ex 'info sharedlibrary' \
    --args "$(command -v $py)" "$out/probe-child.py" "$case") >"$out/probe-gdb-$case.log" 2>&1
  summary "cuda-gdb backtrace of $case" "$out/probe-gdb-$case.log"
fi
