#include "integration/run_job.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <sstream>

#include <unistd.h>

#include "integration/json.h"
#include "integration/sysinfo.h"
#include "kernels/cpu/attention.h"
#include "retrieval/exact_retriever.h"

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
    const uint64_t idx = static_cast<uint64_t>((t - n_sink) / chunk_size);
    return std::binary_search(chunks.begin(), chunks.end(), idx);
  }
};

// Queries of one evaluated step: the question window (m queries) or a decode step (1).
struct StepRecord {
  int64_t first_position = 0;
  int m = 0;
  std::vector<std::vector<float>> q;       // [layer][m, q_heads, D]
  std::vector<std::vector<float>> out;     // [layer][m, q_heads, D] sparse output
  std::vector<Attended> attended;          // [layer]
  double ms = 0, retrieve_ms = 0, fetch_ms = 0, attention_ms = 0, append_ms = 0;
};

class Progress {
 public:
  Progress(bool on, const char* what, int64_t total)
      : on_(on), tty_(isatty(2)), what_(what), total_(total), t0_(NowSeconds()) {}
  // On a terminal one line is redrawn; in a log a line every 10%.
  void Update(int64_t done) {
    if (!on_) return;
    const int pct = static_cast<int>(100 * done / std::max<int64_t>(1, total_));
    if (pct < next_ && done < total_) return;
    next_ = pct + (tty_ ? 2 : 10);
    std::fprintf(stderr, "%s[kvtier] %s %3d%% (%lld/%lld, %.1f s)%s", tty_ ? "\r" : "", what_, pct,
                 static_cast<long long>(done), static_cast<long long>(total_), NowSeconds() - t0_,
                 !tty_ || done >= total_ ? "\n" : "");
    std::fflush(stderr);
  }
 private:
  bool on_;
  bool tty_;
  const char* what_;
  int64_t total_;
  double t0_;
  int next_ = 0;
};

kernels::AttentionParams MakeParams(const Geometry& g, const float* q, const int64_t* pos, int m,
                                    const std::vector<kernels::KvSpan>& parts, float* out) {
  kernels::AttentionParams p;
  p.q_heads = g.q_heads; p.kv_heads = g.kv_heads; p.head_dim = g.head_dim; p.dtype = g.dtype;
  p.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
  p.n_queries = m; p.q = q; p.q_positions = pos;
  p.parts = parts.data(); p.n_parts = static_cast<int>(parts.size());
  p.out = out;
  return p;
}

Status RunKernel(const kernels::AttentionParams& p) {
  const kernels::KernelError e = kernels::Attention(p);
  if (e != kernels::KernelError::kOk) return Internal(std::string("attention kernel: ") + kernels::KernelErrorString(e));
  return Status::Ok();
}

}  // namespace

Status RunOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(store.Validate());
  KVTIER_RETURN_IF_ERROR(workload.Validate());
  if (budget < 0) return InvalidArgument("budget must be >= 0 (got " + std::to_string(budget) + ")");
  if (window <= 0) return InvalidArgument("window must be > 0 (got " + std::to_string(window) + ")");
  if (stat_stride <= 0) return InvalidArgument("stat_stride must be > 0 (got " + std::to_string(stat_stride) + ")");
  if (workload.context <= store.n_sink + store.n_local)
    return InvalidArgument("context (" + std::to_string(workload.context) + ") must exceed n_sink + n_local (" +
                           std::to_string(store.n_sink + store.n_local) + ") for anything to be retrieved");
  const uint64_t budget_chunks = static_cast<uint64_t>(budget / store.chunk_size);
  if (budget_chunks * store.chunk_bytes() > store.hot_bytes)
    return InvalidArgument("budget (" + std::to_string(budget) + " tokens = " + std::to_string(budget_chunks) +
                           " chunks) does not fit the hot slot pool (hot_bytes " + std::to_string(store.hot_bytes) + ")");
  return Status::Ok();
}

Result<RunReport> RunJob(const RunOptions& opt) {
  KVTIER_RETURN_IF_ERROR(opt.Validate());
  const Geometry& g = opt.store.geometry;
  KVTIER_ASSIGN_OR_RETURN(Workload work, Workload::Create(g, opt.workload));
  KVTIER_ASSIGN_OR_RETURN(auto store, TieredStore::Open(opt.store));
  KVTIER_ASSIGN_OR_RETURN(SequenceId seq, store->CreateSequence());
  ExactRetriever retriever(store.get());
  ResetPeakRss();

  RunReport rep;
  rep.options = opt;
  const int L = g.layers, Hq = g.q_heads, D = g.head_dim;
  const size_t q_elems = static_cast<size_t>(Hq) * D;
  const size_t kv_elems = g.token_elems();
  const size_t elem = DTypeSize(g.dtype);
  const int64_t context = opt.workload.context;
  const int64_t qbegin = work.question_begin();
  const int n_sink = opt.store.n_sink, cs = opt.store.chunk_size;
  const int k_chunks = opt.budget / cs;
  rep.context_kv_bytes = static_cast<uint64_t>(context) * L * g.token_kv_bytes();

  // ---- prefill: append the context in windows, observe a strided subset of queries ----
  std::vector<float> qf, kf, vf;
  std::vector<uint8_t> kb, vb;
  auto generate = [&](int layer, int64_t b, int64_t e) {
    const size_t n = static_cast<size_t>(e - b);
    qf.resize(n * q_elems); kf.resize(n * kv_elems); vf.resize(n * kv_elems);
    kb.resize(n * kv_elems * elem); vb.resize(n * kv_elems * elem);
    work.Generate(layer, b, e, qf.data(), kf.data(), vf.data());
    FromFloat(g.dtype, kf.data(), kb.data(), n * kv_elems);
    FromFloat(g.dtype, vf.data(), vb.data(), n * kv_elems);
  };
  Progress prog(opt.progress, "prefill", context);
  double prefill_s = 0;
  std::vector<float> sq;
  std::vector<int64_t> spos;
  for (int64_t b = 0; b < context; b += opt.window) {
    const int64_t e = std::min(context, b + opt.window);
    for (int l = 0; l < L; ++l) {
      generate(l, b, e);
      const double t0 = NowSeconds();
      KVTIER_RETURN_IF_ERROR(store->Append(seq, l, kb.data(), vb.data(), static_cast<int>(e - b), g.dtype));
      sq.clear(); spos.clear();
      for (int64_t p = e - 1; p >= b && p >= n_sink; p -= opt.stat_stride) {
        spos.push_back(p);
        sq.insert(sq.end(), qf.begin() + (p - b) * q_elems, qf.begin() + (p - b + 1) * q_elems);
      }
      if (!spos.empty())
        KVTIER_RETURN_IF_ERROR(store->ObserveQueries(seq, l, sq.data(), spos.data(), static_cast<int>(spos.size())));
      prefill_s += NowSeconds() - t0;
    }
    prog.Update(e);
  }
  rep.prefill_s = prefill_s;

  // ---- evaluated steps: the question window, then decode steps ----
  auto sparse_step = [&](int64_t first, int m, bool append) -> Result<StepRecord> {
    StepRecord rec;
    rec.first_position = first;
    rec.m = m;
    rec.q.resize(L); rec.out.resize(L); rec.attended.resize(L);
    std::vector<int64_t> pos(m);
    std::iota(pos.begin(), pos.end(), first);
    std::vector<float> probe(kv_elems);
    for (int l = 0; l < L; ++l) {
      generate(l, first, first + m);
      rec.q[l].assign(qf.begin(), qf.end());
      rec.out[l].assign(static_cast<size_t>(m) * q_elems, 0.0f);
      double t0 = NowSeconds();
      if (append) KVTIER_RETURN_IF_ERROR(store->Append(seq, l, kb.data(), vb.data(), m, g.dtype));
      double t1 = NowSeconds();
      ExactRetriever::MeanProbe(g, rec.q[l].data(), m, probe.data());
      KVTIER_ASSIGN_OR_RETURN(std::vector<uint64_t> chunks, retriever.TopK(seq, l, probe.data(), k_chunks));
      double t2 = NowSeconds();
      KVTIER_ASSIGN_OR_RETURN(FetchHandle h, store->FetchChunks(seq, l, chunks));
      KVTIER_RETURN_IF_ERROR(h.Wait());
      double t3 = NowSeconds();
      KVTIER_ASSIGN_OR_RETURN(HotView view, store->GetHotView(seq, l));
      std::vector<kernels::KvSpan> parts;
      parts.push_back(view.sinks);
      for (const auto& s : h.spans()) parts.push_back(s);
      for (int i = 0; i < view.n_local_spans; ++i) parts.push_back(view.local[i]);
      KVTIER_RETURN_IF_ERROR(RunKernel(MakeParams(g, rec.q[l].data(), pos.data(), m, parts, rec.out[l].data())));
      double t4 = NowSeconds();
      h.Release();
      rec.append_ms += 1e3 * (t1 - t0);
      rec.retrieve_ms += 1e3 * (t2 - t1);
      rec.fetch_ms += 1e3 * (t3 - t2);
      rec.attention_ms += 1e3 * (t4 - t3);
      std::sort(chunks.begin(), chunks.end());
      rec.attended[l].chunks = std::move(chunks);
      rec.attended[l].local_begin = view.n_local_spans ? view.local[0].first_position : view.n_tokens;
    }
    rec.ms = rec.append_ms + rec.retrieve_ms + rec.fetch_ms + rec.attention_ms;
    return rec;
  };

  std::vector<StepRecord> steps;
  {
    // The question window was appended with the context; its queries attend now.
    KVTIER_ASSIGN_OR_RETURN(StepRecord question, sparse_step(qbegin, opt.workload.question_len, false));
    steps.push_back(std::move(question));
  }
  Progress dprog(opt.progress, "decode", opt.workload.decode_steps);
  for (int s = 0; s < opt.workload.decode_steps; ++s) {
    KVTIER_ASSIGN_OR_RETURN(StepRecord rec, sparse_step(context + s, 1, true));
    steps.push_back(std::move(rec));
    dprog.Update(s + 1);
  }
  KVTIER_RETURN_IF_ERROR(store->WaitForDurable());
  rep.peak_rss_bytes = PeakRssBytes();
  rep.counters = store->counters();
  rep.index_bytes = store->metadata_bytes() + retriever.memory_bytes();
  rep.rss_bound_bytes = opt.store.warm_bytes + opt.store.hot_bytes + (rep.counters.hot_bytes -
                        rep.counters.hot_chunks * opt.store.chunk_bytes()) + rep.index_bytes + kRunRssOverheadBytes;

  for (size_t i = 1; i < steps.size(); ++i) {
    rep.step_ms_all.push_back(steps[i].ms);
  }
  auto part_median = [&](double StepRecord::*field) {
    std::vector<double> v;
    for (size_t i = 1; i < steps.size(); ++i) v.push_back(steps[i].*field);
    return Median(v);
  };
  rep.step_ms = Median(rep.step_ms_all);
  rep.retrieve_ms = part_median(&StepRecord::retrieve_ms);
  rep.fetch_ms = part_median(&StepRecord::fetch_ms);
  rep.attention_ms = part_median(&StepRecord::attention_ms);
  rep.append_ms = part_median(&StepRecord::append_ms);

  // ---- needle hits need no baseline ----
  auto needle_hit = [&](const StepRecord& rec, int l) {
    // Every needle sought by a query of this step must be fully attended.
    std::vector<int> sought;
    for (int i = 0; i < rec.m; ++i) {
      const int n = work.SoughtNeedle(rec.first_position + i);
      if (n >= 0 && std::find(sought.begin(), sought.end(), n) == sought.end()) sought.push_back(n);
    }
    for (int n : sought)
      for (int t = 0; t < opt.workload.needle_len; ++t)
        if (!rec.attended[l].Contains(work.needle_starts()[n] + t, n_sink, cs)) return false;
    return true;
  };
  {
    int hits = 0, total = 0, qhits = 0;
    for (size_t i = 0; i < steps.size(); ++i)
      for (int l = 0; l < L; ++l) {
        const bool hit = needle_hit(steps[i], l);
        if (i == 0) qhits += hit; else { hits += hit; total++; }
      }
    rep.needle_hit_rate = total ? static_cast<double>(hits) / total : 0.0;
    rep.question_needle_hit_rate = static_cast<double>(qhits) / L;
  }

  // ---- baseline: full attention over the whole context, one layer at a time ----
  if (opt.baseline) {
    const int64_t total = work.total_tokens();
    std::vector<uint8_t> all_k(static_cast<size_t>(total) * kv_elems * elem), all_v(all_k.size());
    std::vector<double> full_ms(steps.size(), 0.0);
    std::vector<double> err_num(steps.size(), 0.0), err_den(steps.size(), 0.0);
    std::vector<double> recall_sum(steps.size(), 0.0);
    std::vector<float> mass(static_cast<size_t>(g.kv_heads) * total);
    std::vector<float> out;
    Progress bprog(opt.progress, "full-attention baseline", L);
    for (int l = 0; l < L; ++l) {
      for (int64_t b = 0; b < total; b += 4096) {
        const int64_t e = std::min(total, b + 4096);
        kf.resize((e - b) * kv_elems); vf.resize((e - b) * kv_elems);
        work.Generate(l, b, e, nullptr, kf.data(), vf.data());
        FromFloat(g.dtype, kf.data(), all_k.data() + b * kv_elems * elem, kf.size());
        FromFloat(g.dtype, vf.data(), all_v.data() + b * kv_elems * elem, vf.size());
      }
      for (size_t i = 0; i < steps.size(); ++i) {
        const StepRecord& rec = steps[i];
        const int64_t visible = rec.first_position + rec.m;  // causal: keys up to the last query
        std::fill(mass.begin(), mass.end(), 0.0f);
        std::vector<kernels::KvSpan> parts{kernels::KvSpan{all_k.data(), all_v.data(), static_cast<int>(visible), 0,
                                                           mass.data()}};
        // The kernel's mass layout is [kv_heads, n_tokens] with n_tokens = visible.
        std::vector<int64_t> pos(rec.m);
        std::iota(pos.begin(), pos.end(), rec.first_position);
        out.assign(static_cast<size_t>(rec.m) * q_elems, 0.0f);
        // Time the plain kernel (no mass output) as the baseline step, then
        // run again with mass for recall.
        std::vector<kernels::KvSpan> timed_parts = parts;
        timed_parts[0].mass = nullptr;
        const double t0 = NowSeconds();
        KVTIER_RETURN_IF_ERROR(RunKernel(MakeParams(g, rec.q[l].data(), pos.data(), rec.m, timed_parts, out.data())));
        full_ms[i] += 1e3 * (NowSeconds() - t0);
        KVTIER_RETURN_IF_ERROR(RunKernel(MakeParams(g, rec.q[l].data(), pos.data(), rec.m, parts, out.data())));
        for (size_t j = 0; j < out.size(); ++j) {
          const double d = static_cast<double>(rec.out[l][j]) - out[j];
          err_num[i] += d * d;
          err_den[i] += static_cast<double>(out[j]) * out[j];
        }
        double on = 0, all = 0;
        for (int h = 0; h < g.kv_heads; ++h) {
          const float* mh = mass.data() + static_cast<size_t>(h) * visible;
          for (int64_t t = 0; t < visible; ++t) {
            all += mh[t];
            if (rec.attended[l].Contains(t, n_sink, cs)) on += mh[t];
          }
        }
        recall_sum[i] += all > 0 ? on / all : 0.0;
      }
      bprog.Update(l + 1);
    }
    std::vector<double> recalls;
    for (size_t i = 0; i < steps.size(); ++i) {
      const double err = err_den[i] > 0 ? std::sqrt(err_num[i] / err_den[i]) : 0.0;
      if (i == 0) {
        rep.question_output_rel_error = err;
        rep.question_attention_recall = recall_sum[i] / L;
      } else {
        rep.step_error_all.push_back(err);
        rep.full_step_ms_all.push_back(full_ms[i]);
        recalls.push_back(recall_sum[i] / L);
      }
    }
    rep.output_rel_error = Median(rep.step_error_all);
    rep.attention_recall = Mean(recalls);
    rep.full_attention_step_ms = Median(rep.full_step_ms_all);
  }
  return rep;
}

std::string RunReport::ToJson() const {
  JsonWriter w(true);
  const RunOptions& o = options;
  w.BeginObject();
  w.Key("quality").BeginObject();
  w.Key("needle_hit_rate").Double(needle_hit_rate);
  w.Key("attention_recall").Double(attention_recall);
  w.Key("output_rel_error").Double(output_rel_error);
  w.Key("question_needle_hit_rate").Double(question_needle_hit_rate);
  w.Key("question_attention_recall").Double(question_attention_recall);
  w.Key("question_output_rel_error").Double(question_output_rel_error);
  w.EndObject();
  w.Key("time").BeginObject();
  w.Key("step_ms").Double(step_ms);
  w.Key("full_attention_step_ms").Double(full_attention_step_ms);
  w.Key("speedup_vs_full").Double(step_ms > 0 ? full_attention_step_ms / step_ms : 0.0);
  w.Key("split_ms").BeginObject();
  w.Key("append").Double(append_ms).Key("retrieve").Double(retrieve_ms).Key("fetch").Double(fetch_ms)
      .Key("attention").Double(attention_ms);
  w.EndObject();
  w.Key("prefill_s").Double(prefill_s);
  w.Key("prefill_tokens_per_s").Double(prefill_s > 0 ? o.workload.context / prefill_s : 0.0);
  w.Key("step_ms_all").BeginArray();
  for (double v : step_ms_all) w.Double(v);
  w.EndArray();
  w.Key("full_attention_step_ms_all").BeginArray();
  for (double v : full_step_ms_all) w.Double(v);
  w.EndArray();
  w.EndObject();
  w.Key("memory").BeginObject();
  w.Key("peak_rss_bytes").Uint(peak_rss_bytes);
  w.Key("rss_bound_bytes").Uint(rss_bound_bytes);
  w.Key("within_rss_bound").Bool(peak_rss_bytes <= rss_bound_bytes);
  w.Key("rss_overhead_bytes").Uint(kRunRssOverheadBytes);
  w.Key("index_bytes").Uint(index_bytes);
  w.Key("context_kv_bytes").Uint(context_kv_bytes);
  w.Key("tier_bytes").BeginObject();
  w.Key("hot").Uint(counters.hot_bytes).Key("warm").Uint(counters.warm_bytes).Key("cold").Uint(counters.cold_bytes);
  w.EndObject();
  w.Key("tier_chunks").BeginObject();
  w.Key("hot").Uint(counters.hot_chunks).Key("warm").Uint(counters.warm_chunks).Key("cold").Uint(counters.cold_chunks);
  w.EndObject();
  w.EndObject();
  w.Key("io").BeginObject();
  w.Key("bytes_moved").Uint(counters.bytes_moved);
  w.Key("promotions").Uint(counters.promotions).Key("demotions").Uint(counters.demotions);
  w.Key("hits").Uint(counters.hits).Key("misses").Uint(counters.misses);
  w.Key("cold_reads").Uint(counters.cold_reads).Key("cold_writes").Uint(counters.cold_writes);
  w.Key("chunks_sealed").Uint(counters.chunks_sealed);
  w.EndObject();
  w.Key("config").BeginObject();
  w.Key("context").Int(o.workload.context);
  w.Key("geometry").String(o.store.geometry.ToString());
  w.Key("chunk_size").Int(o.store.chunk_size).Key("n_sink").Int(o.store.n_sink).Key("n_local").Int(o.store.n_local);
  w.Key("repr_topk").Int(o.store.repr_topk);
  w.Key("budget").Int(o.budget).Key("window").Int(o.window).Key("stat_stride").Int(o.stat_stride);
  w.Key("hot_bytes").Uint(o.store.hot_bytes).Key("warm_bytes").Uint(o.store.warm_bytes);
  w.Key("data_dir").String(o.store.data_dir);
  w.Key("compression").String(CompressionName(o.store.compression));
  w.Key("retrieval").String("exact top-k dot product vs representatives, mean probe");
  w.Key("decode_steps").Int(o.workload.decode_steps).Key("question_len").Int(o.workload.question_len);
  w.Key("needle_count").Int(o.workload.needle_count).Key("needle_len").Int(o.workload.needle_len);
  w.Key("needle_depth").Double(o.workload.needle_depth);
  w.Key("anchor_strength").Double(o.workload.anchor_strength).Key("noise").Double(o.workload.noise);
  w.Key("seed").Uint(o.workload.seed);
  w.EndObject();
  w.EndObject();
  return w.str();
}

std::string RunReport::ToTable() const {
  auto mib = [](uint64_t b) { return static_cast<double>(b) / (1 << 20); };
  char buf[4096];
  const double speedup = step_ms > 0 ? full_attention_step_ms / step_ms : 0.0;
  std::snprintf(buf, sizeof(buf),
                "kvtier run — context %lld tokens, geometry %s, budget %d tokens/layer, chunk %d, sinks %d, local %d\n"
                "\n"
                "quality                      decode steps    question window\n"
                "  needle hit rate            %8.3f        %8.3f\n"
                "  attention recall           %8.3f        %8.3f\n"
                "  output rel. error          %8.4f        %8.4f\n"
                "\n"
                "time per decode step (median over %zu steps, all %d layers)\n"
                "  kvtier                     %8.2f ms  (append %.2f, retrieve %.2f, fetch %.2f, attention %.2f)\n"
                "  full attention             %8.2f ms  -> kvtier is %.1fx faster\n"
                "  prefill                    %8.2f s   (%.0f tokens/s, generation excluded)\n"
                "\n"
                "memory\n"
                "  context KV                 %8.1f MiB\n"
                "  tiers: hot %.1f MiB, warm %.1f MiB, cold %.1f MiB (%llu/%llu/%llu chunks)\n"
                "  peak RSS                   %8.1f MiB  (bound %.1f MiB: %s)\n"
                "io: %.1f MiB moved, %llu promotions, %llu demotions, %llu hits, %llu misses, %llu cold reads, %llu cold writes\n",
                static_cast<long long>(options.workload.context), options.store.geometry.ToString().c_str(),
                options.budget, options.store.chunk_size, options.store.n_sink, options.store.n_local,
                needle_hit_rate, question_needle_hit_rate, attention_recall, question_attention_recall,
                output_rel_error, question_output_rel_error, step_ms_all.size(), options.store.geometry.layers,
                step_ms, append_ms, retrieve_ms, fetch_ms, attention_ms, full_attention_step_ms, speedup, prefill_s,
                prefill_s > 0 ? options.workload.context / prefill_s : 0.0, mib(context_kv_bytes),
                mib(counters.hot_bytes), mib(counters.warm_bytes), mib(counters.cold_bytes),
                static_cast<unsigned long long>(counters.hot_chunks), static_cast<unsigned long long>(counters.warm_chunks),
                static_cast<unsigned long long>(counters.cold_chunks), mib(peak_rss_bytes), mib(rss_bound_bytes),
                peak_rss_bytes <= rss_bound_bytes ? "within" : "EXCEEDED", mib(counters.bytes_moved),
                static_cast<unsigned long long>(counters.promotions), static_cast<unsigned long long>(counters.demotions),
                static_cast<unsigned long long>(counters.hits), static_cast<unsigned long long>(counters.misses),
                static_cast<unsigned long long>(counters.cold_reads), static_cast<unsigned long long>(counters.cold_writes));
  return buf;
}

}  // namespace kvtier
