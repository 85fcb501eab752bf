// The attention backend seam (offload/attention_backend.h): Session::Attend builds a plan
// and runs it on the backend of the hot tier's device. Checked here, on any machine:
//  * the CPU backend's plan path gives Session::Attend bit for bit the attention of the
//    hand-written sequence (Gather's parts, sinks | chunks | local, through kernels::Attention;
//    a prefill window that feeds the statistics as sinks | local and chunks, LSE-merged),
//    with GQA, prefill windows and decode steps, chunks coming back from a disk tier, in both
//    position modes;
//  * the host-side logic the CUDA backend rests on: span -> slot mapping, the [K][V] slot as
//    two index-sharing half pools, plan validation with named statuses, workspace layout and
//    its bound (in CUDA builds, against the launcher's own query, which needs no device);
//  * the CUDA backend is refused with a status for a "cuda" tier it cannot use.
// Whether the CUDA backend computes the right numbers needs a GPU: the Session case at the
// end skips without one, and none of it has run.
#include "offload/attention_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/session_internal.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/slot_attention.h"
#include "kernels/dtype.h"
#include "kvtier/session.h"
#include "offload/hot_tier.h"
#include "offload/tiered_store.h"
#include "tests/tiered_store_test_peer.h"
#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier {
namespace {

constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 32;

StoreOptions Store(const std::string& data_dir) {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, DType::kF16};
  so.n_sink = 8;
  so.n_local = 32;
  so.chunk_size = 8;
  so.repr_topk = 2;
  so.hot_bytes = 64 * so.chunk_bytes();
  // Small warm tier: most chunks leave it for the disk tier and come back from there.
  so.warm_bytes = 24 * so.chunk_bytes();
  so.data_dir = data_dir;
  return so;
}

struct Token {
  std::vector<uint16_t> k, v;
  std::vector<float> q;
};
Token MakeToken(int layer, int64_t pos) {
  std::mt19937 rng(static_cast<uint32_t>(layer) * 7919u + static_cast<uint32_t>(pos) * 31u + 5u);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> k(kKvHeads * kDim), v(k.size());
  const bool needle = pos >= 60 && pos < 68;
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = n(rng) + (needle ? 3.0f * std::sin(0.3f * static_cast<float>(i)) : 0.0f);
    v[i] = n(rng);
  }
  Token t;
  t.q.resize(kQHeads * kDim);
  for (int i = 0; i < kQHeads * kDim; ++i)
    t.q[i] = n(rng) + (pos >= 150 ? 3.0f * std::sin(0.3f * static_cast<float>(i % (kKvHeads * kDim))) : 0.0f);
  t.k.resize(k.size());
  t.v.resize(v.size());
  FromFloat(DType::kF16, k.data(), t.k.data(), k.size());
  FromFloat(DType::kF16, v.data(), t.v.data(), v.size());
  return t;
}

// The attention Session::Attend computes, over Gather's parts: one pass over sinks | chunks |
// local, or, for a prefill window whose attention also gives the representative-key
// statistics (`observed`), sinks | local and the chunks apart, merged by log-sum-exp.
std::vector<float> HandWritten(LayerParts& lp, const float* q, const int64_t* pos, int m, bool infllm,
                               bool observed) {
  const Geometry g{kLayers, kQHeads, kKvHeads, kDim, DType::kF16};
  std::vector<float> out(static_cast<size_t>(m) * kQHeads * kDim);
  kernels::AttentionParams ap;
  ap.q_heads = kQHeads;
  ap.kv_heads = kKvHeads;
  ap.head_dim = kDim;
  ap.dtype = DType::kF16;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  ap.n_queries = m;
  ap.q = q;
  ap.q_positions = pos;
  ap.out = out.data();
  std::vector<kernels::KvSpan> parts = lp.parts;
  std::vector<std::vector<float>> rk(parts.size()), rv(parts.size());
  std::vector<float> qr;
  if (infllm) {
    const std::vector<double> inv = kernels::RopeInvFreq(kDim, 10000.0);
    qr.assign(q, q + static_cast<size_t>(m) * kQHeads * kDim);
    kernels::Rope(qr.data(), m, kQHeads, kDim, pos, inv.data());
    ap.q = qr.data();
    for (size_t i = 0; i < parts.size(); ++i) {
      const size_t n = static_cast<size_t>(parts[i].n_tokens) * g.token_elems();
      rk[i].resize(n);
      rv[i].resize(n);
      if (n > 0) {
        ToFloat(DType::kF16, parts[i].k, rk[i].data(), n);
        ToFloat(DType::kF16, parts[i].v, rv[i].data(), n);
        std::vector<int64_t> p(static_cast<size_t>(parts[i].n_tokens));
        for (int t = 0; t < parts[i].n_tokens; ++t)
          p[t] = lp.rope_positions[i] >= 0 ? lp.rope_positions[i] : parts[i].first_position + t;
        kernels::Rope(rk[i].data(), parts[i].n_tokens, kKvHeads, kDim, p.data(), inv.data());
      }
      parts[i].k = rk[i].data();
      parts[i].v = rv[i].data();
    }
    ap.dtype = DType::kF32;
  }
  if (observed && lp.n_chunks > 0) {
    std::vector<kernels::KvSpan> dense{parts[0]};
    dense.insert(dense.end(), parts.begin() + 1 + static_cast<ptrdiff_t>(lp.n_chunks), parts.end());
    const size_t rows = static_cast<size_t>(m) * kQHeads;
    std::vector<float> out_d(out.size()), out_c(out.size()), lse_d(rows), lse_c(rows), lse(rows);
    ap.parts = dense.data();
    ap.n_parts = static_cast<int>(dense.size());
    ap.out = out_d.data();
    ap.lse = lse_d.data();
    EXPECT_EQ(kernels::Attention(ap), kernels::KernelError::kOk);
    ap.parts = parts.data() + 1;
    ap.n_parts = static_cast<int>(lp.n_chunks);
    ap.out = out_c.data();
    ap.lse = lse_c.data();
    EXPECT_EQ(kernels::Attention(ap), kernels::KernelError::kOk);
    kernels::MergeAttentionStates(static_cast<int>(rows), kDim, out_d.data(), lse_d.data(), out_c.data(),
                                  lse_c.data(), out.data(), lse.data());
    return out;
  }
  ap.parts = parts.data();
  ap.n_parts = static_cast<int>(parts.size());
  EXPECT_EQ(kernels::Attention(ap), kernels::KernelError::kOk);
  return out;
}

void PlanPathEqualsHandWritten(PositionMode mode) {
  const std::string dir =
      std::string(KVTIER_BINARY_DIR) + "/attention_backend_test_data_" + PositionModeName(mode);
  std::filesystem::remove_all(dir);
  auto store = TieredStore::Open(Store(dir));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  SessionOptions so;
  so.retrieval.budget_tokens = 24;
  so.positions = mode;
  auto a = Session::Open(store->get(), so);  // Attend: the plan on the CPU backend
  auto b = Session::Open(store->get(), so);  // Gather + the hand-written attention
  ASSERT_TRUE(a.ok() && b.ok());
  int compared = 0, with_chunks = 0, prefill_windows = 0;
  const int64_t prefill = 160, total = 220;
  for (int64_t p0 = 0; p0 < total;) {
    const bool decode = p0 >= prefill;
    const int m = decode ? 1 : static_cast<int>(std::min<int64_t>(12, prefill - p0));
    ASSERT_TRUE((*a)->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill).ok());
    ASSERT_TRUE((*b)->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill).ok());
    std::vector<int64_t> pos(m);
    for (int t = 0; t < m; ++t) pos[t] = p0 + t;
    for (int l = 0; l < kLayers; ++l) {
      std::vector<uint16_t> k, v;
      std::vector<float> q;
      for (int t = 0; t < m; ++t) {
        Token tok = MakeToken(l, p0 + t);
        k.insert(k.end(), tok.k.begin(), tok.k.end());
        v.insert(v.end(), tok.v.begin(), tok.v.end());
        q.insert(q.end(), tok.q.begin(), tok.q.end());
      }
      ASSERT_TRUE((*a)->Append(l, k.data(), v.data(), m, DType::kF16).ok());
      ASSERT_TRUE((*b)->Append(l, k.data(), v.data(), m, DType::kF16).ok());
      std::vector<float> out(q.size(), std::nanf(""));
      AttendStats st;
      Status s = (*a)->Attend(l, q.data(), pos.data(), m, out.data(), &st);
      ASSERT_TRUE(s.ok()) << s.ToString();
      auto lp = ImplOf(**b).Gather(l, q.data(), pos.data(), m);
      ASSERT_TRUE(lp.ok()) << lp.status().ToString();
      const std::vector<float> ref =
          HandWritten(*lp, q.data(), pos.data(), m, mode == PositionMode::kInfLLM, /*observed=*/!decode);
      lp->Release();
      ASSERT_EQ((*a)->last_chunks()[l], (*b)->last_chunks()[l]) << "position " << p0 << " layer " << l;
      ASSERT_EQ(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)), 0)
          << PositionModeName(mode) << " position " << p0 << " layer " << l << " m " << m;
      ++compared;
      with_chunks += st.chunks > 0 ? 1 : 0;
      prefill_windows += m > 1 ? 1 : 0;
    }
    p0 += m;
  }
  EXPECT_GT(with_chunks, 40);      // retrieval fetched chunks into slots
  EXPECT_GT(prefill_windows, 10);  // windows of several queries, causal inside the local part
  EXPECT_GT((*store)->counters().cold_writes, 0u);
  EXPECT_GT(compared, 100);
  ASSERT_TRUE((*a)->Drop().ok());
  ASSERT_TRUE((*b)->Drop().ok());
}

TEST(AttentionBackend, SessionPlanOnCpuEqualsHandWrittenAttentionAbsolute) {
  PlanPathEqualsHandWritten(PositionMode::kAbsolute);
}

TEST(AttentionBackend, SessionPlanOnCpuEqualsHandWrittenAttentionInfLLM) {
  PlanPathEqualsHandWritten(PositionMode::kInfLLM);
}

// ---- host-side logic ------------------------------------------------------------------------

// The dense attention the store's statistics, the Session's and `kvtier run`'s baselines run:
// every field from the geometry and the arguments, the scale 1/sqrt(head_dim), causal.
TEST(AttentionBackend, DenseAttentionParamsTakeTheGeometrysHeads) {
  const Geometry g{2, 8, 2, 64, DType::kF16};
  const float q[1] = {0.0f};
  const int64_t pos[1] = {7};
  const kernels::KvSpan parts[2] = {};
  float out[1];
  const kernels::AttentionParams p = DenseAttentionParams(g, DType::kF32, q, pos, 3, parts, 2, out);
  EXPECT_EQ(p.q_heads, 8);
  EXPECT_EQ(p.kv_heads, 2);
  EXPECT_EQ(p.head_dim, 64);
  EXPECT_EQ(p.dtype, DType::kF32);  // the parts' dtype, not the geometry's
  EXPECT_FLOAT_EQ(p.scale, 0.125f);
  EXPECT_EQ(p.n_queries, 3);
  EXPECT_EQ(p.q, q);
  EXPECT_EQ(p.q_positions, pos);
  EXPECT_EQ(p.parts, parts);
  EXPECT_EQ(p.n_parts, 2);
  EXPECT_EQ(p.out, out);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_TRUE(p.causal);
}

TEST(AttentionBackend, SlotOfSpanMapsSlotStartsAndNamesEveryOtherSpan) {
  std::vector<uint8_t> pool(4 * 64);
  const HotPoolView view{pool.data(), 4, 64};
  kernels::KvSpan sp{pool.data() + 3 * 64, pool.data() + 3 * 64 + 32, 4, 100, nullptr};
  auto s = SlotOfSpan(view, sp, 0);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(*s, 3);
  sp.k = pool.data() + 64 + 8;  // inside a slot, not at its start
  sp.v = static_cast<const uint8_t*>(sp.k) + 32;
  EXPECT_EQ(SlotOfSpan(view, sp, 5).status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(SlotOfSpan(view, sp, 5).status().message().find("chunk span 5"), std::string::npos);
  sp.k = pool.data() + 4 * 64;  // one past the pool
  sp.v = pool.data() + 4 * 64 + 32;
  EXPECT_EQ(SlotOfSpan(view, sp, 0).status().code(), StatusCode::kInvalidArgument);
  sp.k = pool.data() + 64;  // V not the second half of K's slot
  sp.v = pool.data() + 2 * 64;
  auto bad_v = SlotOfSpan(view, sp, 1);
  EXPECT_EQ(bad_v.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_v.status().message().find("second half"), std::string::npos) << bad_v.status().ToString();
  EXPECT_EQ(SlotOfSpan(HotPoolView{}, sp, 0).status().code(), StatusCode::kInvalidArgument);
}

// Random f16 K/V in a pool of [K][V] slots plus dense runs; a ragged selection that includes
// the last slot (the largest index the V half-pool may see).
TEST(AttentionBackend, PlanReadsKvSlotsThroughHalfPoolsBitForBitLikeTheParts) {
  constexpr int kChunk = 8, kCap = 6;
  const size_t tok = static_cast<size_t>(kKvHeads) * kDim;
  const size_t half = kChunk * tok * sizeof(uint16_t);
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  auto random_f16 = [&](size_t elems) {
    std::vector<float> f(elems);
    for (float& x : f) x = n(rng);
    std::vector<uint16_t> h(elems);
    FromFloat(DType::kF16, f.data(), h.data(), elems);
    return h;
  };
  std::vector<uint16_t> pool = random_f16(kCap * 2 * kChunk * tok);
  std::vector<uint16_t> sk = random_f16(4 * tok), sv = random_f16(4 * tok);
  std::vector<uint16_t> lk = random_f16(20 * tok), lv = random_f16(20 * tok);
  const auto* base = reinterpret_cast<const uint8_t*>(pool.data());
  const std::vector<int> chosen{5, 0, 3};
  std::vector<kernels::KvSpan> chunks;
  for (size_t i = 0; i < chosen.size(); ++i)
    chunks.push_back(kernels::KvSpan{base + chosen[i] * 2 * half, base + chosen[i] * 2 * half + half, kChunk,
                                     4 + static_cast<int64_t>(i) * kChunk, nullptr});
  const kernels::KvSpan sinks{sk.data(), sv.data(), 4, 0, nullptr};
  const kernels::KvSpan local[2] = {{lk.data(), lv.data(), 12, 28, nullptr},
                                    {lk.data() + 12 * tok, lv.data() + 12 * tok, 8, 40, nullptr}};
  const int m = 3;
  std::vector<float> q(static_cast<size_t>(m) * kQHeads * kDim);
  for (float& x : q) x = n(rng);
  const int64_t pos[m] = {45, 46, 47};

  AttentionPlanInput in;
  in.q_heads = kQHeads;
  in.kv_heads = kKvHeads;
  in.head_dim = kDim;
  in.dtype = DType::kF16;
  in.n_queries = m;
  in.q = q.data();
  in.positions = pos;
  in.sinks = sinks;
  in.chunks = chunks.data();
  in.n_chunks = chunks.size();
  in.local = local;
  in.n_local = 2;
  in.pool = HotPoolView{base, kCap, 2 * half};
  AttentionPlan plan;
  ASSERT_TRUE(plan.Build(in).ok());
  const kernels::SlotAttentionParams& p = plan.params();
  EXPECT_EQ(plan.slot_index(), (std::vector<int32_t>{10, 0, 6}));
  EXPECT_EQ(p.pool_k, base);
  EXPECT_EQ(p.pool_v, base + half);
  EXPECT_EQ(p.pool_slots, 2 * kCap - 1);
  EXPECT_EQ(p.n_dense, 3);
  EXPECT_EQ(p.n_leading_dense, 1);
  EXPECT_FLOAT_EQ(p.scale, 1.0f / std::sqrt(static_cast<float>(kDim)));
  EXPECT_EQ(p.out, nullptr);  // the backend's to set
  EXPECT_EQ(ValidateAttentionPlan(p, false).code(), StatusCode::kInvalidArgument);
  std::vector<float> out(q.size(), std::nanf(""));
  kernels::SlotAttentionParams with_out = p;
  with_out.out = out.data();
  EXPECT_TRUE(ValidateAttentionPlan(with_out, /*cuda=*/false).ok());

  auto backend = MakeAttentionBackend(MakeHotTier(Device::kCpu, 4 * 2 * half, 2 * half)->get(),
                                      Geometry{1, kQHeads, kKvHeads, kDim, DType::kF16}, 1);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  EXPECT_STREQ((*backend)->name(), "cpu");
  ASSERT_TRUE((*backend)->Run(plan, out.data()).ok());

  std::vector<kernels::KvSpan> parts{sinks};
  parts.insert(parts.end(), chunks.begin(), chunks.end());
  parts.push_back(local[0]);
  parts.push_back(local[1]);
  std::vector<float> ref(q.size());
  kernels::AttentionParams ap;
  ap.q_heads = kQHeads;
  ap.kv_heads = kKvHeads;
  ap.head_dim = kDim;
  ap.dtype = DType::kF16;
  ap.scale = p.scale;
  ap.n_queries = m;
  ap.q = q.data();
  ap.q_positions = pos;
  ap.parts = parts.data();
  ap.n_parts = static_cast<int>(parts.size());
  ap.out = ref.data();
  ASSERT_EQ(kernels::Attention(ap), kernels::KernelError::kOk);
  EXPECT_EQ(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)), 0);

  // A span that is not a slot of the pool cannot be planned.
  chunks[1].k = base + half;
  EXPECT_EQ(plan.Build(in).code(), StatusCode::kInvalidArgument);
  chunks[1].k = base;
  chunks[1].n_tokens = kChunk - 1;  // not one full slot
  EXPECT_EQ(plan.Build(in).code(), StatusCode::kInvalidArgument);
  chunks[1].n_tokens = kChunk;
  in.n_local = kernels::kMaxDenseParts;  // too many runs next to the sinks
  EXPECT_EQ(plan.Build(in).code(), StatusCode::kInvalidArgument);
}

// A plan whose keys are kept before RoPE: sinks, three chunks of a [K][V] slot pool and two
// local runs in host memory, queries at the end of the local window.
struct RotatingPlanCase {
  static constexpr int kChunk = 8, kCap = 6, kM = 3;
  DType dt;
  size_t tok = static_cast<size_t>(kKvHeads) * kDim, half = 0;
  std::vector<uint8_t> pool, sk, sv, lk, lv;
  std::vector<float> q;
  int64_t pos[kM] = {45, 46, 47};
  std::vector<double> inv_freq = kernels::RopeInvFreq(kDim, 10000.0);
  std::vector<kernels::KvSpan> chunks;
  kernels::KvSpan sinks, local[2];
  static constexpr int64_t kL0 = 28;  // the local window's start

  explicit RotatingPlanCase(DType dtype) : dt(dtype) {
    half = kChunk * tok * DTypeSize(dt);
    std::mt19937 rng(9);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto random = [&](size_t elems) {
      std::vector<float> f(elems);
      for (float& x : f) x = n(rng);
      std::vector<uint8_t> b(elems * DTypeSize(dt));
      FromFloat(dt, f.data(), b.data(), elems);
      return b;
    };
    pool = random(kCap * 2 * kChunk * tok);
    sk = random(4 * tok), sv = random(4 * tok), lk = random(20 * tok), lv = random(20 * tok);
    q.resize(static_cast<size_t>(kM) * kQHeads * kDim);
    for (float& x : q) x = n(rng);
    Place(pool.data(), sk.data(), sv.data(), lk.data(), lv.data());
  }
  // The spans over these bases (host copies, or device copies of the same bytes).
  void Place(const uint8_t* pool_base, const uint8_t* s_k, const uint8_t* s_v, const uint8_t* l_k,
             const uint8_t* l_v) {
    chunks.clear();
    const int chosen[3] = {5, 0, 3};
    for (int i = 0; i < 3; ++i)
      chunks.push_back(kernels::KvSpan{pool_base + chosen[i] * 2 * half,
                                       pool_base + chosen[i] * 2 * half + half, kChunk,
                                       4 + static_cast<int64_t>(i) * kChunk, nullptr});
    sinks = kernels::KvSpan{s_k, s_v, 4, 0, nullptr};
    const size_t run = 12 * tok * DTypeSize(dt);
    local[0] = kernels::KvSpan{l_k, l_v, 12, kL0, nullptr};
    local[1] = kernels::KvSpan{l_k + run, l_v + run, 8, kL0 + 12, nullptr};
  }
  AttentionPlanInput Input(const uint8_t* pool_base) const {
    AttentionPlanInput in;
    in.q_heads = kQHeads;
    in.kv_heads = kKvHeads;
    in.head_dim = kDim;
    in.dtype = dt;
    in.n_queries = kM;
    in.q = q.data();
    in.positions = pos;
    in.sinks = sinks;
    in.chunks = chunks.data();
    in.n_chunks = chunks.size();
    in.local = local;
    in.n_local = 2;
    in.pool = HotPoolView{pool_base, kCap, 2 * half};
    in.rope_inv_freq = inv_freq.data();
    in.sinks_rope_position = kL0;
    in.chunks_rope_position = kL0;
    return in;
  }
};

// Session::Attend's InfLLM path before the kernel rotated: fp32 copies rotated with
// kernels::Rope (sinks and chunks at L0, the local runs at their own positions), the chunks
// as a pool of their own, planned in kF32 without rotation.
struct PreRotated {
  std::vector<float> pool, parts[3];
  AttentionPlanInput in;
  std::vector<kernels::KvSpan> chunks;
  kernels::KvSpan sinks, local[2];

  explicit PreRotated(const RotatingPlanCase& c) {
    const size_t chunk_elems = RotatingPlanCase::kChunk * c.tok;
    auto copy = [&](const kernels::KvSpan& sp, float* k, float* v, bool at_l0) {
      const size_t n = static_cast<size_t>(sp.n_tokens) * c.tok;
      ToFloat(c.dt, sp.k, k, n);
      ToFloat(c.dt, sp.v, v, n);
      std::vector<int64_t> pos(static_cast<size_t>(sp.n_tokens));
      for (int t = 0; t < sp.n_tokens; ++t)
        pos[static_cast<size_t>(t)] = at_l0 ? c.kL0 : sp.first_position + t;
      kernels::Rope(k, sp.n_tokens, kKvHeads, kDim, pos.data(), c.inv_freq.data());
      kernels::KvSpan out = sp;
      out.k = k;
      out.v = v;
      return out;
    };
    pool.resize(c.chunks.size() * 2 * chunk_elems);
    for (size_t i = 0; i < c.chunks.size(); ++i) {
      float* k = pool.data() + i * 2 * chunk_elems;
      chunks.push_back(copy(c.chunks[i], k, k + chunk_elems, true));
    }
    const kernels::KvSpan* dense[3] = {&c.sinks, &c.local[0], &c.local[1]};
    kernels::KvSpan* mine[3] = {&sinks, &local[0], &local[1]};
    for (int i = 0; i < 3; ++i) {
      const size_t n = static_cast<size_t>(dense[i]->n_tokens) * c.tok;
      parts[i].resize(2 * n);
      *mine[i] = copy(*dense[i], parts[i].data(), parts[i].data() + n, i == 0);
    }
    in = c.Input(c.pool.data());
    in.dtype = DType::kF32;
    in.rope_inv_freq = nullptr;
    in.sinks_rope_position = in.chunks_rope_position = kernels::kRopeAtKeyPositions;
    in.sinks = sinks;
    in.chunks = chunks.data();
    in.local = local;
    in.pool = HotPoolView{reinterpret_cast<const uint8_t*>(pool.data()), static_cast<int32_t>(chunks.size()),
                          2 * chunk_elems * sizeof(float)};
  }
};

TEST(AttentionBackend, RotatingPlanOnCpuEqualsRopeOnFp32CopiesBitForBit) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    RotatingPlanCase c(dt);
    AttentionPlan plan, ref_plan;
    ASSERT_TRUE(plan.Build(c.Input(c.pool.data())).ok());
    EXPECT_EQ(plan.params().rope_inv_freq, c.inv_freq.data());
    EXPECT_EQ(plan.params().dense[0].rope_position, c.kL0);
    EXPECT_EQ(plan.params().dense[1].rope_position, kernels::kRopeAtKeyPositions);
    EXPECT_EQ(plan.params().slot_rope_position, c.kL0);
    PreRotated r(c);
    ASSERT_TRUE(ref_plan.Build(r.in).ok());
    auto backend = MakeAttentionBackend(MakeHotTier(Device::kCpu, 4 * 2 * c.half, 2 * c.half)->get(),
                                        Geometry{1, kQHeads, kKvHeads, kDim, dt}, 1);
    ASSERT_TRUE(backend.ok()) << backend.status().ToString();
    std::vector<float> out(c.q.size(), std::nanf("")), ref(c.q.size(), std::nanf(""));
    ASSERT_TRUE((*backend)->Run(plan, out.data()).ok());
    ASSERT_TRUE((*backend)->Run(ref_plan, ref.data()).ok());
    EXPECT_EQ(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)), 0);
    // The dense parts' statistics come from the rotated keys too.
    std::vector<float> mass[3], ref_mass[3];
    float* mp[3];
    float* rp[3];
    for (int i = 0; i < 3; ++i) {
      mass[i].assign(static_cast<size_t>(kKvHeads) * plan.params().dense[i].n_tokens, std::nanf(""));
      ref_mass[i].assign(mass[i].size(), std::nanf(""));
      mp[i] = mass[i].data();
      rp[i] = ref_mass[i].data();
    }
    ASSERT_TRUE((*backend)->RunWithDenseMass(plan, out.data(), mp).ok());
    ASSERT_TRUE((*backend)->RunWithDenseMass(ref_plan, ref.data(), rp).ok());
    EXPECT_EQ(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)), 0);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(mass[i], ref_mass[i]) << "dense part " << i;
  }
}

TEST(AttentionBackend, RotationErrorsAreNamed) {
  RotatingPlanCase c(DType::kF16);
  AttentionPlan plan;
  AttentionPlanInput in = c.Input(c.pool.data());
  in.rope_inv_freq = nullptr;  // positions set, nothing to rotate with
  Status s = plan.Build(in);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sinks_rope_position 28 is set but rope_inv_freq is null"), std::string::npos)
      << s.ToString();
  in.sinks_rope_position = kernels::kRopeAtKeyPositions;
  s = plan.Build(in);
  EXPECT_NE(s.message().find("chunks_rope_position 28"), std::string::npos) << s.ToString();
  in.chunks_rope_position = kernels::kRopeAtKeyPositions;
  EXPECT_TRUE(plan.Build(in).ok());  // no rotation at all: today's plan
  EXPECT_EQ(plan.params().rope_inv_freq, nullptr);
  in.rope_inv_freq = c.inv_freq.data();
  in.chunks_rope_position = -7;
  s = plan.Build(in);
  EXPECT_NE(s.message().find("chunks_rope_position -7"), std::string::npos) << s.ToString();
  in.chunks_rope_position = c.kL0;
  in.head_dim = 31;
  s = plan.Build(in);
  EXPECT_NE(s.message().find("head_dim 31 is odd"), std::string::npos) << s.ToString();
  in.head_dim = kDim;
  ASSERT_TRUE(plan.Build(in).ok());
  std::vector<float> out(c.q.size());
  kernels::SlotAttentionParams p = plan.params();
  p.out = out.data();
  EXPECT_TRUE(ValidateAttentionPlan(p, /*cuda=*/true).ok());
  p.dense[2].rope_position = -3;
  s = ValidateAttentionPlan(p, false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dense[2].rope_position -3"), std::string::npos) << s.ToString();
  p.dense[2].rope_position = kernels::kRopeAtKeyPositions;
  p.rope_inv_freq = nullptr;
  s = ValidateAttentionPlan(p, true);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("slot_rope_position 28 is set but rope_inv_freq is null"), std::string::npos)
      << s.ToString();
}

// q_rope_positions: the plan's queries as projected, rotated by the kernel, give the bits of the
// plan whose queries kernels::Rope rotated first (the CPU backend's twin rotates with Rope).
TEST(AttentionBackend, QueriesRotatedByTheKernelOnCpuEqualPreRotatedQueriesBitForBit) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    RotatingPlanCase c(dt);
    const int64_t q_rope[RotatingPlanCase::kM] = {1000, 1001, 1002};  // not the causal positions
    std::vector<float> rotated = c.q;
    kernels::Rope(rotated.data(), RotatingPlanCase::kM, kQHeads, kDim, q_rope, c.inv_freq.data());
    AttentionPlanInput in = c.Input(c.pool.data()), ref_in = in;
    in.q_rope_positions = q_rope;
    ref_in.q = rotated.data();
    AttentionPlan plan, ref_plan;
    ASSERT_TRUE(plan.Build(in).ok());
    ASSERT_TRUE(ref_plan.Build(ref_in).ok());
    EXPECT_EQ(plan.params().q_rope_positions, q_rope);
    auto backend = MakeAttentionBackend(MakeHotTier(Device::kCpu, 4 * 2 * c.half, 2 * c.half)->get(),
                                        Geometry{1, kQHeads, kKvHeads, kDim, dt}, 1);
    ASSERT_TRUE(backend.ok()) << backend.status().ToString();
    std::vector<float> out(c.q.size(), std::nanf("")), ref(c.q.size(), std::nanf(""));
    ASSERT_TRUE((*backend)->Run(plan, out.data()).ok());
    ASSERT_TRUE((*backend)->Run(ref_plan, ref.data()).ok());
    EXPECT_EQ(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)), 0);
    std::vector<float> mass(static_cast<size_t>(kKvHeads) * 4), ref_mass(mass.size());
    float* mp[3] = {mass.data(), nullptr, nullptr};
    float* rp[3] = {ref_mass.data(), nullptr, nullptr};
    ASSERT_TRUE((*backend)->RunWithDenseMass(plan, out.data(), mp).ok());
    ASSERT_TRUE((*backend)->RunWithDenseMass(ref_plan, ref.data(), rp).ok());
    EXPECT_EQ(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)), 0);
    EXPECT_EQ(mass, ref_mass);
  }
}

TEST(AttentionBackend, DeviceSlotListAndQueryRotationErrorsAreNamed) {
  RotatingPlanCase c(DType::kF16);
  // Stand-ins for device arrays: Build and ValidateAttentionPlan never read them.
  const int32_t index[4] = {10, 0, 6, 2};
  const int64_t first[4] = {4, 12, 20, 28};
  const int32_t count = 3;
  AttentionPlanInput in = c.Input(c.pool.data());
  in.chunks = nullptr;
  in.n_chunks = 0;
  auto refused = [&](const std::string& what) {
    AttentionPlan plan;
    const Status s = plan.Build(in);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s.ToString();
  };
  in.device_slot_count = &count;  // a count without a capacity
  refused("device_slot_count is set but device_slot_capacity is 0");
  in.device_slot_count = nullptr;
  in.device_slot_capacity = 4;
  in.device_slot_index = index;
  in.device_slot_first_position = first;
  refused("device_slot_capacity 4 without device_slot_count");
  in.device_slot_count = &count;
  in.device_slot_index = nullptr;
  refused("device_slot_index is null");
  in.device_slot_index = index;
  in.device_slot_first_position = nullptr;
  refused("device_slot_first_position is null");
  in.device_slot_first_position = first;
  in.device_slot_capacity = -1;
  refused("device_slot_capacity -1 is negative");
  in.device_slot_capacity = 4;
  in.chunks = c.chunks.data();
  in.n_chunks = c.chunks.size();
  refused("3 host chunk spans and a device slot list");
  in.chunks = nullptr;
  in.n_chunks = 0;
  in.pool.slot_bytes = 2 * c.half + 2;  // not whole tokens
  refused("do not hold whole tokens");
  in.pool.slot_bytes = 2 * c.half;
  const int64_t q_rope[RotatingPlanCase::kM] = {0, 1, 2};
  in.q_rope_positions = q_rope;
  in.rope_inv_freq = nullptr;
  in.sinks_rope_position = in.chunks_rope_position = kernels::kRopeAtKeyPositions;
  refused("q_rope_positions is set but rope_inv_freq is null");
  in.rope_inv_freq = c.inv_freq.data();
  AttentionPlan plan;
  ASSERT_TRUE(plan.Build(in).ok());
  EXPECT_TRUE(plan.slots_on_device());
  const kernels::SlotAttentionParams& p = plan.params();
  EXPECT_EQ(p.n_slots, 4);  // the capacity
  EXPECT_EQ(p.n_slots_in_memory, &count);
  EXPECT_EQ(p.slot_index, index);
  EXPECT_EQ(p.slot_first_position, first);
  EXPECT_EQ(p.slot_tokens, RotatingPlanCase::kChunk);
  EXPECT_EQ(p.pool_slots, 2 * RotatingPlanCase::kCap - 1);
  EXPECT_EQ(p.q_rope_positions, q_rope);
  std::vector<float> out(c.q.size());
  kernels::SlotAttentionParams with_out = p;
  with_out.out = out.data();
  EXPECT_TRUE(ValidateAttentionPlan(with_out, /*cuda=*/true, /*slots_on_device=*/true).ok());
  Status s = ValidateAttentionPlan(with_out, /*cuda=*/false, /*slots_on_device=*/true);
  EXPECT_NE(s.message().find("only the \"cuda\" backend runs it"), std::string::npos) << s.ToString();
  auto cpu = MakeAttentionBackend(MakeHotTier(Device::kCpu, 4 * 2 * c.half, 2 * c.half)->get(),
                                  Geometry{1, kQHeads, kKvHeads, kDim, DType::kF16}, 1);
  ASSERT_TRUE(cpu.ok());
  s = (*cpu)->Run(plan, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("device memory"), std::string::npos) << s.ToString();
  kernels::SlotAttentionParams no_count = with_out;
  no_count.n_slots_in_memory = nullptr;
  s = ValidateAttentionPlan(no_count, true, true);
  EXPECT_NE(s.message().find("without its device count"), std::string::npos) << s.ToString();
  kernels::SlotAttentionParams no_capacity = with_out;
  no_capacity.n_slots = 0;
  s = ValidateAttentionPlan(no_capacity, true, true);
  EXPECT_NE(s.message().find("no capacity (n_slots 0)"), std::string::npos) << s.ToString();
  // A count in host memory: the twin reads it (checked against the capacity), cuda refuses it.
  s = ValidateAttentionPlan(with_out, /*cuda=*/true, /*slots_on_device=*/false);
  EXPECT_NE(s.message().find("slot count in host memory"), std::string::npos) << s.ToString();
  const int32_t too_many = 5;
  with_out.n_slots_in_memory = &too_many;
  s = ValidateAttentionPlan(with_out, false, false);
  EXPECT_NE(s.message().find("slot count 5 outside [0, 4]"), std::string::npos) << s.ToString();
  with_out.n_slots_in_memory = &count;
  EXPECT_TRUE(ValidateAttentionPlan(with_out, false, false).ok());
  with_out.q_rope_positions = q_rope;
  with_out.rope_inv_freq = nullptr;
  with_out.dense[0].rope_position = with_out.slot_rope_position = kernels::kRopeAtKeyPositions;
  s = ValidateAttentionPlan(with_out, false, false);
  EXPECT_NE(s.message().find("q_rope_positions is set but rope_inv_freq is null"), std::string::npos)
      << s.ToString();
}

#if KVTIER_HAVE_CUDA
// The chunk half given as device arrays (a device slot list and its device count) on the "cuda"
// backend: with capacity == count, the bits of the host plan over the same chunks; with spare
// capacity (other slots past the count, which must not be read), the same attention up to the split
// layout; with the queries rotated in the kernel, the plan whose queries kernels::Rope rotated.
TEST(AttentionBackend, DeviceSlotListPlanOnTheCudaBackendEqualsTheHostPlan) {
  if (kernels::cuda::DeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    RotatingPlanCase c(dt);
    std::vector<void*> allocs;
    auto put = [&](const void* b, size_t bytes) {
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(bytes, 1)), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d, b, bytes, cudaMemcpyHostToDevice), cudaSuccess);
      allocs.push_back(d);
      return d;
    };
    auto put_bytes = [&](const std::vector<uint8_t>& b) {
      return static_cast<const uint8_t*>(put(b.data(), b.size()));
    };
    const uint8_t* d_pool = put_bytes(c.pool);
    c.Place(d_pool, put_bytes(c.sk), put_bytes(c.sv), put_bytes(c.lk), put_bytes(c.lv));
    auto tier = MakeHotTier(Device::kCuda, 4 * 2 * c.half, 2 * c.half);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    auto gpu = MakeAttentionBackend(tier->get(), Geometry{1, kQHeads, kKvHeads, kDim, dt}, 1);
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    const size_t n_out = c.q.size();
    auto* d_out = static_cast<float*>(put(std::vector<float>(n_out, std::nanf("")).data(), n_out * 4));
    auto run = [&](const AttentionPlan& plan, const float* q_device) {
      std::vector<float> got(n_out, std::nanf(""));
      const Status st = (*gpu)->RunOnDevice(plan, q_device, d_out, nullptr);
      EXPECT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(got.data(), d_out, n_out * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      return got;
    };
    AttentionPlan host_plan;
    ASSERT_TRUE(host_plan.Build(c.Input(d_pool)).ok());
    const std::vector<float> want = run(host_plan, nullptr);
    // The host plan's slot list, then two other slots of the pool past the count.
    std::vector<int32_t> index = host_plan.slot_index();
    std::vector<int64_t> first = host_plan.slot_first_position();
    index.push_back(KernelSlotIndex(1));
    index.push_back(KernelSlotIndex(2));
    first.push_back(60);
    first.push_back(68);
    const int32_t count = static_cast<int32_t>(c.chunks.size());
    AttentionPlanInput in = c.Input(d_pool);
    in.chunks = nullptr;
    in.n_chunks = 0;
    in.device_slot_index = static_cast<const int32_t*>(put(index.data(), index.size() * sizeof(int32_t)));
    in.device_slot_first_position =
        static_cast<const int64_t*>(put(first.data(), first.size() * sizeof(int64_t)));
    in.device_slot_count = static_cast<const int32_t*>(put(&count, sizeof(count)));
    in.device_slot_capacity = count;
    AttentionPlan dev_plan;
    ASSERT_TRUE(dev_plan.Build(in).ok());
    std::vector<float> got = run(dev_plan, nullptr);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), n_out * sizeof(float)), 0) << "capacity == count";
    auto worst = [&](const std::vector<float>& a, const std::vector<float>& b) {
      double w = 0;
      for (size_t i = 0; i < a.size(); ++i) w = std::max(w, static_cast<double>(std::fabs(a[i] - b[i])));
      return w;
    };
    in.device_slot_capacity = static_cast<int>(index.size());
    ASSERT_TRUE(dev_plan.Build(in).ok());
    got = run(dev_plan, nullptr);
    EXPECT_LE(worst(got, want), 1e-5) << "capacity " << index.size() << " > count " << count;
    // The mass path (dense half, slot half with the device count, merge) against the host plan's.
    std::vector<float> mass(static_cast<size_t>(kKvHeads) * 4), want_mass(mass.size());
    std::vector<float> host_out(n_out), want_host(n_out);
    float* mp[3] = {mass.data(), nullptr, nullptr};
    float* wp[3] = {want_mass.data(), nullptr, nullptr};
    ASSERT_TRUE((*gpu)->RunWithDenseMass(dev_plan, host_out.data(), mp).ok());
    ASSERT_TRUE((*gpu)->RunWithDenseMass(host_plan, want_host.data(), wp).ok());
    EXPECT_LE(worst(host_out, want_host), 1e-5);
    EXPECT_LE(worst(mass, want_mass), 1e-5);
    // Queries as projected on the device, rotated by the kernel: the plan whose q kernels::Rope
    // rotated (close: the host compiler may fuse Rope's products), and no host copy of q needed.
    const int64_t q_rope[RotatingPlanCase::kM] = {1000, 1001, 1002};
    std::vector<float> rotated = c.q;
    kernels::Rope(rotated.data(), RotatingPlanCase::kM, kQHeads, kDim, q_rope, c.inv_freq.data());
    AttentionPlanInput rot_ref = c.Input(d_pool);
    rot_ref.q = rotated.data();
    ASSERT_TRUE(host_plan.Build(rot_ref).ok());
    const std::vector<float> want_rot = run(host_plan, nullptr);
    in.q_rope_positions = q_rope;
    in.q = nullptr;  // RunOnDevice takes q_device
    ASSERT_TRUE(dev_plan.Build(in).ok());
    const auto* q_device = static_cast<const float*>(put(c.q.data(), n_out * sizeof(float)));
    got = run(dev_plan, q_device);
    EXPECT_LE(worst(got, want_rot), 1e-5);
    EXPECT_GT(worst(want, want_rot), 1e-3);  // the rotation matters
    for (void* d : allocs) cudaFree(d);
  }
}
#endif

#if KVTIER_HAVE_CUDA
TEST(AttentionBackend, RotatingPlanOnTheCudaBackendMatchesTheCpuBackend) {
  if (kernels::cuda::DeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    RotatingPlanCase c(dt);
    AttentionPlan host_plan, dev_plan;
    ASSERT_TRUE(host_plan.Build(c.Input(c.pool.data())).ok());
    // The same bytes on the device; the plan's host arrays (q, positions, inv_freq) stay host.
    std::vector<void*> allocs;
    auto put = [&](const std::vector<uint8_t>& b) {
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, b.size()), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d, b.data(), b.size(), cudaMemcpyHostToDevice), cudaSuccess);
      allocs.push_back(d);
      return static_cast<const uint8_t*>(d);
    };
    const uint8_t* d_pool = put(c.pool);
    c.Place(d_pool, put(c.sk), put(c.sv), put(c.lk), put(c.lv));
    ASSERT_TRUE(dev_plan.Build(c.Input(d_pool)).ok());
    auto tier = MakeHotTier(Device::kCuda, 4 * 2 * c.half, 2 * c.half);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    auto cpu = MakeAttentionBackend(MakeHotTier(Device::kCpu, 4 * 2 * c.half, 2 * c.half)->get(),
                                    Geometry{1, kQHeads, kKvHeads, kDim, dt}, 1);
    auto gpu = MakeAttentionBackend(tier->get(), Geometry{1, kQHeads, kKvHeads, kDim, dt}, 1);
    ASSERT_TRUE(cpu.ok() && gpu.ok()) << gpu.status().ToString();
    std::vector<float> want(c.q.size()), got(c.q.size(), std::nanf(""));
    auto worst = [&] {
      double w = 0;
      for (size_t i = 0; i < want.size(); ++i)
        w = std::max(w, static_cast<double>(std::fabs(want[i] - got[i])));
      return w;
    };
    ASSERT_TRUE((*cpu)->Run(host_plan, want.data()).ok());
    Status st = (*gpu)->Run(dev_plan, got.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_LE(worst(), 1e-4);
    // Other frequencies: the device copy follows them.
    c.inv_freq = kernels::RopeInvFreq(kDim, 500000.0);
    ASSERT_TRUE(dev_plan.Build(c.Input(d_pool)).ok());
    c.Place(c.pool.data(), c.sk.data(), c.sv.data(), c.lk.data(), c.lv.data());
    ASSERT_TRUE(host_plan.Build(c.Input(c.pool.data())).ok());
    ASSERT_TRUE((*cpu)->Run(host_plan, want.data()).ok());
    ASSERT_TRUE((*gpu)->Run(dev_plan, got.data()).ok());
    EXPECT_LE(worst(), 1e-4);
    // With the dense parts' statistics (two launches and a merge).
    std::vector<float> mass[3], gmass[3];
    float* mp[3];
    float* gp[3];
    for (int i = 0; i < 3; ++i) {
      mass[i].assign(static_cast<size_t>(kKvHeads) * host_plan.params().dense[i].n_tokens, 0.0f);
      gmass[i].assign(mass[i].size(), std::nanf(""));
      mp[i] = mass[i].data();
      gp[i] = gmass[i].data();
    }
    ASSERT_TRUE((*cpu)->RunWithDenseMass(host_plan, want.data(), mp).ok());
    st = (*gpu)->RunWithDenseMass(dev_plan, got.data(), gp);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_LE(worst(), 1e-4);
    for (int i = 0; i < 3; ++i)
      for (size_t j = 0; j < mass[i].size(); ++j) EXPECT_NEAR(gmass[i][j], mass[i][j], 1e-4) << i << " " << j;
    for (void* d : allocs) cudaFree(d);
  }
}
#endif

TEST(AttentionBackend, ValidationNamesBadGeometry) {
  kernels::SlotAttentionParams p;
  p.q_heads = 6;
  p.kv_heads = 4;  // not a divisor
  p.head_dim = 64;
  p.dtype = DType::kF16;
  Status s = ValidateAttentionPlan(p, false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("multiple of kv_heads"), std::string::npos) << s.ToString();
  p.q_heads = 8;
  EXPECT_TRUE(ValidateAttentionPlan(p, false).ok());  // no queries: nothing else to check
  // The CUDA kernel has an instance per head_dim in {16, 32, 64, 128, 256} (16: kvtier-tiny);
  // the CPU twin takes any. A refusal names the head_dim and the ones the kernel takes.
  for (int d : {16, 32, 64, 128, 256}) {
    p.head_dim = d;
    EXPECT_TRUE(ValidateAttentionPlan(p, /*cuda=*/true).ok()) << d;
  }
  for (int d : {8, 48, 96, 512}) {
    p.head_dim = d;
    EXPECT_TRUE(ValidateAttentionPlan(p, false).ok()) << d;
    s = ValidateAttentionPlan(p, /*cuda=*/true);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << d;
    EXPECT_NE(s.message().find("head_dim " + std::to_string(d) + ":"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("16, 32, 64, 128 or 256"), std::string::npos) << s.ToString();
  }
  p.head_dim = 64;
  p.n_queries = 70000;
  s = ValidateAttentionPlan(p, true);
  EXPECT_NE(s.message().find("65535"), std::string::npos) << s.ToString();
  p.n_queries = 1;
  std::vector<float> q(8 * 64), out(q.size());
  int64_t pos = 0;
  p.q = q.data();
  p.q_positions = &pos;
  s = ValidateAttentionPlan(p, false);  // out missing
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("null pointer"), std::string::npos) << s.ToString();
  p.out = out.data();
  std::vector<uint8_t> pool(1024);
  const int32_t idx[2] = {0, 3};
  const int64_t first[2] = {0, 8};
  p.pool_k = pool.data();
  p.pool_v = pool.data();
  p.pool_slots = 3;
  p.slot_tokens = 1;
  p.n_slots = 2;
  p.slot_index = idx;
  p.slot_first_position = first;
  s = ValidateAttentionPlan(p, true);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("slot index 3 (entry 1)"), std::string::npos) << s.ToString();
  p.n_leading_dense = 2;  // more leading parts than dense parts
  EXPECT_EQ(ValidateAttentionPlan(p, false).code(), StatusCode::kInvalidArgument);
}

TEST(AttentionBackend, WorkspaceLayoutIsAlignedDisjointAndCoversItsParts) {
  for (int m : {1, 3, 64}) {
    for (int slots : {0, 1, 37}) {
      const CudaAttentionWorkspace w = LayoutCudaAttentionWorkspace(m, 32, 128, slots);
      const size_t rows = static_cast<size_t>(m) * 32 * 128 * sizeof(float);
      const size_t offs[] = {w.q, w.positions, w.slot_index, w.slot_first, w.out, w.total};
      const size_t need[] = {rows, m * sizeof(int64_t), slots * sizeof(int32_t), slots * sizeof(int64_t),
                             rows};
      for (int i = 0; i < 5; ++i) {
        EXPECT_EQ(offs[i] % 256, 0u) << i;
        EXPECT_GE(offs[i + 1] - offs[i], need[i]) << "part " << i << " m " << m << " slots " << slots;
      }
    }
  }
  // The queries' rotation positions sit before the output; without them no offset moves.
  const CudaAttentionWorkspace plain = LayoutCudaAttentionWorkspace(3, 32, 128, 5);
  const CudaAttentionWorkspace rope = LayoutCudaAttentionWorkspace(3, 32, 128, 5, 3);
  EXPECT_EQ(plain.q_rope_positions, plain.out);
  EXPECT_EQ(rope.q_rope_positions, plain.out);
  EXPECT_GE(rope.out - rope.q_rope_positions, 3 * sizeof(int64_t));
  EXPECT_EQ(rope.out % 256, 0u);
  EXPECT_EQ(rope.total - rope.out, plain.total - plain.out);
  EXPECT_EQ(MaxSlotAttentionKernelBytes(0, 32, 128), 0u);
  EXPECT_GE(MaxSlotAttentionKernelBytes(1, 32, 128), 4096u + 64u * 32 * 129 * sizeof(float));
}

#if KVTIER_HAVE_CUDA
TEST(AttentionBackend, KernelWorkspaceBoundCoversTheLaunchersQuery) {
  // SlotAttentionWorkspaceBytes is host code (no device needed): the bound a backend sizes
  // its workspace with at creation must cover it for every step shape.
  std::vector<uint8_t> pool(64);
  std::vector<int32_t> idx(200, 0);
  std::vector<int64_t> first(200, 0);
  std::vector<float> q(64 * 32 * 128), out(q.size());
  std::vector<int64_t> pos(64, 1 << 20);
  for (int m : {1, 2, 16, 64})
    for (int slots : {0, 1, 8, 200})
      for (int dense_tokens : {0, 40, 5000}) {
        kernels::SlotAttentionParams p;
        p.q_heads = 32;
        p.kv_heads = 8;
        p.head_dim = 128;
        p.dtype = DType::kBF16;
        p.n_queries = m;
        p.q = q.data();
        p.q_positions = pos.data();
        p.out = out.data();
        p.dense[0] = kernels::DenseKv{pool.data(), pool.data(), dense_tokens, 0, nullptr};
        p.n_dense = 1;
        p.pool_k = pool.data();
        p.pool_v = pool.data();
        p.pool_slots = 1;
        p.slot_tokens = 32;
        p.n_slots = slots;
        p.slot_index = idx.data();
        p.slot_first_position = first.data();
        EXPECT_LE(kernels::cuda::SlotAttentionWorkspaceBytes(p), MaxSlotAttentionKernelBytes(m, 32, 128))
            << "m " << m << " slots " << slots << " dense " << dense_tokens;
      }
}
#endif

// Host memory that calls itself "cuda": not kvtier's CudaHotTier, so no backend can run on
// it; Session::Open says so instead of reading it.
class ClaimsCuda final : public ForwardingHotTier {
 public:
  using ForwardingHotTier::ForwardingHotTier;
  Device device() const override { return Device::kCuda; }
};

TEST(AttentionBackend, SessionOnADeviceTierWithoutABackendIsRefusedWithAStatus) {
  StoreOptions o = Store("");
  o.warm_bytes = 256 * o.chunk_bytes();
  StoreHooks hooks;
  hooks.hot_tier_factory = [](size_t pool, size_t slot) -> Result<std::unique_ptr<HotTier>> {
    KVTIER_ASSIGN_OR_RETURN(auto inner, MakeHotTier(Device::kCpu, pool, slot));
    return std::unique_ptr<HotTier>(std::make_unique<ClaimsCuda>(std::move(inner)));
  };
  auto store = TieredStore::Open(o, hooks);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  SessionOptions so;
  so.retrieval.budget_tokens = 24;  // within the pool: the backend is what refuses
  auto s = Session::Open(store->get(), so);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().ToString();
  EXPECT_NE(s.status().message().find("attention backend"), std::string::npos) << s.status().ToString();
  SessionOptions inf = so;  // infllm positions are no longer refused on a device tier: the backend is
  inf.positions = PositionMode::kInfLLM;
  auto s2 = Session::Open(store->get(), inf);
  ASSERT_FALSE(s2.ok());
  EXPECT_EQ(s2.status().code(), StatusCode::kUnavailable) << s2.status().ToString();
  // Open leaves no sequence behind when the session cannot be made.
  EXPECT_TRUE((*store)->ListSequences().empty());
}

#if KVTIER_HAVE_CUDA
TEST(AttentionBackend, SessionOnTheCudaTierMatchesTheHostTier) {
  if (kernels::cuda::DeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  // head_dim 16 (kvtier-tiny's: half the lanes idle) and 64. Same data, same retrieval: the
  // same chunks, and outputs within f16 storage / fp32 accumulation distance (different
  // summation order).
  // Both position modes: with infllm the keys are stored before RoPE and the attention kernel
  // rotates them where memory puts them (chunks and separated sinks at L0), on the device.
  for (const PositionMode mode : {PositionMode::kAbsolute, PositionMode::kInfLLM})
    for (const int dim : {16, 64}) {
      SCOPED_TRACE("head_dim " + std::to_string(dim) +
                   (mode == PositionMode::kInfLLM ? ", infllm" : ", absolute"));
      auto open = [dim](Device tier) {
        StoreOptions o = Store("");
        o.geometry.head_dim = dim;
        o.warm_bytes = 256 * o.chunk_bytes();
        o.device = tier;
        return TieredStore::Open(o);
      };
      auto host = open(Device::kCpu);
      auto cuda = open(Device::kCuda);
      ASSERT_TRUE(host.ok() && cuda.ok()) << cuda.status().ToString();
      SessionOptions so;
      so.retrieval.budget_tokens = 24;
      so.positions = mode;
      auto a = Session::Open(host->get(), so);
      auto b = Session::Open(cuda->get(), so);
      ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
      std::mt19937 rng(3);
      std::normal_distribution<float> n(0.0f, 1.0f);
      const size_t kv = static_cast<size_t>(kKvHeads) * dim, qe = static_cast<size_t>(kQHeads) * dim;
      double worst = 0;
      for (int64_t p = 0; p < 200; ++p) {
        ASSERT_TRUE((*a)->BeginStep(StepKind::kDecode).ok());
        ASSERT_TRUE((*b)->BeginStep(StepKind::kDecode).ok());
        for (int l = 0; l < kLayers; ++l) {
          std::vector<float> kf(kv), vf(kv), q(qe);
          for (float& x : kf) x = n(rng);
          for (float& x : vf) x = n(rng);
          for (float& x : q) x = n(rng);
          std::vector<uint16_t> k(kv), v(kv);
          FromFloat(DType::kF16, kf.data(), k.data(), kv);
          FromFloat(DType::kF16, vf.data(), v.data(), kv);
          ASSERT_TRUE((*a)->Append(l, k.data(), v.data(), 1, DType::kF16).ok());
          ASSERT_TRUE((*b)->Append(l, k.data(), v.data(), 1, DType::kF16).ok());
          std::vector<float> oa(qe), ob(qe, std::nanf(""));
          ASSERT_TRUE((*a)->Attend(l, q.data(), &p, 1, oa.data()).ok());
          Status st = (*b)->Attend(l, q.data(), &p, 1, ob.data());
          ASSERT_TRUE(st.ok()) << st.ToString();
          EXPECT_EQ((*a)->last_chunks()[l], (*b)->last_chunks()[l]);
          for (size_t i = 0; i < qe; ++i)
            worst = std::max(worst, static_cast<double>(std::fabs(oa[i] - ob[i])));
        }
      }
      EXPECT_LE(worst, 1e-4);
    }
}

TEST(AttentionBackend, PrefillStatisticsOnTheCudaTierMatchTheHostTier) {
  if (kernels::cuda::DeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  // A prefill window's Attend takes the representative-key statistics from the attention it
  // runs: on the cuda tier the kernel's per-key mass, summed with atomics (their order moves
  // the last bits). Same data through a host and a cuda store: after every layer step the
  // local ring's mass agrees to fp32 rounding, so the same representatives are chosen and
  // the same chunks come back, and the outputs agree.
  // Both position modes: with infllm the keys are stored before RoPE and the attention kernel
  // rotates them where memory puts them (chunks and separated sinks at L0), on the device.
  for (const PositionMode mode : {PositionMode::kAbsolute, PositionMode::kInfLLM})
    for (const int dim : {16, 64}) {
      SCOPED_TRACE("head_dim " + std::to_string(dim) +
                   (mode == PositionMode::kInfLLM ? ", infllm" : ", absolute"));
      auto open = [dim](Device tier) {
        StoreOptions o = Store("");
        o.geometry.head_dim = dim;
        o.warm_bytes = 256 * o.chunk_bytes();
        o.device = tier;
        return TieredStore::Open(o);
      };
      auto host = open(Device::kCpu);
      auto cuda = open(Device::kCuda);
      ASSERT_TRUE(host.ok() && cuda.ok()) << cuda.status().ToString();
      SessionOptions so;
      so.retrieval.budget_tokens = 24;
      so.positions = mode;
      auto a = Session::Open(host->get(), so);
      auto b = Session::Open(cuda->get(), so);
      ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
      std::mt19937 rng(5);
      std::normal_distribution<float> n(0.0f, 1.0f);
      constexpr int kWindow = 16;
      const size_t kv = static_cast<size_t>(kWindow) * kKvHeads * dim,
                   qe = static_cast<size_t>(kWindow) * kQHeads * dim;
      double worst_out = 0, worst_mass = 0;
      int with_chunks = 0, mass_compared = 0;
      for (int64_t b0 = 0; b0 < 256; b0 += kWindow) {
        ASSERT_TRUE((*a)->BeginStep(StepKind::kPrefill).ok());
        ASSERT_TRUE((*b)->BeginStep(StepKind::kPrefill).ok());
        std::vector<int64_t> pos(kWindow);
        for (int t = 0; t < kWindow; ++t) pos[static_cast<size_t>(t)] = b0 + t;
        for (int l = 0; l < kLayers; ++l) {
          std::vector<float> kf(kv), vf(kv), q(qe);
          for (float& x : kf) x = n(rng);
          for (float& x : vf) x = n(rng);
          for (float& x : q) x = n(rng);
          std::vector<uint16_t> k(kv), v(kv);
          FromFloat(DType::kF16, kf.data(), k.data(), kv);
          FromFloat(DType::kF16, vf.data(), v.data(), kv);
          ASSERT_TRUE((*a)->Append(l, k.data(), v.data(), kWindow, DType::kF16).ok());
          ASSERT_TRUE((*b)->Append(l, k.data(), v.data(), kWindow, DType::kF16).ok());
          std::vector<float> oa(qe), ob(qe, std::nanf(""));
          ASSERT_TRUE((*a)->Attend(l, q.data(), pos.data(), kWindow, oa.data()).ok());
          Status st = (*b)->Attend(l, q.data(), pos.data(), kWindow, ob.data());
          ASSERT_TRUE(st.ok()) << st.ToString();
          ASSERT_EQ((*a)->last_chunks()[l], (*b)->last_chunks()[l]) << "window " << b0 << " layer " << l;
          with_chunks += (*a)->last_chunks()[l].empty() ? 0 : 1;
          for (size_t i = 0; i < qe; ++i)
            worst_out = std::max(worst_out, static_cast<double>(std::fabs(oa[i] - ob[i])));
          const std::vector<float> ma = TieredStoreTestPeer::RingMass(**host, (*a)->sequence(), l);
          const std::vector<float> mb = TieredStoreTestPeer::RingMass(**cuda, (*b)->sequence(), l);
          ASSERT_EQ(ma.size(), mb.size());
          for (size_t i = 0; i < ma.size(); ++i) {
            worst_mass = std::max(worst_mass, std::fabs(static_cast<double>(ma[i]) - mb[i]) /
                                                  std::max(1.0, std::fabs(static_cast<double>(ma[i]))));
            mass_compared += ma[i] > 0.0f ? 1 : 0;
          }
        }
      }
      EXPECT_GT(with_chunks, 10) << "the windows should retrieve chunks";
      EXPECT_GT(mass_compared, 100) << "the local ring should hold mass";
      EXPECT_LE(worst_mass, 1e-5);
      EXPECT_LE(worst_out, 1e-4);
    }
}
#endif

}  // namespace
}  // namespace kvtier
