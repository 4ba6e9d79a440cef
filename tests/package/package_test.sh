#!/usr/bin/env bash
# Installs a treeattn build into a fresh prefix, builds examples/cpp against it with
# find_package(treeattn) and runs it under mpirun. Fails (non-zero, with the step named) when
# the install, an installed header that does not compile on its own (it includes one that is
# not installed), the consumer's configure or build, the check that find_package used the
# install prefix (not the build tree or the source tree), or the example's own oracle check
# fails.
#
# usage: package_test.sh BUILD_DIR EXAMPLE_DIR WORK_DIR CMAKE GENERATOR CXX LINK_FLAGS MPIEXEC...
set -euo pipefail
build=$1 example=$2 work=$3 cmake=$4 generator=$5 cxx=$6 link_flags=$7
shift 7
step() { echo "== $*"; }
fail() { echo "package_test: FAILED: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix

step "install $build into $prefix"
"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log" || {
  cat "$work/install.log"; fail "cmake --install"; }
config=$(find "$prefix" -name treeattnConfig.cmake -print -quit)
[ -n "$config" ] || fail "no treeattnConfig.cmake under $prefix"
[ -f "$prefix/include/treeattn/session.hpp" ] || fail "include/treeattn/session.hpp not installed"
# The installed package must not point back into the build or source tree.
source_dir=$(cd "$example/../.." && pwd)
if grep -rl -e "$build" -e "$source_dir/" "$(dirname "$config")"; then
  fail "installed CMake files refer to the build or source tree (above)"
fi

step "every installed header compiles on its own against $prefix/include"
for h in "$prefix"/include/treeattn/*.hpp; do
  echo "#include <treeattn/$(basename "$h")>" |
    "$cxx" -std=c++20 -fsyntax-only -x c++ -I"$prefix/include" - || fail "$h is not self-contained"
done

step "configure $example against $prefix"
"$cmake" -S "$example" -B "$work/build" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_EXE_LINKER_FLAGS="$link_flags" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
  || fail "configuring the example"
found=$(sed -n 's/^treeattn_DIR:PATH=//p' "$work/build/CMakeCache.txt")
case "$found" in
  "$prefix"/*) echo "find_package(treeattn) used $found" ;;
  *) fail "find_package(treeattn) found '$found', not the install under $prefix" ;;
esac

step "build the example"
"$cmake" --build "$work/build" || fail "building the example"

step "run: $* $work/build/example"
"$@" "$work/build/example" || fail "the example (exit status $?)"
