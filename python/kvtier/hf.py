"""kvtier as the KV memory of Hugging Face transformers models (Llama, Qwen2, Mistral and the
other decoder models whose attention goes through transformers' attention-function registry).

    import kvtier.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvtier")
    cache = kvtier.hf.KvtierCache(model.config, max_context=32768)   # retrieval options as kwargs
    new_tokens = kvtier.hf.generate(model, input_ids, cache, max_new_tokens=8)  # the new tokens only

kvtier.hf needs torch and transformers (pip install 'kvtier[hf]' plus a torch of your choice);
without them `import kvtier.hf` raises an ImportError that says so.

Two pieces, meant to be used together:

* KvtierCache, a transformers `Cache`: each layer's new keys and values go into a kvtier
  Session (one sequence) instead of growing tensors; get_seq_length() drives generate's
  positions as usual.
* the attention function registered as "kvtier" (ALL_ATTENTION_FUNCTIONS in transformers
  4.48/4.49, AttentionInterface from 4.50): the layer's queries go to Session.attend, which
  attends over the sinks, the chunks retrieval picks under the budget, and the local window,
  and returns the output the model projects. The key/value tensors transformers hands it are
  not read (the session holds them), nor is the dense mask (kvtier's kernel masks causally by
  position).

The cache hands each layer's step to the attention function through a thread-local slot: in
these models Cache.update and the attention call are consecutive in one layer's forward, and
the function checks it got the very key tensor update returned, so a mismatch (attention
without the cache, another cache) raises instead of attending the wrong memory.

Positions (positions=): "infllm" (the default, as `kvtier infinite`): memory units sit at the
local window's start. transformers applies RoPE before the cache sees keys, so the cache
undoes it with plain rotate-half RoPE of the config's rope theta (computed here: transformers
5 no longer hands update the layer's cos/sin) and the session rotates again at attention time
with the same RoPE; models with another rope type (rope_scaling / rope_parameters) or a
partial rotary factor are refused in this mode. "absolute": keys and queries as transformers rotated
them; with retrieve=False (or a budget covering every chunk) this is the model's own full
attention, computed by kvtier.

Prefill: kvtier attends a window of queries after appending that window's keys, and the keys
must still be in the local window (n_local tokens), so long prompts go through `prefill()` in
windows of prefill_window tokens, every window through every layer (as `kvtier infinite`
does); a single forward longer than n_local raises. `generate()` prefills all but the prompt's
last token and lets model.generate run that token as its first decode step.
Batch size 1 (a Session is one sequence).

transformers versions: the Cache contract changed in 4.54 (a Cache is a list of per-layer
CacheLayerMixin objects that the masks and generate ask for get_seq_length / get_mask_sizes)
and again in 5.x (update no longer receives cos/sin or cache_position, the config's
rope_theta moved into rope_parameters, torch_dtype became dtype). KvtierCache answers both:
where CacheLayerMixin exists it hands Cache one _KvtierLayer per model layer (each a view of
the one session), and update takes the old cache_kwargs and the new keyword arguments alike.
Tested on 4.49 and on the current release (README, "Python").
"""
import inspect
import threading
from typing import Any, Callable, Dict, Optional, Tuple

try:
    import torch
    import transformers
    from transformers.cache_utils import Cache, DynamicCache
except ImportError as _e:
    _missing = getattr(_e, "name", None) or "torch or transformers"
    raise ImportError(
        f"kvtier.hf needs torch and transformers, and {_missing} cannot be imported ({_e}). Install them: "
        "pip install 'kvtier[hf]' (transformers, safetensors) and torch (pip install torch, or Debian's "
        "python3-torch); `import kvtier` itself needs neither") from _e

import kvtier

ATTENTION_NAME = "kvtier"
_TESTED_TRANSFORMERS = ("4.49", "5.24")

try:  # transformers >= 4.54: a Cache is a list of layers
    from transformers.cache_utils import CacheLayerMixin
except ImportError:  # 4.49: a Cache is one object
    CacheLayerMixin = None


def _disable_broken_fsdp_probe() -> None:
    """Debian's torch 1.13 cannot import torch.distributed.fsdp under Python 3.11 (one of its
    dataclasses has a default Python 3.11 refuses), and generate() in transformers 4.4x imports
    it to ask whether the model is FSDP-managed. Where that import fails, no model can be, so
    the probe is replaced by its answer. Nothing changes where the import works."""
    try:
        import torch.distributed.fsdp  # noqa: F401
    except ValueError:
        import transformers.generation.utils as gu

        if hasattr(gu, "is_fsdp_managed_module"):
            gu.is_fsdp_managed_module = lambda module: False


_disable_broken_fsdp_probe()

_local = threading.local()


class _Pending:
    """One layer's step, from Cache.update to the attention function."""

    __slots__ = ("cache", "layer", "key", "positions", "cos", "sin")

    def __init__(self, cache, layer, key, positions, cos, sin):
        self.cache, self.layer, self.key, self.positions, self.cos, self.sin = cache, layer, key, positions, cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undoes transformers' apply_rotary_pos_emb: x [b, heads, m, d], cos/sin [b, m, d]; fp32."""
    cos = cos.to(torch.float32).unsqueeze(1)
    sin = sin.to(torch.float32).unsqueeze(1)
    x = x.to(torch.float32)
    return x * cos - _rotate_half(x) * sin


def _rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain rotate-half RoPE (what transformers' default rope type computes, in fp32) for
    int64 positions [m]: cos, sin [1, m, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().unsqueeze(0), emb.sin().unsqueeze(0)


def _rope_of(text: Any) -> Tuple[str, float, float]:
    """(rope type, theta, partial rotary factor) of a config: rope_scaling and rope_theta in
    transformers 4.x, rope_parameters in 5.x."""
    params = getattr(text, "rope_parameters", None) or {}
    scaling = getattr(text, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0
    partial = params.get("partial_rotary_factor") or getattr(text, "partial_rotary_factor", None) or 1.0
    return rope_type, float(theta), float(partial)


_STORE_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


if CacheLayerMixin is not None:

    class _KvtierLayer(CacheLayerMixin):
        """One model layer of a KvtierCache for transformers >= 4.54, whose Cache delegates
        update, get_seq_length and get_mask_sizes to its layers. The tokens are in the
        cache's session; this object answers for them (no keys/values tensors)."""

        is_sliding = False
        supports_early_init = False

        def __init__(self, cache, layer_idx):
            super().__init__()
            self.cache, self.layer_idx = cache, layer_idx

        def lazy_initialization(self, key_states, value_states):
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            return self.cache.update(key_states, value_states, self.layer_idx, *args, **kwargs)

        def get_seq_length(self):
            return self.cache._seen

        def get_mask_sizes(self, query_length, *args):
            # Asked before this forward's update: the mask spans the tokens held plus the new ones.
            return self.cache._seen + query_length, 0

        def get_max_length(self):
            return -1

        def get_max_cache_shape(self):
            return -1

        def reset(self):
            raise NotImplementedError("KvtierCache cannot be reset: open a new cache")

        def reorder_cache(self, beam_idx):
            raise NotImplementedError("KvtierCache holds one sequence: beam search is not supported")


class KvtierCache(Cache):
    """A transformers Cache whose memory is a kvtier Store and Session (one sequence).

    Retrieval and policy options are keyword arguments, defaulting to the "kvtier" preset:
      preset        "kvtier" | "kvtier-fast" | "actqkv" | "infllm" (kvtier.preset_names())
      retrieve      False: attend every chunk (full attention through the store)
      budget_tokens retrieved tokens per layer and step (default: the library's, 2048)
      probe, alloc, index   override the preset's parts (spec strings, see docs/architecture.md)
      positions     "infllm" (default) | "absolute"
    Store options: n_sink (64), n_local (512), chunk_size (32), repr_topk (the preset's; every
    key of a chunk for "kvtier"), hot_bytes and warm_bytes (default: sized for max_context
    tokens: the warm tier holds every chunk, the hot pool what one layer may attend), dtype
    (the model's), data_dir (a cold tier), and any other kvtier.Store option.
    prefill_window: tokens per prefill forward in prefill() (<= n_local).
    """

    is_compileable = False

    def __init__(self, config: Any, *, max_context: int = 32768, preset: str = "kvtier", positions: str = "infllm",
                 retrieve: bool = True, budget_tokens: Optional[int] = None, probe: Optional[str] = None,
                 alloc: Optional[str] = None, index: Optional[str] = None, n_sink: int = 64, n_local: int = 512,
                 chunk_size: int = 32, repr_topk: Optional[int] = None, hot_bytes: Optional[int] = None,
                 warm_bytes: Optional[int] = None, dtype: Optional[str] = None, prefill_window: int = 64,
                 **store_options: Any) -> None:
        text = getattr(config, "text_config", None) or config
        n_layers = int(text.num_hidden_layers)
        if CacheLayerMixin is not None:
            super().__init__(layers=[_KvtierLayer(self, i) for i in range(n_layers)])
        else:
            super().__init__()
        self.n_layers = n_layers
        self.q_heads = int(text.num_attention_heads)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.q_heads)
        rope_type, rope_theta, partial = _rope_of(text)
        if positions == "infllm" and (rope_type != "default" or partial != 1.0):
            raise kvtier.InvalidArgument(
                "positions='infllm' rotates keys with plain RoPE (rope_theta) at attention time; this model has "
                f"rope type {rope_type!r}, partial rotary factor {partial}: use positions='absolute'")
        self.rope_theta = rope_theta
        if dtype is None:
            model_dtype = getattr(text, "dtype", None) if isinstance(getattr(text, "dtype", None), torch.dtype) else None
            model_dtype = model_dtype or getattr(text, "torch_dtype", None) or torch.float32
            dtype = _STORE_DTYPES.get(model_dtype, "f32")
        if not isinstance(prefill_window, int) or not 1 <= prefill_window <= n_local:
            raise kvtier.InvalidArgument(f"prefill_window must be in [1, n_local = {n_local}] (got {prefill_window!r})")
        p = kvtier.preset(preset)  # raises InvalidArgument for an unknown name
        if repr_topk is None:
            repr_topk = p["repr_topk"] or chunk_size
        budget = p["budget_tokens"] if budget_tokens is None else budget_tokens
        session_opts: Dict[str, Any] = dict(preset=preset, positions=positions, retrieve=retrieve,
                                            rope_theta=rope_theta)
        if budget_tokens is not None:
            session_opts["budget_tokens"] = budget_tokens
        for key, val in (("probe", probe), ("alloc", alloc), ("index", index)):
            if val is not None:
                session_opts[key] = val
        # Sizing as `kvtier infinite` does (engine/store_sizing.h): every chunk of max_context
        # fits in warm; the hot pool holds what one layer may attend, every chunk when not
        # retrieving.
        if warm_bytes is None or hot_bytes is None:
            size = kvtier.size_store(max_context, budget, retrieve, layers=self.n_layers, q_heads=self.q_heads,
                                     kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=dtype,
                                     chunk_size=chunk_size)
            warm_bytes = size["warm_bytes"] if warm_bytes is None else warm_bytes
            hot_bytes = size["hot_bytes"] if hot_bytes is None else hot_bytes
        self.store = kvtier.Store(layers=self.n_layers, q_heads=self.q_heads, kv_heads=self.kv_heads,
                                  head_dim=self.head_dim, dtype=dtype, n_sink=n_sink, n_local=n_local,
                                  chunk_size=chunk_size, repr_topk=min(repr_topk, chunk_size), hot_bytes=hot_bytes,
                                  warm_bytes=warm_bytes, **store_options)
        self.session = kvtier.Session.open(self.store, **session_opts)
        self.positions_mode = positions
        self.store_dtype = {"f32": torch.float32, "f16": torch.float16,
                            "bf16": torch.bfloat16}[self.store.options["dtype"]]
        self.n_local = n_local
        self.prefill_window = prefill_window
        # "prefill" while prefill() runs; otherwise by the number of tokens
        self.step_kind: Optional[str] = None
        # called as on_step(cache, kind) after each step's last layer
        self.on_step: Optional[Callable[["KvtierCache", str], None]] = None
        self._seen = 0

    # ---- transformers' Cache interface ----
    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self._seen

    def get_max_cache_shape(self) -> Optional[int]:
        return None  # no fixed size

    def get_max_length(self) -> Optional[int]:  # transformers < 4.45
        return None

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError("KvtierCache holds one sequence: beam search is not supported")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        # cache_kwargs: transformers 4.x (cos, sin, cache_position); 5.x passes kwargs= (the
        # forward's keyword arguments, which may carry cache_position) or nothing.
        b, hkv, m, d = key_states.shape
        if b != 1:
            raise kvtier.InvalidArgument(f"KvtierCache holds one sequence: batch size must be 1 (got {b})")
        if m > self.n_local:
            raise kvtier.InvalidArgument(
                f"a forward of {m} tokens exceeds the local window (n_local = {self.n_local}): kvtier attends a "
                "window after appending it, so prefill long prompts with kvtier.hf.prefill() (windows of "
                "prefill_window tokens)")
        cache_kwargs = dict(cache_kwargs or kwargs.get("kwargs") or {})
        first = self._seen
        cp = cache_kwargs.get("cache_position")
        if cp is not None and (cp.numel() != m or int(cp[0]) != first):
            raise kvtier.FailedPrecondition(
                f"cache_position starts at {int(cp[0]) if cp.numel() else None}, but the cache holds {first} tokens")
        if layer_idx == 0:
            kind = self.step_kind or ("decode" if m == 1 else "prefill")
            self.session.begin_step(kind)
            self._kind = kind
        positions = torch.arange(first, first + m, dtype=torch.int64)
        cos = sin = None
        k = key_states
        if self.positions_mode == "infllm":
            cos, sin = _rope_cos_sin(positions, d, self.rope_theta)
            k = _unrope(key_states, cos, sin)
        k = k[0].transpose(0, 1).to(self.store_dtype).contiguous()
        v = value_states[0].transpose(0, 1).to(self.store_dtype).contiguous()
        self.session.append(layer_idx, k, v)
        if layer_idx == self.n_layers - 1:
            self._seen += m
        _local.pending = _Pending(self, layer_idx, key_states, positions, cos, sin)
        return key_states, value_states

    # ---- the attention step (called by kvtier_attention) ----
    def _attend(self, pending: _Pending, query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
        b, hq, m, d = query.shape
        if scaling is not None and abs(scaling - d ** -0.5) > 1e-6 * d ** -0.5:
            raise kvtier.InvalidArgument(f"kvtier attends with scale 1/sqrt(head_dim) = {d ** -0.5}; this model "
                                         f"uses {scaling}")
        q = _unrope(query, pending.cos, pending.sin) if self.positions_mode == "infllm" else query
        q = q[0].transpose(0, 1).to(torch.float32).contiguous()
        out = torch.empty((m, hq, d), dtype=torch.float32)
        self.session.attend(pending.layer, q, pending.positions, out)
        if pending.layer == self.n_layers - 1 and self.on_step is not None:
            self.on_step(self, self._kind)
        return out.to(query.dtype).unsqueeze(0)


def kvtier_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                     **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers attention function "kvtier": query [1, q_heads, m, head_dim] -> ([1, m, q_heads,
    head_dim], None), attended by the KvtierCache whose update() ran just before in this layer."""
    pending = getattr(_local, "pending", None)
    _local.pending = None
    layer = getattr(module, "layer_idx", None)
    if pending is None or pending.key is not key or pending.layer != layer:
        raise kvtier.FailedPrecondition(
            "attn_implementation='kvtier' attends through a kvtier.hf.KvtierCache: pass one as the model's cache "
            "(kvtier.hf.cache_arg: cache=, or past_key_values= before transformers 5; use_cache=True)")
    if query.shape[0] != 1:
        raise kvtier.InvalidArgument(f"batch size must be 1 (got {query.shape[0]})")
    return pending.cache._attend(pending, query, scaling), None


def register() -> None:
    """Registers kvtier_attention as attn_implementation="kvtier" (done on import)."""
    if hasattr(transformers, "AttentionInterface"):  # transformers >= 4.50
        transformers.AttentionInterface.register(ATTENTION_NAME, kvtier_attention)
    else:  # 4.48, 4.49: the registry is a dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = kvtier_attention


register()


def cache_arg(model: torch.nn.Module, cache: Cache) -> Dict[str, Cache]:
    """{name: cache} for model(...) and model.generate(...): transformers 5.x renamed the
    argument past_key_values to cache (the old name warns, and goes in 5.40 / 6.0)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def use_kvtier(model: Any, enable: bool = True) -> Any:
    """Switches a loaded model's attention to "kvtier" (enable=False: back to "eager")."""
    model.config._attn_implementation = ATTENTION_NAME if enable else "eager"
    return model


@torch.no_grad()
def prefill(model: Any, input_ids: torch.Tensor, cache: Cache, window: Optional[int] = None) -> torch.Tensor:
    """Runs input_ids [1, n] into `cache` in windows of `window` tokens (default: the cache's
    prefill_window; 64 for a DynamicCache), each window through every layer. Returns the logits
    of the last token, [1, vocab]."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise kvtier.InvalidArgument(f"input_ids must be [1, n] (got {tuple(input_ids.shape)})")
    win: int = window or int(getattr(cache, "prefill_window", 64))
    logits = None
    is_kvtier = isinstance(cache, KvtierCache)
    if is_kvtier:
        cache.step_kind = "prefill"
    try:
        for b in range(0, input_ids.shape[1], win):
            out = model(input_ids=input_ids[:, b:b + win], use_cache=True, logits_to_keep=1, **cache_arg(model, cache))
            logits = out.logits[:, -1]
    finally:
        if is_kvtier:
            cache.step_kind = None
    return logits


@torch.no_grad()
def generate(model: Any, input_ids: torch.Tensor, cache: Optional[Cache] = None, max_new_tokens: int = 16,
             window: Optional[int] = None, **generate_kwargs: Any) -> torch.Tensor:
    """Greedy generation as `kvtier infinite` runs it: prefill all but the last prompt token in
    windows, then model.generate from the full prompt (its first step runs the last token as a
    decode step). cache: a KvtierCache, or None for transformers' DynamicCache (the model's own
    attention).

    Returns the new tokens only, [1, max_new_tokens] (fewer if generation stops early), unlike
    model.generate, which returns the prompt followed by them: its output is
    torch.cat([input_ids, generate(...)], dim=1)."""
    if cache is None:
        cache = DynamicCache()
    n = input_ids.shape[1]
    if n > 1:
        prefill(model, input_ids[:, :-1], cache, window)
    out = model.generate(input_ids, **cache_arg(model, cache), max_new_tokens=max_new_tokens,
                         do_sample=False, attention_mask=torch.ones_like(input_ids), **generate_kwargs)
    return out[:, n:]
