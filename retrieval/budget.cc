#include "retrieval/budget.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu/entropy.h"
#include "retrieval/probe.h"  // factory-string helpers

namespace kvtier {

// ---- Eq. 10 and Eq. 11 ------------------------------------------------------------------

double SoftmaxEntropy(const float* s, int n) {
  // Eq. 11 lives in kernels/cpu/entropy (the CPU twin of the device kernel).
  return kernels::SoftmaxEntropy(s, n);
}

namespace {
// An upper bound on e^x for x >= 0: 1 + x + x^2 for x <= 1 (the series' tail past x is at most
// x^2 (e - 2) there), else exp rounded up.
double ExpUpper(double x) { return x <= 1.0 ? 1.0 + x + x * x : std::exp(x) * (1.0 + 1e-15); }
// A lower bound on e^{-x} for x >= 0: 1 - x for x <= 1/2, else exp rounded down.
double ExpNegLower(double x) { return x <= 0.5 ? 1.0 - x : std::exp(-x) * (1.0 - 1e-15); }
}  // namespace

double SoftmaxEntropyErrorBound(const float* s, const float* error, int n,
                                std::vector<double>* contribution) {
  if (contribution != nullptr) contribution->assign(static_cast<size_t>(std::max(n, 0)), 0.0);
  if (s == nullptr || error == nullptr || n <= 0) return 0.0;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double mx = -kInf;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(s[i]) || !(error[i] >= 0.0f && error[i] <= std::numeric_limits<float>::max()))
      return kInf;
    mx = std::max(mx, static_cast<double>(s[i]));
  }
  // softmax(s) and the p-mean of s, shifted by the max (no overflow).
  std::vector<double> p(static_cast<size_t>(n));
  double z = 0.0, zs = 0.0;
  for (int i = 0; i < n; ++i) {
    p[i] = std::exp(static_cast<double>(s[i]) - mx);
    z += p[i];
    zs += p[i] * (static_cast<double>(s[i]) - mx);
  }
  const double mean = zs / z + mx;
  double w = 0.0, shift = 0.0;  // W and the numerator of m
  const double inv_z = 1.0 / z;
  for (int i = 0; i < n; ++i) {
    p[i] *= inv_z;
    const double e = error[i];
    if (e == 0.0) {
      w += p[i];
      continue;
    }
    const double up = ExpUpper(e);
    w += p[i] * ExpNegLower(e);
    shift += p[i] * up * e + p[i] * (up - 1.0) * std::abs(static_cast<double>(s[i]) - mean);
  }
  if (!(w > 0.0)) return kInf;
  const double inv_w = 1.0 / w, m = shift * inv_w;
  // p[i] becomes c_i (one loop whatever `contribution` is: the same arithmetic every call).
  double bound = 0.0;
  for (int i = 0; i < n; ++i) {
    const double e = error[i];
    p[i] = e == 0.0 ? 0.0
                    : p[i] * ExpUpper(e) * inv_w * (std::abs(static_cast<double>(s[i]) - mean) + e + m) * e;
    bound += p[i];
  }
  if (contribution != nullptr) contribution->assign(p.begin(), p.end());
  // The terms above are evaluated in double: their relative error is far below 1e-6 for any n
  // below 2^30. SoftmaxEntropy of either vector is a sum of n terms in double: log Z and
  // sum p_i (s_i - max) are off by at most (n + 16) 2^-53 (1 + log n + spread) each, with the
  // spread max - min of the scores (< the screened spread + 2 max e); twice that for the two
  // evaluations, times 2 for slack.
  double lo = mx, emax = 0.0;
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, static_cast<double>(s[i]));
    emax = std::max(emax, static_cast<double>(error[i]));
  }
  const double spread = mx - lo + 2.0 * emax;
  const double rounding = 4.0 * (n + 16.0) * 0x1p-53 * (1.0 + std::log(static_cast<double>(n)) + spread);
  return bound * (1.0 + 1e-6) + rounding;
}

float Cosine(const float* a, const float* b, int d) {
  // Eq. 10: s = a . b / (|a| |b|).
  double dot = 0.0, na = 0.0, nb = 0.0;
  for (int i = 0; i < d; ++i) {
    dot += static_cast<double>(a[i]) * b[i];
    na += static_cast<double>(a[i]) * a[i];
    nb += static_cast<double>(b[i]) * b[i];
  }
  if (na == 0.0 || nb == 0.0) return 0.0f;
  return static_cast<float>(dot / (std::sqrt(na) * std::sqrt(nb)));
}

// ---- shared step protocol ------------------------------------------------------------------

BudgetAllocator::~BudgetAllocator() = default;

void BudgetAllocator::BeginStepCommon(int layers, int k) {
  begun_ = true;
  layers_ = layers;
  k_ = k;
  next_layer_ = 0;
  step_error_ = Status::Ok();
  if (layers < 1)
    step_error_ = InvalidArgument("BudgetAllocator::BeginStep: layers must be >= 1 (got " +
                                  std::to_string(layers) + ")");
  else if (k < 1)
    step_error_ =
        InvalidArgument("BudgetAllocator::BeginStep: k must be >= 1 (got " + std::to_string(k) + ")");
}

Status BudgetAllocator::CheckAllocate(int layer, const LayerScores& s, bool need_scores) const {
  if (!begun_) return FailedPrecondition("BudgetAllocator::Allocate called before BeginStep");
  KVTIER_RETURN_IF_ERROR(step_error_);
  if (next_layer_ >= layers_)
    return FailedPrecondition("BudgetAllocator::Allocate: all " + std::to_string(layers_) +
                              " layers of this step are served; call BeginStep (got layer " +
                              std::to_string(layer) + ")");
  if (layer != next_layer_)
    return FailedPrecondition(
        "BudgetAllocator::Allocate: layers are served in order 0..L-1; expected layer " +
        std::to_string(next_layer_) + ", got " + std::to_string(layer));
  if (s.n < 0)
    return InvalidArgument("BudgetAllocator::Allocate: n must be >= 0 (got " + std::to_string(s.n) + ")");
  if (need_scores && s.n > 0) {
    if (s.scores == nullptr)
      return InvalidArgument("BudgetAllocator::Allocate: scores must not be null when n > 0");
    for (int i = 0; i < s.n; ++i)
      if (!std::isfinite(s.scores[i]))
        return InvalidArgument("BudgetAllocator::Allocate: score " + std::to_string(i) + " of layer " +
                               std::to_string(layer) + " is not finite");
  }
  return Status::Ok();
}

Result<int> BudgetAllocator::AllocateWithEntropy(int layer, int n, double theta) {
  (void)n;
  (void)theta;
  return FailedPrecondition("budget allocator '" + ToString() + "' takes no Eq. 11 entropy (layer " +
                            std::to_string(layer) + ")");
}

// ---- topk --------------------------------------------------------------------------------

void TopKBudget::BeginStep(int layers, int k) { BeginStepCommon(layers, k); }

Result<int> TopKBudget::Allocate(int layer, const LayerScores& s) {
  KVTIER_RETURN_IF_ERROR(CheckAllocate(layer, s, /*need_scores=*/false));
  ++next_layer_;
  return std::min(k_, s.n);
}

int TopKBudget::MaxTake(int layer, int n) const {
  (void)layer;
  if (!begun_ || !step_error_.ok()) return std::max(0, n);
  return std::max(0, std::min(k_, n));
}

int TopKBudget::WouldTake(int layer, int n, double theta) const {
  (void)theta;
  return MaxTake(layer, n);
}

// ---- entropy -------------------------------------------------------------------------------

Status EntropyBudgetOptions::Validate() const {
  if (min_chunks < 1)
    return InvalidArgument("EntropyBudgetOptions.min_chunks ('min') must be >= 1 (got " +
                           std::to_string(min_chunks) + ")");
  return Status::Ok();
}

Result<std::unique_ptr<EntropyBudget>> EntropyBudget::Make(const EntropyBudgetOptions& o) {
  KVTIER_RETURN_IF_ERROR(o.Validate());
  return std::unique_ptr<EntropyBudget>(new EntropyBudget(o));
}

std::string EntropyBudget::ToString() const {
  return "entropy:min=" + std::to_string(opt_.min_chunks) + ",rank=" + ChunkRankName(opt_.rank);
}

void EntropyBudget::Reset() {
  std::fill(theta_sum_.begin(), theta_sum_.end(), 0.0);
  std::fill(theta_count_.begin(), theta_count_.end(), 0);
}

std::optional<double> EntropyBudget::MeanEntropy(int layer) const {
  if (layer < 0 || static_cast<size_t>(layer) >= theta_count_.size() || theta_count_[layer] == 0)
    return std::nullopt;
  return theta_sum_[layer] / static_cast<double>(theta_count_[layer]);
}

void EntropyBudget::BeginStep(int layers, int k) {
  BeginStepCommon(layers, k);
  if (step_error_.ok() && k < opt_.min_chunks)
    step_error_ =
        InvalidArgument("EntropyBudget::BeginStep: k (" + std::to_string(k) + ") must be >= min (" +
                        std::to_string(opt_.min_chunks) + ") so that every layer can get its minimum");
  if (!step_error_.ok()) return;
  if (theta_count_.size() != static_cast<size_t>(layers)) {  // a different model: start over
    theta_sum_.assign(layers, 0.0);
    theta_count_.assign(layers, 0);
    state_.theta_sum = theta_sum_.data();
    state_.theta_count = theta_count_.data();
  }
  state_.layers = layers;
  kernels::EntropyGrantBeginStep(&state_, k);  // B_kv = L x k (Algorithm 1)
}

Result<int> EntropyBudget::Allocate(int layer, const LayerScores& s) {
  KVTIER_RETURN_IF_ERROR(CheckAllocate(layer, s, /*need_scores=*/true));
  ++next_layer_;
  if (s.n == 0) return 0;  // nothing to take; no entropy recorded
  // Eq. 11: information density of this layer's similarity distribution.
  return Grant(layer, s.n, SoftmaxEntropy(s.scores, s.n));
}

Result<int> EntropyBudget::AllocateWithEntropy(int layer, int n, double theta) {
  KVTIER_RETURN_IF_ERROR(CheckAllocate(layer, LayerScores{nullptr, n}, /*need_scores=*/false));
  if (n > 0 && !(std::isfinite(theta) && theta >= 0.0))
    return InvalidArgument("EntropyBudget::AllocateWithEntropy: the entropy of layer " +
                           std::to_string(layer) + " must be finite and >= 0 (got " + std::to_string(theta) +
                           ")");
  ++next_layer_;
  if (n == 0) return 0;  // nothing to take; no entropy recorded
  return Grant(layer, n, theta);
}

int EntropyBudget::MaxTake(int layer, int n) const {
  if (!begun_ || !step_error_.ok() || layer < 0 || layer >= layers_) return std::max(0, n);
  const int64_t reserve = static_cast<int64_t>(opt_.min_chunks) * (layers_ - 1 - layer);
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, state_.remaining - reserve)));
}

int EntropyBudget::WouldTake(int layer, int n, double theta) const {
  if (!begun_ || !step_error_.ok() || layer != next_layer_ || n <= 0 || !std::isfinite(theta) || theta < 0.0)
    return std::max(0, n);
  const int64_t take = kernels::EntropyGrantShare(state_, layer, n, theta);  // ActQKV Eq. 12
  return take < 0 ? std::max(0, n) : static_cast<int>(take);
}

Result<int> EntropyBudget::Grant(int layer, int n, double theta) {
  // ActQKV Eq. 12 and Algorithm 1's bookkeeping: kernels/cpu/entropy_grant.h.
  const int64_t take = kernels::EntropyGrantTake(&state_, layer, n, theta);
  if (take < 0)
    return Internal("EntropyBudget: budget bookkeeping broke (B_kv " + std::to_string(state_.remaining) +
                    ")");
  return static_cast<int>(take);
}

// ---- factory ---------------------------------------------------------------------------------

const char* ChunkRankName(ChunkRank r) { return r == ChunkRank::kLogit ? "logit" : "cosine"; }

Result<std::unique_ptr<BudgetAllocator>> MakeBudgetAllocator(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "budget allocator"));
  auto unknown_key = [&](const std::string& key, const char* known) {
    return InvalidArgument("unknown key '" + key + "' for budget allocator '" + fs.name + "' in spec '" +
                           spec + "' (known: " + known + ")");
  };
  auto parse_rank = [&](const std::string& value) -> Result<ChunkRank> {
    if (value == "cosine") return ChunkRank::kCosine;
    if (value == "logit") return ChunkRank::kLogit;
    return InvalidArgument("bad value '" + value + "' for key 'rank' in budget allocator spec '" + spec +
                           "' (expected cosine or logit)");
  };
  if (fs.name == "topk") {
    for (const auto& [key, value] : fs.params) {
      if (key != "rank") return unknown_key(key, "rank");
      KVTIER_ASSIGN_OR_RETURN(ChunkRank r, parse_rank(value));
      if (r != ChunkRank::kLogit)
        return InvalidArgument(
            "rank=" + value + " in budget allocator spec '" + spec +
            "': topk takes the index's top k by logit; ranking by cosine needs an allocator "
            "that scores every chunk (entropy)");
    }
    return std::unique_ptr<BudgetAllocator>(new TopKBudget());
  }
  if (fs.name == "entropy") {
    EntropyBudgetOptions o;
    for (const auto& [key, value] : fs.params) {
      if (key == "min") {
        KVTIER_ASSIGN_OR_RETURN(o.min_chunks, ParseSpecInt(spec, key, value));
      } else if (key == "rank") {
        KVTIER_ASSIGN_OR_RETURN(o.rank, parse_rank(value));
      } else {
        return unknown_key(key, "min, rank");
      }
    }
    if (Status st = o.Validate(); !st.ok())
      return InvalidArgument("bad value for key 'min' in budget allocator spec '" + spec +
                             "': " + st.message());
    KVTIER_ASSIGN_OR_RETURN(auto b, EntropyBudget::Make(o));
    return std::unique_ptr<BudgetAllocator>(std::move(b));
  }
  return InvalidArgument("unknown budget allocator '" + fs.name + "' in spec '" + spec +
                         "' (known: topk, entropy)");
}

}  // namespace kvtier
