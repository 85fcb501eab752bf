"""∞-Bench-style retrieval through any local transformers checkpoint with kvtier as its KV
memory: the Python counterpart of `kvtier infinite`, printing the same report.

    python -m kvtier.tools.infinitebench --model DIR --task passkey|number_string|kv_retrieval \\
        --context N [--samples K] [--compare] [--json FILE]
    python -m kvtier.tools.infinitebench --model DIR --data TASKS [--template gpt4|yarn-mistral|kvtier] \\
        [--truncate N] [--predictions DIR] [--compare] [--json FILE]

With --data, ∞-Bench's own task files (one <task>.jsonl or a folder of the twelve) run instead of
the generator, as `kvtier infinite --data` runs them and with the same code (the benchmark's
prompts, truncation in the middle to --truncate tokens of the model's tokenizer, and scoring):
predictions are appended to --predictions DIR/<method>/preds_<task>.jsonl as they are made (what the
benchmark's scorer reads), a rerun skips the samples already there, and the end prints one row per
method and one column per task. --compare adds transformers' full attention, StreamingLLM (sinks and
local window only), InfLLM and ActQKV (their presets) on the same samples.

The samples are kvtier infinite's (kvtier.tools.make_samples: the same generator, seed and order), the
defaults its defaults (sinks 16, local 256, chunks of 32, budget 256, prefill window 64, InfLLM
positions, the kvtier preset), and each prompt runs the same way: all but its last token
prefilled in windows, the last token as the first decode step of a greedy model.generate, exact
match = correct. --compare adds transformers' own full attention (eager, DynamicCache) on the
same samples and prints kvtier infinite's comparison table.

A checkpoint with a 256-entry vocabulary (kvtier.tools.export_hf's) is fed the prompt's bytes as
tokens, like kvtier infinite; any other goes through its tokenizer, and an answer counts when
the decoded output starts with it (needle recall is then not measured: it needs byte positions).
"""
import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import torch

import kvtier
import kvtier.tools
import kvtier.hf as kh


def _parse_contexts(text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (got {text!r})")
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"contexts must be positive (got {text!r})")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tools.infinitebench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local transformers checkpoint directory")
    ap.add_argument("--task", default="passkey", choices=["passkey", "number_string", "kv_retrieval"])
    ap.add_argument("--context", "--contexts", dest="contexts", type=_parse_contexts, default=[4096],
                    help="prompt length in bytes, or a comma-separated list")
    ap.add_argument("--samples", type=int, default=None,
                    help="samples per context (default 10); with --data the first K of each task (default all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--preset", default="kvtier", help="retrieval preset: " + "|".join(kvtier.preset_names()))
    ap.add_argument("--budget", type=int, default=256, help="retrieved tokens per layer and step")
    ap.add_argument("--probe", help="probe spec (default: the preset's)")
    ap.add_argument("--alloc", help="budget allocator spec (default: the preset's)")
    ap.add_argument("--index", help="chunk index spec (default: the preset's)")
    ap.add_argument("--sink", type=int, default=16, help="attention-sink tokens")
    ap.add_argument("--local", type=int, default=256, help="local-window tokens")
    ap.add_argument("--chunk", type=int, default=32, help="tokens per chunk")
    ap.add_argument("--repr-topk", type=int, default=0, help="representative keys per chunk (0: the preset's; "
                    "every key of a chunk for kvtier)")
    ap.add_argument("--window", type=int, default=64, help="prefill window in tokens, at most --local")
    ap.add_argument("--positions", default="infllm", choices=["infllm", "absolute"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="model dtype (the store keeps K/V in it)")
    ap.add_argument("--compare", action="store_true", help="also transformers' full attention on the same samples")
    ap.add_argument("--full-max-context", type=int, default=4096,
                    help="--compare: full attention runs up to this context (eager attention with a growing "
                         "DynamicCache costs quadratic time on CPU)")
    ap.add_argument("--data", help="∞-Bench task files: one <task>.jsonl or a folder of them (instead of --task)")
    ap.add_argument("--template", default="kvtier", help="--data: prompt template family: kvtier | gpt4 | "
                    "yarn-mistral (also yi-6b-200k, yi-34b-200k, chatglm3)")
    ap.add_argument("--truncate", type=int, default=0, help="--data: cut a longer prompt to this many tokens by "
                    "dropping its middle, as the benchmark does (0: none)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="--data: tokens generated per sample (0: the "
                    "sample's max_new_tokens, else the benchmark's budget for its task)")
    ap.add_argument("--predictions", default="infbench-predictions", help="--data: folder of "
                    "<method>/preds_<task>.jsonl; a rerun goes on after the samples already there")
    ap.add_argument("--json", help="write the report as JSON to this file")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return ap


class Result:
    def __init__(self, method: str, context: int) -> None:
        self.method, self.context = method, context
        self.correct = self.samples = 0
        self.seconds = 0.0
        self.tokens = self.chunks = self.steps = 0
        self.needle_steps = self.needle_hits = 0
        self.decode_seconds = 0.0
        self.decode_tokens = 0
        self.peak = {"hot_bytes": 0, "warm_bytes": 0, "cold_bytes": 0, "bytes_moved": 0}
        self.outputs: List[bytes] = []
        self.skipped = False

    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else 0.0

    def needle_recall(self) -> float:
        return self.needle_hits / self.needle_steps if self.needle_steps else -1.0

    def s_per_sample(self) -> float:
        return self.seconds / self.samples if self.samples else 0.0

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        return {"method": self.method, "context": self.context, "skipped": self.skipped, "accuracy": self.accuracy(),
                "correct": self.correct, "samples": self.samples, "s_per_sample": self.s_per_sample(),
                "tokens_per_s": self.tokens_per_s(),
                "chunks_per_layer_step": self.chunks / self.steps if self.steps else 0.0,
                "needle_recall": self.needle_recall() if self.needle_steps else None,
                "decode_ms_per_token": 1e3 * self.decode_seconds / self.decode_tokens if self.decode_tokens else None,
                "peak": self.peak, "outputs": [o.decode("latin-1") for o in self.outputs]}


class Runner:
    def __init__(self, args: argparse.Namespace, model: Any, tokenizer: Any = None) -> None:
        self.a, self.model, self.tok = args, model, tokenizer
        self.byte_vocab = model.config.vocab_size == 256

    def encode(self, sample: Dict[str, Any]) -> Tuple[torch.Tensor, int]:
        if self.byte_vocab:
            return torch.tensor([list(sample["prompt"])]), len(sample["answer"])
        ids = self.tok(sample["prompt"].decode("latin-1"), return_tensors="pt").input_ids
        return ids, len(self.tok(sample["answer"].decode("latin-1"), add_special_tokens=False).input_ids)

    def decode(self, tokens: List[int]) -> bytes:
        if self.byte_vocab:
            return bytes(tokens)
        return self.tok.decode(tokens, skip_special_tokens=True).strip().encode("latin-1", "replace")

    def make_cache(self, context: int, **extra: Any) -> kh.KvtierCache:
        """The flags' cache; `extra` overrides them (a method's preset replaces --probe/--alloc/--index)."""
        a = self.a
        opts: Dict[str, Any] = dict(max_context=context + 64, preset=a.preset, positions=a.positions,
                                    budget_tokens=a.budget, n_sink=a.sink, n_local=a.local, chunk_size=a.chunk,
                                    prefill_window=a.window, transfer_threads=2)
        if a.repr_topk:
            opts["repr_topk"] = a.repr_topk
        for key in ("probe", "alloc", "index"):
            if getattr(a, key) and "preset" not in extra:
                opts[key] = getattr(a, key)
        opts.update(extra)
        return kh.KvtierCache(self.model.config, **opts)

    def needle_scorer(self, cache: kh.KvtierCache, sample: Dict[str, Any],
                      r: Result) -> Callable[[kh.KvtierCache, str], None]:
        """Needle recall as kvtier infinite scores it: per decode step and layer, were all sealed
        chunks over the answer's bytes in the needle attended?"""
        a, store, seq = self.a, cache.store, cache.session.sequence

        def on_step(c: kh.KvtierCache, kind: str) -> None:
            if kind != "decode":
                return
            last = c.session.last_chunks
            for layer in range(c.n_layers):
                sealed = store.chunk_count(seq, layer)
                lo = (max(sample["answer_begin"], a.sink) - a.sink) // a.chunk
                hi = min(sealed, (sample["answer_end"] - 1 - a.sink) // a.chunk + 1)
                if lo >= hi:
                    continue
                found = sum(1 for idx in last[layer] if lo <= idx < hi)
                r.needle_steps += 1
                r.needle_hits += 1 if found == hi - lo else 0
        return on_step

    def run_sample(self, method: str, context: int, sample: Dict[str, Any], r: Result) -> None:
        ids, n_answer = self.encode(sample)
        kvt = method == "kvtier"
        kh.use_kvtier(self.model, kvt)
        cache = self.make_cache(context) if kvt else None
        if cache is not None and self.byte_vocab:
            cache.on_step = self.needle_scorer(cache, sample, r)
        t0 = time.perf_counter()
        prefill_cache = cache if cache is not None else kh.DynamicCache()
        with torch.no_grad():
            if ids.shape[1] > 1:
                kh.prefill(self.model, ids[:, :-1], prefill_cache, self.a.window)
            t1 = time.perf_counter()
            out = self.model.generate(ids, **kh.cache_arg(self.model, prefill_cache), max_new_tokens=n_answer, do_sample=False,
                                      attention_mask=torch.ones_like(ids))
        t2 = time.perf_counter()
        new = out[0, ids.shape[1]:].tolist()
        got = self.decode(new)
        r.seconds += t2 - t0
        r.decode_seconds += t2 - t1
        r.decode_tokens += len(new)
        r.tokens += ids.shape[1] + len(new) - 1
        r.samples += 1
        r.correct += 1 if (got == sample["answer"] if self.byte_vocab else got.startswith(sample["answer"])) else 0
        r.outputs.append(got)
        if cache is not None:
            layers = cache.n_layers
            r.steps += ((ids.shape[1] - 1 + self.a.window - 1) // self.a.window + len(new)) * layers
            r.chunks += int(cache.session.counters()["chunks_attended"])
            c = cache.store.counters()
            for k in r.peak:
                r.peak[k] = max(r.peak[k], c[k])
        kh.use_kvtier(self.model, False)

    def run(self) -> Tuple[List[str], List[Result]]:
        a = self.a
        methods = (["HF full attention"] if a.compare else []) + ["kvtier"]
        results: List[Result] = []
        for context in a.contexts:
            samples = kvtier.tools.make_samples(a.task, context, a.samples, a.seed)
            for m in methods:
                r = Result(m, context)
                if m != "kvtier" and context > a.full_max_context:
                    r.skipped = True
                    results.append(r)
                    continue
                for i, s in enumerate(samples):
                    if not a.quiet:
                        print(f"infinitebench: {m}, context {context}, sample {i + 1}/{len(samples)}", file=sys.stderr)
                    self.run_sample(m, context, s, r)
                results.append(r)
        return methods, results


class TaskRun:
    """One method on one ∞-Bench task file (--data)."""

    def __init__(self, task: str, path: str, method: str, predictions: str) -> None:
        self.task, self.path, self.method, self.predictions = task, path, method, predictions
        self.samples = self.resumed = self.run = 0
        self.score_sum = self.seconds = 0.0
        self.tokens = 0
        self.chunks = self.steps = 0
        self.peak = {"hot_bytes": 0, "warm_bytes": 0, "cold_bytes": 0, "bytes_moved": 0}
        self.peak_rss = 0  # the process's peak RSS when the task ended (bytes; it only grows)

    def score(self) -> float:
        return self.score_sum / self.samples if self.samples else 0.0

    def as_dict(self) -> Dict[str, Any]:
        return {"task": self.task, "file": self.path, "method": self.method, "score": self.score(),
                "samples": self.samples, "resumed": self.resumed, "predictions": self.predictions,
                "run": {"samples": self.run, "seconds": self.seconds,
                        "s_per_sample": self.seconds / self.run if self.run else 0.0, "tokens": self.tokens,
                        "chunks_per_layer_step": self.chunks / self.steps if self.steps else 0.0,
                        "tier_bytes": self.peak, "peak_rss_bytes": self.peak_rss}}


DATA_METHODS = {  # --data --compare: name -> KvtierCache options (None: transformers' own attention)
    "HF full attention": None,
    "StreamingLLM": {"budget_tokens": 0},
    "InfLLM": {"preset": "infllm"},
    "ActQKV": {"preset": "actqkv"},
    "kvtier": {},
}


def _slug(method: str) -> str:
    return method.lower().replace(" ", "_")


class DataRunner(Runner):
    """--data: the benchmark's task files through transformers' generate with the kvtier cache."""

    def tokens_of(self, prompt: str) -> List[int]:
        if self.byte_vocab:
            ids = list(prompt.encode("utf-8"))
        else:
            ids = self.tok(prompt, add_special_tokens=True).input_ids
        if self.a.truncate and len(ids) > self.a.truncate:
            ids = kvtier.tools.infbench_truncate(ids, self.a.truncate)
            if not self.byte_vocab:  # as the benchmark does: back to text, then the model's tokens again
                ids = self.tok(self.tok.decode(ids, skip_special_tokens=True), add_special_tokens=True).input_ids
        return [int(t) for t in ids]

    def text_of(self, tokens: List[int]) -> str:
        if self.byte_vocab:
            return bytes(tokens).decode("utf-8", "replace")
        return str(self.tok.decode(tokens, skip_special_tokens=True)).strip()

    def predict(self, method: str, ids: List[int], budget: int, tr: TaskRun) -> str:
        extra = DATA_METHODS[method]
        x = torch.tensor([ids])
        cache = None
        if extra is not None:
            kh.use_kvtier(self.model, True)
            cache = self.make_cache(len(ids) + budget, **extra)
        t0 = time.perf_counter()
        prefill_cache = cache if cache is not None else kh.DynamicCache()
        with torch.no_grad():
            if x.shape[1] > 1:
                kh.prefill(self.model, x[:, :-1], prefill_cache, self.a.window)
            out = self.model.generate(x, **kh.cache_arg(self.model, prefill_cache), max_new_tokens=budget,
                                      do_sample=False, attention_mask=torch.ones_like(x))
        new = out[0, x.shape[1]:].tolist()
        tr.seconds += time.perf_counter() - t0
        tr.tokens += len(ids) + len(new) - 1
        tr.run += 1
        if cache is not None:
            tr.steps += ((len(ids) - 1 + self.a.window - 1) // self.a.window + len(new)) * cache.n_layers
            tr.chunks += int(cache.session.counters()["chunks_attended"])
            c = cache.store.counters()
            for k in tr.peak:
                tr.peak[k] = max(tr.peak[k], int(c[k]))
        kh.use_kvtier(self.model, False)
        return self.text_of(new)

    def run_data(self) -> Tuple[List[str], List[str], List[TaskRun]]:
        a = self.a
        methods = list(DATA_METHODS) if a.compare else ["kvtier"]
        files = kvtier.tools.infbench_read(a.data)
        tasks: List[str] = []
        runs: List[TaskRun] = []
        for f in files:
            task = f["task"]
            tasks.append(task)
            samples = f["samples"] if a.samples_given is None else f["samples"][:a.samples_given]
            prepared = []
            for s in samples:
                prompt = kvtier.tools.infbench_prompt(a.template, task, s)
                budget = a.max_new_tokens or s["max_new_tokens"] or kvtier.tools.infbench_max_new_tokens(task)
                prepared.append((s, self.tokens_of(prompt), budget, kvtier.tools.infbench_ground_truth(task, s)))
            for m in methods:
                tr = TaskRun(task, f["path"], m, os.path.join(a.predictions, _slug(m), f"preds_{task}.jsonl"))
                preds = kvtier.tools.InfBenchPredictions(tr.predictions)
                todo = sum(1 for s, *_ in prepared if preds.find(s["id"]) is None)
                for s, ids, budget, truth in prepared:
                    done = preds.find(s["id"])
                    if done is not None:
                        if done["ground_truth"] != truth:
                            raise SystemExit(f"{tr.predictions} was made from other data: sample {s['id']}'s ground "
                                             f"truth there is {done['ground_truth'][:60]}, in {f['path']} "
                                             f"{truth[:60]} (move the file away, or give another --predictions)")
                        prediction = done["prediction"]
                        tr.resumed += 1
                    else:
                        if not a.quiet:
                            eta = (f"; about {tr.seconds / tr.run * (todo - tr.run):.0f} s left" if tr.run else "")
                            print(f"infinitebench: {m}, {task}, sample {tr.run + 1}/{todo}{eta}", file=sys.stderr)
                        prediction = self.predict(m, ids, budget, tr)
                        preds.append(s["id"], prediction, truth)
                    tr.score_sum += kvtier.tools.infbench_score(task, prediction, truth, a.template)
                    tr.samples += 1
                tr.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                runs.append(tr)
        return methods, tasks, runs


def data_report(a: argparse.Namespace, methods: List[str], tasks: List[str], runs: List[TaskRun],
                out: Optional[TextIO] = None) -> None:
    out = out or sys.stdout
    print(f"kvtier.tools.infinitebench — ∞-Bench data {a.data}, template {a.template}, truncate "
          f"{a.truncate or 'none'}, model {a.model} — transformers {kh.transformers.__version__}", file=out)
    for r in runs:
        print(f"{r.task:<20} {r.method:<17} {100 * r.score():6.2f} over {r.samples} samples ({r.resumed} from "
              f"{r.predictions}); {r.run} run now, {(r.seconds / r.run if r.run else 0.0):.3f} s/sample", file=out)
    print(file=out)
    print(f"{'method':<17}" + "".join(f" | {t:<19}" for t in tasks) + " | avg", file=out)
    for m in methods:
        scores = [100 * r.score() for t in tasks for r in runs if r.method == m and r.task == t]
        print(f"{m:<17}" + "".join(f" | {v:<19.2f}" for v in scores) + f" | {sum(scores) / len(scores):.2f}",
              file=out)
    print("scores x100 by the benchmark's rules: accuracy for the retrieval, choice, math_find and code tasks, "
          "F1 for QA, ROUGE-Lsum for the summary, the share of values for math_calc", file=out)


def _printable(b: bytes) -> str:
    return "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else f"\\x{c:02x}" for c in b)


def _mib(n: float) -> str:
    return f"{n / 1048576.0:.2f} MiB"


def describe(a: argparse.Namespace) -> str:
    p = kvtier.preset(a.preset)
    probe, alloc, index = a.probe or p["probe"], a.alloc or p["alloc"], a.index or p["index"]
    reprs = a.repr_topk or p["repr_topk"] or a.chunk
    return (f"probe={probe} alloc={alloc} index={index} reprs={reprs}/chunk budget={a.budget} tokens "
            f"({a.budget // a.chunk} chunks/layer), positions {a.positions}")


def report(a: argparse.Namespace, model: Any, methods: List[str], results: List[Result],
           out: Optional[TextIO] = None) -> None:
    out = out or sys.stdout  # looked up now, not at import: pytest's capsys swaps it
    c = model.config
    print(f"kvtier infinite — task {a.task}, {a.samples} samples per context, weights {a.model} (d_model "
          f"{c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads}/"
          f"{getattr(c, 'num_key_value_heads', c.num_attention_heads)} heads) — transformers "
          f"{kh.transformers.__version__}", file=out)
    print(f"store: sinks {a.sink}, local {a.local}, chunk {a.chunk}, prefill window {min(a.window, a.local)}, "
          "policy lru", file=out)
    for m in methods:
        d = describe(a) if m == "kvtier" else "transformers eager attention over every token (DynamicCache)"
        print(f"  {m:<15} {d}", file=out)
    print(file=out)
    if not a.compare:
        for r in results:
            print(f"context {r.context}: accuracy {r.accuracy():.3f} ({r.correct}/{r.samples}), "
                  f"{r.s_per_sample():.3f} s/sample, {r.tokens_per_s():.0f} tokens/s, "
                  f"{(r.chunks / r.steps if r.steps else 0.0):.2f} chunks per layer and step", file=out)
            print(f"  memory per tier (store counters, largest at a sample's end): hot {_mib(r.peak['hot_bytes'])}, "
                  f"warm {_mib(r.peak['warm_bytes'])}, cold {_mib(r.peak['cold_bytes'])}; moved "
                  f"{_mib(r.peak['bytes_moved'])}", file=out)
            if r.needle_steps:
                print(f"  needle recall {r.needle_recall():.3f}: share of (answer step, layer) that attended every "
                      "sealed chunk holding the answer in the needle", file=out)
            if r.outputs:
                print(f"  first answer decoded: \"{_printable(r.outputs[0])}\"", file=out)
    else:
        print(f"{'context':<9}" + "".join(f" | {m:<22}" for m in methods), file=out)
        print(f"{'':<9}" + "".join(f" | {'acc':<5} {'recall':<6} {'s/sample':<9}" for _ in methods), file=out)
        for i, ctx in enumerate(a.contexts):
            line = f"{ctx:<9}"
            for j in range(len(methods)):
                r = results[i * len(methods) + j]
                if r.skipped:
                    line += f" | {'skipped (slow)':<22}"
                    continue
                rec = f"{r.needle_recall():.3f}" if r.needle_steps else "-"
                line += f" | {r.accuracy():<5.3f} {rec:<6} {r.s_per_sample():<9.3f}"
            print(line, file=out)
        print("acc: exact match; recall: needle recall (share of answer steps and layers that attended every\n"
              "sealed chunk holding the answer in the needle; '-' where it never left the sinks or local window)",
              file=out)
        if any(r.skipped for r in results):
            print(f"full attention skipped above --full-max-context {a.full_max_context}", file=out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    # --samples limits each task of --data only when given.
    a.samples_given = a.samples
    if a.samples is None:
        a.samples = 10
    if a.truncate < 0 or a.max_new_tokens < 0:
        raise SystemExit("--truncate and --max-new-tokens must be >= 0")
    if not a.data and (a.truncate or a.max_new_tokens):
        raise SystemExit("--truncate and --max-new-tokens apply to --data runs")
    if a.window > a.local or a.window < 1:
        raise SystemExit(f"--window ({a.window}) must be in [1, --local ({a.local})]")
    if a.samples < 1:
        raise SystemExit("--samples must be >= 1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=getattr(torch, a.dtype),
                                                 attn_implementation="eager").eval()
    tok = None if model.config.vocab_size == 256 else AutoTokenizer.from_pretrained(a.model)
    if a.data:
        try:
            dmethods, tasks, runs = DataRunner(a, model, tok).run_data()
        except kvtier.Error as e:
            raise SystemExit(f"infinitebench: {type(e).__name__}: {e}")
        data_report(a, dmethods, tasks, runs)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"data": a.data, "template": a.template, "truncate": a.truncate, "model": a.model,
                           "methods": dmethods, "tasks": tasks, "results": [r.as_dict() for r in runs]}, f, indent=2)
            print(f"report: {a.json}")
        return 0
    methods, results = Runner(a, model, tok).run()
    report(a, model, methods, results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"task": a.task, "samples": a.samples, "model": a.model,
                       "results": [r.as_dict() for r in results]}, f, indent=2)
        print(f"report: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
