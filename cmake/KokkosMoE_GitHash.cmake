# Run as a script (cmake -DSOURCE_DIR=... -DGIT=... -DOUTPUT=... -P) at every
# build: writes OUTPUT, a header defining KOKKOSMOE_GIT_HASH as the source
# tree's revision (12 hex digits, "-dirty" with uncommitted changes to
# tracked files; "unknown" outside a git checkout), and rewrites it only
# when that changes, so a commit rebuilds one source file, not the library.
set(hash "unknown")
if(GIT AND EXISTS "${SOURCE_DIR}/.git")
  execute_process(COMMAND "${GIT}" rev-parse --short=12 HEAD
                  WORKING_DIRECTORY "${SOURCE_DIR}"
                  OUTPUT_VARIABLE rev OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE rc ERROR_QUIET)
  if(rc EQUAL 0 AND rev)
    set(hash "${rev}")
    execute_process(COMMAND "${GIT}" diff --quiet HEAD --
                    WORKING_DIRECTORY "${SOURCE_DIR}"
                    RESULT_VARIABLE dirty ERROR_QUIET)
    if(NOT dirty EQUAL 0)
      string(APPEND hash "-dirty")
    endif()
  endif()
endif()
set(text "// Generated at build time by cmake/KokkosMoE_GitHash.cmake.\n#define KOKKOSMOE_GIT_HASH \"${hash}\"\n")
set(old "")
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUTPUT}" "${text}")
endif()
