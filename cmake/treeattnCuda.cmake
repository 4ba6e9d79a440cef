# CUDA and NCCL for the GPU path: the CUDA executor (src/kernels/cuda), the NCCL communicator
# (src/comm/nccl), their tests (tests/cuda) and the GPU check (tools/gpu_check).
#
#   TREEATTN_WITH_CUDA   AUTO (default): CUDA when nvcc is found; ON: required; OFF: never.
#   TREEATTN_WITH_NCCL   AUTO (default): NCCL when CUDA is on and NCCL is found; ON / OFF.
#   TREEATTN_NCCL_ROOT   where NCCL is (include/nccl.h, lib/libnccl.so*) when it is not in the
#                        CUDA toolkit, NCCL_HOME / NCCL_ROOT or the nvidia-nccl-cu13 Python wheel.
#   CMAKE_CUDA_ARCHITECTURES  default 90: sm_90 machine code (Hopper) plus compute_90 PTX that
#                        the driver compiles for newer GPUs.
#
# Sets TREEATTN_HAVE_CUDA and TREEATTN_HAVE_NCCL (and the imported target treeattn_nccl_lib).
# Without CUDA or NCCL the libraries treeattn_cuda and treeattn_nccl still exist and return
# kUnsupported, so callers (CLI, tests) need no #ifdef.

set(TREEATTN_WITH_CUDA AUTO CACHE STRING "Build the CUDA executor: AUTO (when nvcc is found), ON or OFF")
set_property(CACHE TREEATTN_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(TREEATTN_WITH_NCCL AUTO CACHE STRING "Build the NCCL communicator: AUTO (with CUDA, when NCCL is found), ON or OFF")
set_property(CACHE TREEATTN_WITH_NCCL PROPERTY STRINGS AUTO ON OFF)
set(TREEATTN_NCCL_ROOT "" CACHE PATH "NCCL install prefix (include/nccl.h, lib/libnccl.so*)")

# AUTO, or a CMake boolean.
function(_treeattn_tristate var out)
  string(TOUPPER "${${var}}" v)
  if(v STREQUAL "AUTO")
    set(${out} AUTO PARENT_SCOPE)
  elseif(${var})
    set(${out} ON PARENT_SCOPE)
  else()
    set(${out} OFF PARENT_SCOPE)
  endif()
endfunction()

_treeattn_tristate(TREEATTN_WITH_CUDA _treeattn_cuda_mode)
_treeattn_tristate(TREEATTN_WITH_NCCL _treeattn_nccl_mode)
set(TREEATTN_HAVE_CUDA OFF)
set(TREEATTN_HAVE_NCCL OFF)

if(NOT _treeattn_cuda_mode STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    # CMake < 3.26 knows no C++20 dialect flag for nvcc; libtreeattn's cxx_std_20 then makes any
    # target with CUDA sources that links it fail to generate. nvcc >= 12 takes -std=c++20.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
      list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    endif()
    find_package(CUDAToolkit REQUIRED)
    set(TREEATTN_HAVE_CUDA ON)
    message(STATUS "treeattn: CUDA ${CUDAToolkit_VERSION} (${CMAKE_CUDA_COMPILER}), "
                   "architectures ${CMAKE_CUDA_ARCHITECTURES}")
  elseif(_treeattn_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "TREEATTN_WITH_CUDA=ON but no CUDA compiler was found (put nvcc on PATH "
                        "or set CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "treeattn: no CUDA compiler found; the CUDA executor reports kUnsupported")
  endif()
endif()

if(TREEATTN_HAVE_CUDA AND NOT _treeattn_nccl_mode STREQUAL "OFF")
  set(_nccl_hints ${TREEATTN_NCCL_ROOT} $ENV{NCCL_HOME} $ENV{NCCL_ROOT})
  get_filename_component(_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  list(APPEND _nccl_hints ${_cuda_root} ${CUDAToolkit_LIBRARY_ROOT})
  # The nvidia-nccl-cu13 wheel (pip) keeps include/ and lib/ in the package folder nvidia/nccl.
  find_program(_treeattn_python NAMES python3 python)
  if(_treeattn_python)
    execute_process(
      COMMAND ${_treeattn_python} -c
              "import nvidia.nccl as n; print(list(n.__path__)[0])"
      OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _nccl_wheel_rc)
    if(_nccl_wheel_rc EQUAL 0 AND _nccl_wheel)
      list(APPEND _nccl_hints ${_nccl_wheel})
    endif()
  endif()
  find_path(TREEATTN_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  find_library(TREEATTN_NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  if(TREEATTN_NCCL_INCLUDE_DIR AND TREEATTN_NCCL_LIBRARY)
    file(STRINGS ${TREEATTN_NCCL_INCLUDE_DIR}/nccl.h _nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*" "\\1" _nccl_major "${_nccl_ver}")
    string(REGEX REPLACE ".*NCCL_MINOR ([0-9]+).*" "\\1" _nccl_minor "${_nccl_ver}")
    string(REGEX REPLACE ".*NCCL_PATCH ([0-9]+).*" "\\1" _nccl_patch "${_nccl_ver}")
    set(TREEATTN_NCCL_VERSION "${_nccl_major}.${_nccl_minor}.${_nccl_patch}")
    if(TREEATTN_NCCL_VERSION VERSION_LESS 2.18)
      message(STATUS "treeattn: NCCL ${TREEATTN_NCCL_VERSION} at ${TREEATTN_NCCL_LIBRARY} is "
                     "older than 2.18 (non-blocking communicators, ncclCommSplit); not used")
    else()
      set(TREEATTN_HAVE_NCCL ON)
      add_library(treeattn_nccl_lib UNKNOWN IMPORTED)
      set_target_properties(treeattn_nccl_lib PROPERTIES
        IMPORTED_LOCATION ${TREEATTN_NCCL_LIBRARY}
        INTERFACE_INCLUDE_DIRECTORIES ${TREEATTN_NCCL_INCLUDE_DIR})
      message(STATUS "treeattn: NCCL ${TREEATTN_NCCL_VERSION} (${TREEATTN_NCCL_LIBRARY})")
    endif()
  endif()
  if(NOT TREEATTN_HAVE_NCCL)
    if(_treeattn_nccl_mode STREQUAL "ON")
      message(FATAL_ERROR "TREEATTN_WITH_NCCL=ON but NCCL >= 2.18 was not found (set "
                          "TREEATTN_NCCL_ROOT)")
    endif()
    message(STATUS "treeattn: NCCL not found; the NCCL communicator reports kUnsupported")
  endif()
endif()

# Compile options of our CUDA sources (C++20 comes from libtreeattn's cxx_std_20): host warnings
# as for the C++ sources, and with TREEATTN_WERROR every warning of nvcc (and of the host
# compiler through it) is an error.
set(TREEATTN_CUDA_FLAGS -Xcompiler=-Wall,-Wextra,-Wshadow,-Wno-sign-conversion)
if(TREEATTN_WERROR)
  list(APPEND TREEATTN_CUDA_FLAGS -Werror=all-warnings -Xcompiler=-Werror)
endif()
