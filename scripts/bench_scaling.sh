#!/usr/bin/env bash
# `kvtier run` by context length: step time, its ratio to full attention (measured in the same
# process on the same queries), needle hit rate, peak RSS and the retrieval index's bytes, each
# context run RUNS times; writes the median and the range of every figure to a table and a plot.
#   scripts/bench_scaling.sh [BUILD_DIR] [OUT_DIR]
#   KVTIER_BENCH_CONTEXTS  contexts in tokens [32768 131072 524288 1048576]
#   KVTIER_BENCH_RUNS      runs per context [3]
#   KVTIER_BENCH_ARGS      extra `kvtier run` flags (e.g. "--preset infllm")
# OUT_DIR (default BUILD_DIR/bench-scaling) gets run-CTX-N.json, scaling.md, scaling.json and
# scaling.png (the plot needs matplotlib: Debian's python3-matplotlib, scripts/deps.sh python).
# The 1M runs take most of the time: full attention over 1M tokens is the baseline of the ratio.
set -euo pipefail
build=${1:-build}
out=${2:-$build/bench-scaling}
runs=${KVTIER_BENCH_RUNS:-3}
contexts=${KVTIER_BENCH_CONTEXTS:-32768 131072 524288 1048576}
[[ -x "$build/kvtier" ]] || { echo "bench_scaling: no $build/kvtier (build it: cmake --build $build --target kvtier_cli)" >&2; exit 2; }
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "bench_scaling: KVTIER_BENCH_RUNS must be a positive integer, got '$runs'" >&2; exit 2; }
mkdir -p "$out"
data=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-scaling-XXXXXX")
trap 'rm -rf "$data"' EXIT
for ctx in $contexts; do
  [[ "$ctx" =~ ^[1-9][0-9]*$ ]] || { echo "bench_scaling: bad context '$ctx'" >&2; exit 2; }
  # The warm tier holds a quarter of the context's KV (8 layers x 2 kv heads x 64 x f16 x K,V =
  # 4 KiB a token), as scripts/bench_run.sh sizes it: the rest lives in RocksDB.
  warm=$((ctx * 4096 / 4))
  for ((i = 1; i <= runs; i++)); do
    echo "bench_scaling: context $ctx, run $i of $runs" >&2
    # shellcheck disable=SC2086
    "$build/kvtier" run --quiet --context "$ctx" --warm-bytes "$warm" --data-dir "$data/d" \
      --json "$out/run-$ctx-$i.json" ${KVTIER_BENCH_ARGS:-} > "$out/run-$ctx-$i.txt"
    rm -rf "$data/d"
  done
done
/usr/bin/python3 - "$out" "$runs" $contexts <<'PY'
import json, statistics, sys
out, runs, contexts = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3:]]
fields = [  # (key in the table, header, how to read it from a report, format)
    ("step_ms", "step ms", lambda r: r["time"]["step_ms"], "{:.2f}"),
    ("full_ms", "full attention ms", lambda r: r["time"]["full_attention_step_ms"], "{:.1f}"),
    ("speedup", "vs full", lambda r: r["time"]["speedup_vs_full"], "{:.1f}x"),
    ("needle_hit", "needle hit", lambda r: r["quality"]["needle_hit_rate"], "{:.3f}"),
    ("rss_mib", "peak RSS MiB", lambda r: r["memory"]["peak_rss_bytes"] / 2**20, "{:.0f}"),
    ("index_mib", "index MiB", lambda r: r["memory"]["index_bytes"] / 2**20, "{:.1f}"),
]
rows = []
for ctx in contexts:
    reports = [json.load(open(f"{out}/run-{ctx}-{i}.json")) for i in range(1, runs + 1)]
    row = {"context": ctx}
    for key, _, get, _ in fields:
        vals = [get(r) for r in reports]
        if any(v is None for v in vals):
            row[key] = None
            continue
        row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": vals}
    rows.append(row)
json.dump(rows, open(f"{out}/scaling.json", "w"), indent=1)
def cell(v, fmt):
    if v is None:
        return "not measured"
    if len(v["runs"]) == 1:
        return fmt.format(v["median"])
    return f'{fmt.format(v["median"])} ({fmt.format(v["min"])}-{fmt.format(v["max"])})'
lines = [f"median (min-max) of {runs} run(s) per context", "",
         "| context | " + " | ".join(h for _, h, _, _ in fields) + " |",
         "|---" * (len(fields) + 1) + "|"]
for row in rows:
    lines.append(f'| {row["context"] // 1024}K | ' + " | ".join(cell(row[k], f) for k, _, _, f in fields) + " |")
open(f"{out}/scaling.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print(f"bench_scaling: no matplotlib, no plot (scripts/deps.sh python installs it); table in {out}/scaling.md")
    sys.exit(0)
fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
xs = [r["context"] for r in rows]
for ax, (key, title) in zip(axes, [("speedup", "step vs full attention (x)"), ("step_ms", "step (ms)"),
                                   ("rss_mib", "peak RSS (MiB)")]):
    pts = [(x, r[key]) for x, r in zip(xs, rows) if r[key] is not None]
    if not pts:
        continue
    med = [v["median"] for _, v in pts]
    err = [[v["median"] - v["min"] for _, v in pts], [v["max"] - v["median"] for _, v in pts]]
    ax.errorbar([x for x, _ in pts], med, yerr=err, marker="o", capsize=3, label="peak RSS")
    if key == "rss_mib":
        idx = [(x, r["index_mib"]["median"]) for x, r in zip(xs, rows) if r["index_mib"] is not None]
        ax.plot([x for x, _ in idx], [v for _, v in idx], marker="s", label="retrieval index")
        ax.legend()
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x // 1024}K" for x in xs])
    ax.set_title(title)
    ax.grid(alpha=0.3)
fig.suptitle(f"kvtier run by context, median and range of {runs} run(s)")
fig.tight_layout()
fig.savefig(f"{out}/scaling.png", dpi=110)
print(f"bench_scaling: {out}/scaling.md, {out}/scaling.json, {out}/scaling.png")
PY
