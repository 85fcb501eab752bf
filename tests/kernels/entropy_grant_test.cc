// ActQKV Eq. 12 / Algorithm 1 as a scalar flow (kernels/cpu/entropy_grant.h) and on the device
// (kernels/cuda/grant.cu, LaunchEntropyGrant).
//
// The twin is checked against a reference written here (Eq. 12 as a plain function over its own
// vectors, in the operation order the twin documents) and against EntropyBudget, which holds
// its state in the twin's struct: grants, B_kv and the running means equal bit for bit. The
// device tests ("cuda" in their names; skipped with "no CUDA device: ..." without one) run the
// same flows with the state in device memory and compare with the twin.
#include "kernels/cpu/entropy_grant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "retrieval/budget.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier {
namespace {

using kernels::EntropyGrantParams;
using kernels::EntropyGrantState;
using kernels::KernelError;

uint32_t FreshSeed() { return std::random_device{}(); }

// Eq. 12 written out again (the reference the twin must equal): Theta-bar^j = sum / count of
// deeper layers seen, else the mean of this step's Theta so far (this layer's included);
// B^l = Theta / (Theta + sum Theta-bar) * B_kv (even split when 0, all for the last layer);
// floor with a 1e-9 relative tolerance; clamp to [min(M, n), min(n, B_kv - M (L - 1 - l))].
struct ReferenceBudget {
  int layers, min_chunks;
  int64_t remaining = 0;
  double step_sum = 0.0;
  int step_count = 0;
  std::vector<double> sum;
  std::vector<int64_t> count;

  ReferenceBudget(int l, int m) : layers(l), min_chunks(m), sum(l, 0.0), count(l, 0) {}
  void BeginStep(int k) {
    remaining = static_cast<int64_t>(layers) * k;
    step_sum = 0.0;
    step_count = 0;
  }
  // -1: the bounds crossed.
  int64_t Take(int layer, int n, double theta) {
    if (n == 0) return 0;
    const double step_mean = (step_sum + theta) / (step_count + 1);
    double deeper = 0.0;
    for (int j = layer + 1; j < layers; ++j)
      deeper += count[j] > 0 ? sum[j] / static_cast<double>(count[j]) : step_mean;
    const double b = static_cast<double>(remaining);
    const double share = layer == layers - 1    ? b
                         : theta + deeper > 0.0 ? theta / (theta + deeper) * b
                                                : b / static_cast<double>(layers - layer);
    const auto rounded = static_cast<int64_t>(std::floor(share * (1.0 + 1e-9)));
    const int64_t hi =
        std::min<int64_t>(n, remaining - static_cast<int64_t>(min_chunks) * (layers - 1 - layer));
    const int64_t lo = std::min(min_chunks, n);
    if (hi < lo) return -1;
    const int64_t take = std::clamp(rounded, lo, hi);
    step_sum += theta;
    ++step_count;
    remaining -= take;
    sum[layer] += theta;
    ++count[layer];
    return take;
  }
};

// A twin state over vectors it owns.
struct HostState {
  EntropyGrantState s;
  std::vector<double> sum;
  std::vector<int64_t> count;
  HostState(int layers, int min_chunks) : sum(layers, 0.0), count(layers, 0) {
    s.layers = layers;
    s.min_chunks = min_chunks;
    s.theta_sum = sum.data();
    s.theta_count = count.data();
  }
};

// Random thetas, 0 and extremes included; n from 0 to well past k.
double DrawTheta(std::mt19937& rng) {
  switch (std::uniform_int_distribution<int>(0, 9)(rng)) {
    case 0:
      return 0.0;
    case 1:
      return 1e300;
    case 2:
      return std::numeric_limits<double>::max();
    case 3:
      return 1e-300;
    default:
      return std::uniform_real_distribution<double>(0.0, 9.0)(rng);
  }
}
int DrawCount(std::mt19937& rng, int k) {
  switch (std::uniform_int_distribution<int>(0, 4)(rng)) {
    case 0:
      return 0;
    case 1:
      return std::uniform_int_distribution<int>(1, 3)(rng);
    default:
      return std::uniform_int_distribution<int>(1, 4 * k + 8)(rng);
  }
}

bool SameBits(double a, double b) { return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b); }

// One random trial's shape.
struct Trial {
  int layers, min_chunks, k, steps;
};
Trial DrawTrial(std::mt19937& rng) {
  Trial t;
  t.layers = std::uniform_int_distribution<int>(1, 40)(rng);
  t.min_chunks = std::uniform_int_distribution<int>(1, 4)(rng);
  t.k = t.min_chunks + std::uniform_int_distribution<int>(0, 12)(rng);
  t.steps = std::uniform_int_distribution<int>(1, 12)(rng);
  return t;
}

TEST(EntropyGrant, TwinEqualsTheReferenceAndEntropyBudgetBitForBit) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  int64_t grants = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const Trial t = DrawTrial(rng);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": L " + std::to_string(t.layers) + ", M " +
                 std::to_string(t.min_chunks) + ", k " + std::to_string(t.k));
    ReferenceBudget ref(t.layers, t.min_chunks);
    HostState twin(t.layers, t.min_chunks);
    HostState stepped(t.layers, t.min_chunks);  // through EntropyGrantStep's params
    auto budget = EntropyBudget::Make(EntropyBudgetOptions{.min_chunks = t.min_chunks});
    ASSERT_TRUE(budget.ok());
    EntropyBudget& b = **budget;
    for (int step = 0; step < t.steps; ++step) {
      ref.BeginStep(t.k);
      kernels::EntropyGrantBeginStep(&twin.s, t.k);
      kernels::EntropyGrantBeginStep(&stepped.s, t.k);
      b.BeginStep(t.layers, t.k);
      for (int l = 0; l < t.layers; ++l) {
        const int n = DrawCount(rng, t.k);
        const double theta = DrawTheta(rng);
        SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(l) + " n " +
                     std::to_string(n) + " theta " + std::to_string(theta));
        const int64_t want = ref.Take(l, n, theta);
        ASSERT_GE(want, 0);
        EXPECT_EQ(kernels::EntropyGrantShare(twin.s, l, n, theta), n == 0 ? 0 : want);
        EXPECT_EQ(kernels::EntropyGrantTake(&twin.s, l, n, theta), want);
        const int32_t n32 = n;
        int32_t take = -7, error = 0;
        EntropyGrantParams p{.state = &stepped.s,
                             .layer = l,
                             .n = &n32,
                             .theta = &theta,
                             .cap = std::numeric_limits<int>::max(),
                             .take = &take,
                             .error = &error};
        ASSERT_EQ(kernels::EntropyGrantStep(p), KernelError::kOk);
        EXPECT_EQ(take, want);
        EXPECT_EQ(error, kernels::kEntropyGrantOk);
        auto got = b.AllocateWithEntropy(l, n, theta);
        ASSERT_TRUE(got.ok()) << got.status().message();
        EXPECT_EQ(*got, want);
        EXPECT_EQ(twin.s.remaining, ref.remaining);
        EXPECT_EQ(stepped.s.remaining, ref.remaining);
        EXPECT_EQ(b.remaining(), ref.remaining);
        ++grants;
      }
      for (int l = 0; l < t.layers; ++l) {
        EXPECT_EQ(twin.count[l], ref.count[l]);
        EXPECT_TRUE(SameBits(twin.sum[l], ref.sum[l])) << "layer " << l;
        EXPECT_EQ(stepped.count[l], ref.count[l]);
        EXPECT_TRUE(SameBits(stepped.sum[l], ref.sum[l])) << "layer " << l;
        const std::optional<double> mean = b.MeanEntropy(l);
        ASSERT_EQ(mean.has_value(), ref.count[l] > 0) << "layer " << l;
        if (mean) {
          EXPECT_TRUE(SameBits(*mean, ref.sum[l] / static_cast<double>(ref.count[l]))) << "layer " << l;
        }
      }
      EXPECT_TRUE(SameBits(twin.s.step_theta_sum, ref.step_sum));
      EXPECT_EQ(twin.s.step_theta_count, ref.step_count);
    }
  }
  EXPECT_GT(grants, 1000);
}

// t / (t + b) * B with t = 1, b = 5/3, B = 8 is 3 in exact arithmetic and 2.9999999999999996
// in double: the 1e-9 tolerance of the rounding keeps it 3 (a plain floor would grant 2).
TEST(EntropyGrant, ToleranceKeepsAShareThatIsAnIntegerInExactArithmetic) {
  const double deep = 5.0 / 3.0;
  ASSERT_LT(1.0 / (1.0 + deep) * 8.0, 3.0);  // the double product falls short of 3
  HostState st(/*layers=*/2, /*min_chunks=*/1);
  st.sum[1] = deep;
  st.count[1] = 1;
  kernels::EntropyGrantBeginStep(&st.s, /*k=*/4);
  EXPECT_EQ(kernels::EntropyGrantShare(st.s, 0, 100, 1.0), 3);

  // The same through EntropyBudget: step 1 makes Theta-bar^1 = 5/3, step 2 grants layer 0.
  auto budget = EntropyBudget::Make();
  ASSERT_TRUE(budget.ok());
  EntropyBudget& b = **budget;
  b.BeginStep(2, 4);
  ASSERT_TRUE(b.AllocateWithEntropy(0, 100, 2.0).ok());
  ASSERT_TRUE(b.AllocateWithEntropy(1, 100, deep).ok());
  b.BeginStep(2, 4);
  auto take = b.AllocateWithEntropy(0, 100, 1.0);
  ASSERT_TRUE(take.ok());
  EXPECT_EQ(*take, 3);
  EXPECT_EQ(b.remaining(), 5);
}

TEST(EntropyGrant, HostChecksOfTheParams) {
  HostState st(2, 1);
  const int32_t n = 3;
  const double theta = 1.0;
  int32_t take = 0;
  const EntropyGrantParams ok{.state = &st.s, .layer = 0, .n = &n, .theta = &theta, .cap = 8, .take = &take};
  EntropyGrantParams p = ok;
  p.cap = -1;
  EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kBadShape);
  p = ok;
  p.layer = -1;
  EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kBadShape);
  p = ok;
  p.fixed_k = -2;
  EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kBadShape);
  p = ok;
  p.take = nullptr;
  EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kNullPointer);
  p = ok;
  p.n = nullptr;
  EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kNullPointer);
  p = ok;
  p.state = nullptr;
  EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kNullPointer);
  p.fixed_k = 2;  // topk reads no state and no theta
  p.theta = nullptr;
  EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kOk);
  EXPECT_EQ(take, 2);
}

// ---- the flow on each backend: the twin (cpu) and the launcher (cuda) ---------------------

enum class Backend { kCpu, kCuda };

// One layer's inputs, as host values.
struct GrantCall {
  int layer = 0;
  int32_t n = 0;
  double theta = 0.0;
  int32_t non_finite = -1;  // < 0: no count passed (null pointer)
  int cap = 1 << 20;
  int fixed_k = 0;
};
struct GrantOut {
  int32_t take = -1;
  int32_t error = -1;
};

// A state of L layers on one backend; the host copy is what Snapshot returns.
class GrantRig {
 public:
  GrantRig(Backend backend, int layers, int min_chunks) : backend_(backend), host_(layers, min_chunks) {
#if KVTIER_HAVE_CUDA
    if (backend_ == Backend::kCuda) {
      d_sum_ = Alloc<double>(layers);
      d_count_ = Alloc<int64_t>(layers);
      d_state_ = Alloc<EntropyGrantState>(1);
      d_n_ = Alloc<int32_t>(1);
      d_theta_ = Alloc<double>(1);
      d_non_finite_ = Alloc<int32_t>(1);
      d_take_ = Alloc<int32_t>(1);
      d_error_ = Alloc<int32_t>(1);
      Upload();
    }
#endif
  }
  ~GrantRig() {
#if KVTIER_HAVE_CUDA
    for (void* p : allocs_) cudaFree(p);
#endif
  }
  GrantRig(const GrantRig&) = delete;
  GrantRig& operator=(const GrantRig&) = delete;

  /// The host copy of the state: edit it, then Upload() (the cuda rig copies it to the device).
  HostState& host() { return host_; }
#if KVTIER_HAVE_CUDA
  /// The cuda rig's state in device memory (its arrays too).
  EntropyGrantState* device_state() { return d_state_; }
#endif
  void Upload() {
#if KVTIER_HAVE_CUDA
    if (backend_ != Backend::kCuda) return;
    EntropyGrantState d = host_.s;
    d.theta_sum = d_sum_;
    d.theta_count = d_count_;
    Put(d_state_, &d, 1);
    Put(d_sum_, host_.sum.data(), host_.sum.size());
    Put(d_count_, host_.count.data(), host_.count.size());
#endif
  }
  /// The backend's state, into host().
  void Download() {
#if KVTIER_HAVE_CUDA
    if (backend_ != Backend::kCuda) return;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    double* sum = host_.s.theta_sum;
    int64_t* count = host_.s.theta_count;
    Get(&host_.s, d_state_, 1);
    host_.s.theta_sum = sum;
    host_.s.theta_count = count;
    Get(host_.sum.data(), d_sum_, host_.sum.size());
    Get(host_.count.data(), d_count_, host_.count.size());
#endif
  }

  void BeginStep(int k) {
    if (backend_ == Backend::kCpu) {
      kernels::EntropyGrantBeginStep(&host_.s, k);
      return;
    }
#if KVTIER_HAVE_CUDA
    ASSERT_EQ(kernels::cuda::LaunchEntropyGrantBeginStep(d_state_, k, nullptr), KernelError::kOk);
    Download();
#endif
  }

  /// One grant; `error_before` is what *error holds before the call. The state is downloaded.
  GrantOut Grant(const GrantCall& c, int32_t error_before = 0) {
    GrantOut out;
    out.error = error_before;
    if (backend_ == Backend::kCpu) {
      EntropyGrantParams p{.state = &host_.s,
                           .layer = c.layer,
                           .n = &c.n,
                           .theta = &c.theta,
                           .non_finite = c.non_finite < 0 ? nullptr : &c.non_finite,
                           .cap = c.cap,
                           .fixed_k = c.fixed_k,
                           .take = &out.take,
                           .error = &out.error};
      EXPECT_EQ(kernels::EntropyGrantStep(p), KernelError::kOk);
      return out;
    }
#if KVTIER_HAVE_CUDA
    Put(d_n_, &c.n, 1);
    Put(d_theta_, &c.theta, 1);
    Put(d_non_finite_, &c.non_finite, 1);
    Put(d_take_, &out.take, 1);
    Put(d_error_, &out.error, 1);
    EntropyGrantParams p{.state = d_state_,
                         .layer = c.layer,
                         .n = d_n_,
                         .theta = d_theta_,
                         .non_finite = c.non_finite < 0 ? nullptr : d_non_finite_,
                         .cap = c.cap,
                         .fixed_k = c.fixed_k,
                         .take = d_take_,
                         .error = d_error_};
    EXPECT_EQ(kernels::cuda::LaunchEntropyGrant(p, nullptr), KernelError::kOk);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "kernel failed";
    Get(&out.take, d_take_, 1);
    Get(&out.error, d_error_, 1);
    Download();
#endif
    return out;
  }

 private:
#if KVTIER_HAVE_CUDA
  template <class T>
  T* Alloc(size_t n) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << n * sizeof(T) << " bytes failed";
      return nullptr;
    }
    allocs_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  void Put(T* d, const T* h, size_t n) {
    EXPECT_EQ(cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  template <class T>
  void Get(T* h, const T* d, size_t n) {
    EXPECT_EQ(cudaMemcpy(h, d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  std::vector<void*> allocs_;
  EntropyGrantState* d_state_ = nullptr;
  double* d_sum_ = nullptr;
  int64_t* d_count_ = nullptr;
  int32_t* d_n_ = nullptr;
  double* d_theta_ = nullptr;
  int32_t* d_non_finite_ = nullptr;
  int32_t* d_take_ = nullptr;
  int32_t* d_error_ = nullptr;
#endif
  Backend backend_;
  HostState host_;
};

// The whole state, compared bit for bit.
::testing::AssertionResult SameState(const HostState& a, const HostState& b) {
  if (a.s.layers != b.s.layers || a.s.min_chunks != b.s.min_chunks || a.s.remaining != b.s.remaining ||
      !SameBits(a.s.step_theta_sum, b.s.step_theta_sum) || a.s.step_theta_count != b.s.step_theta_count ||
      !SameBits(a.s.last_theta, b.s.last_theta))
    return ::testing::AssertionFailure()
           << "scalars differ: remaining " << a.s.remaining << " vs " << b.s.remaining << ", step sum "
           << a.s.step_theta_sum << " vs " << b.s.step_theta_sum << ", step count " << a.s.step_theta_count
           << " vs " << b.s.step_theta_count;
  for (size_t l = 0; l < a.sum.size(); ++l)
    if (!SameBits(a.sum[l], b.sum[l]) || a.count[l] != b.count[l])
      return ::testing::AssertionFailure() << "layer " << l << ": sum " << a.sum[l] << " vs " << b.sum[l]
                                           << ", count " << a.count[l] << " vs " << b.count[l];
  return ::testing::AssertionSuccess();
}

class EntropyGrantFlow : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam() != Backend::kCuda) return;
#if !KVTIER_HAVE_CUDA
    GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off or nvcc not found)";
#else
    if (kernels::cuda::DeviceCount() == 0)
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount found none ("
                   << kernels::cuda::LastCudaErrorString() << ")";
#endif
  }
  Backend backend() const { return GetParam(); }
};

// Random steps, one grant at a time, against the twin on host memory (on cpu: itself, which
// the reference test above pins; on cuda: the launcher against the twin).
TEST_P(EntropyGrantFlow, RandomStepsEqualTheTwin) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 12; ++trial) {
    const Trial t = DrawTrial(rng);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": L " + std::to_string(t.layers) + ", M " +
                 std::to_string(t.min_chunks) + ", k " + std::to_string(t.k));
    GrantRig rig(backend(), t.layers, t.min_chunks);
    HostState twin(t.layers, t.min_chunks);
    for (int step = 0; step < std::min(t.steps, 4); ++step) {
      rig.BeginStep(t.k);
      kernels::EntropyGrantBeginStep(&twin.s, t.k);
      ASSERT_TRUE(SameState(rig.host(), twin));
      for (int l = 0; l < t.layers; ++l) {
        GrantCall c{.layer = l, .n = DrawCount(rng, t.k), .theta = DrawTheta(rng), .non_finite = 0};
        c.cap = std::uniform_int_distribution<int>(0, 2 * t.k)(rng);
        SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(l));
        const GrantOut got = rig.Grant(c);
        const int64_t want = kernels::EntropyGrantTake(&twin.s, l, c.n, c.theta);
        ASSERT_GE(want, 0);
        EXPECT_EQ(got.take, std::min<int64_t>(want, c.cap));
        EXPECT_EQ(got.error, kernels::kEntropyGrantOk);
        ASSERT_TRUE(SameState(rig.host(), twin));
      }
    }
  }
}

TEST_P(EntropyGrantFlow, EmptyLayerTakesNothingAndLeavesTheStateUntouched) {
  GrantRig rig(backend(), 3, 1);
  rig.BeginStep(4);
  const HostState before = [&] {
    HostState h(3, 1);
    h.s.remaining = rig.host().s.remaining;
    return h;
  }();
  // n == 0 with a NaN theta (SegmentEntropy writes 0 for an empty segment; any value is ignored).
  const GrantOut out = rig.Grant({.layer = 0, .n = 0, .theta = std::nan(""), .non_finite = 0});
  EXPECT_EQ(out.take, 0);
  EXPECT_EQ(out.error, kernels::kEntropyGrantOk);
  EXPECT_TRUE(SameState(rig.host(), before));
  EXPECT_EQ(rig.host().s.remaining, 12);
}

TEST_P(EntropyGrantFlow, FailuresWriteTheirCodeTakeNothingAndLeaveTheState) {
  GrantRig rig(backend(), 3, 1);
  rig.BeginStep(4);
  HostState before(3, 1);
  before.s.remaining = 12;
  struct Case {
    const char* what;
    GrantCall call;
    int32_t code;
  };
  const Case cases[] = {
      {"NaN theta", {.n = 5, .theta = std::nan("")}, kernels::kEntropyGrantBadTheta},
      {"infinite theta",
       {.n = 5, .theta = std::numeric_limits<double>::infinity()},
       kernels::kEntropyGrantBadTheta},
      {"negative theta", {.n = 5, .theta = -0.5}, kernels::kEntropyGrantBadTheta},
      {"non-finite scores", {.n = 5, .theta = 1.0, .non_finite = 2}, kernels::kEntropyGrantNonFiniteScores},
      {"negative n", {.n = -1, .theta = 1.0}, kernels::kEntropyGrantBadArgument},
      {"layer past L", {.layer = 3, .n = 5, .theta = 1.0}, kernels::kEntropyGrantBadArgument},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const GrantOut out = rig.Grant(c.call);
    EXPECT_EQ(out.take, 0);
    EXPECT_EQ(out.error, c.code);
    EXPECT_TRUE(SameState(rig.host(), before));
  }
  // *error keeps the first failure: a later failure or success does not overwrite it.
  EXPECT_EQ(rig.Grant({.n = 5, .theta = -1.0}, kernels::kEntropyGrantNonFiniteScores).error,
            kernels::kEntropyGrantNonFiniteScores);
  const GrantOut ok = rig.Grant({.n = 5, .theta = 1.0, .non_finite = 0}, kernels::kEntropyGrantBadTheta);
  EXPECT_EQ(ok.error, kernels::kEntropyGrantBadTheta);
  EXPECT_GT(ok.take, 0);

  // Bounds that cross: B_kv below M for each remaining layer (a k < M step).
  GrantRig crossed(backend(), 3, 2);
  crossed.BeginStep(1);  // B_kv = 3 < M * L = 6
  const GrantOut out = crossed.Grant({.n = 5, .theta = 1.0});
  EXPECT_EQ(out.take, 0);
  EXPECT_EQ(out.error, kernels::kEntropyGrantBoundsCross);
  EXPECT_EQ(crossed.host().s.remaining, 3);
  EXPECT_EQ(crossed.host().s.step_theta_count, 0);
  EXPECT_EQ(crossed.host().count[0], 0);
}

TEST_P(EntropyGrantFlow, CapClampsTheTakeButTheStateIsChargedTheGrant) {
  // L = 1: the only layer is the last and is granted everything left, min(n, B_kv) = 6.
  GrantRig rig(backend(), 1, 1);
  rig.BeginStep(6);
  const GrantOut out = rig.Grant({.n = 50, .theta = 2.0, .cap = 4});
  EXPECT_EQ(out.take, 4);
  EXPECT_EQ(out.error, kernels::kEntropyGrantOk);
  EXPECT_EQ(rig.host().s.remaining, 0);  // as EntropyBudget: the whole grant is charged
  EXPECT_EQ(rig.host().count[0], 1);
  EXPECT_EQ(rig.host().s.last_theta, 2.0);
  // cap 0 takes nothing.
  rig.BeginStep(6);
  EXPECT_EQ(rig.Grant({.n = 50, .theta = 2.0, .cap = 0}).take, 0);
}

TEST_P(EntropyGrantFlow, FixedKTakesMinOfKNAndCapAndLeavesTheState) {
  GrantRig rig(backend(), 2, 1);
  rig.BeginStep(3);
  HostState before(2, 1);
  before.s.remaining = 6;
  EXPECT_EQ(rig.Grant({.n = 10, .theta = std::nan(""), .cap = 100, .fixed_k = 5}).take, 5);
  EXPECT_EQ(rig.Grant({.n = 2, .cap = 100, .fixed_k = 5}).take, 2);
  EXPECT_EQ(rig.Grant({.n = 10, .cap = 3, .fixed_k = 5}).take, 3);
  EXPECT_EQ(rig.Grant({.n = 0, .cap = 3, .fixed_k = 5}).take, 0);
  const GrantOut bad = rig.Grant({.n = -4, .cap = 3, .fixed_k = 5});
  EXPECT_EQ(bad.take, 0);
  EXPECT_EQ(bad.error, kernels::kEntropyGrantBadArgument);
  EXPECT_TRUE(SameState(rig.host(), before));
}

INSTANTIATE_TEST_SUITE_P(Backends, EntropyGrantFlow, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& i) {
                           return std::string(i.param == Backend::kCuda ? "cuda" : "cpu");
                         });

// A decode step as the device runs it: every layer's n and Theta in device arrays (as
// SegmentEntropy leaves them), L grants enqueued back to back with no host wait between them,
// one synchronisation at the end; grants and state equal the twin's.
TEST(EntropyGrantDevice, StepOfQueuedGrantsEqualsTheTwin) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off or nvcc not found)";
#else
  if (kernels::cuda::DeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount found none (" << kernels::cuda::LastCudaErrorString()
                 << ")";
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 8; ++trial) {
    const Trial t = DrawTrial(rng);
    const int L = t.layers;
    SCOPED_TRACE("trial " + std::to_string(trial) + ": L " + std::to_string(L));
    GrantRig rig(Backend::kCuda, L, t.min_chunks);  // holds the state on the device
    HostState twin(L, t.min_chunks);
    int32_t *d_n = nullptr, *d_non_finite = nullptr, *d_take = nullptr, *d_error = nullptr;
    double* d_theta = nullptr;
    ASSERT_EQ(cudaMalloc(&d_n, L * sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_non_finite, L * sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_take, L * sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_error, sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_theta, L * sizeof(double)), cudaSuccess);
    std::vector<int32_t> n(L), non_finite(L, 0), take(L);
    std::vector<double> theta(L);
    for (int step = 0; step < t.steps; ++step) {
      for (int l = 0; l < L; ++l) {
        n[l] = DrawCount(rng, t.k);
        theta[l] = DrawTheta(rng);
      }
      const int cap = std::uniform_int_distribution<int>(1, 2 * t.k)(rng);
      const int32_t zero = 0;
      ASSERT_EQ(cudaMemcpy(d_n, n.data(), L * sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_non_finite, non_finite.data(), L * sizeof(int32_t), cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_theta, theta.data(), L * sizeof(double), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_error, &zero, sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(kernels::cuda::LaunchEntropyGrantBeginStep(rig.device_state(), t.k, nullptr),
                KernelError::kOk);
      for (int l = 0; l < L; ++l) {
        const EntropyGrantParams p{.state = rig.device_state(),
                                   .layer = l,
                                   .n = d_n + l,
                                   .theta = d_theta + l,
                                   .non_finite = d_non_finite + l,
                                   .cap = cap,
                                   .take = d_take + l,
                                   .error = d_error};
        ASSERT_EQ(kernels::cuda::LaunchEntropyGrant(p, nullptr), KernelError::kOk);
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      int32_t error = -1;
      ASSERT_EQ(cudaMemcpy(take.data(), d_take, L * sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&error, d_error, sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(error, kernels::kEntropyGrantOk);
      kernels::EntropyGrantBeginStep(&twin.s, t.k);
      for (int l = 0; l < L; ++l) {
        const int64_t want = kernels::EntropyGrantTake(&twin.s, l, n[l], theta[l]);
        EXPECT_EQ(take[l], std::min<int64_t>(want, cap)) << "step " << step << " layer " << l;
      }
      rig.Download();
      ASSERT_TRUE(SameState(rig.host(), twin)) << "step " << step;
    }
    cudaFree(d_n);
    cudaFree(d_non_finite);
    cudaFree(d_take);
    cudaFree(d_error);
    cudaFree(d_theta);
  }
#endif
}

}  // namespace
}  // namespace kvtier
