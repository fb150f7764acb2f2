# Installs the build into STAGING, then moves the tree to PREFIX: every
# consumer test then uses an install that lives where it was not installed
# (the CMake package, the pkg-config files and the libraries' run paths are
# relative to their own location).
#   cmake -DBUILD=<build> -DSTAGING=<dir> -DPREFIX=<dir> -P install_and_move.cmake
file(REMOVE_RECURSE ${STAGING} ${PREFIX})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD} --prefix ${STAGING} RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installing ${BUILD} into ${STAGING} failed (${rc})")
endif()
file(RENAME ${STAGING} ${PREFIX})
if(EXISTS ${STAGING})
  message(FATAL_ERROR "${STAGING} still exists after the move")
endif()
message(STATUS "installed into ${STAGING}, moved to ${PREFIX}")
