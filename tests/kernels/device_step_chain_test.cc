// The decode step's device kernels chained as the device step will chain them (docs/architecture.md,
// "The device decode step"), against the same step computed by the CPU twins and the host's
// budget allocator: per layer the probe from q, the chunk scores (Eq. 10), Eq. 11, Eq. 12's grant
// with the allocator's state in device memory, the top-B rows, the chunk table's slots (hits kept
// across steps, misses gathered from mapped pinned memory), and the attention over the local
// window and the slot list whose count only the device knows. Nothing in a step waits on the
// host; the test reads the outputs back after each step and compares them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/chunk_table.h"
#include "kernels/cpu/entropy.h"
#include "kernels/cpu/entropy_grant.h"
#include "kernels/cpu/probe.h"
#include "kernels/cpu/slot_attention.h"
#include "kernels/dtype.h"
#include "offload/device_sync.h"
#include "retrieval/budget.h"
#include "tests/device_test_util.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier {
namespace {

#if KVTIER_HAVE_CUDA
using device_test::DeviceArena;
using device_test::Get;
#endif

TEST(DeviceStepChain, KernelsChainedOnTheDeviceGiveTheHostStep) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
#else
  if (kernels::cuda::DeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  using kernels::KernelError;
  namespace kc = kernels::cuda;
  constexpr int kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 64, kRepr = 2, kTokens = 16, kLocal = 8;
  constexpr int kK = 4;       // chunks per layer and step (the budget), B_kv = L x k
  constexpr int kSlots = 24;  // the device pool: more than a step's usual selections, fewer than the chunks
  constexpr int kSteps = 40;
  const int n_chunks[kLayers] = {30, 41, 25};
  const int k_max = kLayers * kK;  // the most one layer can be granted
  const DType dt = DType::kF16;
  const size_t dsize = DTypeSize(dt);
  const size_t chunk_half = static_cast<size_t>(kTokens) * kKvHeads * kDim * dsize;
  std::mt19937 rng(44);
  std::normal_distribution<float> nd;
  auto half_bits = [&](size_t n, float scale) {
    std::vector<float> f(n);
    for (float& x : f) x = nd(rng) * scale;
    std::vector<uint16_t> h(n);
    FromFloat(dt, f.data(), h.data(), n);
    return h;
  };

  DeviceArena a;
  struct Layer {
    int n = 0;
    std::vector<uint16_t> keys;  // [kv_heads, n, repr, D] representatives
    std::vector<float> inv_norm;
    std::vector<uint16_t> chunk_k, chunk_v;  // [n][tokens, kv_heads, D]
    std::vector<uint16_t> local_k, local_v;  // [local, kv_heads, D]
    // device
    uint16_t *keys_d = nullptr, *local_k_d = nullptr, *local_v_d = nullptr;
    float* inv_d = nullptr;
    int32_t *offsets_d = nullptr, *n_d = nullptr;
    const void** src_k_d = nullptr;
    const void** src_v_d = nullptr;
    int64_t* first_d = nullptr;
  } layers[kLayers];
  for (int l = 0; l < kLayers; ++l) {
    Layer& L = layers[l];
    L.n = n_chunks[l];
    L.keys = half_bits(static_cast<size_t>(kKvHeads) * L.n * kRepr * kDim, 1.0f + l);
    L.inv_norm.resize(static_cast<size_t>(kKvHeads) * L.n * kRepr);
    std::vector<float> key(kDim);
    for (size_t r = 0; r < L.inv_norm.size(); ++r) {
      ToFloat(dt, L.keys.data() + r * kDim, key.data(), kDim);
      L.inv_norm[r] = kernels::InverseNorm(key.data(), kDim);
    }
    L.chunk_k = half_bits(static_cast<size_t>(L.n) * chunk_half / dsize, 1.0f);
    L.chunk_v = half_bits(L.chunk_k.size(), 1.0f);
    L.local_k = half_bits(static_cast<size_t>(kLocal) * kKvHeads * kDim, 1.0f);
    L.local_v = half_bits(L.local_k.size(), 1.0f);
    L.keys_d = a.Put(L.keys);
    L.inv_d = a.Put(L.inv_norm);
    L.local_k_d = a.Put(L.local_k);
    L.local_v_d = a.Put(L.local_v);
    L.offsets_d = a.Put(std::vector<int32_t>{0, L.n});
    L.n_d = a.Put(std::vector<int32_t>{L.n});
    // The chunks' warm copies: mapped pinned host memory the gather reads through UVA.
    auto* pinned = static_cast<uint8_t*>(a.Pinned(2 * L.n * chunk_half));
    ASSERT_NE(pinned, nullptr);
    std::vector<const void*> src_k(L.n), src_v(L.n);
    std::vector<int64_t> first(L.n);
    for (int c = 0; c < L.n; ++c) {
      uint8_t* ck = pinned + 2 * c * chunk_half;
      std::memcpy(ck, reinterpret_cast<const uint8_t*>(L.chunk_k.data()) + c * chunk_half, chunk_half);
      std::memcpy(ck + chunk_half, reinterpret_cast<const uint8_t*>(L.chunk_v.data()) + c * chunk_half,
                  chunk_half);
      void* mapped = nullptr;
      ASSERT_EQ(cudaHostGetDevicePointer(&mapped, ck, 0), cudaSuccess);
      src_k[c] = mapped;
      src_v[c] = static_cast<uint8_t*>(mapped) + chunk_half;
      first[c] = 4 + static_cast<int64_t>(c) * kTokens;
    }
    L.src_k_d = a.Put(src_k);
    L.src_v_d = a.Put(src_v);
    L.first_d = a.Put(first);
  }

  // The allocator's state in device memory, the chunk table, the pool, the per-layer scratch.
  std::vector<double> zeros_d(kLayers, 0.0);
  std::vector<int64_t> zeros_i(kLayers, 0);
  kernels::EntropyGrantState state;
  state.layers = kLayers;
  state.min_chunks = 1;
  state.theta_sum = a.Put(zeros_d);
  state.theta_count = a.Put(zeros_i);
  kernels::EntropyGrantState* state_d = a.Put(std::vector<kernels::EntropyGrantState>{state});
  int64_t* slot_owner = a.Put(std::vector<int64_t>(kSlots, kernels::kChunkTableFree));
  uint64_t* slot_stamp = a.Zeros<uint64_t>(kSlots);
  const int row_capacity = *std::max_element(n_chunks, n_chunks + kLayers);
  int32_t* row_slot = a.Put(std::vector<int32_t>(static_cast<size_t>(kLayers) * row_capacity, -1));
  int32_t* clock_hand = a.Zeros<int32_t>(1);
  uint8_t* pool_k = a.Zeros<uint8_t>(kSlots * chunk_half);
  uint8_t* pool_v = a.Zeros<uint8_t>(kSlots * chunk_half);
  int64_t* table_counters = a.Zeros<int64_t>(kernels::kChunkTableCounters);
  float* q_d = a.Zeros<float>(static_cast<size_t>(kLayers) * kQHeads * kDim);
  float* out_d = a.Zeros<float>(static_cast<size_t>(kLayers) * kQHeads * kDim);
  float* probe_d = a.Zeros<float>(kKvHeads * kDim);
  float* logit_d = a.Zeros<float>(row_capacity);
  float* cosine_d = a.Zeros<float>(row_capacity);
  double* theta_d = a.Zeros<double>(1);
  int32_t* non_finite_d = a.Zeros<int32_t>(1);
  int32_t* take_d = a.Zeros<int32_t>(1);
  int32_t* error_d = a.Zeros<int32_t>(1);
  int32_t* rows_d = a.Zeros<int32_t>(k_max);
  int32_t* slot_list_d = a.Zeros<int32_t>(k_max);
  int64_t* slot_first_d = a.Zeros<int64_t>(k_max);
  int32_t* n_slots_d = a.Zeros<int32_t>(1);
  int32_t* miss_slot_d = a.Zeros<int32_t>(k_max);
  int32_t* miss_row_d = a.Zeros<int32_t>(k_max);
  int32_t* n_misses_d = a.Zeros<int32_t>(1);
  size_t topk_bytes = 0;
  {
    kernels::SegmentedTopKParams probe_shape;
    probe_shape.n_segments = 1;
    const int32_t offsets[2] = {0, row_capacity}, k = 0;
    probe_shape.offsets = offsets;
    probe_shape.k = &k;
    ASSERT_EQ(kc::SegmentedTopKWorkspaceBytes(probe_shape, row_capacity, &topk_bytes), KernelError::kOk);
  }
  uint8_t* topk_ws = a.Zeros<uint8_t>(topk_bytes);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);

  // The host step: the twins and the host's allocator.
  auto budget = EntropyBudget::Make({1, ChunkRank::kLogit});
  ASSERT_TRUE(budget.ok());
  const kernels::ProbeShape shape{kQHeads, kKvHeads, kDim};
  int64_t table_before[kernels::kChunkTableCounters] = {};
  for (int step = 0; step < kSteps; ++step) {
    std::vector<std::vector<float> > q(kLayers, std::vector<float>(kQHeads * kDim));
    for (auto& ql : q)
      for (float& x : ql) x = nd(rng) * (step % 5 == 0 ? 3.0f : 1.0f);
    for (int l = 0; l < kLayers; ++l)
      ASSERT_EQ(cudaMemcpy(q_d + static_cast<size_t>(l) * kQHeads * kDim, q[l].data(), q[l].size() * 4,
                           cudaMemcpyHostToDevice),
                cudaSuccess);

    // ---- the device step: launches only ----
    const uint64_t syncs0 = HostSyncsTotal();
    ASSERT_EQ(kc::LaunchEntropyGrantBeginStep(state_d, kK, stream), KernelError::kOk);
    for (int l = 0; l < kLayers; ++l) {
      Layer& L = layers[l];
      const float* ql = q_d + static_cast<size_t>(l) * kQHeads * kDim;
      ASSERT_EQ(kc::LaunchMeanPoolProbe(shape, ql, 1, probe_d, stream), KernelError::kOk);
      kernels::ChunkScoreParams sp;
      sp.kv_heads = kKvHeads;
      sp.head_dim = kDim;
      sp.repr = kRepr;
      sp.dtype = dt;
      sp.fold = kernels::HeadFold::Kind::kMax;
      sp.n_chunks = L.n;
      sp.keys = L.keys_d;
      sp.inv_norm = L.inv_d;
      sp.probe = probe_d;
      sp.logit = logit_d;
      sp.cosine = cosine_d;
      ASSERT_EQ(kc::LaunchScoreChunks(sp, stream), KernelError::kOk);
      kernels::EntropyParams ep;
      ep.n_segments = 1;
      ep.offsets = L.offsets_d;
      ep.scores = cosine_d;
      ep.entropy = theta_d;
      ep.non_finite = non_finite_d;
      ASSERT_EQ(kc::LaunchSegmentEntropy(ep, stream), KernelError::kOk);
      kernels::EntropyGrantParams gp;
      gp.state = state_d;
      gp.layer = l;
      gp.n = L.n_d;
      gp.theta = theta_d;
      gp.non_finite = non_finite_d;
      gp.cap = kSlots;
      gp.take = take_d;
      gp.error = error_d;
      ASSERT_EQ(kc::LaunchEntropyGrant(gp, stream), KernelError::kOk);
      kernels::SegmentedTopKParams tp;  // the grant's take is the top-k's k: no host in between
      tp.n_segments = 1;
      tp.offsets = L.offsets_d;
      tp.scores = logit_d;
      tp.k = take_d;
      tp.k_max = k_max;
      tp.out_index = rows_d;
      ASSERT_EQ(kc::LaunchSegmentedTopK(tp, L.n, topk_ws, topk_bytes, stream), KernelError::kOk);
      kernels::ChunkTableParams cp;
      cp.slots = kSlots;
      cp.layers = kLayers;
      cp.row_capacity = row_capacity;
      cp.slot_owner = slot_owner;
      cp.slot_stamp = slot_stamp;
      cp.row_slot = row_slot;
      cp.clock_hand = clock_hand;
      cp.layer = l;
      cp.stamp = static_cast<uint64_t>(step) * kLayers + l + 1;
      cp.step_first_stamp = static_cast<uint64_t>(step) * kLayers + 1;
      cp.max_rows = k_max;
      cp.rows = rows_d;
      cp.n_rows = take_d;
      cp.src_k = L.src_k_d;
      cp.src_v = L.src_v_d;
      cp.first_position = L.first_d;
      cp.slot_list = slot_list_d;
      cp.slot_first_position = slot_first_d;
      cp.n_slots = n_slots_d;
      cp.miss_slot = miss_slot_d;
      cp.miss_row = miss_row_d;
      cp.n_misses = n_misses_d;
      cp.counters = table_counters;
      cp.chunk_bytes_k = chunk_half;
      cp.chunk_bytes_v = chunk_half;
      cp.pool_k = pool_k;
      cp.pool_v = pool_v;
      ASSERT_EQ(kc::LaunchChunkTableAssign(cp, stream), KernelError::kOk);
      ASSERT_EQ(kc::LaunchChunkTableGather(cp, stream), KernelError::kOk);
      kernels::SlotAttentionParams ap;
      ap.q_heads = kQHeads;
      ap.kv_heads = kKvHeads;
      ap.head_dim = kDim;
      ap.dtype = dt;
      ap.causal = false;
      ap.n_queries = 1;
      ap.q = ql;
      ap.dense[0].k = L.local_k_d;
      ap.dense[0].v = L.local_v_d;
      ap.dense[0].n_tokens = kLocal;
      ap.n_dense = 1;
      ap.pool_k = pool_k;
      ap.pool_v = pool_v;
      ap.pool_slots = kSlots;
      ap.slot_tokens = kTokens;
      ap.n_slots = k_max;  // the capacity; the count is the table's, on the device
      ap.n_slots_in_memory = n_slots_d;
      ap.slot_index = slot_list_d;
      ap.slot_first_position = slot_first_d;
      ap.out = out_d + static_cast<size_t>(l) * kQHeads * kDim;
      const size_t ws_bytes = kc::SlotAttentionWorkspaceBytes(ap);
      static uint8_t* attn_ws = nullptr;
      static size_t attn_ws_bytes = 0;
      if (ws_bytes > attn_ws_bytes) {
        attn_ws = a.Zeros<uint8_t>(ws_bytes);
        attn_ws_bytes = ws_bytes;
      }
      ASSERT_EQ(kc::LaunchSlotAttention(ap, attn_ws, attn_ws_bytes, stream), KernelError::kOk);
    }
    EXPECT_EQ(HostSyncsTotal(), syncs0) << "a launch of the step waited on the host";
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // the test's read-back, after the step
    const std::vector<float> out = Get(out_d, static_cast<size_t>(kLayers) * kQHeads * kDim);
    EXPECT_EQ(Get(error_d, 1)[0], 0) << "step " << step;

    // ---- the host step: the twins, the allocator, attention over the chunks' own copies ----
    budget->get()->BeginStep(kLayers, kK);
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE("step " + std::to_string(step) + ", layer " + std::to_string(l));
      Layer& L = layers[l];
      std::vector<float> probe(kKvHeads * kDim), logit(L.n), cosine(L.n);
      kernels::MeanPoolProbe(shape, q[l].data(), 1, probe.data());
      kernels::ChunkScoreParams sp;
      sp.kv_heads = kKvHeads;
      sp.head_dim = kDim;
      sp.repr = kRepr;
      sp.dtype = dt;
      sp.fold = kernels::HeadFold::Kind::kMax;
      sp.n_chunks = L.n;
      sp.keys = L.keys.data();
      sp.inv_norm = L.inv_norm.data();
      sp.probe = probe.data();
      sp.logit = logit.data();
      sp.cosine = cosine.data();
      ASSERT_EQ(kernels::ScoreChunks(sp), KernelError::kOk);
      const double theta = SoftmaxEntropy(cosine.data(), L.n);
      auto take = budget->get()->AllocateWithEntropy(l, L.n, theta);
      ASSERT_TRUE(take.ok());
      const int t = std::min(*take, kSlots);
      const int32_t offsets[2] = {0, L.n};
      std::vector<int32_t> rows(k_max);
      kernels::SegmentedTopKParams tp;
      tp.n_segments = 1;
      tp.offsets = offsets;
      tp.scores = logit.data();
      tp.k = &t;
      tp.k_max = k_max;
      tp.out_index = rows.data();
      ASSERT_EQ(kernels::SegmentedTopK(tp), KernelError::kOk);
      rows.resize(t);
      std::vector<int64_t> first(t);
      for (int i = 0; i < t; ++i) first[i] = 4 + static_cast<int64_t>(rows[i]) * kTokens;
      std::vector<float> expect(kQHeads * kDim);
      kernels::SlotAttentionParams ap;
      ap.q_heads = kQHeads;
      ap.kv_heads = kKvHeads;
      ap.head_dim = kDim;
      ap.dtype = dt;
      ap.causal = false;
      ap.n_queries = 1;
      ap.q = q[l].data();
      ap.dense[0].k = L.local_k.data();
      ap.dense[0].v = L.local_v.data();
      ap.dense[0].n_tokens = kLocal;
      ap.n_dense = 1;
      ap.pool_k = L.chunk_k.data();
      ap.pool_v = L.chunk_v.data();
      ap.pool_slots = L.n;
      ap.slot_tokens = kTokens;
      ap.n_slots = t;
      ap.slot_index = rows.data();
      ap.slot_first_position = first.data();
      ap.out = expect.data();
      ASSERT_EQ(kernels::SlotAttention(ap), KernelError::kOk);
      for (int i = 0; i < kQHeads * kDim; ++i)
        ASSERT_NEAR(out[static_cast<size_t>(l) * kQHeads * kDim + i], expect[i], 1e-4) << "element " << i;
    }
    // The device's allocator state followed the host's: B_kv left after the step.
    const kernels::EntropyGrantState s = Get(state_d, 1)[0];
    EXPECT_EQ(s.remaining, budget->get()->remaining()) << "step " << step;
  }
  // Chunks came back across steps from the device pool (hits), and others were gathered.
  const std::vector<int64_t> counters = Get(table_counters, kernels::kChunkTableCounters);
  EXPECT_GT(counters[kernels::kChunkTableHits], 0);
  EXPECT_GT(counters[kernels::kChunkTableMisses], 0);
  EXPECT_EQ(counters[kernels::kChunkTableInvalid], 0);
  EXPECT_EQ(counters[kernels::kChunkTableNoSource], 0);
  EXPECT_EQ(counters[kernels::kChunkTableOverflow], 0);
  (void)table_before;
  cudaStreamDestroy(stream);
#endif
}

}  // namespace
}  // namespace kvtier
