# ctest: install the build tree into a scratch prefix, build
# examples/downstream against it (find_package(kvcomp), kvcomp::aclnn), run
# the result and compare its output with the C++ API's; then compile the C
# ABI test with the pkg-config flags of kvcomp-aclnn and run it.
# Inputs: BUILD_DIR, SOURCE_DIR, WORK_DIR, GENERATOR, MAKE_PROGRAM, CXX, CC, LIBDIR, EXPECTED, and where
# the build found its own dependencies: DEP_PREFIX_PATH ('|'-separated CMAKE_PREFIX_PATH), DNNL_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
string(REPLACE "|" ";" dep_prefix_path "${DEP_PREFIX_PATH}")
set(downstream_prefix_path ${prefix} ${dep_prefix_path})
set(dnnl_hint)
if(DNNL_DIR)
  set(dnnl_hint -Ddnnl_DIR=${DNNL_DIR})
endif()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/downstream -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM} -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX}
    "-DCMAKE_PREFIX_PATH=${downstream_prefix_path}" ${dnnl_hint})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/compressor_grad_example)
set(actual "${run_output}")
run(${EXPECTED} grad)
if(NOT actual STREQUAL run_output)
  message(FATAL_ERROR "downstream build prints\n${actual}\nbut the C++ API gives\n${run_output}")
endif()

find_program(PKG_CONFIG pkg-config)
if(PKG_CONFIG)
  set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
  run(${PKG_CONFIG} --cflags --libs kvcomp-aclnn)
  string(STRIP "${run_output}" flags)
  separate_arguments(flags UNIX_COMMAND "${flags}")
  run(${CC} -std=c11 ${SOURCE_DIR}/aclnn/tests/c_abi_test.c ${flags} -lm -Wl,-rpath,${prefix}/${LIBDIR}
      -o ${WORK_DIR}/c_abi_test)
  run(${WORK_DIR}/c_abi_test)
else()
  message(STATUS "pkg-config not found: the .pc files were not exercised")
endif()
message(STATUS "downstream build and run: identical output\n${actual}")
