// The classic baselines the papers compare against: lru, streaming (StreamingLLM), h2o (Heavy-Hitter
// Oracle) and snapkv. Each keeps per-layer state keyed by token position (so it survives the caller
// dropping keys between observations), scores keys per kv head, and keeps exactly min(budget, keys)
// positions per head, protected keys (sinks + local window) first; only streaming may evict them.
//
// Conventions shared by the four (see scoring_policy.h for the interface):
//   - G = q_heads / kv_heads; kv head g owns query heads [g*G, (g+1)*G) (GQA).
//   - "Visible" keys of a query are the cached keys at or before its position (causal).
//   - State is double precision internally; TokenScores are float.
//   - Scores(layer) after Keep(layer, ...) covers only the kept keys (the others are forgotten).
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "offload/policy/policies.h"

namespace kvtier::policies {
namespace {

// new[i] = old value at the same position, or `fill` for a position not seen before.
template <typename T>
std::vector<T> Remap(const std::vector<int64_t>& old_pos, const std::vector<T>& old_vals,
                     const std::vector<int64_t>& new_pos, T fill) {
  std::vector<T> out(new_pos.size(), fill);
  size_t j = 0;
  for (size_t i = 0; i < new_pos.size(); ++i) {
    while (j < old_pos.size() && old_pos[j] < new_pos[i]) ++j;
    if (j < old_pos.size() && old_pos[j] == new_pos[i]) out[i] = old_vals[j];
  }
  return out;
}

// Number of keys (a prefix, positions increasing) a query at `query_pos` can see.
int64_t VisibleCount(const std::vector<int64_t>& positions, int64_t query_pos) {
  return std::upper_bound(positions.begin(), positions.end(), query_pos) - positions.begin();
}

struct LayerState {
  bool observed = false;
  int64_t observations = 0;                   // Observe calls on this layer (lru's clock)
  std::vector<int64_t> positions;             // keys of the latest observation, minus those Keep dropped
  std::vector<std::vector<double>> per_head;  // [kv_heads][positions.size()] policy state
};

// The bookkeeping every classic policy shares: Begin / Observe / Scores / Keep checks, position-keyed
// state, forgetting after Keep. A policy supplies Update (fold one observation into the state) and,
// if its keep rule is not "protected keys, then the highest scores", SelectHead.
class ClassicPolicy : public ScoringPolicy {
 public:
  Status Begin(const PolicyGeometry& g) override {
    if (Status st = g.Validate(); !st.ok()) return InvalidArgument(name() + ": " + st.message());
    g_ = g;
    layers_.assign(g.layers, LayerState{});
    began_ = true;
    return Status::Ok();
  }

  Status Observe(const AttentionObservation& obs) override {
    // An allocation failure (state grows with the observed keys) is ResourceExhausted.
    return ReturnOnBadAlloc(
        [&] { return name() + " Observe: state for " + std::to_string(obs.n_keys) + " keys"; },
        [&]() -> Status {
          if (!began_) return FailedPrecondition(name() + ": Observe before Begin");
          if (Status st = obs.Validate(g_); !st.ok()) return InvalidArgument(name() + ": " + st.message());
          LayerState& s = layers_[obs.layer];
          std::vector<int64_t> positions(obs.key_positions, obs.key_positions + obs.n_keys);
          std::vector<std::vector<double>> per_head(g_.kv_heads);
          for (int h = 0; h < g_.kv_heads; ++h)
            per_head[h] = s.per_head.empty() ? std::vector<double>(positions.size(), NewKeyValue(s))
                                             : Remap(s.positions, s.per_head[h], positions, NewKeyValue(s));
          s.positions = std::move(positions);
          s.per_head = std::move(per_head);
          ++s.observations;
          Update(obs, s);
          s.observed = true;
          return Status::Ok();
        });
  }

  Result<TokenScores> Scores(int layer) const override {
    KVTIER_RETURN_IF_ERROR(CheckLayer(layer, "Scores"));
    const LayerState& s = layers_[layer];
    TokenScores out;
    out.positions = s.positions;
    out.per_head.resize(g_.kv_heads);
    for (int h = 0; h < g_.kv_heads; ++h) out.per_head[h] = HeadScores(s, h);
    return out;
  }

  Result<KeepSet> Keep(int layer, int64_t budget) override {
    KVTIER_RETURN_IF_ERROR(CheckLayer(layer, "Keep"));
    if (budget < 0) return InvalidArgument(name() + ": budget must be >= 0, got " + std::to_string(budget));
    LayerState& s = layers_[layer];
    KeepSet ks;
    ks.per_head.resize(g_.kv_heads);
    for (int h = 0; h < g_.kv_heads; ++h) {
      auto kept = SelectHead(s, h, budget);
      if (!kept.ok())
        return Status(kept.status().code(),
                      name() + " (layer " + std::to_string(layer) + "): " + kept.status().message());
      ks.per_head[h] = std::move(kept).value();
    }
    Forget(s, ks.Union());
    return ks;
  }

  size_t state_bytes() const override {
    size_t bytes = layers_.capacity() * sizeof(LayerState);
    for (const auto& s : layers_) {
      bytes += s.positions.capacity() * sizeof(int64_t) + s.per_head.capacity() * sizeof(std::vector<double>);
      for (const auto& h : s.per_head) bytes += h.capacity() * sizeof(double);
    }
    return bytes;
  }

 protected:
  // Folds `obs` into `s`, whose positions / per_head already match obs's keys.
  virtual void Update(const AttentionObservation& obs, LayerState& s) = 0;
  // State given to a key the layer has not seen before.
  virtual double NewKeyValue(const LayerState& s) const { return 0.0; }
  // One kv head's scores, aligned with s.positions.
  virtual std::vector<float> HeadScores(const LayerState& s, int head) const {
    return std::vector<float>(s.per_head[head].begin(), s.per_head[head].end());
  }
  // One kv head's keep set (positions, increasing): protected keys, then the highest scores.
  virtual Result<std::vector<int64_t>> SelectHead(const LayerState& s, int head, int64_t budget) const {
    return KeepTopWithProtected(g_, s.positions, HeadScores(s, head), budget);
  }

  Status CheckLayer(int layer, const char* what) const {
    if (!began_) return FailedPrecondition(name() + ": " + what + " before Begin");
    if (layer < 0 || layer >= g_.layers)
      return InvalidArgument(name() + ": " + what + ": layer " + std::to_string(layer) +
                             " out of range [0, " + std::to_string(g_.layers) + ")");
    if (!layers_[layer].observed)
      return FailedPrecondition(name() + ": " + what + " before any Observe of layer " +
                                std::to_string(layer));
    return Status::Ok();
  }

  PolicyGeometry g_;
  bool began_ = false;
  std::vector<LayerState> layers_;

 private:
  // Keeps the state of `keep` (increasing, a subset of s.positions) only; fresh vectors so the
  // memory really goes.
  static void Forget(LayerState& s, const std::vector<int64_t>& keep) {
    if (keep.size() == s.positions.size()) return;
    for (auto& h : s.per_head) h = Remap(s.positions, h, keep, 0.0);
    s.positions = keep;
  }
};

// ---- lru -------------------------------------------------------------------------------------

// Least recently used, on the token clock: time is the token position. A key is "used" by kv head g
// at time p when the query at position p, through some query head of g's group, gives it attention
// a[h][i][k] >= 1 / v_i, where v_i is the number of keys visible to that query (at least the
// uniform share). Score of (g, key) = the position of the latest query that used it; a key never
// used scores its own position (the moment it entered the cache, as a cache counts a load as a
// use). So within one observation window a key used by the last question query outranks one used
// by an earlier query, and any used key outranks the keys written before that use. Keep: protected
// keys, then the highest scores (most recently used), ties toward the later position. Scores are
// positions (exact in float up to 2^24).
class LruPolicy final : public ClassicPolicy {
 public:
  std::string name() const override { return "lru"; }
  std::string ToString() const override { return "lru"; }

 protected:
  // New keys get a marker, replaced by their own position in Update.
  double NewKeyValue(const LayerState&) const override { return -1.0; }
  void Update(const AttentionObservation& obs, LayerState& s) override {
    const int G = g_.group_size();
    for (auto& head : s.per_head)
      for (size_t k = 0; k < head.size(); ++k)
        if (head[k] < 0.0) head[k] = static_cast<double>(s.positions[k]);
    for (int i = 0; i < obs.n_queries; ++i) {
      const int64_t v = VisibleCount(s.positions, obs.query_positions[i]);
      if (v == 0) continue;  // the query sees no cached key
      const double uniform = 1.0 / static_cast<double>(v);
      const double t = static_cast<double>(obs.query_positions[i]);
      for (int h = 0; h < g_.q_heads; ++h)
        for (int64_t k = 0; k < v; ++k)
          if (static_cast<double>(obs.at(h, i, k)) >= uniform)
            s.per_head[h / G][k] = std::max(s.per_head[h / G][k], t);
    }
  }
};

// ---- streaming (StreamingLLM, Xiao et al. 2024) ---------------------------------------------

// StreamingLLM keeps the attention sinks (the first `sinks` positions; the geometry's sink_tokens
// unless `sinks=N` overrides it) and a rolling window of the most recent keys, nothing else:
// Keep(layer, B) keeps the sinks and the most recent B - sinks keys, so its local window is whatever
// the budget leaves (it ignores the geometry's local_tokens and may evict protected keys: the only
// policy with may_evict_protected() = true). If B < sinks it keeps the first B sinks (the lowest
// positions, the strongest sinks) and no recent key. Scores follow the same order: the j-th of s
// sinks scores 2 + (s - j) / s in (2, 3], the i-th of the n keys otherwise (i + 1) / n in (0, 1],
// so the top B scores are exactly Keep's set. Attention values play no part.
class StreamingPolicy final : public ClassicPolicy {
 public:
  explicit StreamingPolicy(int sinks) : sinks_(sinks) {}
  std::string name() const override { return "streaming"; }
  std::string ToString() const override {
    return "streaming:sinks=" + (sinks_ < 0 ? std::string("auto") : std::to_string(sinks_));
  }
  bool may_evict_protected() const override { return true; }

 protected:
  void Update(const AttentionObservation&, LayerState&) override {}
  int64_t SinkLimit() const { return sinks_ < 0 ? g_.sink_tokens : sinks_; }
  int64_t SinkCount(const LayerState& s) const {
    return std::lower_bound(s.positions.begin(), s.positions.end(), SinkLimit()) - s.positions.begin();
  }
  std::vector<float> HeadScores(const LayerState& s, int) const override {
    const int64_t n = static_cast<int64_t>(s.positions.size()), sc = SinkCount(s);
    std::vector<float> out(n);
    for (int64_t i = 0; i < n; ++i)
      out[i] = i < sc ? static_cast<float>(2.0 + static_cast<double>(sc - i) / static_cast<double>(sc))
                      : static_cast<float>(static_cast<double>(i + 1) / static_cast<double>(n));
    return out;
  }
  Result<std::vector<int64_t>> SelectHead(const LayerState& s, int, int64_t budget) const override {
    const int64_t n = static_cast<int64_t>(s.positions.size()), sc = SinkCount(s);
    if (budget >= n) return s.positions;
    if (budget <= sc) return std::vector<int64_t>(s.positions.begin(), s.positions.begin() + budget);
    std::vector<int64_t> out(s.positions.begin(), s.positions.begin() + sc);
    out.insert(out.end(), s.positions.end() - (budget - sc), s.positions.end());
    return out;
  }

 private:
  int sinks_;  // -1 = the geometry's sink_tokens
};

// ---- h2o (Heavy-Hitter Oracle, Zhang et al. 2023) -------------------------------------------

// H2O's score is the attention a key has accumulated: for kv head g and key k,
//   acc[g][k] = Σ_observations Σ_{h in g's group} Σ_{queries i} a[h][i][k],
// summed over every observation the key was cached for (a new key starts at 0). Keep: the protected
// keys (sinks + local window, the paper's "recent" tokens), then the heavy hitters (highest acc).
// Parameter `recent` (default 0) is the paper's recent-token share of the budget: with recent = r the
// most recent floor(r * B) keys are kept as well (beyond the local window, as far as the budget
// allows) before the heavy hitters fill the rest; r = 0 leaves the recent part to the local window.
class H2oPolicy final : public ClassicPolicy {
 public:
  explicit H2oPolicy(double recent) : recent_(recent) {}
  std::string name() const override { return "h2o"; }
  std::string ToString() const override { return "h2o:recent=" + FormatSpecDouble(recent_); }

 protected:
  void Update(const AttentionObservation& obs, LayerState& s) override {
    const int G = g_.group_size();
    for (int h = 0; h < g_.q_heads; ++h) {
      std::vector<double>& acc = s.per_head[h / G];
      for (int i = 0; i < obs.n_queries; ++i)
        for (int64_t k = 0; k < obs.n_keys; ++k) acc[k] += obs.at(h, i, k);
    }
  }
  Result<std::vector<int64_t>> SelectHead(const LayerState& s, int head, int64_t budget) const override {
    const std::vector<float> scores = HeadScores(s, head);
    const int64_t n = static_cast<int64_t>(s.positions.size());
    const int64_t recent = static_cast<int64_t>(std::floor(recent_ * static_cast<double>(budget)));
    // Also checks budget >= protected count (and gives the error naming it).
    auto base = KeepTopWithProtected(g_, s.positions, scores, budget);
    if (!base.ok() || recent == 0 || budget >= n) return base;
    const std::vector<int64_t> prot = ProtectedIndexes(g_, s.positions);
    std::vector<char> chosen(n, 0);
    for (int64_t i : prot) chosen[i] = 1;
    int64_t left = budget - static_cast<int64_t>(prot.size());
    for (int64_t i = n - 1; i >= std::max<int64_t>(0, n - recent) && left > 0; --i)
      if (!chosen[i]) chosen[i] = 1, --left;
    std::vector<int64_t> rest;
    for (int64_t i = 0; i < n; ++i)
      if (!chosen[i]) rest.push_back(i);
    for (int64_t i : TopIndexes(scores, rest, left)) chosen[i] = 1;
    std::vector<int64_t> out;
    for (int64_t i = 0; i < n; ++i)
      if (chosen[i]) out.push_back(s.positions[i]);
    return out;
  }

 private:
  double recent_;
};

// ---- snapkv (Li et al. 2024) ------------------------------------------------------------------

// SnapKV votes with the observation window, which here is the latest observation's queries (only
// the latest observation counts; earlier ones are forgotten):
//   1. per query head h: C_h[k] = Σ_{window queries i} a[h][i][k]           (SnapKV's vote)
//   2. 1-D max pooling along the cached keys with kernel `kernel` (odd, default 7), stride 1, same
//      length (max over the in-range neighbours i in [k - kernel/2, k + kernel/2], as max_pool1d
//      with padding kernel/2): P_h[k] = max_i C_h[i]; the neighbourhood is over adjacent cached
//      keys (indexes), which are adjacent positions unless keys were dropped between them;
//   3. GQA: the score of kv head g is the mean of P_h over the G query heads of its group (pooling
//      per query head first, then the group mean, as the GQA ports of SnapKV do).
// Keep: protected keys (sinks + local window, which holds the window's own keys when local_tokens
// >= the window), then the highest scores.
class SnapKvPolicy final : public ClassicPolicy {
 public:
  explicit SnapKvPolicy(int kernel) : kernel_(kernel) {}
  std::string name() const override { return "snapkv"; }
  std::string ToString() const override { return "snapkv:kernel=" + std::to_string(kernel_); }

 protected:
  void Update(const AttentionObservation& obs, LayerState& s) override {
    const int G = g_.group_size();
    const int64_t n = obs.n_keys, half = kernel_ / 2;
    for (auto& h : s.per_head) std::fill(h.begin(), h.end(), 0.0);  // only the latest observation counts
    std::vector<double> vote(n), pooled(n);
    for (int h = 0; h < g_.q_heads; ++h) {
      std::fill(vote.begin(), vote.end(), 0.0);
      for (int i = 0; i < obs.n_queries; ++i)
        for (int64_t k = 0; k < n; ++k) vote[k] += obs.at(h, i, k);
      for (int64_t k = 0; k < n; ++k) {
        double m = vote[k];
        for (int64_t j = std::max<int64_t>(0, k - half); j <= std::min<int64_t>(n - 1, k + half); ++j)
          m = std::max(m, vote[j]);
        pooled[k] = m;
      }
      std::vector<double>& score = s.per_head[h / G];
      for (int64_t k = 0; k < n; ++k) score[k] += pooled[k] / G;
    }
  }

 private:
  int kernel_;
};

}  // namespace

// ---- factories -------------------------------------------------------------------------------

Result<std::unique_ptr<ScoringPolicy>> MakeLru(const FactorySpec& fs, const std::string& spec) {
  if (!fs.params.empty()) return UnknownKey(fs, spec, fs.params[0].first, "none");
  return std::unique_ptr<ScoringPolicy>(new LruPolicy());
}

Result<std::unique_ptr<ScoringPolicy>> MakeStreaming(const FactorySpec& fs, const std::string& spec) {
  int sinks = -1;
  for (const auto& [key, value] : fs.params) {
    if (key != "sinks") return UnknownKey(fs, spec, key, "sinks");
    if (value == "auto") {
      sinks = -1;
      continue;
    }
    KVTIER_ASSIGN_OR_RETURN(sinks, ParseSpecInt(spec, key, value));
    if (sinks < 0)
      return InvalidArgument("bad value '" + value + "' for key 'sinks' in spec '" + spec +
                             "' (expected auto or an integer >= 0)");
  }
  return std::unique_ptr<ScoringPolicy>(new StreamingPolicy(sinks));
}

Result<std::unique_ptr<ScoringPolicy>> MakeH2o(const FactorySpec& fs, const std::string& spec) {
  double recent = 0.0;
  for (const auto& [key, value] : fs.params) {
    if (key != "recent") return UnknownKey(fs, spec, key, "recent");
    KVTIER_ASSIGN_OR_RETURN(recent, ParseSpecDouble(spec, key, value));
    if (recent < 0.0 || recent > 1.0)
      return InvalidArgument("bad value '" + value + "' for key 'recent' in spec '" + spec +
                             "' (expected a number in [0, 1])");
  }
  return std::unique_ptr<ScoringPolicy>(new H2oPolicy(recent));
}

Result<std::unique_ptr<ScoringPolicy>> MakeSnapKv(const FactorySpec& fs, const std::string& spec) {
  int kernel = 7;
  for (const auto& [key, value] : fs.params) {
    if (key != "kernel") return UnknownKey(fs, spec, key, "kernel");
    KVTIER_ASSIGN_OR_RETURN(kernel, ParseSpecInt(spec, key, value));
    if (kernel < 1 || kernel % 2 == 0)
      return InvalidArgument("bad value '" + value + "' for key 'kernel' in spec '" + spec +
                             "' (expected an odd integer >= 1)");
  }
  return std::unique_ptr<ScoringPolicy>(new SnapKvPolicy(kernel));
}

PolicyInfo LruInfo() {
  return {
      "lru",
      "keeps the most recently used keys (attention >= uniform 1/visible from a query head of the kv group); "
      "never-used keys date from their insertion",
      "classic baseline (least recently used)",
      {}};
}

PolicyInfo StreamingInfo() {
  return {"streaming",
          "keeps the attention sinks and the most recent keys; shrinks the recent window to fit the budget "
          "(may evict the local window)",
          "StreamingLLM (Xiao et al. 2024)",
          {{"sinks", "auto", "sink positions kept: auto = the geometry's sink_tokens, or an integer >= 0"}}};
}

PolicyInfo H2oInfo() {
  return {
      "h2o",
      "keeps the heavy hitters: keys with the highest attention accumulated over all observations, plus the "
      "local window",
      "H2O: Heavy-Hitter Oracle (Zhang et al. 2023)",
      {{"recent", "0", "share of the budget kept as most recent keys (beyond the local window), in [0, 1]"}}};
}

PolicyInfo SnapKvInfo() {
  return {"snapkv",
          "keeps the keys the latest observation window votes for: attention summed over the window queries, "
          "max-pooled over neighbouring keys, mean over the GQA group",
          "SnapKV (Li et al. 2024)",
          {{"kernel", "7", "max-pooling kernel along the keys (odd, >= 1)"}}};
}

}  // namespace kvtier::policies
