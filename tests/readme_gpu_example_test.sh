#!/usr/bin/env bash
# README.md's GPU embedding example: the first ```cpp block after <!-- gpu-embedding-example -->,
# taken verbatim, so that what the README shows is what compiles and runs.
#   tests/readme_gpu_example_test.sh --extract README.md OUT.cc
#     writes the block to OUT.cc (the build compiles it: CMakeLists.txt's kvtier_readme_gpu_example);
#     fails when the README has no such block.
#   tests/readme_gpu_example_test.sh BINARY
#     runs the program built from it and checks its one line of output: every step and layer ran,
#     chunks were retrieved, every output is within V's range and the first step gave V exactly.
#     Exit 77 (skip) when the program says there is no CUDA device; scripts/gpu_emulated.sh, which
#     runs it on the emulated device, counts that as a failure.
set -euo pipefail
if [[ ${1:-} == --extract ]]; then
  readme=${2:?usage: --extract README.md OUT.cc}; out=${3:?usage: --extract README.md OUT.cc}
  awk '/<!-- gpu-embedding-example -->/ {m=1; next}
       m && !c && /^```cpp$/ {c=1; next}
       c && /^```/ {exit}
       c {print}' "$readme" > "$out.tmp"
  if [[ ! -s $out.tmp ]]; then
    rm -f "$out.tmp"
    echo "$readme has no \`\`\`cpp block after <!-- gpu-embedding-example -->" >&2; exit 1
  fi
  mv "$out.tmp" "$out"
  exit 0
fi
binary=${1:?usage: tests/readme_gpu_example_test.sh BINARY | --extract README.md OUT.cc}
if [[ ! -x $binary ]]; then
  echo "readme-gpu-example: no program at $binary (built as kvtier_readme_gpu_example where CUDA is)" >&2; exit 1
fi
rc=0
output=$("$binary" 2>&1) || rc=$?
echo "$output"
if [[ $rc -ne 0 ]] && grep -q 'Unavailable' <<< "$output"; then
  echo "readme-gpu-example: SKIPPED: no CUDA device"; exit 77
fi
re='^([0-9]+) steps x ([0-9]+) layers on the GPU: ([0-9]+) chunks retrieved, ([0-9]+) host waits, ([0-9]+) outputs outside \[-1, 1\], ([0-9]+) first-step outputs not V$'
line=$(tail -n 1 <<< "$output")
if [[ $rc -ne 0 || ! $line =~ $re ]]; then
  echo "readme-gpu-example: FAILED: exit status $rc, last line not the expected summary" >&2; exit 1
fi
steps=${BASH_REMATCH[1]} chunks=${BASH_REMATCH[3]} waits=${BASH_REMATCH[4]}
outside=${BASH_REMATCH[5]} first=${BASH_REMATCH[6]}
bad=()
(( steps > 0 )) || bad+=("no step ran")
(( chunks > 0 )) || bad+=("no chunk was retrieved")
(( waits > 0 )) || bad+=("no host wait counted (AttendDevice downloads the queries)")
(( outside == 0 )) || bad+=("$outside outputs outside V's range")
(( first == 0 )) || bad+=("$first first-step outputs are not V of token 0")
if (( ${#bad[@]} )); then
  printf 'readme-gpu-example: FAILED: %s\n' "${bad[@]}" >&2; exit 1
fi
echo "readme-gpu-example: OK"
