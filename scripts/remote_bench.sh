#!/usr/bin/env bash
# The remote tier (Redis) against redis-benchmark on the same server and against the local
# RocksDB tier, then `kvtier run` with most chunks in Redis against the all-local run, all
# in one go so the ratios compare figures taken side by side. Starts its own redis-server
# on a free loopback port (killed at exit).
#   scripts/remote_bench.sh [BUILD_DIR]     (KVTIER_BENCH_CONTEXT, default 131072 tokens)
# Needs redis-server, redis-benchmark (redis-tools) and the build's kvtier and kvtier_bench.
set -euo pipefail
build=${1:-build}
ctx=${KVTIER_BENCH_CONTEXT:-131072}
work=$(mktemp -d /tmp/kvtier_remote_bench_XXXXXX)   # the server's dir and the stores
out=$build/bench-remote                                # the reports, kept
mkdir -p "$out"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --dir "$work" --save "" --appendonly no \
  --logfile "$work/redis.log" --daemonize no &
redis_pid=$!
trap 'kill $redis_pid 2>/dev/null; wait $redis_pid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
spec="redis://127.0.0.1:$port"

# 1. Chunk throughput: a 16 KiB chunk is a 16420-byte value (28-byte header, 4-byte meta
# length, 4-byte meta in the benchmark); one client, 32 commands per pipeline, as
# PutChunks/GetChunks of 32 send them.
redis-benchmark -p "$port" -t set,get -d 16420 -P 32 -c 1 -n 64000 -r 2048 --csv > "$out/rb.csv"
KVTIER_BENCH_REDIS="$spec" "$build/kvtier_bench" --benchmark_filter='^(RemoteTier|LocalColdTier)/' \
  --benchmark_min_time=2 --benchmark_format=json > "$out/kb.json" 2>/dev/null
redis-cli -p "$port" flushall >/dev/null

# 2. kvtier run: warm tier a quarter of the context's KV; the rest in RocksDB, or in Redis.
warm=$(( ctx * 4096 / 4 ))
"$build/kvtier" run --quiet --context "$ctx" --warm-bytes "$warm" --data-dir "$work/local" \
  --json "$out/local.json" > "$out/local.txt"
# --keep: the run would drop its sequence from Redis at the end, and used_memory below is read after it.
"$build/kvtier" run --quiet --context "$ctx" --warm-bytes "$warm" --data-dir none --remote "$spec" --keep \
  --json "$out/remote.json" > "$out/remote.txt"
mem=$(redis-cli -p "$port" info memory | sed -n 's/^used_memory_human://p' | tr -d '\r')

python3 - "$out" "$ctx" "$mem" <<'PY'
import csv, json, sys
work, ctx, mem = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rb = {row[0].split()[0]: float(row[1]) for row in csv.reader(open(f"{work}/rb.csv")) if row and row[0] != "test"}
kb = {"/".join(b["name"].split("/")[:2]): b["items_per_second"]
      for b in json.load(open(f"{work}/kb.json"))["benchmarks"] if "items_per_second" in b}
print("chunk throughput, 16 KiB chunks, batches of 32 (chunks/s)")
for op, cmd in (("Put", "SET"), ("Get", "GET")):
    r, c, b = kb[f"RemoteTier/{op}"], kb[f"LocalColdTier/{op}"], rb[cmd]
    print(f"  {op}: remote {r:9.0f}  redis-benchmark {cmd} {b:9.0f} (remote/redis-benchmark {r/b:.2f})"
          f"  local RocksDB {c:9.0f} (remote/local {r/c:.2f})")
loc, rem = json.load(open(f"{work}/local.json")), json.load(open(f"{work}/remote.json"))
def line(name, r):
    t, tiers = r["time"], r.get("tiers", {})
    hr = tiers.get("hit_rate", {})
    return (f"  {name:<7} step {t['step_ms']:8.2f} ms (fetch {t['split_ms']['fetch']:.2f}), prefill "
            f"{t['prefill_s']:.1f} s + {t['prefill_drain_s']:.1f} s drain, fetched chunks hot/warm/cold/remote "
            f"{hr.get('hot',0):.2f}/{hr.get('warm',0):.2f}/{hr.get('cold',0):.2f}/{hr.get('remote',0):.2f}, "
            f"needle hit {r['quality']['needle_hit_rate']:.3f}")
print(f"kvtier run --context {ctx} (warm = 1/4 of the context's KV; redis used_memory {mem})")
print(line("local", loc)); print(line("remote", rem))
print(f"  step time remote/local: {rem['time']['step_ms']/loc['time']['step_ms']:.2f}")
PY
