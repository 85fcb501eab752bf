#!/usr/bin/env bash
# Retrieval overhead (probe + search + allocation) as a share of the decode step,
# by context length and index kind, with the step's ratio to full attention on the
# same data in the same process. Usage: scripts/bench_retrieval.sh [BUILD_DIR]
#   KVTIER_BENCH_CONTEXTS  contexts in tokens (default "32768 131072 1048576")
#   KVTIER_BENCH_CONFIGS   index/allocator pairs (default "Exact:entropy Flat:topk HNSW32:topk")
# The warm tier is a quarter of the context's KV, so long runs spill to RocksDB.
set -euo pipefail
build=${1:-build}
out=$build/bench-retrieval
mkdir -p "$out"
printf '%-8s %-16s %9s %9s %7s %9s %9s %8s %8s %12s\n' context index:alloc step_ms retr_ms share fetch_ms full_ms speedup needle rss/bound_MiB
for ctx in ${KVTIER_BENCH_CONTEXTS:-32768 131072 1048576}; do
  for cfg in ${KVTIER_BENCH_CONFIGS:-Exact:entropy Flat:topk HNSW32:topk}; do
    index=${cfg%%:*}; alloc=${cfg##*:}
    tag="$ctx-${index//[^A-Za-z0-9]/_}-$alloc"
    rm -rf "$out/data-$tag"
    warm=$(( ctx * 4096 / 4 ))  # 8 layers x 2 kv heads x 64 x f16 x (K,V) = 4 KiB per token
    "$build/kvtier" run --quiet --context "$ctx" --warm-bytes "$warm" --index "$index" --alloc "$alloc" \
      --spearman-windows 0 --data-dir "$out/data-$tag" --json "$out/run-$tag.json" > "$out/run-$tag.txt"
    /usr/bin/python3 - "$out/run-$tag.json" "$ctx" "$cfg" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); t = r["time"]; s = t["split_ms"]; m = r["memory"]
retr = s["probe"] + s["search"] + s["alloc"]
print(f'{sys.argv[2]:<8} {sys.argv[3]:<16} {t["step_ms"]:9.2f} {retr:9.2f} {retr / t["step_ms"]:6.0%} '
      f'{s["fetch"]:9.2f} {t["full_attention_step_ms"]:9.2f} {t["speedup_vs_full"]:7.1f}x '
      f'{r["quality"]["needle_hit_rate"]:8.3f} {m["peak_rss_bytes"]/2**20:6.0f}/{m["rss_bound_bytes"]/2**20:.0f}')
PY
    rm -rf "$out/data-$tag"
  done
done
