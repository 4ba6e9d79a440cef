# Included by ctest before any test runs (TEST_INCLUDE_FILES, tests/CMakeLists.txt): the suite
# runs the CPU kernels with their compiled-in choices (TREEATTN_TUNE=0), whatever kernel tuning
# cache the user's machine holds, and never writes that cache. The tests of the tuning set a
# scratch cache directory and turn it on themselves. An explicit TREEATTN_TUNE is kept.
if(NOT DEFINED ENV{TREEATTN_TUNE})
  set(ENV{TREEATTN_TUNE} 0)
endif()
