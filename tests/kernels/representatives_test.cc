// The seal's representatives as one flow for the host and the device
// (kernels/cpu/representatives.h): the twin gives the store's ChooseRepresentatives (kMass) keys
// and the Exact index's inverse norms, and the device kernel gives the twin's bits.
#include "kernels/cpu/representatives.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/chunk_score.h"
#include "kernels/dtype.h"
#include "offload/representatives.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier {
namespace {

using kernels::MassChoiceShape;
using kernels::MassRepresentativesParams;

struct Case {
  DType dtype;
  int kv_heads, head_dim, chunk_size, repr_topk, out_heads;
};

const Case kCases[] = {
    {DType::kF16, 2, 64, 32, 4, 2},
    {DType::kBF16, 2, 20, 16, 3, 4},  // a dot tail; query heads
    {DType::kF32, 1, 16, 8, 8, 1},
    {DType::kF16, 4, 32, 64, 1, 8},
};

// Chunks of random keys; out head h of chunk c gets mass when (c + h) % 3 != 0, else zeros (the
// fallback), and a few equal masses (ties go to the earlier token).
struct Chunks {
  MassChoiceShape shape;
  int n = 0;
  std::vector<std::vector<uint8_t>> keys;  // [n] [chunk_size, kv_heads, head_dim] storage bytes
  std::vector<float> mass;                 // [n, out_heads, chunk_size]
};

Chunks MakeChunks(const Case& cs, int n, uint32_t seed) {
  Chunks c;
  c.shape = MassChoiceShape{cs.dtype, cs.kv_heads, cs.head_dim, cs.chunk_size, cs.repr_topk, cs.out_heads};
  c.n = n;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  const size_t elems = static_cast<size_t>(cs.chunk_size) * cs.kv_heads * cs.head_dim;
  for (int i = 0; i < n; ++i) {
    std::vector<float> f(elems);
    for (float& x : f) x = nd(rng);
    std::vector<uint8_t> b(elems * DTypeSize(cs.dtype));
    FromFloat(cs.dtype, f.data(), b.data(), elems);
    c.keys.push_back(std::move(b));
    for (int h = 0; h < cs.out_heads; ++h)
      for (int t = 0; t < cs.chunk_size; ++t)
        c.mass.push_back((i + h) % 3 == 0 ? 0.0f : (t % 5 == 0 ? 0.75f : ud(rng)));
  }
  return c;
}

// The twin's rows for the chunks, [out_heads, stride, R] keys and inverse norms.
struct Rows {
  std::vector<uint8_t> keys;
  std::vector<float> inv_norm;
  std::vector<int> tokens;
};

Rows TwinRows(const Chunks& c, int64_t stride) {
  const MassChoiceShape& s = c.shape;
  Rows r;
  const size_t key_bytes = static_cast<size_t>(s.head_dim) * DTypeSize(s.dtype);
  r.keys.assign(static_cast<size_t>(s.out_heads) * stride * s.repr_topk * key_bytes, 0);
  r.inv_norm.assign(static_cast<size_t>(s.out_heads) * stride * s.repr_topk, 0.0f);
  r.tokens.assign(static_cast<size_t>(c.n) * s.out_heads * s.repr_topk, -1);
  std::vector<const void*> keys;
  for (const auto& k : c.keys) keys.push_back(k.data());
  std::vector<float> scratch(static_cast<size_t>(c.n) * s.out_heads * kernels::MassChoiceScratchFloats(s));
  MassRepresentativesParams p;
  p.shape = s;
  p.chunks = c.n;
  p.keys = keys.data();
  p.mass = c.mass.data();
  p.scratch = scratch.data();
  p.tokens = r.tokens.data();
  p.chunk_stride = stride;
  p.out_keys = r.keys.data();
  p.out_inv_norm = r.inv_norm.data();
  EXPECT_EQ(kernels::MassRepresentatives(p), kernels::KernelError::kOk);
  return r;
}

TEST(SealRepresentatives, TwinGivesTheStoresKeysAndTheIndexsInverseNorms) {
  for (const Case& cs : kCases) {
    const Chunks c = MakeChunks(cs, 3, 7 + cs.head_dim);
    const int64_t stride = 5;
    const Rows rows = TwinRows(c, stride);
    const MassChoiceShape& s = c.shape;
    const size_t key_bytes = static_cast<size_t>(s.head_dim) * DTypeSize(s.dtype);
    for (int i = 0; i < c.n; ++i) {
      RepresentativeInput in;
      in.geometry.layers = 1;
      in.geometry.q_heads = s.out_heads;
      in.geometry.kv_heads = s.kv_heads;
      in.geometry.head_dim = s.head_dim;
      in.geometry.dtype = s.dtype;
      in.chunk_size = s.chunk_size;
      in.repr_topk = s.repr_topk;
      in.out_heads = s.out_heads;
      in.keys = c.keys[static_cast<size_t>(i)].data();
      in.mass = c.mass.data() + static_cast<size_t>(i) * s.out_heads * s.chunk_size;
      in.mass_stride = static_cast<size_t>(s.chunk_size);
      in.choice = ReprChoice::kMass;
      std::vector<uint8_t> repr(static_cast<size_t>(s.repr_topk) * s.out_heads * key_bytes);
      ASSERT_TRUE(ChooseRepresentatives(in, repr.data()).ok());
      for (int h = 0; h < s.out_heads; ++h)
        for (int r = 0; r < s.repr_topk; ++r) {
          const size_t at = (static_cast<size_t>(h) * stride + i) * s.repr_topk + r;
          const uint8_t* want = repr.data() + (static_cast<size_t>(r) * s.out_heads + h) * key_bytes;
          EXPECT_EQ(std::memcmp(rows.keys.data() + at * key_bytes, want, key_bytes), 0)
              << DTypeName(s.dtype) << " chunk " << i << " head " << h << " r " << r;
          std::vector<float> f(static_cast<size_t>(s.head_dim));
          ToFloat(s.dtype, want, f.data(), f.size());
          const float inv = kernels::InverseNorm(f.data(), s.head_dim);  // what ExactChunkIndex::Add stores
          EXPECT_EQ(std::memcmp(&rows.inv_norm[at], &inv, sizeof inv), 0)
              << DTypeName(s.dtype) << " chunk " << i << " head " << h << " r " << r;
        }
    }
  }
}

TEST(SealRepresentatives, MassTiesGoToTheEarlierTokenAndNoMassTakesTheMostTypicalKey) {
  // One kv head of head_dim 2, four tokens; mass ties between tokens 1 and 3.
  const MassChoiceShape s{DType::kF32, 1, 2, 4, 2, 1};
  const float keys[] = {1, 0, 1, 0.2f, 1, -0.1f, 0, 1};  // k0 = x, k1 = x + 0.2y, k2 = x - 0.1y, k3 = y
  float scratch[2 * 4 + 2];
  int tokens[2] = {-1, -1};
  const float mass[] = {0.1f, 0.5f, 0.2f, 0.5f};
  EXPECT_TRUE(kernels::ChooseMassTokens(s, keys, mass, 0, scratch, tokens));
  EXPECT_EQ(tokens[0], 1);
  EXPECT_EQ(tokens[1], 3);
  // No statistics: the unit keys' sum m = (2.975, 1.097); cosines with it 0.938, 0.988, 0.899,
  // 0.346: the most typical keys are k1, then k0.
  const float zeros[] = {0, 0, 0, 0};
  EXPECT_FALSE(kernels::ChooseMassTokens(s, keys, zeros, 0, scratch, tokens));
  EXPECT_EQ(tokens[0], 1);
  EXPECT_EQ(tokens[1], 0);
  // Bad shapes and null pointers are named by the host check.
  MassRepresentativesParams p;
  p.shape = s;
  p.shape.repr_topk = 5;  // > chunk_size
  EXPECT_EQ(kernels::MassRepresentativesCheck(p), kernels::KernelError::kBadShape);
  p.shape = s;
  p.chunks = 1;
  p.chunk_stride = 1;
  EXPECT_EQ(kernels::MassRepresentativesCheck(p), kernels::KernelError::kNullPointer);
}

#if KVTIER_HAVE_CUDA
template <class T>
T* ToDevice(const T* host, size_t n, std::vector<void*>* owned) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, n * sizeof(T))), cudaSuccess);
  if (n > 0) EXPECT_EQ(cudaMemcpy(d, host, n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  owned->push_back(d);
  return static_cast<T*>(d);
}
#endif

TEST(SealRepresentatives, DeviceKernelGivesTheTwinsBits) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
#else
  if (kernels::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const Case& cs : kCases) {
    const Chunks c = MakeChunks(cs, 3, 11 + cs.chunk_size);
    const int64_t stride = 4;
    const Rows want = TwinRows(c, stride);
    const MassChoiceShape& s = c.shape;
    std::vector<void*> owned;
    std::vector<const void*> key_ptrs;
    for (const auto& k : c.keys) key_ptrs.push_back(ToDevice(k.data(), k.size(), &owned));
    MassRepresentativesParams p;
    p.shape = s;
    p.chunks = c.n;
    p.keys = ToDevice(key_ptrs.data(), key_ptrs.size(), &owned);
    p.mass = ToDevice(c.mass.data(), c.mass.size(), &owned);
    const std::vector<float> scratch(static_cast<size_t>(c.n) * s.out_heads *
                                     kernels::MassChoiceScratchFloats(s));
    p.scratch = ToDevice(scratch.data(), scratch.size(), &owned);
    const std::vector<int> tokens(want.tokens.size(), -1);
    p.tokens = ToDevice(tokens.data(), tokens.size(), &owned);
    p.chunk_stride = stride;
    const std::vector<uint8_t> zero_keys(want.keys.size(), 0);
    const std::vector<float> zero_inv(want.inv_norm.size(), 0.0f);
    p.out_keys = ToDevice(zero_keys.data(), zero_keys.size(), &owned);
    p.out_inv_norm = ToDevice(zero_inv.data(), zero_inv.size(), &owned);
    ASSERT_EQ(kernels::cuda::LaunchChooseMassRepresentatives(p, nullptr), kernels::KernelError::kOk);
    std::vector<uint8_t> got_keys(want.keys.size());
    std::vector<float> got_inv(want.inv_norm.size());
    std::vector<int> got_tokens(want.tokens.size());
    ASSERT_EQ(cudaMemcpy(got_keys.data(), p.out_keys, got_keys.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(
        cudaMemcpy(got_inv.data(), p.out_inv_norm, got_inv.size() * sizeof(float), cudaMemcpyDeviceToHost),
        cudaSuccess);
    ASSERT_EQ(
        cudaMemcpy(got_tokens.data(), p.tokens, got_tokens.size() * sizeof(int), cudaMemcpyDeviceToHost),
        cudaSuccess);
    EXPECT_EQ(got_tokens, want.tokens) << DTypeName(s.dtype);
    EXPECT_EQ(got_keys, want.keys) << DTypeName(s.dtype);
    EXPECT_EQ(std::memcmp(got_inv.data(), want.inv_norm.data(), got_inv.size() * sizeof(float)), 0)
        << DTypeName(s.dtype);
    for (void* d : owned) cudaFree(d);
  }
#endif
}

}  // namespace
}  // namespace kvtier
