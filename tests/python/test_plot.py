"""python -m kvtier.tools.plot: real reports of the built CLI drawn into valid PNGs, the data extraction
checked against hand-computed values of small handmade reports, and the errors a user gets."""
import json
import os
import struct
import subprocess
import sys

import pytest

import kvtier.tools.plot as kp

from conftest import ROOT, WEIGHTS


def kvtier_cli():
    # ctest passes the binary of its build (Python.Package's KVTIER_CLI); by hand, a build of
    # the default directory.
    path = os.environ.get("KVTIER_CLI") or os.path.join(ROOT, "build", "kvtier")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no kvtier CLI at {path} (set KVTIER_CLI)")
    return path


def plot(*args):
    r = subprocess.run([sys.executable, "-m", "kvtier.tools.plot", *args], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Small real reports: kvtier run --compare, kvtier infinite --compare at two contexts, and a
    policy comparison over two budgets."""
    cli = kvtier_cli()
    d = tmp_path_factory.mktemp("reports")
    run = str(d / "run.json")
    subprocess.run([cli, "run", "--quiet", "--compare", "--context", "8192", "--geometry", "2,8,2,32",
                    "--decode-steps", "4", "--budget", "512", "--spearman-windows", "0", "--json", run],
                   check=True, stdout=subprocess.DEVNULL)
    inf = str(d / "infinite.json")
    subprocess.run([cli, "infinite", "--weights", WEIGHTS, "--task", "passkey", "--contexts", "1024,2048",
                    "--samples", "2", "--compare", "--quiet", "--json", inf], check=True, stdout=subprocess.DEVNULL)
    pol = str(d / "policies.json")
    subprocess.run([cli, "run", "--quiet", "--compare-policies", "--context", "4096", "--geometry", "2,8,2,32",
                    "--decode-steps", "8", "--local", "64", "--sweep", "256,512", "--policies", "h2o;streaming",
                    "--json", pol], check=True, stdout=subprocess.DEVNULL)
    return {"run": run, "infinite": inf, "policies": pol}


def paths_of(stdout):
    """The paths a plot run printed (the frontier's table comes before them)."""
    return [line for line in stdout.splitlines() if line.endswith((".png", ".md"))]


def png_size(path):
    """(width, height) from a PNG's IHDR; fails unless the file is a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_real_reports_have_the_kinds_they_are(reports):
    for kind, path in reports.items():
        assert kp.load_report(path).kind == kind


def test_every_picture_is_written_as_a_valid_png(reports, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "pictures"
    rc, stdout, stderr = plot(reports["run"], reports["infinite"], reports["policies"], "--out", str(out))
    assert rc == 0, stderr
    written = paths_of(stdout)
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["chunk-choice-run.png", "frontier.md", "frontier.png", "infinite-frontier-passkey.png",
                     "infinite-frontier.md", "infinite-passkey.png", "policy-sweep.png"], stdout
    # The frontier's table is printed too, and is what frontier.md holds.
    md = [p for p in written if os.path.basename(p) == "frontier.md"][0]
    with open(md) as f:
        table = f.read()
    assert table in stdout
    for name in ("full attention", "StreamingLLM", "InfLLM", "InfLLM (own defaults)", "ActQKV", "Quest", "kvtier",
                 "attention oracle"):
        assert f"| {name} |" in table, (name, table)
    # So is the trained model's: every --compare row at both contexts.
    md = [p for p in written if os.path.basename(p) == "infinite-frontier.md"][0]
    with open(md) as f:
        table = f.read()
    assert table in stdout
    for name in ("full attention", "StreamingLLM", "InfLLM", "InfLLM (own defaults)", "ActQKV", "Quest", "kvtier",
                 "kvtier-fast", "needle oracle"):
        for ctx in ("1K", "2K"):
            assert f"| passkey | {ctx} | {name} | " in table, (name, ctx, table)
    for p in written:
        if p.endswith(".md"):
            continue
        assert os.path.dirname(os.path.abspath(p)) == str(out)
        w, h = png_size(p)
        assert 600 <= w <= 2000 and 250 <= h <= 2000, (p, w, h)
        assert 10_000 < os.path.getsize(p) < 500_000, p
        pixels = matplotlib.image.imread(p)
        assert pixels.shape[:2] == (h, w)
        assert pixels.std() > 0.05, f"{p} looks blank"


def test_reports_merge_into_one_picture_per_kind(reports, tmp_path):
    pytest.importorskip("matplotlib")
    # The same infinite report twice pools into one picture; two run reports with one stem
    # get two heat maps.
    rc, stdout, stderr = plot(reports["infinite"], reports["infinite"], reports["run"], reports["run"], "--out",
                              str(tmp_path))
    assert rc == 0, stderr
    assert sorted(os.path.basename(p) for p in paths_of(stdout)) == [
        "chunk-choice-run-2.png", "chunk-choice-run.png", "frontier.md", "frontier.png",
        "infinite-frontier-passkey.png", "infinite-frontier.md", "infinite-passkey.png"]


def test_unknown_and_mismatched_kinds_exit_2_naming_the_file(reports, tmp_path):
    other = write(tmp_path / "other.json", {"ops": 10, "errors": 0})
    rc, stdout, stderr = plot(other, "--out", str(tmp_path / "o"))
    assert rc == 2 and stdout == ""
    assert other in stderr and "expected a report of kind infinite" in stderr and "found no kvtier report" in stderr
    rc, _, stderr = plot(reports["run"], "--kind", "infinite", "--out", str(tmp_path / "o"))
    assert rc == 2
    assert reports["run"] in stderr and "expected a report of kind infinite" in stderr
    assert "found a run report" in stderr
    text = tmp_path / "notjson.json"
    text.write_text("kvtier run ...")
    rc, _, stderr = plot(str(text), "--out", str(tmp_path / "o"))
    assert rc == 2 and str(text) in stderr and "not JSON" in stderr
    rc, _, stderr = plot(str(tmp_path / "missing.json"), "--out", str(tmp_path / "o"))
    assert rc == 2 and "missing.json" in stderr and "cannot read" in stderr


def test_a_report_without_the_data_is_skipped_saying_so(reports, tmp_path):
    with open(reports["run"]) as f:
        old = json.load(f)
    del old["chunk_choice"]
    old["config"]["compare"] = False  # no frontier either
    path = write(tmp_path / "old-run.json", old)
    rc, stdout, stderr = plot(path, "--out", str(tmp_path / "o"))
    assert rc == 1 and stdout == ""
    assert f"skipped the chunk-choice heat map of {path}: the report has no chunk_choice" in stderr
    assert "no picture written" in stderr


# ---- extraction against hand-computed values ------------------------------------------------------

def infinite_report(budget, results):
    return {"weights": "models/kvtier-tiny.safetensors", "task": "passkey", "samples": 5, "seed": 1,
            "budget": budget, "sink": 16, "local": 256, "chunk": 32, "window": 64, "compress": None,
            "kv_budget": None, "observe": 32, "methods": [], "results": results}


def result(method, context, correct, samples, recall):
    return {"method": method, "context": context, "skipped": False, "accuracy": correct / samples,
            "correct": correct, "samples": samples, "needle_recall": recall}


def test_infinite_series_pools_samples_by_context(tmp_path):
    a = write(tmp_path / "a.json", infinite_report(256, [
        result("kvtier", 4096, 3, 5, 0.6), result("full", 4096, 5, 5, None),
        {"method": "kvtier", "context": 65536, "skipped": True, "skip_reason": "too long"}]))
    b = write(tmp_path / "b.json", infinite_report(256, [
        result("kvtier", 8192, 1, 4, 0.25), result("kvtier", 4096, 3, 3, 1.0)]))
    series = kp.infinite_series([kp.load_report(a), kp.load_report(b)])
    assert list(series) == ["passkey"]
    lines = series["passkey"]
    assert sorted(lines) == ["full", "kvtier"]
    kv = lines["kvtier"]
    assert [p.context for p in kv] == [4096, 8192]  # sorted; the skipped 64K left out
    # Pooled, not averaged: 6 of 8 samples (the mean of 0.6 and 1.0 would be 0.8).
    assert (kv[0].correct, kv[0].samples) == (6, 8)
    assert kv[0].accuracy == pytest.approx(0.75)
    assert kv[0].needle_recall == pytest.approx((0.6 * 5 + 1.0 * 3) / 8)
    assert kv[1].accuracy == pytest.approx(0.25) and kv[1].needle_recall == pytest.approx(0.25)
    assert lines["full"][0].accuracy == 1.0 and lines["full"][0].needle_recall is None


def test_infinite_lines_of_different_settings_stay_apart(tmp_path):
    a = write(tmp_path / "a.json", infinite_report(256, [result("kvtier", 4096, 3, 5, 0.6)]))
    b = write(tmp_path / "b.json", infinite_report(512, [result("kvtier", 4096, 5, 5, 1.0)]))
    lines = kp.infinite_series([kp.load_report(a), kp.load_report(b)])["passkey"]
    assert sorted(lines) == ["kvtier (budget 256)", "kvtier (budget 512)"]
    assert lines["kvtier (budget 256)"][0].accuracy == pytest.approx(0.6)
    assert lines["kvtier (budget 512)"][0].accuracy == 1.0


def run_report(chunk_choice):
    return {"quality": {}, "methods": [], "config": {"context": 256, "budget": 64}, "chunk_choice": chunk_choice}


def test_chunk_choice_shares_and_edges(tmp_path):
    # 5 chunks of 32 tokens after 64 sinks, 2 chunks per bucket: buckets hold chunks {0,1}, {2,3},
    # {4}, i.e. tokens [64,128), [128,192), [192,224). Over 4 steps: share = max_steps / 4,
    # per_step = counts / 4.
    cc = {"steps": 4, "chunk_size": 32, "first_position": 64, "chunks": 5, "bucket_chunks": 2, "buckets": 3,
          "max_buckets": 128, "needles": [[130, 138]],
          "methods": [{"name": "configured", "counts": [[8, 0, 1], [0, 5, 4]], "max_steps": [[4, 0, 1], [0, 3, 4]]},
                      {"name": "other", "counts": [[2, 2, 0], [0, 0, 0]], "max_steps": [[1, 2, 0], [0, 0, 0]]}]}
    heats = kp.chunk_choice(kp.load_report(write(tmp_path / "r.json", run_report(cc))))
    assert [h.method for h in heats] == ["configured", "other"]
    assert heats[0].edges == [64, 128, 192, 224]
    assert heats[0].needles == [(130, 138)]
    assert heats[0].share == [[1.0, 0.0, 0.25], [0.0, 0.75, 1.0]]
    assert heats[0].per_step == [[2.0, 0.0, 0.25], [0.0, 1.25, 1.0]]
    assert heats[1].share == [[0.25, 0.5, 0.0], [0.0, 0.0, 0.0]]
    assert heats[0].steps == 4


def test_chunk_choice_inconsistent_buckets_are_an_error(tmp_path):
    cc = {"steps": 4, "chunk_size": 32, "first_position": 64, "chunks": 5, "bucket_chunks": 2, "buckets": 3,
          "needles": [], "methods": [{"name": "configured", "counts": [[8, 0, 0]], "max_steps": [[4, 0]]}]}
    path = write(tmp_path / "r.json", run_report(cc))
    with pytest.raises(kp.PlotError, match="r.json: chunk_choice.methods\\[0\\].max_steps\\[0\\] has 2 buckets, not 3"):
        kp.chunk_choice(kp.load_report(path))
    cc["buckets"] = 4
    with pytest.raises(kp.PlotError, match="4 buckets of 2 chunks for 5 chunks"):
        kp.chunk_choice(kp.load_report(write(tmp_path / "r.json", run_report(cc))))


def row(policy, budget, kept, recall, err):
    return {"policy": policy, "budget": budget, "needle_retention": kept, "attention_recall": recall,
            "output_error": err, "compressions": 1}


def test_policy_sweep_by_budget(tmp_path):
    a = write(tmp_path / "a.json", {"context": 8192, "decode_steps": 64, "rows": [
        row("h2o", 1024, 1.0, 0.95, 0.1), row("h2o", 512, 0.5, 0.91, 0.3), row("streaming", 512, 0.0, 0.1, 1.1)]})
    b = write(tmp_path / "b.json", {"context": 8192, "decode_steps": 64, "rows": [
        row("streaming", 1024, 0.0, 0.2, 1.0), row("h2o", 512, 0.5, 0.91, 0.3)]})
    lines = kp.policy_sweep([kp.load_report(a), kp.load_report(b)])
    assert sorted(lines) == ["h2o", "streaming"]
    assert [(p.budget, p.needle_retention, p.attention_recall, p.output_error) for p in lines["h2o"]] == [
        (512, 0.5, 0.91, 0.3), (1024, 1.0, 0.95, 0.1)]
    assert [(p.budget, p.attention_recall) for p in lines["streaming"]] == [(512, 0.1), (1024, 0.2)]
    c = write(tmp_path / "c.json", {"context": 8192, "decode_steps": 64, "rows": [row("h2o", 512, 0.5, 0.8, 0.3)]})
    with pytest.raises(kp.PlotError, match="c.json: h2o at budget 512 differs"):
        kp.policy_sweep([kp.load_report(a), kp.load_report(c)])
    d = write(tmp_path / "d.json", {"context": 16384, "decode_steps": 64, "rows": [row("h2o", 512, 1, 1, 0)]})
    assert sorted(kp.policy_sweep([kp.load_report(a), kp.load_report(d)])) == [
        "h2o", "h2o (context 16384, 64 steps)", "streaming"]


def test_policy_legend_names_drop_parameters_unless_ambiguous():
    assert kp.short_policy_labels(["h2o:recent=0", "snapkv:kernel=7", "gkv:form=max", "gkv:form=mean",
                                   "h2o:recent=0 (context 16384, 64 steps)"]) == {
        "h2o:recent=0": "h2o", "snapkv:kernel=7": "snapkv", "gkv:form=max": "gkv:form=max",
        "gkv:form=mean": "gkv:form=mean", "h2o:recent=0 (context 16384, 64 steps)": "h2o (context 16384, 64 steps)"}


def test_missing_field_names_the_file_and_field(tmp_path):
    path = write(tmp_path / "p.json", {"context": 8192, "decode_steps": 64, "rows": [{"policy": "h2o"}]})
    with pytest.raises(kp.PlotError, match="p.json: policies report without 'budget' in rows\\[0\\]"):
        kp.policy_sweep([kp.load_report(path)])


def compare_report(context, methods, full_ms=100.0, full_bytes=500e6, full_floor=1.2, oracle=(1.0, 0.5)):
    return {"quality": {"attention_oracle": {"needle_hit": oracle[0], "recall": oracle[1]}},
            "config": {"context": context, "budget": 2048, "compare": True},
            "time": {"full_attention_step_ms": full_ms, "full_attention_bytes_per_step": full_bytes,
                     "full_attention_step_over_floor": full_floor},
            "methods": methods}


def method(name, step_ms, total, over_floor, hit, recall, err, full_ms=100.0, budget=2048, chunk=32):
    return {"name": name, "chunk_size": chunk, "budget_tokens": budget, "needle_hit_rate": hit,
            "attention_recall": recall, "output_rel_error": err, "step_ms": step_ms,
            "speedup_vs_full": full_ms / step_ms, "bytes_per_step": {"total": total}, "step_over_floor": over_floor}


def test_frontier_rows_and_table_from_a_handmade_report(tmp_path):
    a = write(tmp_path / "a.json", compare_report(131072, [
        method("StreamingLLM", 0.5, 2.4e6, None, 0.0, 0.034, 1.25),
        method("InfLLM (own defaults)", 10.0, 40e6, 2.5, 0.5, 0.25, 1.0625, chunk=128),
        method("kvtier", 4.0, 31e6, 1.5, 0.875, 0.3926, 0.954)]))
    rows = kp.frontier_rows(kp.load_report(a))
    assert [r.method for r in rows] == ["full attention", "StreamingLLM", "InfLLM (own defaults)", "kvtier",
                                        "attention oracle"]
    full, streaming, own, kv, oracle = rows
    assert (full.step_ms, full.vs_full, full.bytes_per_step, full.step_over_floor) == (100.0, 1.0, 500e6, 1.2)
    assert (full.needle_hit, full.recall, full.output_error) == (1.0, 1.0, 0.0)
    assert kv.vs_full == pytest.approx(25.0) and kv.time_ratio == pytest.approx(0.04)
    assert streaming.step_over_floor is None  # not in the report: "-"
    assert own.chunk_size == 128 and own.budget_tokens == 2048
    assert (oracle.step_ms, oracle.vs_full, oracle.needle_hit, oracle.recall) == (None, None, 1.0, 0.5)
    table = kp.frontier_table(rows)
    lines = table.splitlines()
    assert lines[0] == ("| context | method | step ms | MB read a step | vs full | step / byte floor | needle hit "
                        "| recall | out. err |")
    assert lines[2] == "| 128K | full attention | 100.00 | 500.00 | 1.0x | 1.20x | 1.000 | 1.000 | 0.000 |"
    assert lines[3] == "| 128K | StreamingLLM | 0.50 | 2.40 | 200.0x | - | 0.000 | 0.034 | 1.250 |"
    assert lines[4] == "| 128K | InfLLM (own defaults) | 10.00 | 40.00 | 10.0x | 2.50x | 0.500 | 0.250 | 1.062 |"
    assert lines[5] == "| 128K | kvtier | 4.00 | 31.00 | 25.0x | 1.50x | 0.875 | 0.393 | 0.954 |"
    assert lines[6] == "| 128K | attention oracle | - | - | - | - | 1.000 | 0.500 | - |"
    assert len(lines) == 7
    # Two contexts: each report's rows, in the order given.
    b = write(tmp_path / "b.json", compare_report(1048576, [method("kvtier", 10.0, 90e6, 2.0, 0.244, 0.076, 1.0,
                                                                  full_ms=800.0)], full_ms=800.0))
    both = kp.frontier_rows(kp.load_report(a)) + kp.frontier_rows(kp.load_report(b))
    assert [r.context for r in both].count(1048576) == 3
    assert "| 1M | kvtier | 10.00 | 90.00 | 80.0x | 2.00x | 0.244 | 0.076 | 1.000 |" in kp.frontier_table(both)


def test_frontier_needs_compare_and_the_baseline(tmp_path):
    plain = compare_report(4096, [method("configured", 1.0, 1e6, 1.0, 1.0, 0.9, 0.1)])
    plain["config"]["compare"] = False
    assert kp.frontier_rows(kp.load_report(write(tmp_path / "p.json", plain))) is None
    nobase = compare_report(4096, [method("kvtier", 1.0, 1e6, 1.0, 1.0, 0.9, 0.1)])
    nobase["time"]["full_attention_step_ms"] = None
    assert kp.frontier_rows(kp.load_report(write(tmp_path / "n.json", nobase))) is None
    broken = compare_report(4096, [{"name": "kvtier", "step_ms": 1.0}])
    with pytest.raises(kp.PlotError, match="b.json: run report without 'needle_hit_rate' in methods\\[0\\]"):
        kp.frontier_rows(kp.load_report(write(tmp_path / "b.json", broken)))


def test_infinite_frontier_pools_seeds_and_weights_costs_by_tokens(tmp_path):
    def result(method, correct, samples, recall, cpu_ms, floor_ms, tokens):
        return {"method": method, "context": 4096, "skipped": False, "correct": correct, "samples": samples,
                "needle_recall": recall,
                "cost_per_token": {"generated": {"tokens": tokens, "cpu_ms": cpu_ms, "floor_ms": floor_ms}}}

    def report(name, results):
        return write(tmp_path / name, {"task": "passkey", "weights": "w", "budget": 256, "results": results})

    a = report("a.json", [result("full attention", 1, 2, 1.0, 2.0, 0.1, 10), result("kvtier", 2, 2, 0.5, 0.5, 0.1, 10)])
    b = report("b.json", [result("full attention", 0, 2, 1.0, 4.0, 0.1, 30), result("kvtier", 1, 2, 0.25, 1.0, 0.1, 30)])
    reps = [kp.load_report(a), kp.load_report(b)]
    lines = kp.infinite_frontier_table(reps).splitlines()
    assert lines[0].startswith("| task | context | method | answers |")
    # full attention: 1/4 answers; cost (2 x 10 + 4 x 30) / 40 = 3.5 ms, floor 0.1 ms: 35x.
    assert lines[2] == "| passkey | 4K | full attention | 1/4 | 0.250 | 1.000 | 3.500 | 35.0x | 1.00x |"
    # kvtier: 3/4; recall (0.5 x 2 + 0.25 x 2) / 4 = 0.375; cost (5 + 30) / 40 = 0.875 ms; 3.5 / 0.875 = 4x.
    assert lines[3] == "| passkey | 4K | kvtier | 3/4 | 0.750 | 0.375 | 0.875 | 8.8x | 4.00x |"
    assert len(lines) == 4
    # The picture's points: the same pooling, as the cost over full attention's.
    pts = kp.infinite_frontier_points(reps)["passkey"]
    assert [(p.method, p.context) for p in pts] == [("full attention", 4096), ("kvtier", 4096)]
    assert pts[0].time_ratio == pytest.approx(1.0)
    assert (pts[1].time_ratio, pts[1].accuracy, pts[1].needle_recall) == (pytest.approx(0.25), 0.75, 0.375)
    # Without full attention's cost there is no ratio, and no picture to draw.
    c = report("c.json", [result("kvtier", 1, 2, 0.5, 0.5, 0.1, 10)])
    assert kp.infinite_frontier_points([kp.load_report(c)])["passkey"][0].time_ratio is None
    said = []
    kp.make_pictures([kp.load_report(c)], str(tmp_path / "out"), say=said.append, table=lambda _t: None)
    assert any("skipped infinite-frontier-passkey.png" in x for x in said), said
