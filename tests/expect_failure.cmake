# Runs COMMAND (arguments separated by '|') and passes when it exits non-zero and its output
# matches REGEX at least COUNT times (e.g. once per rank).
#   cmake -DCOMMAND=... -DREGEX=... -DCOUNT=N -P expect_failure.cmake
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a failure, the command succeeded:\n${all}")
endif()
string(REGEX MATCHALL "${REGEX}" hits "${all}")
list(LENGTH hits n)
if(n LESS COUNT)
  message(FATAL_ERROR "expected ${COUNT} lines matching '${REGEX}', found ${n} (exit ${rc}):\n${all}")
endif()
message(STATUS "failed as expected (exit ${rc}), ${n} matching lines")
