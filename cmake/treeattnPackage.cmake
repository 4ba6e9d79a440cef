# The installable CMake package: `cmake --install <build> --prefix P` puts the static libraries,
# the public headers and a config package into P, and another project then writes
#
#   find_package(treeattn REQUIRED)          # CMAKE_PREFIX_PATH=P, or treeattn_DIR=<build>
#   target_link_libraries(app PRIVATE treeattn::mpi)   # or treeattn::treeattn without MPI
#
# (examples/cpp is such a project; tests/package builds and runs it against an install). Inside
# this build the same names exist as ALIAS targets, so add_subdirectory/FetchContent users
# write the same target_link_libraries line.
#
# Exported: treeattn (EXPORT_NAME treeattn) and treeattn_mpi (EXPORT_NAME mpi). Not exported:
# treeattn_measure (the benchmark harness, probes and the OpenBLAS peer; used by the CLI and
# tests of this project only), so its headers are not installed either.
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(TREEATTN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/treeattn CACHE STRING
    "Where the installed CMake package files go, relative to the install prefix")

set(_treeattn_exported treeattn)
set(TREEATTN_PACKAGE_WITH_MPI OFF)  # read by treeattnConfig.cmake.in
add_library(treeattn::treeattn ALIAS treeattn)
set_target_properties(treeattn PROPERTIES EXPORT_NAME treeattn)
if(TARGET treeattn_mpi)
  list(APPEND _treeattn_exported treeattn_mpi)
  set(TREEATTN_PACKAGE_WITH_MPI ON)
  add_library(treeattn::mpi ALIAS treeattn_mpi)
  set_target_properties(treeattn_mpi PROPERTIES EXPORT_NAME mpi)
endif()

install(TARGETS ${_treeattn_exported} EXPORT treeattnTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# Public headers of the exported libraries: everything in include/treeattn except the headers
# of libraries that are not installed (a header added for such a library goes in this list;
# tests/package compiles every installed header on its own against the install prefix):
#   treeattn_measure: workload, roofline, peer, detect, measure
#   treeattn_model:   gguf, tokenizer, model, generate
#   treeattn_engine:  engine (its scheduler part: treeattn_engine_scheduler), and
#   treeattn_generation: generation (with treeattn_serve, not exported yet)
#   treeattn_verify:  verify (not exported yet)
#   treeattn_cuda, treeattn_nccl (not exported yet): executor_cuda, comm_nccl
#   treeattn_launch (not exported yet): launch, job_status
# and, without MPI, the MPI backend's.
set(_treeattn_not_installed workload roofline peer detect measure gguf tokenizer model generate engine
    generation verify executor_cuda comm_nccl launch job_status)
if(NOT TARGET treeattn_mpi)
  list(APPEND _treeattn_not_installed comm_mpi)
endif()
set(_treeattn_header_excludes)
foreach(h IN LISTS _treeattn_not_installed)
  list(APPEND _treeattn_header_excludes PATTERN ${h}.hpp EXCLUDE)
endforeach()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/treeattn
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.hpp"
        ${_treeattn_header_excludes})

install(EXPORT treeattnTargets NAMESPACE treeattn:: DESTINATION ${TREEATTN_INSTALL_CMAKEDIR})
# The build tree is a package too: find_package(treeattn) with treeattn_DIR=<build dir>.
export(EXPORT treeattnTargets NAMESPACE treeattn::
       FILE ${PROJECT_BINARY_DIR}/treeattnTargets.cmake)

# Two configs from one template: the build tree's (next to its treeattnTargets.cmake) and the
# one that is installed.
set(TREEATTN_CONFIG_FOR_BUILD_TREE ON)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/treeattnConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/treeattnConfig.cmake
                              INSTALL_DESTINATION ${PROJECT_BINARY_DIR})
set(TREEATTN_CONFIG_FOR_BUILD_TREE OFF)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/treeattnConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/package/treeattnConfig.cmake
                              INSTALL_DESTINATION ${TREEATTN_INSTALL_CMAKEDIR})
# 0.x: a minor version change may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/treeattnConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/treeattnConfig.cmake
              ${PROJECT_BINARY_DIR}/treeattnConfigVersion.cmake
        DESTINATION ${TREEATTN_INSTALL_CMAKEDIR})
