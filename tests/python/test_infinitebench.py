"""Passkey at 16K and 32K bytes through transformers' generate with the kvtier cache
(kvtier.tools.infinitebench) against `kvtier infinite` on the same prompts: the same accuracy and the
same decoded answer for every sample, 4 samples at 16K and 2 at 32K."""
import json
import os
import subprocess

import pytest

import kvtier.tools.infinitebench as ib

from conftest import ROOT, WEIGHTS

SAMPLES = {16384: 4, 32768: 2}


def kvtier_cli():
    # ctest passes the binary of its build (Python.Package's KVTIER_CLI); by hand, a build of
    # the default directory.
    path = os.environ.get("KVTIER_CLI") or os.path.join(ROOT, "build", "kvtier")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no kvtier CLI at {path} (set KVTIER_CLI)")
    return path


# One test per context, so that ctest can run them side by side (CMakeLists.txt splits the file by -k).
@pytest.mark.parametrize("context", [16384, 32768])
def test_passkey_matches_kvtier_infinite(hf_dir, tmp_path, capsys, context):
    cli_json = tmp_path / "cli.json"
    subprocess.run([kvtier_cli(), "infinite", "--weights", WEIGHTS, "--task", "passkey", "--contexts", str(context),
                    "--samples", str(SAMPLES[context]), "--quiet", "--json", str(cli_json)], check=True,
                   stdout=subprocess.DEVNULL)
    py_json = tmp_path / "py.json"
    assert ib.main(["--model", hf_dir, "--task", "passkey", "--context", str(context), "--samples",
                    str(SAMPLES[context]), "--quiet", "--json", str(py_json)]) == 0
    printed = capsys.readouterr().out
    cli = json.loads(cli_json.read_text())["results"]
    py = json.loads(py_json.read_text())["results"]
    assert [r["context"] for r in py] == [r["context"] for r in cli] == [context]
    for c, p in zip(cli, py):
        assert p["samples"] == c["samples"] == SAMPLES[context]
        assert p["accuracy"] == c["accuracy"]
        assert p["outputs"] == c["outputs"]  # sample by sample
        # The same chunks per step; needle recall may move by a (step, layer) or two: transformers
        # applies RoPE before the cache sees keys, and undoing it in fp32 can flip a tie-close
        # chunk choice that does not change the answer.
        assert p["chunks_per_layer_step"] == pytest.approx(c["chunks_per_layer_step"], rel=0.02)
        assert p["needle_recall"] == pytest.approx(c["needle_recall"], abs=0.05)
        assert f"context {p['context']}: accuracy {p['accuracy']:.3f}" in printed  # kvtier infinite's line


def test_runner_rejects_bad_flags(hf_dir):
    with pytest.raises(SystemExit):
        ib.main(["--model", hf_dir, "--task", "nope"])
    with pytest.raises(SystemExit):
        ib.main(["--model", hf_dir, "--context", "0"])
    with pytest.raises(SystemExit):
        ib.main(["--model", hf_dir, "--window", "300", "--local", "256"])


# ---- ∞-Bench's own task files (--data) ----------------------------------------------------------------

FIXTURES = os.path.join(ROOT, "tests", "data", "infbench")


def write_data(tmp_path, task, contexts, samples, seed=3):
    out = tmp_path / "data"
    subprocess.run([kvtier_cli(), "infinite", "--task", task, "--contexts", contexts, "--samples", str(samples),
                    "--seed", str(seed), "--write-data", str(out)], check=True, stdout=subprocess.DEVNULL)
    return str(out)


def lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_data_scores_as_kvtier_infinite_data_and_the_generator(hf_dir, tmp_path):
    """The generator's samples written as a task file: through transformers with --data every method
    scores as `kvtier infinite --data` does, kvtier's predictions are the C++ path's byte for byte, and
    the accuracy is the generator path's."""
    data = write_data(tmp_path, "passkey", "1024,2048", 2)
    py_json, cli_json = tmp_path / "py.json", tmp_path / "cli.json"
    assert ib.main(["--model", hf_dir, "--data", data, "--compare", "--quiet", "--predictions",
                    str(tmp_path / "py"), "--json", str(py_json)]) == 0
    subprocess.run([kvtier_cli(), "infinite", "--weights", WEIGHTS, "--data", data, "--compare", "--quiet",
                    "--predictions", str(tmp_path / "cli"), "--json", str(cli_json)], check=True,
                   stdout=subprocess.DEVNULL)
    py = {r["method"]: r["score"] for r in json.loads(py_json.read_text())["results"]}
    cli = {r["method"]: r["score"] for r in json.loads(cli_json.read_text())["results"]}
    assert py["HF full attention"] == cli["full attention"]
    for m in ("StreamingLLM", "InfLLM", "ActQKV", "kvtier"):
        assert py[m] == cli[m], m
    assert lines(tmp_path / "py" / "kvtier" / "preds_passkey.jsonl") == \
        lines(tmp_path / "cli" / "kvtier" / "preds_passkey.jsonl")
    gen_json = tmp_path / "gen.json"
    assert ib.main(["--model", hf_dir, "--task", "passkey", "--context", "1024,2048", "--samples", "2", "--seed",
                    "3", "--quiet", "--json", str(gen_json)]) == 0
    gen = json.loads(gen_json.read_text())["results"]
    assert sum(r["correct"] for r in gen) / 4 == py["kvtier"]


def test_every_task_of_the_official_schema_runs(hf_dir, tmp_path, capsys):
    assert ib.main(["--model", hf_dir, "--data", FIXTURES, "--template", "gpt4", "--max-new-tokens", "3",
                    "--quiet", "--predictions", str(tmp_path), "--json", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert len(rep["tasks"]) == 12
    for t in rep["tasks"]:
        got = lines(tmp_path / "kvtier" / f"preds_{t}.jsonl")
        assert got and set(got[0]) == {"id", "prediction", "ground_truth"}
    assert "| longbook_choice_eng" in capsys.readouterr().out
    for r in rep["results"]:
        assert r["run"]["peak_rss_bytes"] > 0 and r["run"]["tier_bytes"]["warm_bytes"] >= 0


def test_a_run_resumes_after_the_samples_already_predicted(hf_dir, tmp_path, capsys):
    data = write_data(tmp_path, "number_string", "1024", 3)
    preds = tmp_path / "p"
    assert ib.main(["--model", hf_dir, "--data", data, "--samples", "1", "--quiet", "--predictions", str(preds)]) == 0
    path = preds / "kvtier" / "preds_number_string.jsonl"
    assert len(lines(path)) == 1
    with open(path, "a") as f:
        f.write('{"id": 1, "predic')  # a line cut short by a kill
    capsys.readouterr()
    assert ib.main(["--model", hf_dir, "--data", data, "--quiet", "--predictions", str(preds)]) == 0
    out = capsys.readouterr().out
    assert "over 3 samples (1 from" in out and "2 run now" in out, out
    assert [r["id"] for r in lines(path)] == [0, 1, 2]
    whole = tmp_path / "w"
    assert ib.main(["--model", hf_dir, "--data", data, "--quiet", "--predictions", str(whole)]) == 0
    assert lines(path) == lines(whole / "kvtier" / "preds_number_string.jsonl")


def test_data_errors_are_named(hf_dir, tmp_path):
    bad = tmp_path / "passkey.jsonl"
    bad.write_text('{"id": 0, "context": "c", "input": "i"}\n')
    with pytest.raises(SystemExit, match="passkey.jsonl:1: field 'answer' is missing"):
        ib.main(["--model", hf_dir, "--data", str(bad), "--quiet"])
    with pytest.raises(SystemExit, match="apply to --data"):
        ib.main(["--model", hf_dir, "--truncate", "10"])
    with pytest.raises(SystemExit, match="template family"):
        ib.main(["--model", hf_dir, "--data", FIXTURES, "--template", "llama-9", "--quiet"])


def test_scoring_through_the_binding():
    import kvtier
    import kvtier.tools as t

    assert t.infbench_score("passkey", "The pass key is 71432.", '["71432"]') == 1.0
    assert t.infbench_score("longbook_qa_eng", "Eiffel Tower, in Paris", '["the Eiffel Tower"]') == pytest.approx(2 / 3)
    assert t.infbench_score("math_calc", "Values: 5 1 4 8", "[1, 4, 8]", "gpt4") == 1.0
    assert t.infbench_truncate([1, 2, 3, 4, 5], 5) == [1, 2, 3, 4, 5]
    assert t.infbench_truncate(list(range(10)), 5) == [0, 1, 7, 8, 9]  # Python's x[:5 // 2] + x[-5 // 2:]
    assert t.infbench_max_new_tokens("kv_retrieval") == 50
    with pytest.raises(kvtier.InvalidArgument):
        t.infbench_score("code_debug", "A", '["f"]')


def test_rouge_lsum_is_rouge_scores():
    """The C++ ROUGE-Lsum against the rouge_score package (what HF evaluate's "rouge" runs), on texts
    with repeats, punctuation, case and several sentences."""
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    import random

    import kvtier.tools as t

    scorer = rouge_scorer.RougeScorer(["rougeLsum"])
    rng = random.Random(5)
    words = ["The", "cat", "sat", "on", "the", "mat", "dog", "ran", "away,", "home.", "A", "42", "Mat!"]
    for _ in range(200):
        def text():
            return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(0, 9)))
                             for _ in range(rng.randint(1, 3)))
        ref, pred = text(), text()
        want = scorer.score(ref, pred)["rougeLsum"].fmeasure
        assert t.infbench_rouge_lsum(pred, ref) == pytest.approx(want, abs=1e-12), (ref, pred)
