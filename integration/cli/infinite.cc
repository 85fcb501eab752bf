// `kvtier infinite` (see infinite.h).
#include "integration/cli/infinite.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "integration/cli/flags.h"
#include "integration/json.h"
#include "integration/model/llama.h"
#include "offload/demotion_policy.h"
#include "retrieval/retriever.h"

namespace kvtier {
namespace {

using model::LlamaModel;
using model::LlamaSession;
using model::PositionMode;

// ---------------------------------------------------------------------------
// Tasks. The byte formats are the Python trainer's (models/tasks.py, documented
// in models/README.md "Task formats"), byte for byte, so a model trained there is
// evaluated on the prompts it learnt. The random draws here come from
// std::mt19937_64, so the samples themselves are not the Python ones.

const std::string kIntro =
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n";
const std::string kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n";
const std::string kKvIntro = "Below is a list of keys and values. Find the value of the key I will ask about.\n";

struct Sample {
  std::string prompt, answer;
};

std::string RandomChars(std::mt19937_64& rng, const char* alphabet, int n) {
  const int size = static_cast<int>(std::char_traits<char>::length(alphabet));
  std::uniform_int_distribution<int> pick(0, size - 1);
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(alphabet[pick(rng)]);
  return s;
}

// kIntro + k filler lines + needle + (n - k) filler lines + question, where n is the largest
// number of whole filler lines keeping prompt + answer within `length`, k uniform in 0..n.
Result<Sample> Haystack(const std::string& task, const std::string& needle, const std::string& question,
                        const std::string& answer, int64_t length, std::mt19937_64& rng) {
  const int64_t fixed = static_cast<int64_t>(kIntro.size() + needle.size() + question.size() + answer.size());
  if (fixed > length)
    return InvalidArgument("context " + std::to_string(length) + " is too short for task " + task + " (needs >= " +
                           std::to_string(fixed) + " bytes)");
  const int64_t n = (length - fixed) / static_cast<int64_t>(kFiller.size());
  const int64_t k = std::uniform_int_distribution<int64_t>(0, n)(rng);
  Sample s;
  s.prompt.reserve(static_cast<size_t>(length));
  s.prompt = kIntro;
  for (int64_t i = 0; i < k; ++i) s.prompt += kFiller;
  s.prompt += needle;
  for (int64_t i = k; i < n; ++i) s.prompt += kFiller;
  s.prompt += question;
  s.answer = answer;
  return s;
}

Result<Sample> MakeSample(const std::string& task, int64_t length, std::mt19937_64& rng) {
  if (task == "passkey") {
    const std::string key = RandomChars(rng, "0123456789", 5);
    return Haystack(task, "The pass key is " + key + ". Remember it. " + key + " is the pass key.\n",
                    "What is the pass key? The pass key is ", key, length, rng);
  }
  if (task == "number_string") {
    const std::string seq = RandomChars(rng, "0123456789", 10);
    return Haystack(task, "The sequence of digits is " + seq + ". Remember it. " + seq + " is the sequence.\n",
                    "What is the sequence of digits? The sequence of digits is ", seq, length, rng);
  }
  if (task == "kv_retrieval") {
    // kKvIntro + N lines "KEY: VALUE\n" (distinct 8-char lowercase hex keys, 8-char hex values; N as
    // large as fits, at least 1) + the question about one uniformly chosen key.
    const int64_t line_len = 8 + 2 + 8 + 1;
    const int64_t q_len = static_cast<int64_t>(std::string("What is the value of key ").size() + 8 +
                                               std::string("? The value is ").size() + 8);
    const int64_t n = (length - static_cast<int64_t>(kKvIntro.size()) - q_len) / line_len;
    if (n < 1)
      return InvalidArgument("context " + std::to_string(length) + " is too short for task kv_retrieval (needs >= " +
                             std::to_string(kKvIntro.size() + q_len + line_len) + " bytes)");
    std::vector<std::string> keys, values;
    std::set<std::string> seen;
    while (static_cast<int64_t>(keys.size()) < n) {
      std::string k = RandomChars(rng, "0123456789abcdef", 8);
      if (seen.insert(k).second) keys.push_back(std::move(k));
    }
    for (int64_t i = 0; i < n; ++i) values.push_back(RandomChars(rng, "0123456789abcdef", 8));
    const size_t asked = static_cast<size_t>(std::uniform_int_distribution<int64_t>(0, n - 1)(rng));
    Sample s;
    s.prompt = kKvIntro;
    for (int64_t i = 0; i < n; ++i) s.prompt += keys[i] + ": " + values[i] + "\n";
    s.prompt += "What is the value of key " + keys[asked] + "? The value is ";
    s.answer = values[asked];
    return s;
  }
  return InvalidArgument("unknown task '" + task + "' (passkey | number_string | kv_retrieval)");
}

using cli::Fail;
using cli::FlagSet;
using cli::IntFlag;
using cli::ParseBytes;
using cli::ParseInt;
using cli::ParseIntList;
using cli::PathFlag;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------------------
// Evaluation

struct Options {
  std::string weights, task = "passkey", json;
  std::vector<int64_t> contexts = {4096};
  int samples = 10;
  int window = 128;  // prefill window, clamped to n_local
  int64_t seed = 1;
  bool compare = false, quiet = false;
  PositionMode positions = PositionMode::kInfLLM;
  RetrieverOptions retrieval;
  StoreOptions store;
  bool hot_set = false, warm_set = false;
  uint64_t full_max_bytes = 1ull << 30;  // full attention runs only where one layer's chunks fit in this
};

// One way of attending: which chunks, which positions.
struct Method {
  std::string name;
  enum Kind { kFull, kStreaming, kRetrieval } kind = kRetrieval;
  RetrieverOptions retrieval;
  PositionMode positions = PositionMode::kInfLLM;
};

struct Result1 {  // one method at one context length
  std::string method;
  int64_t context = 0;
  bool skipped = false;
  std::string skip_reason;
  int correct = 0, samples = 0;
  double seconds = 0;
  uint64_t tokens = 0;          // prompt + decoded tokens run through the model
  uint64_t chunks = 0, steps = 0;
  StoreCounters peak;           // largest per-tier bytes over the samples (at each sample's end)
  std::vector<std::string> outputs;
  double accuracy() const { return samples ? static_cast<double>(correct) / samples : 0; }
  double s_per_sample() const { return samples ? seconds / samples : 0; }
  double tokens_per_s() const { return seconds > 0 ? tokens / seconds : 0; }
};

// Store options of one method at one context length: the warm tier holds every chunk
// (unless the user sized it, with a cold tier), the hot slot pool what one layer attends.
Result<StoreOptions> StoreFor(const Options& o, const Method& m, const LlamaModel& model, int64_t context) {
  StoreOptions s = o.store;
  s.geometry = model.config().KvGeometry(DType::kF32);
  const uint64_t cb = s.chunk_bytes();
  const uint64_t chunks = static_cast<uint64_t>(context / s.chunk_size + 2);
  const uint64_t layers = static_cast<uint64_t>(model.config().n_layers);
  if (!o.warm_set) s.warm_bytes = std::max<uint64_t>(layers * chunks * cb, 4 * cb);
  if (!o.hot_set || m.kind == Method::kFull) {
    // Full attention pins every chunk of a layer at once; the entropy allocator may hand one
    // layer up to L * k chunks.
    const uint64_t k = static_cast<uint64_t>(std::max(0, m.retrieval.budget_tokens / s.chunk_size));
    const uint64_t need = m.kind == Method::kFull ? chunks : std::min(chunks, layers * k + 1);
    s.hot_bytes = std::max<uint64_t>(need, 1) * cb;
    if (o.hot_set) s.hot_bytes = std::max(s.hot_bytes, o.store.hot_bytes);
  }
  return s;
}

Status RunSample(const Options& o, const Method& m, const LlamaModel& model, const StoreOptions& so,
                 const Sample& sample, Result1* r) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<LlamaSession> session, LlamaSession::Create(&model, so, m.positions));
  if (m.kind == Method::kRetrieval) {
    KVTIER_RETURN_IF_ERROR(session->EnableRetrieval(m.retrieval));
  } else if (m.kind == Method::kStreaming) {
    session->SetChunkSelector([](int, const float*, const int64_t*, int, const std::vector<ChunkInfo>&)
                                  -> Result<std::vector<uint64_t>> { return std::vector<uint64_t>{}; });
  }
  const int window = std::min(o.window, so.n_local);
  const int vocab = model.config().vocab;
  std::vector<int32_t> tokens(sample.prompt.size());
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<unsigned char>(sample.prompt[i]);
  const double t0 = Now();
  std::vector<float> last;
  // Window by window, keeping only the last logits row (all of them would be context x vocab floats).
  for (size_t b = 0; b < tokens.size(); b += static_cast<size_t>(window)) {
    const size_t e = std::min(tokens.size(), b + static_cast<size_t>(window));
    KVTIER_ASSIGN_OR_RETURN(std::vector<float> logits,
                            session->Prefill(std::vector<int32_t>(tokens.begin() + b, tokens.begin() + e), window));
    last.assign(logits.end() - vocab, logits.end());
  }
  std::string out;
  int32_t next = LlamaSession::Argmax(last);
  out.push_back(static_cast<char>(next));
  while (out.size() < sample.answer.size()) {
    KVTIER_ASSIGN_OR_RETURN(last, session->Decode(next));
    next = LlamaSession::Argmax(last);
    out.push_back(static_cast<char>(next));
  }
  r->seconds += Now() - t0;
  r->tokens += tokens.size() + out.size() - 1;
  r->steps += static_cast<uint64_t>((tokens.size() + window - 1) / window + out.size() - 1) * model.config().n_layers;
  r->chunks += session->total_chunks();
  r->samples += 1;
  r->correct += out == sample.answer ? 1 : 0;
  r->outputs.push_back(out);
  const StoreCounters c = session->store()->counters();
  r->peak.hot_bytes = std::max(r->peak.hot_bytes, c.hot_bytes);
  r->peak.warm_bytes = std::max(r->peak.warm_bytes, c.warm_bytes);
  r->peak.cold_bytes = std::max(r->peak.cold_bytes, c.cold_bytes);
  r->peak.bytes_moved = std::max(r->peak.bytes_moved, c.bytes_moved);
  return Status::Ok();
}

Result<Result1> RunMethod(const Options& o, const Method& m, const LlamaModel& model, int64_t context,
                          const std::vector<Sample>& samples) {
  Result1 r;
  r.method = m.name;
  r.context = context;
  KVTIER_ASSIGN_OR_RETURN(StoreOptions so, StoreFor(o, m, model, context));
  if (m.kind == Method::kFull && so.hot_bytes > o.full_max_bytes) {
    r.skipped = true;
    r.skip_reason = "one layer's chunks need " + std::to_string(so.hot_bytes >> 20) + " MiB of hot slots";
    return r;
  }
  for (size_t i = 0; i < samples.size(); ++i) {
    if (!o.quiet)
      std::fprintf(stderr, "infinite: %s, context %lld, sample %zu/%zu\n", m.name.c_str(),
                   static_cast<long long>(context), i + 1, samples.size());
    KVTIER_RETURN_IF_ERROR(RunSample(o, m, model, so, samples[i], &r));
  }
  return r;
}

std::string MiB(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", bytes / 1048576.0);
  return buf;
}

std::string Describe(const Method& m, int chunk) {
  switch (m.kind) {
    case Method::kFull: return "every chunk, absolute positions";
    case Method::kStreaming: return "sinks + local window only, positions " +
                                    std::string(model::PositionModeName(m.positions));
    case Method::kRetrieval:
      return "probe=" + m.retrieval.probe + " alloc=" + m.retrieval.alloc + " index=" + m.retrieval.index.factory +
             " budget=" + std::to_string(m.retrieval.budget_tokens) + " tokens (" +
             std::to_string(m.retrieval.budget_tokens / chunk) + " chunks/layer), positions " +
             model::PositionModeName(m.positions);
  }
  return "";
}

std::string ToJson(const Options& o, const std::vector<Method>& methods, const std::vector<Result1>& results) {
  JsonWriter w(/*pretty=*/true);
  w.BeginObject();
  w.Key("weights").String(o.weights).Key("task").String(o.task).Key("samples").Int(o.samples);
  w.Key("seed").Int(o.seed).Key("budget").Int(o.retrieval.budget_tokens);
  w.Key("sink").Int(o.store.n_sink).Key("local").Int(o.store.n_local).Key("chunk").Int(o.store.chunk_size);
  w.Key("window").Int(std::min(o.window, o.store.n_local));
  w.Key("methods").BeginArray();
  for (const Method& m : methods)
    w.BeginObject().Key("name").String(m.name).Key("config").String(Describe(m, o.store.chunk_size)).EndObject();
  w.EndArray();
  w.Key("results").BeginArray();
  for (const Result1& r : results) {
    w.BeginObject().Key("method").String(r.method).Key("context").Int(r.context).Key("skipped").Bool(r.skipped);
    if (!r.skipped) {
      w.Key("accuracy").Double(r.accuracy()).Key("correct").Int(r.correct).Key("samples").Int(r.samples);
      w.Key("s_per_sample").Double(r.s_per_sample()).Key("tokens_per_s").Double(r.tokens_per_s());
      w.Key("chunks_per_layer_step").Double(r.steps ? static_cast<double>(r.chunks) / r.steps : 0);
      w.Key("tier_bytes").BeginObject();
      w.Key("hot").Uint(r.peak.hot_bytes).Key("warm").Uint(r.peak.warm_bytes).Key("cold").Uint(r.peak.cold_bytes);
      w.EndObject();
      w.Key("bytes_moved").Uint(r.peak.bytes_moved);
      w.Key("outputs").BeginArray();
      for (const std::string& s : r.outputs) w.String(s);
      w.EndArray();
    } else {
      w.Key("skip_reason").String(r.skip_reason);
    }
    w.EndObject();
  }
  w.EndArray().EndObject();
  return w.str();
}

// Printable form of a decoded answer (the untrained model emits any byte).
std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) {
    if (ch >= 32 && ch < 127) {
      out.push_back(static_cast<char>(ch));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", ch);
      out += buf;
    }
  }
  return out;
}

}  // namespace

int RunInfinite(int argc, char** argv) {
  Options o;
  o.store.n_sink = 64;
  o.store.n_local = 512;
  o.store.chunk_size = 32;
  o.store.repr_topk = 4;
  o.store.transfer_threads = 2;
  o.retrieval.budget_tokens = 2048;
  bool context_set = false;
  FlagSet f;
  f.Add("weights", "kvtier-llama safetensors file (required), e.g. models/kvtier-tiny.safetensors",
        PathFlag(&o.weights));
  f.Add("task", "passkey | number_string | kv_retrieval (default passkey)", [&o](const std::string& s) {
    if (s != "passkey" && s != "number_string" && s != "kv_retrieval")
      return InvalidArgument("unknown task '" + s + "' (passkey | number_string | kv_retrieval)");
    o.task = s;
    return Status::Ok();
  });
  f.Add("context", "prompt + answer bytes (= tokens) per sample (default 4096)", [&](const std::string& s) {
    int64_t v = 0;
    KVTIER_RETURN_IF_ERROR(ParseInt(s, 1, int64_t{1} << 32, &v));
    if (!context_set) o.contexts.clear();
    context_set = true;
    o.contexts = {v};
    return Status::Ok();
  });
  f.Add("contexts", "comma-separated context lengths, e.g. 4096,16384 (one table row each)",
        [&](const std::string& s) {
          context_set = true;
          return ParseIntList(s, 1, int64_t{1} << 32, &o.contexts);
        });
  f.Add("samples", "samples per context length (default 10)", IntFlag(&o.samples, 1, 1 << 20));
  f.Add("probe", "retrieval probe: act | mean (default act)", [&o](const std::string& s) {
    o.retrieval.probe = s;
    return Status::Ok();
  });
  f.Add("alloc", "budget allocator: entropy | topk (default entropy)", [&o](const std::string& s) {
    o.retrieval.alloc = s;
    return Status::Ok();
  });
  f.Add("index", "chunk index: Exact | Flat | HNSW32 (default Exact)", [&o](const std::string& s) {
    o.retrieval.index.factory = s;
    return Status::Ok();
  });
  f.Add("budget", "retrieved tokens per layer and step (default 2048)",
        IntFlag(&o.retrieval.budget_tokens, 0, 1 << 24));
  f.Add("policy", "demotion policy of the hot and warm tiers: lru or a scoring policy (default lru)",
        [&o](const std::string& s) {
          auto p = MakeDemotionPolicy(s);
          if (!p.ok()) return p.status();
          o.store.hot_policy = o.store.warm_policy = s;
          return Status::Ok();
        });
  f.Add("sink", "attention-sink tokens (default 64)", IntFlag(&o.store.n_sink, 0, 1 << 20));
  f.Add("local", "local-window tokens (default 512)", IntFlag(&o.store.n_local, 1, 1 << 24));
  f.Add("chunk", "tokens per chunk (default 32)", IntFlag(&o.store.chunk_size, 1, 1 << 16));
  f.Add("repr-topk", "representative keys per head per chunk (default 4)", IntFlag(&o.store.repr_topk, 1, 1 << 16));
  f.Add("window", "prefill window in tokens, at most --local (default 128)", IntFlag(&o.window, 1, 1 << 24));
  f.Add("positions", "infllm (memory at the local window's start, keys stored before RoPE) | absolute "
        "(default infllm)", [&o](const std::string& s) {
          auto p = model::ParsePositionMode(s);
          if (!p.ok()) return p.status();
          o.positions = *p;
          return Status::Ok();
        });
  f.Add("hot-bytes", "hot slot pool (default: what one layer attends)", [&o](const std::string& s) {
    o.hot_set = true;
    return ParseBytes(s, &o.store.hot_bytes);
  });
  f.Add("warm-bytes", "warm tier (default: every chunk; less needs --data-dir)", [&o](const std::string& s) {
    o.warm_set = true;
    return ParseBytes(s, &o.store.warm_bytes);
  });
  f.Add("data-dir", "cold tier (RocksDB) directory (default none)", PathFlag(&o.store.data_dir));
  f.Add("full-max-bytes", "--compare: full attention runs where one layer's chunks fit in this (default 1G)",
        [&o](const std::string& s) { return ParseBytes(s, &o.full_max_bytes); });
  f.Add("seed", "random seed of the samples (default 1)", IntFlag(&o.seed, 0, INT64_MAX));
  f.Add("compare", "full attention, StreamingLLM, InfLLM (mean+topk) and ActQKV (act+entropy) on the same "
        "samples at the same budget; one table by context length", [&o](const std::string& s) {
          o.compare = s != "0";
          return Status::Ok();
        }, true);
  f.Add("json", "write the report as JSON to this file", PathFlag(&o.json));
  f.Add("quiet", "no progress on stderr", [&o](const std::string& s) {
    o.quiet = s != "0";
    return Status::Ok();
  }, true);
  Status st = f.Parse("infinite", argc, argv);
  if (!st.ok()) return Fail(st);
  if (f.help()) {
    f.PrintHelp(
        "usage: kvtier infinite --weights FILE --task passkey|number_string|kv_retrieval --context N --samples S "
        "[flags]\n\n"
        "∞-Bench-style retrieval through the kvtier-llama model: each prompt is prefilled in windows with\n"
        "retrieval inside the model, the answer decoded greedily; exact match = correct. --compare runs\n"
        "full attention, StreamingLLM, InfLLM and ActQKV on the same samples (--contexts 4096,16384,...).");
    return 0;
  }
  if (o.weights.empty()) return Fail(InvalidArgument("--weights FILE is required (a kvtier-llama safetensors file)"));
  if (o.window > o.store.n_local)
    return Fail(InvalidArgument("--window (" + std::to_string(o.window) + ") must be <= --local (" +
                                std::to_string(o.store.n_local) + "): a window's keys must stay in the local window"));
  if (o.warm_set && o.store.data_dir.empty())
    return Fail(InvalidArgument("--warm-bytes needs --data-dir: without a cold tier the warm tier holds every chunk"));
  {
    Status v = o.retrieval.Validate();
    if (!v.ok()) return Fail(InvalidArgument("retrieval options: " + v.message()));
  }
  auto loaded = LlamaModel::Load(o.weights);
  if (!loaded.ok())
    return Fail(InvalidArgument("cannot load --weights '" + o.weights + "': " + loaded.status().message()));
  const LlamaModel& model = **loaded;

  std::vector<Method> methods;
  if (o.compare) {
    Method full{"full attention", Method::kFull, o.retrieval, PositionMode::kAbsolute};
    Method streaming{"StreamingLLM", Method::kStreaming, o.retrieval, PositionMode::kInfLLM};
    streaming.retrieval.budget_tokens = 0;
    Method infllm{"InfLLM", Method::kRetrieval, o.retrieval, PositionMode::kInfLLM};
    infllm.retrieval.probe = "mean";
    infllm.retrieval.alloc = "topk";
    Method actqkv{"ActQKV", Method::kRetrieval, o.retrieval, PositionMode::kInfLLM};
    actqkv.retrieval.probe = "act";
    actqkv.retrieval.alloc = "entropy";
    methods = {full, streaming, infllm, actqkv};
  } else {
    methods = {Method{"kvtier", Method::kRetrieval, o.retrieval, o.positions}};
  }

  // The same samples for every method: one generator per context length.
  std::vector<Result1> results;
  for (int64_t context : o.contexts) {
    std::mt19937_64 rng(static_cast<uint64_t>(o.seed) * 1000003ull + static_cast<uint64_t>(context));
    std::vector<Sample> samples;
    for (int i = 0; i < o.samples; ++i) {
      auto s = MakeSample(o.task, context, rng);
      if (!s.ok()) return Fail(s.status());
      samples.push_back(std::move(*s));
    }
    for (const Method& m : methods) {
      auto r = RunMethod(o, m, model, context, samples);
      if (!r.ok()) return Fail(r.status());
      results.push_back(std::move(*r));
    }
  }

  const model::LlamaConfig& c = model.config();
  std::printf("kvtier infinite — task %s, %d samples per context, weights %s (d_model %d, %d layers, %d/%d heads)\n",
              o.task.c_str(), o.samples, o.weights.c_str(), c.d_model, c.n_layers, c.q_heads, c.kv_heads);
  std::printf("store: sinks %d, local %d, chunk %d, prefill window %d, policy %s\n", o.store.n_sink, o.store.n_local,
              o.store.chunk_size, std::min(o.window, o.store.n_local), o.store.warm_policy.c_str());
  for (const Method& m : methods) std::printf("  %-15s %s\n", m.name.c_str(), Describe(m, o.store.chunk_size).c_str());
  std::printf("\n");
  if (!o.compare) {
    for (const Result1& r : results) {
      std::printf("context %lld: accuracy %.3f (%d/%d), %.3f s/sample, %.0f tokens/s, %.2f chunks per layer and step\n",
                  static_cast<long long>(r.context), r.accuracy(), r.correct, r.samples, r.s_per_sample(),
                  r.tokens_per_s(), r.steps ? static_cast<double>(r.chunks) / r.steps : 0.0);
      std::printf("  memory per tier (store counters, largest at a sample's end): hot %s, warm %s, cold %s; "
                  "moved %s\n", MiB(r.peak.hot_bytes).c_str(), MiB(r.peak.warm_bytes).c_str(),
                  MiB(r.peak.cold_bytes).c_str(), MiB(r.peak.bytes_moved).c_str());
      if (!r.outputs.empty()) std::printf("  first answer decoded: \"%s\"\n", Printable(r.outputs[0]).c_str());
    }
  } else {
    std::printf("%-9s", "context");
    for (const Method& m : methods) std::printf(" | %-22s", m.name.c_str());
    std::printf("\n%-9s", "");
    for (size_t i = 0; i < methods.size(); ++i) std::printf(" | %-8s %-13s", "accuracy", "s/sample");
    std::printf("\n");
    for (size_t row = 0; row < o.contexts.size(); ++row) {
      std::printf("%-9lld", static_cast<long long>(o.contexts[row]));
      for (size_t i = 0; i < methods.size(); ++i) {
        const Result1& r = results[row * methods.size() + i];
        if (r.skipped) std::printf(" | %-22s", "does not fit");
        else std::printf(" | %-8.3f %-13.3f", r.accuracy(), r.s_per_sample());
      }
      std::printf("\n");
    }
    for (const Result1& r : results)
      if (r.skipped)
        std::printf("\n%s at context %lld skipped: %s (raise --full-max-bytes)", r.method.c_str(),
                    static_cast<long long>(r.context), r.skip_reason.c_str());
    std::printf("\nmemory per tier at the largest context (store counters, largest at a sample's end):\n");
    for (size_t i = 0; i < methods.size(); ++i) {
      const Result1& r = results[(o.contexts.size() - 1) * methods.size() + i];
      if (r.skipped) continue;
      std::printf("  %-15s hot %s, warm %s, cold %s; %.0f tokens/s\n", r.method.c_str(),
                  MiB(r.peak.hot_bytes).c_str(), MiB(r.peak.warm_bytes).c_str(), MiB(r.peak.cold_bytes).c_str(),
                  r.tokens_per_s());
    }
  }
  if (!o.json.empty()) {
    std::ofstream out(o.json, std::ios::binary | std::ios::trunc);
    out << ToJson(o, methods, results) << "\n";
    if (!out) return Fail(IOError("could not write --json file '" + o.json + "'"));
    std::printf("report: %s\n", o.json.c_str());
  }
  return 0;
}

}  // namespace kvtier
