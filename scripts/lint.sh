#!/usr/bin/env bash
# The tree's static checks.
#   scripts/lint.sh format          every C/C++/CUDA source is as .clang-format writes it (fast;
#                                   part of `make test`, hence CI). `make format` rewrites them.
#   scripts/lint.sh tidy BUILD_DIR  .clang-tidy's checks over the library and tool sources, with
#                                   BUILD_DIR's compile_commands.json (`make lint` runs both).
# Exit status 1 names the files that fail.
set -uo pipefail
cd "$(dirname "$0")/.."
FORMAT=${CLANG_FORMAT:-clang-format-14}
TIDY=${CLANG_TIDY:-clang-tidy-14}
# Everything of ours; tests/fixtures holds data, not code.
sources() { git ls-files '*.cc' '*.h' '*.c' '*.cu' '*.cuh' | grep -v '^tests/fixtures/'; }
case "${1:-}" in
  format)
    bad=()
    while read -r f; do
      "$FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
    done < <(sources)
    if ((${#bad[@]})); then
      echo "lint: ${#bad[@]} files differ from .clang-format (make format rewrites them):"
      printf '  %s\n' "${bad[@]}"
      exit 1
    fi
    echo "lint: $(sources | wc -l) files formatted as .clang-format says"
    ;;
  tidy)
    build=${2:?usage: scripts/lint.sh tidy BUILD_DIR}
    [[ -f "$build/compile_commands.json" ]] || { echo "lint: no $build/compile_commands.json (configure first)" >&2; exit 2; }
    # The library and the tools; tests are left out (GoogleTest's macros trip several checks).
    # Only files the build compiles (kernels/cuda's host files exist in CUDA builds only).
    mapfile -t files < <(git ls-files 'kernels/*.cc' 'store/*.cc' 'offload/*.cc' 'retrieval/*.cc' \
                                     'engine/*.cc' 'integration/*.cc' |
                         grep -F -f <(grep -o '"file": *"[^"]*"' "$build/compile_commands.json" |
                                      sed 's/.*"\([^"]*\)"$/\1/' | sed "s|^$PWD/||"))
    printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 4 "$TIDY" -p "$build" --quiet 2> "$build/tidy.log"
    rc=$?
    grep -E 'warning:|error:' "$build/tidy.log" | grep -v 'warnings generated' || true
    ((rc == 0)) && echo "lint: clang-tidy clean over ${#files[@]} files" || { echo "lint: clang-tidy found the above"; exit 1; }
    ;;
  *) echo "usage: scripts/lint.sh format | tidy BUILD_DIR" >&2; exit 2 ;;
esac
