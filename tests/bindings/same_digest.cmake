# Runs two commands (each a |-separated list) and checks that both print the same
# output_digest=<16 hex digits>: the same rows, bitwise.
#   cmake -DFIRST=<cmd> -DSECOND=<cmd> -P same_digest.cmake
foreach(_which FIRST SECOND)
  string(REPLACE "|" ";" _cmd "${${_which}}")
  execute_process(COMMAND ${_cmd} OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${_which} command failed (${_rc}): ${${_which}}\n${_out}\n${_err}")
  endif()
  if(NOT _out MATCHES "output_digest=([0-9a-f]+)")
    message(FATAL_ERROR "${_which} command printed no output_digest:\n${_out}")
  endif()
  set(_digest_${_which} ${CMAKE_MATCH_1})
  message(STATUS "${_which}: output_digest=${CMAKE_MATCH_1}")
endforeach()
if(NOT _digest_FIRST STREQUAL _digest_SECOND)
  message(FATAL_ERROR "the outputs differ: ${_digest_FIRST} and ${_digest_SECOND}")
endif()
message(STATUS "same output_digest ${_digest_FIRST}")
