#include "integration/run_job.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <sstream>

#include "engine/compress.h"
#include "engine/session_internal.h"
#include "integration/device_driver.h"
#include "integration/json.h"
#include "integration/kv_source.h"
#include "integration/options_json.h"
#include "integration/policy_eval.h"
#include "integration/progress.h"
#include "integration/sysinfo.h"
#include "integration/tier_report.h"
#include "integration/turnover.h"
#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "kvtier/session.h"
#include "offload/attention_backend.h"
#include "offload/device_memory.h"
#include "offload/host_memory.h"
#include "offload/observe_queries.h"
#include "offload/policy/scoring_policy.h"
#include "offload/representatives.h"
#include "offload/tiered_store.h"
#include "retrieval/retriever.h"

namespace kvtier {
namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double Mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// What one (step, layer) attended: sinks [0, n_sink), the chunks listed, and
// the local window from local_begin on. Enough to decide, for any token,
// whether it was attended.
struct Attended {
  std::vector<uint64_t> chunks;  // sorted chunk indices
  int64_t local_begin = 0;
  bool Contains(int64_t t, int n_sink, int chunk_size) const {
    if (t < n_sink || t >= local_begin) return true;
    const uint64_t idx = static_cast<uint64_t>(ChunkOfPosition(t, n_sink, chunk_size, kAnyChunkCount));
    return std::binary_search(chunks.begin(), chunks.end(), idx);
  }
};

// Queries of one evaluated step: the question window (m queries) or a decode step (1).
struct StepRecord {
  int64_t first_position = 0;
  int m = 0;
  std::vector<std::vector<float>> q_layer_cache;  // [layer][m, q_heads, D] (decode steps of methods[0])
  std::vector<std::vector<float>> out;            // [layer][m, q_heads, D] sparse output
  std::vector<Attended> attended;                 // [layer]
  double ms = 0, probe_ms = 0, retrieve_ms = 0, alloc_ms = 0, fetch_ms = 0, attention_ms = 0, append_ms = 0;
  double other_ms = 0;  // Session::Attend's wall time outside the parts above (not in ms)
  double chunks = 0;
  uint64_t bytes_moved = 0;
  // Bytes read, all layers (AttendStats' counts; the fetch's from the store's loads).
  uint64_t first_stage_bytes = 0, rescoring_bytes = 0, attention_bytes = 0, fetch_bytes = 0;
};

kernels::AttentionParams MakeParams(const Geometry& g, const float* q, const int64_t* pos, int m,
                                    const std::vector<kernels::KvSpan>& parts, float* out) {
  return DenseAttentionParams(g, g.dtype, q, pos, m, parts.data(), static_cast<int>(parts.size()), out);
}

Status RunKernel(const kernels::AttentionParams& p) {
  const kernels::KernelError e = kernels::Attention(p);
  if (e != kernels::KernelError::kOk)
    return Internal(std::string("attention kernel: ") + kernels::KernelErrorString(e));
  return Status::Ok();
}

}  // namespace

Status RunOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(store.Validate());
  // A trace brings its own data; the synthetic knobs are not used.
  KVTIER_RETURN_IF_ERROR(trace ? trace->Validate() : workload.Validate());
  if (budget < 0) return InvalidArgument("budget must be >= 0 (got " + std::to_string(budget) + ")");
  if (window <= 0) return InvalidArgument("window must be > 0 (got " + std::to_string(window) + ")");
  if (stat_stride <= 0)
    return InvalidArgument("stat_stride must be > 0 (got " + std::to_string(stat_stride) + ")");
  if (workload.context <= store.n_sink + store.n_local)
    return InvalidArgument("context (" + std::to_string(workload.context) +
                           ") must exceed n_sink + n_local (" + std::to_string(store.n_sink + store.n_local) +
                           ") for anything to be retrieved");
  {
    RetrieverOptions r = retrieval;
    r.budget_tokens = budget;
    KVTIER_RETURN_IF_ERROR(r.Validate());
  }
  if (spearman_windows < 0) return InvalidArgument("spearman_windows must be >= 0");
  if (measure_bandwidth) {
    const Status bw = bandwidth.Validate();
    if (!bw.ok()) return InvalidArgument("bandwidth: " + bw.message());
  }
  if (!compress.empty()) {
    auto p = MakeScoringPolicy(compress);
    if (!p.ok()) return InvalidArgument("compress: " + p.status().message());
    if (kv_budget < store.n_sink + store.n_local)
      return InvalidArgument("kv_budget (" + std::to_string(kv_budget) +
                             ") must cover the sinks and local window (" +
                             std::to_string(store.n_sink + store.n_local) + " tokens)");
  }
  if (observe < 1 || observe > workload.context)
    return InvalidArgument("observe must be in [1, context] (got " + std::to_string(observe) + ")");
  const uint64_t budget_chunks = static_cast<uint64_t>(budget / store.chunk_size);
  if (budget_chunks * store.chunk_bytes() > store.hot_bytes)
    return InvalidArgument(
        "budget (" + std::to_string(budget) + " tokens = " + std::to_string(budget_chunks) +
        " chunks) does not fit the hot slot pool (hot_bytes " + std::to_string(store.hot_bytes) + ")");
  return Status::Ok();
}

namespace {

// One retrieval method under evaluation: its own retriever (probe state and
// indexes), and what it did at each evaluated step.
struct Method {
  std::string name;
  // The store and sequence it reads: the shared ones, or, for InfLLM's row, a store of the same
  // tokens whose representatives are per query head (see "InfLLM as written" below).
  TieredStore* store = nullptr;
  SequenceId seq = 0;
  int chunk_size = 0;                // its store's chunk size (own stores may differ from the configured)
  std::unique_ptr<Session> session;  // its own retrieval state over its sequence
  std::vector<StepRecord> steps;     // [0] question window, then decode steps
  uint64_t bytes_moved = 0;
  double chunks = 0;
};

// Spearman rho with average ranks for ties.
double Spearman(const std::vector<double>& a, const std::vector<double>& b) {
  auto ranks = [](const std::vector<double>& v) {
    std::vector<size_t> o(v.size());
    std::iota(o.begin(), o.end(), 0);
    std::sort(o.begin(), o.end(), [&](size_t x, size_t y) { return v[x] < v[y]; });
    std::vector<double> r(v.size());
    for (size_t i = 0; i < o.size();) {
      size_t j = i;
      while (j + 1 < o.size() && v[o[j + 1]] == v[o[i]]) ++j;
      for (size_t t = i; t <= j; ++t) r[o[t]] = 0.5 * static_cast<double>(i + j);
      i = j + 1;
    }
    return r;
  };
  const std::vector<double> ra = ranks(a), rb = ranks(b);
  const double n = static_cast<double>(a.size());
  if (n < 2) return 0.0;
  const double ma = std::accumulate(ra.begin(), ra.end(), 0.0) / n,
               mb = std::accumulate(rb.begin(), rb.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < ra.size(); ++i) {
    sab += (ra[i] - ma) * (rb[i] - mb);
    saa += (ra[i] - ma) * (ra[i] - ma);
    sbb += (rb[i] - mb) * (rb[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0.0;
}

SpearmanSummary Summarize(std::vector<double> v) {
  SpearmanSummary s;
  s.samples = static_cast<int>(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto q = [&](double f) { return v[static_cast<size_t>(f * (v.size() - 1) + 0.5)]; };
  s.median = Median(v);
  s.q1 = q(0.25);
  s.q3 = q(0.75);
  return s;
}

// A prefill window sampled for probe-to-oracle agreement: the probes' scores
// of every chunk that existed then, per layer.
struct SampledWindow {
  int64_t begin = 0, end = 0;
  std::vector<std::vector<uint64_t>> ids;                   // [layer]
  std::vector<std::vector<float>> act_scores, mean_scores;  // [layer]
};

}  // namespace

Result<RunReport> RunJob(const RunOptions& options) {
  RunOptions opt = options;
  if (opt.trace) AdoptTrace(*opt.trace, &opt.store.geometry, &opt.workload);
  KVTIER_RETURN_IF_ERROR(opt.Validate());
  const Geometry& g = opt.store.geometry;
  // The data: synthetic or a recorded trace; everything below reads it through `work`.
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<KvSource> source, MakeKvSource(g, opt.workload, opt.trace));
  const KvSource& work = *source;
  // The program, its libraries and the device runtime are in the RSS bound as measured here,
  // before the store allocates anything.
  InitDeviceRuntime();
  const uint64_t rss_at_start = CurrentRssBytes();
  KVTIER_ASSIGN_OR_RETURN(auto store, TieredStore::Open(opt.store));
  KVTIER_ASSIGN_OR_RETURN(SequenceId seq, store->CreateSequence());
  // drop_at_end: on an error return the sequence leaves every tier here (after the sessions
  // below, declared later, are gone); on success it is dropped explicitly, errors reported.
  struct DropAtEnd {
    TieredStore* store;
    SequenceId seq;
    bool armed;
    ~DropAtEnd() {
      if (armed) store->DropSequence(seq).IgnoreError();
    }
  } drop_guard{store.get(), seq, opt.drop_at_end};
  ResetPeakRss();

  RunReport rep;
  rep.rss_at_start_bytes = rss_at_start;
  // RocksDB's memory, sampled once per prefill window and decode step (its peak is what the
  // stated overhead must cover).
  auto sample_lower_tier_memory = [&] {
    rep.lower_tier_memory_peak_bytes =
        std::max(rep.lower_tier_memory_peak_bytes, store->lower_tiers().memory_bytes());
  };
  rep.sequence = seq;
  rep.options = opt;
  const int L = g.layers, Hq = g.q_heads, D = g.head_dim;
  const size_t q_elems = static_cast<size_t>(Hq) * D;
  const size_t kv_elems = g.token_elems();
  const size_t elem = DTypeSize(g.dtype);
  const int64_t context = opt.workload.context;
  const int64_t qbegin = work.question_begin();
  const int n_sink = opt.store.n_sink, cs = opt.store.chunk_size;
  rep.context_kv_bytes = static_cast<uint64_t>(context) * L * g.token_kv_bytes();

  // ---- rows with a store of their own ----
  // A comparison row whose paper keeps its chunks otherwise than the configured store reads a
  // second store of the same tokens (cold tier in a directory under data_dir, removed at the
  // end; no remote tier), fed the same K/V and observed queries, so the other rows keep the
  // configured store. None is opened with a scoring policy or compression (they drop chunks of
  // the configured store only) or without a cold tier (data_dir empty: the context would not fit
  // a second store's warm tier); the rows that need one are then left out (RunReport::
  // compare_notes says so), except InfLLM's, which reads the configured store as before.
  //  * InfLLM as written: InfLLM's ContextManager keeps each query head's own representatives
  //    (its top repr_topk tokens by the attention it gave them) and scores a block per query
  //    head: StoreOptions::repr_heads = query. Not opened (the row reads the configured store)
  //    when the configured store is per query head already, or when every key is a
  //    representative (repr_topk = chunk_size: a query head's mean representative is then its
  //    kv head's mean key, and the score is the kv-head score times the group size, the same
  //    ranking).
  //  * InfLLM at its own defaults: the same, with InfLLM's block size 128, 4 representatives and
  //    its top 16 blocks (kInfLLMBlock, kInfLLMReprTopk, kInfLLMTopBlocks): 2048 tokens a layer
  //    whatever the run's budget. Needs n_local to be a multiple of 128.
  //  * Quest: its bound needs every key's min and max, and an index sees representatives only,
  //    so every key is one (repr_topk = chunk_size); not opened when the configured store keeps
  //    every key per kv head already, without an index cap (the Quest kind takes none).
  const bool scoring_policy =
      !opt.compress.empty() || opt.store.warm_policy != "lru" || opt.store.hot_policy != "lru";
  const bool own_stores = opt.compare && !scoring_policy && !opt.store.data_dir.empty();
  struct OwnStore {
    struct RemoveDirAtEnd {  // after the store below is gone
      std::string dir;
      ~RemoveDirAtEnd() {
        std::error_code ec;
        if (!dir.empty()) std::filesystem::remove_all(dir, ec);
      }
    } dir;
    std::unique_ptr<TieredStore> store;
    SequenceId seq = 0;
  };
  std::vector<std::unique_ptr<OwnStore>> own;  // outlives the methods' sessions (declared later)
  auto open_own = [&](StoreOptions so, const std::string& subdir) -> Result<OwnStore*> {
    so.remote.clear();
    so.data_dir = opt.store.data_dir + "/" + subdir;
    auto os = std::make_unique<OwnStore>();
    os->dir.dir = so.data_dir;
    std::error_code ec;
    std::filesystem::remove_all(so.data_dir, ec);  // what an interrupted run left
    KVTIER_ASSIGN_OR_RETURN(os->store, TieredStore::Open(so));
    KVTIER_ASSIGN_OR_RETURN(os->seq, os->store->CreateSequence());
    own.push_back(std::move(os));
    return own.back().get();
  };
  OwnStore* infllm_own = nullptr;
  if (own_stores && opt.store.repr_heads == ReprHeads::kKv && opt.store.repr_topk < cs) {
    StoreOptions qo = opt.store;
    qo.repr_heads = ReprHeads::kQuery;
    KVTIER_ASSIGN_OR_RETURN(infllm_own, open_own(qo, "infllm-query-heads"));
  }
  OwnStore* infllm_defaults_own = nullptr;
  if (own_stores && opt.store.n_local % kInfLLMBlock == 0) {
    StoreOptions qo = opt.store;
    qo.chunk_size = kInfLLMBlock;
    qo.repr_topk = kInfLLMReprTopk;
    qo.repr_heads = ReprHeads::kQuery;
    qo.index_bytes = 0;  // its index kind (Flat) takes no memory cap
    // Its top blocks fit the hot slot pool whatever the run's budget.
    qo.hot_bytes = std::max<uint64_t>(qo.hot_bytes, uint64_t{kInfLLMTopBlocks} * qo.chunk_bytes());
    KVTIER_ASSIGN_OR_RETURN(infllm_defaults_own, open_own(qo, "infllm-own-defaults"));
  }
  OwnStore* quest_own = nullptr;
  const bool quest_shared =
      opt.store.repr_topk == cs && opt.store.repr_heads == ReprHeads::kKv && opt.store.index_bytes == 0;
  if (own_stores && !quest_shared) {
    StoreOptions qo = opt.store;
    qo.repr_topk = cs;
    qo.repr_heads = ReprHeads::kKv;
    qo.index_bytes = 0;  // its index kind (Quest) takes no memory cap
    KVTIER_ASSIGN_OR_RETURN(quest_own, open_own(qo, "quest-every-key"));
  }

  // ---- the methods: the configured one, or the comparison set ----
  std::vector<Method> methods;
  int headline_method = 0;  // the configured retrieval's row: its numbers fill the report's top level
  auto add_method = [&](const std::string& name, const RetrieverOptions& ro, TieredStore* own_store = nullptr,
                        SequenceId own_seq = 0) -> Status {
    Method m;
    m.name = name;
    m.store = own_store != nullptr ? own_store : store.get();
    m.seq = own_store != nullptr ? own_seq : seq;
    m.chunk_size = m.store->options().chunk_size;
    // Representative-key statistics come from the prefill below (every stat_stride-th query),
    // once for the sequence, not from each method's evaluated steps.
    SessionOptions so;
    so.retrieval = ro;
    so.observe_prefill = false;
    so.defer_cold_chunks = opt.defer_cold_chunks;
    KVTIER_ASSIGN_OR_RETURN(m.session, Session::Attach(m.store, m.seq, so));
    methods.push_back(std::move(m));
    return Status::Ok();
  };
  // A paper method as its preset writes it (PaperRetrieval: the configured index kind where it
  // computes the paper's chunk score, scores summed over kv heads) at the given budget.
  RetrieverOptions configured = opt.retrieval;
  configured.budget_tokens = opt.budget;
  auto paper = [&](const std::string& preset, const std::string& probe, const std::string& alloc,
                   int budget) -> Result<RetrieverOptions> {
    KVTIER_ASSIGN_OR_RETURN(RetrieverOptions ro, PaperRetrieval(preset, configured));
    ro.probe = probe;
    ro.alloc = alloc;
    ro.budget_tokens = budget;
    return ro;
  };
  if (opt.compare) {
    KVTIER_ASSIGN_OR_RETURN(RetrieverOptions streaming, paper("infllm", "mean", "topk", 0));
    KVTIER_ASSIGN_OR_RETURN(RetrieverOptions infllm, paper("infllm", "mean", "topk", opt.budget));
    KVTIER_ASSIGN_OR_RETURN(RetrieverOptions act_topk, paper("actqkv", "act", "topk", opt.budget));
    KVTIER_ASSIGN_OR_RETURN(RetrieverOptions actqkv,
                            paper("actqkv", "act", "entropy:rank=cosine", opt.budget));
    KVTIER_RETURN_IF_ERROR(add_method("StreamingLLM", streaming));
    KVTIER_RETURN_IF_ERROR(add_method("InfLLM", infllm, infllm_own ? infllm_own->store.get() : nullptr,
                                      infllm_own ? infllm_own->seq : 0));
    if (infllm_defaults_own != nullptr) {
      // InfLLM's scoring (as the InfLLM row computes it) over its own store, at its top 16 blocks.
      RetrieverOptions d = infllm;
      d.budget_tokens = kInfLLMTopBlocks * kInfLLMBlock;
      KVTIER_RETURN_IF_ERROR(
          add_method(kInfLLMDefaultsRow, d, infllm_defaults_own->store.get(), infllm_defaults_own->seq));
      if (d.budget_tokens != opt.budget)
        rep.compare_notes.push_back(std::string(kInfLLMDefaultsRow) + " retrieves its own default, " +
                                    std::to_string(kInfLLMTopBlocks) + " blocks of " +
                                    std::to_string(kInfLLMBlock) + " = " + std::to_string(d.budget_tokens) +
                                    " tokens a layer; the other rows " + std::to_string(opt.budget));
    } else {
      rep.compare_notes.push_back(
          std::string(kInfLLMDefaultsRow) + " left out: " +
          (!own_stores ? std::string("it needs a store of its own (a cold tier, no scoring policy)")
                       : "n_local (" + std::to_string(opt.store.n_local) +
                             ") is not a multiple of its block (" + std::to_string(kInfLLMBlock) + ")"));
    }
    KVTIER_RETURN_IF_ERROR(add_method("ActQKV w/o cut-off", act_topk));
    KVTIER_RETURN_IF_ERROR(add_method("ActQKV", actqkv));
    if (quest_own != nullptr || quest_shared) {
      // Quest's bound over every key, the current query's (mean-pooled per kv head) probe, a
      // fixed top-k at the run's budget.
      RetrieverOptions q = configured;
      q.probe = "mean";
      q.alloc = "topk";
      q.index = kQuestRowIndex;
      q.reuse_cosine = 0.0;
      q.screen_period = 1;
      KVTIER_RETURN_IF_ERROR(add_method("Quest", q, quest_own ? quest_own->store.get() : nullptr,
                                        quest_own ? quest_own->seq : 0));
    } else {
      rep.compare_notes.push_back(
          "Quest left out: it needs a store of its own (a cold tier, no scoring policy) that keeps every key "
          "as a representative");
    }
    headline_method = static_cast<int>(methods.size());
    KVTIER_RETURN_IF_ERROR(add_method("kvtier", configured));
    // kvtier-fast: the configured retrieval with the preset's search reuse (not exact: held to
    // answers and needle hits, docs/benchmarks.md "The kvtier-fast preset"); left out when the
    // configured retrieval reuses already (the kvtier row is then that).
    if (configured.reuse_cosine == 0.0) {
      KVTIER_ASSIGN_OR_RETURN(RetrievalPreset fast_preset, MakeRetrievalPreset("kvtier-fast"));
      RetrieverOptions fast = configured;
      fast.reuse_cosine = fast_preset.retrieval.reuse_cosine;
      KVTIER_RETURN_IF_ERROR(add_method("kvtier-fast", fast));
    } else {
      rep.compare_notes.push_back(
          "kvtier-fast left out: the configured retrieval reuses its searches already "
          "(--reuse); the kvtier row is that configuration");
    }
  } else {
    KVTIER_RETURN_IF_ERROR(add_method("configured", configured));
  }
  // Probe-to-oracle agreement uses its own act and mean probes (same chunks).
  std::unique_ptr<Retriever> act_probe, mean_probe;
  if (opt.spearman_windows > 0) {
    RetrieverOptions ro = opt.retrieval;
    ro.alloc = "topk";
    ro.screen_period = 1;  // a topk allocator screens every chunk
    ro.budget_tokens = opt.budget;
    ro.probe = "act";
    KVTIER_ASSIGN_OR_RETURN(act_probe, Retriever::Create(store.get(), ro));
    ro.probe = "mean";
    KVTIER_ASSIGN_OR_RETURN(mean_probe, Retriever::Create(store.get(), ro));
  }
  // Windows sampled for agreement: evenly spread over the second half of the
  // prefill (earlier windows have few chunks to rank).
  std::vector<SampledWindow> sampled;
  std::vector<int64_t> sample_at;
  for (int i = 0; i < opt.spearman_windows; ++i) {
    const int64_t pos = context / 2 + (qbegin - context / 2) * (i + 1) / (opt.spearman_windows + 1);
    sample_at.push_back(pos / opt.window * opt.window);
  }

  // ---- prefill: append the context in windows, observe statistics ----
  std::vector<float> qf, kf, vf;
  std::vector<uint8_t> kb, vb;
  auto generate = [&](int layer, int64_t b, int64_t e) {
    const size_t n = static_cast<size_t>(e - b);
    qf.resize(n * q_elems);
    kf.resize(n * kv_elems);
    vf.resize(n * kv_elems);
    kb.resize(n * kv_elems * elem);
    vb.resize(n * kv_elems * elem);
    work.Generate(layer, b, e, qf.data(), kf.data(), vf.data());
    FromFloat(g.dtype, kf.data(), kb.data(), n * kv_elems);
    FromFloat(g.dtype, vf.data(), vb.data(), n * kv_elems);
  };
  Progress prog(opt.progress, "prefill", context, "tokens");
  double prefill_s = 0;
  std::vector<float> sq;
  std::vector<int64_t> spos, window_pos;
  // Every stat_stride-th query of the window [b, e) held in qf, from the last
  // one back, skipping positions below min_pos: the observed queries (sq, spos).
  auto gather_strided = [&](int64_t b, int64_t e, int64_t min_pos) {
    sq.clear();
    spos.clear();
    for (int64_t p = e - 1; p >= b && p >= min_pos; p -= opt.stat_stride) {
      spos.push_back(p);
      sq.insert(sq.end(), qf.begin() + (p - b) * q_elems, qf.begin() + (p - b + 1) * q_elems);
    }
  };
  for (int64_t b = 0; b < context; b += opt.window) {
    const int64_t e = std::min(context, b + opt.window);
    const bool sample = std::find(sample_at.begin(), sample_at.end(), b) != sample_at.end() && b < qbegin;
    if (sample) {
      sampled.emplace_back();
      sampled.back().begin = b;
      sampled.back().end = e;
      sampled.back().ids.resize(L);
      sampled.back().act_scores.resize(L);
      sampled.back().mean_scores.resize(L);
    }
    for (int l = 0; l < L; ++l) {
      generate(l, b, e);
      const double t0 = NowSeconds();
      KVTIER_RETURN_IF_ERROR(
          methods[0].session->Append(l, kb.data(), vb.data(), static_cast<int>(e - b), g.dtype));
      gather_strided(b, e, n_sink);
      // With every key a representative (repr_topk = chunk_size) the statistics choose nothing.
      if (!spos.empty() && opt.store.repr_topk < cs)
        KVTIER_RETURN_IF_ERROR(
            ObserveQueries(*store, seq, l, sq.data(), spos.data(), static_cast<int>(spos.size())));
      // The rows' own stores take the window too (not in prefill_s: the configured store's prefill).
      const int m = static_cast<int>(e - b);
      const double own0 = NowSeconds();
      for (Method& mt : methods) {
        if (mt.store == store.get()) continue;  // each own store has one row
        KVTIER_RETURN_IF_ERROR(mt.session->Append(l, kb.data(), vb.data(), m, g.dtype));
        if (!spos.empty() && mt.store->options().repr_topk < mt.chunk_size)
          KVTIER_RETURN_IF_ERROR(
              ObserveQueries(*mt.store, mt.seq, l, sq.data(), spos.data(), static_cast<int>(spos.size())));
      }
      const double own_s = NowSeconds() - own0;
      // Every window feeds the probes' running statistics (ActQKV Eq. 8 runs over all windows so far).
      window_pos.resize(static_cast<size_t>(m));
      std::iota(window_pos.begin(), window_pos.end(), b);
      for (Method& mt : methods)
        KVTIER_RETURN_IF_ERROR(mt.session->Observe(l, qf.data(), window_pos.data(), m));
      prefill_s += NowSeconds() - t0 - own_s;
      if (act_probe) {
        if (sample) {
          std::vector<uint64_t> ids2;
          KVTIER_RETURN_IF_ERROR(act_probe->ObserveAndScore(seq, l, qf.data(), m, &sampled.back().ids[l],
                                                            &sampled.back().act_scores[l]));
          KVTIER_RETURN_IF_ERROR(
              mean_probe->ObserveAndScore(seq, l, qf.data(), m, &ids2, &sampled.back().mean_scores[l]));
          if (ids2 != sampled.back().ids[l])
            return Internal("act and mean probes scored different chunk sets");
          // Analysis only: rebuilt from the store at the next sample, not held in between.
          act_probe->DropIndexes();
          mean_probe->DropIndexes();
        } else {
          KVTIER_RETURN_IF_ERROR(act_probe->Observe(l, qf.data(), m));
        }
      }
    }
    sample_lower_tier_memory();
    prog.Update(e);
  }
  prog.Done();
  rep.prefill_s = prefill_s;
  // The prefill leaves cold writes queued (every sealed chunk goes to RocksDB in the
  // background). The evaluated steps start once those are durable, so a step's time is a
  // decode step's, not the tail of the prefill's write-back contending with it; the drain
  // is reported on its own (prefill_drain_s).
  {
    const double t0 = NowSeconds();
    KVTIER_RETURN_IF_ERROR(store->WaitForDurable());
    rep.prefill_drain_s = NowSeconds() - t0;
    // The rows' own stores too, so that no row's steps share the cores with their write-back.
    for (const auto& os : own) KVTIER_RETURN_IF_ERROR(os->store->WaitForDurable());
  }

  // ---- the scoring policy at prefill end: demotion scores and/or compression ----
  // The last `observe` prompt queries attend exactly over every key of the layer (read
  // back from whichever tier holds it); the policy observes that, layer by layer.
  // Chunk scores are the block aggregation of its token scores (StructKV's S_block);
  // in compression mode the chunks holding the most keep-set tokens stay (ties by
  // score), up to kv_budget tokens, and the rest leave the store and every index.
  const std::string demotion_spec =
      opt.store.warm_policy != "lru" ? opt.store.warm_policy : opt.store.hot_policy;
  const std::string policy_spec =
      !opt.compress.empty() ? opt.compress : (demotion_spec != "lru" ? demotion_spec : "");
  std::unique_ptr<ScoringPolicy> policy;
  // Observes one layer: the queries at positions [q_first, q_last] attend exactly over every
  // key the store still holds for the layer (sinks, live chunks, local window).
  auto observe_layer = [&](int l, int64_t q_first, int64_t q_last) -> Status {
    KVTIER_ASSIGN_OR_RETURN(LayerKeys lk, ReadLayerKeys(store.get(), seq, l));
    const std::vector<int64_t>& keypos = lk.positions;
    const std::vector<float>& K = lk.keys;
    const std::vector<float>& V = lk.values;
    const size_t n = keypos.size();
    const int m = static_cast<int>(q_last - q_first + 1);
    std::vector<int64_t> qpos(m);
    std::iota(qpos.begin(), qpos.end(), q_first);
    std::vector<float> q(static_cast<size_t>(m) * q_elems), attn(static_cast<size_t>(Hq) * m * n);
    work.Generate(l, q_first, q_last + 1, q.data(), nullptr, nullptr);
    rep.policy.scratch_bytes = std::max<uint64_t>(
        rep.policy.scratch_bytes, (2 * K.size() + attn.size()) * sizeof(float) + 2 * lk.raw_bytes);
    double t0 = NowSeconds();
    ExactAttentionRows(g, q.data(), qpos.data(), m, K.data(), keypos.data(), static_cast<int64_t>(n),
                       attn.data());
    rep.policy.attention_ms += 1e3 * (NowSeconds() - t0);
    AttentionObservation obs;
    obs.layer = l;
    obs.n_queries = m;
    obs.n_keys = static_cast<int64_t>(n);
    obs.key_positions = keypos.data();
    obs.query_positions = qpos.data();
    obs.attention = attn.data();
    obs.keys = K.data();
    obs.values = V.data();
    t0 = NowSeconds();
    KVTIER_RETURN_IF_ERROR(policy->Observe(obs));
    rep.policy.scoring_ms += 1e3 * (NowSeconds() - t0);
    return Status::Ok();
  };
  // Demotion scores, or compression, for one observed layer. Chunk i holds positions
  // [n_sink + i*cs, n_sink + (i+1)*cs); its score is the block aggregation of the
  // policy's token scores over kv heads. In compression mode a chunk's worth is that
  // aggregation over the tokens the policy kept (so its keep decision counts, not only its
  // ranking): chunks it kept nothing of leave, and at most kv_budget tokens stay.
  auto apply_layer = [&](int l) -> Status {
    const double t0 = NowSeconds();
    KVTIER_ASSIGN_OR_RETURN(uint64_t n_chunks, store->ChunkCount(seq, l));
    KVTIER_ASSIGN_OR_RETURN(TokenScores ts, policy->Scores(l));
    std::vector<std::pair<uint64_t, float>> chunk_scores(n_chunks);
    for (uint64_t i = 0; i < n_chunks; ++i) chunk_scores[i] = {i, 0.0f};
    for (const auto& [c, score] : AggregateToChunks(ts, n_sink, cs, n_chunks)) chunk_scores[c].second = score;
    if (opt.compress.empty()) {
      rep.policy.scoring_ms += 1e3 * (NowSeconds() - t0);
      return store->SetChunkScores(seq, l, chunk_scores);
    }
    KVTIER_ASSIGN_OR_RETURN(KeepSet keep, policy->Keep(l, opt.kv_budget));
    KVTIER_ASSIGN_OR_RETURN(int64_t chunk_budget, ChunkBudget(*store, seq, l, opt.kv_budget));
    const std::vector<uint64_t> drop = ChunksToDrop(ts, keep, n_sink, cs, n_chunks, chunk_budget);
    rep.policy.scoring_ms += 1e3 * (NowSeconds() - t0);
    const uint64_t dropped_before = store->counters().dropped_chunks;
    KVTIER_RETURN_IF_ERROR(store->DropChunks(seq, l, drop));
    for (Method& mt : methods) KVTIER_RETURN_IF_ERROR(ImplOf(*mt.session).retriever()->Forget(seq, l, drop));
    if (act_probe) {
      KVTIER_RETURN_IF_ERROR(act_probe->Forget(seq, l, drop));
      KVTIER_RETURN_IF_ERROR(mean_probe->Forget(seq, l, drop));
    }
    rep.policy.dropped_chunks += store->counters().dropped_chunks - dropped_before;
    return Status::Ok();
  };
  // Kept tokens per layer (mean): what the store still holds.
  auto kept_tokens = [&]() -> Result<uint64_t> { return KeptTokensPerLayer(*store, seq, L); };
  if (!policy_spec.empty()) {
    // ---- the scoring policy at prefill end: demotion scores and/or compression ----
    // The last `observe` prompt queries attend exactly over every key of the layer (read
    // back from whichever tier holds it); the policy observes that, layer by layer.
    KVTIER_ASSIGN_OR_RETURN(policy, MakeScoringPolicy(policy_spec));
    PolicyGeometry pg;
    pg.layers = L;
    pg.q_heads = Hq;
    pg.kv_heads = g.kv_heads;
    pg.head_dim = D;
    pg.sink_tokens = n_sink;
    pg.local_tokens = opt.store.n_local;
    KVTIER_RETURN_IF_ERROR(policy->Begin(pg));
    rep.policy.spec = policy->ToString();
    for (int l = 0; l < L; ++l) KVTIER_RETURN_IF_ERROR(observe_layer(l, context - opt.observe, context - 1));
    for (int l = 0; l < L; ++l) KVTIER_RETURN_IF_ERROR(apply_layer(l));
    if (!opt.compress.empty()) {
      rep.policy.compressed = true;
      rep.policy.compressions = 1;
      KVTIER_ASSIGN_OR_RETURN(rep.policy.kept_tokens, kept_tokens());
    }
  }

  // ---- evaluated steps: the question window, then decode steps ----
  // Every method attends over the same store; in a comparison the hot slot
  // cache is emptied before each method's step, so no method is served by
  // chunks another method fetched.
  // On a cuda tier the decode steps go through the device-pointer calls, as an engine's do.
  std::unique_ptr<DeviceDriver> driver;
  if (opt.store.device == Device::kCuda && !opt.host_calls) {
    KVTIER_ASSIGN_OR_RETURN(driver, DeviceDriver::Create(g));
  }
  auto sparse_step = [&](Method& mt, int64_t first, int m, bool decode,
                         const std::vector<std::vector<float>>& qs) -> Result<StepRecord> {
    StepRecord rec;
    rec.first_position = first;
    rec.m = m;
    rec.out.resize(L);
    rec.attended.resize(L);
    std::vector<int64_t> pos(m);
    std::iota(pos.begin(), pos.end(), first);
    if (methods.size() > 1) mt.store->EvictHot();
    // Chunks promoted into hot slots, from whichever tier: the fetch's bytes.
    auto loads = [](const StoreCounters& c) { return c.warm_loads + c.cold_loads + c.remote_loads; };
    const StoreCounters before = mt.store->counters();
    const uint64_t moved0 = before.bytes_moved;
    KVTIER_RETURN_IF_ERROR(mt.session->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill));
    for (int l = 0; l < L; ++l) {
      rec.out[l].assign(static_cast<size_t>(m) * q_elems, 0.0f);
      AttendStats st;
      const double t0 = NowSeconds();
      if (driver && decode)
        KVTIER_RETURN_IF_ERROR(driver->Attend(mt.session.get(), l, qs[l].data(), pos.data(), &st));
      else
        KVTIER_RETURN_IF_ERROR(mt.session->Attend(l, qs[l].data(), pos.data(), m, rec.out[l].data(), &st));
      const double wall_ms = 1e3 * (NowSeconds() - t0);
      rec.other_ms +=
          std::max(0.0, wall_ms - (st.probe_ms + st.search_ms + st.alloc_ms + st.fetch_ms + st.attention_ms));
      rec.probe_ms += st.probe_ms;
      rec.retrieve_ms += st.search_ms;
      rec.alloc_ms += st.alloc_ms;
      rec.fetch_ms += st.fetch_ms;
      rec.attention_ms += st.attention_ms;
      rec.chunks += st.chunks;
      rec.first_stage_bytes += st.first_stage_bytes;
      rec.rescoring_bytes += st.rescoring_bytes;
      rec.attention_bytes += st.attention_bytes;
      std::vector<uint64_t> chunks = mt.session->last_chunks()[static_cast<size_t>(l)];
      std::sort(chunks.begin(), chunks.end());
      rec.attended[l].chunks = std::move(chunks);
      KVTIER_ASSIGN_OR_RETURN(HotView view, GetHotView(*mt.store, mt.seq, l));
      rec.attended[l].local_begin = view.n_local_spans ? view.local[0].first_position : view.n_tokens;
    }
    if (driver && decode) {
      // The engine reads the step's outputs back: the device work of the step ends here.
      const double t0 = NowSeconds();
      KVTIER_RETURN_IF_ERROR(driver->ReadOutputs(&rec.out));
      // A decode step on the session's device lane names its chunks one step late: read this
      // step's now (one wait, counted in the session's host_syncs) for the report.
      KVTIER_RETURN_IF_ERROR(mt.session->WaitForDevice());
      rec.chunks = 0;
      for (int l = 0; l < L; ++l) {
        std::vector<uint64_t> chunks = mt.session->last_chunks()[static_cast<size_t>(l)];
        rec.chunks += static_cast<double>(chunks.size());
        std::sort(chunks.begin(), chunks.end());
        rec.attended[l].chunks = std::move(chunks);
      }
      rec.other_ms += 1e3 * (NowSeconds() - t0);
    }
    const StoreCounters after = mt.store->counters();
    rec.bytes_moved = after.bytes_moved - moved0;
    rec.fetch_bytes = (loads(after) - loads(before)) * mt.store->options().chunk_bytes();
    return rec;
  };

  std::vector<std::vector<float>> step_q(L);  // [layer] queries of the current step
  std::vector<std::vector<float>> question_q(L);
  for (int l = 0; l < L; ++l) {
    question_q[l].resize(static_cast<size_t>(opt.workload.question_len) * q_elems);
    work.Generate(l, qbegin, context, question_q[l].data(), nullptr, nullptr);
    for (Method& mt : methods) {
      Status st = mt.session->SetQuestion(l, question_q[l].data(), opt.workload.question_len);
      if (!st.ok() && st.code() != StatusCode::kFailedPrecondition)
        return st;  // probes without a question term
    }
  }
  // The question window was appended with the context; its queries attend now.
  for (Method& mt : methods) {
    KVTIER_ASSIGN_OR_RETURN(StepRecord question,
                            sparse_step(mt, qbegin, opt.workload.question_len, false, question_q));
    mt.steps.push_back(std::move(question));
  }
  auto host_syncs = [&methods] {
    uint64_t n = 0;
    for (const Method& mt : methods) n += mt.session->counters().host_syncs;
    return n;
  };
  const uint64_t decode_syncs0 = host_syncs();
  auto worker_host_syncs = [&methods] {
    uint64_t n = 0;
    for (const Method& mt : methods) n += mt.session->counters().worker_host_syncs;
    return n;
  };
  const uint64_t decode_worker_syncs0 = worker_host_syncs();
  auto chunks_deferred = [&methods] {
    uint64_t n = 0;
    for (const Method& mt : methods) n += mt.session->counters().chunks_deferred;
    return n;
  };
  const uint64_t decode_deferred0 = chunks_deferred();
  Progress dprog(opt.progress, "decode", opt.workload.decode_steps, "steps");
  for (int s = 0; s < opt.workload.decode_steps; ++s) {
    const int64_t p = context + s;
    // The configured store's append, and each own store's (by row: each own store has one).
    double append_ms = 0;
    std::vector<double> own_append_ms(methods.size(), 0.0);
    for (int l = 0; l < L; ++l) {
      generate(l, p, p + 1);
      step_q[l].assign(qf.begin(), qf.end());
      for (Method& mt : methods) {
        const bool shared = mt.store == store.get();
        if (shared && &mt != &methods[0]) continue;  // the shared sequence takes the token once
        const double t0 = NowSeconds();
        if (driver)
          KVTIER_RETURN_IF_ERROR(driver->Append(mt.session.get(), l, kb.data(), vb.data(), g.dtype));
        else
          KVTIER_RETURN_IF_ERROR(mt.session->Append(l, kb.data(), vb.data(), 1, g.dtype));
        (shared ? append_ms : own_append_ms[static_cast<size_t>(&mt - methods.data())]) +=
            1e3 * (NowSeconds() - t0);
      }
    }
    for (Method& mt : methods) {
      KVTIER_ASSIGN_OR_RETURN(StepRecord rec, sparse_step(mt, p, 1, true, step_q));
      rec.append_ms =
          mt.store == store.get() ? append_ms : own_append_ms[static_cast<size_t>(&mt - methods.data())];
      if (&mt == &methods[0]) rec.q_layer_cache = step_q;  // the baseline replays these queries
      mt.steps.push_back(std::move(rec));
    }
    // Policies that compress while decoding (G-KV's s): every s generated tokens the last
    // min(observe, s) of them are observed over what the store holds, and it compresses again.
    if (policy && !opt.compress.empty() && policy->compress_every() > 0 &&
        (s + 1) % policy->compress_every() == 0) {
      const int64_t w = std::min<int64_t>(opt.observe, policy->compress_every());
      for (int l = 0; l < L; ++l) KVTIER_RETURN_IF_ERROR(observe_layer(l, p - w + 1, p));
      for (int l = 0; l < L; ++l) KVTIER_RETURN_IF_ERROR(apply_layer(l));
      rep.policy.compressions++;
      KVTIER_ASSIGN_OR_RETURN(rep.policy.kept_tokens, kept_tokens());
    }
    sample_lower_tier_memory();
    dprog.Update(s + 1);
  }
  dprog.Done();
  if (opt.workload.decode_steps > 0)
    rep.host_syncs_per_token =
        static_cast<double>(host_syncs() - decode_syncs0) / static_cast<double>(opt.workload.decode_steps);
  if (opt.workload.decode_steps > 0)
    rep.worker_host_syncs_per_token = static_cast<double>(worker_host_syncs() - decode_worker_syncs0) /
                                      static_cast<double>(opt.workload.decode_steps);
  if (opt.workload.decode_steps > 0)
    rep.chunks_deferred_per_token = static_cast<double>(chunks_deferred() - decode_deferred0) /
                                    static_cast<double>(opt.workload.decode_steps);
  KVTIER_RETURN_IF_ERROR(store->WaitForDurable());
  sample_lower_tier_memory();
  rep.peak_rss_bytes = PeakRssBytes();
  {
    const DeviceMemoryUse device_memory = ReadDeviceMemory();
    rep.device_memory_peak_bytes = device_memory.peak_total;
    for (int i = 0; i < kDeviceMemoryOwners; ++i) rep.device_memory_peak_by_owner[i] = device_memory.peak[i];
  }
  rep.counters = store->counters();
  rep.index_cap_bytes = opt.store.index_bytes;
  uint64_t retriever_bytes = 0, index_bound = 0;
  for (Method& mt : methods) {
    const Retriever* r = ImplOf(*mt.session).retriever();
    retriever_bytes += r->memory_bytes();
    rep.index_compressed_chunks += r->compressed_chunks();
    rep.index_evicted_chunks += r->evicted_chunks();
    // A capped session's indexes never exceed the cap; the bound counts the cap itself.
    index_bound +=
        opt.store.index_bytes > 0 ? std::max(opt.store.index_bytes, r->memory_bytes()) : r->memory_bytes();
  }
  if (act_probe) {
    const uint64_t analysis = act_probe->memory_bytes() + mean_probe->memory_bytes();
    retriever_bytes += analysis;
    index_bound += analysis;
  }
  rep.index_bytes = store->metadata_bytes() + retriever_bytes;
  rep.rss_bound_bytes = rep.rss_at_start_bytes + opt.store.warm_bytes + opt.store.hot_bytes +
                        (rep.counters.hot_bytes - rep.counters.hot_chunks * opt.store.chunk_bytes()) +
                        store->metadata_bytes() + index_bound + rep.policy.scratch_bytes +
                        work.memory_bytes() + kRunRssOverheadBytes;
  for (const auto& os : own) {  // the rows' own stores: their tiers and records as well
    KVTIER_RETURN_IF_ERROR(os->store->WaitForDurable());
    const StoreOptions& so = os->store->options();
    const StoreCounters c = os->store->counters();
    rep.rss_bound_bytes += so.warm_bytes + so.hot_bytes + (c.hot_bytes - c.hot_chunks * so.chunk_bytes()) +
                           os->store->metadata_bytes();
  }

  // ---- chunk choice: the buckets of every method's chunk_counts, and the sought needles ----
  ChunkChoice& cc = rep.chunk_choice;
  cc.steps = opt.workload.decode_steps;
  cc.chunk_size = cs;
  cc.first_position = n_sink;
  for (int l = 0; l < L; ++l) {
    KVTIER_ASSIGN_OR_RETURN(uint64_t n, store->ChunkCount(seq, l));
    cc.chunks = std::max(cc.chunks, n);
  }
  // A row's chunk c (of its own chunk size) counts in the bucket of its first token.
  auto cc_chunk = [&](const Method& mt, uint64_t c) {
    return c * static_cast<uint64_t>(mt.chunk_size) / static_cast<uint64_t>(cs);
  };
  for (const Method& mt : methods)
    for (const StepRecord& r : mt.steps)
      for (const Attended& a : r.attended)
        if (!a.chunks.empty()) cc.chunks = std::max(cc.chunks, cc_chunk(mt, a.chunks.back()) + 1);  // sorted
  cc.bucket_chunks = std::max<uint64_t>(1, (cc.chunks + kMaxChunkChoiceBuckets - 1) / kMaxChunkChoiceBuckets);
  cc.buckets = (cc.chunks + cc.bucket_chunks - 1) / cc.bucket_chunks;
  for (int64_t p = qbegin; p < work.total_tokens(); ++p)
    for (const TokenRange& r : work.SoughtNeedles(p))
      if (std::find(cc.needles.begin(), cc.needles.end(), r) == cc.needles.end()) cc.needles.push_back(r);
  std::sort(cc.needles.begin(), cc.needles.end(),
            [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });

  // ---- per-method timing and needle hits (no baseline needed) ----
  // Whether the attended set holds every token of every needle the m queries from `first` seek.
  auto needles_attended = [&](int64_t first, int m, const Attended& attended, int chunk_size) {
    std::vector<TokenRange> sought;
    for (int i = 0; i < m; ++i)
      for (const TokenRange& r : work.SoughtNeedles(first + i))
        if (std::find(sought.begin(), sought.end(), r) == sought.end()) sought.push_back(r);
    for (const TokenRange& r : sought)
      for (int64_t t = r.begin; t < r.end; ++t)
        if (!attended.Contains(t, n_sink, chunk_size)) return false;
    return true;
  };
  auto needle_hit = [&](const StepRecord& rec, int l, int chunk_size) {
    return needles_attended(rec.first_position, rec.m, rec.attended[l], chunk_size);
  };
  for (Method& mt : methods) {
    MethodReport mr;
    mr.name = mt.name;
    mr.spec = ImplOf(*mt.session).retriever()->Describe();
    mr.chunk_size = mt.chunk_size;
    mr.budget_tokens = mt.session->options().retrieval.budget_tokens;
    mr.selections = ImplOf(*mt.session).retriever()->selections();
    mr.reused_selections = ImplOf(*mt.session).retriever()->reused_selections();
    mr.sliced_selections = ImplOf(*mt.session).retriever()->sliced_selections();
    mr.chunk_counts.assign(static_cast<size_t>(L), std::vector<uint64_t>(cc.buckets, 0));
    mr.chunk_max_steps = mr.chunk_counts;
    // [layer][the row's chunk index]
    uint64_t own_chunks = 0;
    for (const StepRecord& r : mt.steps)
      for (const Attended& a : r.attended)
        if (!a.chunks.empty()) own_chunks = std::max(own_chunks, a.chunks.back() + 1);  // sorted
    std::vector<std::vector<uint32_t>> chunk_steps(static_cast<size_t>(L),
                                                   std::vector<uint32_t>(own_chunks, 0));
    std::vector<double> probe, search, alloc, fetch, attn, app, other, share;
    int hits = 0, total = 0, qhits = 0;
    double chunks = 0;
    // steps[0] is the question window, steps[1] the first decode step.
    mr.decode_turnover_by_layer.resize(static_cast<size_t>(L));
    for (int l = 0; l < L; ++l)
      for (size_t i = 2; i < mt.steps.size(); ++i)
        mr.decode_turnover_by_layer[l].Add(mt.steps[i - 1].attended[l].chunks,
                                           mt.steps[i].attended[l].chunks);
    for (size_t i = 0; i < mt.steps.size(); ++i) {
      StepRecord& r = mt.steps[i];
      r.ms = r.append_ms + r.probe_ms + r.retrieve_ms + r.alloc_ms + r.fetch_ms + r.attention_ms;
      for (int l = 0; l < L; ++l) {
        const bool hit = needle_hit(r, l, mt.chunk_size);
        if (i == 0)
          qhits += hit;
        else {
          hits += hit;
          total++;
        }
      }
      if (i == 0) continue;
      for (int l = 0; l < L; ++l)
        for (uint64_t c : r.attended[l].chunks) chunk_steps[l][c]++;
      mr.step_ms_all.push_back(r.ms);
      probe.push_back(r.probe_ms);
      search.push_back(r.retrieve_ms);
      alloc.push_back(r.alloc_ms);
      fetch.push_back(r.fetch_ms);
      attn.push_back(r.attention_ms);
      app.push_back(r.append_ms);
      other.push_back(r.other_ms);
      share.push_back(r.ms > 0 ? (r.probe_ms + r.retrieve_ms + r.alloc_ms) / r.ms : 0.0);
      chunks += r.chunks;
      mr.bytes_moved += r.bytes_moved;
      mr.first_stage_bytes += static_cast<double>(r.first_stage_bytes);
      mr.rescoring_bytes += static_cast<double>(r.rescoring_bytes);
      mr.fetch_bytes += static_cast<double>(r.fetch_bytes);
      mr.attention_bytes += static_cast<double>(r.attention_bytes);
    }
    if (mt.steps.size() > 1) {
      const double n = static_cast<double>(mt.steps.size() - 1);  // decode steps
      mr.first_stage_bytes /= n;
      mr.rescoring_bytes /= n;
      mr.fetch_bytes /= n;
      mr.attention_bytes /= n;
    }
    for (int l = 0; l < L; ++l)
      for (uint64_t c = 0; c < own_chunks; ++c) {
        const uint64_t b = std::min(cc_chunk(mt, c) / cc.bucket_chunks, cc.buckets - 1);
        mr.chunk_counts[l][b] += chunk_steps[l][c];
        mr.chunk_max_steps[l][b] = std::max<uint64_t>(mr.chunk_max_steps[l][b], chunk_steps[l][c]);
      }
    mr.step_ms = Median(mr.step_ms_all);
    mr.probe_ms = Median(probe);
    mr.search_ms = Median(search);
    mr.alloc_ms = Median(alloc);
    mr.fetch_ms = Median(fetch);
    mr.attention_ms = Median(attn);
    mr.append_ms = Median(app);
    mr.other_ms = Median(other);
    mr.retrieval_share = Median(share);
    mr.chunks_per_step = mt.steps.size() > 1 ? chunks / static_cast<double>(mt.steps.size() - 1) : 0.0;
    mr.needle_hit_rate = total ? static_cast<double>(hits) / total : 0.0;
    mr.question_needle_hit_rate = static_cast<double>(qhits) / L;
    rep.methods.push_back(std::move(mr));
  }

  // ---- the byte floor: full attention's bytes, and the streaming rate measured now ----
  // Full attention reads K and V of every visible token, every layer, once per step.
  if (methods[0].steps.size() > 1) {
    double bytes = 0;
    for (size_t i = 1; i < methods[0].steps.size(); ++i) {
      const StepRecord& r = methods[0].steps[i];
      bytes += static_cast<double>(r.first_position + r.m) * L * static_cast<double>(g.token_kv_bytes());
    }
    rep.full_attention_bytes = bytes / static_cast<double>(methods[0].steps.size() - 1);
  }
  // After the peak RSS was taken: the buffer is not the store's memory. A cuda tier's step reads
  // GPU memory, whose rate this host read does not measure: no floor there.
  if (opt.measure_bandwidth && opt.store.device == Device::kCpu) {
    KVTIER_ASSIGN_OR_RETURN(rep.bandwidth, MeasureStreamBandwidth(opt.bandwidth));
  }

  // ---- baseline: full attention over the whole context, one layer at a time ----
  if (opt.baseline) {
    const int64_t total = work.total_tokens();
    const size_t n_steps = methods[0].steps.size();
    std::vector<uint8_t> all_k(static_cast<size_t>(total) * kv_elems * elem), all_v(all_k.size());
    std::vector<double> full_ms(n_steps, 0.0);
    // [method][step] accumulators over layers
    std::vector<std::vector<double>> err_num(methods.size(), std::vector<double>(n_steps, 0.0)),
        err_den = err_num, recall_sum = err_num;
    std::vector<float> mass(static_cast<size_t>(g.kv_heads) * total);
    std::vector<float> out;
    // The attention oracle: per step and layer, the budget's worth of chunks that hold the most
    // of full attention's mass (summed over kv heads and the step's queries), with the same
    // sinks and local window as the methods. No chunk choice of budget / chunk_size chunks a
    // layer captures more of that mass; it bounds what scoring alone can reach at this budget.
    std::vector<double> oracle_hits(n_steps, 0.0), oracle_recall(n_steps, 0.0);
    std::vector<double> chunk_mass;
    std::vector<uint64_t> chunk_order;
    const uint64_t oracle_take = static_cast<uint64_t>(std::max(0, opt.budget / cs));
    std::vector<double> rho_act, rho_mean;
    Progress bprog(opt.progress, "full-attention baseline", L, "layers");
    for (int l = 0; l < L; ++l) {
      for (int64_t b = 0; b < total; b += 4096) {
        const int64_t e = std::min(total, b + 4096);
        kf.resize((e - b) * kv_elems);
        vf.resize((e - b) * kv_elems);
        work.Generate(l, b, e, nullptr, kf.data(), vf.data());
        FromFloat(g.dtype, kf.data(), all_k.data() + b * kv_elems * elem, kf.size());
        FromFloat(g.dtype, vf.data(), all_v.data() + b * kv_elems * elem, vf.size());
      }
      for (size_t i = 0; i < n_steps; ++i) {
        const int64_t first = methods[0].steps[i].first_position;
        const int m = methods[0].steps[i].m;
        const std::vector<float>& q = i == 0 ? question_q[l] : methods[0].steps[i].q_layer_cache[l];
        const int64_t visible = first + m;  // causal: keys up to the last query
        std::fill(mass.begin(), mass.end(), 0.0f);
        std::vector<kernels::KvSpan> parts{
            kernels::KvSpan{all_k.data(), all_v.data(), static_cast<int>(visible), 0, mass.data()}};
        std::vector<int64_t> pos(m);
        std::iota(pos.begin(), pos.end(), first);
        out.assign(static_cast<size_t>(m) * q_elems, 0.0f);
        // Time the plain kernel (no mass output) as the baseline step, then
        // run again with mass for recall.
        std::vector<kernels::KvSpan> timed_parts = parts;
        timed_parts[0].mass = nullptr;
        const double t0 = NowSeconds();
        KVTIER_RETURN_IF_ERROR(RunKernel(MakeParams(g, q.data(), pos.data(), m, timed_parts, out.data())));
        full_ms[i] += 1e3 * (NowSeconds() - t0);
        KVTIER_RETURN_IF_ERROR(RunKernel(MakeParams(g, q.data(), pos.data(), m, parts, out.data())));
        for (size_t mi = 0; mi < methods.size(); ++mi) {
          const StepRecord& rec = methods[mi].steps[i];
          for (size_t j = 0; j < out.size(); ++j) {
            const double d = static_cast<double>(rec.out[l][j]) - out[j];
            err_num[mi][i] += d * d;
            err_den[mi][i] += static_cast<double>(out[j]) * out[j];
          }
          double on = 0, all = 0;
          for (int h = 0; h < g.kv_heads; ++h) {
            const float* mh = mass.data() + static_cast<size_t>(h) * visible;
            for (int64_t t = 0; t < visible; ++t) {
              all += mh[t];
              if (rec.attended[l].Contains(t, n_sink, methods[mi].chunk_size)) on += mh[t];
            }
          }
          recall_sum[mi][i] += all > 0 ? on / all : 0.0;
        }
        Attended best;
        best.local_begin = methods[0].steps[i].attended[l].local_begin;
        const uint64_t n_chunks =
            best.local_begin > n_sink ? static_cast<uint64_t>((best.local_begin - n_sink) / cs) : 0;
        chunk_mass.assign(n_chunks, 0.0);
        double all = 0;
        for (int h = 0; h < g.kv_heads; ++h) {
          const float* mh = mass.data() + static_cast<size_t>(h) * visible;
          for (int64_t t = 0; t < visible; ++t) all += mh[t];
          for (uint64_t c = 0; c < n_chunks; ++c) {
            const float* mc = mh + ChunkFirstToken(c, n_sink, cs);
            chunk_mass[c] += std::accumulate(mc, mc + cs, 0.0);
          }
        }
        chunk_order.resize(n_chunks);
        std::iota(chunk_order.begin(), chunk_order.end(), 0);
        const uint64_t take = std::min(oracle_take, n_chunks);
        std::partial_sort(chunk_order.begin(), chunk_order.begin() + static_cast<std::ptrdiff_t>(take),
                          chunk_order.end(), [&](uint64_t a, uint64_t b) {
                            return chunk_mass[a] != chunk_mass[b] ? chunk_mass[a] > chunk_mass[b] : a < b;
                          });
        best.chunks.assign(chunk_order.begin(), chunk_order.begin() + static_cast<std::ptrdiff_t>(take));
        std::sort(best.chunks.begin(), best.chunks.end());
        double on = 0;
        for (uint64_t c : best.chunks) on += chunk_mass[c];
        for (int h = 0; h < g.kv_heads; ++h) {
          const float* mh = mass.data() + static_cast<size_t>(h) * visible;
          on += std::accumulate(mh, mh + std::min<int64_t>(n_sink, visible), 0.0);
          on += std::accumulate(mh + std::min(best.local_begin, visible), mh + visible, 0.0);
        }
        oracle_recall[i] += all > 0 ? on / all : 0.0;
        oracle_hits[i] += needles_attended(first, m, best, cs) ? 1.0 : 0.0;
      }
      // Oracle chunk relevance of each sampled window: the mass its real
      // queries (a strided subset) give each chunk under full attention.
      for (SampledWindow& w : sampled) {
        const std::vector<uint64_t>& ids = w.ids[l];
        if (ids.size() < 2) continue;
        qf.resize(static_cast<size_t>(w.end - w.begin) * q_elems);
        work.Generate(l, w.begin, w.end, qf.data(), nullptr, nullptr);
        gather_strided(w.begin, w.end, 0);
        const int64_t visible = w.end;
        std::fill(mass.begin(), mass.begin() + static_cast<size_t>(g.kv_heads) * visible, 0.0f);
        std::vector<kernels::KvSpan> parts{
            kernels::KvSpan{all_k.data(), all_v.data(), static_cast<int>(visible), 0, mass.data()}};
        out.assign(spos.size() * q_elems, 0.0f);
        KVTIER_RETURN_IF_ERROR(RunKernel(
            MakeParams(g, sq.data(), spos.data(), static_cast<int>(spos.size()), parts, out.data())));
        std::vector<double> oracle(ids.size(), 0.0), act(ids.size()), mean(ids.size());
        for (size_t c = 0; c < ids.size(); ++c) {
          const int64_t t0 = ChunkFirstToken(ids[c], n_sink, cs);
          for (int h = 0; h < g.kv_heads; ++h)
            for (int t = 0; t < cs; ++t) oracle[c] += mass[static_cast<size_t>(h) * visible + t0 + t];
          act[c] = w.act_scores[l][c];
          mean[c] = w.mean_scores[l][c];
        }
        rho_act.push_back(Spearman(act, oracle));
        rho_mean.push_back(Spearman(mean, oracle));
      }
      bprog.Update(l + 1);
    }
    bprog.Done();
    rep.spearman_act = Summarize(rho_act);
    rep.spearman_mean = Summarize(rho_mean);
    for (size_t i = 1; i < n_steps; ++i) rep.full_step_ms_all.push_back(full_ms[i]);
    rep.full_attention_step_ms = Median(rep.full_step_ms_all);
    rep.oracle_take_chunks = oracle_take;
    rep.question_oracle_needle_hit_rate = oracle_hits[0] / L;
    rep.question_oracle_attention_recall = oracle_recall[0] / L;
    if (n_steps > 1) {
      const double pairs = static_cast<double>(n_steps - 1) * L;
      rep.oracle_needle_hit_rate = std::accumulate(oracle_hits.begin() + 1, oracle_hits.end(), 0.0) / pairs;
      rep.oracle_attention_recall =
          std::accumulate(oracle_recall.begin() + 1, oracle_recall.end(), 0.0) / pairs;
    }
    for (size_t mi = 0; mi < methods.size(); ++mi) {
      MethodReport& mr = rep.methods[mi];
      std::vector<double> recalls;
      for (size_t i = 0; i < n_steps; ++i) {
        const double err = err_den[mi][i] > 0 ? std::sqrt(err_num[mi][i] / err_den[mi][i]) : 0.0;
        if (i == 0) {
          mr.question_output_rel_error = err;
          mr.question_attention_recall = recall_sum[mi][i] / L;
        } else {
          mr.step_error_all.push_back(err);
          recalls.push_back(recall_sum[mi][i] / L);
        }
      }
      mr.output_rel_error = Median(mr.step_error_all);
      mr.attention_recall = Mean(recalls);
    }
  }
  // The headline numbers: the configured method's (the "kvtier" row in a comparison).
  rep.headline = headline_method;
  const MethodReport& m0 = rep.methods[rep.headline];
  rep.needle_hit_rate = m0.needle_hit_rate;
  rep.attention_recall = m0.attention_recall;
  rep.output_rel_error = m0.output_rel_error;
  rep.question_needle_hit_rate = m0.question_needle_hit_rate;
  rep.question_attention_recall = m0.question_attention_recall;
  rep.question_output_rel_error = m0.question_output_rel_error;
  rep.step_ms = m0.step_ms;
  rep.step_ms_all = m0.step_ms_all;
  rep.step_error_all = m0.step_error_all;
  rep.retrieve_ms = m0.probe_ms + m0.search_ms + m0.alloc_ms;
  rep.fetch_ms = m0.fetch_ms;
  rep.attention_ms = m0.attention_ms;
  rep.append_ms = m0.append_ms;
  rep.other_ms = m0.other_ms;
  if (opt.drop_at_end) {
    methods.clear();
    act_probe.reset();
    mean_probe.reset();
    drop_guard.armed = false;
    KVTIER_RETURN_IF_ERROR(store->DropSequence(seq));
    KVTIER_RETURN_IF_ERROR(store->WaitForDurable());
    rep.sequence_dropped = true;
  }
  return rep;
}

namespace {

// "bytes_per_step": what a decode step of `m` read, by part and in total.
void WriteStepBytes(JsonWriter* w, const MethodReport& m) {
  w->Key("bytes_per_step").BeginObject();
  w->Key("first_stage").Double(m.first_stage_bytes).Key("rescoring").Double(m.rescoring_bytes);
  w->Key("fetch").Double(m.fetch_bytes).Key("attention").Double(m.attention_bytes);
  w->Key("total").Double(m.step_bytes());
  w->EndObject();
}

}  // namespace

double RunReport::FloorMs(double bytes) const {
  return bandwidth.bytes_per_s > 0 ? 1e3 * bytes / bandwidth.bytes_per_s : 0.0;
}

double RunReport::OverFloor(double ms, double bytes) const {
  const double floor = FloorMs(bytes);
  return ms > 0 && floor > 0 ? ms / floor : 0.0;
}

std::string RunReport::ToJson() const {
  JsonWriter w(true);
  const RunOptions& o = options;
  // A figure that was not measured is null, never 0: recall, output error and every
  // comparison with full attention need the baseline (--no-baseline skips it).
  const bool base = o.baseline;
  auto vs_full = [&](double v) -> JsonWriter& { return base ? w.Double(v) : w.Null(); };
  auto speedup = [&](double ms) -> JsonWriter& {
    return base && ms > 0 ? w.Double(full_attention_step_ms / ms) : w.Null();
  };
  // The byte floor needs the bandwidth measurement; a step's ratio to it, a step time.
  const bool measured = bandwidth.bytes_per_s > 0;
  auto floor_ms = [&](double bytes) -> JsonWriter& { return measured ? w.Double(FloorMs(bytes)) : w.Null(); };
  auto over_floor = [&](double ms, double bytes) -> JsonWriter& {
    const double r = OverFloor(ms, bytes);
    return r > 0 ? w.Double(r) : w.Null();
  };
  w.BeginObject();
  w.Key("quality").BeginObject();
  w.Key("needle_hit_rate").Double(needle_hit_rate);
  w.Key("attention_recall");
  vs_full(attention_recall);
  w.Key("output_rel_error");
  vs_full(output_rel_error);
  w.Key("question_needle_hit_rate").Double(question_needle_hit_rate);
  w.Key("question_attention_recall");
  vs_full(question_attention_recall);
  w.Key("question_output_rel_error");
  vs_full(question_output_rel_error);
  // The budget's best chunks by full attention's own mass: what scoring alone could reach.
  w.Key("attention_oracle").BeginObject();
  w.Key("chunks_per_layer").Int(static_cast<int64_t>(oracle_take_chunks));
  w.Key("needle_hit");
  vs_full(oracle_needle_hit_rate);
  w.Key("recall");
  vs_full(oracle_attention_recall);
  w.Key("question_needle_hit");
  vs_full(question_oracle_needle_hit_rate);
  w.Key("question_recall");
  vs_full(question_oracle_attention_recall);
  w.EndObject();
  w.Key("probe_spearman").BeginObject();
  for (const auto& [name, sp] : {std::pair<const char*, const SpearmanSummary*>{"act", &spearman_act},
                                 std::pair<const char*, const SpearmanSummary*>{"mean", &spearman_mean}}) {
    w.Key(name).BeginObject();
    if (sp->samples > 0) {
      w.Key("median").Double(sp->median).Key("q1").Double(sp->q1).Key("q3").Double(sp->q3);
      w.Key("iqr").Double(sp->q3 - sp->q1);
    } else {  // --spearman-windows 0 or --no-baseline: no oracle to rank against
      w.Key("median").Null().Key("q1").Null().Key("q3").Null().Key("iqr").Null();
    }
    w.Key("samples").Int(sp->samples);
    w.EndObject();
  }
  w.EndObject();
  w.EndObject();
  w.Key("methods").BeginArray();
  for (const MethodReport& m : methods) {
    w.BeginObject();
    w.Key("name").String(m.name).Key("spec").String(m.spec);
    w.Key("chunk_size").Int(m.chunk_size).Key("budget_tokens").Int(m.budget_tokens);
    w.Key("needle_hit_rate").Double(m.needle_hit_rate).Key("attention_recall");
    vs_full(m.attention_recall);
    w.Key("output_rel_error");
    vs_full(m.output_rel_error);
    w.Key("question_needle_hit_rate").Double(m.question_needle_hit_rate);
    w.Key("question_attention_recall");
    vs_full(m.question_attention_recall);
    w.Key("question_output_rel_error");
    vs_full(m.question_output_rel_error);
    w.Key("step_ms").Double(m.step_ms);
    w.Key("speedup_vs_full");
    speedup(m.step_ms);
    w.Key("split_ms").BeginObject();
    w.Key("append").Double(m.append_ms).Key("probe").Double(m.probe_ms).Key("search").Double(m.search_ms);
    w.Key("alloc").Double(m.alloc_ms).Key("fetch").Double(m.fetch_ms).Key("attention").Double(m.attention_ms);
    w.Key("other").Double(m.other_ms);
    w.EndObject();
    w.Key("retrieval_share").Double(m.retrieval_share);
    w.Key("chunks_per_step").Double(m.chunks_per_step);
    w.Key("selections").Uint(m.selections).Key("reused_selections").Uint(m.reused_selections);
    w.Key("sliced_selections").Uint(m.sliced_selections);
    WriteTurnoverJson(&w, m.decode_turnover_by_layer);
    w.Key("bytes_moved").Uint(m.bytes_moved);
    // What a decode step read, by part (mean over the decode steps, all layers), and the time
    // those bytes take at the streaming rate measured in this run.
    WriteStepBytes(&w, m);
    w.Key("floor_ms");
    floor_ms(m.step_bytes());
    w.Key("step_over_floor");
    over_floor(m.step_ms, m.step_bytes());
    w.EndObject();
  }
  w.EndArray();
  w.Key("compare_notes").BeginArray();
  for (const std::string& n : compare_notes) w.String(n);
  w.EndArray();
  // Which chunks each method retrieved over the decode steps, per layer, in at most
  // kMaxChunkChoiceBuckets buckets of consecutive chunks (the chunk-choice heat map): per
  // bucket the retrievals summed over its chunks and steps (counts) and the steps its most
  // often retrieved chunk was retrieved in (max_steps).
  const ChunkChoice& cc = chunk_choice;
  w.Key("chunk_choice").BeginObject();
  w.Key("steps").Int(cc.steps).Key("chunk_size").Int(cc.chunk_size);
  w.Key("first_position").Int(cc.first_position);
  w.Key("chunks").Uint(cc.chunks).Key("bucket_chunks").Uint(cc.bucket_chunks).Key("buckets").Uint(cc.buckets);
  w.Key("max_buckets").Uint(kMaxChunkChoiceBuckets);
  w.Key("needles").BeginArray();
  for (const TokenRange& r : cc.needles) w.BeginArray().Int(r.begin).Int(r.end).EndArray();
  w.EndArray();
  w.Key("methods").BeginArray();
  for (const MethodReport& m : methods) {
    w.BeginObject().Key("name").String(m.name);
    for (const auto& [key, rows] :
         {std::pair<const char*, const std::vector<std::vector<uint64_t>>*>{"counts", &m.chunk_counts},
          {"max_steps", &m.chunk_max_steps}}) {
      w.Key(key).BeginArray();
      for (const std::vector<uint64_t>& layer : *rows) {
        w.BeginArray();
        for (uint64_t n : layer) w.Uint(n);
        w.EndArray();
      }
      w.EndArray();
    }
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  w.Key("time").BeginObject();
  w.Key("step_ms").Double(step_ms);
  w.Key("full_attention_step_ms");
  vs_full(full_attention_step_ms);
  w.Key("speedup_vs_full");
  speedup(step_ms);
  w.Key("split_ms").BeginObject();
  w.Key("append")
      .Double(append_ms)
      .Key("retrieve")
      .Double(retrieve_ms)
      .Key("fetch")
      .Double(fetch_ms)
      .Key("attention")
      .Double(attention_ms);
  if (!methods.empty()) {
    w.Key("probe")
        .Double(methods[headline].probe_ms)
        .Key("search")
        .Double(methods[headline].search_ms)
        .Key("alloc")
        .Double(methods[headline].alloc_ms);
  }
  w.Key("other").Double(other_ms);
  w.EndObject();
  w.Key("retrieval_share");
  if (methods.empty())
    w.Null();
  else
    w.Double(methods[headline].retrieval_share);
  w.Key("prefill_s").Double(prefill_s);
  w.Key("prefill_drain_s").Double(prefill_drain_s);
  w.Key("prefill_tokens_per_s");
  if (prefill_s > 0)
    w.Double(o.workload.context / prefill_s);
  else
    w.Null();
  w.Key("step_ms_all").BeginArray();
  for (double v : step_ms_all) w.Double(v);
  w.EndArray();
  w.Key("full_attention_step_ms_all").BeginArray();
  for (double v : full_step_ms_all) w.Double(v);
  w.EndArray();
  // The byte floor (methods[].bytes_per_step for every method): the headline method's and
  // full attention's, and the streaming rate both are divided by.
  const double head_bytes = methods.empty() ? 0.0 : methods[headline].step_bytes();
  if (methods.empty())
    w.Key("bytes_per_step").Null();
  else
    WriteStepBytes(&w, methods[headline]);
  w.Key("floor_ms");
  floor_ms(head_bytes);
  w.Key("step_over_floor");
  over_floor(step_ms, head_bytes);
  w.Key("full_attention_bytes_per_step").Double(full_attention_bytes);
  w.Key("full_attention_floor_ms");
  floor_ms(full_attention_bytes);
  w.Key("full_attention_step_over_floor");
  if (base)
    over_floor(full_attention_step_ms, full_attention_bytes);
  else
    w.Null();
  w.Key("stream_bandwidth");
  if (measured) {
    w.BeginObject();
    w.Key("bytes_per_s")
        .Double(bandwidth.bytes_per_s)
        .Key("best_bytes_per_s")
        .Double(bandwidth.best_bytes_per_s);
    w.Key("buffer_bytes").Uint(bandwidth.buffer_bytes).Key("llc_bytes").Uint(bandwidth.llc_bytes);
    w.Key("threads")
        .Int(bandwidth.threads)
        .Key("passes")
        .Int(bandwidth.passes)
        .Key("ms")
        .Double(bandwidth.ms);
    w.EndObject();
  } else {
    w.Null();
  }
  w.EndObject();
  w.Key("policy").BeginObject();
  // No scoring policy ran (lru, no --compress): its times are not measured; the chunks it
  // dropped and the tokens it kept only mean something after a compression.
  if (policy.spec.empty())
    w.Key("spec").Null();
  else
    w.Key("spec").String(policy.spec);
  w.Key("compressed").Bool(policy.compressed);
  if (policy.spec.empty()) {
    w.Key("scoring_ms").Null().Key("attention_ms").Null();
  } else {
    w.Key("scoring_ms").Double(policy.scoring_ms).Key("attention_ms").Double(policy.attention_ms);
  }
  if (policy.compressed) {
    w.Key("dropped_chunks").Uint(policy.dropped_chunks).Key("kept_tokens_per_layer").Uint(policy.kept_tokens);
  } else {
    w.Key("dropped_chunks").Null().Key("kept_tokens_per_layer").Null();
  }
  w.Key("kv_budget").Int(o.kv_budget).Key("compressions").Int(policy.compressions);
  w.EndObject();
  w.Key("memory").BeginObject();
  w.Key("peak_rss_bytes").Uint(peak_rss_bytes);
  w.Key("rss_bound_bytes").Uint(rss_bound_bytes);
  w.Key("within_rss_bound").Bool(peak_rss_bytes <= rss_bound_bytes);
  w.Key("rss_overhead_bytes").Uint(kRunRssOverheadBytes);
  w.Key("rss_at_start_bytes").Uint(rss_at_start_bytes);
  w.Key("lower_tier_memory_peak_bytes").Uint(lower_tier_memory_peak_bytes);
  w.Key("index_bytes").Uint(index_bytes);
  w.Key("index_cap_bytes").Uint(index_cap_bytes);
  w.Key("index_compressed_chunks").Uint(index_compressed_chunks);
  w.Key("index_evicted_chunks").Uint(index_evicted_chunks);
  w.Key("context_kv_bytes").Uint(context_kv_bytes);
  w.Key("tier_bytes").BeginObject();
  w.Key("hot")
      .Uint(counters.hot_bytes)
      .Key("warm")
      .Uint(counters.warm_bytes)
      .Key("cold")
      .Uint(counters.cold_bytes);
  w.EndObject();
  w.Key("tier_chunks").BeginObject();
  w.Key("hot")
      .Uint(counters.hot_chunks)
      .Key("warm")
      .Uint(counters.warm_chunks)
      .Key("cold")
      .Uint(counters.cold_chunks);
  w.EndObject();
  w.EndObject();
  w.Key("io").BeginObject();
  w.Key("bytes_moved").Uint(counters.bytes_moved);
  w.Key("promotions").Uint(counters.promotions).Key("demotions").Uint(counters.demotions);
  w.Key("hits").Uint(counters.hits).Key("misses").Uint(counters.misses);
  w.Key("cold_reads").Uint(counters.cold_reads).Key("cold_writes").Uint(counters.cold_writes);
  w.Key("chunks_sealed").Uint(counters.chunks_sealed);
  w.Key("chunks_landing").Uint(counters.chunks_landing);
  w.EndObject();
  w.Key("device").BeginObject();
  w.Key("kind").String(DeviceName(o.store.device));
  w.Key("host_syncs_per_token").Double(host_syncs_per_token);
  w.Key("worker_host_syncs_per_token").Double(worker_host_syncs_per_token);
  w.Key("chunks_deferred_per_token").Double(chunks_deferred_per_token);
  w.Key("memory_peak_bytes").Uint(device_memory_peak_bytes);
  w.Key("memory_peak_bytes_by_owner").BeginObject();
  for (int i = 0; i < kDeviceMemoryOwners; ++i)
    w.Key(DeviceMemoryOwnerName(static_cast<DeviceMemoryOwner>(i))).Uint(device_memory_peak_by_owner[i]);
  w.EndObject();
  w.EndObject();
  w.Key("tiers");
  WriteTierTrafficJson(&w, counters);
  w.Key("config").BeginObject();
  w.Key("context").Int(o.workload.context);
  w.Key("geometry").String(o.store.geometry.ToString());
  WriteStoreOptionsJson(&w, o.store);
  w.Key("budget").Int(o.budget).Key("window").Int(o.window).Key("stat_stride").Int(o.stat_stride);
  w.Key("probe").String(o.retrieval.probe).Key("alloc").String(o.retrieval.alloc);
  w.Key("index").String(o.retrieval.index);
  w.Key("compare").Bool(o.compare).Key("spearman_windows").Int(o.spearman_windows);
  w.Key("decode_steps").Int(o.workload.decode_steps).Key("question_len").Int(o.workload.question_len);
  w.Key("needle_count").Int(o.workload.needle_count).Key("needle_len").Int(o.workload.needle_len);
  w.Key("needle_depth").Double(o.workload.needle_depth);
  w.Key("question_anchor_every")
      .Int(o.workload.question_anchor_every)
      .Key("needle_echo")
      .Int(o.workload.needle_echo);
  w.Key("anchor_strength").Double(o.workload.anchor_strength).Key("noise").Double(o.workload.noise);
  w.Key("seed").Uint(o.workload.seed);
  // The data: "synthetic" (the knobs above) or a recorded trace (its provenance; the
  // needle and strength knobs above then do not apply).
  w.Key("source").String(o.trace ? "trace" : "synthetic");
  if (o.trace) {
    w.Key("trace").String(o.trace->source);
    w.Key("trace_needles").BeginArray();
    for (const TokenRange& r : o.trace->needles) w.BeginArray().Int(r.begin).Int(r.end).EndArray();
    w.EndArray();
  }
  w.EndObject();
  w.EndObject();
  return w.str();
}

namespace {

// "x.xx ms, step N.Nx it" for a step of `ms` over `bytes`, or what was not measured.
std::string FloorText(const RunReport& r, double ms, double bytes, bool timed) {
  char s[128];
  if (r.bandwidth.bytes_per_s <= 0) return "floor not measured (--no-bandwidth or --device cuda)";
  const double floor = r.FloorMs(bytes), over = timed ? r.OverFloor(ms, bytes) : 0.0;
  if (over > 0)
    std::snprintf(s, sizeof(s), "floor %.2f ms, step %.1fx it", floor, over);
  else
    std::snprintf(s, sizeof(s), "floor %.2f ms", floor);
  return s;
}

}  // namespace

std::string RunReport::FloorTable() const {
  std::string t;
  char line[512];
  if (bandwidth.bytes_per_s > 0)
    std::snprintf(
        line, sizeof(line),
        "bytes per decode step (MB, mean over the steps, all layers) and the byte floor at %.1f GB/s "
        "(read-only streaming on %d threads, measured in this run):\n",
        bandwidth.bytes_per_s / 1e9, bandwidth.threads);
  else
    std::snprintf(line, sizeof(line),
                  "bytes per decode step (MB, mean over the steps, all layers); the byte floor was not "
                  "measured (--no-bandwidth or --device cuda):\n");
  t += line;
  std::snprintf(line, sizeof(line), "%-22s %10s %10s %9s %10s %9s %9s %11s\n", "method", "1st stage",
                "rescoring", "fetch", "attention", "total", "floor ms", "step/floor");
  t += line;
  auto row = [&](const std::string& name, double first, double rescore, double fetch, double attn, double ms,
                 bool timed) {
    const double total = first + rescore + fetch + attn;
    char floor[32] = "-", ratio[32] = "-";
    if (bandwidth.bytes_per_s > 0) {
      std::snprintf(floor, sizeof(floor), "%.2f", FloorMs(total));
      if (const double over = timed ? OverFloor(ms, total) : 0.0; over > 0)
        std::snprintf(ratio, sizeof(ratio), "%.2fx", over);
    }
    std::snprintf(line, sizeof(line), "%-22s %10.2f %10.2f %9.2f %10.2f %9.2f %9s %11s\n", name.c_str(),
                  first / 1e6, rescore / 1e6, fetch / 1e6, attn / 1e6, total / 1e6, floor, ratio);
    t += line;
  };
  row("full attention", 0, 0, 0, full_attention_bytes, full_attention_step_ms, options.baseline);
  for (const MethodReport& m : methods)
    row(m.name, m.first_stage_bytes, m.rescoring_bytes, m.fetch_bytes, m.attention_bytes, m.step_ms, true);
  return t;
}

std::string RunReport::CompareTable() const {
  std::string t;
  char line[512];
  std::snprintf(line, sizeof(line), "%-22s %8s %8s %9s %10s %9s %10s %11s | %8s %8s\n", "method", "needle",
                "recall", "out.err", "step ms", "vs full", "chunks", "MiB moved", "q.needle", "q.recall");
  t += line;
  if (!options.baseline) {
    // Recall, output error and the speed-up need full attention: "-" (not measured), never 0.
    for (const MethodReport& m : methods) {
      std::snprintf(line, sizeof(line), "%-22s %8.3f %8s %9s %10.2f %9s %10.1f %11.1f | %8.3f %8s\n",
                    m.name.c_str(), m.needle_hit_rate, "-", "-", m.step_ms, "-", m.chunks_per_step,
                    m.bytes_moved / 1048576.0, m.question_needle_hit_rate, "-");
      t += line;
    }
    t += "recall, out.err, vs full, q.recall: not measured (--no-baseline: full attention did not run)\n";
    return t;
  }
  std::snprintf(line, sizeof(line), "%-22s %8.3f %8.3f %9.4f %10.2f %8.1fx %10s %11s | %8.3f %8.3f\n",
                "full attention", 1.0, 1.0, 0.0, full_attention_step_ms, 1.0, "all", "-", 1.0, 1.0);
  t += line;
  for (const MethodReport& m : methods) {
    char vs[32] = "-";
    if (m.step_ms > 0) std::snprintf(vs, sizeof(vs), "%.1fx", full_attention_step_ms / m.step_ms);
    std::snprintf(line, sizeof(line), "%-22s %8.3f %8.3f %9.4f %10.2f %9s %10.1f %11.1f | %8.3f %8.3f\n",
                  m.name.c_str(), m.needle_hit_rate, m.attention_recall, m.output_rel_error, m.step_ms, vs,
                  m.chunks_per_step, m.bytes_moved / 1048576.0, m.question_needle_hit_rate,
                  m.question_attention_recall);
    t += line;
  }
  return t;
}

std::string RunReport::ToTable() const {
  auto mib = [](uint64_t b) { return static_cast<double>(b) / (1 << 20); };
  char buf[4096];
  // Figures that need the full-attention baseline say "not measured" under --no-baseline
  // (a 0 there would read as a measurement).
  const bool base = options.baseline;
  auto fixed = [](double v, int decimals) {
    char s[32];
    std::snprintf(s, sizeof(s), "%8.*f", decimals, v);
    return std::string(s);
  };
  const std::string not_measured = "not measured (--no-baseline)";
  const std::string recall_line =
      base ? fixed(attention_recall, 3) + "        " + fixed(question_attention_recall, 3) : not_measured;
  const std::string error_line =
      base ? fixed(output_rel_error, 4) + "        " + fixed(question_output_rel_error, 4) : not_measured;
  std::string full_line = not_measured;
  if (base) {
    char s[128];
    if (step_ms > 0)
      std::snprintf(s, sizeof(s), "%8.2f ms  -> kvtier is %.1fx faster", full_attention_step_ms,
                    full_attention_step_ms / step_ms);
    else
      std::snprintf(s, sizeof(s), "%8.2f ms", full_attention_step_ms);
    full_line = s;
  }
  std::string oracle_line = not_measured;
  if (base) {
    char s[256];
    std::snprintf(s, sizeof(s),
                  "%8.3f        %8.3f  (needle hit; recall %.3f and %.3f: the best %llu chunks a layer by "
                  "full attention's mass)",
                  oracle_needle_hit_rate, question_oracle_needle_hit_rate, oracle_attention_recall,
                  question_oracle_attention_recall, static_cast<unsigned long long>(oracle_take_chunks));
    oracle_line = s;
  }
  char prefill_rate[32] = "not measured";
  if (prefill_s > 0)
    std::snprintf(prefill_rate, sizeof(prefill_rate), "%.0f", options.workload.context / prefill_s);
  std::snprintf(
      buf, sizeof(buf),
      "kvtier run — context %lld tokens, geometry %s, budget %d tokens/layer, chunk %d, sinks %d, local %d\n"
      "\n"
      "quality                      decode steps    question window\n"
      "  needle hit rate            %8.3f        %8.3f\n"
      "  attention recall           %s\n"
      "  output rel. error          %s\n"
      "  attention oracle           %s\n"
      "\n"
      "time per decode step (median over %zu steps, all %d layers)\n"
      "  kvtier                     %8.2f ms  (append %.2f, probe+search+alloc %.2f, fetch %.2f, attention "
      "%.2f)\n"
      "  full attention             %s\n"
      "  prefill                    %8.2f s   (%s tokens/s, generation excluded; then %.2f s until the cold "
      "tier acknowledged every chunk)\n"
      "\n"
      "memory\n"
      "  context KV                 %8.1f MiB\n"
      "  tiers: hot %.1f MiB, warm %.1f MiB, cold %.1f MiB (%llu/%llu/%llu chunks)\n"
      "  peak RSS                   %8.1f MiB  (bound %.1f MiB: %s)\n"
      "    at start                 %8.1f MiB  (program, libraries, device runtime; in the bound)\n"
      "    RocksDB, most seen       %8.1f MiB  (memtables, table readers, block cache; overhead %.0f MiB)\n"
      "  retrieval index            %8.1f MiB  (cap %s; %llu chunks as int8 codes only, %llu evicted)\n"
      "io: %.1f MiB moved, %llu promotions, %llu demotions, %llu hits, %llu misses, %llu cold reads, %llu "
      "cold writes\n",
      static_cast<long long>(options.workload.context), options.store.geometry.ToString().c_str(),
      options.budget, options.store.chunk_size, options.store.n_sink, options.store.n_local, needle_hit_rate,
      question_needle_hit_rate, recall_line.c_str(), error_line.c_str(), oracle_line.c_str(),
      step_ms_all.size(), options.store.geometry.layers, step_ms, append_ms, retrieve_ms, fetch_ms,
      attention_ms, full_line.c_str(), prefill_s, prefill_rate, prefill_drain_s, mib(context_kv_bytes),
      mib(counters.hot_bytes), mib(counters.warm_bytes), mib(counters.cold_bytes),
      static_cast<unsigned long long>(counters.hot_chunks),
      static_cast<unsigned long long>(counters.warm_chunks),
      static_cast<unsigned long long>(counters.cold_chunks), mib(peak_rss_bytes), mib(rss_bound_bytes),
      peak_rss_bytes <= rss_bound_bytes ? "within" : "EXCEEDED", mib(rss_at_start_bytes),
      mib(lower_tier_memory_peak_bytes), mib(kRunRssOverheadBytes), mib(index_bytes),
      index_cap_bytes > 0 ? (std::to_string(index_cap_bytes >> 20) + " MiB per session").c_str() : "none",
      static_cast<unsigned long long>(index_compressed_chunks),
      static_cast<unsigned long long>(index_evicted_chunks), mib(counters.bytes_moved),
      static_cast<unsigned long long>(counters.promotions),
      static_cast<unsigned long long>(counters.demotions), static_cast<unsigned long long>(counters.hits),
      static_cast<unsigned long long>(counters.misses), static_cast<unsigned long long>(counters.cold_reads),
      static_cast<unsigned long long>(counters.cold_writes));
  std::string text = buf;
  {
    // The byte floor, beside the same-run ratio: what the step and full attention read, and the
    // time those bytes take at the streaming rate measured in this run.
    std::string floor = "\n";  // a section of its own, as "memory" below
    char line[512];
    if (bandwidth.bytes_per_s > 0)
      std::snprintf(
          line, sizeof(line),
          "byte floor (a decode step's bytes at %.1f GB/s, read-only streaming on %d threads, measured "
          "in this run)\n",
          bandwidth.bytes_per_s / 1e9, bandwidth.threads);
    else
      std::snprintf(line, sizeof(line), "byte floor (a decode step's bytes)\n");
    floor += line;
    if (!methods.empty()) {
      const MethodReport& m = methods[headline];
      std::snprintf(line, sizeof(line),
                    "  kvtier                     %8.1f MB  (first stage %.1f, rescoring %.1f, fetch %.1f, "
                    "attention %.1f): %s\n",
                    m.step_bytes() / 1e6, m.first_stage_bytes / 1e6, m.rescoring_bytes / 1e6,
                    m.fetch_bytes / 1e6, m.attention_bytes / 1e6,
                    FloorText(*this, m.step_ms, m.step_bytes(), true).c_str());
      floor += line;
    }
    std::snprintf(line, sizeof(line), "  full attention             %8.1f MB  %s\n",
                  full_attention_bytes / 1e6,
                  FloorText(*this, full_attention_step_ms, full_attention_bytes, base).c_str());
    floor += line;
    const size_t at = text.find("\nmemory\n");
    text.insert(at == std::string::npos ? text.size() : at, floor);
  }
  text += TierTrafficText(counters, !options.store.remote.empty());
  if (options.store.device == Device::kCuda) {
    char line[256];
    std::snprintf(
        line, sizeof(line),
        "device: cuda, %.2f host syncs per generated token (blocking waits on the device over the "
        "decode steps, the steps' own; %.2f on worker threads), %.2f chunks deferred (chosen with no "
        "warm copy)\n",
        host_syncs_per_token, worker_host_syncs_per_token, chunks_deferred_per_token);
    text += line;
    const auto mib = [](uint64_t b) { return static_cast<double>(b) / (1 << 20); };
    const auto owner = [this](DeviceMemoryOwner o) {
      return device_memory_peak_by_owner[static_cast<int>(o)];
    };
    std::snprintf(
        line, sizeof(line),
        "device memory peak %.1f MiB (counted allocations; most per owner: hot tier %.1f, attention "
        "%.1f, retrieval mirror %.1f, retrieval workspace %.1f)\n",
        mib(device_memory_peak_bytes), mib(owner(DeviceMemoryOwner::kHotTier)),
        mib(owner(DeviceMemoryOwner::kAttention)), mib(owner(DeviceMemoryOwner::kRetrievalMirror)),
        mib(owner(DeviceMemoryOwner::kRetrievalWorkspace)));
    text += line;
  }
  if (options.trace) {
    // Right under the title: every figure above is on the trace's real attention.
    const size_t nl = text.find('\n');
    std::string line = "trace: " + options.trace->source + "; question window from position " +
                       std::to_string(options.trace->question_begin) + ", needles";
    for (const TokenRange& r : options.trace->needles)
      line += " [" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
    text.insert(nl + 1, line + "\n");
  }
  if (!methods.empty())
    text += "retrieval (" + methods[headline].name + "): " + methods[headline].spec + "\n";
  if (!methods.empty() && methods[headline].reused_selections > 0)
    text += "reused selections: " + std::to_string(methods[headline].reused_selections) + " of " +
            std::to_string(methods[headline].selections) +
            " layer selections rescored the layer's last search's shortlist (--reuse)\n";
  if (!methods.empty() && methods[headline].sliced_selections > 0)
    text += "sliced selections: " + std::to_string(methods[headline].sliced_selections) + " of " +
            std::to_string(methods[headline].selections) +
            " layer selections screened a slice of the chunks and rescored the shortlist (--screen)\n";
  if (const std::string turnover =
          methods.empty() ? "" : TurnoverText(methods[headline].decode_turnover_by_layer);
      !turnover.empty())
    text += "decode turnover: " + turnover +
            " of a layer's retrieved chunks were not retrieved by its previous decode step\n";
  if (!policy.spec.empty()) {
    char line[512];
    char ratio[32] = "-";
    if (policy.attention_ms > 0)
      std::snprintf(ratio, sizeof(ratio), "%.2fx", policy.scoring_ms / policy.attention_ms);
    std::snprintf(line, sizeof(line),
                  "scoring policy %s: %.1f ms over %d layers (%s the %.1f ms of the "
                  "observation windows' exact attention)%s\n",
                  policy.spec.c_str(), policy.scoring_ms, options.store.geometry.layers, ratio,
                  policy.attention_ms,
                  policy.compressed ? "" : "; scored at prefill end, its chunk scores drive demotion");
    text += line;
    if (policy.compressed) {
      std::snprintf(line, sizeof(line),
                    "compression: %d time(s); the store holds %llu tokens per layer (budget %lld) of "
                    "%lld, %llu chunks dropped\n",
                    policy.compressions, static_cast<unsigned long long>(policy.kept_tokens),
                    static_cast<long long>(options.kv_budget),
                    static_cast<long long>(options.workload.context + options.workload.decode_steps),
                    static_cast<unsigned long long>(policy.dropped_chunks));
      text += line;
    }
  }
  if (spearman_act.samples > 0) {
    char line[256];
    std::snprintf(line, sizeof(line),
                  "probe-to-oracle Spearman rho (median, IQR over %d samples): act %.3f [%.3f, %.3f], mean "
                  "%.3f [%.3f, %.3f]\n",
                  spearman_act.samples, spearman_act.median, spearman_act.q1, spearman_act.q3,
                  spearman_mean.median, spearman_mean.q1, spearman_mean.q3);
    text += line;
  }
  if (options.compare) {
    text += "\ncomparison on the same data (decode steps | question window):\n" + CompareTable() + "\n" +
            FloorTable();
    for (const std::string& n : compare_notes) text += "note: " + n + "\n";
  }
  return text;
}

}  // namespace kvtier
