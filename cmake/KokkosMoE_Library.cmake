# kokkosmoe_add_library(<name> EXPORT_NAME <n> SOURCES ... PUBLIC_DEPS ... PRIVATE_DEPS ...)
#
# One library per top-level folder. Headers of the folder (and its impl/) are
# installed under include/KokkosMoE/, which is also the installed include path.

function(kokkosmoe_add_library name)
  cmake_parse_arguments(ARG "" "EXPORT_NAME" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} ${ARG_SOURCES})
  add_library(KokkosMoE::${ARG_EXPORT_NAME} ALIAS ${name})
  set_target_properties(${name} PROPERTIES EXPORT_NAME ${ARG_EXPORT_NAME} POSITION_INDEPENDENT_CODE ON)
  target_compile_features(${name} PUBLIC cxx_std_17)
  target_compile_options(${name} PRIVATE ${KOKKOSMOE_WARNINGS})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
    $<INSTALL_INTERFACE:${KOKKOSMOE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  file(GLOB _headers ${CMAKE_CURRENT_SOURCE_DIR}/*.hpp)
  file(GLOB _impl_headers ${CMAKE_CURRENT_SOURCE_DIR}/impl/*.hpp)
  install(FILES ${_headers} DESTINATION ${KOKKOSMOE_INSTALL_INCLUDEDIR})
  if(_impl_headers)
    install(FILES ${_impl_headers} DESTINATION ${KOKKOSMOE_INSTALL_INCLUDEDIR}/impl)
  endif()
  install(TARGETS ${name} EXPORT KokkosMoETargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endfunction()
