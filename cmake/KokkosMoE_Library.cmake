# kokkosmoe_add_library(<name> EXPORT_NAME <n> [DIRS <dir>...] SOURCES ... PUBLIC_DEPS ... PRIVATE_DEPS ...)
#
# One library per floor of the architecture. DIRS are the folders whose
# headers the library owns (default: the current source folder); each is a
# public include directory, and its headers (and impl/ and tpls/ headers) are installed
# under include/KokkosMoE/, which is also the installed include path.
# KOKKOSMOE_LIBRARY_DIRS_<name> records the folders for the layering check.

function(kokkosmoe_add_library name)
  cmake_parse_arguments(ARG "" "EXPORT_NAME" "DIRS;SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  if(NOT ARG_DIRS)
    set(ARG_DIRS ${CMAKE_CURRENT_SOURCE_DIR})
  endif()
  add_library(${name} ${ARG_SOURCES})
  add_library(KokkosMoE::${ARG_EXPORT_NAME} ALIAS ${name})
  set_target_properties(${name} PROPERTIES EXPORT_NAME ${ARG_EXPORT_NAME} POSITION_INDEPENDENT_CODE ON)
  target_compile_features(${name} PUBLIC cxx_std_17)
  target_compile_options(${name} PRIVATE ${KOKKOSMOE_WARNINGS})
  foreach(_dir IN LISTS ARG_DIRS)
    target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${_dir}>)
    file(GLOB _headers ${_dir}/*.hpp)
    file(GLOB _impl_headers ${_dir}/impl/*.hpp)
    file(GLOB _tpls_headers ${_dir}/tpls/*.hpp)
    install(FILES ${_headers} DESTINATION ${KOKKOSMOE_INSTALL_INCLUDEDIR})
    if(_impl_headers)
      install(FILES ${_impl_headers} DESTINATION ${KOKKOSMOE_INSTALL_INCLUDEDIR}/impl)
    endif()
    if(_tpls_headers)
      install(FILES ${_tpls_headers} DESTINATION ${KOKKOSMOE_INSTALL_INCLUDEDIR}/tpls)
    endif()
  endforeach()
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
    $<INSTALL_INTERFACE:${KOKKOSMOE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  set_property(GLOBAL PROPERTY KOKKOSMOE_LIBRARY_DIRS_${ARG_EXPORT_NAME} "${ARG_DIRS}")
  set_property(GLOBAL APPEND PROPERTY KOKKOSMOE_LIBRARIES ${ARG_EXPORT_NAME})
  install(TARGETS ${name} EXPORT KokkosMoETargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endfunction()
