// One harness for every kernel on every backend present (ggml's test-backend-ops idea).
//
// Backend "cpu" is always present: there each CPU twin is checked against an independent
// reference written here (a plain double-precision formula over gathered inputs), so the twins
// that define the kernels' meaning are themselves tested. Backend "cuda" runs the launchers of
// kernels/cuda on a device and compares each with its CPU twin; it skips with "no CUDA device:
// ..." in builds without CUDA or when cudaGetDeviceCount finds none. Nothing under "cuda" has
// ever run: no session of this project has had a GPU when it was written (docs/gpu.md).
//
// Every test draws fresh random inputs (the seed is printed on failure), poisons every output
// with NaN before the run, and fails on any NaN left. Tolerances, as the largest absolute error
// over the largest reference magnitude of an output: fp32 1e-5, f16 2e-3, bf16 1e-2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/entropy.h"
#include "kernels/cpu/forward.h"
#include "kernels/cpu/probe.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/slot_attention.h"
#include "kernels/cuda/store_convert.h"
#include "kernels/dtype.h"
#include "retrieval/probe.h"
#include "store/geometry.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "tests/device_test_util.h"
#endif

namespace kvtier::kernels {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum class Backend { kCpu, kCuda };

double Tolerance(DType t) { return t == DType::kF32 ? 1e-5 : (t == DType::kF16 ? 2e-3 : 1e-2); }

uint32_t FreshSeed() { return std::random_device{}(); }

// Largest |got - want| over the largest |want| (1 when want is all zeros); NaN in got fails.
template <class T>
::testing::AssertionResult Close(const std::vector<T>& got, const std::vector<double>& want, double tol,
                                 const char* what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  double err = 0.0, mag = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return ::testing::AssertionFailure() << what << ": NaN at " << i;
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i])
        return ::testing::AssertionFailure() << what << ": " << got[i] << " vs " << want[i] << " at " << i;
      continue;
    }
    mag = std::max(mag, std::fabs(want[i]));
    const double e = std::fabs(got[i] - want[i]);
    if (e > err) err = e, worst = i;
  }
  const double rel = err / (mag > 0.0 ? mag : 1.0);
  if (rel <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": relative error " << rel << " > " << tol << " at "
                                       << worst << " (" << got[worst] << " vs " << want[worst] << ")";
}

// Close, where element i may also be off by tol x scale[i] (the magnitude its rounding comes
// from, e.g. the sum of a dot's |terms|, when that is larger than the output's).
::testing::AssertionResult CloseToScale(const std::vector<float>& got, const std::vector<double>& want,
                                        const std::vector<double>& scale, double tol, const char* what) {
  if (got.size() != want.size() || scale.size() != want.size())
    return ::testing::AssertionFailure() << what << ": size mismatch";
  double mag = 0.0;
  for (double w : want)
    if (std::isfinite(w)) mag = std::max(mag, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return ::testing::AssertionFailure() << what << ": NaN at " << i;
    const double allowed = tol * std::max({mag, scale[i], 1e-30});
    if (std::fabs(got[i] - want[i]) > allowed)
      return ::testing::AssertionFailure()
             << what << ": error " << std::fabs(got[i] - want[i]) << " > " << allowed << " at " << i << " ("
             << got[i] << " vs " << want[i] << ")";
  }
  return ::testing::AssertionSuccess();
}

std::vector<double> ToDouble(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

#if KVTIER_HAVE_CUDA
// The shared device arena (tests/device_test_util.h) with this harness's two extras.
class DeviceArena : public device_test::DeviceArena {
 public:
  // A SlotAttention workspace as a caller makes one: allocated, its bytes garbage (0xff: NaN
  // partials, counters that are not zero), then its arrival counters cleared once.
  void* AttentionWorkspace(size_t bytes) {
    if (bytes == 0) return nullptr;
    char* ws = Zeros<char>(bytes);
    if (ws == nullptr) return nullptr;
    EXPECT_EQ(cudaMemset(ws, 0xff, bytes), cudaSuccess);
    EXPECT_EQ(cuda::ClearSlotAttentionWorkspace(ws, bytes, nullptr), KernelError::kOk);
    return ws;
  }
  // host = d[0, host->size()) once every kernel launched so far finished.
  template <class T>
  void Get(std::vector<T>* host, const T* d) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "kernel failed";
    EXPECT_EQ(cudaMemcpy(host->data(), d, host->size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
};
#endif

class KernelBackends : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam() != Backend::kCuda) return;
#if !KVTIER_HAVE_CUDA
    GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off or nvcc not found)";
#else
    if (cuda::DeviceCount() == 0)
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount found none (" << cuda::LastCudaErrorString() << ")";
#endif
  }
  bool cuda() const { return GetParam() == Backend::kCuda; }
  const uint32_t seed_ = FreshSeed();  // declared before rng_: initialised first
  std::mt19937 rng_{seed_};
};

// ---- attention over (dense | slot list) ----------------------------------------------------

struct AttnShape {
  int q_heads, kv_heads, head_dim;
  DType dt;
  int m;        // queries
  int n_slots;  // selected chunks
  bool ragged;  // slots partly filled
  bool causal;
  bool mass;
  int slot_tokens = 16;   // tokens per slot
  int n_local = 16;       // local window tokens (two runs: a wrapped ring)
  bool misalign = false;  // the device copy of dense[0] starts one element past 16-byte alignment
};

std::string Name(const AttnShape& s) {
  return std::to_string(s.q_heads) + "q/" + std::to_string(s.kv_heads) + "kv d" + std::to_string(s.head_dim) +
         " " + DTypeName(s.dt) + " m" + std::to_string(s.m) + " slots" + std::to_string(s.n_slots) +
         (s.ragged ? " ragged" : "") + (s.causal ? " causal" : "") + (s.mass ? " mass" : "") +
         " slot_tokens" + std::to_string(s.slot_tokens) + " local" + std::to_string(s.n_local) +
         (s.misalign ? " misaligned" : "");
}

// The inputs of one attention problem in host memory, and its plain reference.
struct AttnProblem {
  AttnShape s;
  int slot_tokens = 16, pool_slots = 0;
  std::vector<float> q;
  std::vector<int64_t> qpos;
  struct Run {
    std::vector<uint8_t> k, v;
    int n;
    int64_t pos0;
  };
  std::vector<Run> dense;               // sinks, local (two runs: a wrapped ring)
  std::vector<uint8_t> pool_k, pool_v;  // [pool_slots, slot_tokens, kv_heads, head_dim]
  std::vector<int32_t> slot_index, slot_n;
  std::vector<int64_t> slot_pos;

  size_t Row() const { return static_cast<size_t>(s.kv_heads) * s.head_dim; }

  void Fill(std::vector<uint8_t>* bytes, size_t elems, std::mt19937& rng) const {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> f(elems);
    for (float& x : f) x = nd(rng);
    bytes->resize(elems * DTypeSize(s.dt));
    FromFloat(s.dt, f.data(), bytes->data(), elems);
  }

  void Make(const AttnShape& shape, std::mt19937& rng) {
    s = shape;
    slot_tokens = s.slot_tokens;
    const int n_sink = 4, n_local_a = (s.n_local * 9 + 15) / 16, n_local_b = s.n_local - n_local_a;
    pool_slots = s.n_slots + 5;  // more slots than selected: unselected ones must not be read
    Run sinks{{}, {}, n_sink, 0};
    Fill(&sinks.k, n_sink * Row(), rng);
    Fill(&sinks.v, n_sink * Row(), rng);
    dense.push_back(std::move(sinks));
    Fill(&pool_k, static_cast<size_t>(pool_slots) * slot_tokens * Row(), rng);
    Fill(&pool_v, static_cast<size_t>(pool_slots) * slot_tokens * Row(), rng);
    // Slots in a shuffled order, chunks at increasing positions after the sinks.
    std::vector<int32_t> perm(pool_slots);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    int64_t pos = 64;
    for (int i = 0; i < s.n_slots; ++i) {
      slot_index.push_back(perm[i]);
      slot_pos.push_back(pos);
      slot_n.push_back(s.ragged ? static_cast<int32_t>(1 + rng() % slot_tokens) : slot_tokens);
      pos += slot_tokens;
    }
    // The local window as a wrapped ring: its later half first in memory.
    pos += 100;
    Run la{{}, {}, n_local_a, pos + n_local_b};
    Run lb{{}, {}, n_local_b, pos};
    Fill(&la.k, n_local_a * Row(), rng);
    Fill(&la.v, n_local_a * Row(), rng);
    Fill(&lb.k, n_local_b * Row(), rng);
    Fill(&lb.v, n_local_b * Row(), rng);
    const int64_t last = pos + n_local_a + n_local_b - 1;
    dense.push_back(std::move(la));
    dense.push_back(std::move(lb));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    q.resize(static_cast<size_t>(s.m) * s.q_heads * s.head_dim);
    for (float& x : q) x = nd(rng);
    // A window of m queries ending at the last local token: causal masking cuts the local part.
    for (int i = 0; i < s.m; ++i) qpos.push_back(last - (s.m - 1 - i));
  }

  // Params over host arrays (the CPU twin), the selected slots [s0, s1).
  SlotAttentionParams Params(int s0, int s1, std::vector<float>* out, std::vector<float>* lse,
                             std::vector<std::vector<float>>* dense_mass, std::vector<float>* slot_mass,
                             bool with_dense = true) const {
    SlotAttentionParams p;
    p.q_heads = s.q_heads;
    p.kv_heads = s.kv_heads;
    p.head_dim = s.head_dim;
    p.dtype = s.dt;
    p.causal = s.causal;
    p.n_queries = s.m;
    p.q = q.data();
    p.q_positions = qpos.data();
    p.n_dense = with_dense ? static_cast<int>(dense.size()) : 0;
    for (int i = 0; i < p.n_dense; ++i) {
      p.dense[i].k = dense[i].k.data();
      p.dense[i].v = dense[i].v.data();
      p.dense[i].n_tokens = dense[i].n;
      p.dense[i].first_position = dense[i].pos0;
      p.dense[i].mass = dense_mass ? (*dense_mass)[i].data() : nullptr;
    }
    p.pool_k = pool_k.data();
    p.pool_v = pool_v.data();
    p.pool_slots = pool_slots;
    p.slot_tokens = slot_tokens;
    p.n_slots = s1 - s0;
    p.slot_index = slot_index.data() + s0;
    p.slot_first_position = slot_pos.data() + s0;
    p.slot_n_tokens = slot_n.data() + s0;
    p.slot_mass = slot_mass ? slot_mass->data() : nullptr;
    p.out = out->data();
    p.lse = lse->data();
    return p;
  }
};

// Plain attention over the gathered keys, in double: the meaning the twin must have.
void ReferenceAttention(const AttnProblem& P, std::vector<double>* out, std::vector<double>* lse,
                        std::vector<double>* mass /* dense runs then slots, in the twin's mass layouts */) {
  const AttnShape& s = P.s;
  const int D = s.head_dim, G = s.q_heads / s.kv_heads;
  struct Key {
    std::vector<float> k, v;
    int64_t pos;
    size_t mass_at;
  };  // one kv head's row per key
  std::vector<std::vector<Key>> keys(s.kv_heads);
  size_t mass_base = 0;
  auto add = [&](const uint8_t* kb, const uint8_t* vb, int n, int64_t pos0, int stride_tokens) {
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < s.kv_heads; ++h) {
        Key key;
        key.k.resize(D);
        key.v.resize(D);
        const size_t off = (static_cast<size_t>(t) * s.kv_heads + h) * D * DTypeSize(s.dt);
        ToFloat(s.dt, kb + off, key.k.data(), D);
        ToFloat(s.dt, vb + off, key.v.data(), D);
        key.pos = pos0 + t;
        key.mass_at = mass_base + static_cast<size_t>(h) * stride_tokens + t;
        keys[h].push_back(std::move(key));
      }
    mass_base += static_cast<size_t>(s.kv_heads) * stride_tokens;
  };
  for (const auto& r : P.dense) add(r.k.data(), r.v.data(), r.n, r.pos0, r.n);
  const size_t slot_bytes = static_cast<size_t>(P.slot_tokens) * P.Row() * DTypeSize(s.dt);
  for (size_t i = 0; i < P.slot_index.size(); ++i)
    add(P.pool_k.data() + P.slot_index[i] * slot_bytes, P.pool_v.data() + P.slot_index[i] * slot_bytes,
        P.slot_n[i], P.slot_pos[i], P.slot_tokens);
  out->assign(static_cast<size_t>(s.m) * s.q_heads * D, 0.0);
  lse->assign(static_cast<size_t>(s.m) * s.q_heads, 0.0);
  mass->assign(mass_base, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int i = 0; i < s.m; ++i)
    for (int h = 0; h < s.q_heads; ++h) {
      const float* qv = P.q.data() + (static_cast<size_t>(i) * s.q_heads + h) * D;
      const auto& ks = keys[h / G];
      std::vector<double> sc(ks.size(), -std::numeric_limits<double>::infinity());
      double mx = -std::numeric_limits<double>::infinity();
      for (size_t j = 0; j < ks.size(); ++j) {
        if (s.causal && ks[j].pos > P.qpos[i]) continue;
        double d = 0.0;
        for (int e = 0; e < D; ++e) d += static_cast<double>(qv[e]) * ks[j].k[e];
        sc[j] = d * scale;
        mx = std::max(mx, sc[j]);
      }
      double z = 0.0;
      for (double x : sc) z += std::exp(x - mx);
      const double l = mx + std::log(z);
      (*lse)[static_cast<size_t>(i) * s.q_heads + h] = l;
      double* o = out->data() + (static_cast<size_t>(i) * s.q_heads + h) * D;
      for (size_t j = 0; j < ks.size(); ++j) {
        const double p = std::exp(sc[j] - l);
        for (int e = 0; e < D; ++e) o[e] += p * ks[j].v[e];
        (*mass)[ks[j].mass_at] += p;
      }
    }
}

const AttnShape kAttnShapes[] = {
    {32, 8, 128, DType::kBF16, 1, 12, true, true, false},  // Llama-3-8B decode, ragged slots
    {8, 8, 64, DType::kF16, 1, 5, false, true, true},      // MHA, mass
    {4, 2, 64, DType::kF32, 5, 7, true, true, true},       // window of 5, causal in the local part
    {8, 2, 128, DType::kF16, 3, 0, false, false, false},   // no slots, not causal
    {6, 3, 128, DType::kF32, 1, 9, true, true, true},      // GQA 2, mass
    {32, 8, 64, DType::kF16, 16, 3, true, true, true},     // a prefill window of 16 queries
    // Small head_dims: a 16-bit row of d16 is two 16-byte chunks (kernels/cuda/attention.cu).
    {8, 2, 16, DType::kF32, 1, 6, true, true, true},     // kvtier-tiny's geometry, decode, mass
    {8, 2, 16, DType::kBF16, 4, 5, false, true, false},  // kvtier-tiny, a prefill window
    {4, 4, 16, DType::kF16, 2, 0, false, false, true},   // no slots, not causal, mass
    {8, 2, 32, DType::kF16, 1, 9, true, true, true},     // d32, mass
    {4, 1, 32, DType::kBF16, 3, 4, false, true, false},  // MQA
    {4, 2, 256, DType::kF16, 1, 4, true, true, true},    // d256: 16 keys a tile
    // Edges of the CUDA kernel's tiles (kernels/cuda/attention.cu: N keys = 8 KiB of K, at most
    // 64: 32 at d128 f16/bf16 and d64 f32, 16 at d256 f16, 64 at d16 and d32 16-bit): runs and
    // slots that are not a multiple of N, causal cuts inside a tile, groups of 1 .. 16 q heads.
    {8, 1, 128, DType::kBF16, 1, 80, true, true, true, 32, 100},      // GQA 8, 64 splits, mass
    {4, 1, 256, DType::kF16, 3, 6, false, true, true, 24, 70},        // GQA 4, d256, cut in a tile
    {4, 4, 16, DType::kBF16, 2, 10, true, true, true, 16, 150},       // GQA 1, d16, local 150
    {16, 1, 64, DType::kF32, 2, 5, true, true, true, 40, 45},         // GQA 16: two blocks a kv head
    {12, 2, 32, DType::kBF16, 7, 9, true, true, false, 20, 61},       // GQA 6, a window of 7
    {8, 8, 16, DType::kF16, 128, 2, true, true, true, 16, 40},        // 1024 blocks: one split, mass
    {8, 2, 128, DType::kF16, 1, 6, true, true, true, 16, 16, true},   // rows not 16-byte aligned
    {4, 2, 64, DType::kF32, 4, 3, false, true, false, 16, 33, true},  // unaligned f32, a window
};

TEST_P(KernelBackends, SlotAttentionMatchesReference) {
  for (const AttnShape& shape : kAttnShapes) {
    SCOPED_TRACE(Name(shape) + " seed " + std::to_string(seed_));
    AttnProblem P;
    P.Make(shape, rng_);
    const size_t n_out = static_cast<size_t>(shape.m) * shape.q_heads * shape.head_dim;
    const size_t n_lse = static_cast<size_t>(shape.m) * shape.q_heads;
    std::vector<float> out(n_out, kNaN), lse(n_lse, kNaN);
    std::vector<std::vector<float>> dmass;
    for (const auto& r : P.dense)
      dmass.emplace_back(static_cast<size_t>(shape.kv_heads) * r.n, shape.mass ? 0.0f : kNaN);
    std::vector<float> smass(static_cast<size_t>(shape.n_slots) * shape.kv_heads * P.slot_tokens, 0.0f);
    SlotAttentionParams p =
        P.Params(0, shape.n_slots, &out, &lse, shape.mass ? &dmass : nullptr, shape.mass ? &smass : nullptr);
    // Mass is added to (+=): it starts at zero, and slots' unused tail stays zero.
    ASSERT_EQ(SlotAttention(p), KernelError::kOk);
    std::vector<double> ref_out, ref_lse, ref_mass;
    ReferenceAttention(P, &ref_out, &ref_lse, &ref_mass);
    const double tol = Tolerance(shape.dt);
    if (!cuda()) {
      EXPECT_TRUE(Close(out, ref_out, tol, "out"));
      EXPECT_TRUE(Close(lse, ref_lse, tol, "lse"));
      if (shape.mass) {
        std::vector<float> all;
        for (const auto& dm : dmass) all.insert(all.end(), dm.begin(), dm.end());
        all.insert(all.end(), smass.begin(), smass.end());
        EXPECT_TRUE(Close(all, ref_mass, tol, "mass"));
      }
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    SlotAttentionParams d = p;
    d.q = dev.Put(P.q);
    d.q_positions = dev.Put(P.qpos);
    std::vector<float*> d_dmass;
    for (int i = 0; i < d.n_dense; ++i) {
      d.dense[i].k = dev.Put(P.dense[i].k);
      d.dense[i].v = dev.Put(P.dense[i].v);
      if (shape.misalign && i == 0) {  // one element in front: the kernel must not use 16-byte loads
        const size_t elem = DTypeSize(shape.dt);
        std::vector<uint8_t> k(elem), v(elem);
        k.insert(k.end(), P.dense[i].k.begin(), P.dense[i].k.end());
        v.insert(v.end(), P.dense[i].v.begin(), P.dense[i].v.end());
        d.dense[i].k = dev.Put(k) + elem;
        d.dense[i].v = dev.Put(v) + elem;
      }
      d.dense[i].mass = shape.mass ? dev.Put(std::vector<float>(dmass[i].size(), 0.0f)) : nullptr;
      d_dmass.push_back(d.dense[i].mass);
    }
    d.pool_k = dev.Put(P.pool_k);
    d.pool_v = dev.Put(P.pool_v);
    d.slot_index = dev.Put(P.slot_index);
    d.slot_first_position = dev.Put(P.slot_pos);
    d.slot_n_tokens = dev.Put(P.slot_n);
    d.slot_mass = shape.mass ? dev.Put(std::vector<float>(smass.size(), 0.0f)) : nullptr;
    d.out = dev.Put(std::vector<float>(n_out, kNaN));
    d.lse = dev.Put(std::vector<float>(n_lse, kNaN));
    const size_t ws_bytes = cuda::SlotAttentionWorkspaceBytes(d);
    void* ws = dev.AttentionWorkspace(ws_bytes);
    if (ws_bytes > 0)
      EXPECT_EQ(cuda::LaunchSlotAttention(d, ws, ws_bytes - 1, nullptr), KernelError::kWorkspace);
    ASSERT_EQ(cuda::LaunchSlotAttention(d, ws, ws_bytes, nullptr), KernelError::kOk)
        << cuda::LastCudaErrorString();
    std::vector<float> g_out(n_out), g_lse(n_lse);
    dev.Get(&g_out, d.out);
    dev.Get(&g_lse, d.lse);
    EXPECT_TRUE(Close(g_out, ToDouble(out), tol, "cuda out vs twin"));
    EXPECT_TRUE(Close(g_lse, ToDouble(lse), tol, "cuda lse vs twin"));
    if (shape.mass) {
      for (int i = 0; i < d.n_dense; ++i) {
        std::vector<float> g(dmass[i].size());
        dev.Get(&g, d_dmass[i]);
        EXPECT_TRUE(Close(g, ToDouble(dmass[i]), tol, "cuda dense mass vs twin"));
      }
      std::vector<float> g(smass.size());
      dev.Get(&g, d.slot_mass);
      EXPECT_TRUE(Close(g, ToDouble(smass), tol, "cuda slot mass vs twin"));
    }
#endif
  }
}

// Split the keys in two (dense + the first slots | the other slots), merge by LSE: one pass.
TEST_P(KernelBackends, LseMergeOfSplitRangesEqualsOnePass) {
  for (const AttnShape& shape : kAttnShapes) {
    if (shape.n_slots < 2) continue;
    SCOPED_TRACE(Name(shape) + " seed " + std::to_string(seed_));
    AttnProblem P;
    P.Make(shape, rng_);
    const size_t n_out = static_cast<size_t>(shape.m) * shape.q_heads * shape.head_dim;
    const size_t n_lse = static_cast<size_t>(shape.m) * shape.q_heads;
    const int cut = shape.n_slots / 2;
    std::vector<float> all(n_out, kNaN), all_lse(n_lse, kNaN), a(n_out, kNaN), a_lse(n_lse, kNaN),
        b(n_out, kNaN), b_lse(n_lse, kNaN), merged(n_out, kNaN), merged_lse(n_lse, kNaN);
    ASSERT_EQ(SlotAttention(P.Params(0, shape.n_slots, &all, &all_lse, nullptr, nullptr)), KernelError::kOk);
    ASSERT_EQ(SlotAttention(P.Params(0, cut, &a, &a_lse, nullptr, nullptr)), KernelError::kOk);
    ASSERT_EQ(SlotAttention(P.Params(cut, shape.n_slots, &b, &b_lse, nullptr, nullptr, /*with_dense=*/false)),
              KernelError::kOk);
    const double tol = Tolerance(DType::kF32);  // the split changes only fp32 rounding, not storage
    if (!cuda()) {
      MergeAttentionStates(static_cast<int>(n_lse), shape.head_dim, a.data(), a_lse.data(), b.data(),
                           b_lse.data(), merged.data(), merged_lse.data());
      EXPECT_TRUE(Close(merged, ToDouble(all), tol, "merged out"));
      EXPECT_TRUE(Close(merged_lse, ToDouble(all_lse), tol, "merged lse"));
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    float* d_a = dev.Put(a);
    float* d_al = dev.Put(a_lse);
    float* d_m = dev.Put(merged);
    float* d_ml = dev.Put(merged_lse);
    ASSERT_EQ(cuda::LaunchMergeAttentionStates(static_cast<int>(n_lse), shape.head_dim, d_a, d_al, dev.Put(b),
                                               dev.Put(b_lse), d_m, d_ml, nullptr),
              KernelError::kOk);
    dev.Get(&merged, d_m);
    dev.Get(&merged_lse, d_ml);
    EXPECT_TRUE(Close(merged, ToDouble(all), tol, "cuda merged out"));
    EXPECT_TRUE(Close(merged_lse, ToDouble(all_lse), tol, "cuda merged lse"));
#endif
  }
}

// ---- keys rotated as they are read (InfLLM positions) --------------------------------------

// Where a rotating problem puts each part: the sinks at L0 or at their own positions, the
// chunks at L0 or at their own, the local runs at their own.
struct RopePlacement {
  bool sinks_at_l0, chunks_at_l0;
};

// L0: the local window's first position (AttnProblem puts the ring's two runs last).
int64_t LocalStart(const AttnProblem& P) { return std::min(P.dense[1].pos0, P.dense[2].pos0); }

// The twin's params for P with the rotation of `place` (host inv_freq).
SlotAttentionParams RotatingParams(const AttnProblem& P, const RopePlacement& place, const double* inv_freq,
                                   std::vector<float>* out, std::vector<float>* lse,
                                   std::vector<std::vector<float>>* dense_mass,
                                   std::vector<float>* slot_mass) {
  SlotAttentionParams p = P.Params(0, static_cast<int>(P.slot_index.size()), out, lse, dense_mass, slot_mass);
  p.rope_inv_freq = inv_freq;
  p.dense[0].rope_position = place.sinks_at_l0 ? LocalStart(P) : kRopeAtKeyPositions;
  p.slot_rope_position = place.chunks_at_l0 ? LocalStart(P) : kRopeAtKeyPositions;
  return p;
}

// What the rotation must mean: kernels::Rope on fp32 copies of the keys where `place` puts
// them (V widened, not rotated), then SlotAttention without rotation over the copies in fp32.
void RotatedReference(const AttnProblem& P, const RopePlacement& place, const double* inv_freq,
                      std::vector<float>* out, std::vector<float>* lse,
                      std::vector<std::vector<float>>* dense_mass, std::vector<float>* slot_mass) {
  const AttnShape& s = P.s;
  const size_t row = P.Row();
  const int64_t l0 = LocalStart(P);
  auto widen = [&](const std::vector<uint8_t>& src) {
    std::vector<float> f(src.size() / DTypeSize(s.dt));
    ToFloat(s.dt, src.data(), f.data(), f.size());
    return f;
  };
  auto rotate = [&](float* k, int n, int64_t pos0, bool at_l0) {
    std::vector<int64_t> pos(static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) pos[static_cast<size_t>(t)] = at_l0 ? l0 : pos0 + t;
    Rope(k, n, s.kv_heads, s.head_dim, pos.data(), inv_freq);
  };
  std::vector<std::vector<float>> dk, dv;
  for (size_t i = 0; i < P.dense.size(); ++i) {
    dk.push_back(widen(P.dense[i].k));
    dv.push_back(widen(P.dense[i].v));
    rotate(dk.back().data(), P.dense[i].n, P.dense[i].pos0, i == 0 && place.sinks_at_l0);
  }
  std::vector<float> pk = widen(P.pool_k), pv = widen(P.pool_v);
  for (size_t i = 0; i < P.slot_index.size(); ++i)
    rotate(pk.data() + static_cast<size_t>(P.slot_index[i]) * P.slot_tokens * row, P.slot_tokens,
           P.slot_pos[i], place.chunks_at_l0);
  SlotAttentionParams p = P.Params(0, static_cast<int>(P.slot_index.size()), out, lse, dense_mass, slot_mass);
  p.dtype = DType::kF32;
  for (int i = 0; i < p.n_dense; ++i) {
    p.dense[i].k = dk[static_cast<size_t>(i)].data();
    p.dense[i].v = dv[static_cast<size_t>(i)].data();
  }
  p.pool_k = pk.data();
  p.pool_v = pv.data();
  ASSERT_EQ(SlotAttention(p), KernelError::kOk);
}

const AttnShape kRopeShapes[] = {
    {32, 8, 128, DType::kBF16, 1, 12, false, true, false},            // GQA 4:1, Llama-3-8B decode
    {8, 2, 64, DType::kF16, 1, 9, true, true, true},                  // GQA 4:1, ragged slots, mass
    {4, 4, 64, DType::kF32, 5, 7, true, true, true},                  // GQA 1:1, a window, mass
    {8, 8, 16, DType::kF16, 128, 2, true, true, true, 16, 40},        // 1:1, one split: mass in the block
    {4, 1, 256, DType::kBF16, 3, 6, false, true, true, 24, 70},       // GQA 4:1, d256, many splits, mass
    {4, 4, 32, DType::kF32, 1, 5, false, true, false, 16, 33, true},  // 1:1, rows not 16-byte aligned
    {8, 2, 128, DType::kF16, 2, 4, false, true, true, 16, 16, true},  // 4:1, unaligned 16-bit, mass
};

TEST_P(KernelBackends, SlotAttentionRotatesKeysAsRopeOnFp32Copies) {
  const RopePlacement places[] = {{true, true}, {false, true}, {false, false}};
  int case_no = 0;
  for (const AttnShape& shape : kRopeShapes) {
    const RopePlacement place = places[case_no++ % 3];
    SCOPED_TRACE(Name(shape) + (place.sinks_at_l0 ? " sinks@L0" : " sinks@own") +
                 (place.chunks_at_l0 ? " chunks@L0" : " chunks@own") + " seed " + std::to_string(seed_));
    AttnProblem P;
    P.Make(shape, rng_);
    const std::vector<double> inv_freq = RopeInvFreq(shape.head_dim, 10000.0);
    const size_t n_out = static_cast<size_t>(shape.m) * shape.q_heads * shape.head_dim;
    const size_t n_lse = static_cast<size_t>(shape.m) * shape.q_heads;
    const size_t n_smass = static_cast<size_t>(shape.n_slots) * shape.kv_heads * P.slot_tokens;
    auto zero_mass = [&] {
      std::vector<std::vector<float>> m;
      for (const auto& r : P.dense) m.emplace_back(static_cast<size_t>(shape.kv_heads) * r.n, 0.0f);
      return m;
    };
    std::vector<float> out(n_out, kNaN), lse(n_lse, kNaN), smass(n_smass, 0.0f);
    std::vector<std::vector<float>> dmass = zero_mass();
    ASSERT_EQ(SlotAttention(RotatingParams(P, place, inv_freq.data(), &out, &lse,
                                           shape.mass ? &dmass : nullptr, shape.mass ? &smass : nullptr)),
              KernelError::kOk);
    if (!cuda()) {
      std::vector<float> ref(n_out, kNaN), ref_lse(n_lse, kNaN), ref_smass(n_smass, 0.0f);
      std::vector<std::vector<float>> ref_dmass = zero_mass();
      RotatedReference(P, place, inv_freq.data(), &ref, &ref_lse, shape.mass ? &ref_dmass : nullptr,
                       shape.mass ? &ref_smass : nullptr);
      EXPECT_TRUE(Close(out, ToDouble(ref), 1e-5, "out vs rope on copies"));
      EXPECT_TRUE(Close(lse, ToDouble(ref_lse), 1e-5, "lse vs rope on copies"));
      if (shape.mass) {
        for (size_t i = 0; i < dmass.size(); ++i)
          EXPECT_TRUE(Close(dmass[i], ToDouble(ref_dmass[i]), 1e-5, "dense mass vs rope on copies"));
        EXPECT_TRUE(Close(smass, ToDouble(ref_smass), 1e-5, "slot mass vs rope on copies"));
      }
      // The rotation must matter here: the keys as stored give another answer.
      std::vector<float> plain(n_out, kNaN), plain_lse(n_lse, kNaN);
      ASSERT_EQ(SlotAttention(P.Params(0, shape.n_slots, &plain, &plain_lse, nullptr, nullptr)),
                KernelError::kOk);
      EXPECT_FALSE(Close(plain, ToDouble(ref), 1e-2, "unrotated vs rotated"));
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    std::vector<float> dummy_out(n_out), dummy_lse(n_lse);
    SlotAttentionParams d = RotatingParams(P, place, nullptr, &dummy_out, &dummy_lse, nullptr, nullptr);
    d.rope_inv_freq = dev.Put(inv_freq);
    d.q = dev.Put(P.q);
    d.q_positions = dev.Put(P.qpos);
    std::vector<float*> d_dmass;
    for (int i = 0; i < d.n_dense; ++i) {
      d.dense[i].k = dev.Put(P.dense[i].k);
      d.dense[i].v = dev.Put(P.dense[i].v);
      if (shape.misalign && i == 0) {  // one element in front: no 16-byte loads
        const size_t elem = DTypeSize(shape.dt);
        std::vector<uint8_t> k(elem), v(elem);
        k.insert(k.end(), P.dense[i].k.begin(), P.dense[i].k.end());
        v.insert(v.end(), P.dense[i].v.begin(), P.dense[i].v.end());
        d.dense[i].k = dev.Put(k) + elem;
        d.dense[i].v = dev.Put(v) + elem;
      }
      d.dense[i].mass = shape.mass ? dev.Put(std::vector<float>(dmass[i].size(), 0.0f)) : nullptr;
      d_dmass.push_back(d.dense[i].mass);
    }
    d.pool_k = dev.Put(P.pool_k);
    d.pool_v = dev.Put(P.pool_v);
    d.slot_index = dev.Put(P.slot_index);
    d.slot_first_position = dev.Put(P.slot_pos);
    d.slot_n_tokens = dev.Put(P.slot_n);
    d.slot_mass = shape.mass ? dev.Put(std::vector<float>(n_smass, 0.0f)) : nullptr;
    d.out = dev.Put(std::vector<float>(n_out, kNaN));
    d.lse = dev.Put(std::vector<float>(n_lse, kNaN));
    const size_t ws_bytes = cuda::SlotAttentionWorkspaceBytes(d);
    void* ws = dev.AttentionWorkspace(ws_bytes);
    ASSERT_EQ(cuda::LaunchSlotAttention(d, ws, ws_bytes, nullptr), KernelError::kOk)
        << cuda::LastCudaErrorString();
    std::vector<float> g_out(n_out), g_lse(n_lse);
    dev.Get(&g_out, d.out);
    dev.Get(&g_lse, d.lse);
    EXPECT_TRUE(Close(g_out, ToDouble(out), 1e-4, "cuda out vs twin"));
    EXPECT_TRUE(Close(g_lse, ToDouble(lse), 1e-4, "cuda lse vs twin"));
    if (shape.mass) {
      for (int i = 0; i < d.n_dense; ++i) {
        std::vector<float> g(dmass[i].size());
        dev.Get(&g, d_dmass[i]);
        EXPECT_TRUE(Close(g, ToDouble(dmass[i]), 1e-4, "cuda dense mass vs twin"));
      }
      std::vector<float> g(n_smass);
      dev.Get(&g, d.slot_mass);
      EXPECT_TRUE(Close(g, ToDouble(smass), 1e-4, "cuda slot mass vs twin"));
    }
#endif
  }
}

// The slot count read from memory (n_slots_in_memory): a launch over a slot list of capacity 6
// whose count says c gives the bits of a launch with n_slots = c, for c = 0, 3 and 6. The entries
// past the count are valid slots of the pool: reading them would change the output. The shape
// fills the kernel's splits from the dense parts alone (4 kv heads x 64 queries: 4 splits; the
// 120-token local window has at least 4 tiles), so both launches split alike whatever the count.
TEST_P(KernelBackends, SlotCountInMemoryEqualsTheHostCount) {
  constexpr int kCapacity = 6;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (int head_dim : {64, 128}) {
      const AttnShape shape{8, 4, head_dim, dt, 64, kCapacity, true, true, true, 16, 120};
      AttnProblem P;
      P.Make(shape, rng_);
      const size_t n_out = static_cast<size_t>(shape.m) * shape.q_heads * shape.head_dim;
      const size_t n_lse = static_cast<size_t>(shape.m) * shape.q_heads;
      const size_t n_smass = static_cast<size_t>(kCapacity) * shape.kv_heads * P.slot_tokens;
      for (int32_t count : {0, 3, kCapacity}) {
        SCOPED_TRACE(Name(shape) + " count " + std::to_string(count) + " seed " + std::to_string(seed_));
        auto zero_mass = [&] {
          std::vector<std::vector<float>> m;
          for (const auto& r : P.dense) m.emplace_back(static_cast<size_t>(shape.kv_heads) * r.n, 0.0f);
          return m;
        };
        std::vector<float> out(n_out, kNaN), lse(n_lse, kNaN), smass(n_smass, 0.0f);
        std::vector<float> ref(n_out, kNaN), ref_lse(n_lse, kNaN), ref_smass(n_smass, 0.0f);
        std::vector<std::vector<float>> dmass = zero_mass(), ref_dmass = zero_mass();
        SlotAttentionParams p = P.Params(0, kCapacity, &out, &lse, &dmass, &smass);
        p.n_slots_in_memory = &count;
        const SlotAttentionParams r = P.Params(0, count, &ref, &ref_lse, &ref_dmass, &ref_smass);
        if (!cuda()) {
          ASSERT_EQ(SlotAttention(p), KernelError::kOk);
          ASSERT_EQ(SlotAttention(r), KernelError::kOk);
          EXPECT_EQ(std::memcmp(out.data(), ref.data(), n_out * sizeof(float)), 0);
          EXPECT_EQ(std::memcmp(lse.data(), ref_lse.data(), n_lse * sizeof(float)), 0);
          EXPECT_EQ(dmass, ref_dmass);
          EXPECT_EQ(smass, ref_smass);  // rows past the count stay 0 in both
          continue;
        }
#if KVTIER_HAVE_CUDA
        DeviceArena dev;
        auto on_device = [&](SlotAttentionParams d, int n_slots, const int32_t* d_count,
                             std::vector<float*>* d_dmass, float** d_smass) {
          d.q = dev.Put(P.q);
          d.q_positions = dev.Put(P.qpos);
          for (int i = 0; i < d.n_dense; ++i) {
            d.dense[i].k = dev.Put(P.dense[i].k);
            d.dense[i].v = dev.Put(P.dense[i].v);
            d.dense[i].mass = dev.Put(std::vector<float>(dmass[i].size(), 0.0f));
            d_dmass->push_back(d.dense[i].mass);
          }
          d.pool_k = dev.Put(P.pool_k);
          d.pool_v = dev.Put(P.pool_v);
          d.n_slots = n_slots;
          d.n_slots_in_memory = d_count;
          d.slot_index = dev.Put(P.slot_index);
          d.slot_first_position = dev.Put(P.slot_pos);
          d.slot_n_tokens = dev.Put(P.slot_n);
          d.slot_mass = *d_smass = dev.Put(std::vector<float>(n_smass, 0.0f));
          d.out = dev.Put(std::vector<float>(n_out, kNaN));
          d.lse = dev.Put(std::vector<float>(n_lse, kNaN));
          return d;
        };
        std::vector<float*> cap_dmass, count_dmass;
        float *cap_smass = nullptr, *count_smass = nullptr;
        const SlotAttentionParams dc = on_device(p, kCapacity, dev.Put(&count, 1), &cap_dmass, &cap_smass);
        const SlotAttentionParams dr = on_device(r, count, nullptr, &count_dmass, &count_smass);
        ASSERT_EQ(cuda::SlotAttentionSplits(dc), cuda::SlotAttentionSplits(dr));
        ASSERT_GT(cuda::SlotAttentionSplits(dc), 1);  // the merge runs: empty splits must weigh 0
        for (const SlotAttentionParams* d : {&dc, &dr}) {
          const size_t ws_bytes = cuda::SlotAttentionWorkspaceBytes(*d);
          ASSERT_EQ(cuda::LaunchSlotAttention(*d, dev.AttentionWorkspace(ws_bytes), ws_bytes, nullptr),
                    KernelError::kOk)
              << cuda::LastCudaErrorString();
        }
        std::vector<float> g_out(n_out), g_lse(n_lse), w_out(n_out), w_lse(n_lse);
        dev.Get(&g_out, dc.out);
        dev.Get(&g_lse, dc.lse);
        dev.Get(&w_out, dr.out);
        dev.Get(&w_lse, dr.lse);
        EXPECT_EQ(std::memcmp(g_out.data(), w_out.data(), n_out * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(g_lse.data(), w_lse.data(), n_lse * sizeof(float)), 0);
        ASSERT_EQ(SlotAttention(r), KernelError::kOk);  // the twin of the count
        EXPECT_TRUE(Close(g_out, ToDouble(ref), Tolerance(dt), "cuda out vs twin"));
        // Mass: atomics in either order; past the count, nothing is added.
        std::vector<float> g(n_smass), w(n_smass);
        dev.Get(&g, cap_smass);
        dev.Get(&w, count_smass);
        EXPECT_TRUE(Close(g, ToDouble(w), 1e-5, "slot mass"));
        for (size_t i = static_cast<size_t>(count) * shape.kv_heads * P.slot_tokens; i < n_smass; ++i)
          ASSERT_EQ(g[i], 0.0f) << "slot mass past the count at " << i;
        for (size_t i = 0; i < cap_dmass.size(); ++i) {
          std::vector<float> gd(dmass[i].size()), wd(dmass[i].size());
          dev.Get(&gd, cap_dmass[i]);
          dev.Get(&wd, count_dmass[i]);
          EXPECT_TRUE(Close(gd, ToDouble(wd), 1e-5, "dense mass"));
        }
#endif
      }
    }
}

TEST(KernelBackendsCpu, SlotAttentionRefusesACountOutsideItsCapacity) {
  std::mt19937 rng(3);
  AttnProblem P;
  P.Make(AttnShape{4, 2, 64, DType::kF16, 1, 4, false, true, false}, rng);
  std::vector<float> out(4 * 64), lse(4);
  SlotAttentionParams p = P.Params(0, 4, &out, &lse, nullptr, nullptr);
  for (int32_t count : {-1, 5}) {
    p.n_slots_in_memory = &count;
    EXPECT_EQ(SlotAttention(p), KernelError::kBadShape) << count;
  }
  int32_t zero = 0;
  p.n_slots_in_memory = &zero;
  EXPECT_EQ(SlotAttention(p), KernelError::kOk);
}

// Queries rotated by the kernel (q_rope_positions) are the queries rotated by kernels::Rope first:
// bit for bit in the twin. On the device, bit for bit with the queries rotated by LaunchRope first
// (the device's Rope: the same arithmetic without FMA contraction), and close to kernels::Rope's
// on the host, whose products the host compiler may fuse (GCC does with -march=native).
TEST_P(KernelBackends, SlotAttentionRotatesQueriesAsRope) {
  const RopePlacement place{true, true};  // InfLLM: sinks and chunks at L0
  for (const AttnShape& shape : {kRopeShapes[0], kRopeShapes[1], kRopeShapes[2], kRopeShapes[4]}) {
    SCOPED_TRACE(Name(shape) + " seed " + std::to_string(seed_));
    AttnProblem P;
    P.Make(shape, rng_);
    const std::vector<double> inv_freq = RopeInvFreq(shape.head_dim, 10000.0);
    const size_t n_out = static_cast<size_t>(shape.m) * shape.q_heads * shape.head_dim;
    const size_t n_lse = static_cast<size_t>(shape.m) * shape.q_heads;
    // Where the queries are rotated: not their causal positions (InfLLM rotates them elsewhere).
    std::vector<int64_t> rope_pos(P.qpos);
    for (int64_t& x : rope_pos) x = x * 3 + 1000;
    std::vector<float> rotated_q = P.q;
    Rope(rotated_q.data(), shape.m, shape.q_heads, shape.head_dim, rope_pos.data(), inv_freq.data());
    std::vector<float> out(n_out, kNaN), lse(n_lse, kNaN), ref(n_out, kNaN), ref_lse(n_lse, kNaN);
    SlotAttentionParams p = RotatingParams(P, place, inv_freq.data(), &out, &lse, nullptr, nullptr);
    p.q_rope_positions = rope_pos.data();
    SlotAttentionParams r = RotatingParams(P, place, inv_freq.data(), &ref, &ref_lse, nullptr, nullptr);
    r.q = rotated_q.data();
    ASSERT_EQ(SlotAttention(p), KernelError::kOk);
    ASSERT_EQ(SlotAttention(r), KernelError::kOk);
    if (!cuda()) {
      EXPECT_EQ(std::memcmp(out.data(), ref.data(), n_out * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(lse.data(), ref_lse.data(), n_lse * sizeof(float)), 0);
      std::vector<float> plain(n_out, kNaN), plain_lse(n_lse, kNaN);  // the rotation must matter
      ASSERT_EQ(
          SlotAttention(RotatingParams(P, place, inv_freq.data(), &plain, &plain_lse, nullptr, nullptr)),
          KernelError::kOk);
      EXPECT_FALSE(Close(plain, ToDouble(ref), 1e-2, "unrotated queries vs rotated"));
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    SlotAttentionParams d = RotatingParams(P, place, nullptr, &out, &lse, nullptr, nullptr);
    d.rope_inv_freq = dev.Put(inv_freq);
    d.q_positions = dev.Put(P.qpos);
    for (int i = 0; i < d.n_dense; ++i) {
      d.dense[i].k = dev.Put(P.dense[i].k);
      d.dense[i].v = dev.Put(P.dense[i].v);
    }
    d.pool_k = dev.Put(P.pool_k);
    d.pool_v = dev.Put(P.pool_v);
    d.slot_index = dev.Put(P.slot_index);
    d.slot_first_position = dev.Put(P.slot_pos);
    d.slot_n_tokens = dev.Put(P.slot_n);
    const size_t ws_bytes = cuda::SlotAttentionWorkspaceBytes(d);
    void* ws = dev.AttentionWorkspace(ws_bytes);
    // The queries as projected, rotated by the kernel.
    SlotAttentionParams in_kernel = d;
    in_kernel.q = dev.Put(P.q);
    in_kernel.q_rope_positions = dev.Put(rope_pos);
    in_kernel.out = dev.Put(std::vector<float>(n_out, kNaN));
    in_kernel.lse = dev.Put(std::vector<float>(n_lse, kNaN));
    // The queries rotated by LaunchRope, then attended.
    SlotAttentionParams by_rope = d;
    cuda::RopeParams rp;
    rp.m = shape.m;
    rp.heads = shape.q_heads;
    rp.head_dim = shape.head_dim;
    rp.x = dev.Put(P.q);
    rp.positions = in_kernel.q_rope_positions;
    rp.inv_freq = d.rope_inv_freq;
    ASSERT_EQ(cuda::LaunchRope(rp, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
    by_rope.q = rp.x;
    by_rope.out = dev.Put(std::vector<float>(n_out, kNaN));
    by_rope.lse = dev.Put(std::vector<float>(n_lse, kNaN));
    // The queries rotated by kernels::Rope on the host, then attended.
    SlotAttentionParams by_host = by_rope;
    by_host.q = dev.Put(rotated_q);
    by_host.out = dev.Put(std::vector<float>(n_out, kNaN));
    by_host.lse = dev.Put(std::vector<float>(n_lse, kNaN));
    for (const SlotAttentionParams* x : {&in_kernel, &by_rope, &by_host})
      ASSERT_EQ(cuda::LaunchSlotAttention(*x, ws, ws_bytes, nullptr), KernelError::kOk)
          << cuda::LastCudaErrorString();
    std::vector<float> g_out(n_out), g_lse(n_lse), w_out(n_out), w_lse(n_lse), h_out(n_out);
    dev.Get(&g_out, in_kernel.out);
    dev.Get(&g_lse, in_kernel.lse);
    dev.Get(&w_out, by_rope.out);
    dev.Get(&w_lse, by_rope.lse);
    dev.Get(&h_out, by_host.out);
    EXPECT_EQ(std::memcmp(g_out.data(), w_out.data(), n_out * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(g_lse.data(), w_lse.data(), n_lse * sizeof(float)), 0);
    EXPECT_TRUE(Close(g_out, ToDouble(h_out), 1e-5, "in-kernel rotation vs kernels::Rope on the host"));
    EXPECT_TRUE(Close(g_out, ToDouble(ref), 1e-4, "cuda out vs twin"));
#endif
  }
}

// The merge folded into the attention kernel (kernels/cuda/attention.cu: the last split of a row
// to finish merges it and resets the row's arrival counter). A sweep over f32/f16/bf16, head_dim
// 64 and 128, GQA 1, 4 and 8, keys as stored and rotated at attention time (InfLLM positions:
// sinks and chunks at L0, queries rotated in the kernel), each split 64 ways, with a
// query row that sees no key (every split empty: out 0, lse -inf) beside one that sees them all.
// On the device each launch runs twice eagerly, then is captured in a graph that replays twice:
// every output equals the first bit for bit (a counter left non-zero would merge a row early or
// never), and the first is within 1e-4 of the twin. Every launch of the sweep, whatever its
// shape, uses one workspace whose counters were cleared once. The twin is checked against the
// plain reference where the keys are as stored.
TEST_P(KernelBackends, SlotAttentionMergesInKernelOverManySplitsRelaunchedAndReplayed) {
  const RopePlacement place{true, true};
#if KVTIER_HAVE_CUDA
  DeviceArena shared;
  constexpr size_t kSharedWorkspace = size_t{4} << 20;
  void* ws = nullptr;
  cudaStream_t stream = nullptr;
  if (cuda()) {
    ws = shared.AttentionWorkspace(kSharedWorkspace);
    ASSERT_NE(ws, nullptr);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  struct StreamHold {
    cudaStream_t s;
    ~StreamHold() {
      if (s != nullptr) (void)cudaStreamDestroy(s);
    }
  } hold{stream};
#endif
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (int head_dim : {64, 128})
      for (int gqa : {1, 4, 8})
        for (bool rope : {false, true}) {
          // 2 kv heads x 2 queries: 4 rows of blocks, so 64 splits; 72 ragged slots of 24 tokens
          // (1 to 2 tiles each) and 3 dense tiles: 75 to 147 units, so that splits walk several
          // slot units (the slot list read one unit ahead) and slots of several tiles.
          const AttnShape shape{2 * gqa, 2, head_dim, dt, 2, 72, true, true, false, 24, 16};
          SCOPED_TRACE(Name(shape) + (rope ? " keys and queries rotated" : "") + " seed " +
                       std::to_string(seed_));
          AttnProblem P;
          P.Make(shape, rng_);
          P.qpos[0] = P.dense[0].pos0 - 1;  // before every key: row 0 sees none
          const std::vector<double> inv_freq = RopeInvFreq(head_dim, 10000.0);
          std::vector<int64_t> rope_pos(P.qpos);  // InfLLM rotates queries elsewhere
          for (int64_t& x : rope_pos) x = x * 3 + 1000;
          const size_t row_elems = static_cast<size_t>(shape.q_heads) * head_dim;
          const size_t n_out = 2 * row_elems, n_lse = 2 * static_cast<size_t>(shape.q_heads);
          std::vector<float> out(n_out, kNaN), lse(n_lse, kNaN);
          SlotAttentionParams p =
              rope ? RotatingParams(P, place, inv_freq.data(), &out, &lse, nullptr, nullptr)
                   : P.Params(0, shape.n_slots, &out, &lse, nullptr, nullptr);
          if (rope) p.q_rope_positions = rope_pos.data();
          ASSERT_EQ(SlotAttention(p), KernelError::kOk);
          for (size_t i = 0; i < row_elems; ++i)
            ASSERT_EQ(out[i], 0.0f) << "twin, the row with no key, " << i;
          for (int h = 0; h < shape.q_heads; ++h)
            ASSERT_EQ(lse[h], -std::numeric_limits<float>::infinity()) << "twin, no key";
          if (!cuda()) {
            if (rope) continue;  // SlotAttentionRotates* check the rotation against its meaning
            std::vector<double> ref_out, ref_lse, ref_mass;
            ReferenceAttention(P, &ref_out, &ref_lse, &ref_mass);
            const std::vector<float> seen(out.begin() + row_elems, out.end()),
                seen_lse(lse.begin() + shape.q_heads, lse.end());
            EXPECT_TRUE(Close(seen, std::vector<double>(ref_out.begin() + row_elems, ref_out.end()),
                              Tolerance(dt), "twin out vs reference"));
            EXPECT_TRUE(Close(seen_lse, std::vector<double>(ref_lse.begin() + shape.q_heads, ref_lse.end()),
                              Tolerance(dt), "twin lse vs reference"));
            continue;
          }
#if KVTIER_HAVE_CUDA
          DeviceArena dev;
          SlotAttentionParams d = p;
          d.q = dev.Put(P.q);
          d.q_positions = dev.Put(P.qpos);
          for (int i = 0; i < d.n_dense; ++i) {
            d.dense[i].k = dev.Put(P.dense[i].k);
            d.dense[i].v = dev.Put(P.dense[i].v);
          }
          d.pool_k = dev.Put(P.pool_k);
          d.pool_v = dev.Put(P.pool_v);
          d.slot_index = dev.Put(P.slot_index);
          d.slot_first_position = dev.Put(P.slot_pos);
          d.slot_n_tokens = dev.Put(P.slot_n);
          if (rope) {
            d.rope_inv_freq = dev.Put(inv_freq);
            d.q_rope_positions = dev.Put(rope_pos);
          }
          d.out = dev.Zeros<float>(n_out);
          d.lse = dev.Zeros<float>(n_lse);
          ASSERT_EQ(cuda::SlotAttentionSplits(d), 64);
          const size_t ws_bytes = cuda::SlotAttentionWorkspaceBytes(d);
          ASSERT_LE(ws_bytes, kSharedWorkspace);
          std::vector<float> g_out(n_out), g_lse(n_lse);
          auto fetch = [&] {
            ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
            dev.Get(&g_out, d.out);
            dev.Get(&g_lse, d.lse);
          };
          auto poison = [&] {  // outputs the run must write
            ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
            ASSERT_EQ(cudaMemcpy(d.out, std::vector<float>(n_out, kNaN).data(), n_out * sizeof(float),
                                 cudaMemcpyHostToDevice),
                      cudaSuccess);
            ASSERT_EQ(cudaMemcpy(d.lse, std::vector<float>(n_lse, kNaN).data(), n_lse * sizeof(float),
                                 cudaMemcpyHostToDevice),
                      cudaSuccess);
          };
          poison();
          ASSERT_EQ(cuda::LaunchSlotAttention(d, ws, ws_bytes, stream), KernelError::kOk)
              << cuda::LastCudaErrorString();
          fetch();
          const std::vector<float> first_out = g_out, first_lse = g_lse;
          EXPECT_TRUE(Close(first_out, ToDouble(out), 1e-4, "cuda out vs twin"));
          EXPECT_TRUE(Close(first_lse, ToDouble(lse), 1e-4, "cuda lse vs twin"));
          auto same_as_first = [&](const char* what) {
            EXPECT_EQ(std::memcmp(g_out.data(), first_out.data(), n_out * sizeof(float)), 0)
                << what << ": out";
            EXPECT_EQ(std::memcmp(g_lse.data(), first_lse.data(), n_lse * sizeof(float)), 0)
                << what << ": lse";
          };
          poison();
          ASSERT_EQ(cuda::LaunchSlotAttention(d, ws, ws_bytes, stream), KernelError::kOk);
          fetch();
          same_as_first("launched again");
          poison();
          ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
          ASSERT_EQ(cuda::LaunchSlotAttention(d, ws, ws_bytes, stream), KernelError::kOk);
          cudaGraph_t graph = nullptr;
          ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
          cudaGraphExec_t exec = nullptr;
          ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
          for (const char* what : {"replayed", "replayed again"}) {
            poison();
            ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
            fetch();
            same_as_first(what);
          }
          EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
          EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
#endif
        }
}

TEST(KernelBackendsCpu, SlotAttentionRefusesARotationItCannotPlace) {
  std::mt19937 rng(11);
  AttnProblem P;
  P.Make({4, 2, 64, DType::kF16, 1, 3, false, true, false}, rng);
  std::vector<float> out(4 * 64), lse(4);
  const std::vector<double> inv_freq = RopeInvFreq(64, 10000.0);
  SlotAttentionParams p = P.Params(0, 3, &out, &lse, nullptr, nullptr);
  p.slot_rope_position = 5;  // a position without frequencies
  EXPECT_EQ(SlotAttention(p), KernelError::kBadShape);
  p.slot_rope_position = kRopeAtKeyPositions;
  p.dense[0].rope_position = 5;
  EXPECT_EQ(SlotAttention(p), KernelError::kBadShape);
  p.rope_inv_freq = inv_freq.data();
  EXPECT_EQ(SlotAttention(p), KernelError::kOk);
  p.dense[0].rope_position = -2;  // below kRopeAtKeyPositions
  EXPECT_EQ(SlotAttention(p), KernelError::kBadShape);
  p.dense[0].rope_position = kRopeAtKeyPositions;
  p.head_dim = 63;  // odd: no pairs to rotate
  EXPECT_EQ(CheckSlotAttentionParams(p), KernelError::kBadShape);
  p.rope_inv_freq = nullptr;
  EXPECT_EQ(CheckSlotAttentionParams(p), KernelError::kOk);
  p.head_dim = 64;
  const int64_t q_rope_position = 9;
  p.q_rope_positions = &q_rope_position;  // queries to rotate, without frequencies
  EXPECT_EQ(SlotAttention(p), KernelError::kBadShape);
  p.rope_inv_freq = inv_freq.data();
  EXPECT_EQ(SlotAttention(p), KernelError::kOk);
}

TEST(KernelBackendsCpu, MergeWithAnEmptySideKeepsTheOther) {
  const std::vector<float> a = {1.0f, 2.0f}, a_lse = {0.5f}, none = {0.0f, 0.0f}, none_lse = {kNegInf};
  std::vector<float> out(2, kNaN), lse(1, kNaN);
  MergeAttentionStates(1, 2, none.data(), none_lse.data(), a.data(), a_lse.data(), out.data(), lse.data());
  EXPECT_EQ(out, a);
  EXPECT_EQ(lse[0], 0.5f);
  MergeAttentionStates(1, 2, none.data(), none_lse.data(), none.data(), none_lse.data(), out.data(),
                       lse.data());
  EXPECT_EQ(out, none);
  EXPECT_EQ(lse[0], kNegInf);
}

TEST(KernelBackendsCpu, SlotAttentionRejectsASlotOutsideThePool) {
  std::mt19937 rng(FreshSeed());
  AttnProblem P;
  P.Make({4, 2, 64, DType::kF16, 1, 3, false, true, false}, rng);
  P.slot_index[1] = P.pool_slots;  // one past the pool
  std::vector<float> out(4 * 64, kNaN), lse(4, kNaN);
  EXPECT_EQ(SlotAttention(P.Params(0, 3, &out, &lse, nullptr, nullptr)), KernelError::kBadShape);
  P.slot_index[1] = 0;
  P.slot_n[2] = P.slot_tokens + 1;  // more tokens than a slot holds
  EXPECT_EQ(SlotAttention(P.Params(0, 3, &out, &lse, nullptr, nullptr)), KernelError::kBadShape);
}

#if KVTIER_HAVE_CUDA
// Host-side, no device needed: the launcher refuses a head_dim it has no kernel instance for
// before anything is enqueued (the twin takes them all), and states the same list as the
// plan validation (offload/attention_backend.cc) through SlotAttentionHeadDimSupported.
TEST(KernelBackendsCpu, CudaSlotAttentionRefusesHeadDimsWithoutAKernel) {
  for (int d : {16, 32, 64, 128, 256}) EXPECT_TRUE(cuda::SlotAttentionHeadDimSupported(d)) << d;
  std::mt19937 rng(FreshSeed());
  for (int d : {1, 8, 24, 48, 96, 100, 192, 512}) {
    EXPECT_FALSE(cuda::SlotAttentionHeadDimSupported(d)) << d;
    AttnProblem P;
    P.Make({4, 2, d, DType::kF16, 1, 2, false, true, false}, rng);
    std::vector<float> out(static_cast<size_t>(4) * d, kNaN), lse(4, kNaN);
    const SlotAttentionParams p = P.Params(0, 2, &out, &lse, nullptr, nullptr);
    EXPECT_EQ(SlotAttention(p), KernelError::kOk) << d;  // the twin takes any 1 .. kMaxHeadDim
    EXPECT_EQ(cuda::LaunchSlotAttention(p, nullptr, 0, nullptr), KernelError::kBadShape) << d;
  }
}
#endif

// ---- chunk scoring and per-layer top-k ---------------------------------------------------------

struct ScoreShape {
  int kv_heads, head_dim, repr;
  int64_t n;
  DType dt;
  HeadFold::Kind fold;
};

TEST_P(KernelBackends, ChunkScoresMatchReference) {
  const ScoreShape shapes[] = {{8, 128, 4, 300, DType::kBF16, HeadFold::Kind::kSum},
                               {2, 64, 1, 77, DType::kF32, HeadFold::Kind::kMax},
                               {4, 64, 3, 129, DType::kF16, HeadFold::Kind::kSum},
                               {1, 128, 2, 1, DType::kF16, HeadFold::Kind::kMax}};
  for (const ScoreShape& s : shapes) {
    SCOPED_TRACE(std::to_string(s.kv_heads) + "kv d" + std::to_string(s.head_dim) + " R" +
                 std::to_string(s.repr) + " n" + std::to_string(s.n) + " " + DTypeName(s.dt) + " seed " +
                 std::to_string(seed_));
    const size_t n_keys = static_cast<size_t>(s.kv_heads) * s.n * s.repr;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> kf(n_keys * s.head_dim), probe(static_cast<size_t>(s.kv_heads) * s.head_dim);
    for (float& x : kf) x = nd(rng_);
    for (float& x : probe) x = nd(rng_);
    std::vector<uint8_t> keys(kf.size() * DTypeSize(s.dt));
    FromFloat(s.dt, kf.data(), keys.data(), kf.size());
    ToFloat(s.dt, keys.data(), kf.data(), kf.size());  // the values the kernel sees
    std::vector<float> inv(n_keys);
    for (size_t j = 0; j < n_keys; ++j) inv[j] = InverseNorm(kf.data() + j * s.head_dim, s.head_dim);
    std::vector<float> logit(s.n, kNaN), cosine(s.n, kNaN);
    ChunkScoreParams p;
    p.kv_heads = s.kv_heads;
    p.head_dim = s.head_dim;
    p.repr = s.repr;
    p.dtype = s.dt;
    p.fold = s.fold;
    p.n_chunks = s.n;
    p.keys = keys.data();
    p.inv_norm = inv.data();
    p.probe = probe.data();
    p.logit = logit.data();
    p.cosine = cosine.data();
    ASSERT_EQ(ScoreChunks(p), KernelError::kOk);
    if (!cuda()) {
      // Direct formula in double: fold over heads of the best representative's dot / cosine.
      // Beside each, the scale of its rounding: the dots' sums of |k_d p_d| (a dot that
      // cancels to near zero keeps the rounding of its terms, not of its value).
      const bool mx = s.fold == HeadFold::Kind::kMax;
      std::vector<double> want_l(s.n, mx ? -INFINITY : 0.0), want_c(s.n, mx ? -INFINITY : 0.0);
      std::vector<double> scale_l(s.n, 0.0), scale_c(s.n, 0.0);
      for (int h = 0; h < s.kv_heads; ++h) {
        const float* pr = probe.data() + static_cast<size_t>(h) * s.head_dim;
        double pn = 0.0;
        for (int d = 0; d < s.head_dim; ++d) pn += static_cast<double>(pr[d]) * pr[d];
        for (int64_t c = 0; c < s.n; ++c) {
          double best = -INFINITY, best_cos = -1.0, terms = 0.0, terms_cos = 0.0;
          for (int r = 0; r < s.repr; ++r) {
            const float* k = kf.data() + ((static_cast<size_t>(h) * s.n + c) * s.repr + r) * s.head_dim;
            double dot = 0.0, kn = 0.0, abs_dot = 0.0;
            for (int d = 0; d < s.head_dim; ++d) {
              dot += static_cast<double>(k[d]) * pr[d], kn += static_cast<double>(k[d]) * k[d];
              abs_dot += std::fabs(static_cast<double>(k[d]) * pr[d]);
            }
            best = std::max(best, dot);
            best_cos = std::max(best_cos, dot / std::sqrt(kn * pn));
            terms = std::max(terms, abs_dot);
            terms_cos = std::max(terms_cos, abs_dot / std::sqrt(kn * pn));
          }
          want_l[c] = mx ? std::max(want_l[c], best) : want_l[c] + best;
          want_c[c] = mx ? std::max(want_c[c], best_cos) : want_c[c] + best_cos / s.kv_heads;
          scale_l[c] += terms;
          scale_c[c] += terms_cos;
        }
      }
      // Dots of 64..128 fp32 products against double: relative to the output's scale, or to
      // the terms' where they cancel.
      EXPECT_TRUE(CloseToScale(logit, want_l, scale_l, 1e-5, "logit"));
      EXPECT_TRUE(CloseToScale(cosine, want_c, scale_c, 1e-5, "cosine"));
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    ChunkScoreParams d = p;
    d.keys = dev.Put(keys);
    d.inv_norm = dev.Put(inv);
    d.probe = dev.Put(probe);
    d.logit = dev.Put(std::vector<float>(s.n, kNaN));
    d.cosine = dev.Put(std::vector<float>(s.n, kNaN));
    ASSERT_EQ(cuda::LaunchScoreChunks(d, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
    std::vector<float> gl(s.n), gc(s.n);
    dev.Get(&gl, d.logit);
    dev.Get(&gc, d.cosine);
    EXPECT_TRUE(Close(gl, ToDouble(logit), 1e-5, "cuda logit vs twin"));
    EXPECT_TRUE(Close(gc, ToDouble(cosine), 1e-5, "cuda cosine vs twin"));
#endif
  }
}

TEST_P(KernelBackends, SegmentedTopKMatchesStableSort) {
  // Ragged layers (one empty, one shorter than its k), scores with ties and signed zeros.
  const std::vector<int32_t> sizes = {50, 0, 3, 1000, 17};
  const std::vector<int32_t> ks = {8, 4, 5, 64, 17};
  const int k_max = 64;
  std::vector<int32_t> offsets = {0};
  for (int32_t n : sizes) offsets.push_back(offsets.back() + n);
  std::vector<float> scores(offsets.back());
  std::uniform_int_distribution<int> coarse(-20, 20);
  for (float& x : scores) x = static_cast<float>(coarse(rng_)) * 0.25f;  // many ties
  for (size_t i = 0; i < scores.size(); i += 7) scores[i] = (i / 7) % 2 ? -0.0f : 0.0f;
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::vector<int32_t> idx(sizes.size() * k_max, 12345);
  std::vector<float> top(sizes.size() * k_max, kNaN);
  SegmentedTopKParams p;
  p.n_segments = static_cast<int>(sizes.size());
  p.offsets = offsets.data();
  p.scores = scores.data();
  p.k = ks.data();
  p.k_max = k_max;
  p.out_index = idx.data();
  p.out_score = top.data();
  ASSERT_EQ(SegmentedTopK(p), KernelError::kOk);
  if (!cuda()) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      std::vector<int32_t> order(sizes[s]);
      std::iota(order.begin(), order.end(), 0);
      const float* sc = scores.data() + offsets[s];
      std::stable_sort(order.begin(), order.end(), [sc](int32_t a, int32_t b) { return sc[a] > sc[b]; });
      const int take = std::min(sizes[s], ks[s]);
      for (int j = 0; j < k_max; ++j) {
        EXPECT_EQ(idx[s * k_max + j], j < take ? order[j] : -1) << "segment " << s << " rank " << j;
        if (j < take)
          EXPECT_EQ(top[s * k_max + j], sc[order[j]]);
        else
          EXPECT_EQ(top[s * k_max + j], kNegInf);
      }
    }
    return;
  }
#if KVTIER_HAVE_CUDA
  DeviceArena dev;
  SegmentedTopKParams d = p;
  d.offsets = dev.Put(offsets);
  d.scores = dev.Put(scores);
  d.k = dev.Put(ks);
  d.out_index = dev.Put(std::vector<int32_t>(idx.size(), 12345));
  d.out_score = dev.Put(std::vector<float>(top.size(), kNaN));
  size_t ws_bytes = 0;
  ASSERT_EQ(cuda::SegmentedTopKWorkspaceBytes(d, offsets.back(), &ws_bytes), KernelError::kOk)
      << cuda::LastCudaErrorString();
  void* ws = dev.Zeros<char>(ws_bytes);
  EXPECT_EQ(cuda::LaunchSegmentedTopK(d, offsets.back(), ws, ws_bytes - 1, nullptr), KernelError::kWorkspace);
  ASSERT_EQ(cuda::LaunchSegmentedTopK(d, offsets.back(), ws, ws_bytes, nullptr), KernelError::kOk)
      << cuda::LastCudaErrorString();
  std::vector<int32_t> g_idx(idx.size());
  std::vector<float> g_top(top.size());
  dev.Get(&g_idx, d.out_index);
  dev.Get(&g_top, d.out_score);
  EXPECT_EQ(g_idx, idx);
  for (size_t i = 0; i < top.size(); ++i) EXPECT_EQ(g_top[i], top[i]) << i;
#endif
}

// ---- Eq. 11 entropy ----------------------------------------------------------------------------

TEST_P(KernelBackends, SegmentEntropyMatchesDirectFormula) {
  const std::vector<int32_t> sizes = {1, 0, 4096, 33, 2, 700};
  std::vector<int32_t> offsets = {0};
  for (int32_t n : sizes) offsets.push_back(offsets.back() + n);
  std::vector<float> scores(offsets.back());
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (float& x : scores) x = nd(rng_);
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::vector<double> ent(sizes.size(), std::nan(""));
  EntropyParams p;
  p.n_segments = static_cast<int>(sizes.size());
  p.offsets = offsets.data();
  p.scores = scores.data();
  p.entropy = ent.data();
  ASSERT_EQ(SegmentEntropy(p), KernelError::kOk);
  if (!cuda()) {
    // Eq. 11 directly: -sum p log p with p = softmax(s), long double.
    std::vector<double> want;
    for (size_t s = 0; s < sizes.size(); ++s) {
      long double z = 0.0L, h = 0.0L;
      for (int32_t i = offsets[s]; i < offsets[s + 1]; ++i)
        z += std::exp(static_cast<long double>(scores[i]));
      for (int32_t i = offsets[s]; i < offsets[s + 1]; ++i) {
        const long double pr = std::exp(static_cast<long double>(scores[i])) / z;
        if (pr > 0.0L) h -= pr * std::log(pr);
      }
      want.push_back(static_cast<double>(h));
    }
    EXPECT_TRUE(Close(ent, want, 1e-9, "entropy"));  // fp64 arithmetic: far below fp32's bound
    EXPECT_EQ(ent[0], 0.0);                          // one chunk: exactly 0
    EXPECT_EQ(ent[1], 0.0);                          // empty segment
    return;
  }
#if KVTIER_HAVE_CUDA
  DeviceArena dev;
  EntropyParams d = p;
  d.offsets = dev.Put(offsets);
  d.scores = dev.Put(scores);
  d.entropy = dev.Put(std::vector<double>(sizes.size(), std::nan("")));
  ASSERT_EQ(cuda::LaunchSegmentEntropy(d, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
  std::vector<double> g(sizes.size());
  dev.Get(&g, d.entropy);
  EXPECT_TRUE(Close(g, ent, 1e-5, "cuda entropy vs twin"));
#endif
}

// ---- ActQKV probe (Eq. 7-9) ------------------------------------------------------------------------

// Eq. 8 over every query seen so far (direct two-pass sums, not the running form), then Eq. 7
// and Eq. 9 over the current window, in long double.
std::vector<double> DirectActProbe(const ProbeShape& s, const std::vector<std::vector<float>>& windows,
                                   double eps) {
  const int D = s.head_dim, G = s.q_heads / s.kv_heads;
  const std::vector<float>& cur = windows.back();
  const int m = static_cast<int>(cur.size() / (static_cast<size_t>(s.q_heads) * D));
  std::vector<double> probe(static_cast<size_t>(s.kv_heads) * D, 0.0);
  for (int h = 0; h < s.q_heads; ++h) {
    std::vector<long double> mean(D, 0.0L), var(D, 0.0L);
    int64_t count = 0;
    for (const auto& w : windows) {
      const int mw = static_cast<int>(w.size() / (static_cast<size_t>(s.q_heads) * D));
      for (int j = 0; j < mw; ++j, ++count)
        for (int d = 0; d < D; ++d) mean[d] += w[(static_cast<size_t>(j) * s.q_heads + h) * D + d];
    }
    for (int d = 0; d < D; ++d) mean[d] /= count;
    for (const auto& w : windows) {
      const int mw = static_cast<int>(w.size() / (static_cast<size_t>(s.q_heads) * D));
      for (int j = 0; j < mw; ++j)
        for (int d = 0; d < D; ++d) {
          const long double dev = w[(static_cast<size_t>(j) * s.q_heads + h) * D + d] - mean[d];
          var[d] += dev * dev;
        }
    }
    for (int d = 0; d < D; ++d) var[d] /= (count - 1);
    std::vector<long double> l1(m, 0.0L);
    long double total = 0.0L;
    for (int j = 0; j < m; ++j) {
      for (int d = 0; d < D; ++d) {
        if (!(var[d] > eps)) continue;
        const long double dev = cur[(static_cast<size_t>(j) * s.q_heads + h) * D + d] - mean[d];
        l1[j] += dev * dev / var[d];
      }
      total += l1[j];
    }
    for (int j = 0; j < m; ++j)
      for (int d = 0; d < D; ++d)
        probe[static_cast<size_t>(h / G) * D + d] +=
            static_cast<double>(l1[j] / total / G * cur[(static_cast<size_t>(j) * s.q_heads + h) * D + d]);
  }
  return probe;
}

TEST_P(KernelBackends, ActProbeMatchesDirectEquationsAndTheRetriever) {
  const ProbeShape shapes[] = {{8, 2, 64}, {32, 8, 128}, {4, 4, 64}};
  const int window_sizes[] = {6, 3, 9, 1};
  for (const ProbeShape& s : shapes) {
    SCOPED_TRACE(std::to_string(s.q_heads) + "q/" + std::to_string(s.kv_heads) + "kv d" +
                 std::to_string(s.head_dim) + " seed " + std::to_string(seed_));
    Geometry g;
    g.layers = 1;
    g.q_heads = s.q_heads;
    g.kv_heads = s.kv_heads;
    g.head_dim = s.head_dim;
    auto builder = ActProbeBuilder::Make(g);
    ASSERT_TRUE(builder.ok()) << builder.status().ToString();
    const size_t stats = static_cast<size_t>(s.q_heads) * s.head_dim;
    std::vector<double> mean(stats, 0.0), m2(stats, 0.0);
    int64_t count = 0;
    std::vector<std::vector<float>> windows;
#if KVTIER_HAVE_CUDA
    std::unique_ptr<DeviceArena> dev;
    double *d_mean = nullptr, *d_m2 = nullptr;
    if (cuda()) {
      dev = std::make_unique<DeviceArena>();
      d_mean = dev->Put(mean);
      d_m2 = dev->Put(m2);
    }
#endif
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int m : window_sizes) {
      std::vector<float> q(static_cast<size_t>(m) * s.q_heads * s.head_dim);
      for (float& x : q) x = nd(rng_) * (1.0f + 0.1f * static_cast<float>(rng_() % 5));
      windows.push_back(q);
      ActMergeWindow(s, q.data(), m, count, mean.data(), m2.data());
      const int64_t n_old = count;
      count += m;
      std::vector<float> twin(static_cast<size_t>(s.kv_heads) * s.head_dim, kNaN), retr(twin.size(), kNaN);
      ActWeightedProbe(s, q.data(), m, mean.data(), m2.data(), count, 1e-6, twin.data());
      if (!cuda()) {
        ASSERT_TRUE((*builder)->Build(0, q.data(), m, retr.data()).ok());
        EXPECT_EQ(retr, twin) << "retriever and twin differ";  // the retriever runs the twin
        if (count >= 2) {
          EXPECT_TRUE(Close(twin, DirectActProbe(s, windows, 1e-6), 1e-5, "probe vs Eq. 7-9"));
        }
        continue;
      }
#if KVTIER_HAVE_CUDA
      const float* d_q = dev->Put(q);
      ASSERT_EQ(cuda::LaunchActMergeWindow(s, d_q, m, n_old, d_mean, d_m2, nullptr), KernelError::kOk);
      const size_t ws = cuda::ActWeightedProbeWorkspaceBytes(s, m);
      float* d_probe = dev->Put(std::vector<float>(twin.size(), kNaN));
      ASSERT_EQ(cuda::LaunchActWeightedProbe(s, d_q, m, d_mean, d_m2, count, 1e-6, d_probe,
                                             dev->Zeros<char>(ws), ws, nullptr),
                KernelError::kOk)
          << cuda::LastCudaErrorString();
      std::vector<float> got(twin.size());
      dev->Get(&got, d_probe);
      EXPECT_TRUE(Close(got, ToDouble(twin), 1e-5, "cuda probe vs twin"));
#else
      (void)n_old;
#endif
    }
  }
}

TEST_P(KernelBackends, MeanPoolProbeMatchesDirectMean) {
  const ProbeShape s{8, 2, 128};
  const int m = 5;
  std::vector<float> q(static_cast<size_t>(m) * s.q_heads * s.head_dim);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : q) x = nd(rng_);
  std::vector<float> probe(static_cast<size_t>(s.kv_heads) * s.head_dim, kNaN);
  MeanPoolProbe(s, q.data(), m, probe.data());
  if (!cuda()) {
    std::vector<double> want(probe.size(), 0.0);
    const int G = s.q_heads / s.kv_heads;
    for (int j = 0; j < m; ++j)
      for (int h = 0; h < s.q_heads; ++h)
        for (int d = 0; d < s.head_dim; ++d)
          want[static_cast<size_t>(h / G) * s.head_dim + d] +=
              q[(static_cast<size_t>(j) * s.q_heads + h) * s.head_dim + d] / static_cast<double>(m * G);
    EXPECT_TRUE(Close(probe, want, 1e-5, "mean pool"));
    return;
  }
#if KVTIER_HAVE_CUDA
  DeviceArena dev;
  float* d_probe = dev.Put(std::vector<float>(probe.size(), kNaN));
  ASSERT_EQ(cuda::LaunchMeanPoolProbe(s, dev.Put(q), m, d_probe, nullptr), KernelError::kOk);
  std::vector<float> got(probe.size());
  dev.Get(&got, d_probe);
  EXPECT_TRUE(Close(got, ToDouble(probe), 1e-5, "cuda mean pool vs twin"));
#endif
}

// ---- the model's forward outside attention (kernels/cpu/forward.h, rope.h) ---------------------

std::vector<float> Normal(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

TEST_P(KernelBackends, EmbeddingCopiesTheTokensRows) {
  const int vocab = 300, d = 96, m = 7;
  const std::vector<float> table = Normal(rng_, static_cast<size_t>(vocab) * d);
  const std::vector<int32_t> tokens = {0, 299, 5, 5, 128, 1, 298};
  std::vector<float> out(static_cast<size_t>(m) * d, kNaN);
  EmbeddingParams p;
  p.m = m;
  p.d = d;
  p.vocab = vocab;
  p.tokens = tokens.data();
  p.table = table.data();
  p.out = out.data();
  ASSERT_EQ(Embedding(p), KernelError::kOk);
  if (!cuda()) {
    std::vector<double> want(out.size());
    for (int t = 0; t < m; ++t)
      for (int i = 0; i < d; ++i)
        want[static_cast<size_t>(t) * d + i] =
            table[static_cast<size_t>(tokens[static_cast<size_t>(t)]) * d + i];
    EXPECT_TRUE(Close(out, want, 0.0, "embedding"));  // a copy: exact
    return;
  }
#if KVTIER_HAVE_CUDA
  DeviceArena dev;
  EmbeddingParams dp = p;
  dp.tokens = dev.Put(tokens);
  dp.table = dev.Put(table);
  dp.out = dev.Put(std::vector<float>(out.size(), kNaN));
  ASSERT_EQ(cuda::LaunchEmbedding(dp, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
  std::vector<float> got(out.size());
  dev.Get(&got, dp.out);
  EXPECT_TRUE(Close(got, ToDouble(out), 0.0, "cuda embedding vs twin"));
#endif
}

TEST(KernelBackendsCpu, EmbeddingRejectsATokenOutsideTheVocabularyAndWritesNothing) {
  const std::vector<float> table(4 * 3, 1.0f);
  const std::vector<int32_t> tokens = {1, 4};
  std::vector<float> out(2 * 3, -7.0f);
  EmbeddingParams p;
  p.m = 2;
  p.d = 3;
  p.vocab = 4;
  p.tokens = tokens.data();
  p.table = table.data();
  p.out = out.data();
  EXPECT_EQ(Embedding(p), KernelError::kBadShape);
  for (float v : out) EXPECT_EQ(v, -7.0f);  // the valid first token's row is not written either
  p.tokens = nullptr;
  EXPECT_EQ(Embedding(p), KernelError::kNullPointer);
}

TEST_P(KernelBackends, RmsNormMatchesReference) {
  for (int d : {128, 200, 1000}) {
    SCOPED_TRACE("d " + std::to_string(d) + " seed " + std::to_string(seed_));
    const int m = 9;
    const double eps = 1e-5;
    std::vector<float> x = Normal(rng_, static_cast<size_t>(m) * d, 3.0f);
    for (int i = 0; i < d; ++i) x[static_cast<size_t>(4) * d + i] *= 1e-4f;  // a row where eps matters
    const std::vector<float> w = Normal(rng_, static_cast<size_t>(d));
    std::vector<float> out(x.size(), kNaN);
    RmsNormParams p;
    p.m = m;
    p.d = d;
    p.eps = eps;
    p.x = x.data();
    p.w = w.data();
    p.out = out.data();
    ASSERT_EQ(RmsNorm(p), KernelError::kOk);
    if (!cuda()) {
      std::vector<double> want(out.size());
      for (int t = 0; t < m; ++t) {
        double ss = 0;
        for (int i = 0; i < d; ++i) ss += std::pow(static_cast<double>(x[static_cast<size_t>(t) * d + i]), 2);
        const double r = 1.0 / std::sqrt(ss / d + eps);
        for (int i = 0; i < d; ++i)
          want[static_cast<size_t>(t) * d + i] =
              x[static_cast<size_t>(t) * d + i] * r * w[static_cast<size_t>(i)];
      }
      EXPECT_TRUE(Close(out, want, 1e-5, "rmsnorm"));
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    RmsNormParams dp = p;
    dp.x = dev.Put(x);
    dp.w = dev.Put(w);
    dp.out = dev.Put(std::vector<float>(out.size(), kNaN));
    ASSERT_EQ(cuda::LaunchRmsNorm(dp, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
    std::vector<float> got(out.size());
    dev.Get(&got, dp.out);
    EXPECT_TRUE(Close(got, ToDouble(out), 1e-5, "cuda rmsnorm vs twin"));
#endif
  }
}

TEST(KernelBackendsCpu, RmsNormRejectsABadEpsilon) {
  const std::vector<float> x(8, 1.0f), w(8, 1.0f);
  std::vector<float> out(8);
  RmsNormParams p;
  p.m = 1;
  p.d = 8;
  p.x = x.data();
  p.w = w.data();
  p.out = out.data();
  for (double eps : {0.0, -1e-5, std::numeric_limits<double>::infinity()}) {
    p.eps = eps;
    EXPECT_EQ(RmsNorm(p), KernelError::kBadShape) << eps;
  }
}

TEST_P(KernelBackends, RopeMatchesRotationReference) {
  const int m = 6, heads = 3, head_dim = 128;
  const double theta = 10000.0;
  const std::vector<int64_t> pos = {0, 1, 17, 4095, 100000, 1 << 20};
  const std::vector<double> inv_freq = RopeInvFreq(head_dim, theta);
  const std::vector<float> x0 = Normal(rng_, static_cast<size_t>(m) * heads * head_dim);
  std::vector<float> x = x0;
  Rope(x.data(), m, heads, head_dim, pos.data(), inv_freq.data());
  if (!cuda()) {
    std::vector<double> want(x.size());
    const int half = head_dim / 2;
    for (int t = 0; t < m; ++t)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < half; ++i) {
          // the angle from theta directly (not the twin's inv_freq table)
          const double a =
              static_cast<double>(pos[static_cast<size_t>(t)]) * std::pow(theta, -2.0 * i / head_dim);
          const size_t b = (static_cast<size_t>(t) * heads + h) * head_dim;
          const double x1 = x0[b + i], x2 = x0[b + i + half];
          want[b + i] = x1 * std::cos(a) - x2 * std::sin(a);
          want[b + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
        }
    EXPECT_TRUE(Close(x, want, 1e-5, "rope"));
    return;
  }
#if KVTIER_HAVE_CUDA
  DeviceArena dev;
  cuda::RopeParams dp;
  dp.m = m;
  dp.heads = heads;
  dp.head_dim = head_dim;
  dp.x = dev.Put(x0);
  dp.positions = dev.Put(pos);
  dp.inv_freq = dev.Put(inv_freq);
  ASSERT_EQ(cuda::LaunchRope(dp, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
  std::vector<float> got(x.size());
  dev.Get(&got, dp.x);
  EXPECT_TRUE(Close(got, ToDouble(x), 1e-5, "cuda rope vs twin"));
#endif
}

TEST_P(KernelBackends, SwiGluMatchesReference) {
  const size_t n = 3 * 352 + 5;
  std::vector<float> gate = Normal(rng_, n, 4.0f);
  gate[0] = -90.0f;  // exp(90) overflows fp32: silu must still be -0, not NaN
  gate[1] = 90.0f;
  const std::vector<float> g0 = gate, up = Normal(rng_, n);
  SwiGluParams p;
  p.n = n;
  p.gate = gate.data();
  p.up = up.data();
  ASSERT_EQ(SwiGlu(p), KernelError::kOk);
  if (!cuda()) {
    std::vector<double> want(n);
    for (size_t i = 0; i < n; ++i) want[i] = g0[i] / (1.0 + std::exp(-static_cast<double>(g0[i]))) * up[i];
    EXPECT_TRUE(Close(gate, want, 1e-5, "swiglu"));
    return;
  }
#if KVTIER_HAVE_CUDA
  DeviceArena dev;
  SwiGluParams dp;
  dp.n = n;
  dp.gate = dev.Put(g0);
  dp.up = dev.Put(up);
  ASSERT_EQ(cuda::LaunchSwiGlu(dp, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
  std::vector<float> got(n);
  dev.Get(&got, dp.gate);
  EXPECT_TRUE(Close(got, ToDouble(gate), 1e-5, "cuda swiglu vs twin"));
#endif
}

struct GemmShape {
  int m, k, n_out;
  bool accumulate;
};

TEST_P(KernelBackends, GemmMatchesReference) {
  // decode (m 1), k not a multiple of 8 (the twin's tail), and shapes past the twin's threading
  // threshold (m k n >= 2^18), with and without the residual accumulate.
  for (const GemmShape s :
       {GemmShape{1, 128, 384, false}, GemmShape{5, 131, 77, true}, GemmShape{64, 128, 256, false},
        GemmShape{64, 352, 128, true}, GemmShape{3, 128, 256, true}}) {
    SCOPED_TRACE("m " + std::to_string(s.m) + " k " + std::to_string(s.k) + " n " + std::to_string(s.n_out) +
                 (s.accumulate ? " +=" : " =") + " seed " + std::to_string(seed_));
    const std::vector<float> x = Normal(rng_, static_cast<size_t>(s.m) * s.k);
    const std::vector<float> w = Normal(rng_, static_cast<size_t>(s.n_out) * s.k, 0.1f);
    const std::vector<float> y0 = s.accumulate ? Normal(rng_, static_cast<size_t>(s.m) * s.n_out)
                                               : std::vector<float>(static_cast<size_t>(s.m) * s.n_out, kNaN);
    std::vector<float> y = y0;
    GemmParams p;
    p.m = s.m;
    p.k = s.k;
    p.n_out = s.n_out;
    p.x = x.data();
    p.w = w.data();
    p.y = y.data();
    p.accumulate = s.accumulate;
    ASSERT_EQ(Gemm(p), KernelError::kOk);
    if (!cuda()) {
      std::vector<double> want(y.size());
      for (int t = 0; t < s.m; ++t)
        for (int o = 0; o < s.n_out; ++o) {
          double acc = s.accumulate ? y0[static_cast<size_t>(t) * s.n_out + o] : 0.0;
          for (int i = 0; i < s.k; ++i)
            acc += static_cast<double>(x[static_cast<size_t>(t) * s.k + i]) *
                   w[static_cast<size_t>(o) * s.k + i];
          want[static_cast<size_t>(t) * s.n_out + o] = acc;
        }
      EXPECT_TRUE(Close(y, want, 1e-5, "gemm"));
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    cuda::BlasHandle blas = nullptr;
    ASSERT_EQ(cuda::CreateBlasHandle(&blas), KernelError::kOk) << cuda::LastBlasStatusString();
    std::unique_ptr<void, void (*)(void*)> hold(blas, cuda::DestroyBlasHandle);
    const size_t ws_bytes = cuda::GemmWorkspaceBytes();
    void* ws = dev.Zeros<uint8_t>(ws_bytes);
    GemmParams dp = p;
    dp.x = dev.Put(x);
    dp.w = dev.Put(w);
    dp.y = dev.Put(y0);
    EXPECT_EQ(cuda::LaunchGemm(dp, blas, ws, ws_bytes - 1, nullptr), KernelError::kWorkspace);
    ASSERT_EQ(cuda::LaunchGemm(dp, blas, ws, ws_bytes, nullptr), KernelError::kOk)
        << cuda::LastBlasStatusString();
    std::vector<float> got(y.size());
    dev.Get(&got, dp.y);
    EXPECT_TRUE(Close(got, ToDouble(y), 1e-5, "cuda gemm vs twin"));
#endif
  }
}

TEST(KernelBackendsCpu, GemmRejectsBadShapesAndNullPointers) {
  const std::vector<float> x(8, 1.0f), w(8, 1.0f);
  std::vector<float> y(1, -3.0f);
  GemmParams p;
  p.m = 1;
  p.k = 8;
  p.n_out = 1;
  p.x = x.data();
  p.w = w.data();
  p.y = y.data();
  p.k = 0;
  EXPECT_EQ(Gemm(p), KernelError::kBadShape);
  p.k = 8;
  p.m = -1;
  EXPECT_EQ(Gemm(p), KernelError::kBadShape);
  p.m = 1;
  p.w = nullptr;
  EXPECT_EQ(Gemm(p), KernelError::kNullPointer);
  EXPECT_EQ(y[0], -3.0f);
  p.w = w.data();
  ASSERT_EQ(Gemm(p), KernelError::kOk);
  EXPECT_EQ(y[0], 8.0f);
}

// ---- K/V conversion to the store dtype (ConvertToStore) ----------------------------------------

// Inputs that exercise every rounding path: zeros, infinities, NaNs (quiet, signalling, with
// payloads), the f16 overflow edge (65504, 65519.99, 65520), f16 subnormal ties and the
// smallest values that round up, bf16 ties in both parities, fp32 subnormals, and random
// values over many binades.
std::vector<float> ConversionInputs(std::mt19937& rng) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                                0x7f800001u, 0x7fa5a5a5u, 0x477fe000u, 0x477fefffu, 0x477ff000u, 0xc77ff000u,
                                0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0x33800000u, 0x33c00000u,
                                0x34400000u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u, 0x3f817fffu,
                                0x3f808001u, 0x3f801000u, 0x3f803000u, 0x3f802fffu, 0x7f7fffffu, 0x7f7f8000u};
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 4000; ++i) bits.push_back(any(rng));
  std::vector<float> v;
  for (uint32_t b : bits) v.push_back(BitsToFloat(b));
  std::uniform_real_distribution<float> ex(-30.0f, 18.0f);
  for (int i = 0; i < 4000; ++i) v.push_back((i & 1 ? -1.0f : 1.0f) * std::exp2(ex(rng)));
  return v;
}

// An independent f16 reference: the nearest f16 found by distance in double over the two
// candidates around |x| (no bit tricks), ties to the even significand; NaN is checked apart.
uint16_t F16ByDistance(float x) {
  const double a = std::fabs(static_cast<double>(x));
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (std::isinf(x) || a >= 65520.0) return sign | 0x7c00u;  // half-way above 65504 rounds to inf
  auto value = [](uint16_t h) {                              // magnitude of an f16 pattern without sign
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    return e == 0 ? std::ldexp(static_cast<double>(m), -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  };
  uint16_t lo = 0;  // the largest pattern <= a (patterns are ordered like their values)
  for (int step = 1 << 14; step > 0; step >>= 1)
    if (lo + step <= 0x7bff && value(static_cast<uint16_t>(lo + step)) <= a)
      lo = static_cast<uint16_t>(lo + step);
  if (value(lo) == a || lo == 0x7bff) return sign | lo;
  const double dl = a - value(lo), dh = value(static_cast<uint16_t>(lo + 1)) - a;
  const uint16_t pick = dl < dh ? lo : (dh < dl ? static_cast<uint16_t>(lo + 1) : ((lo & 1) ? lo + 1 : lo));
  return sign | pick;
}

// The same for bf16: the candidates are the truncated pattern and the next one up.
uint16_t Bf16ByDistance(float x) {
  const uint32_t u = FloatBits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isinf(x)) return static_cast<uint16_t>(u >> 16);
  const uint16_t lo = static_cast<uint16_t>((u & 0x7fffffffu) >> 16);
  const double a = std::fabs(static_cast<double>(x));
  const double vl = std::fabs(static_cast<double>(BitsToFloat(static_cast<uint32_t>(lo) << 16)));
  if (vl == a) return sign | lo;
  // The next pattern up may be infinity (0x7f80): its "value" for rounding is 2^128.
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double vh = hi == 0x7f80u ? std::ldexp(1.0, 128)
                                  : static_cast<double>(BitsToFloat(static_cast<uint32_t>(hi) << 16));
  const double dl = a - vl, dh = vh - a;
  const uint16_t pick = dl < dh ? lo : (dh < dl ? hi : ((lo & 1) ? hi : lo));
  return sign | pick;
}

bool IsQuietNaN(DType t, uint16_t h) {
  return t == DType::kF16 ? ((h & 0x7c00u) == 0x7c00u && (h & 0x0200u))
                          : ((h & 0x7f80u) == 0x7f80u && (h & 0x0040u));
}

TEST_P(KernelBackends, ConvertToStoreRoundsToNearestEven) {
  const std::vector<float> src = ConversionInputs(rng_);
  const size_t n = src.size();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    std::vector<uint8_t> twin(n * DTypeSize(t), 0xa5);
    ConvertToStoreParams p;
    p.n = n;
    p.dtype = t;
    p.src = src.data();
    p.dst = twin.data();
    ASSERT_EQ(ConvertToStore(p), KernelError::kOk);
    if (!cuda()) {  // the twin against the distance reference
      for (size_t i = 0; i < n; ++i) {
        if (t == DType::kF32) {
          uint32_t got;
          std::memcpy(&got, twin.data() + 4 * i, 4);
          ASSERT_EQ(got, FloatBits(src[i])) << "at " << i << " (seed " << seed_ << ")";
          continue;
        }
        uint16_t got;
        std::memcpy(&got, twin.data() + 2 * i, 2);
        if (std::isnan(src[i])) {
          ASSERT_TRUE(IsQuietNaN(t, got)) << std::hex << FloatBits(src[i]) << " -> " << got;
          continue;
        }
        const uint16_t want = t == DType::kF16 ? F16ByDistance(src[i]) : Bf16ByDistance(src[i]);
        ASSERT_EQ(got, want) << std::hex << "input bits " << FloatBits(src[i]) << " (seed " << std::dec
                             << seed_ << ")";
      }
      continue;
    }
#if KVTIER_HAVE_CUDA
    DeviceArena dev;
    ConvertToStoreParams dp = p;
    dp.src = dev.Put(src);
    dp.dst = dev.Zeros<uint8_t>(twin.size());
    ASSERT_EQ(cuda::LaunchConvertToStore(dp, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
    std::vector<uint8_t> got(twin.size());
    dev.Get(&got, static_cast<const uint8_t*>(dp.dst));
    EXPECT_EQ(std::memcmp(got.data(), twin.data(), twin.size()), 0)
        << "cuda conversion differs from the twin";
#endif
  }
}

// The bit functions the device kernel runs, compiled here for the host, against the host
// conversion: every f32 exponent and sign with the low bits at each rounding edge (f16: bit 13;
// bf16: bit 16), which covers every tie, overflow and subnormal case.
TEST(KernelBackendsCpu, StoreConversionBitsEqualTheHostConversion) {
  // Bits 13..31 take every value; bits 0..12 the patterns around the f16 normal range's tie
  // (0x1000). Subnormal results drop 14..24 bits: their ties lie in the enumerated bits.
  const uint32_t f16_low[] = {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu};
  const uint32_t bf16_low[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu};
  uint64_t checked = 0;
  for (uint32_t high = 0; high < (1u << 19); ++high)  // bits 13..31
    for (uint32_t low : f16_low) {
      const uint32_t u = (high << 13) | low;
      ASSERT_EQ(F16BitsFromF32Bits(u), FloatToF16(BitsToFloat(u))) << std::hex << u;
      ++checked;
    }
  for (uint32_t high = 0; high < (1u << 16); ++high)
    for (uint32_t low : bf16_low) {
      const uint32_t u = (high << 16) | low;
      ASSERT_EQ(Bf16BitsFromF32Bits(u), FloatToBf16(BitsToFloat(u))) << std::hex << u;
      ++checked;
    }
  std::mt19937 rng(FreshSeed());
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 1000000; ++i, ++checked) {
    const uint32_t u = any(rng);
    ASSERT_EQ(F16BitsFromF32Bits(u), FloatToF16(BitsToFloat(u))) << std::hex << u;
    ASSERT_EQ(Bf16BitsFromF32Bits(u), FloatToBf16(BitsToFloat(u))) << std::hex << u;
  }
  EXPECT_EQ(checked, (uint64_t{1} << 19) * 6 + (uint64_t{1} << 16) * 6 + 1000000);
}

TEST(KernelBackendsCpu, ConvertToStoreRejectsABadDTypeAndNullPointers) {
  const float src[2] = {1.0f, 2.0f};
  uint16_t dst[2] = {7, 7};
  ConvertToStoreParams p;
  p.n = 2;
  p.src = src;
  p.dst = dst;
  p.dtype = static_cast<DType>(9);
  EXPECT_EQ(ConvertToStore(p), KernelError::kBadDType);
  p.dtype = DType::kF16;
  p.src = nullptr;
  EXPECT_EQ(ConvertToStore(p), KernelError::kNullPointer);
  EXPECT_EQ(dst[0], 7);
  p.src = src;
  ASSERT_EQ(ConvertToStore(p), KernelError::kOk);
  EXPECT_EQ(dst[0], 0x3c00u);  // 1.0 in f16
  EXPECT_EQ(dst[1], 0x4000u);  // 2.0
}

// ---- transfers (device only: the twin is memcpy) -----------------------------------------------

TEST_P(KernelBackends, GatherAndBatchCopiesMoveChunksFromPinnedMemory) {
  if (!cuda()) GTEST_SKIP() << "the transfer kernels' CPU twin is memcpy; this test runs on the cuda backend";
#if KVTIER_HAVE_CUDA
  const int n = 9;
  for (size_t bytes : {size_t{16384}, size_t{65536 + 8}}) {  // 16-byte path and the byte path
    SCOPED_TRACE("bytes " + std::to_string(bytes) + " seed " + std::to_string(seed_));
    void* host = nullptr;
    ASSERT_EQ(cudaHostAlloc(&host, n * bytes, cudaHostAllocMapped), cudaSuccess);
    std::vector<uint8_t> want(n * bytes);
    for (auto& b : want) b = static_cast<uint8_t>(rng_());
    std::memcpy(host, want.data(), want.size());
    DeviceArena dev;
    uint8_t* pool = dev.Zeros<uint8_t>((n + 3) * bytes);
    ASSERT_EQ(cudaMemset(pool, 0xff, (n + 3) * bytes), cudaSuccess);
    std::vector<uint64_t> src(n), dst(n);
    std::vector<void*> dsts(n);
    std::vector<const void*> srcs(n);
    std::vector<size_t> sizes(n, bytes);
    for (int i = 0; i < n; ++i) {
      void* mapped = nullptr;
      ASSERT_EQ(cudaHostGetDevicePointer(&mapped, static_cast<uint8_t*>(host) + i * bytes, 0), cudaSuccess);
      src[i] = reinterpret_cast<uint64_t>(mapped);
      dst[i] = reinterpret_cast<uint64_t>(pool + static_cast<size_t>((i * 5) % (n + 3)) * bytes);
      dsts[i] = pool + static_cast<size_t>((i * 5) % (n + 3)) * bytes;
      srcs[i] = static_cast<uint8_t*>(host) + i * bytes;
    }
    cuda::GatherParams gp;
    gp.n_copies = n;
    gp.bytes = bytes;
    gp.src = dev.Put(src);
    gp.dst = dev.Put(dst);
    ASSERT_EQ(cuda::LaunchGatherCopies(gp, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
    std::vector<uint8_t> got(bytes);
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(cudaMemcpy(got.data(), dsts[i], bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(0, std::memcmp(got.data(), want.data() + i * bytes, bytes)) << "gather copy " << i;
    }
    // The batch call on a stream of its own, and the per-copy path the legacy default stream
    // takes (the driver refuses a batch there).
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    for (cudaStream_t s : {stream, cudaStream_t{nullptr}}) {
      SCOPED_TRACE(s == nullptr ? "legacy default stream" : "own stream");
      ASSERT_EQ(cudaMemset(pool, 0, (n + 3) * bytes), cudaSuccess);
      ASSERT_EQ(cuda::MemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, s), KernelError::kOk)
          << cuda::LastCudaErrorString();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (int i = 0; i < n; ++i) {
        ASSERT_EQ(cudaMemcpy(got.data(), dsts[i], bytes, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(0, std::memcmp(got.data(), want.data() + i * bytes, bytes)) << "batch copy " << i;
      }
    }
    cudaStreamDestroy(stream);
    cudaFreeHost(host);
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(All, KernelBackends, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& i) {
                           return std::string(i.param == Backend::kCpu ? "cpu" : "cuda");
                         });

}  // namespace
}  // namespace kvtier::kernels
