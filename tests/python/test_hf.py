"""kvtier.hf on the exported kvtier-tiny: generation through a KvtierCache whose budget covers
the whole context gives the logits of transformers' own eager attention; retrieval generates
the passkey; misuse raises."""
import pytest
import torch
from transformers import DynamicCache

import kvtier
import kvtier.tools
import kvtier.hf as kh



def prompt(context, task="passkey", index=0):
    s = kvtier.tools.make_samples(task, context, index + 1)[index]
    return torch.tensor([list(s["prompt"])]), s["answer"]


def kvtier_windows(model, ids, cache, window=64):
    """Logits of every token, the prompt run through the cache in windows."""
    out = []
    with torch.no_grad():
        for b in range(0, ids.shape[1], window):
            out.append(model(input_ids=ids[:, b:b + window], use_cache=True, **kh.cache_arg(model, cache)).logits)
    return torch.cat(out, 1)


def full_cache(model, **kw):
    # Every sealed chunk, keys as transformers rotates them: full attention computed by kvtier.
    opts = dict(positions="absolute", retrieve=False, n_sink=16, n_local=256, chunk_size=32, max_context=4096)
    opts.update(kw)
    return kh.KvtierCache(model.config, **opts)


def test_full_budget_prefill_logits_equal_eager(hf_model):
    ids, _ = prompt(640)  # sinks 16 + local 256: over half the prompt sits in sealed chunks
    with torch.no_grad():
        kh.use_kvtier(hf_model, False)
        want = hf_model(ids).logits
        kh.use_kvtier(hf_model, True)
        cache = full_cache(hf_model)
        got = kvtier_windows(hf_model, ids, cache)
    kh.use_kvtier(hf_model, False)
    assert cache.get_seq_length() == ids.shape[1]
    assert cache.session.counters()["chunks_attended"] > 0  # the chunks were attended, not skipped
    # Every position of the prompt: fp32 rounding, amplified through kvtier-tiny's layers, puts
    # some prompt positions ~1.6e-4 apart at a logit scale of ~24 (eager alone is ~3e-4 from
    # float64 there, see below); 1e-5 of the scale bounds it. The generated steps (next test)
    # meet 1e-4 absolute.
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_full_budget_generation_logits_equal_eager(hf_model):
    # Greedy generate with the kvtier cache vs transformers' eager attention with its
    # DynamicCache, both prefilled the same way: every step's logits.
    ids, _ = prompt(600)
    steps = 6
    results = {}
    for name in ("eager", "kvtier"):
        kh.use_kvtier(hf_model, name == "kvtier")
        cache = full_cache(hf_model) if name == "kvtier" else DynamicCache()
        with torch.no_grad():
            kh.prefill(hf_model, ids[:, :-1], cache, 64)
            out = hf_model.generate(ids, **kh.cache_arg(hf_model, cache), max_new_tokens=steps, do_sample=False,
                                    attention_mask=torch.ones_like(ids), output_logits=True,
                                    return_dict_in_generate=True)
        results[name] = (out.sequences, torch.stack(out.logits))
    kh.use_kvtier(hf_model, False)
    assert torch.equal(results["eager"][0], results["kvtier"][0])
    assert results["kvtier"][1].shape[0] == steps
    assert (results["eager"][1] - results["kvtier"][1]).abs().max().item() <= 1e-4


def test_longer_context_error_is_eager_fp32_noise(hf_model):
    # At ~1K tokens fp32 rounding alone moves eager's logits by a few 1e-4 from float64; kvtier's
    # kernel must be no farther from float64 than eager is.
    ids, _ = prompt(1000)
    with torch.no_grad():
        kh.use_kvtier(hf_model, False)
        eager = hf_model(ids).logits.double()
        exact = hf_model.double()(ids).logits
        hf_model.float()
        kh.use_kvtier(hf_model, True)
        got = kvtier_windows(hf_model, ids, full_cache(hf_model)).double()
    kh.use_kvtier(hf_model, False)
    assert (got - exact).abs().max().item() <= max((eager - exact).abs().max().item(), 1e-4)


def test_retrieval_generates_the_passkey(hf_model):
    # The default path: InfLLM positions and the kvtier preset, over a prompt 8x kvtier-tiny's
    # training length; kvtier-tiny answers it (kvtier infinite: 1.0 at 4K).
    ids, answer = prompt(4096)
    kh.use_kvtier(hf_model, True)
    cache = kh.KvtierCache(hf_model.config, n_sink=16, n_local=256, budget_tokens=256, max_context=4096)
    out = kh.generate(hf_model, ids, cache, max_new_tokens=len(answer))
    kh.use_kvtier(hf_model, False)
    assert bytes(out[0].tolist()) == answer
    c = cache.session.counters()
    assert c["steps"] == (ids.shape[1] - 1 + 63) // 64 + len(answer)
    assert 0 < c["max_layer_chunks"] <= 4 * 256 // 32  # the entropy allocator: at most L * k chunks


def test_hf_misuse_raises(hf_model):
    ids, _ = prompt(600)
    kh.use_kvtier(hf_model, True)
    try:
        with pytest.raises(kvtier.FailedPrecondition, match="KvtierCache"):
            with torch.no_grad():
                hf_model(ids[:, :10], use_cache=False)
        cache = full_cache(hf_model)
        with pytest.raises(kvtier.InvalidArgument, match="local window"):
            with torch.no_grad():
                hf_model(ids, use_cache=True, **kh.cache_arg(hf_model, cache))  # 600 tokens > n_local 256
        with pytest.raises(kvtier.InvalidArgument, match="batch size"):
            with torch.no_grad():
                hf_model(ids[:, :8].repeat(2, 1), use_cache=True, **kh.cache_arg(hf_model, full_cache(hf_model)))
        with pytest.raises(kvtier.InvalidArgument, match="prefill_window"):
            full_cache(hf_model, prefill_window=1000)
        with pytest.raises(kvtier.InvalidArgument, match="unknown preset"):
            full_cache(hf_model, preset="nope")
        with pytest.raises(kvtier.InvalidArgument, match="unknown option"):
            full_cache(hf_model, bogus=1)
    finally:
        kh.use_kvtier(hf_model, False)


def test_generate_returns_the_new_tokens_of_model_generate(hf_model):
    # Documented: kvtier.hf.generate returns what model.generate appends to the prompt, no more.
    ids, _ = prompt(300)
    kh.use_kvtier(hf_model, False)
    with torch.no_grad():
        full = hf_model.generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids))
    new = kh.generate(hf_model, ids, None, max_new_tokens=4)  # DynamicCache: the model's own attention
    assert new.shape == (1, 4)
    assert torch.equal(torch.cat([ids, new], dim=1), full)


def test_import_without_torch_says_how_to_install():
    import subprocess
    import sys

    code = ("import sys\n"
            "sys.modules['torch'] = None  # as if torch were not installed\n"
            "import kvtier  # the engine API needs no torch\n"
            "try:\n"
            "    import kvtier.hf\n"
            "except ImportError as e:\n"
            "    print('ImportError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ImportError: kvtier.hf needs torch and transformers" in r.stdout, r.stdout
    assert "pip install 'kvtier[hf]'" in r.stdout and "torch" in r.stdout
