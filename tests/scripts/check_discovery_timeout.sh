#!/usr/bin/env bash
# Every GoogleTest binary must list its tests within a timeout that a busy build machine meets
# (cmake/testing.cmake says why). Fails if a CMakeLists.txt calls gtest_discover_tests directly, or if a
# discovery script in the build tree carries a timeout under the given floor (the default is 5 s).
# Usage: check_discovery_timeout.sh <source dir> <build dir> <floor seconds>
set -euo pipefail
src=$1 build=$2 floor=$3
bad=0
while IFS= read -r f; do
  echo "direct gtest_discover_tests (use kvcomp_discover_tests): $f"
  bad=1
done < <(grep -rl --include=CMakeLists.txt --include='*.cmake' 'gtest_discover_tests(' "$src" \
           --exclude-dir=build --exclude-dir='build-*' --exclude-dir=.git | grep -v '/cmake/testing.cmake$' || true)
n=0
while IFS= read -r f; do
  n=$((n + 1))
  t=$(sed -n 's/.*TEST_DISCOVERY_TIMEOUT \[==\[\([0-9]*\)\]==\].*/\1/p' "$f")
  if [ -z "$t" ] || [ "$t" -lt "$floor" ]; then
    echo "discovery timeout '${t:-none}' < ${floor} s: $f"
    bad=1
  fi
done < <(find "$build" -name '*_discovery.cmake' -not -path '*/CMakeFiles/*')
if [ "$n" -eq 0 ]; then
  echo "no discovery scripts under $build"
  bad=1
fi
[ "$bad" -eq 0 ] && echo "$n discovery scripts, every timeout >= ${floor} s"
exit "$bad"
