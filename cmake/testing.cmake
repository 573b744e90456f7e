# kvcomp_discover_tests(<target> [gtest_discover_tests options...])
#
# Every GoogleTest binary of the project is registered through this function, never through
# gtest_discover_tests directly. Discovery runs the binary once at build time (POST_BUILD) to list its
# tests, and gtest_discover_tests gives that run 5 s by default. In a CUDA build every test binary loads
# libkvcomp with cuBLASLt (hundreds of MiB); on a machine busy compiling, loading it cold took longer than
# 5 s and failed the build (test_io, in a CI run). CMake has no variable for this default, hence the
# function. An explicit DISCOVERY_TIMEOUT in the options overrides this one (the last value wins).
include(GoogleTest)
set(KVCOMP_GTEST_DISCOVERY_TIMEOUT 120 CACHE STRING "Seconds a test binary may take to list its tests at build time")
function(kvcomp_discover_tests target)
  gtest_discover_tests(${target} DISCOVERY_TIMEOUT ${KVCOMP_GTEST_DISCOVERY_TIMEOUT} ${ARGN})
endfunction()
