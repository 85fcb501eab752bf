"""Pictures of kvtier's JSON reports: the results people would rather see than read.

    python -m kvtier.tools.plot REPORT.json [REPORT2.json ...] --out DIR [--kind KIND]

Each report's kind is told by its fields, and each kind gives its pictures (PNG, matplotlib's
Agg backend, no display needed); every path written is printed:

  infinite  `kvtier infinite --json`: accuracy and needle recall against context length, one
            line per method (several with --compare); reports of the same task are merged
            (a context run by several reports pools their samples). infinite-TASK.png
            Its table (markdown: answers, needle recall, the cost of a generated token, over the
            one-core floor and over full attention's) is printed and written to
            infinite-frontier.md.
  run       `kvtier run --json`: the chunk-choice heat map, which chunks (by position in the
            context) each layer retrieved over the decode steps, one panel per method (every
            row with --compare), the needles marked. chunk-choice-STEM.png
            With --compare (and the full-attention baseline), the speed-quality frontier of
            every such report: step time over full attention's (same run) against needle hit
            and attention recall, one marker per method, one colour per context. frontier.png;
            its table (markdown: step ms, bytes read, ratio to full attention and to the byte
            floor, needle hit, recall, output error) is printed and written to frontier.md.
  policies  `kvtier run --compare-policies --sweep B1,B2,... --json`: needle kept, attention
            recall and output error against the KV budget, one line per scoring policy;
            several reports are merged. policy-sweep.png

A report of no known kind, or not of --kind, is an error (exit 2) naming the file and the kind
expected; so is a file that is not JSON or lacks a field its kind needs. A picture whose data a
report does not carry (a run report written before chunk_choice existed, an infinite report
with every result skipped) is skipped, saying so. Exit status 0 when a picture was written, 1
when none was.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

KINDS = ("infinite", "run", "policies")
# What each kind is, for error messages.
KIND_SOURCES = {
    "infinite": "`kvtier infinite --json`",
    "run": "`kvtier run --json`",
    "policies": "`kvtier run --compare-policies --json`",
}


class PlotError(Exception):
    """A report that cannot be drawn: not JSON, of no known kind, or missing a field (exit 2)."""


@dataclass
class Report:
    path: str
    kind: str
    data: Dict[str, Any]


def report_kind(data: Any) -> Optional[str]:
    """The kind of a parsed report ("infinite", "run", "policies"), None when it is none of them."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("results"), list) and "task" in data:
        return "infinite"
    if isinstance(data.get("quality"), dict) and isinstance(data.get("methods"), list) and "config" in data:
        return "run"
    if isinstance(data.get("rows"), list) and "context" in data:
        return "policies"
    return None


def load_report(path: str, expected: Optional[str] = None) -> Report:
    """Reads one report; PlotError naming the file when it is unreadable, not JSON, of no known
    kind, or not of kind `expected`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise PlotError(f"{path}: cannot read: {e.strerror or e}")
    except ValueError as e:
        raise PlotError(f"{path}: not JSON ({e})")
    kind = report_kind(data)
    want = [expected] if expected else list(KINDS)
    if kind is None or kind not in want:
        what = f"a {kind} report ({KIND_SOURCES[kind]})" if kind else "no kvtier report this tool knows"
        expect = " or ".join(f"{k} ({KIND_SOURCES[k]})" for k in want)
        raise PlotError(f"{path}: expected a report of kind {expect}, found {what}")
    return Report(path, kind, data)


def _field(report: Report, obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise PlotError(f"{report.path}: {where} is {type(obj).__name__}, not an object")
    if key not in obj:
        raise PlotError(f"{report.path}: {report.kind} report without '{key}' in {where}")
    return obj[key]


def _number(report: Report, obj: Mapping[str, Any], key: str, where: str) -> float:
    v = _field(report, obj, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PlotError(f"{report.path}: '{key}' in {where} is {v!r}, not a number")
    return float(v)


def _optional_number(report: Report, obj: Mapping[str, Any], key: str, where: str) -> Optional[float]:
    """A number, or None where the report says null (not measured) or leaves it out."""
    if obj.get(key) is None:
        return None
    return _number(report, obj, key, where)


# ---- infinite: accuracy and needle recall by context --------------------------------------------

@dataclass
class InfinitePoint:
    """One (method, context) of one task, pooled over the reports that ran it."""
    context: int
    correct: int = 0
    samples: int = 0
    # needle recall weighted by samples (a report gives the rate, not its step count)
    recall_sum: float = 0.0
    recall_samples: int = 0
    reports: List[str] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else float("nan")

    @property
    def needle_recall(self) -> Optional[float]:
        return self.recall_sum / self.recall_samples if self.recall_samples else None


# The settings that make two reports' lines of one method different lines.
_INFINITE_SETTINGS = ("weights", "budget", "sink", "local", "chunk", "compress", "kv_budget")


def infinite_series(reports: Sequence[Report]) -> Dict[str, Dict[str, List[InfinitePoint]]]:
    """task -> line label -> points by increasing context. A line is a method; where merged
    reports differ in a setting (weights, budget, ...), the label names it. Skipped results
    are left out; a context in several reports pools their samples."""
    by_task: Dict[str, List[Report]] = {}
    for r in reports:
        by_task.setdefault(str(_field(r, r.data, "task", "the report")), []).append(r)
    out: Dict[str, Dict[str, List[InfinitePoint]]] = {}
    for task, rs in by_task.items():
        differing = [k for k in _INFINITE_SETTINGS if len({json.dumps(r.data.get(k)) for r in rs}) > 1]
        lines: Dict[str, Dict[int, InfinitePoint]] = {}
        for r in rs:
            suffix = ", ".join(f"{k} {os.path.basename(str(r.data.get(k)))}" for k in differing)
            for i, res in enumerate(r.data["results"]):
                where = f"results[{i}]"
                if _field(r, res, "skipped", where):
                    continue
                method = str(_field(r, res, "method", where))
                label = f"{method} ({suffix})" if suffix else method
                ctx = int(_number(r, res, "context", where))
                p = lines.setdefault(label, {}).setdefault(ctx, InfinitePoint(ctx))
                n = int(_number(r, res, "samples", where))
                p.correct += int(_number(r, res, "correct", where))
                p.samples += n
                recall = _optional_number(r, res, "needle_recall", where)
                if recall is not None:
                    p.recall_sum += recall * n
                    p.recall_samples += n
                p.reports.append(r.path)
        out[task] = {label: [pts[c] for c in sorted(pts)] for label, pts in lines.items() if pts}
    return out


@dataclass
class InfiniteCost:
    """The cost of one (task, method, context) per generated token, pooled over reports: process
    CPU ms per token weighted by each report's generated tokens, and the ratio to the one-core
    floor (CPU ms over the floor's ms, the floor weighted the same way)."""
    cpu_ms_tokens: float = 0.0
    floor_ms_tokens: float = 0.0
    tokens: int = 0

    @property
    def cpu_ms(self) -> Optional[float]:
        return self.cpu_ms_tokens / self.tokens if self.tokens else None

    @property
    def over_floor(self) -> Optional[float]:
        return self.cpu_ms_tokens / self.floor_ms_tokens if self.floor_ms_tokens > 0 else None


def infinite_costs(reports: Sequence[Report]) -> Dict[Tuple[str, str, int], InfiniteCost]:
    """(task, method, context) -> the generated tokens' cost, pooled over the reports that carry
    cost_per_token (older reports without it are left out)."""
    out: Dict[Tuple[str, str, int], InfiniteCost] = {}
    for r in reports:
        task = str(_field(r, r.data, "task", "the report"))
        for i, res in enumerate(r.data["results"]):
            where = f"results[{i}]"
            if _field(r, res, "skipped", where):
                continue
            gen = res.get("cost_per_token", {}).get("generated") if isinstance(res.get("cost_per_token"), dict) else None
            if not isinstance(gen, dict) or not gen.get("tokens"):
                continue
            key = (task, str(_field(r, res, "method", where)), int(_number(r, res, "context", where)))
            c = out.setdefault(key, InfiniteCost())
            n = int(_number(r, gen, "tokens", f"{where}.cost_per_token.generated"))
            c.cpu_ms_tokens += _number(r, gen, "cpu_ms", f"{where}.cost_per_token.generated") * n
            floor = _optional_number(r, gen, "floor_ms", f"{where}.cost_per_token.generated")
            if floor:
                c.floor_ms_tokens += floor * n
            c.tokens += n
    return out


def _infinite_cells(reports: Sequence[Report]) -> Iterator[Tuple[str, int, str, InfinitePoint, Optional[InfiniteCost],
                                                                  Optional[InfiniteCost]]]:
    """(task, context, method, its point, its cost, full attention's cost at that task and
    context) per task, by context, then method in the reports' order; a cost is None where no
    report carries it."""
    series = infinite_series(reports)
    costs = infinite_costs(reports)
    for task, lines in series.items():
        for ctx in sorted({p.context for pts in lines.values() for p in pts}):
            full = costs.get((task, "full attention", ctx))
            for label, pts in lines.items():
                p = next((q for q in pts if q.context == ctx), None)
                if p is not None:
                    yield task, ctx, label, p, costs.get((task, label, ctx)), full


def _over(a: Optional[InfiniteCost], b: Optional[InfiniteCost]) -> Optional[float]:
    """a's CPU ms per generated token over b's; None without both."""
    return a.cpu_ms / b.cpu_ms if a is not None and b is not None and a.cpu_ms and b.cpu_ms else None


def infinite_frontier_table(reports: Sequence[Report]) -> str:
    """The trained model's frontier as a markdown table: per task, context and method (in the
    reports' order), the answers pooled over the reports (seeds), needle recall, and the cost of a
    generated token (CPU ms, over the one-core floor, over full attention's at the same task and
    context)."""
    out = ["| task | context | method | answers | accuracy | needle recall | ms / generated token "
           "| vs floor | vs full attention |",
           "|---|---|---|---|---|---|---|---|---|"]
    for task, ctx, label, p, c, full in _infinite_cells(reports):
        out.append("| " + " | ".join([
            task, _tokens(ctx), label, f"{p.correct}/{p.samples}", f"{p.accuracy:.3f}",
            _cell(p.needle_recall, "{:.3f}"), _cell(None if c is None else c.cpu_ms, "{:.3f}"),
            _cell(None if c is None else c.over_floor, "{:.1f}x"), _cell(_over(full, c), "{:.2f}x")]) + " |")
    return "\n".join(out) + "\n"


@dataclass
class InfiniteFrontierPoint:
    """One (method, context) of a task on the trained model's frontier: the cost of a generated
    token over full attention's (same task and context, pooled as in infinite_frontier_table;
    None without full attention's cost) against accuracy and needle recall."""
    context: int
    method: str
    time_ratio: Optional[float]
    accuracy: float
    needle_recall: Optional[float]


def infinite_frontier_points(reports: Sequence[Report]) -> Dict[str, List[InfiniteFrontierPoint]]:
    """task -> the frontier's points, by context, then method in the reports' order; full
    attention's own point sits at 1."""
    out: Dict[str, List[InfiniteFrontierPoint]] = {}
    for task, ctx, label, p, c, full in _infinite_cells(reports):
        out.setdefault(task, []).append(InfiniteFrontierPoint(ctx, label, _over(c, full), p.accuracy,
                                                              p.needle_recall))
    return out


# ---- run: the chunk-choice heat map ---------------------------------------------------------------

@dataclass
class ChunkHeat:
    """What one method of a run report retrieved, per layer and bucket of consecutive chunks (the
    bucket b holds tokens [edges[b], edges[b + 1])): share[layer][b] is the share of the decode
    steps in which the layer retrieved the bucket's most often retrieved chunk (in [0, 1]: a
    needle's chunk taken at every step stands out even where a bucket holds many chunks), and
    per_step[layer][b] the chunks of the bucket it retrieved per decode step (mean)."""
    method: str
    share: List[List[float]]
    per_step: List[List[float]]
    edges: List[int]
    needles: List[Tuple[int, int]]
    steps: int


def chunk_choice(report: Report) -> Optional[List[ChunkHeat]]:
    """One ChunkHeat per method of a run report, None when the report has no chunk_choice
    (written by a kvtier run before it existed)."""
    cc = report.data.get("chunk_choice")
    if cc is None:
        return None
    where = "chunk_choice"
    steps = int(_number(report, cc, "steps", where))
    chunk = int(_number(report, cc, "chunk_size", where))
    first = int(_number(report, cc, "first_position", where))
    chunks = int(_number(report, cc, "chunks", where))
    per_bucket = int(_number(report, cc, "bucket_chunks", where))
    buckets = int(_number(report, cc, "buckets", where))
    if per_bucket < 1 or buckets != math.ceil(chunks / per_bucket):
        raise PlotError(f"{report.path}: chunk_choice has {buckets} buckets of {per_bucket} chunks for "
                        f"{chunks} chunks")
    # The last bucket may hold fewer chunks than the others.
    edges = [first + min(b * per_bucket, chunks) * chunk for b in range(buckets + 1)]
    needles = [(int(n[0]), int(n[1])) for n in _field(report, cc, "needles", where)]

    def rows(m: Mapping[str, Any], key: str, where: str) -> List[List[float]]:
        out = []
        for layer, row in enumerate(_field(report, m, key, where)):
            if not isinstance(row, list):
                raise PlotError(f"{report.path}: {where}.{key}[{layer}] is not a list")
            if len(row) != buckets:
                raise PlotError(f"{report.path}: {where}.{key}[{layer}] has {len(row)} buckets, not {buckets}")
            out.append([n / steps if steps else 0.0 for n in row])
        return out

    heats = []
    for i, m in enumerate(_field(report, cc, "methods", where)):
        mwhere = f"chunk_choice.methods[{i}]"
        heats.append(ChunkHeat(str(_field(report, m, "name", mwhere)), rows(m, "max_steps", mwhere),
                               rows(m, "counts", mwhere), edges, needles, steps))
    return heats


# ---- run --compare: the speed-quality frontier --------------------------------------------------

@dataclass
class FrontierRow:
    """One method of a `kvtier run --compare` report: full attention (the baseline), each compared
    row, and the attention oracle (quality only). None where the report does not carry the figure
    (step_over_floor without a bandwidth measurement, times of the oracle)."""
    context: int
    method: str
    step_ms: Optional[float]
    bytes_per_step: Optional[float]
    vs_full: Optional[float]          # full attention's step time over this row's (same run)
    step_over_floor: Optional[float]  # the step over its bytes at the run's streaming rate
    needle_hit: Optional[float]
    recall: Optional[float]
    output_error: Optional[float]
    budget_tokens: Optional[int] = None
    chunk_size: Optional[int] = None

    @property
    def time_ratio(self) -> Optional[float]:
        """Step time as a fraction of full attention's (1 / vs_full)."""
        return 1.0 / self.vs_full if self.vs_full else None


def frontier_rows(report: Report) -> Optional[List[FrontierRow]]:
    """The frontier rows of a run report made with --compare and the baseline: full attention, the
    compared rows in the report's order, then the attention oracle; None for other run reports."""
    cfg = _field(report, report.data, "config", "the report")
    if not cfg.get("compare"):
        return None
    t = _field(report, report.data, "time", "the report")
    full_ms = _optional_number(report, t, "full_attention_step_ms", "time")
    if full_ms is None:
        return None  # --no-baseline: no ratio, recall or output error to place a row by
    context = int(_number(report, cfg, "context", "config"))
    rows = [FrontierRow(context, "full attention", full_ms,
                        _optional_number(report, t, "full_attention_bytes_per_step", "time"), 1.0,
                        _optional_number(report, t, "full_attention_step_over_floor", "time"), 1.0, 1.0, 0.0)]
    for i, m in enumerate(_field(report, report.data, "methods", "the report")):
        where = f"methods[{i}]"
        b = m.get("bytes_per_step")
        rows.append(FrontierRow(
            context, str(_field(report, m, "name", where)), _number(report, m, "step_ms", where),
            _optional_number(report, b, "total", f"{where}.bytes_per_step") if isinstance(b, dict) else None,
            _optional_number(report, m, "speedup_vs_full", where), _optional_number(report, m, "step_over_floor", where),
            _number(report, m, "needle_hit_rate", where), _optional_number(report, m, "attention_recall", where),
            _optional_number(report, m, "output_rel_error", where),
            int(m["budget_tokens"]) if isinstance(m.get("budget_tokens"), int) else None,
            int(m["chunk_size"]) if isinstance(m.get("chunk_size"), int) else None))
    oracle = _field(report, report.data, "quality", "the report").get("attention_oracle")
    if isinstance(oracle, dict) and oracle.get("needle_hit") is not None:
        rows.append(FrontierRow(context, "attention oracle", None, None, None, None,
                                _number(report, oracle, "needle_hit", "quality.attention_oracle"),
                                _optional_number(report, oracle, "recall", "quality.attention_oracle"), None))
    return rows


def _cell(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def frontier_table(rows: Sequence[FrontierRow]) -> str:
    """The frontier as a markdown table, one line per row in the given order (contexts apart)."""
    out = ["| context | method | step ms | MB read a step | vs full | step / byte floor | needle hit | recall "
           "| out. err |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| " + " | ".join([
            _tokens(r.context), r.method, _cell(r.step_ms, "{:.2f}"),
            _cell(None if r.bytes_per_step is None else r.bytes_per_step / 1e6, "{:.2f}"),
            _cell(r.vs_full, "{:.1f}x"), _cell(r.step_over_floor, "{:.2f}x"), _cell(r.needle_hit, "{:.3f}"),
            _cell(r.recall, "{:.3f}"), _cell(r.output_error, "{:.3f}")]) + " |")
    return "\n".join(out) + "\n"


# ---- policies: quality against KV budget ---------------------------------------------------------

POLICY_METRICS = (("needle_retention", "needle kept"), ("attention_recall", "attention recall"),
                  ("output_error", "output rel. error"))


@dataclass
class PolicyPoint:
    budget: int
    needle_retention: float
    attention_recall: float
    output_error: float


def policy_sweep(reports: Sequence[Report]) -> Dict[str, List[PolicyPoint]]:
    """policy -> points by increasing budget (tokens per kv head and layer). Reports of other
    contexts or decode steps than the first get their own lines (the label says which); the same
    (policy, budget) twice with different figures is a PlotError."""
    first = reports[0].data if reports else {}
    lines: Dict[str, Dict[int, Tuple[PolicyPoint, str]]] = {}
    for r in reports:
        same = all(r.data.get(k) == first.get(k) for k in ("context", "decode_steps"))
        suffix = "" if same else f" (context {r.data.get('context')}, {r.data.get('decode_steps')} steps)"
        for i, row in enumerate(r.data["rows"]):
            where = f"rows[{i}]"
            label = str(_field(r, row, "policy", where)) + suffix
            p = PolicyPoint(int(_number(r, row, "budget", where)),
                            *(_number(r, row, key, where) for key, _ in POLICY_METRICS))
            known = lines.setdefault(label, {}).get(p.budget)
            if known is not None and known[0] != p:
                raise PlotError(f"{r.path}: {label} at budget {p.budget} differs from {known[1]}'s")
            lines[label][p.budget] = (p, r.path)
    return {label: [pts[b][0] for b in sorted(pts)] for label, pts in lines.items()}


# ---- drawing -------------------------------------------------------------------------------------

def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> str:
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


# Lines that coincide (two methods with the same accuracy) stay visible: each line has its own
# marker and dash pattern, and the later ones are drawn smaller.
_STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("v", ":"), ("D", "-"), ("P", "--"), ("X", "-."), ("*", ":"),
           ("h", "-"), ("p", "--"), ("<", "-."), (">", ":")]


def _style(i: int) -> Dict[str, Any]:
    marker, ls = _STYLES[i % len(_STYLES)]
    return {"marker": marker, "linestyle": ls, "markersize": max(3.0, 8.0 - 0.6 * i), "alpha": 0.9}


def _tokens(n: float) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{int(n) >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{int(n) >> 10}K"
    return f"{n:g}"


def draw_infinite(task: str, lines: Mapping[str, Sequence[InfinitePoint]], path: str) -> str:
    plt = _pyplot()
    fig, (acc, rec) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    contexts = sorted({p.context for pts in lines.values() for p in pts})
    for i, (label, pts) in enumerate(lines.items()):
        x = [p.context for p in pts]
        acc.plot(x, [p.accuracy for p in pts], label=label, **_style(i))
        recall = [(p.context, p.needle_recall) for p in pts if p.needle_recall is not None]
        rec.plot([c for c, _ in recall], [v for _, v in recall], label=label, **_style(i))
    samples = sorted({p.samples for pts in lines.values() for p in pts})
    n = f"{samples[0]}" if len(samples) == 1 else f"{samples[0]}-{samples[-1]}"
    for ax, title in ((acc, f"accuracy ({n} samples per point)"), (rec, "needle recall")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts)
        ax.set_xticklabels([_tokens(c) for c in contexts])
        ax.minorticks_off()
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    rec.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"kvtier infinite: {task}")
    return _save(fig, path)


def draw_chunk_choice(title: str, heats: Sequence[ChunkHeat], path: str) -> str:
    plt = _pyplot()
    layers = max(len(h.share) for h in heats)
    fig, axes = plt.subplots(len(heats), 1, figsize=(10, 1.0 + len(heats) * (0.5 + 0.22 * layers)), sharex=True,
                             squeeze=False, constrained_layout=True)
    image = None
    for ax, h in zip(axes[:, 0], heats):
        image = ax.imshow(h.share, aspect="auto", interpolation="nearest", cmap="magma", vmin=0.0, vmax=1.0,
                          extent=(h.edges[0], h.edges[-1], len(h.share) - 0.5, -0.5))
        for b, e in h.needles:
            ax.axvline((b + e) / 2, color="cyan", lw=0.6, ls="--", alpha=0.6)
            ax.plot([(b + e) / 2], [-0.5], marker="v", color="cyan", markeredgecolor="black", markersize=7,
                    clip_on=False)
        ax.set_ylabel(f"{h.method}\nlayer", fontsize=8)
        ax.set_yticks(range(len(h.share)))
        ax.tick_params(axis="y", labelsize=7)
    per_bucket = (heats[0].edges[1] - heats[0].edges[0]) if len(heats[0].edges) > 1 else 0
    axes[-1, 0].set_xlabel(f"position in the context (tokens; buckets of {per_bucket}; sealed chunks only)"
                           "    ▼ needle")
    fig.colorbar(image, ax=axes[:, 0].tolist(), shrink=0.9,
                 label="share of decode steps in which the\nbucket's most retrieved chunk was retrieved")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _draw_speed_quality(points: Sequence[Any], panels: Sequence[Tuple[str, str]], xlabel: str, title: str,
                        path: str) -> str:
    """One panel per (attribute, name) of `panels`: x the point's time_ratio (log; left is faster),
    y the attribute; one marker per method, one colour per context. A point without a time (an
    oracle that only chooses) is a dashed level in its context's colour."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), constrained_layout=True, squeeze=False)
    axes = axes[0]
    contexts = sorted({p.context for p in points})
    methods = list(dict.fromkeys(p.method for p in points if p.time_ratio is not None))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    levels = list(dict.fromkeys(p.method for p in points if p.time_ratio is None))
    for ax, (key, name) in zip(axes, panels):
        for ci, ctx in enumerate(contexts):
            colour = colours[ci % len(colours)]
            for p in points:
                if p.context != ctx or getattr(p, key) is None:
                    continue
                if p.time_ratio is None:
                    ax.axhline(getattr(p, key), color=colour, ls="--", lw=0.8, alpha=0.7)
                    continue
                ax.plot([p.time_ratio], [getattr(p, key)], color=colour, linestyle="none",
                        marker=_STYLES[methods.index(p.method) % len(_STYLES)][0], markersize=8, alpha=0.85)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(name + (f" (dashed: the {', '.join(levels)})" if levels else ""))
        ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="grey", linestyle="none", marker=_STYLES[i % len(_STYLES)][0], label=m)
               for i, m in enumerate(methods)]
    handles += [Line2D([], [], color=colours[i % len(colours)], lw=3, label=f"context {_tokens(c)}")
                for i, c in enumerate(contexts)]
    axes[-1].legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title)
    return _save(fig, path)


def draw_frontier(rows: Sequence[FrontierRow], path: str) -> str:
    """x: step time over full attention's (log), y: needle hit and (second panel) recall; one
    marker per method, one colour per context. The oracle has no time: it is a dashed level."""
    return _draw_speed_quality(rows, (("needle_hit", "needle hit"), ("recall", "attention recall")),
                               "step time / full attention's (same run; left is faster)",
                               "kvtier run --compare: speed-quality frontier at equal budget", path)


def draw_infinite_frontier(task: str, points: Sequence[InfiniteFrontierPoint], path: str) -> str:
    """x: a generated token's CPU time over full attention's (log), y: accuracy and needle
    recall; one marker per method, one colour per context."""
    timed = [p for p in points if p.time_ratio is not None]  # beyond full attention's reach: no ratio
    return _draw_speed_quality(timed, (("accuracy", "accuracy"), ("needle_recall", "needle recall")),
                               "CPU time per generated token / full attention's (left is cheaper)",
                               f"kvtier infinite --compare: {task}, speed-quality frontier at equal budget", path)


def short_policy_labels(labels: Sequence[str]) -> Dict[str, str]:
    """A legend name per line: the policy's name without its parameters ("h2o:recent=0" ->
    "h2o") where no other line has that name, the full label otherwise."""
    def short(label: str) -> str:
        spec, _, rest = label.partition(" (")
        return spec.split(":")[0] + (f" ({rest}" if rest else "")

    names = [short(label) for label in labels]
    return {label: name if names.count(name) == 1 else label for label, name in zip(labels, names)}


def draw_policy_sweep(lines: Mapping[str, Sequence[PolicyPoint]], path: str, title: str) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    budgets = sorted({p.budget for pts in lines.values() for p in pts})
    names = short_policy_labels(list(lines))
    for i, (label, pts) in enumerate(lines.items()):
        for ax, (key, _) in zip(axes, POLICY_METRICS):
            ax.plot([p.budget for p in pts], [getattr(p, key) for p in pts], label=names[label], **_style(i))
    for ax, (key, name) in zip(axes, POLICY_METRICS):
        if len(budgets) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([_tokens(b) for b in budgets])
        ax.minorticks_off()
        ax.set_title(name + (" (lower is better)" if key == "output_error" else ""))
        if key == "output_error":
            ax.set_ylim(bottom=0)
        else:
            ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.supxlabel("KV budget (tokens per kv head and layer)")
    fig.suptitle(title)
    return _save(fig, path)


# ---- the command ---------------------------------------------------------------------------------

def _unique(path: str, taken: Dict[str, int]) -> str:
    """path, or path with -2, -3, ... before the extension when an earlier picture took it."""
    n = taken.get(path, 0) + 1
    taken[path] = n
    if n == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-{n}{ext}"


def _write_table(text: str, path: str, taken: Dict[str, int], table: Any) -> str:
    """Writes a markdown table to a path not taken yet (_unique), hands it to table(text) when given,
    and returns the path."""
    md = _unique(path, taken)
    with open(md, "w", encoding="utf-8") as f:
        f.write(text)
    if table is not None:
        table(text)
    return md


def make_pictures(reports: Sequence[Report], out: str, say: Any = print, table: Any = None) -> List[str]:
    """Draws every picture the reports hold into `out` (created); returns the paths written and
    calls say(text) for each picture skipped and why, and table(text) with the frontier's
    markdown table when the reports hold one."""
    os.makedirs(out, exist_ok=True)
    written: List[str] = []
    taken: Dict[str, int] = {}
    infinite = [r for r in reports if r.kind == "infinite"]
    if infinite:
        series = infinite_series(infinite)
        for task, task_lines in series.items():
            if not task_lines:
                say(f"skipped infinite-{task}.png: every result of task {task} was skipped")
                continue
            written.append(draw_infinite(task, task_lines, _unique(os.path.join(out, f"infinite-{task}.png"), taken)))
            if not any(p.needle_recall is not None for pts in task_lines.values() for p in pts):
                say(f"infinite-{task}.png: no needle recall in these reports (its panel is empty)")
        written.append(_write_table(infinite_frontier_table(infinite), os.path.join(out, "infinite-frontier.md"),
                                    taken, table))
        for task, pts in infinite_frontier_points(infinite).items():
            if not any(p.time_ratio is not None for p in pts):
                say(f"skipped infinite-frontier-{task}.png: no cost per generated token with full attention's beside "
                    "it (kvtier infinite --compare writes both)")
                continue
            written.append(draw_infinite_frontier(
                task, pts, _unique(os.path.join(out, f"infinite-frontier-{task}.png"), taken)))
    for r in reports:
        if r.kind != "run":
            continue
        stem = os.path.splitext(os.path.basename(r.path))[0]
        heats = chunk_choice(r)
        if heats is None:
            say(f"skipped the chunk-choice heat map of {r.path}: the report has no chunk_choice (written by a "
                "kvtier run before it existed; run it again)")
            continue
        if not heats or not heats[0].edges or heats[0].edges[0] == heats[0].edges[-1]:
            say(f"skipped the chunk-choice heat map of {r.path}: no chunk to show")
            continue
        cfg = r.data.get("config", {})
        title = (f"kvtier run: chunks retrieved per layer over {heats[0].steps} decode steps, context "
                 f"{_tokens(cfg.get('context', 0))}, budget {cfg.get('budget')} tokens/layer ({stem})")
        written.append(draw_chunk_choice(title, heats, _unique(os.path.join(out, f"chunk-choice-{stem}.png"), taken)))
    frontier: List[FrontierRow] = []
    for r in reports:
        if r.kind == "run":
            rows = frontier_rows(r)
            if rows is not None:
                frontier.extend(rows)
    if frontier:
        md = _write_table(frontier_table(frontier), os.path.join(out, "frontier.md"), taken, table)
        written.append(draw_frontier(frontier, _unique(os.path.join(out, "frontier.png"), taken)))
        written.append(md)
    policies = [r for r in reports if r.kind == "policies"]
    if policies:
        sweep = policy_sweep(policies)
        if not sweep:
            say("skipped policy-sweep.png: the policy reports have no rows")
        else:
            budgets = {q.budget for pts in sweep.values() for q in pts}
            if len(budgets) == 1:
                say(f"policy-sweep.png: one budget only ({budgets.pop()}); --sweep B1,B2,... gives a sweep")
            d = policies[0].data
            title = (f"kvtier run --compare-policies: context {_tokens(d.get('context', 0))}, "
                     f"{d.get('decode_steps')} decode steps")
            written.append(draw_policy_sweep(sweep, _unique(os.path.join(out, "policy-sweep.png"), taken), title))
    return written


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tools.plot", description=(__doc__ or "").split("\n\n")[0],
                                 epilog="kinds: " + "; ".join(f"{k}: {v}" for k, v in KIND_SOURCES.items()))
    ap.add_argument("reports", nargs="+", metavar="REPORT.json", help="JSON reports of kvtier run / infinite")
    ap.add_argument("--out", required=True, metavar="DIR", help="directory for the PNGs (created)")
    ap.add_argument("--kind", choices=KINDS, help="require every report to be of this kind")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        reports = [load_report(p, args.kind) for p in args.reports]
        written = make_pictures(reports, args.out, say=lambda s: print(s, file=sys.stderr),
                                table=lambda s: print(s))
    except PlotError as e:
        print(f"kvtier.tools.plot: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    if not written:
        print("kvtier.tools.plot: no picture written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
