#!/usr/bin/env bash
# Where a decode step's time goes: runs `kvtier run` at 128K with many decode steps, attaches
# perf to it once the prefill is done (so only the decode steps are sampled), and splits the
# samples into the parts of a step (scripts/profile_step.py: attention, search, allocation,
# fetch, ...).
#   scripts/profile_step.sh [BUILD_DIR] [OUT_DIR]
#   KVTIER_PROFILE_ARGS  kvtier run flags [--context 131072 --decode-steps 400]
#   KVTIER_PROFILE_HZ    perf's sampling rate [499]; more samples resolve the small parts
#   KVTIER_PROFILE_EVENT perf's event [cpu-clock: a VM may refuse the hardware cycles event]
# OUT_DIR (default BUILD_DIR/profile-step) gets perf.data, run.json, run.txt and parts.md.
# Needs linux-perf (Debian's `linux-perf`); at kernel.perf_event_paranoid 2 perf may still
# attach to a process of the same user, which is what this does (`perf record -D` is refused
# there). Samples are CPU time, oneTBB workers included, so the shares are of CPU time, not
# of wall time.
set -euo pipefail
build=${1:-build}
out=${2:-$build/profile-step}
args=${KVTIER_PROFILE_ARGS:---context 131072 --decode-steps 400}
here=$(cd "$(dirname "$0")" && pwd)
[[ -x "$build/kvtier" ]] || { echo "profile_step: no $build/kvtier (cmake --build $build --target kvtier_cli)" >&2; exit 2; }
command -v perf > /dev/null || { echo "profile_step: no perf (apt-get install linux-perf)" >&2; exit 2; }
mkdir -p "$out"
rm -f "$out/run.err"
# shellcheck disable=SC2086
"$build/kvtier" run --no-baseline $args --json "$out/run.json" > "$out/run.txt" 2> "$out/run.err" &
pid=$!
# Progress lines go to a file one per finished phase: the prefill's line means decoding starts
# after the cold tier's drain (a few seconds at 128K).
until grep -q "prefill" "$out/run.err" 2> /dev/null; do
  kill -0 "$pid" 2> /dev/null || { echo "profile_step: kvtier run ended before its prefill did" >&2; cat "$out/run.err" >&2; exit 1; }
  sleep 0.5
done
sleep 3
perf record -e "${KVTIER_PROFILE_EVENT:-cpu-clock}" -F "${KVTIER_PROFILE_HZ:-499}" --call-graph dwarf,16384 -p "$pid" -o "$out/perf.data" 2> "$out/perf.err" || true
wait "$pid"
perf script -i "$out/perf.data" -F tid,ip,sym 2> /dev/null | /usr/bin/python3 "$here/profile_step.py" | tee "$out/parts.md"
