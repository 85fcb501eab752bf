// StructKV (shared/papers/structkv-global-centrality-pivot.txt): global in-degree centrality
// accumulated over layers, dynamic pivot-layer detection, and decoupled structural / storage sets.
//
// Per observed layer l (the observation window: its last w queries, or all of them when it has
// fewer; the 1/w of Eq. 2 and 4 is then 1/that count):
//   S^(l)_j  local saliency, Eq. 2: Σ_g (1/w) Σ_t Σ_{h∈H_g} a^(l,h)_{t,j}. Kept per kv group g
//            (S_g); the paper's S^(l) is their sum over groups.
//   C        global centrality, Eq. 3, realised online as Algorithm 1 line 6, C ← λ·C + S^(l) layer
//            by layer, which after layer L* equals Σ_{l=0}^{L*} λ^(L*−l)·S^(l) exactly. Kept per kv
//            group too (C_g, with Σ_g C_g = C by linearity).
//   H_l, ρ_l, V_l   entropy, top-k mass and variance of the window's attention rows, Eq. 4–6.
//   T_l      transition score from the min-max normalised first differences, Eq. 7–8.
// Pivot, Eq. 9: L* = argmax_l T_l + 1. Eq. 7 normalises over layers, so the argmax can only be
// taken once every candidate layer has been seen: it is taken when layer L_lim is observed, with
// L_lim = layer_limit (the "pre-set limit" of Algorithm 1 line 8; -1 = the last layer) and l in
// [1, L_lim] (ΔM_l needs layer l−1); L* is capped at L_lim. The running C is snapshotted after
// every layer up to L_lim, so C at L* (Eq. 3 at L*) is exact even though L* is only known at L_lim.
// Then I_struct = top-k(C, ⌊N·R_struct⌋) ∪ I_win (Eq. 10), N the tokens of the pass.
//
// A pass is one forward pass: Observe(layer 0) starts one (and drops the previous pass's C, pivot
// and I_struct), and layers must then be observed in order 0, 1, 2, ...
//
// Keep(layer, budget) is the storage set of Eq. 13, I_KV = top-k(S^(l), N·R_KV) ∪ I_win, plus the
// PolicyGeometry sinks and local window, the same set for every kv head (Eq. 2 sums the groups):
//   - budget_from_ratio=0 (default): the caller's budget replaces N·R_KV; exactly min(budget, n)
//     keys per head: sinks, local window and I_win, then the highest S^(l).
//   - budget_from_ratio=1: the paper's N·R_KV decides (n = the layer's cached keys) and `budget`
//     only caps it: min(budget, |I_KV ∪ protected|) keys, which may be FEWER than the budget.
// KeepSet::structural is I_struct once the pivot of the current pass has been detected (empty
// before). Scores(layer) returns C (per kv group, C_g) on the layer's keys, so AggregateToChunks
// gives the paper's block score S_block = Σ_{t∈block} C[t] (Sec. 4.1); before the pivot it is the
// running C. LocalSaliency(layer) gives S^(l).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "offload/policy/scoring_policy.h"

namespace kvtier {

struct StructKvOptions {
  int w = 8;                            ///< observation / local window (Sec. 4.1)
  double lambda = 0.9;                  ///< layer decay λ of Eq. 3, in (0, 1]
  double r_struct = 0.2;                ///< structural retention rate R_struct of Eq. 10
  double r_kv = 0.1;                    ///< storage retention rate R_KV of Eq. 13
  double w1 = 0.2, w2 = 0.3, w3 = 0.5;  ///< transition weights of Eq. 8
  double topk = 0.1;                    ///< k = topk·N keys for the sparsity ρ of Eq. 5
  int layer_limit = -1;                 ///< L_lim of Algorithm 1 line 8; -1 = the last layer
  bool budget_from_ratio = false;       ///< see the header comment
  Status Validate() const;
  /// "structkv:w=8,lambda=0.9,..." with every parameter.
  std::string ToString() const;
};

/// Eq. 4–6 for one layer.
struct StructKvLayerMetrics {
  double entropy = 0.0;   ///< H_l
  double sparsity = 0.0;  ///< ρ_l
  double variance = 0.0;  ///< V_l
};

class StructKvPolicy final : public ScoringPolicy {
 public:
  explicit StructKvPolicy(const StructKvOptions& o) : o_(o) {}

  std::string name() const override { return "structkv"; }
  std::string ToString() const override { return o_.ToString(); }
  Status Begin(const PolicyGeometry& g) override;
  Status Observe(const AttentionObservation& obs) override;
  Result<TokenScores> Scores(int layer) const override;
  Result<KeepSet> Keep(int layer, int64_t budget) override;
  size_t state_bytes() const override;

  const StructKvOptions& options() const { return o_; }
  /// L* of the current pass (Eq. 9), or -1 while it is not detected yet.
  int pivot_layer() const { return pivot_; }
  /// I_struct of the current pass (Eq. 10), positions increasing; empty before the pivot.
  const std::vector<int64_t>& structural() const { return structural_; }
  /// H_l, ρ_l, V_l of a layer of the current pass, up to L_lim. FailedPrecondition if not seen.
  Result<StructKvLayerMetrics> Metrics(int layer) const;
  /// T_l of Eq. 8 for l = 0..L_lim of the current pass (T_0 = 0, undefined in the paper);
  /// empty before the pivot.
  const std::vector<double>& transition_scores() const { return transition_; }
  /// S^(l) of Eq. 2 on the layer's latest observation: one row per kv group (S_g), whose sum
  /// over rows is the paper's S^(l).
  Result<TokenScores> LocalSaliency(int layer) const;

 private:
  struct LayerState {
    bool observed = false;
    std::vector<int64_t> positions;
    std::vector<std::vector<float>> saliency;  // [kv_heads][n]: S_g of Eq. 2
  };
  struct Centrality {
    std::vector<int64_t> positions;
    std::vector<std::vector<float>> per_group;  // [kv_heads][positions]: C_g
  };
  Status CheckLayer(int layer, const char* what) const;
  void DetectPivot(int limit);
  int LayerLimit() const;

  StructKvOptions o_;
  PolicyGeometry g_;
  bool begun_ = false;
  std::vector<LayerState> layers_;
  // The current pass.
  int next_layer_ = 0;                         // the layer Observe expects next (0 also restarts)
  Centrality c_;                               // running C before the pivot, C at L* after
  std::vector<Centrality> snapshots_;          // C after each layer 0..l, until the pivot
  std::vector<StructKvLayerMetrics> metrics_;  // Eq. 4–6 of layers 0..l (up to L_lim)
  std::vector<double> transition_;
  std::vector<int64_t> structural_;
  int pivot_ = -1;
};

}  // namespace kvtier
