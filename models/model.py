"""Reference implementation (torch, fp32) of kvtier's small Llama-style model.

The C++ forward pass (integration/model/llama.cc) must reproduce these logits;
see models/README.md for the architecture and the file formats. Training code
builds on the same module, so it is a plain nn.Module with named parameters
that map 1:1 onto the safetensors tensor names (state_dict()).
"""
import math

import torch
from torch import nn

MODEL_NAME = "kvtier-llama"
CONFIG_KEYS = ("vocab", "d_model", "n_layers", "q_heads", "kv_heads", "ffn_hidden", "rope_theta", "norm_eps")
_INT_KEYS = ("vocab", "d_model", "n_layers", "q_heads", "kv_heads", "ffn_hidden")


def config_from_metadata(meta):
    """safetensors __metadata__ (all strings) -> config dict with numbers."""
    if meta.get("model") != MODEL_NAME:
        raise ValueError("metadata model is %r, expected %r" % (meta.get("model"), MODEL_NAME))
    cfg = {}
    for k in CONFIG_KEYS:
        cfg[k] = int(meta[k]) if k in _INT_KEYS else float(meta[k])
    return cfg


def config_to_metadata(cfg):
    """Config dict -> safetensors __metadata__ (strings; floats as repr so they read back exactly)."""
    meta = {"model": MODEL_NAME}
    for k in CONFIG_KEYS:
        meta[k] = str(int(cfg[k])) if k in _INT_KEYS else repr(float(cfg[k]))
    return meta


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(n, head_dim, theta, start=0):
    """cos, sin [n, head_dim] for positions start..start+n-1, Hugging Face Llama layout
    (the half-dim frequencies repeated twice). Angles are computed in float64 and
    rounded once, as the C++ side does, so both agree to the last bit or so."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    pos = torch.arange(start, start + n, dtype=torch.float64)
    ang = torch.outer(pos, inv_freq)
    ang = torch.cat([ang, ang], dim=-1)
    return torch.cos(ang).float(), torch.sin(ang).float()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, hq, hkv, f = cfg["d_model"], cfg["q_heads"], cfg["kv_heads"], cfg["ffn_hidden"]
        self.hq, self.hkv, self.hd = hq, hkv, d // hq
        self.attn_norm = RMSNorm(d, cfg["norm_eps"])
        self.wq = nn.Linear(d, hq * self.hd, bias=False)
        self.wk = nn.Linear(d, hkv * self.hd, bias=False)
        self.wv = nn.Linear(d, hkv * self.hd, bias=False)
        self.wo = nn.Linear(hq * self.hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg["norm_eps"])
        self.w_gate = nn.Linear(d, f, bias=False)
        self.w_up = nn.Linear(d, f, bias=False)
        self.w_down = nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, n, self.hq, self.hd).transpose(1, 2)   # [b, hq, n, hd]
        k = self.wk(h).view(b, n, self.hkv, self.hd).transpose(1, 2)  # [b, hkv, n, hd]
        v = self.wv(h).view(b, n, self.hkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.hq // self.hkv
        k = k.repeat_interleave(group, dim=1)  # q head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v  # [b, hq, n, hd]
        x = x + self.wo(att.transpose(1, 2).reshape(b, n, self.hq * self.hd))
        h = self.mlp_norm(x)
        return x + self.w_down(nn.functional.silu(self.w_gate(h)) * self.w_up(h))


class KvtierLlama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg["d_model"] % cfg["q_heads"] or cfg["q_heads"] % cfg["kv_heads"]:
            raise ValueError("d_model must be a multiple of q_heads and q_heads a multiple of kv_heads")
        if (cfg["d_model"] // cfg["q_heads"]) % 2:
            raise ValueError("head_dim must be even for RoPE")
        self.cfg = dict(cfg)
        self.embed = nn.Embedding(cfg["vocab"], cfg["d_model"])
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.lm_head = nn.Linear(cfg["d_model"], cfg["vocab"], bias=False)

    def forward(self, tokens):
        """tokens: [n] or [b, n] int64 -> logits [n, vocab] or [b, n, vocab] (positions 0..n-1)."""
        squeeze = tokens.dim() == 1
        if squeeze:
            tokens = tokens[None]
        hd = self.cfg["d_model"] // self.cfg["q_heads"]
        cos, sin = rope_cos_sin(tokens.shape[1], hd, self.cfg["rope_theta"])
        cos, sin = cos.to(self.embed.weight.device), sin.to(self.embed.weight.device)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.final_norm(x))
        return logits[0] if squeeze else logits

    def tensors(self):
        """{safetensors name: fp32 tensor} in kvtier's naming."""
        out = {}
        for name, p in self.state_dict().items():
            name = name.replace(".weight", "")
            out[name] = p.detach().float().contiguous()
        return out

    def load_tensors(self, tensors):
        """Inverse of tensors(): {kvtier name: array} -> parameters (shapes checked by torch)."""
        state = {}
        for name in self.state_dict():
            key = name.replace(".weight", "")
            if key not in tensors:
                raise KeyError("missing tensor " + key)
            state[name] = torch.as_tensor(tensors[key], dtype=torch.float32)
        self.load_state_dict(state)


def build(cfg):
    """Model with default (untrained) weights from a config dict."""
    return KvtierLlama(cfg)


def load(path):
    """Model from a kvtier-llama safetensors file."""
    try:
        from safetensors_io import load as load_st
    except ImportError:
        from models.safetensors_io import load as load_st
    tensors, meta = load_st(path)
    model = KvtierLlama(config_from_metadata(meta))
    model.load_tensors(tensors)
    return model
