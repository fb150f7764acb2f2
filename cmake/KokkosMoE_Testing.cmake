# kokkosmoe_add_test(<name> SOURCES <src>... [RANKS <n>...] [LABELS <l>...]
#                    [TIMEOUT <s>] [LIBRARIES <lib>...] [ARGS <arg>...])
#
# Builds one Catch2 executable (MPI test main) and registers it at every rank
# count in RANKS (default 1) as <name>_np<N>, through FindMPI's variables.
# Counts above KokkosMoE_MPIEXEC_MAX_NUMPROCS are skipped. Labels: "unit" for
# single-rank tests, "mpi" otherwise, plus "np<N>" and any LABELS given.

set(KOKKOSMOE_TEST_MAX_TIMEOUT 120)

set(KOKKOSMOE_MPIEXEC_PREFLAGS ${MPIEXEC_PREFLAGS})
execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _kmoe_mpiexec_version ERROR_QUIET)
if(_kmoe_mpiexec_version MATCHES "Open MPI|OpenRTE" AND NOT "--oversubscribe" IN_LIST KOKKOSMOE_MPIEXEC_PREFLAGS)
  list(APPEND KOKKOSMOE_MPIEXEC_PREFLAGS --oversubscribe)
endif()

# Environment of every test: root-friendly OpenMPI whose idle ranks yield the
# core (oversubscribed ranks that spin starve the rank they wait for), one BLAS thread and
# KokkosMoE_TEST_OMP_THREADS OpenMP threads per rank (1 by default: ranks share
# the cores; more on an OpenMP build runs every kernel with real threads, the
# race check of the CPU builds), no Kokkos tools.
set(KokkosMoE_TEST_OMP_THREADS 1 CACHE STRING "OpenMP threads per rank in the tests")
set(KOKKOSMOE_TEST_ENVIRONMENT
  OMPI_ALLOW_RUN_AS_ROOT=1
  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMPI_MCA_rmaps_base_oversubscribe=1
  OMPI_MCA_mpi_yield_when_idle=1
  OPENBLAS_NUM_THREADS=1
  OMP_NUM_THREADS=${KokkosMoE_TEST_OMP_THREADS}
  OMP_PROC_BIND=false
  OMP_WAIT_POLICY=passive)
if(KokkosMoE_SANITIZE)
  # Leaks OpenMPI keeps until exit are suppressed (tests/sanitize/lsan.supp,
  # one comment per entry); everything else fails the test.
  # intercept_tls_get_addr=0: GCC 12's LeakSanitizer takes any dynamic TLS
  # block that starts 16 bytes past a page boundary for one with glibc 2.19's
  # {size, start} header in front of it. Under ASan's allocator that header is
  # allocator metadata, so whether the leak check at exit crashes ("Tracer
  # caught signal 11") depends on where the heap put the TLS block of a
  # dlopen'ed OpenMPI component. The blocks stay reachable through the
  # thread's DTV, which the check still scans.
  list(APPEND KOKKOSMOE_TEST_ENVIRONMENT
    "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_odr_violation=0:fast_unwind_on_malloc=0:intercept_tls_get_addr=0"
    # OpenMPI keeps its components loaded, so that their stacks can be matched.
    "OMPI_MCA_mca_base_component_disable_dlclose=1"
    "LSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/tests/sanitize/lsan.supp:print_suppressions=0"
    "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
endif()

function(kokkosmoe_register_mpi_command name nranks)
  cmake_parse_arguments(ARG "" "TIMEOUT;WORKING_DIRECTORY" "COMMAND;LABELS;PASS_REGULAR_EXPRESSION;FAIL_REGULAR_EXPRESSION;DEPENDS;FIXTURES" ${ARGN})
  if(nranks GREATER KokkosMoE_MPIEXEC_MAX_NUMPROCS)
    return()
  endif()
  set(timeout ${ARG_TIMEOUT})
  if(NOT timeout OR timeout GREATER KOKKOSMOE_TEST_MAX_TIMEOUT)
    set(timeout ${KOKKOSMOE_TEST_MAX_TIMEOUT})
  endif()
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${nranks} ${KOKKOSMOE_MPIEXEC_PREFLAGS}
                   ${ARG_COMMAND} ${MPIEXEC_POSTFLAGS})
  if(ARG_WORKING_DIRECTORY)
    set_tests_properties(${name} PROPERTIES WORKING_DIRECTORY ${ARG_WORKING_DIRECTORY})
  endif()
  set(labels np${nranks} ${ARG_LABELS})
  if(nranks EQUAL 1)
    list(APPEND labels unit)
  else()
    list(APPEND labels mpi)
  endif()
  list(REMOVE_DUPLICATES labels)
  set_tests_properties(${name} PROPERTIES
    PROCESSORS ${nranks}
    TIMEOUT ${timeout}
    LABELS "${labels}"
    SKIP_RETURN_CODE 77
    ENVIRONMENT "${KOKKOSMOE_TEST_ENVIRONMENT}")
  if(ARG_PASS_REGULAR_EXPRESSION)
    set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION "${ARG_PASS_REGULAR_EXPRESSION}")
  endif()
  if(ARG_FAIL_REGULAR_EXPRESSION)
    set_tests_properties(${name} PROPERTIES FAIL_REGULAR_EXPRESSION "${ARG_FAIL_REGULAR_EXPRESSION}")
  endif()
  if(ARG_FIXTURES)
    set_tests_properties(${name} PROPERTIES FIXTURES_REQUIRED "${ARG_FIXTURES}")
  endif()
endfunction()

function(kokkosmoe_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;RANKS;LABELS;LIBRARIES;ARGS" ${ARGN})
  if(NOT ARG_RANKS)
    set(ARG_RANKS 1)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE kokkosmoe_test_main ${ARG_LIBRARIES})
  target_compile_options(${name} PRIVATE ${KOKKOSMOE_WARNINGS})
  foreach(n IN LISTS ARG_RANKS)
    kokkosmoe_register_mpi_command(${name}_np${n} ${n}
      COMMAND $<TARGET_FILE:${name}> ${ARG_ARGS}
      LABELS ${ARG_LABELS}
      TIMEOUT ${ARG_TIMEOUT}
      WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  endforeach()
endfunction()

# kokkosmoe_add_same_digest_test(<name> FIRST <ranks> <command...> SECOND <ranks> <command...>
#                                [KEY <key>] [LABELS <label>...] [FIXTURES_SETUP <f>] [FIXTURES_REQUIRED <f>])
# Runs both commands under mpiexec (in the test binary directory) and passes
# when they print the same <key>=<hex> (default key: output_digest), i.e. the
# same rows or weights, bit for bit (tests/bindings/same_digest.cmake).
function(kokkosmoe_add_same_digest_test name)
  cmake_parse_arguments(ARG "" "KEY;FIXTURES_SETUP;FIXTURES_REQUIRED" "FIRST;SECOND;LABELS" ${ARGN})
  if(NOT ARG_KEY)
    set(ARG_KEY output_digest)
  endif()
  set(np 1)
  foreach(which FIRST SECOND)
    list(POP_FRONT ARG_${which} n)
    if(n GREATER np)
      set(np ${n})
    endif()
    set(cmd ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} ${KOKKOSMOE_MPIEXEC_PREFLAGS} ${ARG_${which}})
    string(REPLACE ";" "|" cmd_${which} "${cmd}")
  endforeach()
  add_test(NAME ${name}
           COMMAND ${CMAKE_COMMAND} "-DFIRST=${cmd_FIRST}" "-DSECOND=${cmd_SECOND}" -DKEY=${ARG_KEY}
                   -P ${PROJECT_SOURCE_DIR}/tests/bindings/same_digest.cmake
           WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  set_tests_properties(${name} PROPERTIES PROCESSORS ${np} TIMEOUT 180 LABELS "${ARG_LABELS};mpi;np${np}"
                       ENVIRONMENT "${KOKKOSMOE_TEST_ENVIRONMENT}" PASS_REGULAR_EXPRESSION "same ${ARG_KEY}")
  if(ARG_FIXTURES_SETUP)
    set_tests_properties(${name} PROPERTIES FIXTURES_SETUP "${ARG_FIXTURES_SETUP}")
  endif()
  if(ARG_FIXTURES_REQUIRED)
    set_tests_properties(${name} PROPERTIES FIXTURES_REQUIRED "${ARG_FIXTURES_REQUIRED}")
  endif()
endfunction()
