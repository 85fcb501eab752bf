#!/usr/bin/env bash
# Installs the built library into a fresh prefix and builds, against that prefix
# alone, the README's "Embedding kvtier" example exactly as the README gives it: its
# C++ program and its CMakeLists.txt (find_package and target_link_libraries, nothing
# else: no CMAKE_CXX_STANDARD, the package carries C++20). The same build adds the C API
# example and the C API test program (tests/engine/c_api_test.c) as C99; then runs them. Fails
# if find_package(kvtier), an example or the C API breaks, if the consumer compiles
# against the source tree or the CUDA toolkit's headers, or if it gets KVTIER_HAVE_CUDA
# from a library built without CUDA. Also fails if anything but include/kvtier/*.h is
# installed as a header, if an installed header does not compile alone against the install
# (one that includes a header that is not installed) or names a type no installed header
# defines (tests/public_types_test.sh), or if the two spellings of DType
# (kvtier/types.h and kernels/dtype.h, which must not include each other) differ.
#   tests/install_consumer_test.sh BUILD_DIR SOURCE_DIR [KVTIER_WITH_CUDA: ON|OFF]
set -euo pipefail
build=$(cd "$1" && pwd); src=$(cd "$2" && pwd); with_cuda=${3:-OFF}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
# Exactly the public headers: include/kvtier/*.h, nothing from the layers' folders.
installed=$(cd "$work/prefix/include" && find . -type f | sed 's|^\./||' | sort)
public=$(cd "$src/include" && find kvtier -maxdepth 1 -name '*.h' -type f | sort)
if [ "$installed" != "$public" ]; then
  echo "installed headers differ from include/kvtier/*.h:" >&2
  diff <(echo "$public") <(echo "$installed") >&2 || true
  exit 1
fi
# Each installed header compiles alone with the install prefix as its only include path, so
# none includes an internal header (C++20; the C API's header also as C99).
for h in $installed; do
  echo "#include <$h>" > "$work/alone.cc"
  "${CXX:-c++}" -std=c++20 -fsyntax-only -I "$work/prefix/include" "$work/alone.cc" 2> "$work/alone.log" ||
    { echo "installed header $h does not compile alone:" >&2; cat "$work/alone.log" >&2; exit 1; }
done
# Each installed header names only types the installed headers define (no internal type, not
# even forward-declared): with the compile-alone check above, no internal type reaches an engine.
bash "$src/tests/public_types_test.sh" "$work/prefix/include" > /dev/null
echo '#include <kvtier/kvtier_c.h>' > "$work/alone.c"
"${CC:-cc}" -std=c99 -fsyntax-only -I "$work/prefix/include" "$work/alone.c" ||
  { echo "kvtier/kvtier_c.h does not compile alone as C99" >&2; exit 1; }
dtype_enum() { sed -n '/^#ifndef KVTIER_DTYPE_DEFINED_/,/^#endif/p' "$1"; }
if [ "$(dtype_enum "$src/include/kvtier/types.h")" != "$(dtype_enum "$src/kernels/dtype.h")" ] ||
   [ -z "$(dtype_enum "$src/kernels/dtype.h")" ]; then
  echo "DType is spelled differently in include/kvtier/types.h and kernels/dtype.h" >&2; exit 1
fi
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
# The README's CMakeLists.txt for that program: the first ```cmake block after its marker.
awk '/<!-- embedding-cmake -->/ {m=1; next}
     m && !c && /^```cmake$/ {c=1; next}
     c && /^```/ {exit}
     c {print}' "$src/README.md" > "$work/consumer/CMakeLists.txt"
if ! grep -q 'add_executable(app main.cc)' "$work/consumer/CMakeLists.txt"; then
  echo "README.md has no \`\`\`cmake block building app from main.cc after <!-- embedding-cmake -->" >&2; exit 1
fi
cp "$src/tests/engine/c_api_test.c" "$work/consumer/c_api_test.c"
cat >> "$work/consumer/CMakeLists.txt" <<'CM'
# Appended by the test: C consumers of kvtier/kvtier_c.h, compiled as C99 and linked by the
# C++ linker (kvtier is C++).
enable_language(C)
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
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON > "$work/configure.log" ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
commands="$work/consumer/build/compile_commands.json"
[ -s "$commands" ] || { echo "no $commands" >&2; exit 1; }
if grep -q -- "-I$src" "$commands"; then
  echo "the consumer was compiled against the source tree" >&2; exit 1
fi
# No public header includes a CUDA header: the toolkit's include path is never the consumer's.
cuda_includes=$(grep -Eo -- '-(I|isystem) ?[^ "]*cuda[^ "]*/include' "$commands" | grep -Fv "$work/prefix" |
                sort -u || true)
if [ -n "$cuda_includes" ]; then
  echo "the consumer was compiled with the CUDA toolkit's include path: $cuda_includes" >&2; exit 1
fi
if [ "$with_cuda" != ON ] && grep -q KVTIER_HAVE_CUDA "$commands"; then
  echo "the library was built without CUDA, yet its consumer gets KVTIER_HAVE_CUDA" >&2; exit 1
fi
out=$("$work/consumer/build/app")
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
