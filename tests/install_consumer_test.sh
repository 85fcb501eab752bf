#!/usr/bin/env bash
# Installs the built library into a fresh prefix and builds, against that prefix
# alone, a consumer whose sources are exactly the README's "Embedding kvtier"
# examples (C++ and C API), plus the C API test program (tests/c_api_test.c) as C99;
# then runs them. Fails if find_package(kvtier), an example or the C API breaks.
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
# The C API's example: the first ```c block after its marker.
awk '/<!-- c-api-example -->/ {m=1; next}
     m && !c && /^```c$/ {c=1; next}
     c && /^```/ {exit}
     c {print}' "$src/README.md" > "$work/consumer/main.c"
if [ ! -s "$work/consumer/main.c" ]; then
  echo "README.md has no \`\`\`c block after <!-- c-api-example -->" >&2; exit 1
fi
cp "$src/tests/c_api_test.c" "$work/consumer/c_api_test.c"
cat > "$work/consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.22)
project(kvtier_consumer C CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(kvtier 0.1 REQUIRED)
add_executable(consumer main.cc)
target_link_libraries(consumer PRIVATE kvtier::kvtier)
# C consumers of kvtier/kvtier_c.h: compiled as C99, linked by the C++ linker (kvtier is C++).
foreach(c consumer_c:main.c c_api_test:c_api_test.c)
  string(REPLACE ":" ";" c "${c}")
  list(GET c 0 name)
  list(GET c 1 file)
  add_executable(${name} ${file})
  target_link_libraries(${name} PRIVATE kvtier::kvtier)
  set_target_properties(${name} PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF
                                           LINKER_LANGUAGE CXX)
  target_compile_options(${name} PRIVATE -Wall -Wextra -Werror)
endforeach()
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
# The C API: the README's C example, then the C API test (with a cold tier).
out=$("$work/consumer/build/consumer_c")
echo "C API example: $out"
echo "$out" | grep -Eq 'retrieved [1-9][0-9]* chunks' || { echo "unexpected output from the C example" >&2; exit 1; }
"$work/consumer/build/c_api_test" "$work/c-api-data" > "$work/c_api_test.log" 2>&1 ||
  { cat "$work/c_api_test.log"; exit 1; }
tail -n 1 "$work/c_api_test.log"
