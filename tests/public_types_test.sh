#!/usr/bin/env bash
# The installed headers name only types they define: every class, struct, union or enum an
# installed header names (a forward declaration `class X;`, a nested `struct Impl;`, a
# `friend class X;`, an elaborated `std::unique_ptr<struct X>`) must be defined in one of the
# headers of INCLUDE_DIR/kvtier/. With install_consumer_test.sh's check that each installed
# header compiles alone against the install (so every name it uses is declared there), this
# means an installed header uses no type of the library's internals, not even by pointer.
# The one exception:
#  * the C API's opaque handles (`typedef struct kvtier_store kvtier_store;` in kvtier_c.h):
#    C callers hold them only by pointer, by design.
# Fails naming each header and type.
#   tests/public_types_test.sh INCLUDE_DIR   (the folder that holds kvtier/, source or install)
#   tests/public_types_test.sh --self-test   (the check fails on each kind of leak, passes clean)
set -euo pipefail

# Prints "HEADER NAME def|use" for every class/struct/union/enum name in the headers given,
# comments and string literals removed, template parameter lists skipped.
type_names() {
  perl -0777 -ne '
    my $f = $ARGV;
    s{/\*.*?\*/}{ }gs; s{//[^\n]*}{}g; s{"(?:\\.|[^"\\])*"}{""}g;
    s{template\s*<(?:[^<>]|<[^<>]*>)*>}{ }g;
    while (/\b(?:enum\s+(?:class|struct)|class|struct|union|enum)\s+(?:\[\[\w+\]\]\s+)?([A-Za-z_]\w*)/g) {
      my ($name, $rest) = ($1, substr($_, pos($_), 200));
      my $def = $rest =~ /^\s*(?:final\s*)?(?::[^;{}()]*)?\{/ ? "def" : "use";
      print "$f $name $def\n";
    }' "$@"
}

check() {
  local dir=$1
  local headers names
  mapfile -t headers < <(find "$dir/kvtier" -maxdepth 1 -name '*.h' -type f | sort)
  [ "${#headers[@]}" -gt 0 ] || { echo "no headers in $dir/kvtier" >&2; return 1; }
  names=$(type_names "${headers[@]}")
  local defined
  defined=$(echo "$names" | awk '$3 == "def" {print $2}' | sort -u)
  local bad=0
  while read -r file name kind; do
    [ "$kind" = use ] || continue
    grep -qx "$name" <<< "$defined" && continue
    [[ "$(basename "$file")" == kvtier_c.h && "$name" == kvtier_* ]] && continue
    echo "$file names type $name, which no installed header defines" >&2
    bad=1
  done <<< "$names"
  return "$bad"
}

self_test() {
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  mkdir -p "$work/kvtier"
  # A clean header: definitions, templates, a type named in a comment and a string.
  cat > "$work/kvtier/a.h" <<'H'
#include <memory>
namespace kvtier {
// class Hidden; is only a comment
enum class Kind : int { kA };
template <class T, typename U = std::unique_ptr<T>> class [[nodiscard]] Box { T t; };
struct Pod { int x; };
class Outer final : public Pod {
  struct Inner { int y; };
  std::unique_ptr<Inner> inner;
  const char* text = "struct Quoted;";
};
}  // namespace kvtier
H
  check "$work" || { echo "self-test: a clean header was refused" >&2; return 1; }
  local leak
  for leak in 'class Internal;' 'struct Outer2 { class Impl; std::unique_ptr<Impl> impl; };' \
              'struct Holder { std::unique_ptr<struct Hidden> h; };' 'struct F { friend class Peer; };'; do
    echo "namespace kvtier { $leak }" > "$work/kvtier/b.h"
    if check "$work" 2> /dev/null; then
      echo "self-test: the check passed a header with: $leak" >&2
      return 1
    fi
  done
  rm "$work/kvtier/b.h"
  echo "self-test: the check refuses each kind of leak and passes a clean header"
}

if [ "${1:-}" = --self-test ]; then
  self_test
else
  check "$(cd "$1" && pwd)"
  echo "the installed headers name only types they define"
fi
