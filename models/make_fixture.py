"""Writes the tiny kvtier-llama test fixture (seeded random weights, no training).

Regenerate from the repository root with:

    /usr/bin/python3 models/make_fixture.py --out-dir tests/fixtures

Files written (all little-endian):
  tiny_llama.safetensors      fp32 weights, config in __metadata__
  tiny_llama_f16.safetensors  the same weights rounded to fp16
  tiny_llama_logits.bin       int32 n_tokens, int32 tokens[n_tokens] (bytes 0..255),
                              float32 logits[n_tokens][256] of the fp32 model (positions 0..n-1)

Weights are deliberately larger than the usual N(0, 0.02) init so that
activations, attention patterns and logits are far from uniform and the C++
comparison tests something: embeddings ~N(0, 1), linear layers ~N(0, 1/fan_in),
norm gains ~1 + N(0, 0.1^2).
"""
import argparse
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as kvmodel  # noqa: E402
import safetensors_io  # noqa: E402

CONFIG = {"vocab": 256, "d_model": 64, "n_layers": 2, "q_heads": 4, "kv_heads": 2, "ffn_hidden": 128,
          "rope_theta": 10000.0, "norm_eps": 1e-5}
PROMPT = b"The quick brown fox jumps over the lazy dog 0123456789!"  # 55 bytes
SEED = 1234


def random_model(cfg, seed):
    torch.manual_seed(seed)
    m = kvmodel.build(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name == "embed.weight":
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[1] ** 0.5))
    return m.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    m = random_model(CONFIG, SEED)
    meta = kvmodel.config_to_metadata(CONFIG)
    tensors = m.tensors()
    safetensors_io.save(os.path.join(args.out_dir, "tiny_llama.safetensors"), tensors, meta, "F32")
    safetensors_io.save(os.path.join(args.out_dir, "tiny_llama_f16.safetensors"), tensors, meta, "F16")

    # The reference logits come from the fp32 file read back, so the writer is checked too.
    m2 = kvmodel.load(os.path.join(args.out_dir, "tiny_llama.safetensors")).eval()
    tokens = torch.tensor(list(PROMPT), dtype=torch.int64)
    with torch.no_grad():
        logits = m2(tokens).float().numpy()
        assert np.array_equal(logits, m(tokens).float().numpy()), "read-back model differs"
    with open(os.path.join(args.out_dir, "tiny_llama_logits.bin"), "wb") as f:
        f.write(struct.pack("<i", len(PROMPT)))
        f.write(np.asarray(list(PROMPT), dtype="<i4").tobytes())
        f.write(logits.astype("<f4").tobytes())
    print("wrote %s: %d tokens, logits std %.3f, max |logit| %.3f" %
          (args.out_dir, len(PROMPT), logits.std(), np.abs(logits).max()))


if __name__ == "__main__":
    main()
