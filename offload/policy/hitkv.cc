// HitKV (Zhao et al., AAAI 2026, /work/shared/papers/hitkv-activation-frequency.txt): keep the keys
// that are activated most often, where an activation ("hit") is a key ranking in the Top-K of one
// recent-window query's attention; and P-HitKV, the same indicator under PyramidKV's per-layer
// budgets.
//
// What the paper defines, and where it is implemented below:
//   - Definition 1 (Hit): key i gets one hit from window query j when its attention score ranks
//     within the Top-K of j's attention distribution; K is the hit coefficient.     -> ComputeHits
//   - Eq. 1: T_hr(t_i) = Σ_{j in L_w} Hit_i^j / |L_w|.                              -> ComputeHits
//   - Eviction (Sec. "Hit-based KV Eviction Algorithm"): keep T_hr >= θ, evict T_hr < θ, then pad
//     each head to a uniform length with the keys of highest recent-cumulative attention.
//                                                                                   -> SelectHead
//   - Parameter analysis (Fig. 4): K = budget and θ = 50% make the retained count track the
//     budget; the defaults here (k=0 meaning K = budget, theta=0.5).
//   - P-HitKV (Sec. "Scalability Analysis", Experiments): the indicator inside PyramidKV's
//     layer-specific budgets, each layer selecting within its own budget (K = that budget).
//                                                                         -> PyramidLayerBudgets
//
// Where the paper is silent, this implementation chooses (and the tests pin):
//   - GQA: hits are counted per kv head over its group's query heads: every (query head h of the
//     group, window query j) pair is one observer with its own Top-K, so for kv head g
//     T_hr(g, i) = Σ_{h in group(g)} Σ_{j in L_w} Hit_{h,i}^j / (G |L_w|).
//   - Top-K is taken among the keys visible to query j (position <= j's position; later keys have no
//     attention to rank); when K >= the visible count every visible key is a hit. Ties at the K-th
//     place go to the later key (the same rule as TopIndexes).
//   - |L_w| is the same for every key (Eq. 1), also for keys inside the window that fewer queries
//     see; those are normally in the protected local window anyway.
//   - "Recent cumulative attention" is cum(g, i) = Σ_{h in group(g)} Σ_{j in L_w} a[h][j][i] over
//     the same window.
//   - Protected keys (sinks + local window) are kept first and count in the budget. Then the keys
//     with T_hr >= θ; if more pass than the budget holds, the highest T_hr win, ties by cumulative
//     attention, then by the later position. The rest of the budget is padded with the highest
//     cumulative attention (ties to the later position), so each head keeps exactly min(B, n).
//   - The recent window L_w: by default (window=0) the queries of the layer's latest observation,
//     as in the paper's prefill-time compression. window=W > 0 keeps the last W queries across
//     observations instead (useful when observations are single decode steps); a stored query row
//     gives 0 to keys appended after it, which is right since they are in its future, and a new
//     observation replaces stored rows at or after its first query position.
//   - Scores(layer) with k=0 needs a K without a budget: it uses the budget of the layer's latest
//     Keep, and before any Keep sink_tokens + local_tokens (the smallest budget Keep accepts for
//     any sequence), at least 1. The score orders keys the way Keep ranks them (up to float rounding):
//     2 + T_hr + cum/(o(o+1)) for a key with T_hr >= θ, cum/o otherwise, with o = G |L_w| observers
//     (cum/o is in [0, 1], and cum/(o(o+1)) < 1/o, the gap between two T_hr values).
//   - State: since K = budget is known only at Keep, the policy stores the window's attention rows,
//     q_heads * |L_w| floats per cached key and layer; Keep drops the columns of the keys it evicts.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "offload/policy/policies.h"

namespace kvtier::policies {

/// P-HitKV's per-layer budgets, PyramidKV's linear schedule (Cai et al. 2025): each layer first gets
/// `floor_per_layer` (the keys it must keep; PyramidKV likewise adds its observation window on top of
/// the pyramid), and the remaining extra = budget - floor_per_layer per layer is spread linearly from
/// 2 * extra - extra / beta in layer 0 down to extra / beta in the top layer, so the mean is extra and
/// Σ_l budget_l = layers * budget exactly (integer parts first, the remainder one key each to the
/// lowest layers, which keeps the schedule non-increasing). beta >= 1 (1 = uniform; PyramidKV uses
/// 20). InvalidArgument for layers < 1, budget < 0, beta < 1 or not finite, floor outside [0, budget].
Result<std::vector<int64_t>> PyramidLayerBudgets(int layers, int64_t budget, double beta,
                                                 int64_t floor_per_layer) {
  if (layers < 1)
    return InvalidArgument("PyramidLayerBudgets: layers must be >= 1, got " + std::to_string(layers));
  if (budget < 0)
    return InvalidArgument("PyramidLayerBudgets: budget must be >= 0, got " + std::to_string(budget));
  if (!std::isfinite(beta) || beta < 1.0)
    return InvalidArgument("PyramidLayerBudgets: beta must be a finite number >= 1, got " +
                           FormatSpecDouble(beta));
  if (floor_per_layer < 0 || floor_per_layer > budget)
    return InvalidArgument("PyramidLayerBudgets: floor per layer " + std::to_string(floor_per_layer) +
                           " outside [0, budget " + std::to_string(budget) + "]");
  const int64_t extra = budget - floor_per_layer;
  std::vector<int64_t> e(layers, extra);
  if (layers > 1) {
    const double lo = static_cast<double>(extra) / beta, hi = 2.0 * static_cast<double>(extra) - lo;
    const double step = (hi - lo) / (layers - 1);
    int64_t sum = 0;
    for (int l = 0; l < layers; ++l) {
      // The 1e-9 keeps a computed 4.9999999 from flooring to 4.
      e[l] = std::max<int64_t>(0, static_cast<int64_t>(std::floor(hi - l * step + 1e-9)));
      sum += e[l];
    }
    int64_t rem = extra * layers - sum;
    for (int l = 0; rem > 0; l = (l + 1) % layers) ++e[l], --rem;
    for (int l = layers - 1; rem < 0; l = (l + layers - 1) % layers)
      if (e[l] > 0) --e[l], ++rem;
  }
  for (auto& b : e) b += floor_per_layer;
  return e;
}

namespace {

// One recent-window query: its position and its attention over the layer's cached keys.
struct WindowRow {
  int64_t query_position = 0;
  std::vector<float> att;  // [q_heads][positions.size()]
};

struct HitLayer {
  bool observed = false;
  std::vector<int64_t> positions;  // cached keys, increasing
  std::vector<WindowRow> rows;     // L_w, oldest first
  int64_t last_budget = 0;         // the latest Keep's budget for this layer (0 = none yet)
};

// Definition 1 and Eq. 1 for one layer and hit coefficient K, per kv head.
struct HitStats {
  std::vector<std::vector<int32_t>> hits;  // [kv_heads][n] Σ_{h in group} Σ_j Hit_{h,i}^j
  std::vector<std::vector<double>> cum;    // [kv_heads][n] recent cumulative attention
  int64_t observers = 0;                   // G |L_w|, the denominator of Eq. 1
  double rate(int g, int64_t i) const {
    return static_cast<double>(hits[g][i]) / static_cast<double>(observers);
  }
};

std::vector<float> RemapRow(const std::vector<int64_t>& old_pos, const float* old_vals,
                            const std::vector<int64_t>& new_pos) {
  std::vector<float> out(new_pos.size(), 0.0f);
  size_t j = 0;
  for (size_t i = 0; i < new_pos.size(); ++i) {
    while (j < old_pos.size() && old_pos[j] < new_pos[i]) ++j;
    if (j < old_pos.size() && old_pos[j] == new_pos[i]) out[i] = old_vals[j];
  }
  return out;
}

class HitKvPolicy final : public ScoringPolicy {
 public:
  HitKvPolicy(int k, double theta, double pyramid, int window)
      : k_(k), theta_(theta), pyramid_(pyramid), window_(window) {}

  std::string name() const override { return "hitkv"; }
  std::string ToString() const override {
    return "hitkv:k=" + std::to_string(k_) + ",theta=" + FormatSpecDouble(theta_) +
           ",pyramid=" + FormatSpecDouble(pyramid_) + ",window=" + std::to_string(window_);
  }

  Status Begin(const PolicyGeometry& g) override {
    if (Status st = g.Validate(); !st.ok()) return InvalidArgument("hitkv: " + st.message());
    g_ = g;
    layers_.assign(g.layers, HitLayer{});
    began_ = true;
    return Status::Ok();
  }

  Status Observe(const AttentionObservation& obs) override {
    // An allocation failure (state grows with the observed keys) is ResourceExhausted.
    return ReturnOnBadAlloc(
        [&] { return name() + " Observe: state for " + std::to_string(obs.n_keys) + " keys"; },
        [&]() -> Status {
          if (!began_) return FailedPrecondition("hitkv: Observe before Begin");
          if (Status st = obs.Validate(g_); !st.ok()) return InvalidArgument("hitkv: " + st.message());
          HitLayer& s = layers_[obs.layer];
          std::vector<int64_t> positions(obs.key_positions, obs.key_positions + obs.n_keys);
          const size_t n_old = s.positions.size(), n = positions.size();
          std::vector<WindowRow> rows;
          if (window_ > 0)  // keep earlier window queries before this observation's first one
            for (auto& r : s.rows) {
              if (r.query_position >= obs.query_positions[0]) continue;
              WindowRow nr{r.query_position, {}};
              nr.att.reserve(g_.q_heads * n);
              for (int h = 0; h < g_.q_heads; ++h) {
                const std::vector<float> m = RemapRow(s.positions, r.att.data() + h * n_old, positions);
                nr.att.insert(nr.att.end(), m.begin(), m.end());
              }
              rows.push_back(std::move(nr));
            }
          for (int i = 0; i < obs.n_queries; ++i) {
            WindowRow r{obs.query_positions[i], std::vector<float>(g_.q_heads * n)};
            for (int h = 0; h < g_.q_heads; ++h)
              for (size_t k = 0; k < n; ++k) r.att[h * n + k] = obs.at(h, i, static_cast<int64_t>(k));
            rows.push_back(std::move(r));
          }
          const size_t limit =
              window_ > 0 ? static_cast<size_t>(window_) : static_cast<size_t>(obs.n_queries);
          if (rows.size() > limit) rows.erase(rows.begin(), rows.end() - limit);
          s.positions = std::move(positions);
          s.rows = std::move(rows);
          s.observed = true;
          return Status::Ok();
        });
  }

  Result<TokenScores> Scores(int layer) const override {
    KVTIER_RETURN_IF_ERROR(CheckLayer(layer, "Scores"));
    const HitLayer& s = layers_[layer];
    int64_t K = k_;
    if (K == 0)
      K = s.last_budget > 0 ? s.last_budget : std::max<int64_t>(1, g_.sink_tokens + g_.local_tokens);
    const HitStats st = ComputeHits(s, K);
    const double o = static_cast<double>(st.observers);
    TokenScores out;
    out.positions = s.positions;
    out.per_head.assign(g_.kv_heads, std::vector<float>(s.positions.size()));
    for (int g = 0; g < g_.kv_heads; ++g)
      for (size_t i = 0; i < s.positions.size(); ++i) {
        const double r = st.rate(g, i), c = st.cum[g][i] / o;
        out.per_head[g][i] = static_cast<float>(r >= theta_ ? 2.0 + r + c / (o + 1.0) : c);
      }
    return out;
  }

  Result<KeepSet> Keep(int layer, int64_t budget) override {
    KVTIER_RETURN_IF_ERROR(CheckLayer(layer, "Keep"));
    if (budget < 0) return InvalidArgument("hitkv: budget must be >= 0, got " + std::to_string(budget));
    int64_t layer_budget = budget;
    if (pyramid_ > 0.0) {  // P-HitKV: this layer's share of layers * budget
      const int64_t floor = std::min<int64_t>(budget, g_.sink_tokens + g_.local_tokens);
      KVTIER_ASSIGN_OR_RETURN(auto sched, PyramidLayerBudgets(g_.layers, budget, pyramid_, floor));
      layer_budget = sched[layer];
    }
    HitLayer& s = layers_[layer];
    // K = budget (the paper's setting, Fig. 4) unless k overrides it.
    const HitStats st = ComputeHits(s, k_ > 0 ? k_ : layer_budget);
    KeepSet ks;
    ks.per_head.resize(g_.kv_heads);
    for (int g = 0; g < g_.kv_heads; ++g) {
      auto kept = SelectHead(s, st, g, layer_budget);
      if (!kept.ok())
        return Status(kept.status().code(),
                      "hitkv (layer " + std::to_string(layer) + "): " + kept.status().message());
      ks.per_head[g] = std::move(kept).value();
    }
    s.last_budget = layer_budget;
    Forget(s, ks.Union());
    return ks;
  }

  size_t state_bytes() const override {
    size_t bytes = layers_.capacity() * sizeof(HitLayer);
    for (const auto& s : layers_) {
      bytes += s.positions.capacity() * sizeof(int64_t) + s.rows.capacity() * sizeof(WindowRow);
      for (const auto& r : s.rows) bytes += r.att.capacity() * sizeof(float);
    }
    return bytes;
  }

 private:
  Status CheckLayer(int layer, const char* what) const {
    if (!began_) return FailedPrecondition(std::string("hitkv: ") + what + " before Begin");
    if (layer < 0 || layer >= g_.layers)
      return InvalidArgument(std::string("hitkv: ") + what + ": layer " + std::to_string(layer) +
                             " out of range [0, " + std::to_string(g_.layers) + ")");
    if (!layers_[layer].observed)
      return FailedPrecondition(std::string("hitkv: ") + what + " before any Observe of layer " +
                                std::to_string(layer));
    return Status::Ok();
  }

  // Definition 1 + Eq. 1: for each window row j and query head h, the Top-K of the keys visible to j
  // get one hit each (on h's kv head); cum adds up the same rows' attention.
  HitStats ComputeHits(const HitLayer& s, int64_t K) const {
    const int G = g_.group_size();
    const size_t n = s.positions.size();
    HitStats st;
    st.hits.assign(g_.kv_heads, std::vector<int32_t>(n, 0));
    st.cum.assign(g_.kv_heads, std::vector<double>(n, 0.0));
    st.observers = static_cast<int64_t>(G) * static_cast<int64_t>(s.rows.size());
    std::vector<int64_t> idx;
    for (const auto& r : s.rows) {
      const int64_t v =
          std::upper_bound(s.positions.begin(), s.positions.end(), r.query_position) - s.positions.begin();
      for (int h = 0; h < g_.q_heads; ++h) {
        const float* a = r.att.data() + h * n;
        std::vector<int32_t>& hits = st.hits[h / G];
        std::vector<double>& cum = st.cum[h / G];
        for (size_t k = 0; k < n; ++k) cum[k] += a[k];
        if (K <= 0 || v == 0) continue;
        if (K >= v) {
          for (int64_t k = 0; k < v; ++k) ++hits[k];
          continue;
        }
        idx.resize(v);
        for (int64_t k = 0; k < v; ++k) idx[k] = k;
        // Top-K^j: higher attention first, ties toward the later key.
        std::nth_element(idx.begin(), idx.begin() + (K - 1), idx.end(),
                         [a](int64_t x, int64_t y) { return a[x] != a[y] ? a[x] > a[y] : x > y; });
        for (int64_t t = 0; t < K; ++t) ++hits[idx[t]];
      }
    }
    return st;
  }

  // The keep set of kv head g: protected keys; then T_hr >= θ by (T_hr, cum, position) descending;
  // then padding by (cum, position) descending, to exactly min(budget, n).
  Result<std::vector<int64_t>> SelectHead(const HitLayer& s, const HitStats& st, int g,
                                          int64_t budget) const {
    const int64_t n = static_cast<int64_t>(s.positions.size());
    if (budget >= n) return s.positions;
    const std::vector<int64_t> prot = ProtectedIndexes(g_, s.positions);
    if (budget < static_cast<int64_t>(prot.size()))
      return InvalidArgument("budget " + std::to_string(budget) + " is smaller than the " +
                             std::to_string(prot.size()) + " protected keys (sinks " +
                             std::to_string(g_.sink_tokens) + " + local window " +
                             std::to_string(g_.local_tokens) + ")");
    std::vector<char> chosen(n, 0);
    for (int64_t i : prot) chosen[i] = 1;
    int64_t left = budget - static_cast<int64_t>(prot.size());
    const auto& hits = st.hits[g];
    const auto& cum = st.cum[g];
    auto by_cum = [&](int64_t x, int64_t y) { return cum[x] != cum[y] ? cum[x] > cum[y] : x > y; };
    // Keep T_hr >= θ (evict T_hr < θ); the highest T_hr first when they overflow the budget.
    std::vector<int64_t> pass, rest;
    for (int64_t i = 0; i < n; ++i)
      if (!chosen[i]) (st.rate(g, i) >= theta_ ? pass : rest).push_back(i);
    const int64_t take = std::min<int64_t>(left, static_cast<int64_t>(pass.size()));
    std::partial_sort(pass.begin(), pass.begin() + take, pass.end(), [&](int64_t x, int64_t y) {
      return hits[x] != hits[y] ? hits[x] > hits[y] : by_cum(x, y);
    });
    for (int64_t t = 0; t < take; ++t) chosen[pass[t]] = 1;
    left -= take;
    // Pad the head to a uniform length with the highest recent cumulative attention.
    const int64_t pad = std::min<int64_t>(left, static_cast<int64_t>(rest.size()));
    std::partial_sort(rest.begin(), rest.begin() + pad, rest.end(), by_cum);
    for (int64_t t = 0; t < pad; ++t) chosen[rest[t]] = 1;
    std::vector<int64_t> out;
    out.reserve(budget);
    for (int64_t i = 0; i < n; ++i)
      if (chosen[i]) out.push_back(s.positions[i]);
    return out;
  }

  // Keeps only `keep`'s positions (increasing, a subset): the window rows lose the other columns.
  void Forget(HitLayer& s, const std::vector<int64_t>& keep) const {
    if (keep.size() == s.positions.size()) return;
    const size_t n_old = s.positions.size();
    for (auto& r : s.rows) {
      std::vector<float> att;
      att.reserve(g_.q_heads * keep.size());
      for (int h = 0; h < g_.q_heads; ++h) {
        const std::vector<float> m = RemapRow(s.positions, r.att.data() + h * n_old, keep);
        att.insert(att.end(), m.begin(), m.end());
      }
      r.att = std::move(att);
    }
    s.positions = keep;
  }

  int k_;           // hit coefficient K; 0 = the (layer's) budget
  double theta_;    // hit-rate threshold θ
  double pyramid_;  // PyramidKV beta for P-HitKV; 0 = uniform budgets
  int window_;      // |L_w| across observations; 0 = the latest observation's queries
  PolicyGeometry g_;
  bool began_ = false;
  std::vector<HitLayer> layers_;
};

}  // namespace

Result<std::unique_ptr<ScoringPolicy>> MakeHitKv(const FactorySpec& fs, const std::string& spec) {
  int k = 0, window = 0;
  double theta = 0.5, pyramid = 0.0;
  for (const auto& [key, value] : fs.params) {
    if (key == "k") {
      KVTIER_ASSIGN_OR_RETURN(k, ParseSpecInt(spec, key, value));
      if (k < 0)
        return InvalidArgument("bad value '" + value + "' for key 'k' in spec '" + spec +
                               "' (expected an integer >= 0; 0 = K is the budget)");
    } else if (key == "theta") {
      KVTIER_ASSIGN_OR_RETURN(theta, ParseSpecDouble(spec, key, value));
      if (theta < 0.0 || theta > 1.0)
        return InvalidArgument("bad value '" + value + "' for key 'theta' in spec '" + spec +
                               "' (expected a number in [0, 1])");
    } else if (key == "pyramid") {
      KVTIER_ASSIGN_OR_RETURN(pyramid, ParseSpecDouble(spec, key, value));
      if (pyramid != 0.0 && pyramid < 1.0)
        return InvalidArgument("bad value '" + value + "' for key 'pyramid' in spec '" + spec +
                               "' (expected 0 = off, or a PyramidKV beta >= 1)");
    } else if (key == "window") {
      KVTIER_ASSIGN_OR_RETURN(window, ParseSpecInt(spec, key, value));
      if (window < 0)
        return InvalidArgument("bad value '" + value + "' for key 'window' in spec '" + spec +
                               "' (expected an integer >= 0; 0 = the latest observation's queries)");
    } else {
      return UnknownKey(fs, spec, key, "k, theta, pyramid, window");
    }
  }
  return std::unique_ptr<ScoringPolicy>(new HitKvPolicy(k, theta, pyramid, window));
}

PolicyInfo HitKvInfo() {
  return {"hitkv",
          "keeps the keys with hit rate T_hr >= theta (how often a key is in the Top-K of a recent-window "
          "query's "
          "attention), padded per head with the highest recent cumulative attention",
          "HitKV (Zhao et al. 2026): Definition 1, Eq. 1, hit-based eviction; P-HitKV with PyramidKV budgets",
          {{"k", "0", "hit coefficient K (Definition 1); 0 = K is the (layer's) budget"},
           {"theta", "0.5", "hit-rate threshold: keep T_hr >= theta (Eq. 1), in [0, 1]"},
           {"pyramid", "0",
            "0 = the same budget in every layer; beta >= 1 = P-HitKV, PyramidKV's linear per-layer "
            "schedule (top layer gets extra/beta)"},
           {"window", "0",
            "recent window |L_w| in queries across observations; 0 = the latest observation's "
            "queries"}}};
}

}  // namespace kvtier::policies
