#include "integration/policy_eval.h"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>

#include "integration/kv_source.h"
#include "kernels/cpu/dot.h"
#include "offload/policy/scoring_policy.h"

namespace kvtier {
namespace {

double NowMs() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// Softmax of one query head over the keys at `positions` of kv head `kh`
// (K: [tokens][Hkv][D]); writes probabilities to `out` and returns nothing. The
// caller passes only keys at or before the query (causal).
void SoftmaxRow(const float* q, const std::vector<float>& K, int Hkv, int D, int kh, const int64_t* positions,
                size_t n, float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float m = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) {
    out[i] = kernels::Dot(q, K.data() + (static_cast<size_t>(positions[i]) * Hkv + kh) * D, D) * scale;
    m = std::max(m, out[i]);
  }
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += (out[i] = std::exp(out[i] - m));
  const float inv = static_cast<float>(1.0 / sum);
  for (size_t i = 0; i < n; ++i) out[i] *= inv;
}

// o = sum_i p_i v_{positions[i]} for kv head kh.
void WeightedValues(const float* p, const std::vector<float>& V, int Hkv, int D, int kh,
                    const int64_t* positions, size_t n, float* o) {
  std::fill(o, o + D, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    const float* v = V.data() + (static_cast<size_t>(positions[i]) * Hkv + kh) * D;
    for (int d = 0; d < D; ++d) o[d] += p[i] * v[d];
  }
}

struct PolicyRun {
  std::unique_ptr<ScoringPolicy> policy;
  std::vector<std::vector<std::vector<int64_t>>> cache;  // [layer][kv head] kept positions, increasing
  PolicyEvalRow row;
  std::vector<double> decode_scoring, decode_attention;
  double retention = 0, recall = 0, error = 0, cache_tokens = 0;
  int64_t retention_n = 0, recall_n = 0, error_n = 0, cache_n = 0;
};

}  // namespace

Status PolicyEvalOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(geometry.Validate());
  if (budget < 1) return InvalidArgument("policy eval: budget must be >= 1, got " + std::to_string(budget));
  if (observe < 1 || observe > workload.context)
    return InvalidArgument("policy eval: observe must be in [1, context], got " + std::to_string(observe));
  if (sink_tokens < 0 || local_tokens < 0)
    return InvalidArgument("policy eval: sink and local tokens must be >= 0");
  if (budget < sink_tokens + local_tokens + 1)
    return InvalidArgument("policy eval: budget " + std::to_string(budget) + " leaves no room beyond the " +
                           std::to_string(sink_tokens + local_tokens) +
                           " protected tokens (sinks + local window)");
  return Status::Ok();
}

Result<std::vector<PolicyEvalRow>> EvaluatePolicies(const PolicyEvalOptions& options) {
  PolicyEvalOptions o = options;
  if (o.trace) AdoptTrace(*o.trace, &o.geometry, &o.workload);
  KVTIER_RETURN_IF_ERROR(o.Validate());
  const Geometry g = o.geometry;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<KvSource> source, MakeKvSource(g, o.workload, o.trace));
  const KvSource& work = *source;
  const int L = g.layers, Hq = g.q_heads, Hkv = g.kv_heads, D = g.head_dim, G = g.group_size();
  const int64_t ctx = o.workload.context, total = work.total_tokens();
  const int steps = o.workload.decode_steps, m = o.observe;

  std::vector<std::string> specs = o.policies;
  if (specs.empty())
    for (const PolicyInfo& info : ListScoringPolicies()) specs.push_back(info.name);
  PolicyGeometry pg;
  pg.layers = L;
  pg.q_heads = Hq;
  pg.kv_heads = Hkv;
  pg.head_dim = D;
  pg.sink_tokens = o.sink_tokens;
  pg.local_tokens = o.local_tokens;
  std::vector<PolicyRun> runs(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    auto p = MakeScoringPolicy(specs[i]);
    if (!p.ok()) return p.status();
    runs[i].policy = std::move(*p);
    Status st = runs[i].policy->Begin(pg);
    if (!st.ok()) return Status(st.code(), specs[i] + ": " + st.message());
    runs[i].row.spec = runs[i].policy->ToString();
    runs[i].row.budget = o.budget;
    runs[i].cache.assign(L, {});
  }

  // The whole sequence's K and V, per layer, fp32.
  const size_t tok = static_cast<size_t>(Hkv) * D;
  std::vector<std::vector<float>> K(L), V(L);
  for (int l = 0; l < L; ++l) {
    K[l].resize(static_cast<size_t>(total) * tok);
    V[l].resize(K[l].size());
    work.Generate(l, 0, total, nullptr, K[l].data(), V[l].data());
  }

  // ---- prefill end: the last m prompt queries attend over every key ----
  std::vector<int64_t> all_pos(ctx);
  std::iota(all_pos.begin(), all_pos.end(), 0);
  std::vector<int64_t> qpos(m);
  std::iota(qpos.begin(), qpos.end(), ctx - m);
  std::vector<float> q(static_cast<size_t>(std::max(m, 1)) * Hq * D), attn(static_cast<size_t>(Hq) * m * ctx);
  for (int l = 0; l < L; ++l) {
    work.Generate(l, ctx - m, ctx, q.data(), nullptr, nullptr);
    const double t0 = NowMs();
    ExactAttentionRows(g, q.data(), qpos.data(), m, K[l].data(), nullptr, ctx, attn.data());
    const double attention_ms = NowMs() - t0;
    AttentionObservation obs;
    obs.layer = l;
    obs.n_queries = m;
    obs.n_keys = ctx;
    obs.key_positions = all_pos.data();
    obs.query_positions = qpos.data();
    obs.attention = attn.data();
    obs.keys = K[l].data();
    obs.values = V[l].data();
    for (PolicyRun& r : runs) {
      r.row.prefill_attention_ms += attention_ms;
      const double t1 = NowMs();
      Status st = r.policy->Observe(obs);
      r.row.prefill_scoring_ms += NowMs() - t1;
      if (!st.ok()) return Status(st.code(), r.row.spec + ": " + st.message());
    }
  }
  for (PolicyRun& r : runs) {
    for (int l = 0; l < L; ++l) {
      const double t1 = NowMs();
      auto keep = r.policy->Keep(l, o.budget);
      r.row.prefill_scoring_ms += NowMs() - t1;
      if (!keep.ok()) return Status(keep.status().code(), r.row.spec + ": " + keep.status().message());
      r.cache[l] = std::move(keep->per_head);
    }
    r.row.compressions = 1;
    r.row.peak_state_bytes = r.policy->state_bytes();
  }

  // ---- decoding: every step compared with full attention over every token ----
  std::vector<float> qd(static_cast<size_t>(Hq) * D), full(static_cast<size_t>(total)), o_full(D), o_kept(D);
  std::vector<float> probs;
  std::vector<std::vector<std::vector<float>>> past_q(steps);  // [step][layer] decode queries
  for (int s = 0; s < steps; ++s) {
    const int64_t p = ctx + s;
    std::vector<int64_t> seen(p + 1);
    std::iota(seen.begin(), seen.end(), 0);
    const std::vector<TokenRange> sought = work.SoughtNeedles(p);
    for (PolicyRun& r : runs) r.decode_scoring.push_back(0.0), r.decode_attention.push_back(0.0);
    for (int l = 0; l < L; ++l) {
      work.Generate(l, p, p + 1, qd.data(), nullptr, nullptr);
      past_q[s].push_back(qd);
      for (PolicyRun& r : runs)
        for (auto& head : r.cache[l]) head.push_back(p);  // the new token joins every head's cache
      // Full attention, once per q head, shared by the policies.
      std::vector<std::vector<float>> full_rows(Hq), full_out(Hq);
      for (int h = 0; h < Hq; ++h) {
        full_rows[h].resize(p + 1);
        SoftmaxRow(qd.data() + static_cast<size_t>(h) * D, K[l], Hkv, D, h / G, seen.data(), p + 1,
                   full_rows[h].data());
        full_out[h].resize(D);
        WeightedValues(full_rows[h].data(), V[l], Hkv, D, h / G, seen.data(), p + 1, full_out[h].data());
      }
      for (PolicyRun& r : runs) {
        // Union of the heads' caches: the observation's keys.
        std::vector<int64_t> uni;
        for (const auto& head : r.cache[l]) uni.insert(uni.end(), head.begin(), head.end());
        std::sort(uni.begin(), uni.end());
        uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
        std::vector<float> obs_attn(static_cast<size_t>(Hq) * uni.size(), 0.0f);
        const double t0 = NowMs();
        for (int h = 0; h < Hq; ++h) {
          const auto& kept = r.cache[l][h / G];
          probs.resize(kept.size());
          SoftmaxRow(qd.data() + static_cast<size_t>(h) * D, K[l], Hkv, D, h / G, kept.data(), kept.size(),
                     probs.data());
          WeightedValues(probs.data(), V[l], Hkv, D, h / G, kept.data(), kept.size(), o_kept.data());
          // Scatter into the union row (0 where this head dropped the key).
          size_t j = 0;
          for (size_t i = 0; i < kept.size(); ++i) {
            while (uni[j] < kept[i]) ++j;
            obs_attn[static_cast<size_t>(h) * uni.size() + j] = probs[i];
          }
          double rec = 0.0;
          for (int64_t pos : kept) rec += full_rows[h][pos];
          double num = 0.0, den = 0.0;
          for (int d = 0; d < D; ++d) {
            num += (o_kept[d] - full_out[h][d]) * (o_kept[d] - full_out[h][d]);
            den += full_out[h][d] * full_out[h][d];
          }
          r.recall += rec;
          r.recall_n++;
          r.error += den > 0 ? std::sqrt(num / den) : 0.0;
          r.error_n++;
        }
        r.decode_attention.back() += NowMs() - t0;
        for (const auto& head : r.cache[l]) {
          r.cache_tokens += static_cast<double>(head.size());
          r.cache_n++;
          if (!sought.empty()) {
            int64_t in = 0, len = 0;
            for (const TokenRange& nr : sought)
              for (int64_t t = nr.begin; t < nr.end; ++t, ++len)
                in += std::binary_search(head.begin(), head.end(), t);
            r.retention += static_cast<double>(in) / static_cast<double>(len);
            r.retention_n++;
          }
        }
        std::vector<float> uk(uni.size() * tok), uv(uni.size() * tok);
        for (size_t i = 0; i < uni.size(); ++i) {
          std::copy_n(K[l].data() + static_cast<size_t>(uni[i]) * tok, tok, uk.data() + i * tok);
          std::copy_n(V[l].data() + static_cast<size_t>(uni[i]) * tok, tok, uv.data() + i * tok);
        }
        // Policies that compress while decoding observe their window at compression
        // time (below); the others observe every step.
        if (r.policy->compress_every() > 0) continue;
        AttentionObservation obs;
        obs.layer = l;
        obs.n_queries = 1;
        obs.n_keys = static_cast<int64_t>(uni.size());
        obs.key_positions = uni.data();
        obs.query_positions = &p;
        obs.attention = obs_attn.data();
        obs.keys = uk.data();
        obs.values = uv.data();
        const double t1 = NowMs();
        Status st = r.policy->Observe(obs);
        r.decode_scoring.back() += NowMs() - t1;
        if (!st.ok())
          return Status(st.code(), r.row.spec + " (decode step " + std::to_string(s) + "): " + st.message());
      }
    }
    for (PolicyRun& r : runs) {
      const int64_t every = r.policy->compress_every();
      if (every > 0 && (s + 1) % every == 0) {
        // The observation window: the last min(observe, every) decode queries over the
        // cache as it is now (causal; each head over what it kept), then compress.
        const int w = static_cast<int>(std::min<int64_t>(m, every));
        std::vector<int64_t> wpos(w);
        for (int i = 0; i < w; ++i) wpos[i] = p - w + 1 + i;
        for (int l = 0; l < L; ++l) {
          std::vector<int64_t> uni;
          for (const auto& head : r.cache[l]) uni.insert(uni.end(), head.begin(), head.end());
          std::sort(uni.begin(), uni.end());
          uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
          std::vector<float> wattn(static_cast<size_t>(Hq) * w * uni.size(), 0.0f);
          for (int h = 0; h < Hq; ++h)
            for (int i = 0; i < w; ++i) {
              const auto& kept = r.cache[l][h / G];
              const size_t visible =
                  static_cast<size_t>(std::upper_bound(kept.begin(), kept.end(), wpos[i]) - kept.begin());
              probs.resize(visible);
              const float* qv = past_q[wpos[i] - ctx][l].data() + static_cast<size_t>(h) * D;
              SoftmaxRow(qv, K[l], Hkv, D, h / G, kept.data(), visible, probs.data());
              float* row = wattn.data() + (static_cast<size_t>(h) * w + i) * uni.size();
              size_t j = 0;
              for (size_t k = 0; k < visible; ++k) {
                while (uni[j] < kept[k]) ++j;
                row[j] = probs[k];
              }
            }
          std::vector<float> uk(uni.size() * tok), uv(uni.size() * tok);
          for (size_t i = 0; i < uni.size(); ++i) {
            std::copy_n(K[l].data() + static_cast<size_t>(uni[i]) * tok, tok, uk.data() + i * tok);
            std::copy_n(V[l].data() + static_cast<size_t>(uni[i]) * tok, tok, uv.data() + i * tok);
          }
          AttentionObservation obs;
          obs.layer = l;
          obs.n_queries = w;
          obs.n_keys = static_cast<int64_t>(uni.size());
          obs.key_positions = uni.data();
          obs.query_positions = wpos.data();
          obs.attention = wattn.data();
          obs.keys = uk.data();
          obs.values = uv.data();
          const double t1 = NowMs();
          Status st = r.policy->Observe(obs);
          r.decode_scoring.back() += NowMs() - t1;
          if (!st.ok())
            return Status(st.code(),
                          r.row.spec + " (compression at step " + std::to_string(s) + "): " + st.message());
        }
        for (int l = 0; l < L; ++l) {
          const double t1 = NowMs();
          auto keep = r.policy->Keep(l, o.budget);
          r.decode_scoring.back() += NowMs() - t1;
          if (!keep.ok()) return Status(keep.status().code(), r.row.spec + ": " + keep.status().message());
          r.cache[l] = std::move(keep->per_head);
        }
        r.row.compressions++;
      }
      r.row.peak_state_bytes = std::max(r.row.peak_state_bytes, r.policy->state_bytes());
    }
  }

  std::vector<PolicyEvalRow> out;
  for (PolicyRun& r : runs) {
    r.row.needle_retention = r.retention_n ? r.retention / r.retention_n : 0.0;
    r.row.attention_recall = r.recall_n ? r.recall / r.recall_n : 0.0;
    r.row.output_error = r.error_n ? r.error / r.error_n : 0.0;
    r.row.mean_cache_tokens = r.cache_n ? r.cache_tokens / r.cache_n : 0.0;
    // Means, not medians: a policy that compresses every s steps pays its scoring on
    // one step in s, and the mean is what that costs per step.
    r.row.decode_scoring_ms = Mean(r.decode_scoring);
    r.row.decode_attention_ms = Mean(r.decode_attention);
    out.push_back(r.row);
  }
  return out;
}

std::string PolicyEvalTable(const std::vector<PolicyEvalRow>& rows) {
  std::string t;
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%-44s %7s %8s %8s %8s %9s %9s %6s %9s\n", "policy", "budget", "needle",
                "recall", "out.err", "pf.score", "dec.score", "comp", "state.KiB");
  t += buf;
  std::snprintf(buf, sizeof(buf), "%-44s %7s %8s %8s %8s %9s %9s %6s %9s\n", "", "tokens", "kept", "", "",
                "/attn", "/attn", "", "");
  t += buf;
  for (const PolicyEvalRow& r : rows) {
    const std::string spec = r.spec.size() > 44 ? r.spec.substr(0, 41) + "..." : r.spec;
    // A ratio without a measured denominator is "-", not 0.00x.
    auto ratio = [](double num, double den) {
      char s[32] = "-";
      if (den > 0) std::snprintf(s, sizeof(s), "%.2fx", num / den);
      return std::string(s);
    };
    std::snprintf(buf, sizeof(buf), "%-44s %7lld %8.3f %8.3f %8.3f %9s %9s %6d %9.0f\n", spec.c_str(),
                  static_cast<long long>(r.budget), r.needle_retention, r.attention_recall, r.output_error,
                  ratio(r.prefill_scoring_ms, r.prefill_attention_ms).c_str(),
                  ratio(r.decode_scoring_ms, r.decode_attention_ms).c_str(), r.compressions,
                  r.peak_state_bytes / 1024.0);
    t += buf;
  }
  return t;
}

}  // namespace kvtier
