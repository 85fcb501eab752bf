#!/usr/bin/env bash
# Installs the built library into a fresh prefix and builds, against that prefix
# alone, a consumer whose source is exactly the README's "Embedding kvtier"
# example; then runs it. Fails if find_package(kvtier) or the example breaks.
#   tests/install_consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd); src=$(cd "$2" && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
mkdir -p "$work/consumer"
# The first ```cpp block after the marker in the README, verbatim.
awk '/<!-- embedding-example -->/ {m=1; next}
     m && !c && /^```cpp/ {c=1; next}
     c && /^```/ {exit}
     c {print}' "$src/README.md" > "$work/consumer/main.cc"
if [ ! -s "$work/consumer/main.cc" ]; then
  echo "README.md has no \`\`\`cpp block after <!-- embedding-example -->" >&2; exit 1
fi
cat > "$work/consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.22)
project(kvtier_consumer CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(kvtier 0.1 REQUIRED)
add_executable(consumer main.cc)
target_link_libraries(consumer PRIVATE kvtier::kvtier)
CM
# Nothing of the source tree on the include path: only the install prefix.
cmake -S "$work/consumer" -B "$work/consumer/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
if grep -q -- "-I$src" "$work/consumer/build/compile_commands.json" 2>/dev/null; then
  echo "the consumer was compiled against the source tree" >&2; exit 1
fi
out=$("$work/consumer/build/consumer")
echo "$out"
# The example prints how many chunks retrieval brought back; it must be some.
echo "$out" | grep -Eq 'retrieved [1-9][0-9]* chunks' || { echo "unexpected output" >&2; exit 1; }
