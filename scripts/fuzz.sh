#!/usr/bin/env bash
# Runs every libFuzzer target of a KVTIER_FUZZ build for a bounded time, two at a time.
#   scripts/fuzz.sh BUILD_DIR SECONDS_PER_TARGET
# Each target starts from its committed seed corpus (tests/fuzz/corpus/<target>/, read
# only) plus a scratch corpus under BUILD_DIR/fuzz-work/<target>/ where libFuzzer keeps
# the inputs it finds. A crash, a sanitizer report, a leak, an input that takes over 10 s
# or 2 GiB fails the run; the input is saved there as crash-*/timeout-*/oom-* and the log
# is printed. Reproduce with: BUILD_DIR/tests/fuzz/fuzz_<target> <that file>.
set -uo pipefail
build=$1 seconds=$2
src=$(cd "$(dirname "$0")/.." && pwd)
targets=(safetensors trace cold_value compilerkv_tables factory_strings)
run_one() {
  local t=$1 work="$build/fuzz-work/$1"
  rm -rf "$work" && mkdir -p "$work/corpus"
  if "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$work/" "$work/corpus" "$src/tests/fuzz/corpus/$t" > "$work/log" 2>&1; then
    echo "fuzz_$t: $(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$work/log" | grep -o '[0-9]*$') inputs" \
         "in ${seconds} s, $(ls "$work/corpus" | wc -l) new corpus entries, no finding"
  else
    echo "fuzz_$t: FAILED (log and input in $work)"; tail -n 60 "$work/log"; return 1
  fi
}
export -f run_one
export build seconds src
printf '%s\n' "${targets[@]}" | xargs -P 2 -I{} bash -c 'run_one {}'
