// Budget allocators: how many chunks each layer may retrieve in one step.
//
// Per step the caller calls BeginStep(L, k) once, then Allocate(layer, scores) for layers
// 0, 1, ..., L-1 in that order (shallow -> deep, the order of transformer computation), each with
// the cosine scores (Eq. 10) of the layer's n available chunks. Allocate returns how many of
// them (the best by score) the layer may take, and rank() says which score "best" means: the
// order the layer takes them in. Allocators are pluggable by factory string:
//
//   topk                          fixed k per layer, clamped to n; the index's top k by logit.
//   entropy[:min=M,rank=cosine|logit]
//                                 ActQKV's dynamic KV cut-off (Sec. 4.2, Eq. 11-12, Algorithm 1);
//                                 M (default 1) is the minimum per layer that has chunks; rank
//                                 (default cosine) is the order a layer takes its B^l chunks in.
//
// rank lives here, not in the index spec, because it is part of the allocation: Algorithm 1
// takes "the top B^l chunks by s_i" (Eq. 10 cosines, rank=cosine); rank=logit takes them by the
// raw probe.key inner product instead, which keeps key norms (docs/retrieval.md). Either way the
// budget B^l comes from the cosines. It applies to every index kind alike, and only where the
// allocator scores every chunk: topk has no choice (it asks the index for its top k by logit),
// so topk accepts rank=logit and refuses rank=cosine.
//
// ToString() gives the canonical string with every parameter ("entropy:min=1,rank=cosine"); it
// rebuilds an identical allocator (minus running state).
//
// Protocol errors (returned by Allocate, never thrown): Allocate before any BeginStep, for a
// layer other than the next one, or after the last layer -> FailedPrecondition; BeginStep with
// layers < 1 or k < 1 (or k < min for entropy) -> every Allocate of that step returns
// InvalidArgument naming the argument; n < 0, or scores null with n > 0 (entropy), or a
// non-finite score (entropy) -> InvalidArgument. Not thread-safe: one allocator per sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/entropy_grant.h"
#include "store/status.h"

namespace kvtier {

struct LayerScores {
  const float* scores;
  int n;
};  // cosine scores s_i^l (Eq. 10) of the n available chunks of layer l

/// The order a layer takes its chunks in: by the Eq. 10 cosine (ActQKV Algorithm 1) or by the
/// raw probe.key inner product, the attention logit (InfLLM's score).
enum class ChunkRank { kCosine, kLogit };
const char* ChunkRankName(ChunkRank r);  ///< "cosine" | "logit"

class BudgetAllocator {
 public:
  virtual ~BudgetAllocator();
  /// Called once per step before layer 0, with k = chunks per layer, L = layers.
  virtual void BeginStep(int layers, int k) = 0;
  /// Layers are served shallow -> deep (0..L-1). Returns how many chunks layer `layer` may take,
  /// in [min(1, n), n]; the sum over layers never exceeds L*k.
  virtual Result<int> Allocate(int layer, const LayerScores& s) = 0;
  virtual std::string ToString() const = 0;
  /// Θ (Eq. 11) the last Allocate computed, or 0 for allocators that do not compute it.
  virtual double last_entropy() const { return 0.0; }
  /// Whether Allocate reads every chunk's score (entropy: Eq. 10-12 over the whole cache). When
  /// false (topk) the caller may let the index serve its top k without scoring every chunk.
  virtual bool reads_scores() const = 0;
  /// The order the layer takes the chunks Allocate grants it in (the "rank" key).
  virtual ChunkRank rank() const = 0;
  /// The most that Allocate(layer, n chunks) can grant in the current state (n itself when
  /// the step protocol is off: Allocate then reports the error). A backend that must start
  /// its top-k before the budget is known (the device selection of retrieval/device_scorer.h
  /// fetches the best MaxTake rows in the same synchronisation as Theta) sizes it with this.
  virtual int MaxTake(int layer, int n) const = 0;
  /// Allocate for a layer whose Eq. 11 entropy `theta` of its n cosines was computed
  /// elsewhere (on the scores' device, by kernels::SegmentEntropy, the twin of what Allocate
  /// computes): the same grant and bookkeeping as Allocate with those scores. InvalidArgument
  /// for a theta that is not finite or is negative; FailedPrecondition from allocators that
  /// read no scores (topk).
  virtual Result<int> AllocateWithEntropy(int layer, int n, double theta);
  /// What Allocate (topk) or AllocateWithEntropy(layer, n, theta) (entropy) would grant layer
  /// `layer` now, without granting it: no state changes. n itself when the step protocol is off
  /// (the grant then reports the error). A caller that already holds a choice (the Retriever
  /// reusing a layer's last selection) asks first whether the choice is long enough.
  virtual int WouldTake(int layer, int n, double theta) const = 0;
  /// A layer granted elsewhere (a session's device lane runs kernels/cpu/entropy_grant.h's flow
  /// on the device): the step protocol moves past it as Allocate would have.
  void MarkServed(int layer) { next_layer_ = layer + 1; }
  /// The running state a device grant continues from and hands back (entropy: its
  /// EntropyGrantState, whose arrays hold the layers of the current step; null for allocators
  /// without state, topk).
  virtual kernels::EntropyGrantState* grant_state() { return nullptr; }

 protected:
  BudgetAllocator() = default;
  /// Shared step protocol: BeginStepCommon records (layers, k) and checks them;
  /// CheckAllocate enforces the order and the basic argument checks.
  void BeginStepCommon(int layers, int k);
  Status CheckAllocate(int layer, const LayerScores& s, bool need_scores) const;

  bool begun_ = false;
  Status step_error_;  // non-OK when BeginStep got bad arguments
  int layers_ = 0;
  int k_ = 0;
  int next_layer_ = 0;  // the layer Allocate expects next
};

/// "topk": every layer takes min(k, n). Scores are not read (may be null).
class TopKBudget final : public BudgetAllocator {
 public:
  void BeginStep(int layers, int k) override;
  Result<int> Allocate(int layer, const LayerScores& s) override;
  std::string ToString() const override { return "topk"; }
  bool reads_scores() const override { return false; }
  ChunkRank rank() const override { return ChunkRank::kLogit; }
  int MaxTake(int layer, int n) const override;
  int WouldTake(int layer, int n, double theta) const override;
};

struct EntropyBudgetOptions {
  /// Minimum chunks for a layer that has chunks ("min", default 1; >= 1). A layer with n < min
  /// gets n; BeginStep's k must be >= min.
  int min_chunks = 1;
  /// The order a layer takes its B^l chunks in ("rank", default cosine: Algorithm 1).
  ChunkRank rank = ChunkRank::kCosine;
  Status Validate() const;
};

/// "entropy": ActQKV's dynamic KV cut-off (Eq. 11-12, Algorithm 1), served shallow -> deep.
///
/// BeginStep: B_kv = L * k (int64).
/// Allocate(l, s), with n chunks:
///   - n == 0: returns 0; no entropy is recorded (neither for this step nor the running mean).
///   - Theta^l = SoftmaxEntropy(s) (Eq. 11, nats).
///   - Theta-bar^j for every deeper layer j > l: the running mean of Theta^j over previous steps
///     (cumulative mean over every step in which layer j had chunks). A layer j never seen yet
///     uses the mean of the Theta values of this step so far (layers 0..l that had chunks,
///     Theta^l included); for the very first layer of the first step that is Theta^l itself.
///   - Eq. 12: B^l = Theta^l / (Theta^l + sum_{j>l} Theta-bar^j) * B_kv. If that denominator is
///     0 (every entropy 0, e.g. all layers have one chunk), the remaining budget is split evenly
///     over the remaining layers: B^l = B_kv / (L - l). The last layer gets B^l = B_kv.
///   - Rounding: floor, with a relative tolerance of 1e-9 (floor(B^l * (1 + 1e-9))) so that a
///     product that is an integer in exact arithmetic is not lost to rounding. The fraction left
///     over stays in B_kv and so is handed to the deeper layers.
///   - Clamp: to [min(M, n), min(n, B_kv - M * (L - 1 - l))], M = min_chunks. The upper bound
///     reserves M for every deeper layer (we cannot know which deeper layers will have chunks, so
///     all are reserved); by induction B_kv >= M * (L - l) at layer l, hence the bounds never
///     cross, every layer with chunks gets >= min(M, n), and the last layer gets at most what is
///     left.
///   - B_kv -= what the layer actually took (Algorithm 1's update): budget a layer could not use
///     (too few chunks) goes to the deeper layers. Sum over the step <= L * k.
///   - After the layer is processed, Theta^l enters layer l's running mean.
/// BeginStep with a different L than the previous step forgets the running means.
/// The arithmetic is kernels/cpu/entropy_grant.h's (the twin of the device grant): this class
/// holds its running state in a kernels::EntropyGrantState, its vectors backing the arrays.
class EntropyBudget final : public BudgetAllocator {
 public:
  static Result<std::unique_ptr<EntropyBudget>> Make(const EntropyBudgetOptions& o = {});
  // The state points into this object's vectors: a copy would share them.
  EntropyBudget(const EntropyBudget&) = delete;
  EntropyBudget& operator=(const EntropyBudget&) = delete;
  void BeginStep(int layers, int k) override;
  Result<int> Allocate(int layer, const LayerScores& s) override;
  std::string ToString() const override;

  /// Theta-bar^layer: the running mean of Eq. 11 over the steps so far; nullopt before the layer
  /// was ever allocated with chunks (or out of range).
  std::optional<double> MeanEntropy(int layer) const;
  /// B_kv: budget left in the current step.
  int64_t remaining() const { return state_.remaining; }
  double last_entropy() const override { return state_.last_theta; }
  bool reads_scores() const override { return true; }
  ChunkRank rank() const override { return opt_.rank; }
  /// min(n, B_kv - M * (deeper layers)): the clamp's upper bound below.
  int MaxTake(int layer, int n) const override;
  Result<int> AllocateWithEntropy(int layer, int n, double theta) override;
  int WouldTake(int layer, int n, double theta) const override;
  /// Forgets the running means (new sequence).
  void Reset();
  kernels::EntropyGrantState* grant_state() override { return begun_ ? &state_ : nullptr; }
  const EntropyBudgetOptions& options() const { return opt_; }

 private:
  explicit EntropyBudget(const EntropyBudgetOptions& o) : opt_(o) { state_.min_chunks = o.min_chunks; }
  // Eq. 12 and the bookkeeping for a layer with n > 0 chunks of entropy theta (Eq. 11):
  // kernels::EntropyGrantTake; Internal when the bookkeeping broke (the clamp's bounds cross).
  Result<int> Grant(int layer, int n, double theta);
  EntropyBudgetOptions opt_;
  // B_kv, the step's Theta sum and count, the last Theta; theta_sum / theta_count point at
  // theta_sum_ / theta_count_ (L entries each once a step has begun, else null).
  kernels::EntropyGrantState state_;
  std::vector<double> theta_sum_;     // [L] over previous steps
  std::vector<int64_t> theta_count_;  // [L]
};

/// Builds an allocator from its factory string; unknown names, unknown or duplicate keys,
/// malformed items and bad values are InvalidArgument naming them.
Result<std::unique_ptr<BudgetAllocator>> MakeBudgetAllocator(const std::string& spec);

/// Eq. 11: entropy of softmax(s) in nats, computed stably (subtract the max), in fp64:
/// Theta = log Z - sum_i p_i (s_i - max), Z = sum_i exp(s_i - max). 0 when n <= 0 (or s null).
/// Scores must be finite (the entropy allocator checks).
double SoftmaxEntropy(const float* s, int n);
/// The error the entropy path's Θ is certified within (issue 47, docs/retrieval.md "The exactness
/// contract"), nats: a layer whose screened cosines leave a larger SoftmaxEntropyErrorBound has
/// more of them rescored exactly (ChunkIndex::RefineForEntropy) before the grant.
inline constexpr double kEntropyErrorTarget = 1e-3;
/// A certified bound on |SoftmaxEntropy(x) - SoftmaxEntropy(s)| for every x with
/// |x_i - s_i| <= error[i] (error[i] = 0: s_i is exact), the double evaluation of both included;
/// proof in docs/retrieval.md. With p = softmax(s), d_i = s_i - sum_j p_j s_j, up(e) >= e^e,
/// W = sum_j p_j e^{-e_j} and
///   m = (sum_j p_j up(e_j) e_j + sum_j p_j (up(e_j) - 1) |d_j|) / W
/// (a bound on how far the p-mean of x moves from that of s), the bound is the sum of
///   c_i = p_i up(e_i) / W * (|d_i| + e_i + m) * e_i,
/// inflated by 1e-6 relative, plus 4 (n + 16) 2^-53 (1 + log n + spread + 2 max e) nats for the
/// double rounding of the two SoftmaxEntropy evaluations (spread: max - min of s). `contribution`, when set,
/// gets c_i (n entries; 0 where error[i] = 0). +inf when a score or error is not finite, an error is
/// negative, or W underflows; 0 when n <= 0.
double SoftmaxEntropyErrorBound(const float* s, const float* error, int n,
                                std::vector<double>* contribution = nullptr);
/// Eq. 10 helper: cosine similarity of a probe and a key (0 when either norm is 0), in fp64.
float Cosine(const float* a, const float* b, int d);

}  // namespace kvtier
