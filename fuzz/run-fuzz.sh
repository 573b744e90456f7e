#!/usr/bin/env bash
# Builds the libFuzzer targets in build-fuzz (clang, ASan + UBSan + coverage
# on the library sources too), replays the committed seed corpora
# (fuzz/corpus/<target>/) as a regression, then fuzzes each target for a
# bounded time (first argument, seconds; default 60). New inputs go to a
# scratch directory, never into the committed corpora; a crash leaves its
# reproducer in build-fuzz/artifacts/ and fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
if ! command -v clang++ >/dev/null 2>&1; then
  echo "[kvcomp] clang++ not found: libFuzzer targets skipped (scripts/install-deps.sh installs clang)" >&2
  exit 1
fi
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCOMP_SANITIZE=fuzzer \
  -DKVCOMP_BUILD_PYTHON=OFF -DKVCOMP_BUILD_TESTS=OFF -DKVCOMP_WERROR=ON >/dev/null
cmake --build build-fuzz --parallel "$(nproc)" --target fuzz_ops fuzz_io
mkdir -p build-fuzz/artifacts
export ASAN_OPTIONS=detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for target in fuzz_io fuzz_ops; do
  bin="build-fuzz/fuzz/$target"
  # Replay: every committed input once.
  "$bin" -rss_limit_mb=4096 -timeout=60 fuzz/corpus/"$target"/*
  # Bounded fuzzing from the seeds, in a scratch corpus.
  scratch="build-fuzz/corpus-$target"
  mkdir -p "$scratch"
  rc=0
  "$bin" -max_total_time="$seconds" -rss_limit_mb=4096 -malloc_limit_mb=2048 -timeout=60 -print_final_stats=1 \
    -artifact_prefix=build-fuzz/artifacts/ "$scratch" fuzz/corpus/"$target" >"build-fuzz/$target.log" 2>&1 || rc=$?
  grep -E '^(stat::number_of_executed_units|==[0-9]+==ERROR|SUMMARY)' "build-fuzz/$target.log" || true
  if [ "$rc" -ne 0 ]; then
    tail -60 "build-fuzz/$target.log"
    echo "[kvcomp] $target failed (exit $rc); reproducer in build-fuzz/artifacts/" >&2
    exit 1
  fi
done
