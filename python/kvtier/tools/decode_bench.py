"""Per-token decode time of transformers + kvtier against kvtier's C++ model path, in one process
on the same prompt: the shipped model exported (kvtier.tools.export_hf) and the same weights run by
integration/model/llama.cc, both over a kvtier store with `kvtier infinite`'s settings (sinks 16,
local 256, chunks of 32, budget 256, InfLLM positions, the kvtier preset).

    python -m kvtier.tools.decode_bench --model HF_DIR [--weights models/kvtier-tiny.safetensors] \\
        [--context 32768] [--tokens 64]

Both paths prefill all but the prompt's last token in windows of 64, then decode greedily; the
decode steps alternate (one transformers step, one C++ step), so that both see the same machine
load. Prints the median and mean milliseconds per token of each and their ratio, and whether the
two produced the same tokens.
"""
import argparse
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

import kvtier
import kvtier.tools
import kvtier.hf as kh
from kvtier.tools.export_hf import default_weights


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tools.decode_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the exported checkpoint (python -m kvtier.tools.export_hf)")
    ap.add_argument("--weights", default=default_weights(), help="the kvtier-llama file it was exported from")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    ap.add_argument("--task", default="passkey")
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    sample = kvtier.tools.make_samples(a.task, a.context, 1)[0]
    prompt = sample["prompt"]
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation=kh.ATTENTION_NAME).eval()
    cache = kh.KvtierCache(model.config, max_context=a.context + a.tokens + 64, n_sink=16, n_local=256,
                           chunk_size=32, budget_tokens=256, transfer_threads=2)
    cpp = kvtier.tools.CppLlama(a.weights, a.context + a.tokens + 64)

    t0 = time.perf_counter()
    kh.prefill(model, torch.tensor([list(prompt[:-1])]), cache, 64)
    t1 = time.perf_counter()
    cpp.prefill(prompt[:-1], 64)
    t2 = time.perf_counter()

    hf_ms, cpp_ms, hf_tok, cpp_tok = [], [], [prompt[-1]], [prompt[-1]]
    with torch.no_grad():
        for _ in range(a.tokens):
            s = time.perf_counter()
            logits = model(input_ids=torch.tensor([[hf_tok[-1]]]), use_cache=True, **kh.cache_arg(model, cache)).logits
            hf_tok.append(int(logits[0, -1].argmax()))
            e = time.perf_counter()
            hf_ms.append(1e3 * (e - s))
            s = time.perf_counter()
            out = cpp.decode(cpp_tok[-1])
            cpp_tok.append(max(range(len(out)), key=out.__getitem__))
            e = time.perf_counter()
            cpp_ms.append(1e3 * (e - s))
    hm, cm = statistics.median(hf_ms), statistics.median(cpp_ms)
    print(f"decode at {a.context} bytes ({a.task} prompt), {a.tokens} tokens, transformers "
          f"{kh.transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} torch threads")
    print(f"  prefill: transformers + kvtier {t1 - t0:.2f} s, C++ {t2 - t1:.2f} s")
    print(f"  transformers + kvtier: {hm:.3f} ms/token median, {statistics.mean(hf_ms):.3f} mean")
    print(f"  C++ model path:        {cm:.3f} ms/token median, {statistics.mean(cpp_ms):.3f} mean")
    print(f"  ratio (transformers / C++): {hm / cm:.2f} median, {statistics.mean(hf_ms) / statistics.mean(cpp_ms):.2f} mean")
    print(f"  same tokens: {hf_tok == cpp_tok}; answer {sample['answer']!r}, decoded "
          f"{bytes(hf_tok[1:1 + len(sample['answer'])])!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
