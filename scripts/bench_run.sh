#!/usr/bin/env bash
# `kvtier run` step time against full attention at 32K, 128K and 512K tokens,
# on the same data in the same process (the ratio is what to read: absolute
# times on shared machines are noise). Usage: scripts/bench_run.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
out=$build/bench-run
mkdir -p "$out"
printf '%-9s %12s %14s %9s %10s %12s %14s\n' context step_ms full_step_ms speedup needle_hit peak_rss_MiB rss_bound_MiB
for ctx in ${KVTIER_BENCH_CONTEXTS:-32768 131072 524288}; do
  rm -rf "$out/data-$ctx"
  # Warm tier a quarter of the context's KV (8 layers x 2 kv heads x 64 x f16 x K,V = 4 KiB/token).
  warm=$(( ctx * 4096 / 4 ))
  "$build/kvtier" run --quiet --context "$ctx" --warm-bytes "$warm" --data-dir "$out/data-$ctx" \
    --json "$out/run-$ctx.json" > "$out/run-$ctx.txt"
  /usr/bin/python3 - "$out/run-$ctx.json" "$ctx" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); t = r["time"]; m = r["memory"]
print(f'{sys.argv[2]:<9} {t["step_ms"]:12.2f} {t["full_attention_step_ms"]:14.2f} {t["speedup_vs_full"]:8.1f}x '
      f'{r["quality"]["needle_hit_rate"]:10.3f} {m["peak_rss_bytes"]/2**20:12.1f} {m["rss_bound_bytes"]/2**20:14.1f}')
PY
  rm -rf "$out/data-$ctx"
done
