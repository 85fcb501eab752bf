"""Writes a kvtier-llama safetensors file (models/kvtier-tiny.safetensors) as a Hugging Face
`LlamaForCausalLM` checkpoint: config.json, model.safetensors (fp32) and a byte-level tokenizer
whose token ids are the bytes themselves, the model's vocabulary.

    python -m kvtier.tools.export_hf [--weights models/kvtier-tiny.safetensors] --out DIR

Without --weights it exports the shipped kvtier-tiny from any directory: the copy installed in
the package (kvtier/models/, put there by `pip install .`), else the source tree's models/.

The mapping follows integration/model/llama.cc (and models/README.md), which transformers'
Llama computes identically: RMSNorm `x * rsqrt(mean(x^2) + norm_eps) * w`, rotate-half RoPE
with base rope_theta over the whole head, attention scaled by 1/sqrt(head_dim), GQA, a SiLU
gated MLP, no biases, and an lm_head of its own (embeddings are not tied). Weights are stored
row-major [out, in] as torch.nn.Linear keeps them, so they copy over unchanged.
"""
import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

Config = Dict[str, Any]
Tensors = Dict[str, npt.NDArray[np.float32]]

MODEL_NAME = "kvtier-llama"
_INT_KEYS = ("vocab", "d_model", "n_layers", "q_heads", "kv_heads", "ffn_hidden")
_FLOAT_KEYS = ("rope_theta", "norm_eps")

# kvtier name -> transformers name; "{i}" is the layer.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}


def read_kvtier(path: str) -> Tuple[Config, Tensors]:
    """(config dict, {kvtier name: float32 array}) of a kvtier-llama safetensors file."""
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        meta = f.metadata() or {}
        if meta.get("model") != MODEL_NAME:
            raise ValueError(f"{path}: __metadata__ 'model' is {meta.get('model')!r}, expected {MODEL_NAME!r}")
        cfg: Config = {}
        for k in _INT_KEYS:
            cfg[k] = int(meta[k])
        for k in _FLOAT_KEYS:
            cfg[k] = float(meta[k])
        tensors = {name: f.get_tensor(name).astype(np.float32) for name in f.keys()}
    return cfg, tensors


def hf_config(cfg: Config) -> Config:
    head_dim = cfg["d_model"] // cfg["q_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg["vocab"],
        "hidden_size": cfg["d_model"],
        "intermediate_size": cfg["ffn_hidden"],
        "num_hidden_layers": cfg["n_layers"],
        "num_attention_heads": cfg["q_heads"],
        "num_key_value_heads": cfg["kv_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg["norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "rope_scaling": None,
        # RoPE here has no length-dependent scaling; this bounds nothing but what transformers
        # reports. kvtier-tiny was trained on 512-byte sequences and reaches far beyond them
        # through kvtier's InfLLM positions.
        "max_position_embeddings": 1 << 20,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        # A byte vocabulary has no special tokens: generation runs for max_new_tokens.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }


def hf_tensors(cfg: Config, tensors: Tensors) -> Tensors:
    want: Dict[str, Tuple[int, ...]] = {"embed": (cfg["vocab"], cfg["d_model"]), "final_norm": (cfg["d_model"],),
                                        "lm_head": (cfg["vocab"], cfg["d_model"])}
    out = {
        "model.embed_tokens.weight": tensors["embed"],
        "model.norm.weight": tensors["final_norm"],
        "lm_head.weight": tensors["lm_head"],
    }
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise ValueError(f"tensor {name!r} has shape {tensors[name].shape}, expected {shape}")
    for i in range(cfg["n_layers"]):
        for src, dst in _LAYER_NAMES.items():
            out[f"model.layers.{i}.{dst}.weight"] = tensors[f"layers.{i}.{src}"]
    extra = set(tensors) - {"embed", "final_norm", "lm_head"} - {
        f"layers.{i}.{s}" for i in range(cfg["n_layers"]) for s in _LAYER_NAMES}
    if extra:
        raise ValueError(f"unexpected tensors {sorted(extra)}")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte-level alphabet: byte b -> a printable character (the ByteLevel pre-tokenizer's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_tokenizer(out_dir: str) -> None:
    """A tokenizers BPE without merges over the byte-level alphabet: token id == byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                   "clean_up_tokenization_spaces": False}, f, indent=2)


def export(weights: str, out_dir: str) -> Config:
    """Writes the checkpoint to out_dir (created); returns the transformers config dict."""
    from safetensors.numpy import save_file

    cfg, tensors = read_kvtier(weights)
    os.makedirs(out_dir, exist_ok=True)
    config = hf_config(cfg)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(hf_tensors(cfg, tensors), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, f)
    write_tokenizer(out_dir)
    return config


WEIGHTS_NAME = "kvtier-tiny.safetensors"


def weights_candidates() -> List[str]:
    """Where the shipped weights are looked for, in order: the package's own copy (the wheel
    carries models/kvtier-tiny.safetensors as kvtier/models/), the source tree around the
    package (python/kvtier/../../models, when run from a checkout), the source tree pip
    installed from (its direct_url.json), and the current directory's models/."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the kvtier package
    roots = [here, os.path.join(here, "..", "..")]
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            text = distribution("kvtier").read_text("direct_url.json")
        except PackageNotFoundError:
            text = None
        url = json.loads(text).get("url", "") if text else ""
        if url.startswith("file://"):
            from urllib.parse import unquote, urlparse

            roots.append(unquote(urlparse(url).path))
    except (ImportError, ValueError):
        pass
    roots.append(os.getcwd())
    out: List[str] = []
    for root in roots:
        p = os.path.normpath(os.path.join(root, "models", WEIGHTS_NAME))
        if p not in out:
            out.append(p)
    return out


def default_weights() -> Optional[str]:
    """The shipped models/kvtier-tiny.safetensors (weights_candidates()), or None."""
    for p in weights_candidates():
        if os.path.isfile(p):
            return p
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tools.export_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", help="kvtier-llama safetensors file (default: the shipped "
                    "kvtier-tiny.safetensors, installed with the package)")
    ap.add_argument("--out", required=True, help="output directory of the transformers checkpoint")
    a = ap.parse_args(argv)
    weights = a.weights or default_weights()
    if not weights:
        ap.error("the shipped weights were not found (looked for " + ", ".join(weights_candidates()) +
                 "): pass --weights FILE, or reinstall the package from a checkout (pip install .)")
    elif not os.path.isfile(weights):
        ap.error(f"--weights {weights}: no such file")
    config = export(weights, a.out)
    print(f"wrote {a.out}: LlamaForCausalLM, {config['num_hidden_layers']} layers, d_model {config['hidden_size']}, "
          f"{config['num_attention_heads']}/{config['num_key_value_heads']} heads, rope_theta {config['rope_theta']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
