# ctest helper: runs ACTUAL and `EXPECTED EXPECTED_MODE` and fails unless both
# succeed and print the same stdout.
execute_process(COMMAND ${ACTUAL} RESULT_VARIABLE actual_rc OUTPUT_VARIABLE actual ERROR_VARIABLE actual_err)
execute_process(COMMAND ${EXPECTED} ${EXPECTED_MODE} RESULT_VARIABLE expected_rc OUTPUT_VARIABLE expected
                ERROR_VARIABLE expected_err)
if(NOT actual_rc EQUAL 0)
  message(FATAL_ERROR "${ACTUAL} exited with ${actual_rc}\n${actual}${actual_err}")
endif()
if(NOT expected_rc EQUAL 0)
  message(FATAL_ERROR "${EXPECTED} ${EXPECTED_MODE} exited with ${expected_rc}\n${expected}${expected_err}")
endif()
if(NOT actual STREQUAL expected)
  message(FATAL_ERROR "output differs from the C++ API's\n--- ${ACTUAL}:\n${actual}\n--- expected:\n${expected}")
endif()
message(STATUS "identical output:\n${actual}")
