#!/usr/bin/env bash
# Installs the build tree to a temporary prefix, builds examples/cmake_consumer against it with
# find_package(tessera), and runs it: the program, and the conformance suites (the installed
# tessera/testing/ headers) on a user's own Storage and Comm runner, and the Format suite on a
# registered format (the public format plug-in API, tessera/format.h). Usage:
# install_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir="$1"
build_dir="$2"
work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-install-XXXXXX")"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/tessera/tesseraConfig.cmake" || {
  echo "no tesseraConfig.cmake installed"; exit 1; }
cmake -S "$source_dir/examples/cmake_consumer" -B "$work/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release > "$work/configure.log"
cmake --build "$work/consumer" > "$work/build.log"
"$work/consumer/consumer" "$work/checkpoint"
test -f "$work/prefix/include/tessera/testing/storage_suite.h" || {
  echo "the conformance suites (tessera/testing/) were not installed"; exit 1; }
test -x "$work/consumer/consumer_suites" || {
  echo "consumer_suites was not built (GoogleTest not found?)"; exit 1; }
for header in format.h format_writer.h format_registry.h testing/format_suite.h; do
  test -f "$work/prefix/include/tessera/$header" || {
    echo "tessera/$header (the format plug-in API, its suite) was not installed"; exit 1; }
done
suite_tests="$("$work/consumer/consumer_suites" --gtest_list_tests)"
grep -q "^Tessera/FormatTest\." <<< "$suite_tests" || {
  echo "consumer_suites registered no Format suite case"; exit 1; }
"$work/consumer/consumer_suites" --gtest_brief=1
