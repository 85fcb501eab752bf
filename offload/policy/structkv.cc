// StructKV: global in-degree centrality (Eq. 2–3), dynamic pivot detection (Eq. 4–9),
// structural / storage decoupling (Eq. 10, 13) and block aggregation (Sec. 4.1). See structkv.h
// for the definitions and the places where the paper leaves a choice open.
#include "offload/policy/structkv.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "offload/policy/policies.h"

namespace kvtier {
namespace {

// Sorted union of two increasing position lists.
std::vector<int64_t> UnionPositions(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> out;
  out.reserve(a.size() + b.size());
  std::set_union(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// Sorted intersection.
std::vector<int64_t> IntersectPositions(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// ⌊x·r⌋ for a token count x and a rate r, robust to 0.1·10 landing just under 1 in binary.
int64_t RateCount(int64_t x, double r) {
  return static_cast<int64_t>(std::floor(static_cast<double>(x) * r + 1e-9));
}

}  // namespace

// ---- options -------------------------------------------------------------------------

Status StructKvOptions::Validate() const {
  auto rate = [](double v) { return v >= 0.0 && v <= 1.0; };
  if (w < 1) return InvalidArgument("structkv: w must be >= 1, got " + std::to_string(w));
  if (!(lambda > 0.0 && lambda <= 1.0))
    return InvalidArgument("structkv: lambda must be in (0, 1], got " + FormatSpecDouble(lambda));
  if (!rate(r_struct))
    return InvalidArgument("structkv: r_struct must be in [0, 1], got " + FormatSpecDouble(r_struct));
  if (!rate(r_kv)) return InvalidArgument("structkv: r_kv must be in [0, 1], got " + FormatSpecDouble(r_kv));
  if (w1 < 0.0 || w2 < 0.0 || w3 < 0.0)
    return InvalidArgument("structkv: w1, w2, w3 must be >= 0, got " + FormatSpecDouble(w1) + ", " +
                           FormatSpecDouble(w2) + ", " + FormatSpecDouble(w3));
  if (!(topk > 0.0 && topk <= 1.0))
    return InvalidArgument("structkv: topk must be in (0, 1], got " + FormatSpecDouble(topk));
  if (layer_limit < -1)
    return InvalidArgument("structkv: layer_limit must be >= 0 or -1 (the last layer), got " +
                           std::to_string(layer_limit));
  return Status::Ok();
}

std::string StructKvOptions::ToString() const {
  return "structkv:w=" + std::to_string(w) + ",lambda=" + FormatSpecDouble(lambda) +
         ",r_struct=" + FormatSpecDouble(r_struct) + ",r_kv=" + FormatSpecDouble(r_kv) +
         ",w1=" + FormatSpecDouble(w1) + ",w2=" + FormatSpecDouble(w2) + ",w3=" + FormatSpecDouble(w3) +
         ",topk=" + FormatSpecDouble(topk) + ",layer_limit=" + std::to_string(layer_limit) +
         ",budget_from_ratio=" + (budget_from_ratio ? "1" : "0");
}

// ---- the policy ----------------------------------------------------------------------

Status StructKvPolicy::Begin(const PolicyGeometry& g) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  KVTIER_RETURN_IF_ERROR(o_.Validate());
  g_ = g;
  begun_ = true;
  layers_.assign(g.layers, LayerState{});
  next_layer_ = 0;
  c_ = Centrality{};
  snapshots_.clear();
  metrics_.clear();
  transition_.clear();
  structural_.clear();
  pivot_ = -1;
  return Status::Ok();
}

int StructKvPolicy::LayerLimit() const {
  const int last = g_.layers - 1;
  return o_.layer_limit < 0 ? last : std::min(o_.layer_limit, last);
}

Status StructKvPolicy::CheckLayer(int layer, const char* what) const {
  if (!begun_) return FailedPrecondition(std::string("structkv: ") + what + " before Begin");
  if (layer < 0 || layer >= g_.layers)
    return InvalidArgument(std::string("structkv: ") + what + ": layer " + std::to_string(layer) +
                           " out of range [0, " + std::to_string(g_.layers) + ")");
  if (!layers_[layer].observed)
    return FailedPrecondition(std::string("structkv: ") + what + "(layer " + std::to_string(layer) +
                              ") before any observation of that layer");
  return Status::Ok();
}

Status StructKvPolicy::Observe(const AttentionObservation& obs) {
  // An allocation failure (state grows with the observed keys) is ResourceExhausted.
  return ReturnOnBadAlloc(
      [&] { return name() + " Observe: state for " + std::to_string(obs.n_keys) + " keys"; },
      [&]() -> Status {
        if (!begun_) return FailedPrecondition("structkv: Observe before Begin");
        KVTIER_RETURN_IF_ERROR(obs.Validate(g_));
        const int l = obs.layer;
        if (l != 0 && l != next_layer_)
          return FailedPrecondition(
              "structkv: layers are observed in order within a forward pass: expected layer " +
              std::to_string(next_layer_) + " (or 0 to start a new pass), got " + std::to_string(l));
        if (l == 0) {  // a new forward pass: Algorithm 1 line 1, C ← 0, pruned ← false
          c_ = Centrality{};
          snapshots_.clear();
          metrics_.clear();
          transition_.clear();
          structural_.clear();
          pivot_ = -1;
        }
        const int64_t n = obs.n_keys;
        const int G = g_.kv_heads, gs = g_.group_size(), Hq = g_.q_heads;
        // The window: the last w queries of the observation (all of them when it has fewer).
        const int wq = std::min(o_.w, obs.n_queries);
        const int q0 = obs.n_queries - wq;

        // Eq. 2, per kv group g: S_g[j] = (1/w) Σ_{t in window} Σ_{h∈H_g} a^(l,h)_{t,j}.
        LayerState& L = layers_[l];
        L.observed = true;
        L.positions.assign(obs.key_positions, obs.key_positions + n);
        L.saliency.assign(G, std::vector<float>(n, 0.0f));
        std::vector<double> acc(n);
        for (int grp = 0; grp < G; ++grp) {
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int h = grp * gs; h < (grp + 1) * gs; ++h)
            for (int t = q0; t < obs.n_queries; ++t)
              for (int64_t j = 0; j < n; ++j) acc[j] += obs.at(h, t, j);
          for (int64_t j = 0; j < n; ++j) L.saliency[grp][j] = static_cast<float>(acc[j] / wq);
        }

        if (pivot_ < 0) {  // Algorithm 1 line 5: not pruned yet
          // Eq. 4–6 over the window's rows, averaged over the query heads and the window's queries.
          const int64_t k = std::max<int64_t>(1, RateCount(n, o_.topk));  // Eq. 5: k = 0.1·N
          double ent = 0.0, spa = 0.0, var = 0.0;
          std::vector<float> row(n);
          for (int h = 0; h < Hq; ++h)
            for (int t = q0; t < obs.n_queries; ++t) {
              double e = 0.0, sum = 0.0;
              for (int64_t j = 0; j < n; ++j) {
                const double a = obs.at(h, t, j);
                row[j] = static_cast<float>(a);
                if (a > 0.0) e -= a * std::log(a);  // Eq. 4, with 0·log 0 = 0
                sum += a;
              }
              const double mean = sum / static_cast<double>(n);
              double v = 0.0;
              for (int64_t j = 0; j < n; ++j) v += (row[j] - mean) * (row[j] - mean);
              std::nth_element(row.begin(), row.begin() + (k - 1), row.end(), std::greater<float>());
              double top = 0.0;
              for (int64_t j = 0; j < k; ++j) top += row[j];  // Eq. 5: mass of the top-k keys
              ent += e;
              spa += top;
              var += v / static_cast<double>(n);  // Eq. 6: population variance over the N keys
            }
          const double norm = 1.0 / (static_cast<double>(Hq) * wq);
          metrics_.resize(l + 1);
          metrics_[l] = StructKvLayerMetrics{ent * norm, spa * norm, var * norm};

          // Eq. 3 realised online (Algorithm 1 line 6): C ← λ·C + S^(l), per group, on the union of
          // the positions seen in this pass (a key absent from a layer gets no in-degree there).
          const std::vector<int64_t> merged = UnionPositions(c_.positions, L.positions);
          Centrality next;
          next.positions = merged;
          next.per_group.resize(G);
          for (int grp = 0; grp < G; ++grp) {
            const std::vector<float> old =
                c_.per_group.empty() ? std::vector<float>(merged.size(), 0.0f)
                                     : RemapByPosition(c_.positions, c_.per_group[grp], merged, 0.0f);
            const std::vector<float> s = RemapByPosition(L.positions, L.saliency[grp], merged, 0.0f);
            next.per_group[grp].resize(merged.size());
            for (size_t j = 0; j < merged.size(); ++j)
              next.per_group[grp][j] = static_cast<float>(o_.lambda * old[j] + s[j]);
          }
          c_ = std::move(next);
          snapshots_.resize(l + 1);
          snapshots_[l] = c_;
          if (l == LayerLimit()) DetectPivot(l);
        }
        next_layer_ = l + 1;
        return Status::Ok();
      });
}

void StructKvPolicy::DetectPivot(int limit) {
  transition_.assign(limit + 1, 0.0);
  int pivot = 0;
  if (limit >= 1) {
    // Eq. 7 for one metric: ∇̄M_l = (ΔM_l − min_k ΔM_k) / (max_k ΔM_k − min_k ΔM_k), l, k in
    // [1, limit]; a metric whose differences are all equal contributes 0 (the paper divides by 0).
    auto normalised = [&](auto metric) {
      std::vector<double> d(limit + 1, 0.0);
      for (int l = 1; l <= limit; ++l) d[l] = metric(metrics_[l]) - metric(metrics_[l - 1]);
      const auto [mn, mx] = std::minmax_element(d.begin() + 1, d.end());
      const double lo = *mn, range = *mx - *mn;
      for (int l = 1; l <= limit; ++l) d[l] = range > 0.0 ? (d[l] - lo) / range : 0.0;
      return d;
    };
    const auto neg_h = normalised([](const StructKvLayerMetrics& m) { return -m.entropy; });
    const auto rho = normalised([](const StructKvLayerMetrics& m) { return m.sparsity; });
    const auto var = normalised([](const StructKvLayerMetrics& m) { return m.variance; });
    int best = 1;
    for (int l = 1; l <= limit; ++l) {
      // Eq. 8: T_l = w1·∇̄(−H_l) + w2·∇̄(ρ_l) + w3·∇̄(V_l).
      transition_[l] = o_.w1 * neg_h[l] + o_.w2 * rho[l] + o_.w3 * var[l];
      if (transition_[l] > transition_[best]) best = l;  // ties: the shallower layer
    }
    // Eq. 9: L* = argmax_l T_l + 1, capped at the layer limit (Algorithm 1 line 8).
    pivot = std::min(best + 1, limit);
  }
  pivot_ = pivot;
  c_ = std::move(snapshots_[pivot]);  // Eq. 3 at L*: Σ_{l≤L*} λ^(L*−l)·S^(l)
  snapshots_.clear();
  snapshots_.shrink_to_fit();

  // Eq. 10: I_struct = top-k(C, N·R_struct) ∪ I_win, C = Σ_g C_g, N the tokens of the pass.
  const int64_t N = static_cast<int64_t>(c_.positions.size());
  std::vector<float> c(N, 0.0f);
  for (const auto& grp : c_.per_group)
    for (int64_t j = 0; j < N; ++j) c[j] += grp[j];
  std::vector<int64_t> all(N);
  for (int64_t j = 0; j < N; ++j) all[j] = j;
  std::vector<int64_t> idx = TopIndexes(c, all, RateCount(N, o_.r_struct));
  for (int64_t j = std::max<int64_t>(0, N - o_.w); j < N; ++j) idx.push_back(j);  // I_win
  std::sort(idx.begin(), idx.end());
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
  structural_.clear();
  for (int64_t j : idx) structural_.push_back(c_.positions[j]);
}

Result<TokenScores> StructKvPolicy::Scores(int layer) const {
  KVTIER_RETURN_IF_ERROR(CheckLayer(layer, "Scores"));
  const LayerState& L = layers_[layer];
  TokenScores out;
  out.positions = L.positions;
  out.per_head.resize(g_.kv_heads);
  for (int grp = 0; grp < g_.kv_heads; ++grp)
    out.per_head[grp] = c_.per_group.empty()
                            ? std::vector<float>(L.positions.size(), 0.0f)
                            : RemapByPosition(c_.positions, c_.per_group[grp], L.positions, 0.0f);
  return out;
}

Result<TokenScores> StructKvPolicy::LocalSaliency(int layer) const {
  KVTIER_RETURN_IF_ERROR(CheckLayer(layer, "LocalSaliency"));
  const LayerState& L = layers_[layer];
  return TokenScores{L.positions, L.saliency};
}

Result<StructKvLayerMetrics> StructKvPolicy::Metrics(int layer) const {
  if (!begun_) return FailedPrecondition("structkv: Metrics before Begin");
  if (layer < 0 || layer >= static_cast<int>(metrics_.size()))
    return FailedPrecondition("structkv: no metrics for layer " + std::to_string(layer) +
                              " in the current pass (have layers 0.." + std::to_string(metrics_.size()) +
                              ")");
  return metrics_[layer];
}

Result<KeepSet> StructKvPolicy::Keep(int layer, int64_t budget) {
  KVTIER_RETURN_IF_ERROR(CheckLayer(layer, "Keep"));
  if (budget < 0) return InvalidArgument("structkv: budget must be >= 0, got " + std::to_string(budget));
  LayerState& L = layers_[layer];
  const int64_t n = static_cast<int64_t>(L.positions.size());
  // The paper's S^(l) = Σ_g S_g (Eq. 2).
  std::vector<float> s(n, 0.0f);
  for (const auto& grp : L.saliency)
    for (int64_t j = 0; j < n; ++j) s[j] += grp[j];
  // I_win (the last w keys) is protected like the local window.
  PolicyGeometry g2 = g_;
  g2.local_tokens = std::max<int64_t>(g_.local_tokens, o_.w);
  int64_t b = budget;
  if (o_.budget_from_ratio) {
    // Eq. 13: |top-k(S^(l), N·R_KV) ∪ I_win ∪ protected|, with N = n, the layer's keys.
    const std::vector<int64_t> prot = ProtectedIndexes(g2, L.positions);
    std::vector<char> is_prot(n, 0);
    for (int64_t i : prot) is_prot[i] = 1;
    std::vector<int64_t> all(n);
    for (int64_t j = 0; j < n; ++j) all[j] = j;
    int64_t size = static_cast<int64_t>(prot.size());
    for (int64_t i : TopIndexes(s, all, RateCount(n, o_.r_kv)))
      if (!is_prot[i]) ++size;
    b = std::min(budget, size);
  }
  auto kept = KeepTopWithProtected(g2, L.positions, s, b);
  if (!kept.ok())
    return InvalidArgument("structkv layer " + std::to_string(layer) + ": " + kept.status().message() +
                           " (the local window counts the w=" + std::to_string(o_.w) + " window I_win)");
  KeepSet out;
  out.per_head.assign(g_.kv_heads, *kept);
  out.structural = structural_;

  // Forget the layer's state outside the keep set ...
  const std::vector<int64_t>& keep = *kept;
  for (auto& grp : L.saliency) grp = RemapByPosition(L.positions, grp, keep, 0.0f);
  L.positions = keep;
  // ... and, once the pivot has frozen C, C outside every layer's remaining keys. (Before the
  // pivot C is still being accumulated by this pass, whose positions are bounded by the cache.)
  if (pivot_ >= 0) {
    std::vector<int64_t> live;
    for (const auto& other : layers_)
      if (other.observed) live = UnionPositions(live, other.positions);
    const std::vector<int64_t> pos = IntersectPositions(c_.positions, live);
    for (auto& grp : c_.per_group) grp = RemapByPosition(c_.positions, grp, pos, 0.0f);
    c_.positions = pos;
  }
  return out;
}

size_t StructKvPolicy::state_bytes() const {
  auto centrality_bytes = [](const Centrality& c) {
    size_t b = c.positions.capacity() * sizeof(int64_t);
    for (const auto& v : c.per_group) b += v.capacity() * sizeof(float);
    return b;
  };
  size_t b = centrality_bytes(c_);
  for (const auto& s : snapshots_) b += centrality_bytes(s);
  for (const auto& L : layers_) {
    b += L.positions.capacity() * sizeof(int64_t);
    for (const auto& v : L.saliency) b += v.capacity() * sizeof(float);
  }
  b += metrics_.capacity() * sizeof(StructKvLayerMetrics) + transition_.capacity() * sizeof(double) +
       structural_.capacity() * sizeof(int64_t);
  return b;
}

// ---- factory -------------------------------------------------------------------------

namespace policies {

Result<std::unique_ptr<ScoringPolicy>> MakeStructKv(const FactorySpec& fs, const std::string& spec) {
  StructKvOptions o;
  const char* known = "w, lambda, r_struct, r_kv, w1, w2, w3, topk, layer_limit, budget_from_ratio";
  for (const auto& [key, value] : fs.params) {
    if (key == "w") {
      KVTIER_ASSIGN_OR_RETURN(o.w, ParseSpecInt(spec, key, value));
    } else if (key == "layer_limit") {
      KVTIER_ASSIGN_OR_RETURN(o.layer_limit, ParseSpecInt(spec, key, value));
    } else if (key == "budget_from_ratio") {
      if (value != "0" && value != "1")
        return InvalidArgument("bad value '" + value + "' for key 'budget_from_ratio' in policy spec '" +
                               spec + "' (expected 0 or 1)");
      o.budget_from_ratio = value == "1";
    } else {
      double* target = key == "lambda"     ? &o.lambda
                       : key == "r_struct" ? &o.r_struct
                       : key == "r_kv"     ? &o.r_kv
                       : key == "w1"       ? &o.w1
                       : key == "w2"       ? &o.w2
                       : key == "w3"       ? &o.w3
                       : key == "topk"     ? &o.topk
                                           : nullptr;
      if (target == nullptr) return UnknownKey(fs, spec, key, known);
      KVTIER_ASSIGN_OR_RETURN(*target, ParseSpecDouble(spec, key, value));
    }
  }
  if (Status st = o.Validate(); !st.ok())
    return InvalidArgument("policy spec '" + spec + "': " + st.message());
  return std::unique_ptr<ScoringPolicy>(std::make_unique<StructKvPolicy>(o));
}

PolicyInfo StructKvInfo() {
  const StructKvOptions d;
  return PolicyInfo{
      "structkv",
      "global in-degree centrality C accumulated over layers up to a detected pivot layer; keeps the top "
      "local "
      "saliency S per layer (I_KV) and exposes the structural set I_struct = top-k(C) for propagation",
      "shared/papers/structkv-global-centrality-pivot.txt, Sec. 3.2-3.4 (Eq. 2-13), Algorithm 1, Sec. 4.1",
      {
          {"w", std::to_string(d.w),
           "observation window (queries pooled, Eq. 2) and the recent window I_win"},
          {"lambda", FormatSpecDouble(d.lambda), "layer decay of the global centrality (Eq. 3), in (0, 1]"},
          {"r_struct", FormatSpecDouble(d.r_struct), "structural retention rate R_struct (Eq. 10)"},
          {"r_kv", FormatSpecDouble(d.r_kv),
           "storage retention rate R_KV (Eq. 13), used when budget_from_ratio=1"},
          {"w1", FormatSpecDouble(d.w1), "weight of the entropy drop in the transition score (Eq. 8)"},
          {"w2", FormatSpecDouble(d.w2), "weight of the sparsity rise (Eq. 8)"},
          {"w3", FormatSpecDouble(d.w3), "weight of the variance rise (Eq. 8)"},
          {"topk", FormatSpecDouble(d.topk), "fraction of keys whose attention mass is the sparsity (Eq. 5)"},
          {"layer_limit", std::to_string(d.layer_limit),
           "deepest layer the pivot may be (Algorithm 1 line 8); -1 = the last layer"},
          {"budget_from_ratio", d.budget_from_ratio ? "1" : "0",
           "0: Keep keeps exactly min(budget, n); 1: Keep keeps I_KV of Eq. 13 (N·R_KV), capped by budget"},
      }};
}

}  // namespace policies
}  // namespace kvtier
