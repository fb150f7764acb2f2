# Runs two commands (each a |-separated list) and checks that both print the same
# <KEY>=<16 hex digits> (KEY: output_digest unless given): the same rows (or
# weights), bitwise.
#   cmake -DFIRST=<cmd> -DSECOND=<cmd> [-DKEY=weights_digest] -P same_digest.cmake
if(NOT DEFINED KEY)
  set(KEY output_digest)
endif()
foreach(_which FIRST SECOND)
  string(REPLACE "|" ";" _cmd "${${_which}}")
  execute_process(COMMAND ${_cmd} OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${_which} command failed (${_rc}): ${${_which}}\n${_out}\n${_err}")
  endif()
  if(NOT _out MATCHES "${KEY}=([0-9a-f]+)")
    message(FATAL_ERROR "${_which} command printed no ${KEY}:\n${_out}")
  endif()
  set(_digest_${_which} ${CMAKE_MATCH_1})
  message(STATUS "${_which}: ${KEY}=${CMAKE_MATCH_1}")
endforeach()
if(NOT _digest_FIRST STREQUAL _digest_SECOND)
  message(FATAL_ERROR "the ${KEY}s differ: ${_digest_FIRST} and ${_digest_SECOND}")
endif()
message(STATUS "same ${KEY} ${_digest_FIRST}")
