"""kvtier.tools.export_hf: transformers' Llama on the exported weights computes what kvtier's
reference model (models/model.py, which integration/model/llama.cc reproduces) does."""
import importlib.util
import os
import sys

import pytest
import torch

import kvtier
import kvtier.tools
import kvtier.hf as kh

from conftest import ROOT, WEIGHTS


def reference_model():
    spec = importlib.util.spec_from_file_location("kvtier_model_ref", os.path.join(ROOT, "models", "model.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(ROOT, "models"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    return mod.load(WEIGHTS).eval()


def prompt(context, task="passkey", index=0):
    s = kvtier.tools.make_samples(task, context, index + 1)[index]
    return torch.tensor([list(s["prompt"])]), s["answer"]


def test_export_matches_kvtier_reference_model(hf_model):
    # models/model.py is the reference integration/model/llama.cc reproduces (~1e-6).
    ids, _ = prompt(480)  # within kvtier-tiny's 512-byte training length
    ref = reference_model()
    kh.use_kvtier(hf_model, False)
    with torch.no_grad():
        want = ref(ids)
        got = hf_model(ids).logits
    assert got.shape == (1, ids.shape[1], 256)
    # transformers computes RoPE angles in fp32, the reference in float64: at a logit scale of
    # ~20 that alone is a few 1e-4 at the prompt's end, so 1e-3 here; the greedy choice at every
    # position must agree.
    assert (got - want).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_tokenizer_is_the_byte_vocabulary(hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    text = "pass key 12345\n"
    assert tok(text).input_ids == list(text.encode())
    assert tok.decode(list(b"hello")) == "hello"


def test_cli_finds_the_shipped_weights_from_any_directory(tmp_path):
    import subprocess

    # From a directory with no models/ in it (and without the source tree on sys.path): the
    # package's own copy, installed with it.
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "kvtier.tools.export_hf", "--out", str(out)], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    import kvtier.tools.export_hf as ex

    # The first place looked at is the package's own copy (kvtier/models/), and it is there.
    found = ex.default_weights()
    assert found == os.path.join(os.path.dirname(os.path.abspath(kvtier.__file__)), "models", "kvtier-tiny.safetensors")
    assert open(found, "rb").read() == open(WEIGHTS, "rb").read()


def test_cli_says_when_the_weights_are_missing(tmp_path, monkeypatch, capsys):
    import kvtier.tools.export_hf as ex

    monkeypatch.setattr(ex, "weights_candidates", lambda: [str(tmp_path / "nowhere.safetensors")])
    with pytest.raises(SystemExit) as e:
        ex.main(["--out", str(tmp_path / "hf")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "the shipped weights were not found (looked for " + str(tmp_path / "nowhere.safetensors") in err
    assert "--weights FILE" in err
    with pytest.raises(SystemExit):
        ex.main(["--weights", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "hf")])
    assert "no such file" in capsys.readouterr().err
