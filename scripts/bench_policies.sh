#!/usr/bin/env bash
# Every scoring policy on the same synthetic data at the same budget (token-level, exact
# fp32 attention): needle retention, attention recall, output error, and each policy's
# scoring time against the attention time of the same step (ratios, same run).
# Usage: scripts/bench_policies.sh [BUILD_DIR]
#   KVTIER_BENCH_POLICY_CONTEXT  context in tokens (default 16384)
#   KVTIER_BENCH_POLICY_SWEEP    budgets per kv head for the sweep (default "512,1024,2048")
set -euo pipefail
build=${1:-build}
out=$build/bench-policies
mkdir -p "$out"
ctx=${KVTIER_BENCH_POLICY_CONTEXT:-16384}
# 160 decode steps: G-KV (s = 128) compresses once more while decoding.
"$build/kvtier" run --quiet --compare-policies --context "$ctx" --decode-steps 160 --kv-budget 1024 \
  --json "$out/policies-$ctx.json" | tee "$out/policies-$ctx.txt"
echo
"$build/kvtier" run --quiet --compare-policies --context 8192 --decode-steps 32 \
  --sweep "${KVTIER_BENCH_POLICY_SWEEP:-512,1024,2048}" --json "$out/sweep-8192.json" | tee "$out/sweep-8192.txt"
