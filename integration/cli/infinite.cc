// `kvtier infinite` (see infinite.h).
#include "integration/cli/infinite.h"

#include <cblas.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/compress.h"
#include "engine/store_sizing.h"
#include "integration/cli/flags.h"
#include "integration/cli/option_flags.h"
#include "integration/cli/paths.h"
#include "integration/infbench/predictions.h"
#include "integration/infbench/prompt.h"
#include "integration/infbench/score.h"
#include "integration/infbench/task_file.h"
#include "integration/json.h"
#include "integration/model/llama.h"
#include "integration/model/tasks.h"
#include "integration/policy_eval.h"
#include "integration/progress.h"
#include "integration/retriever_flags.h"
#include "integration/run_job.h"
#include "integration/sysinfo.h"
#include "integration/tier_report.h"
#include "integration/turnover.h"
#include "kernels/cpu/forward.h"
#include "offload/demotion_policy.h"
#include "offload/hot_tier.h"
#include "offload/policy/scoring_policy.h"
#include "retrieval/retriever.h"
#include "store/factory_spec.h"

// OpenBLAS's thread control (declared by its cblas.h too).
extern "C" void openblas_set_num_threads(int num_threads);
extern "C" int openblas_get_num_threads(void);

namespace kvtier {
namespace {

using model::LlamaModel;
using model::LlamaSession;
using model::MakeSample;
using model::PositionMode;
using model::Sample;

using cli::Fail;
using cli::FlagSet;
using cli::IntFlag;
using cli::ParseBytes;
using cli::ParseInt;
using cli::ParseIntList;
using cli::PathFlag;
using cli::WithDefault;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU time of the whole process (every thread: the forward's TBB workers, the transfer arena).
double CpuNow() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ---------------------------------------------------------------------------
// Cost per token and its arithmetic floor
//
// The floor of a configuration is the FLOPs a token needs divided by this machine's
// single-core GEMM rate: OpenBLAS's sgemm on one thread at the forward's own FFN shape (one
// prefill window of rows), timed in the same run (MeasureGemmRates). kernels::Gemm's rate at that shape (the
// forward's GEMM, one core) is reported beside it. FLOPs per token:
//   forward   2 (d qh hd + 2 d kvh hd + qh hd d + 3 d ffn) per layer + 2 d vocab (lm head)
//   attention 4 qh hd n_attended per layer (q.k and p.v over the keys the token attended)
//   scoring   2 R kvh hd n_chunks per layer step (every indexed chunk's R representatives
//             against the probe), shared by the tokens of the step (a prefill window)
// Anything above the floor is overhead: a slower GEMM, memory traffic, bookkeeping, search
// structure, conversion, locks.

struct PhaseCost {
  uint64_t tokens = 0;
  double cpu_s = 0, wall_s = 0;
  double retrieval_ms = 0,
         attention_ms = 0;  // the Session's counters (wall): probe+search+alloc+fetch, attention
  double flops = 0;         // the floor's FLOPs (above), summed over tokens
  void Add(const PhaseCost& o) {
    tokens += o.tokens;
    cpu_s += o.cpu_s;
    wall_s += o.wall_s;
    retrieval_ms += o.retrieval_ms;
    attention_ms += o.attention_ms;
    flops += o.flops;
  }
  double per_token(double x) const { return tokens ? x / static_cast<double>(tokens) : 0; }
};

double ForwardFlopsPerToken(const model::LlamaConfig& c) {
  const double d = c.d_model, hd = c.head_dim(), qh = c.q_heads, kvh = c.kv_heads, ffn = c.ffn_hidden;
  return c.n_layers * 2.0 * (d * qh * hd + 2 * d * kvh * hd + qh * hd * d + 3 * d * ffn) + 2.0 * d * c.vocab;
}

struct GemmRates {
  double openblas = 0;  // GFLOP/s, one thread: the floor's rate
  double kvtier = 0;    // GFLOP/s of kernels::Gemm in a one-thread arena
};

// Single-core GEMM rates at [rows, d_model] x [ffn, d_model]^T on random inputs: the best of
// kRounds rounds of at least 0.05 s each, OpenBLAS and kernels::Gemm taking turns, so that a
// moment of contention on a shared machine lowers neither rate (and the floor) and both
// see the same machine.
GemmRates MeasureGemmRates(const model::LlamaConfig& c, int rows) {
  constexpr int kRounds = 5;
  const int k = c.d_model, n = c.ffn_hidden;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows) * k), w(static_cast<size_t>(n) * k),
      y(static_cast<size_t>(rows) * n);
  for (float& v : x) v = u(rng);
  for (float& v : w) v = u(rng);
  const double flops = 2.0 * rows * k * n;
  auto rate = [&](auto&& gemm) {
    gemm();  // warm the caches
    int64_t reps = 0;
    double seconds = 0;
    const double t0 = Now();
    do {
      gemm();
      ++reps;
      seconds = Now() - t0;
    } while (seconds < 0.05);
    return flops * static_cast<double>(reps) / seconds / 1e9;
  };
  kernels::GemmParams p;
  p.m = rows;
  p.k = k;
  p.n_out = n;
  p.x = x.data();
  p.w = w.data();
  p.y = y.data();
  GemmRates r;
  const int threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  tbb::task_arena one(1);
  for (int round = 0; round < kRounds; ++round) {
    r.openblas = std::max(r.openblas, rate([&] {
                            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, k, 1.0f, x.data(),
                                        k, w.data(), k, 0.0f, y.data(), n);
                          }));
    one.execute([&] { r.kvtier = std::max(r.kvtier, rate([&] { kernels::Gemm(p); })); });
  }
  openblas_set_num_threads(threads);
  return r;
}

// ---------------------------------------------------------------------------
// Evaluation

struct Options {
  std::string weights, task = "passkey", json;
  std::vector<int64_t> contexts = {4096};
  int samples = 10;
  int window = 64;  // prefill window, clamped to n_local
  int64_t seed = 1;
  bool compare = false, quiet = false;
  PositionMode positions = PositionMode::kInfLLM;
  RetrieverOptions retrieval;
  StoreOptions store;
  bool hot_set = false, warm_set = false;
  uint64_t full_max_bytes = 1ull << 30;  // full attention runs only where one layer's chunks fit in this
  // --compress: this scoring policy drops chunks at prefill end (and every compress_every()
  // decode steps for policies that compress while decoding), keeping kv_budget tokens per
  // layer; the last `observe` queries are what it observes.
  std::string compress;
  int64_t kv_budget = 0;
  int observe = 32;
  int threads = 0;  // worker threads of the whole run; 0 = oneTBB's default (one per core)
  // ∞-Bench's own task files (--data): the prompts' template family, the truncation of a
  // prompt to at most this many tokens (0: none), the generation budget (0: the sample's or
  // the task's), where the predictions go; --samples limits each task when given.
  std::string data, write_data, templates = "kvtier", predictions = "infbench-predictions";
  int64_t truncate = 0;
  int max_new_tokens = 0;
  bool samples_set = false;
};

// One way of attending: which chunks, which positions.
struct Method {
  std::string name;
  // kNeedleOracle attends exactly the sealed chunks over the sample's needle (no retrieval): the
  // accuracy retrieval would reach if it always found the needle and nothing else.
  enum Kind { kFull, kStreaming, kRetrieval, kNeedleOracle } kind = kRetrieval;
  RetrieverOptions retrieval;
  PositionMode positions = PositionMode::kInfLLM;
  int repr_topk = 0;                      // representative keys per chunk and head; 0 = --repr-topk
  std::optional<ReprChoice> repr_choice;  // how they are chosen; unset = --repr-choice
  std::optional<ReprHeads> repr_heads{};  // kv or query heads; unset = --repr-heads
  int chunk_size = 0;                     // tokens per chunk (block); 0 = --chunk
  bool compress = false;  // --compress applies (every method that attends chunks; StreamingLLM has none)
};

struct Result1 {  // one method at one context length
  std::string method;
  int64_t context = 0;
  bool skipped = false;
  std::string skip_reason;
  int correct = 0, samples = 0;
  double seconds = 0;
  uint64_t tokens = 0;  // prompt + decoded tokens run through the model
  uint64_t chunks = 0, steps = 0;
  std::string traffic;  // the last sample's fetched chunks by tier (integration/tier_report.h)
  // Needle recall: over the answer steps (every decode step, the first one runs the prompt's
  // last token) and layers, the share that attended every sealed chunk holding the answer's
  // bytes inside the needle. Steps where those are still in the sinks or local window do not
  // count. A model may need them in only some layers (kvtier-tiny: layer 1, its copy head),
  // so accuracy can be high at a modest recall.
  uint64_t needle_steps = 0, needle_hits = 0;
  double needle_recall() const { return needle_steps ? static_cast<double>(needle_hits) / needle_steps : -1; }
  // Decode steps after the first: the share of retrieved chunks the same layer's previous
  // step did not retrieve (integration/turnover.h), by layer, and over every layer.
  std::vector<SelectionTurnover> turnover_by_layer;
  // Layer selections (prefill windows and decode steps) summed over samples, and those served
  // by reusing the last search (--reuse) or by screening a slice (--screen).
  uint64_t selections = 0, reused_selections = 0, sliced_selections = 0;
  // --compress: tokens the store held per layer right after the prefill-end compression
  // (summed over samples: mean over layers, and the largest layer), chunks dropped (all
  // layers, every compression) and compressions, summed over samples.
  uint64_t kept_tokens = 0, kept_tokens_max = 0, dropped_chunks = 0, compressions = 0;
  double kept_per_layer() const { return samples ? static_cast<double>(kept_tokens) / samples : 0; }
  double dropped_per_sample() const { return samples ? static_cast<double>(dropped_chunks) / samples : 0; }
  PhaseCost prompt,
      generated;       // cost per token: prefill windows (and the prefill-end compression) | decode steps
  StoreCounters peak;  // largest per-tier bytes over the samples (at each sample's end)
  std::vector<std::string> outputs;
  double accuracy() const { return samples ? static_cast<double>(correct) / samples : 0; }
  double s_per_sample() const { return samples ? seconds / samples : 0; }
  PhaseCost total() const {  // every token of both phases: the cost the floor is held against
    PhaseCost t = prompt;
    t.Add(generated);
    return t;
  }
  double tokens_per_s() const { return seconds > 0 ? tokens / seconds : 0; }
};

// Store options of one method at one context length: the warm tier holds every chunk
// (unless the user sized it, with a cold tier), the hot slot pool what one layer attends.
Result<StoreOptions> StoreFor(const Options& o, const Method& m, const LlamaModel& model, int64_t context) {
  StoreOptions s = o.store;
  s.geometry = model.config().KvGeometry(DType::kF32);
  if (m.chunk_size > 0) s.chunk_size = m.chunk_size;
  if (m.repr_topk > 0) s.repr_topk = std::min(m.repr_topk, s.chunk_size);
  if (m.repr_choice) s.repr_choice = *m.repr_choice;
  if (m.repr_heads) s.repr_heads = *m.repr_heads;
  const StoreSize size = SizeStoreForContext(s, context, m.retrieval.budget_tokens, m.kind != Method::kFull);
  if (!o.warm_set) s.warm_bytes = size.warm_bytes;
  if (!o.hot_set || m.kind == Method::kFull) {
    s.hot_bytes = size.hot_bytes;
    if (o.hot_set) s.hot_bytes = std::max(s.hot_bytes, o.store.hot_bytes);
  }
  return s;
}

// prog: the sample's progress (prompt and answer tokens through the model).
// decode_tokens: the greedy decode's length (the first token comes from the prompt's last
// step). The output is appended to r->outputs; whether it is right is the caller's to say.
Status RunSample(const Options& o, const Method& m, const LlamaModel& model, const StoreOptions& so,
                 const Sample& sample, size_t decode_tokens, Result1* r, Progress* prog) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<LlamaSession> session,
                          LlamaSession::Create(&model, so, m.positions));
  if (m.kind == Method::kRetrieval) {
    KVTIER_RETURN_IF_ERROR(session->EnableRetrieval(m.retrieval));
  } else if (m.kind == Method::kStreaming) {
    KVTIER_RETURN_IF_ERROR(
        session->SetChunkSelector([](int, const float*, const int64_t*, int, const std::vector<ChunkInfo>&)
                                      -> Result<std::vector<uint64_t>> { return std::vector<uint64_t>{}; }));
  } else if (m.kind == Method::kNeedleOracle) {
    KVTIER_RETURN_IF_ERROR(session->SetChunkSelector(
        [&sample](int, const float*, const int64_t*, int,
                  const std::vector<ChunkInfo>& chunks) -> Result<std::vector<uint64_t>> {
          std::vector<uint64_t> picked;
          for (const ChunkInfo& c : chunks)
            if (c.first_token < sample.needle_end && c.first_token + c.n_tokens > sample.needle_begin)
              picked.push_back(c.key.index);
          return picked;
        }));
  }
  // Needle recall of the step just run: per layer, were all sealed needle chunks attended?
  auto score_needle = [&]() -> Status {
    if (sample.answer_end <= sample.answer_begin) return Status::Ok();  // no needle known (--data)
    for (int layer = 0; layer < model.config().n_layers; ++layer) {
      // Every sealed chunk over the answer, dropped by --compress or not: a compressed-away
      // needle is a miss, not a step that does not count.
      // The chunks over the answer's positions [answer_begin, answer_end) are [lo, hi) (store/chunk.h).
      KVTIER_ASSIGN_OR_RETURN(uint64_t sealed, session->store()->ChunkCount(session->sequence(), layer));
      const int64_t C = so.chunk_size;
      const int64_t lo =
          ChunkOfPosition(std::max<int64_t>(sample.answer_begin, so.n_sink), so.n_sink, C, kAnyChunkCount);
      const int64_t hi =
          std::min<int64_t>(static_cast<int64_t>(sealed),
                            ChunkOfPosition(sample.answer_end - 1, so.n_sink, C, kAnyChunkCount) + 1);
      if (lo >= hi) continue;
      const std::vector<uint64_t>& got = session->last_chunks()[static_cast<size_t>(layer)];
      const auto found = std::count_if(got.begin(), got.end(), [&](uint64_t idx) {
        return static_cast<int64_t>(idx) >= lo && static_cast<int64_t>(idx) < hi;
      });
      r->needle_steps += 1;
      r->needle_hits += found == hi - lo ? 1 : 0;
    }
    return Status::Ok();
  };
  const int window = std::min(o.window, so.n_local);
  std::vector<int32_t> tokens(sample.prompt.size());
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<unsigned char>(sample.prompt[i]);
  // The prompt's last token runs as the first decode step (see below).
  const size_t n_prefill = tokens.size() - 1;

  // ---- --compress: the scoring policy over this session's store ----
  // The session keeps each layer's `observe` most recent queries; Session::Compress has them
  // attend exactly over every key the layer still holds (InfLLM positions: where the model
  // attends them), the policy observes that layer by layer, and each layer keeps the chunks
  // holding the most of the policy's keep set, the rest leaving the store and the index.
  const model::LlamaConfig& cfg = model.config();
  const bool compressing = m.compress && !o.compress.empty();
  const int observe = static_cast<int>(std::min<int64_t>(o.observe, static_cast<int64_t>(n_prefill)));
  if (compressing) KVTIER_RETURN_IF_ERROR(session->KeepQueries(observe));
  int64_t compress_every = 0;  // the policy's decode-time period, known after the first compression
  auto compress = [&](int n_queries) -> Status {
    KVTIER_ASSIGN_OR_RETURN(CompressReport rep,
                            session->session()->Compress(o.compress, o.kv_budget, n_queries));
    r->dropped_chunks += rep.dropped_chunks;
    r->compressions += 1;
    compress_every = rep.compress_every;
    return Status::Ok();
  };
  // Cost per token (PhaseCost): CPU and wall time, the Session's retrieval and attention time,
  // and the floor's FLOPs of every layer step, by phase.
  const double forward_flops = ForwardFlopsPerToken(cfg);
  const double L = cfg.n_layers, attn_flops_per_key = 4.0 * cfg.q_heads * cfg.head_dim();
  const double score_flops_per_chunk =
      m.kind == Method::kRetrieval ? 2.0 * so.repr_topk * cfg.kv_heads * cfg.head_dim() : 0;
  const double hot_tokens = static_cast<double>(so.n_sink + so.n_local);
  // FLOPs of `n` tokens ending at position `end`, each layer attending `chunks` chunks.
  auto step_flops = [&](double n, double end, double chunks) {
    const double attended =
        m.kind == Method::kFull ? end - n / 2 : std::min(end, hot_tokens) + chunks * so.chunk_size;
    const double indexed = std::max(0.0, (end - hot_tokens) / so.chunk_size);
    return n * forward_flops + L * (n * attn_flops_per_key * attended + score_flops_per_chunk * indexed);
  };
  struct Mark {
    double cpu, wall;
    SessionCounters c;
  };
  auto mark = [&]() { return Mark{CpuNow(), Now(), session->session()->counters()}; };
  auto charge = [](const Mark& a, const Mark& b, uint64_t tokens, PhaseCost* cost) {
    cost->tokens += tokens;
    cost->cpu_s += b.cpu - a.cpu;
    cost->wall_s += b.wall - a.wall;
    cost->retrieval_ms += (b.c.probe_ms + b.c.search_ms + b.c.alloc_ms + b.c.fetch_ms) -
                          (a.c.probe_ms + a.c.search_ms + a.c.alloc_ms + a.c.fetch_ms);
    cost->attention_ms += b.c.attention_ms - a.c.attention_ms;
  };
  // Chunks each layer attended per step between two marks.
  auto chunks_per_layer_step = [](const Mark& a, const Mark& b) {
    const uint64_t attends = b.c.attends - a.c.attends;
    return attends
               ? static_cast<double>(b.c.chunks_attended - a.c.chunks_attended) / static_cast<double>(attends)
               : 0.0;
  };
  const Mark start = mark();
  const double t0 = start.wall;
  // The prompt's last token runs as the first decode step, not in the last prefill window:
  // the answer's first byte is then retrieved for by that token's own query (ActQKV Sec. 4.2),
  // as every later byte is, instead of by a probe pooled over a whole window of question and
  // filler. Under full attention the logits are the same either way.
  for (size_t b = 0; b < n_prefill; b += static_cast<size_t>(window)) {
    const size_t e = std::min(n_prefill, b + static_cast<size_t>(window));
    const Mark before = mark();
    KVTIER_RETURN_IF_ERROR(
        session->Prefill(std::vector<int32_t>(tokens.begin() + b, tokens.begin() + e), window).status());
    r->prompt.flops +=
        step_flops(static_cast<double>(e - b), static_cast<double>(e), chunks_per_layer_step(before, mark()));
    prog->Update(static_cast<int64_t>(e));
  }
  int64_t decoded = 0;  // decode steps run (the prompt's last token is the first)
  // After a decode step: G-KV-style policies compress again every compress_every() steps,
  // observing the last min(observe, s) decoded queries (as `kvtier run` does).
  auto after_decode = [&]() -> Status {
    decoded += 1;
    if (compress_every > 0 && decoded % compress_every == 0)
      KVTIER_RETURN_IF_ERROR(compress(static_cast<int>(std::min<int64_t>(o.observe, compress_every))));
    return Status::Ok();
  };
  if (compressing) {
    KVTIER_RETURN_IF_ERROR(compress(observe));
    KVTIER_ASSIGN_OR_RETURN(uint64_t kept,
                            KeptTokensPerLayer(*session->store(), session->sequence(), cfg.n_layers));
    r->kept_tokens += kept;
    for (int l = 0; l < cfg.n_layers; ++l) {
      KVTIER_ASSIGN_OR_RETURN(int64_t n_tokens, session->store()->SequenceLength(session->sequence(), l));
      KVTIER_ASSIGN_OR_RETURN(uint64_t count, session->store()->ChunkCount(session->sequence(), l));
      KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkInfo> live,
                              session->store()->ListChunks(session->sequence(), l));
      r->kept_tokens_max = std::max<uint64_t>(
          r->kept_tokens_max,
          static_cast<uint64_t>(n_tokens) - (count - live.size()) * static_cast<uint64_t>(so.chunk_size));
    }
  }
  const Mark prefilled = mark();
  charge(start, prefilled, n_prefill, &r->prompt);
  // One decode step: its cost and FLOPs (the Decode call alone: the needle scoring and a
  // decode-time compression run outside it).
  int64_t decode_steps = 0;
  auto decode = [&](int32_t token) -> Result<std::vector<float>> {
    const Mark before = mark();
    const double end = static_cast<double>(n_prefill) + static_cast<double>(++decode_steps);
    KVTIER_ASSIGN_OR_RETURN(std::vector<float> logits, session->Decode(token));
    const Mark after = mark();
    r->generated.flops += step_flops(1, end, chunks_per_layer_step(before, after));
    charge(before, after, 1, &r->generated);
    return logits;
  };
  // Each layer's retrieved chunks at the previous decode step, ascending.
  std::vector<std::vector<uint64_t>> previous_chunks;
  auto count_turnover = [&] {
    const std::vector<std::vector<uint64_t>>& now = session->last_chunks();
    std::vector<std::vector<uint64_t>> sorted(now.begin(), now.end());
    for (std::vector<uint64_t>& c : sorted) std::sort(c.begin(), c.end());
    r->turnover_by_layer.resize(sorted.size());
    if (previous_chunks.size() == sorted.size())
      for (size_t l = 0; l < sorted.size(); ++l) r->turnover_by_layer[l].Add(previous_chunks[l], sorted[l]);
    previous_chunks = std::move(sorted);
  };
  KVTIER_ASSIGN_OR_RETURN(std::vector<float> last, decode(tokens.back()));
  count_turnover();
  KVTIER_RETURN_IF_ERROR(score_needle());
  KVTIER_RETURN_IF_ERROR(after_decode());
  std::string out;
  int32_t next = LlamaSession::Argmax(last);
  out.push_back(static_cast<char>(next));
  while (out.size() < decode_tokens) {
    KVTIER_ASSIGN_OR_RETURN(last, decode(next));
    count_turnover();
    KVTIER_RETURN_IF_ERROR(score_needle());
    KVTIER_RETURN_IF_ERROR(after_decode());
    next = LlamaSession::Argmax(last);
    out.push_back(static_cast<char>(next));
    prog->Update(static_cast<int64_t>(n_prefill + out.size()));
  }
  prog->Update(static_cast<int64_t>(n_prefill + out.size()));
  r->seconds += Now() - t0;
  r->tokens += tokens.size() + out.size() - 1;
  r->steps += static_cast<uint64_t>((n_prefill + window - 1) / window + out.size()) * model.config().n_layers;
  r->chunks += session->total_chunks();
  if (const Retriever* rt = session->retriever(); rt != nullptr) {
    r->selections += rt->selections();
    r->reused_selections += rt->reused_selections();
    r->sliced_selections += rt->sliced_selections();
  }
  r->samples += 1;
  r->outputs.push_back(out);
  const StoreCounters c = session->store()->counters();
  r->traffic = TierTrafficText(c, !session->store()->options().remote.empty(), "    ");
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
    // One line per sample (redrawn with ETA on a terminal while it runs): a 32K sample takes
    // tens of seconds.
    char what[256];
    std::snprintf(what, sizeof(what), "infinite: %s, context %lld, sample %zu/%zu", m.name.c_str(),
                  static_cast<long long>(context), i + 1, samples.size());
    Progress prog(!o.quiet, what,
                  static_cast<int64_t>(samples[i].prompt.size() + samples[i].answer.size() - 1), "tokens");
    const int correct_before = r.correct;
    KVTIER_RETURN_IF_ERROR(RunSample(o, m, model, so, samples[i], samples[i].answer.size(), &r, &prog));
    r.correct += r.outputs.back() == samples[i].answer ? 1 : 0;
    std::string extra = r.correct > correct_before ? ", correct" : ", wrong";
    if (i + 1 < samples.size())
      extra += "; " + m.name + " at " + std::to_string(context) + " done in about " +
               FormatDuration(r.s_per_sample() * static_cast<double>(samples.size() - i - 1));
    prog.Done(extra);
  }
  return r;
}

// The width of the method column: the longest method name, at least 15.
int NameWidth(const std::vector<Method>& methods) {
  size_t w = 15;
  for (const Method& m : methods) w = std::max(w, m.name.size());
  return static_cast<int>(w);
}

std::string MiB(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", bytes / 1048576.0);
  return buf;
}

std::string DescribeAttention(const Method& m, int default_chunk) {
  const int chunk = m.chunk_size > 0 ? m.chunk_size : default_chunk;
  switch (m.kind) {
    case Method::kFull:
      return "every chunk, absolute positions";
    case Method::kStreaming:
      return "sinks + local window only, positions " + std::string(model::PositionModeName(m.positions));
    case Method::kNeedleOracle:
      return "sinks + local window + exactly the chunks over the needle (upper bound of retrieval), "
             "positions " +
             std::string(model::PositionModeName(m.positions));
    case Method::kRetrieval:
      return "probe=" + m.retrieval.probe + " alloc=" + m.retrieval.alloc + " index=" + m.retrieval.index +
             " reprs=" + std::to_string(m.repr_topk) + "/chunk" +
             (m.repr_heads == ReprHeads::kQuery ? " per query head" : "") +
             (m.chunk_size > 0 ? " chunk=" + std::to_string(m.chunk_size) : std::string()) +
             (m.retrieval.reuse_cosine > 0 ? " reuse=" + FormatSpecDouble(m.retrieval.reuse_cosine)
                                           : std::string()) +
             " budget=" + std::to_string(m.retrieval.budget_tokens) + " tokens (" +
             std::to_string(m.retrieval.budget_tokens / chunk) + " chunks/layer), positions " +
             model::PositionModeName(m.positions);
  }
  return "";
}

std::string Describe(const Options& o, const Method& m) {
  std::string d = DescribeAttention(m, o.store.chunk_size);
  if (m.compress)
    d += "; compressed by " + o.compress + " to " + std::to_string(o.kv_budget) + " tokens/layer (observe " +
         std::to_string(o.observe) + ")";
  return d;
}

// Cost per token of one phase, for the JSON report (ms per token; floor and ratio as in PhaseCost).
void CostJson(JsonWriter& w, const PhaseCost& c, double gemm_gflops) {
  const double floor_ms = gemm_gflops > 0 ? c.per_token(c.flops) / (gemm_gflops * 1e9) * 1e3 : 0;
  const double cpu_ms = c.per_token(c.cpu_s) * 1e3;
  const double retrieval = c.per_token(c.retrieval_ms), attention = c.per_token(c.attention_ms);
  w.BeginObject().Key("tokens").Uint(c.tokens);
  w.Key("cpu_ms").Double(cpu_ms).Key("wall_ms").Double(c.per_token(c.wall_s) * 1e3);
  w.Key("forward_and_rest_ms").Double(c.per_token(c.wall_s) * 1e3 - retrieval - attention);
  w.Key("retrieval_ms").Double(retrieval).Key("attention_ms").Double(attention);
  w.Key("floor_flops").Double(c.per_token(c.flops)).Key("floor_ms").Double(floor_ms);
  if (floor_ms > 0)
    w.Key("cpu_over_floor").Double(cpu_ms / floor_ms);
  else
    w.Key("cpu_over_floor").Null();
  w.EndObject();
}

std::string ToJson(const Options& o, const std::vector<Method>& methods, const std::vector<Result1>& results,
                   const GemmRates& rates) {
  const double gemm_gflops = rates.openblas;
  JsonWriter w(/*pretty=*/true);
  w.BeginObject();
  w.Key("weights").String(o.weights).Key("task").String(o.task).Key("samples").Int(o.samples);
  w.Key("seed").Int(o.seed).Key("budget").Int(o.retrieval.budget_tokens);
  w.Key("sink").Int(o.store.n_sink).Key("local").Int(o.store.n_local).Key("chunk").Int(o.store.chunk_size);
  w.Key("window").Int(std::min(o.window, o.store.n_local));
  if (o.compress.empty())
    w.Key("compress").Null();
  else
    w.Key("compress").String(o.compress);
  // Without --compress no budget applies: null, not 0.
  if (o.compress.empty())
    w.Key("kv_budget").Null();
  else
    w.Key("kv_budget").Int(o.kv_budget);
  w.Key("observe").Int(o.observe);
  w.Key("threads").Int(
      static_cast<int64_t>(tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism)));
  w.Key("gemm_gflops_one_core")
      .Double(rates.openblas)
      .Key("kvtier_gemm_gflops_one_core")
      .Double(rates.kvtier);
  w.Key("methods").BeginArray();
  for (const Method& m : methods)
    w.BeginObject()
        .Key("name")
        .String(m.name)
        .Key("config")
        .String(Describe(o, m))
        .Key("compressed")
        .Bool(m.compress)
        .EndObject();
  w.EndArray();
  w.Key("results").BeginArray();
  for (const Result1& r : results) {
    w.BeginObject().Key("method").String(r.method).Key("context").Int(r.context).Key("skipped").Bool(
        r.skipped);
    if (!r.skipped) {
      w.Key("accuracy").Double(r.accuracy()).Key("correct").Int(r.correct).Key("samples").Int(r.samples);
      w.Key("s_per_sample").Double(r.s_per_sample()).Key("tokens_per_s").Double(r.tokens_per_s());
      w.Key("chunks_per_layer_step").Double(r.steps ? static_cast<double>(r.chunks) / r.steps : 0);
      w.Key("cost_per_token").BeginObject();
      w.Key("prompt");
      CostJson(w, r.prompt, gemm_gflops);
      w.Key("generated");
      CostJson(w, r.generated, gemm_gflops);
      w.Key("total");
      CostJson(w, r.total(), gemm_gflops);
      w.EndObject();
      if (r.needle_steps)
        w.Key("needle_recall").Double(r.needle_recall());
      else
        w.Key("needle_recall").Null();
      WriteTurnoverJson(&w, r.turnover_by_layer);
      w.Key("selections").Uint(r.selections).Key("reused_selections").Uint(r.reused_selections);
      w.Key("sliced_selections").Uint(r.sliced_selections);
      if (r.compressions) {
        w.Key("kept_tokens_per_layer")
            .Double(r.kept_per_layer())
            .Key("kept_tokens_max_layer")
            .Uint(r.kept_tokens_max);
        w.Key("dropped_chunks_per_sample").Double(r.dropped_per_sample());
        w.Key("compressions_per_sample").Double(static_cast<double>(r.compressions) / r.samples);
      }
      w.Key("tier_bytes").BeginObject();
      w.Key("hot")
          .Uint(r.peak.hot_bytes)
          .Key("warm")
          .Uint(r.peak.warm_bytes)
          .Key("cold")
          .Uint(r.peak.cold_bytes);
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

// ---------------------------------------------------------------------------
// ∞-Bench's own task files (--data, --write-data; integration/infbench/)

// The generator's samples as a ∞-Bench task file: context = the prompt before the question,
// input = the question, answer = [answer], max_new_tokens = the answer's bytes (kvtier-tiny
// decodes exactly that many, as the generator's own path does).
Status WriteGeneratorData(const Options& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(o.write_data, ec);
  if (ec) return IOError("--write-data: cannot create '" + o.write_data + "': " + ec.message());
  std::vector<infbench::BenchSample> out;
  for (int64_t context : o.contexts) {
    std::mt19937_64 rng = model::SampleRng(o.seed, context);
    for (int i = 0; i < o.samples; ++i) {
      KVTIER_ASSIGN_OR_RETURN(Sample s, MakeSample(o.task, context, rng));
      infbench::BenchSample b;
      b.id_json = std::to_string(out.size());
      b.context = s.prompt.substr(0, static_cast<size_t>(s.question_begin));
      b.input = s.prompt.substr(static_cast<size_t>(s.question_begin));
      b.answer_json = JsonWriter::Quote(s.answer);
      b.answer_json.insert(b.answer_json.begin(), '[');
      b.answer_json.push_back(']');
      b.max_new_tokens = static_cast<int>(s.answer.size());
      out.push_back(std::move(b));
    }
  }
  const std::string path = (fs::path(o.write_data) / (o.task + ".jsonl")).string();
  KVTIER_RETURN_IF_ERROR(infbench::WriteTaskFile(path, out));
  std::printf("wrote %zu %s samples to %s\n", out.size(), o.task.c_str(), path.c_str());
  return Status::Ok();
}

// A method's folder name under --predictions: "full attention" -> "full_attention".
std::string MethodSlug(const std::string& name) {
  std::string s;
  for (char c : name)
    s.push_back(c == ' ' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return s;
}

struct TaskRun {  // one method on one task file
  std::string task, file, method, predictions;
  bool skipped = false;
  std::string skip_reason;
  int samples = 0, resumed = 0;  // samples scored; of them, found in the predictions file
  double score_sum = 0;
  Result1 run;  // the samples run now (time, tokens, retrieval, tiers)
  uint64_t peak_rss = 0;
  double score() const { return samples ? score_sum / samples : 0; }
};

std::string DataJson(const Options& o, const std::vector<Method>& methods, const std::vector<TaskRun>& runs,
                     const std::vector<std::string>& tasks) {
  JsonWriter w(/*pretty=*/true);
  w.BeginObject();
  w.Key("weights").String(o.weights).Key("data").String(o.data).Key("template").String(o.templates);
  w.Key("truncate").Int(o.truncate).Key("max_new_tokens").Int(o.max_new_tokens);
  w.Key("predictions").String(o.predictions).Key("budget").Int(o.retrieval.budget_tokens);
  w.Key("sink").Int(o.store.n_sink).Key("local").Int(o.store.n_local).Key("chunk").Int(o.store.chunk_size);
  w.Key("window").Int(std::min(o.window, o.store.n_local));
  w.Key("methods").BeginArray();
  for (const Method& m : methods)
    w.BeginObject().Key("name").String(m.name).Key("config").String(Describe(o, m)).EndObject();
  w.EndArray();
  w.Key("tasks").BeginArray();
  for (const std::string& t : tasks) w.String(t);
  w.EndArray();
  w.Key("results").BeginArray();
  for (const TaskRun& r : runs) {
    w.BeginObject().Key("task").String(r.task).Key("file").String(r.file).Key("method").String(r.method);
    w.Key("skipped").Bool(r.skipped);
    if (r.skipped) {
      w.Key("skip_reason").String(r.skip_reason).EndObject();
      continue;
    }
    w.Key("score").Double(r.score()).Key("samples").Int(r.samples).Key("resumed").Int(r.resumed);
    w.Key("predictions").String(r.predictions);
    w.Key("run").BeginObject();
    w.Key("samples").Int(r.run.samples).Key("seconds").Double(r.run.seconds);
    w.Key("s_per_sample").Double(r.run.s_per_sample()).Key("tokens").Uint(r.run.tokens);
    w.Key("tokens_per_s").Double(r.run.tokens_per_s());
    w.Key("chunks_per_layer_step").Double(r.run.steps ? static_cast<double>(r.run.chunks) / r.run.steps : 0);
    w.Key("selections").Uint(r.run.selections).Key("reused_selections").Uint(r.run.reused_selections);
    w.Key("sliced_selections").Uint(r.run.sliced_selections);
    WriteTurnoverJson(&w, r.run.turnover_by_layer);
    w.Key("tier_bytes").BeginObject();
    w.Key("hot")
        .Uint(r.run.peak.hot_bytes)
        .Key("warm")
        .Uint(r.run.peak.warm_bytes)
        .Key("cold")
        .Uint(r.run.peak.cold_bytes);
    w.EndObject();
    w.Key("bytes_moved").Uint(r.run.peak.bytes_moved).Key("peak_rss_bytes").Uint(r.peak_rss);
    w.EndObject().EndObject();
  }
  w.EndArray().EndObject();
  return w.str();
}

// --data: every task file through every method, with the benchmark's prompts, truncation and
// scoring; predictions appended as made, and the samples already in them skipped.
int RunData(const Options& o, std::vector<Method> methods, const LlamaModel& model) {
  // The needle oracle needs the needle's place, which the benchmark's files do not say.
  methods.erase(std::remove_if(methods.begin(), methods.end(),
                               [](const Method& m) { return m.kind == Method::kNeedleOracle; }),
                methods.end());
  auto data = infbench::ReadTaskData(o.data);
  if (!data.ok()) return Fail(data.status());
  std::vector<TaskRun> runs;
  std::vector<std::string> tasks;
  for (const infbench::TaskFile& tf : *data) {
    tasks.push_back(tf.task);
    const size_t n =
        o.samples_set ? std::min(tf.samples.size(), static_cast<size_t>(o.samples)) : tf.samples.size();
    // The prompts, their budgets and ground truths: the same for every method.
    std::vector<Sample> prompts(n);
    std::vector<size_t> budgets(n);
    std::vector<std::string> truths(n);
    for (size_t i = 0; i < n; ++i) {
      const infbench::BenchSample& b = tf.samples[i];
      auto prompt = infbench::BuildPrompt(o.templates, tf.task, b);
      if (!prompt.ok()) return Fail(InvalidArgument(tf.path + ": " + prompt.status().message()));
      prompts[i].prompt =
          o.truncate > 0 ? infbench::TruncateMiddle(*prompt, static_cast<size_t>(o.truncate)) : *prompt;
      if (prompts[i].prompt.size() < 2)
        return Fail(InvalidArgument(tf.path + ":" + std::to_string(b.line) +
                                    ": the prompt is shorter than 2 tokens"));
      budgets[i] = static_cast<size_t>(o.max_new_tokens > 0   ? o.max_new_tokens
                                       : b.max_new_tokens > 0 ? b.max_new_tokens
                                                              : infbench::DefaultMaxNewTokens(tf.task));
      auto gt = infbench::GroundTruthJson(tf.task, b);
      if (!gt.ok())
        return Fail(InvalidArgument(tf.path + ":" + std::to_string(b.line) + ": " + gt.status().message()));
      truths[i] = *gt;
    }
    for (const Method& m : methods) {
      TaskRun tr;
      tr.task = tf.task;
      tr.file = tf.path;
      tr.method = m.name;
      tr.run.method = m.name;
      tr.predictions = o.predictions + "/" + MethodSlug(m.name) + "/preds_" + tf.task + ".jsonl";
      auto preds = infbench::PredictionsFile::Open(tr.predictions);
      if (!preds.ok()) return Fail(preds.status());
      ResetPeakRss();
      size_t to_run = 0;
      for (size_t i = 0; i < n; ++i) to_run += (*preds)->Find(tf.samples[i].id_json) == nullptr;
      size_t ran = 0;
      for (size_t i = 0; i < n; ++i) {
        const infbench::BenchSample& b = tf.samples[i];
        std::string prediction;
        if (const infbench::Prediction* p = (*preds)->Find(b.id_json); p != nullptr) {
          if (p->ground_truth_json != truths[i])
            return Fail(FailedPrecondition(tr.predictions + " was made from other data: sample " + b.id_json +
                                           "'s ground truth there is " + p->ground_truth_json.substr(0, 60) +
                                           ", in " + tf.path + " " + truths[i].substr(0, 60) +
                                           " (move the file away, or give another --predictions folder)"));
          prediction = p->prediction;
          tr.resumed += 1;
        } else {
          auto so = StoreFor(o, m, model, static_cast<int64_t>(prompts[i].prompt.size() + budgets[i]));
          if (!so.ok()) return Fail(so.status());
          if (m.kind == Method::kFull && so->hot_bytes > o.full_max_bytes) {
            tr.skipped = true;
            tr.skip_reason = "sample " + b.id_json + ": one layer's chunks need " +
                             std::to_string(so->hot_bytes >> 20) +
                             " MiB of hot slots (raise --full-max-bytes)";
            break;
          }
          char what[256];
          std::snprintf(what, sizeof(what), "infinite: %s, %s, sample %zu/%zu", m.name.c_str(),
                        tf.task.c_str(), ran + 1, to_run);
          Progress prog(!o.quiet, what, static_cast<int64_t>(prompts[i].prompt.size() + budgets[i] - 1),
                        "tokens");
          Status st = RunSample(o, m, model, *so, prompts[i], budgets[i], &tr.run, &prog);
          if (!st.ok()) return Fail(st);
          prediction = tr.run.outputs.back();
          st = (*preds)->Append({b.id_json, prediction, truths[i]});
          if (!st.ok()) return Fail(st);
          ++ran;
          prog.Done(ran < to_run
                        ? "; " + tf.task + " done in about " +
                              FormatDuration(tr.run.s_per_sample() * static_cast<double>(to_run - ran))
                        : std::string());
        }
        auto score = infbench::ScoreOne(tf.task, prediction, truths[i], o.templates);
        if (!score.ok()) return Fail(score.status());
        tr.score_sum += *score;
        tr.samples += 1;
      }
      tr.peak_rss = PeakRssBytes();
      runs.push_back(std::move(tr));
    }
  }

  const model::LlamaConfig& c = model.config();
  const int name_w = NameWidth(methods);
  std::printf(
      "kvtier infinite — ∞-Bench data %s, template %s, truncate %s, weights %s (d_model %d, %d layers)\n",
      o.data.c_str(), o.templates.c_str(), o.truncate > 0 ? std::to_string(o.truncate).c_str() : "none",
      o.weights.c_str(), c.d_model, c.n_layers);
  for (const Method& m : methods) std::printf("  %-*s %s\n", name_w, m.name.c_str(), Describe(o, m).c_str());
  std::printf("\n");
  for (const TaskRun& r : runs) {
    if (r.skipped) {
      std::printf("%-20s %-*s skipped: %s\n", r.task.c_str(), name_w, r.method.c_str(),
                  r.skip_reason.c_str());
      continue;
    }
    std::printf(
        "%-20s %-*s %6.2f over %d samples (%d from %s); %d run now, %.3f s/sample, %.2f chunks per layer "
        "and step, peak RSS %s\n",
        r.task.c_str(), name_w, r.method.c_str(), 100 * r.score(), r.samples, r.resumed,
        r.predictions.c_str(), r.run.samples, r.run.s_per_sample(),
        r.run.steps ? static_cast<double>(r.run.chunks) / r.run.steps : 0.0, MiB(r.peak_rss).c_str());
  }
  // The paper's table: one row per method, one column per task, then the average.
  std::printf("\n%-*s", name_w, "method");
  for (const std::string& t : tasks) std::printf(" | %-19s", t.c_str());
  std::printf(" | %-6s\n", "avg");
  for (const Method& m : methods) {
    std::printf("%-*s", name_w, m.name.c_str());
    double sum = 0;
    int counted = 0;
    for (const std::string& t : tasks)
      for (const TaskRun& r : runs)
        if (r.method == m.name && r.task == t) {
          if (r.skipped) {
            std::printf(" | %-19s", "skipped");
          } else {
            std::printf(" | %-19.2f", 100 * r.score());
            sum += 100 * r.score();
            ++counted;
          }
        }
    if (counted == static_cast<int>(tasks.size()))
      std::printf(" | %-6.2f\n", sum / counted);
    else
      std::printf(" | %-6s\n", "-");
  }
  std::printf(
      "scores x100 by the benchmark's rules: accuracy for the retrieval, choice, math_find and code tasks, "
      "F1 for QA, ROUGE-Lsum for the summary, the share of values for math_calc\n");
  if (!o.json.empty()) {
    std::ofstream out(o.json, std::ios::binary | std::ios::trunc);
    out << DataJson(o, methods, runs, tasks) << "\n";
    if (!out) return Fail(IOError("could not write --json file '" + o.json + "'"));
    std::printf("report: %s\n", o.json.c_str());
  }
  return 0;
}

}  // namespace

void AddModelTaskFlags(cli::FlagSet* flags, std::string* weights, std::string* task) {
  flags->Add("weights", "kvtier-llama safetensors file (required), e.g. models/kvtier-tiny.safetensors",
             FlagSet::Binding(
                 [weights](const std::string& s) {
                   if (s.empty()) return InvalidArgument("empty path");
                   // A directory (an HF export, a models/ folder) says which file to pass; a
                   // missing file is left to the loader, whose message names it.
                   Status st = cli::CheckInputFile("--weights", s);
                   if (!st.ok() && st.code() != StatusCode::kNotFound) return st;
                   *weights = s;
                   return Status::Ok();
                 },
                 *weights));
  flags->Add("task", "passkey | number_string | kv_retrieval",
             cli::WithDefault(*task, [task](const std::string& s) {
               KVTIER_RETURN_IF_ERROR(model::CheckTask(s));
               *task = s;
               return Status::Ok();
             }));
}

int RunInfinite(int argc, char** argv) {
  Options o;
  // Defaults sized for kvtier-tiny, trained on 512-byte sequences: with InfLLM positions a
  // query sees nothing farther than the local window (memory sits at its start), so a local
  // window of 256 (up to 287 tokens with a partly filled chunk) stays inside the distances it
  // was trained on. Half the training length, as InfLLM and ActQKV size theirs: with 128 the
  // prompt's last query had too little context to find a 10-digit needle (number_string 0.4 /
  // 0.2 / 0.6 at 4K / 16K / 64K on 5 samples; 1.0 at each with 256), passkey was 1.0 either
  // way. (Sinks 64 + local 512 + budget 2048 answered 4/5 passkey samples at 16K.)
  o.store.n_sink = 16;
  o.store.n_local = 256;
  o.store.chunk_size = 32;
  o.store.repr_topk = 0;  // every key of a chunk, once --chunk is known
  o.store.transfer_threads = 2;
  // kvtier's recommended retrieval (the "kvtier" preset, docs/retrieval.md): a chunk is scored
  // by the best logit any kv head gives any of its keys (index key heads=max) and taken in
  // logit order (allocator key rank=logit); --preset actqkv|infllm give the papers as written.
  o.retrieval = RecommendedRetrieval();
  o.retrieval.budget_tokens = 256;
  FlagSet f;
  {
    Status st = cli::AddPresetFlag(&f, argc, argv, &o.retrieval, &o.store.repr_topk);
    if (!st.ok()) return Fail(st);
  }
  RetrieverSpecFlags rf(&o.retrieval);
  bool context_set = false;
  AddModelTaskFlags(&f, &o.weights, &o.task);
  f.Add("context", "prompt + answer bytes (= tokens) per sample",
        WithDefault(std::to_string(o.contexts.front()), [&](const std::string& s) {
          int64_t v = 0;
          KVTIER_RETURN_IF_ERROR(ParseInt(s, 1, int64_t{1} << 32, &v));
          if (!context_set) o.contexts.clear();
          context_set = true;
          o.contexts = {v};
          return Status::Ok();
        }));
  f.Add("contexts", "comma-separated context lengths, e.g. 4096,16384 (one table row each)",
        [&](const std::string& s) {
          context_set = true;
          return ParseIntList(s, 1, int64_t{1} << 32, &o.contexts);
        });
  f.Add("samples", "samples per context length (with --data: the first S of each task; default all)",
        WithDefault("10", [&o](const std::string& s) {
          o.samples_set = true;
          return IntFlag(&o.samples, 1, 1 << 20).set(s);
        }));
  const auto& rt = RetrieverOptionTable();
  f.Add("probe", cli::OptionHelp(cli::OptionRow(rt, "probe")),
        WithDefault(o.retrieval.probe, [&o](const std::string& s) {
          o.retrieval.probe = s;
          return Status::Ok();
        }));
  f.Add("alloc", cli::OptionHelp(cli::OptionRow(rt, "alloc")),
        WithDefault(o.retrieval.alloc, [&rf](const std::string& s) { return rf.SetAlloc(s); }));
  f.Add("index", cli::OptionHelp(cli::OptionRow(rt, "index")),
        WithDefault(o.retrieval.index, [&rf](const std::string& s) { return rf.SetIndex(s); }));
  f.Add("head-merge",
        "Exact index: a chunk's per-kv-head scores are summed (sum) or the best head decides (max) "
        "(index key heads=)",
        WithDefault(SpecKey(o.retrieval.index, "heads"),
                    [&rf](const std::string& s) { return rf.SetIndexKey("heads", s); }));
  f.Add("rank-by",
        "entropy allocator: a layer takes its chunks by Eq. 10 cosine (cosine, Algorithm 1) or by "
        "logit (allocator key rank=)",
        WithDefault(SpecKey(o.retrieval.alloc, "rank"),
                    [&rf](const std::string& s) { return rf.SetAllocKey("rank", s); }));
  cli::AddOptionFlag(&f, rt, "budget_tokens", &o.retrieval);
  cli::AddOptionFlag(&f, rt, "reuse_cosine", &o.retrieval);
  cli::AddOptionFlag(&f, rt, "screen_period", &o.retrieval);
  f.Add("policy", "demotion policy of the hot and warm tiers: lru or a scoring policy",
        WithDefault(o.store.warm_policy, [&o](const std::string& s) {
          auto p = MakeDemotionPolicy(s);
          if (!p.ok()) return p.status();
          o.store.hot_policy = o.store.warm_policy = s;
          return Status::Ok();
        }));
  const auto& store_rows = StoreOptionTable();
  cli::AddOptionFlag(&f, store_rows, "n_sink", &o.store);
  cli::AddOptionFlag(&f, store_rows, "n_local", &o.store);
  cli::AddOptionFlag(&f, store_rows, "chunk_size", &o.store);
  const auto& repr = cli::OptionRow(store_rows, "repr_topk");
  f.Add(repr.flag, cli::OptionHelp(repr) + " (the paper baselines of --compare keep 4)",
        WithDefault("every key, = --chunk", cli::OptionBinding(repr, &o.store)));
  cli::AddOptionFlag(&f, store_rows, "repr_choice", &o.store);
  cli::AddOptionFlag(&f, store_rows, "repr_heads", &o.store);
  f.Add("window", "prefill window in tokens, at most --local", IntFlag(&o.window, 1, 1 << 24));
  f.Add("positions", "infllm (memory at the local window's start, keys stored before RoPE) | absolute",
        WithDefault(model::PositionModeName(o.positions), [&o](const std::string& s) {
          auto p = model::ParsePositionMode(s);
          if (!p.ok()) return p.status();
          o.positions = *p;
          return Status::Ok();
        }));
  const auto& hot = cli::OptionRow(store_rows, "hot_bytes");
  f.Add(hot.flag, cli::OptionHelp(hot), WithDefault("what one layer attends", [&o](const std::string& s) {
          o.hot_set = true;
          return ParseBytes(s, &o.store.hot_bytes);
        }));
  const auto& device = cli::OptionRow(store_rows, "device");
  f.Add(device.flag, cli::OptionHelp(device) + "; the model forward runs there too",
        cli::OptionBinding(device, &o.store));
  const auto& warm = cli::OptionRow(store_rows, "warm_bytes");
  f.Add(warm.flag, cli::OptionHelp(warm) + "; less than every chunk needs --data-dir",
        WithDefault("every chunk", [&o](const std::string& s) {
          o.warm_set = true;
          return ParseBytes(s, &o.store.warm_bytes);
        }));
  const auto& index_bytes = cli::OptionRow(store_rows, "index_bytes");
  f.Add(index_bytes.flag, cli::OptionHelp(index_bytes), cli::OptionBinding(index_bytes, &o.store));
  const auto& data_dir = cli::OptionRow(store_rows, "data_dir");
  f.Add(data_dir.flag, cli::OptionHelp(data_dir), WithDefault("none", PathFlag(&o.store.data_dir)));
  const auto& remote = cli::OptionRow(store_rows, "remote");
  f.Add(remote.flag,
        cli::OptionHelp(remote) +
            "; with --warm-bytes, "
            "chunks that leave warm are fetched back from it",
        WithDefault("none", [&o](const std::string& s) {
          auto r = ParseRemoteSpec(s);
          if (!r.ok()) return r.status();
          o.store.remote = s;
          return Status::Ok();
        }));
  f.Add("full-max-bytes", "--compare: full attention runs where one layer's chunks fit in this",
        cli::BytesFlag(&o.full_max_bytes));
  f.Add("seed", "random seed of the samples", IntFlag(&o.seed, 0, INT64_MAX));
  f.Add("data",
        "∞-Bench's own task files: one <task>.jsonl or a folder of them (the benchmark's twelve tasks); "
        "runs them with the benchmark's prompts, truncation and scoring instead of the generator",
        WithDefault("none", PathFlag(&o.data)));
  f.Add("template",
        "--data: the prompts' template family: kvtier (context + input as they are) | gpt4 | "
        "yarn-mistral (also yi-6b-200k, yi-34b-200k, chatglm3)",
        cli::WithDefault(o.templates, [&o](const std::string& s) {
          KVTIER_RETURN_IF_ERROR(infbench::CheckTemplateFamily(s));
          o.templates = s;
          return Status::Ok();
        }));
  f.Add("truncate",
        "--data: cut a longer prompt to this many tokens by dropping its middle, as the benchmark "
        "does (0: no truncation)",
        WithDefault("0", IntFlag(&o.truncate, 0, int64_t{1} << 32)));
  f.Add("max-new-tokens",
        "--data: tokens generated per sample (0: the sample's max_new_tokens, else the "
        "benchmark's budget for its task)",
        WithDefault("0", IntFlag(&o.max_new_tokens, 0, 1 << 20)));
  f.Add("predictions",
        "--data: folder of the predictions, <method>/preds_<task>.jsonl as the benchmark's "
        "scorer reads them; a run finds the samples already there and goes on after them",
        cli::WithDefault(o.predictions, PathFlag(&o.predictions)));
  f.Add("write-data",
        "write the generator's samples (--task, --contexts, --samples, --seed) as a ∞-Bench "
        "task file DIR/<task>.jsonl for --data, and exit",
        WithDefault("none", PathFlag(&o.write_data)));
  f.Add(
      "compare",
      "full attention, StreamingLLM, InfLLM (mean+topk), ActQKV (act+entropy), kvtier (these flags) "
      "and a needle oracle on the same samples at the same budget; one table by context length",
      [&o](const std::string& s) {
        o.compare = s != "0";
        return Status::Ok();
      },
      true);
  f.Add("compress",
        "compression: this scoring policy (any 'kvtier policies' spec, e.g. h2o, snapkv, "
        "gkv:s=16) drops whole chunks at prefill end, keeping --kv-budget tokens per layer; policies that "
        "compress while decoding (gkv) compress again every s decode steps. With --compare it applies to "
        "every method that attends chunks (not StreamingLLM)",
        [&o](const std::string& s) {
          auto p = MakeScoringPolicy(s);
          if (!p.ok()) return InvalidArgument("--compress: " + p.status().message());
          o.compress = (*p)->ToString();
          return Status::Ok();
        });
  f.Add("kv-budget",
        "--compress: tokens kept per layer, sinks and local window included (required with "
        "--compress, at least --sink + --local; the store's local window holds up to --chunk tokens more "
        "than --local and is never dropped, so a budget below --sink + --local + --chunk may be exceeded by "
        "that)",
        WithDefault("", IntFlag(&o.kv_budget, 1, int64_t{1} << 40)));
  f.Add("observe",
        "--compress: the last prompt tokens whose queries' exact attention over every held key "
        "the policy observes",
        IntFlag(&o.observe, 1, 1 << 16));
  f.Add("threads",
        "worker threads for the whole run, 0 = one per core. The cost table's cpu column counts every "
        "thread's CPU time: with 1 it compares with the one-core floor without the fork-join overhead",
        WithDefault("0", IntFlag(&o.threads, 0, 4096)));
  f.Add("json", "write the report as JSON to this file (checked writable before the run)",
        cli::OutputPathFlag(&o.json));
  f.Add(
      "quiet", "no progress on stderr",
      [&o](const std::string& s) {
        o.quiet = s != "0";
        return Status::Ok();
      },
      true);
  Status st = f.Parse("infinite", argc, argv);
  if (!st.ok()) return Fail(st);
  if (f.help()) {
    f.PrintHelp(
        "usage: kvtier infinite --weights FILE --task passkey|number_string|kv_retrieval --context N "
        "--samples S "
        "[flags]\n\n"
        "∞-Bench-style retrieval through the kvtier-llama model: each prompt is prefilled in windows with\n"
        "retrieval inside the model, the answer decoded greedily; exact match = correct. --compare runs\n"
        "full attention, StreamingLLM, InfLLM, InfLLM at its own defaults (blocks of 128, 4 "
        "representatives,\n"
        "its top 16 blocks), ActQKV, Quest (as the papers write them), kvtier (these flags), kvtier-fast\n"
        "(these flags with the preset's search reuse) and a\n"
        "needle oracle on the same samples (--contexts 4096,16384,...). docs/retrieval.md explains kvtier's\n"
        "defaults (--head-merge max --rank-by logit, every key a representative).\n\n"
        "--compress SPEC --kv-budget N: at prefill end the last --observe prompt queries attend exactly "
        "over\n"
        "every key each layer holds (keys where the model attends them: with --positions infllm, memory at "
        "the\n"
        "local window's start), the scoring policy keeps N tokens per\n"
        "layer, and the chunks holding the fewest of its kept tokens leave the store and the retrieval "
        "index\n"
        "for good; gkv compresses again every s decode steps. With --compare every method but StreamingLLM\n"
        "works on the compressed store (full attention = every chunk compression left).\n\n"
        "--data DIR|FILE: ∞-Bench's own task files (<task>.jsonl, the benchmark's twelve tasks) instead of "
        "the\n"
        "generator: the benchmark's prompts (--template), truncation (--truncate) and scoring; predictions\n"
        "appended to --predictions DIR/<method>/preds_<task>.jsonl as they are made, and a rerun skips the\n"
        "samples already there. --write-data DIR writes the generator's samples as such a file.");
    return 0;
  }
  if (o.store.repr_topk == 0 || o.store.repr_topk > o.store.chunk_size)
    o.store.repr_topk = o.store.chunk_size;
  if (!o.write_data.empty()) {
    if (!o.data.empty()) return Fail(InvalidArgument("--write-data and --data do not go together"));
    Status w = WriteGeneratorData(o);
    return w.ok() ? 0 : Fail(w);
  }
  if (o.data.empty() && (o.truncate > 0 || o.max_new_tokens > 0))
    return Fail(InvalidArgument("--truncate and --max-new-tokens apply to --data runs"));
  if (o.weights.empty())
    return Fail(InvalidArgument("--weights FILE is required (a kvtier-llama safetensors file)"));
  if (o.window > o.store.n_local)
    return Fail(InvalidArgument("--window (" + std::to_string(o.window) + ") must be <= --local (" +
                                std::to_string(o.store.n_local) +
                                "): a window's keys must stay in the local window"));
  if (o.warm_set && o.store.data_dir.empty() && o.store.remote.empty())
    return Fail(
        InvalidArgument("--warm-bytes needs --data-dir or --remote: without a lower tier the warm tier holds "
                        "every chunk"));
  if (!o.compress.empty() && o.kv_budget == 0)
    return Fail(InvalidArgument("--compress needs --kv-budget N (tokens kept per layer)"));
  if (o.compress.empty() && o.kv_budget != 0)
    return Fail(
        InvalidArgument("--kv-budget needs --compress SPEC (the scoring policy that decides what stays)"));
  if (!o.compress.empty() && o.kv_budget < static_cast<int64_t>(o.store.n_sink) + o.store.n_local)
    return Fail(InvalidArgument("--kv-budget (" + std::to_string(o.kv_budget) +
                                ") must cover the sinks and the " + "local window (--sink " +
                                std::to_string(o.store.n_sink) + " + --local " +
                                std::to_string(o.store.n_local) + ")"));
  {
    Status v = o.retrieval.Validate();
    if (!v.ok()) return Fail(InvalidArgument("retrieval options: " + v.message()));
  }
  if (o.store.device == Device::kCuda) {
    // --device cuda: the store's hot tier and the model's forward both run on the GPU
    // (integration/model/llama_device.h). First what the device forward does not take (usage
    // errors, whatever the machine), then whether there is a device at all (Unavailable
    // "no CUDA device: ..." otherwise).
    if (o.compare)
      return Fail(
          InvalidArgument("--device cuda does not take --compare (the comparison is not checked on the "
                          "device yet): run each method on its own"));
    if (Status dev = CheckDevice(o.store.device); !dev.ok()) return Fail(dev);
  }
  std::optional<tbb::global_control> thread_limit;  // --threads, for the rest of the run
  if (o.threads > 0) thread_limit.emplace(tbb::global_control::max_allowed_parallelism, o.threads);
  auto loaded = LlamaModel::Load(o.weights);
  if (!loaded.ok())
    return Fail(InvalidArgument("cannot load --weights '" + o.weights + "': " + loaded.status().message()));
  const LlamaModel& model = **loaded;
  // The floor's GEMM rate, on one core, at the forward's own shape (a prefill window of rows).
  const GemmRates rates = MeasureGemmRates(model.config(), std::min(o.window, o.store.n_local));
  const double gemm_gflops = rates.openblas;

  std::vector<Method> methods;
  if (o.compare) {
    // The paper methods as written: 4 representative keys per chunk and head (the most
    // attended keys, ReprChoice::kMass, each method having its own store), chunk scores
    // summed over kv heads; InfLLM scores the mean of the representatives, ActQKV the best one
    // and takes chunks in Eq. 10 cosine order (Algorithm 1). "kvtier" is the flags'
    // configuration. PaperRetrieval (include/kvtier/session.h) picks the index kind.
    auto paper = [&](const std::string& name) -> Result<std::pair<RetrieverOptions, int>> {
      KVTIER_ASSIGN_OR_RETURN(RetrievalPreset p, MakeRetrievalPreset(name));
      KVTIER_ASSIGN_OR_RETURN(RetrieverOptions r, PaperRetrieval(name, o.retrieval));
      return std::make_pair(r, std::min(p.repr_topk, o.store.chunk_size));
    };
    auto infllm_preset = paper("infllm");
    auto actqkv_preset = paper("actqkv");
    if (!infllm_preset.ok()) return Fail(infllm_preset.status());
    if (!actqkv_preset.ok()) return Fail(actqkv_preset.status());
    Method full{"full attention",        Method::kFull,     o.retrieval,
                PositionMode::kAbsolute, o.store.repr_topk, std::nullopt};
    Method streaming{"StreamingLLM",        Method::kStreaming, o.retrieval,
                     PositionMode::kInfLLM, o.store.repr_topk,  std::nullopt};
    streaming.retrieval.budget_tokens = 0;
    // Both papers choose representatives as InfLLM does, by attention mass. InfLLM's
    // ContextManager keeps them per query head (its top repr_topk keys by that head's
    // attention) and scores a block per query head: ReprHeads::kQuery.
    Method infllm{"InfLLM",
                  Method::kRetrieval,
                  infllm_preset->first,
                  PositionMode::kInfLLM,
                  infllm_preset->second,
                  ReprChoice::kMass};
    infllm.repr_heads = ReprHeads::kQuery;
    // InfLLM at its own defaults (as `kvtier run --compare` runs it): blocks of 128 tokens, 4
    // representatives, its top 16 blocks whatever the run's budget; left out where the local
    // window is not a whole number of its blocks.
    std::optional<Method> infllm_defaults;
    if (o.store.n_local % kInfLLMBlock == 0) {
      infllm_defaults = infllm;
      infllm_defaults->name = kInfLLMDefaultsRow;
      infllm_defaults->chunk_size = kInfLLMBlock;
      infllm_defaults->repr_topk = kInfLLMReprTopk;
      infllm_defaults->retrieval.budget_tokens = kInfLLMTopBlocks * kInfLLMBlock;
    }
    Method actqkv{"ActQKV",
                  Method::kRetrieval,
                  actqkv_preset->first,
                  PositionMode::kInfLLM,
                  actqkv_preset->second,
                  ReprChoice::kMass};
    // Quest: a chunk ranked by the largest q.k its per-chunk key box allows (every key a
    // representative: the box needs them all), the current query's probe (mean-pooled per kv
    // head), a fixed top-k at the run's budget, the heads by max (pages chosen per head).
    Method quest{"Quest",     Method::kRetrieval, o.retrieval, PositionMode::kInfLLM, o.store.chunk_size,
                 std::nullopt};
    quest.retrieval.probe = "mean";
    quest.retrieval.alloc = "topk";
    quest.retrieval.index = kQuestRowIndex;
    quest.retrieval.reuse_cosine = 0.0;
    quest.retrieval.screen_period = 1;
    quest.repr_heads = ReprHeads::kKv;
    Method ours{"kvtier", Method::kRetrieval, o.retrieval, o.positions, o.store.repr_topk, std::nullopt};
    methods = {full, streaming, infllm};
    if (infllm_defaults) methods.push_back(*infllm_defaults);
    methods.push_back(actqkv);
    methods.push_back(quest);
    methods.push_back(ours);
    // kvtier-fast: the flags' configuration with the preset's search reuse (not exact: held
    // to answers, docs/benchmarks.md "The kvtier-fast preset"); left out when the flags reuse
    // already (the kvtier row is then that).
    if (o.retrieval.reuse_cosine == 0.0) {
      auto fast = MakeRetrievalPreset("kvtier-fast");
      if (!fast.ok()) return Fail(fast.status());
      Method f = ours;
      f.name = "kvtier-fast";
      f.retrieval.reuse_cosine = fast->retrieval.reuse_cosine;
      methods.push_back(f);
    }
    methods.push_back(Method{"needle oracle", Method::kNeedleOracle, o.retrieval, PositionMode::kInfLLM,
                             o.store.repr_topk, std::nullopt});
  } else {
    methods = {
        Method{"kvtier", Method::kRetrieval, o.retrieval, o.positions, o.store.repr_topk, std::nullopt}};
  }
  // --compress: every method that attends chunks works on what compression left (full
  // attention: every chunk left); StreamingLLM attends none, so compression cannot change it.
  for (Method& m : methods) m.compress = !o.compress.empty() && m.kind != Method::kStreaming;
  if (!o.data.empty()) return RunData(o, methods, model);

  // The same samples for every method: one generator per context length.
  std::vector<Result1> results;
  for (int64_t context : o.contexts) {
    std::mt19937_64 rng = model::SampleRng(o.seed, context);
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
  const int name_w = NameWidth(methods);
  std::printf(
      "kvtier infinite — task %s, %d samples per context, weights %s (d_model %d, %d layers, %d/%d heads)\n",
      o.task.c_str(), o.samples, o.weights.c_str(), c.d_model, c.n_layers, c.q_heads, c.kv_heads);
  std::printf("store: sinks %d, local %d, chunk %d, prefill window %d, policy %s\n", o.store.n_sink,
              o.store.n_local, o.store.chunk_size, std::min(o.window, o.store.n_local),
              o.store.warm_policy.c_str());
  if (o.store.device == Device::kCuda)
    std::printf(
        "device: cuda (hot tier in GPU memory; embedding, norms, projections, RoPE, K/V conversion and "
        "attention on the GPU; q and the attention output cross to the host per layer)\n");
  for (const Method& m : methods) std::printf("  %-*s %s\n", name_w, m.name.c_str(), Describe(o, m).c_str());
  std::printf("\n");
  if (!o.compare) {
    for (const Result1& r : results) {
      std::printf(
          "context %lld: accuracy %.3f (%d/%d), %.3f s/sample, %.0f tokens/s, %.2f chunks per layer and "
          "step\n",
          static_cast<long long>(r.context), r.accuracy(), r.correct, r.samples, r.s_per_sample(),
          r.tokens_per_s(), r.steps ? static_cast<double>(r.chunks) / r.steps : 0.0);
      std::printf(
          "  memory per tier (store counters, largest at a sample's end): hot %s, warm %s, cold %s; "
          "moved %s\n",
          MiB(r.peak.hot_bytes).c_str(), MiB(r.peak.warm_bytes).c_str(), MiB(r.peak.cold_bytes).c_str(),
          MiB(r.peak.bytes_moved).c_str());
      std::printf("  the last sample's store:\n%s", r.traffic.c_str());
      if (r.needle_steps)
        std::printf(
            "  needle recall %.3f: share of (answer step, layer) that attended every sealed chunk holding "
            "the answer in the needle\n",
            r.needle_recall());
      if (const std::string turnover = TurnoverText(r.turnover_by_layer); !turnover.empty())
        std::printf(
            "  decode turnover %s: share of a layer's retrieved chunks that its previous decode step did "
            "not retrieve\n",
            turnover.c_str());
      if (r.reused_selections > 0 || r.sliced_selections > 0)
        std::printf(
            "  of %llu layer selections, %llu reused the last search (--reuse), %llu screened a slice "
            "(--screen)\n",
            static_cast<unsigned long long>(r.selections),
            static_cast<unsigned long long>(r.reused_selections),
            static_cast<unsigned long long>(r.sliced_selections));
      if (r.compressions)
        std::printf(
            "  compression %s: %.1f tokens kept per layer (largest layer %llu, budget %lld), %.1f chunks "
            "dropped per sample (all layers), %.1f compressions per sample\n",
            o.compress.c_str(), r.kept_per_layer(), static_cast<unsigned long long>(r.kept_tokens_max),
            static_cast<long long>(o.kv_budget), r.dropped_per_sample(),
            static_cast<double>(r.compressions) / r.samples);
      if (!r.outputs.empty())
        std::printf("  first answer decoded: \"%s\"\n", model::Printable(r.outputs[0]).c_str());
    }
  } else {
    std::printf("%-9s", "context");
    for (const Method& m : methods) std::printf(" | %-22s", m.name.c_str());
    std::printf("\n%-9s", "");
    for (size_t i = 0; i < methods.size(); ++i) std::printf(" | %-5s %-6s %-9s", "acc", "recall", "s/sample");
    std::printf("\n");
    for (size_t row = 0; row < o.contexts.size(); ++row) {
      std::printf("%-9lld", static_cast<long long>(o.contexts[row]));
      for (size_t i = 0; i < methods.size(); ++i) {
        const Result1& r = results[row * methods.size() + i];
        if (r.skipped) {
          std::printf(" | %-22s", "does not fit");
        } else {
          char recall[16] = "-";
          if (r.needle_steps) std::snprintf(recall, sizeof(recall), "%.3f", r.needle_recall());
          std::printf(" | %-5.3f %-6s %-9.3f", r.accuracy(), recall, r.s_per_sample());
        }
      }
      std::printf("\n");
    }
    std::printf(
        "acc: exact match; recall: needle recall (share of answer steps and layers that attended every\n"
        "sealed chunk holding the answer in the needle; '-' where it never left the sinks or local "
        "window)\n");
    for (const Result1& r : results)
      if (r.skipped)
        std::printf("\n%s at context %lld skipped: %s (raise --full-max-bytes)", r.method.c_str(),
                    static_cast<long long>(r.context), r.skip_reason.c_str());
    std::printf("\nmemory per tier at the largest context (store counters, largest at a sample's end):\n");
    for (size_t i = 0; i < methods.size(); ++i) {
      const Result1& r = results[(o.contexts.size() - 1) * methods.size() + i];
      if (r.skipped) continue;
      std::printf("  %-*s hot %s, warm %s, cold %s; %.0f tokens/s\n", name_w, r.method.c_str(),
                  MiB(r.peak.hot_bytes).c_str(), MiB(r.peak.warm_bytes).c_str(),
                  MiB(r.peak.cold_bytes).c_str(), r.tokens_per_s());
    }
    if (!o.compress.empty()) {
      std::printf(
          "\ncompression %s to %lld tokens/layer at the largest context (kept tokens per layer, "
          "chunks dropped per sample):\n",
          o.compress.c_str(), static_cast<long long>(o.kv_budget));
      for (size_t i = 0; i < methods.size(); ++i) {
        const Result1& r = results[(o.contexts.size() - 1) * methods.size() + i];
        if (r.skipped || !r.compressions) continue;
        std::printf("  %-*s %.1f kept, %.1f dropped\n", name_w, r.method.c_str(), r.kept_per_layer(),
                    r.dropped_per_sample());
      }
    }
  }
  std::printf(
      "\ncost per token (ms; cpu = process CPU time, all %zu threads (--threads); the parts are wall time: "
      "retrieval = probe+search+alloc+fetch, attention, forward+rest = the remainder):\n",
      tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism));
  std::printf(
      "floor = FLOPs per token / %.2f GFLOP/s (OpenBLAS sgemm, one thread, the model's FFN shape, best of 5 "
      "rounds in this run; kvtier's own GEMM there: %.2f GFLOP/s); total = prompt and generated tokens "
      "together\n",
      rates.openblas, rates.kvtier);
  std::printf("%-*s %-9s %-9s %9s %9s %9s %9s %9s %9s\n", name_w, "method", "context", "phase", "cpu",
              "fwd+rest", "retrieval", "attention", "floor", "cpu/floor");
  for (const Result1& r : results) {
    if (r.skipped) continue;
    const PhaseCost total = r.total();
    for (const auto& [phase, c] : {std::pair<const char*, const PhaseCost*>{"prompt", &r.prompt},
                                   std::pair<const char*, const PhaseCost*>{"generated", &r.generated},
                                   std::pair<const char*, const PhaseCost*>{"total", &total}}) {
      const double floor_ms = c->per_token(c->flops) / (gemm_gflops * 1e9) * 1e3;
      const double cpu = c->per_token(c->cpu_s) * 1e3, ret = c->per_token(c->retrieval_ms),
                   att = c->per_token(c->attention_ms);
      std::printf("%-*s %-9lld %-9s %9.4f %9.4f %9.4f %9.4f %9.4f %8.1fx\n", name_w, r.method.c_str(),
                  static_cast<long long>(r.context), phase, cpu, c->per_token(c->wall_s) * 1e3 - ret - att,
                  ret, att, floor_ms, floor_ms > 0 ? cpu / floor_ms : 0.0);
    }
  }
  if (!o.json.empty()) {
    std::ofstream out(o.json, std::ios::binary | std::ios::trunc);
    out << ToJson(o, methods, results, rates) << "\n";
    if (!out) return Fail(IOError("could not write --json file '" + o.json + "'"));
    std::printf("report: %s\n", o.json.c_str());
  }
  return 0;
}

}  // namespace kvtier
