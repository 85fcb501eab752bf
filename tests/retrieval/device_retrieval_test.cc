// Tests of retrieval/device_scorer.h: the retrieval backend seam of the Exact index.
// On CPU: the twins' additions (chunk_stride, the non-finite count), the workspace layout and
// its sizing, plan checks, the mirror's layout against one built afresh after adds and
// removes, and the "cpu" backend choosing exactly what the rerank=0 Exact index chooses
// (heads sum|max x topk | entropy:rank=logit | entropy:rank=cosine, random and adversarial
// inputs: ties, zero keys, one chunk, an empty layer, after Remove) both index-level and through
// the Retriever; the budget's AllocateWithEntropy against Allocate. The "cuda" backend is
// compiled; its tests skip with "no CUDA device: ..." without one and, with one, compare its
// selections with the cpu backend's, which must be equal: the scoring kernel repeats the twin's
// arithmetic in its order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/entropy.h"
#include "kernels/cpu/rope.h"
#include "retrieval/budget.h"
#include "retrieval/device_scorer.h"
#include "retrieval/exact_index.h"
#include "retrieval/retriever.h"
#include "tests/test_util.h"

#if KVTIER_HAVE_CUDA
#include "kernels/cuda/kernels.h"
#include "offload/device_memory.h"
#include "offload/device_sync.h"
#include "offload/device_sync_cuda.h"
#endif

namespace kvtier {
namespace {

// n random chunks ([n, R, H, D] fp32), exact in the shape's dtype (as the store's keys are).
std::vector<float> RandomReprs(size_t n, const ChunkShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> out(n * s.repr_floats());
  for (float& x : out) x = nd(rng);
  std::vector<uint8_t> tmp(out.size() * DTypeSize(s.dtype));
  FromFloat(s.dtype, out.data(), tmp.data(), out.size());
  ToFloat(s.dtype, tmp.data(), out.data(), out.size());
  return out;
}

std::vector<float> RandomProbe(const ChunkShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> p(static_cast<size_t>(s.dim()));
  for (float& x : p) x = nd(rng);
  return p;
}

std::unique_ptr<ExactChunkIndex> MakeExact(const std::string& spec, const ChunkShape& shape) {
  auto o = ExactIndexOptions::Parse(spec);
  EXPECT_TRUE(o.ok()) << o.status().ToString();
  auto r = ExactChunkIndex::Create(shape, *o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

// Adds chunks `ids` (ascending), reprs[i] for ids[i].
void AddAll(ChunkIndex* index, const std::vector<uint64_t>& ids, const std::vector<float>& reprs) {
  const size_t per = index->shape().repr_floats();
  ASSERT_TRUE(index
                  ->Add(ids,
                        [&](uint64_t chunk, float* repr) {
                          const size_t i = std::find(ids.begin(), ids.end(), chunk) - ids.begin();
                          std::copy_n(reprs.data() + i * per, per, repr);
                          return Status::Ok();
                        })
                  .ok());
}

std::vector<uint64_t> Iota(size_t n, uint64_t from = 0) {
  std::vector<uint64_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

// The host path's choice (rerank=0: Screen is the exact pass, Best sorts it) and its Eq. 11.
std::vector<uint64_t> HostBest(const ChunkIndex& index, const std::vector<float>& probe, ChunkRank rank,
                               size_t take, double* theta = nullptr) {
  ChunkScores s;
  EXPECT_TRUE(index.Screen(probe.data(), &s).ok());
  if (theta) *theta = SoftmaxEntropy(s.cosine.data(), static_cast<int>(s.cosine.size()));
  std::vector<uint64_t> out;
  EXPECT_TRUE(index.Best(probe.data(), s, rank, take, &out).ok());
  return out;
}

std::unique_ptr<RetrievalBackend> CpuBackend() {
  auto b = MakeRetrievalBackend("cpu");
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  return b.ok() ? std::move(b).value() : nullptr;
}

// ---- the twins' additions ---------------------------------------------------------------------

TEST(DeviceRetrievalTwins, ChunkStrideScoresTheFirstRowsOfEachHeadAsPacked) {
  const int H = 3, D = 8, R = 2;
  const int64_t n = 5, cap = 9;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  std::vector<float> packed(static_cast<size_t>(H) * n * R * D), packed_inv(static_cast<size_t>(H) * n * R);
  for (float& x : packed) x = nd(rng);
  for (float& x : packed_inv) x = std::abs(nd(rng));
  // The strided copy: rows [n, cap) of each head hold garbage the scoring must not read.
  std::vector<float> strided(static_cast<size_t>(H) * cap * R * D, 1e30f),
      strided_inv(static_cast<size_t>(H) * cap * R, 1e30f);
  for (int h = 0; h < H; ++h) {
    std::copy_n(packed.data() + h * n * R * D, n * R * D, strided.data() + h * cap * R * D);
    std::copy_n(packed_inv.data() + h * n * R, n * R, strided_inv.data() + h * cap * R);
  }
  std::vector<float> probe(static_cast<size_t>(H) * D);
  for (float& x : probe) x = nd(rng);
  for (auto fold : {kernels::HeadFold::Kind::kSum, kernels::HeadFold::Kind::kMax}) {
    kernels::ChunkScoreParams p;
    p.kv_heads = H;
    p.head_dim = D;
    p.repr = R;
    p.dtype = DType::kF32;
    p.fold = fold;
    p.n_chunks = n;
    p.probe = probe.data();
    std::vector<float> la(n), ca(n), lb(n), cb(n);
    p.keys = packed.data();
    p.inv_norm = packed_inv.data();
    p.logit = la.data();
    p.cosine = ca.data();
    ASSERT_EQ(kernels::ScoreChunks(p), kernels::KernelError::kOk);
    p.chunk_stride = cap;
    p.keys = strided.data();
    p.inv_norm = strided_inv.data();
    p.logit = lb.data();
    p.cosine = cb.data();
    ASSERT_EQ(kernels::ScoreChunks(p), kernels::KernelError::kOk);
    EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(ca.data(), cb.data(), n * sizeof(float)));
    p.chunk_stride = n - 1;  // a head would overlap the next
    EXPECT_EQ(kernels::CheckChunkScoreParams(p), kernels::KernelError::kBadShape);
    p.chunk_stride = -1;
    EXPECT_EQ(kernels::CheckChunkScoreParams(p), kernels::KernelError::kBadShape);
  }
}

TEST(DeviceRetrievalTwins, SegmentEntropyCountsNonFiniteScoresAndKeepsTheEntropy) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> s{0.1f, 0.5f, -0.2f, nan, 0.3f, inf, -inf, 0.0f};
  const int32_t offsets[4] = {0, 3, 7, 8};
  double with[3], without[3];
  int32_t bad[3] = {-1, -1, -1};
  kernels::EntropyParams p;
  p.n_segments = 3;
  p.offsets = offsets;
  p.scores = s.data();
  p.entropy = without;
  ASSERT_EQ(kernels::SegmentEntropy(p), kernels::KernelError::kOk);
  p.entropy = with;
  p.non_finite = bad;
  ASSERT_EQ(kernels::SegmentEntropy(p), kernels::KernelError::kOk);
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 3);
  EXPECT_EQ(bad[2], 0);
  EXPECT_EQ(with[0], kernels::SoftmaxEntropy(s.data(), 3));
  EXPECT_EQ(with[0], without[0]);
  EXPECT_EQ(std::memcmp(&with[1], &without[1], sizeof(double)), 0);  // NaN or not, the same bits
  EXPECT_EQ(with[2], 0.0);
}

// ---- workspace, plans, factory -------------------------------------------------------------------

TEST(DeviceRetrievalWorkspace, LayoutIsAlignedDisjointAndGrowsWithTheChunks) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1024}, int64_t{100000}})
    for (size_t topk : {size_t{0}, size_t{1000}}) {
      const RetrievalWorkspaceLayout l = LayoutRetrievalWorkspace(3 * 16, n, topk);
      EXPECT_EQ(l.n_chunks, n);
      for (size_t off : {l.in, l.logit, l.cosine, l.out, l.topk}) EXPECT_EQ(off % 256, 0u) << n;
      EXPECT_EQ(l.entropy % alignof(double), 0u);
      EXPECT_EQ(l.rows % 16, 0u);
      // in-block: probe | offsets[2] | k, one contiguous upload
      EXPECT_EQ(l.offsets, l.probe + 48 * sizeof(float));
      EXPECT_EQ(l.k, l.offsets + 8);
      EXPECT_EQ(l.in_bytes, l.k + 4 - l.in);
      // parts in order, none overlapping the next
      EXPECT_LE(l.in + l.in_bytes, l.logit);
      EXPECT_LE(l.logit + n * sizeof(float), l.cosine);
      EXPECT_LE(l.cosine + n * sizeof(float), l.out);
      EXPECT_EQ(l.out_bytes, l.rows - l.out + n * sizeof(int32_t));  // rows for every chunk
      EXPECT_LE(l.out + l.out_bytes, l.topk);
      EXPECT_GE(l.total, l.topk + topk);
      EXPECT_GE(LayoutRetrievalWorkspace(48, n + 1, topk).total, l.total);
    }
}

TEST(DeviceRetrievalWorkspace, AQueryPartSitsBetweenTheInBlockAndTheScores) {
  const RetrievalWorkspaceLayout plain = LayoutRetrievalWorkspace(32, 100, 0);
  const RetrievalWorkspaceLayout l =
      LayoutRetrievalWorkspace(32, 100, 0, /*q_floats=*/8 * 16, /*rope_pairs=*/8);
  EXPECT_EQ(plain.q_floats, 0);
  EXPECT_EQ(l.q_floats, 128);
  EXPECT_EQ(l.rope_pairs, 8);
  // in-block: probe | offsets | k | pad | q_position | inv_freq, one upload
  EXPECT_EQ(l.k, plain.k);
  EXPECT_EQ(l.q_position % 8, 0u);
  EXPECT_GE(l.q_position, l.k + 4);
  EXPECT_EQ(l.inv_freq, l.q_position + 8);
  EXPECT_EQ(l.in_bytes, l.inv_freq + 8 * sizeof(double) - l.in);
  EXPECT_EQ(l.q % 256, 0u);
  EXPECT_LE(l.in + l.in_bytes, l.q);
  EXPECT_LE(l.q + 128 * sizeof(float), l.logit);
  // the queries' check comes back in the out-block, before the rows
  EXPECT_EQ(l.q_non_finite, l.non_finite + 4);
  EXPECT_EQ(l.q_first, l.q_non_finite + 4);
  EXPECT_LE(l.q_first + 4, l.rows);
  EXPECT_EQ(l.rows % 16, 0u);
}

TEST(DeviceRetrievalTwins, CountNonFiniteCountsAndFindsTheFirst) {
  std::vector<float> x(1000, 1.5f);
  int32_t count = -1, first = -1;
  kernels::CountNonFinite(x.data(), 1000, &count, &first);
  EXPECT_EQ(count, 0);
  EXPECT_EQ(first, INT32_MAX);
  x[700] = std::numeric_limits<float>::infinity();
  x[31] = std::numeric_limits<float>::quiet_NaN();
  x[999] = -std::numeric_limits<float>::infinity();
  x[5] = std::numeric_limits<float>::max();  // finite
  kernels::CountNonFinite(x.data(), 1000, &count, &first);
  EXPECT_EQ(count, 3);
  EXPECT_EQ(first, 31);
  kernels::CountNonFinite(x.data(), 0, &count, &first);
  EXPECT_EQ(count, 0);
  EXPECT_EQ(first, INT32_MAX);
}

TEST(DeviceRetrievalWorkspace, ParamsPointIntoTheLayoutAndPickTheRankedScores) {
  const RetrievalWorkspaceLayout l = LayoutRetrievalWorkspace(32, 100, 0);
  std::vector<uint8_t> ws(l.total);
  LayerSelectPlan plan;
  plan.score.kv_heads = 2;
  plan.score.head_dim = 16;
  plan.score.repr = 1;
  plan.score.n_chunks = 50;
  plan.k_max = 7;
  plan.entropy = true;
  for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine}) {
    plan.rank = rank;
    const LayerKernelParams k = LayerParamsIn(ws.data(), l, plan);
    EXPECT_EQ(reinterpret_cast<const uint8_t*>(k.score.probe), ws.data() + l.probe);
    EXPECT_EQ(reinterpret_cast<uint8_t*>(k.score.logit), ws.data() + l.logit);
    EXPECT_EQ(reinterpret_cast<uint8_t*>(k.score.cosine), ws.data() + l.cosine);
    EXPECT_EQ(k.entropy.scores, k.score.cosine);  // Eq. 11 always takes the cosines
    EXPECT_EQ(k.entropy.n_segments, 1);
    EXPECT_EQ(k.topk.scores, rank == ChunkRank::kLogit ? k.score.logit : k.score.cosine);
    EXPECT_EQ(k.topk.k_max, 7);
    EXPECT_EQ(reinterpret_cast<uint8_t*>(k.topk.out_index), ws.data() + l.rows);
    EXPECT_EQ(k.topk.offsets, k.entropy.offsets);
  }
  plan.entropy = false;
  EXPECT_EQ(LayerParamsIn(ws.data(), l, plan).entropy.n_segments, 0);
}

TEST(DeviceRetrievalWorkspace, CpuBackendReservesAnEighthMoreThanAsked) {
  auto b = CpuBackend();
  ASSERT_NE(b, nullptr);
  EXPECT_STREQ(b->name(), "cpu");
  EXPECT_EQ(b->workspace_bytes(), 0u);
  EXPECT_EQ(*b->TopKWorkspaceBytes(5000), 0u);
  ASSERT_TRUE(b->Reserve(64, 10).ok());
  EXPECT_EQ(b->layout().n_chunks, 1024);
  const size_t first = b->workspace_bytes();
  EXPECT_EQ(first, LayoutRetrievalWorkspace(64, 1024, 0).total);
  ASSERT_TRUE(b->Reserve(64, 1024).ok());
  EXPECT_EQ(b->workspace_bytes(), first);  // fits: nothing changes
  ASSERT_TRUE(b->Reserve(64, 1025).ok());
  EXPECT_EQ(b->layout().n_chunks, 1025 + 128);  // an eighth more, not a doubling
  ASSERT_TRUE(b->Reserve(64, 1100).ok());
  EXPECT_EQ(b->layout().n_chunks, 1025 + 128);  // fits
  ASSERT_TRUE(b->Reserve(64, 5000).ok());
  EXPECT_EQ(b->layout().n_chunks, 5000 + 625);
  ASSERT_TRUE(b->Reserve(128, 10).ok());  // a longer probe keeps the chunks
  EXPECT_EQ(b->layout().n_chunks, 5625);
  EXPECT_EQ(b->workspace_bytes(), LayoutRetrievalWorkspace(128, 5625, 0).total);
}

TEST(DeviceRetrievalPlan, BadPlansAreNamedStatuses) {
  std::vector<float> keys(4 * 2 * 8), inv(4 * 2), probe(16);
  LayerSelectPlan good;
  good.score.kv_heads = 2;
  good.score.head_dim = 8;
  good.score.repr = 1;
  good.score.dtype = DType::kF32;
  good.score.n_chunks = 4;
  good.score.keys = keys.data();
  good.score.inv_norm = inv.data();
  good.probe = probe.data();
  good.k_max = 4;
  EXPECT_TRUE(ValidateLayerSelectPlan(good).ok());
  auto expect_bad = [](LayerSelectPlan p, const char* what) {
    const Status st = ValidateLayerSelectPlan(p);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what;
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
  };
  LayerSelectPlan p = good;
  p.k_max = 5;
  expect_bad(p, "k_max 5");
  p.k_max = -1;
  expect_bad(p, "k_max -1");
  p = good;
  p.probe = nullptr;
  expect_bad(p, "probe is null");
  {
    std::vector<float> q(32);
    LayerSelectPlan both = good;
    both.queries.q = q.data();
    both.queries.q_heads = 4;
    expect_bad(both, "both a probe and queries");
    both.probe = nullptr;
    both.queries.q_heads = 3;  // not a multiple of the 2 kv heads
    expect_bad(both, "not a multiple of the 2 kv heads");
    both.queries.q_heads = 4;
    both.queries.rope_position = -1;  // before L0 (a query among the sinks): a rotation like any other
    EXPECT_TRUE(ValidateLayerSelectPlan(both).ok());
    both.score.head_dim = 7;
    both.queries.rope_inv_freq = reinterpret_cast<const double*>(q.data());
    expect_bad(both, "cannot be rotated");
  }
  p = good;
  p.score.keys = nullptr;
  expect_bad(p, "null");
  p = good;
  p.score.dtype = static_cast<DType>(7);  // not a dtype the kernels know
  expect_bad(p, "dtype");
  p = good;
  p.score.chunk_stride = 3;
  expect_bad(p, "chunk_stride 3");
  p = good;
  p.score.head_dim = 0;
  expect_bad(p, "bad shape");
  p = good;
  p.score.n_chunks = int64_t{INT32_MAX} + 1;
  p.score.chunk_stride = 0;
  expect_bad(p, "int32");
  auto b = CpuBackend();
  EXPECT_EQ(b->RunLayer(good, nullptr).code(), StatusCode::kInvalidArgument);
  LayerSelectResult r;
  p = good;
  p.k_max = 9;
  EXPECT_EQ(b->RunLayer(p, &r).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b->workspace_bytes(), 0u);  // refused before anything was reserved
}

TEST(DeviceRetrievalBackend, FactoryNamesWhatItCannotMake) {
  auto bogus = MakeRetrievalBackend("tpu");
  ASSERT_FALSE(bogus.ok());
  EXPECT_EQ(bogus.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bogus.status().message().find("tpu"), std::string::npos);
  auto cuda = MakeRetrievalBackend("cuda");
#if KVTIER_HAVE_CUDA
  if (kernels::cuda::DeviceCount() == 0) {
    ASSERT_FALSE(cuda.ok());
    EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(cuda.status().message().find("no CUDA device: "), std::string::npos) << cuda.status().message();
  } else {
    ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
    EXPECT_STREQ((*cuda)->name(), "cuda");
  }
#else
  ASSERT_FALSE(cuda.ok());
  EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable);
#endif
}

// ---- the mirror --------------------------------------------------------------------------------

TEST(DeviceRetrievalMirror, LayoutAfterAddsAndRemovesEqualsAFreshOne) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const ChunkShape shape{3, 16, 2, dt};
    auto backend = CpuBackend();
    auto grown = MakeExact("Exact", shape);
    ASSERT_TRUE(grown->AttachBackend(backend.get()).ok());
    EXPECT_EQ(grown->AttachBackend(backend.get()).code(), StatusCode::kInvalidArgument);  // once
    const std::vector<float> reprs = RandomReprs(100, shape, 3 + static_cast<int>(dt));
    const size_t per = shape.repr_floats();
    std::vector<uint64_t> kept;
    std::vector<float> kept_reprs;
    size_t capacity_seen = 0;
    for (size_t b0 = 0; b0 < 100; b0 += 13) {  // batches of 13, a few removals in between
      const size_t b1 = std::min<size_t>(100, b0 + 13);
      AddAll(grown.get(), Iota(b1 - b0, b0),
             std::vector<float>(reprs.begin() + b0 * per, reprs.begin() + b1 * per));
      for (size_t i = b0; i < b1; ++i) {
        kept.push_back(i);
        kept_reprs.insert(kept_reprs.end(), reprs.begin() + i * per, reprs.begin() + (i + 1) * per);
      }
      std::vector<uint64_t> gone{b0 + 1, b0 + 5};
      if (b0 == 26) gone.push_back(0);  // the very first row: every row moves
      ASSERT_TRUE(grown->Remove(gone).ok());
      for (uint64_t g : gone) {
        const auto it = std::find(kept.begin(), kept.end(), g);
        if (it == kept.end()) continue;
        const size_t at = it - kept.begin();
        kept.erase(it);
        kept_reprs.erase(kept_reprs.begin() + at * per, kept_reprs.begin() + (at + 1) * per);
      }
      ASSERT_TRUE(grown->SyncMirror().ok());
      const ReprMirror* m = grown->mirror();
      ASSERT_NE(m, nullptr);
      EXPECT_EQ(m->rows(), kept.size());
      EXPECT_GE(m->capacity(), m->rows());
      if (m->capacity() != capacity_seen) {  // grown by an eighth (at least 16), never doubled past it
        EXPECT_LE(m->capacity(),
                  std::max<size_t>({m->rows() + m->rows() / 8, capacity_seen + capacity_seen / 8, 16}));
        capacity_seen = m->capacity();
      }
      EXPECT_LE(m->capacity(), std::max<size_t>(m->rows() + m->rows() / 8 + 13, 16));  // what it holds
      auto fresh_backend = CpuBackend();  // declared first: an index must not outlive its backend
      auto fresh = MakeExact("Exact", shape);
      AddAll(fresh.get(), kept, kept_reprs);
      ASSERT_TRUE(fresh->AttachBackend(fresh_backend.get()).ok());
      std::vector<uint8_t> ka, kb;
      std::vector<float> ia, ib;
      ASSERT_TRUE(m->Download(&ka, &ia).ok());
      ASSERT_TRUE(fresh->mirror()->Download(&kb, &ib).ok());
      EXPECT_EQ(ka, kb) << DTypeName(dt) << " after chunk " << b1;
      EXPECT_EQ(0, std::memcmp(ia.data(), ib.data(), ia.size() * sizeof(float)));
      EXPECT_EQ(ia.size(), ib.size());
    }
    EXPECT_GT(grown->memory_bytes(), grown->mirror()->bytes());
  }
}

TEST(DeviceRetrievalMirror, ScoringViewIsTheChunkScoreLayout) {
  const ChunkShape shape{2, 8, 3, DType::kF16};
  auto backend = CpuBackend();
  auto index = MakeExact("Exact:heads=max", shape);
  ASSERT_TRUE(index->AttachBackend(backend.get()).ok());
  AddAll(index.get(), Iota(20), RandomReprs(20, shape, 9));
  ASSERT_TRUE(index->SyncMirror().ok());
  const kernels::ChunkScoreParams p = index->mirror()->Params(kernels::HeadFold::Kind::kMax);
  EXPECT_EQ(p.kv_heads, 2);
  EXPECT_EQ(p.head_dim, 8);
  EXPECT_EQ(p.repr, 3);
  EXPECT_EQ(p.dtype, DType::kF16);
  EXPECT_EQ(p.n_chunks, 20);
  EXPECT_EQ(p.chunk_stride, static_cast<int64_t>(index->mirror()->capacity()));
  // Its scores are the host Score's, bit for bit.
  const std::vector<float> probe = RandomProbe(shape, 2);
  std::vector<float> logit(20), cosine(20);
  kernels::ChunkScoreParams q = p;
  q.probe = probe.data();
  q.logit = logit.data();
  q.cosine = cosine.data();
  ASSERT_EQ(kernels::ScoreChunks(q), kernels::KernelError::kOk);
  ChunkScores s;
  ASSERT_TRUE(index->Score(probe.data(), &s).ok());
  EXPECT_EQ(0, std::memcmp(s.logit.data(), logit.data(), 20 * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(s.cosine.data(), cosine.data(), 20 * sizeof(float)));
}

TEST(DeviceRetrievalMirror, UnderACapTheMirrorEvictsWithTheHostAndShrinks) {
  // With a mirror the backend scores stored keys, so the cap evicts (no int8-only chunks), the
  // mirror counts in memory_bytes() and shrinks with the rows, and what the index chooses is
  // what a fresh mirrored index of the kept chunks chooses.
  const ChunkShape shape{2, 16, 4, DType::kF16};
  const size_t n = 1200, per = shape.repr_floats();
  const auto reprs = RandomReprs(n, shape, 61);
  const uint64_t cap = 96 << 10;
  auto backend = CpuBackend();
  auto index = MakeExact("Exact:heads=max", shape);
  ASSERT_TRUE(index->AttachBackend(backend.get()).ok());
  ASSERT_TRUE(index->SetMemoryCap(cap).ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(index->Add(i, reprs.data() + i * per).ok());
    ASSERT_TRUE(index->SyncMirror().ok());
    ASSERT_LE(index->memory_bytes(), cap) << "after chunk " << i;
    ASSERT_EQ(index->mirror()->rows(), index->size());
  }
  EXPECT_EQ(index->compressed_chunks(), 0u);
  EXPECT_GT(index->evicted_chunks(), 0u);
  EXPECT_EQ(index->size() + index->evicted_chunks(), n);
  EXPECT_LE(index->mirror()->capacity(), index->size() + index->size() / 8 + 16);
  auto fresh_backend = CpuBackend();
  auto fresh = MakeExact("Exact:heads=max", shape);
  const uint64_t first = index->evicted_chunks();
  AddAll(fresh.get(), Iota(n - first, first), std::vector<float>(reprs.begin() + first * per, reprs.end()));
  ASSERT_TRUE(fresh->AttachBackend(fresh_backend.get()).ok());
  const std::vector<float> probe = RandomProbe(shape, 3);
  for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine}) {
    std::vector<uint64_t> a, b;
    double ta = 0, tb = 0;
    int32_t na = 0, nb = 0;
    ASSERT_TRUE(index->SelectOnBackend(probe.data(), rank, true, 16, &a, &ta, &na).ok());
    ASSERT_TRUE(fresh->SelectOnBackend(probe.data(), rank, true, 16, &b, &tb, &nb).ok());
    EXPECT_EQ(a, b);
    EXPECT_EQ(ta, tb);
  }
  // A compressed index cannot take a mirror: the backend has no keys for those chunks.
  auto host = MakeExact("Exact", shape);
  ASSERT_TRUE(host->SetMemoryCap(64 << 10).ok());
  AddAll(host.get(), Iota(200), std::vector<float>(reprs.begin(), reprs.begin() + 200 * per));
  ASSERT_GT(host->compressed_chunks(), 0u);
  auto late_backend = CpuBackend();
  EXPECT_EQ(host->AttachBackend(late_backend.get()).code(), StatusCode::kFailedPrecondition);
}

// ---- selections: cpu backend vs the rerank=0 host path -------------------------------------------

struct Fold {
  const char* heads;
  ChunkRank rank;
  bool entropy;
};
const Fold kFolds[] = {{"sum", ChunkRank::kLogit, false}, {"max", ChunkRank::kLogit, false},
                       {"sum", ChunkRank::kLogit, true},  {"max", ChunkRank::kLogit, true},
                       {"sum", ChunkRank::kCosine, true}, {"max", ChunkRank::kCosine, true}};

// Every k_max for both (host at rerank=0, and a default-rerank index with a mirror).
void ExpectSameChoices(const ChunkIndex& host, ExactChunkIndex* mirrored, const std::vector<float>& probe,
                       const Fold& f, const std::string& what) {
  const size_t n = host.size();
  ASSERT_EQ(mirrored->size(), n);
  for (size_t k : {size_t{0}, size_t{1}, size_t{2}, n / 2, n > 0 ? n - 1 : 0, n}) {
    double theta_host = 0.0, theta = -1.0;
    int32_t bad = -1;
    const std::vector<uint64_t> want = HostBest(host, probe, f.rank, k, &theta_host);
    std::vector<uint64_t> got;
    ASSERT_TRUE(
        mirrored->SelectOnBackend(probe.data(), f.rank, f.entropy, static_cast<int>(k), &got, &theta, &bad)
            .ok());
    EXPECT_EQ(got, want) << what << " heads=" << f.heads << " rank=" << ChunkRankName(f.rank) << " k=" << k;
    if (f.entropy) {
      EXPECT_EQ(theta, theta_host) << what;  // the same SoftmaxEntropy of the same cosines
      EXPECT_EQ(bad, 0);
    } else {
      EXPECT_EQ(theta, 0.0);
    }
  }
}

TEST(DeviceRetrievalSelect, CpuBackendChoosesWhatRerankZeroChooses) {
  for (DType dt : {DType::kF32, DType::kF16})
    for (const Fold& f : kFolds) {
      const ChunkShape shape{4, 32, 3, dt};
      const std::string heads = std::string("Exact:heads=") + f.heads;
      auto backend = CpuBackend();
      auto host = MakeExact(heads + ",rerank=0", shape);
      auto mirrored = MakeExact(heads, shape);  // rerank=4: the mirror path ignores it
      ASSERT_TRUE(mirrored->AttachBackend(backend.get()).ok());
      const std::vector<float> reprs = RandomReprs(300, shape, 17);
      AddAll(host.get(), Iota(300), reprs);
      AddAll(mirrored.get(), Iota(300), reprs);
      for (uint32_t seed = 0; seed < 3; ++seed)
        ExpectSameChoices(*host, mirrored.get(), RandomProbe(shape, 100 + seed), f,
                          std::string("random ") + DTypeName(dt));
      // After Remove (Forget): the compacted mirror chooses as the compacted host index.
      const std::vector<uint64_t> gone{0, 1, 57, 58, 150, 299};
      ASSERT_TRUE(host->Remove(gone).ok());
      ASSERT_TRUE(mirrored->Remove(gone).ok());
      ExpectSameChoices(*host, mirrored.get(), RandomProbe(shape, 7), f, "after Remove");
      // More chunks after the removal (the mirror grows past its capacity again).
      const std::vector<float> more = RandomReprs(200, shape, 18);
      AddAll(host.get(), Iota(200, 300), more);
      AddAll(mirrored.get(), Iota(200, 300), more);
      ExpectSameChoices(*host, mirrored.get(), RandomProbe(shape, 8), f, "after Remove and Add");
    }
}

TEST(DeviceRetrievalSelect, AdversarialInputsChooseAlike) {
  const ChunkShape shape{2, 8, 2, DType::kF32};
  const size_t per = shape.repr_floats();
  for (const Fold& f : kFolds) {
    const std::string heads = std::string("Exact:heads=") + f.heads;
    auto fresh = [&](std::unique_ptr<ExactChunkIndex>* host, std::unique_ptr<ExactChunkIndex>* mirrored,
                     std::unique_ptr<RetrievalBackend>* backend) {
      host->reset();
      mirrored->reset();  // before its backend goes
      *backend = CpuBackend();
      *host = MakeExact(heads + ",rerank=0", shape);
      *mirrored = MakeExact(heads, shape);
      ASSERT_TRUE((*mirrored)->AttachBackend(backend->get()).ok());
    };
    std::unique_ptr<RetrievalBackend> backend;
    std::unique_ptr<ExactChunkIndex> host, mirrored;
    // An empty layer: nothing chosen, Theta 0.
    fresh(&host, &mirrored, &backend);
    ExpectSameChoices(*host, mirrored.get(), RandomProbe(shape, 1), f, "empty");
    // One chunk.
    AddAll(host.get(), {5}, RandomReprs(1, shape, 2));
    AddAll(mirrored.get(), {5}, RandomReprs(1, shape, 2));
    ExpectSameChoices(*host, mirrored.get(), RandomProbe(shape, 1), f, "one chunk");
    // Ties: four copies of each of 10 chunks, interleaved with zero keys (logit 0, cosine 0;
    // a zero probe head makes -0 and +0 logits meet too).
    fresh(&host, &mirrored, &backend);
    const std::vector<float> base = RandomReprs(10, shape, 3);
    std::vector<float> reprs;
    for (int copy = 0; copy < 4; ++copy)
      for (size_t c = 0; c < 10; ++c) {
        reprs.insert(reprs.end(), base.begin() + c * per, base.begin() + (c + 1) * per);
        reprs.insert(reprs.end(), per, 0.0f);
      }
    AddAll(host.get(), Iota(80), reprs);
    AddAll(mirrored.get(), Iota(80), reprs);
    ExpectSameChoices(*host, mirrored.get(), RandomProbe(shape, 4), f, "ties");
    std::vector<float> half_zero = RandomProbe(shape, 5);
    std::fill(half_zero.begin(), half_zero.begin() + shape.head_dim, 0.0f);
    ExpectSameChoices(*host, mirrored.get(), half_zero, f, "ties, zero probe head");
    ExpectSameChoices(*host, mirrored.get(), std::vector<float>(shape.dim(), 0.0f), f, "zero probe");
    for (float& x : half_zero) x = -x;
    ExpectSameChoices(*host, mirrored.get(), half_zero, f, "ties, negated probe");
  }
}

TEST(DeviceRetrievalSelect, NanAndHugeKeysChooseAlikeAndBadCallsAreRefused) {
  // A NaN key gets inverse norm 0 and its cosine NaN, which the best-representative max drops
  // (-1 stays), and an overflowing dot meets an inverse norm of 0 likewise: the cosines stay
  // finite, both paths choose alike and nothing is counted (the count is the device's guard for
  // scores the host cannot read; the twin test above checks the counting itself).
  const ChunkShape shape{1, 4, 1, DType::kF32};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> reprs{1, 2, 3, 4, nan, 0, 0, 0, 1, 1, 1, 1, 3e38f, 3e38f, 0, 0, -1, 0, 0, 0};
  for (const Fold& f : kFolds) {
    auto backend = CpuBackend();
    auto host = MakeExact(std::string("Exact:rerank=0,heads=") + f.heads, shape);
    auto index = MakeExact(std::string("Exact:heads=") + f.heads, shape);
    ASSERT_TRUE(index->AttachBackend(backend.get()).ok());
    AddAll(host.get(), Iota(5), reprs);
    AddAll(index.get(), Iota(5), reprs);
    ExpectSameChoices(*host, index.get(), std::vector<float>{1, 1, 1, 1}, f, "NaN and huge keys");
  }
  auto backend = CpuBackend();
  auto index = MakeExact("Exact", shape);
  ASSERT_TRUE(index->AttachBackend(backend.get()).ok());
  std::vector<uint64_t> got;
  double theta = 0;
  int32_t bad = 0;
  // Bad calls.
  EXPECT_EQ(index->SelectOnBackend(nullptr, ChunkRank::kLogit, false, 1, &got, &theta, &bad).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(index->SelectOnBackend(reprs.data(), ChunkRank::kLogit, false, -1, &got, &theta, &bad).code(),
            StatusCode::kInvalidArgument);
  auto bare = MakeExact("Exact", shape);
  EXPECT_EQ(bare->SelectOnBackend(reprs.data(), ChunkRank::kLogit, false, 1, &got, &theta, &bad).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(bare->AttachBackend(nullptr).code(), StatusCode::kInvalidArgument);
}

// ---- the budget's entropy entry ------------------------------------------------------------------

TEST(DeviceRetrievalBudget, AllocateWithEntropyGrantsWhatAllocateGrants) {
  for (const char* spec : {"entropy", "entropy:min=2,rank=logit"}) {
    auto a = MakeBudgetAllocator(spec);
    auto b = MakeBudgetAllocator(spec);
    ASSERT_TRUE(a.ok() && b.ok());
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (int step = 0; step < 12; ++step) {
      (*a)->BeginStep(5, 4);
      (*b)->BeginStep(5, 4);
      for (int l = 0; l < 5; ++l) {
        const int n = (step + l) % 4 == 0 ? 0 : 1 + static_cast<int>(rng() % 40);
        std::vector<float> s(n);
        for (float& x : s) x = nd(rng) * (1 + l);
        const int bound = (*b)->MaxTake(l, n);
        auto ga = (*a)->Allocate(l, LayerScores{s.data(), n});
        auto gb = (*b)->AllocateWithEntropy(l, n, kernels::SoftmaxEntropy(s.data(), n));
        ASSERT_TRUE(ga.ok() && gb.ok()) << ga.status().ToString() << gb.status().ToString();
        EXPECT_EQ(*ga, *gb) << spec << " step " << step << " layer " << l;
        EXPECT_LE(*gb, bound);
        EXPECT_EQ((*a)->last_entropy(), (*b)->last_entropy());
      }
    }
  }
}

TEST(DeviceRetrievalBudget, BadEntropiesAndTopKAreRefused) {
  auto e = MakeBudgetAllocator("entropy");
  (*e)->BeginStep(2, 3);
  EXPECT_EQ((*e)->AllocateWithEntropy(0, 4, std::nan("")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*e)->AllocateWithEntropy(0, 4, -1.0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*e)->AllocateWithEntropy(1, 4, 1.0).status().code(),
            StatusCode::kFailedPrecondition);           // out of order
  EXPECT_EQ((*e)->MaxTake(0, 10), 5);                   // 2 x 3, one kept for the deeper layer
  EXPECT_EQ(*(*e)->AllocateWithEntropy(0, 4, 1.0), 3);  // refusals moved nothing: layer 0 still
  auto t = MakeBudgetAllocator("topk");
  (*t)->BeginStep(2, 3);
  EXPECT_EQ((*t)->MaxTake(0, 10), 3);
  EXPECT_EQ((*t)->MaxTake(0, 2), 2);
  EXPECT_EQ((*t)->AllocateWithEntropy(0, 4, 1.0).status().code(), StatusCode::kFailedPrecondition);
}

// ---- through the Retriever ----------------------------------------------------------------------

StoreOptions Options(const std::string& dir) {
  StoreOptions o;
  o.geometry = Geometry{3, 4, 2, 16, DType::kF16};
  o.n_sink = 4;
  o.n_local = 16;
  o.chunk_size = 4;
  o.repr_topk = 2;
  o.hot_bytes = 512 * o.chunk_bytes();
  o.warm_bytes = 16 * o.chunk_bytes();
  o.data_dir = dir;
  return o;
}

void Fill(TieredStore* s, SequenceId seq, int n, uint32_t seed) {
  const Geometry& g = s->options().geometry;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int l = 0; l < g.layers; ++l) {
    std::vector<float> k(static_cast<size_t>(n) * g.token_elems()), v(k.size());
    for (auto& x : k) x = nd(rng) * (1 + l);
    for (auto& x : v) x = nd(rng);
    std::vector<uint8_t> k16(k.size() * DTypeSize(g.dtype)), v16(v.size() * DTypeSize(g.dtype));
    FromFloat(g.dtype, k.data(), k16.data(), k.size());  // the store takes its own dtype
    FromFloat(g.dtype, v.data(), v16.data(), v.size());
    const Status st = s->Append(seq, l, k16.data(), v16.data(), n, g.dtype);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
}

TEST(DeviceRetrievalRetriever, CpuBackendSelectsAsTheHostPathAtRerankZero) {
  for (const char* alloc : {"topk", "entropy:rank=logit", "entropy:rank=cosine", "entropy:min=2,rank=cosine"})
    for (const char* heads : {"sum", "max"}) {
      TempDir dir;
      auto store = TieredStore::Open(Options(dir.path()));
      ASSERT_TRUE(store.ok());
      TieredStore* s = store->get();
      const Geometry& g = s->options().geometry;
      const SequenceId seq = *s->CreateSequence();
      Fill(s, seq, 4 + 16 + 4 * 60 + 1, 21);
      RetrieverOptions ro;
      ro.alloc = alloc;
      ro.budget_tokens = 6 * 4;
      ro.index = std::string("Exact:rerank=0,heads=") + heads;
      auto host = Retriever::Create(s, ro);
      ro.index = std::string("Exact:heads=") + heads;
      auto dev = Retriever::Create(s, ro, CpuBackend());
      ASSERT_TRUE(host.ok() && dev.ok());
      EXPECT_EQ((*host)->backend(), nullptr);  // a host tier: the host path
      ASSERT_NE((*dev)->backend(), nullptr);
      EXPECT_STREQ((*dev)->backend()->name(), "cpu");
      std::mt19937 rng(6);
      std::normal_distribution<float> nd;
      std::vector<float> q(static_cast<size_t>(4) * g.q_heads * g.head_dim);
      for (int step = 0; step < 8; ++step) {
        if (step == 4) {  // Forget in the middle: both drop the same chunks
          const std::vector<uint64_t> gone{0, 3, 4, 30, 59};
          for (int l = 0; l < g.layers; ++l) {
            ASSERT_TRUE(s->DropChunks(seq, l, gone).ok());
            ASSERT_TRUE((*host)->Forget(seq, l, gone).ok());
            ASSERT_TRUE((*dev)->Forget(seq, l, gone).ok());
          }
        }
        for (auto& x : q) x = nd(rng) * (1 + step % 3);
        const bool decode = step % 2 == 1;
        (*host)->BeginStep();
        (*dev)->BeginStep();
        for (int l = 0; l < g.layers; ++l) {
          auto a = (*host)->Select(seq, l, q.data(), decode ? 1 : 4, decode);
          auto b = (*dev)->Select(seq, l, q.data(), decode ? 1 : 4, decode);
          ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
          EXPECT_EQ(a->chunks, b->chunks)
              << alloc << " heads=" << heads << " step " << step << " layer " << l;
          EXPECT_EQ(a->entropy, b->entropy);
          EXPECT_FALSE(b->chunks.empty());
        }
      }
    }
}

// A decode query left in the backend's memory (Session::AttendDevice): the backend builds the
// probe (rotated first with InfLLM positions) and checks q; the choice is the host query's.
TEST(DeviceRetrievalRetriever, DecodeQueriesInBackendMemoryChooseAsHostQueries) {
  for (const char* alloc : {"topk", "entropy:rank=cosine", "entropy:rank=logit"})
    for (const bool rotate : {false, true}) {
      TempDir dir;
      auto store = TieredStore::Open(Options(dir.path()));
      ASSERT_TRUE(store.ok());
      TieredStore* s = store->get();
      const Geometry& g = s->options().geometry;
      const SequenceId seq = *s->CreateSequence();
      Fill(s, seq, 4 + 16 + 4 * 40 + 1, 33);
      RetrieverOptions ro;
      ro.alloc = alloc;
      ro.budget_tokens = 5 * 4;
      auto host = Retriever::Create(s, ro, CpuBackend());
      auto dev = Retriever::Create(s, ro, CpuBackend());
      ASSERT_TRUE(host.ok() && dev.ok());
      ASSERT_TRUE((*dev)->SelectsDecodeOnBackend());
      const std::vector<double> inv_freq = kernels::RopeInvFreq(g.head_dim, 10000.0);
      std::mt19937 rng(8);
      std::normal_distribution<float> nd;
      std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim), rotated(q.size());
      for (int step = 0; step < 12; ++step) {
        for (auto& x : q) x = nd(rng) * (1 + step % 3);
        const int64_t position = 160 + 7 * step;  // where memory sees the query (InfLLM: minus L0)
        rotated = q;
        if (rotate) kernels::Rope(rotated.data(), 1, g.q_heads, g.head_dim, &position, inv_freq.data());
        BackendQueries queries;
        queries.q = q.data();  // the cpu backend's memory is host memory
        queries.q_heads = g.q_heads;
        queries.rope_inv_freq = rotate ? inv_freq.data() : nullptr;
        queries.rope_position = position;
        (*host)->BeginStep();
        (*dev)->BeginStep();
        for (int l = 0; l < g.layers; ++l) {
          auto a = (*host)->Select(seq, l, rotated.data(), 1, /*decode=*/true);
          auto b = (*dev)->SelectDecodeOnBackend(seq, l, queries);
          ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
          EXPECT_EQ(a->chunks, b->chunks)
              << alloc << " rotate " << rotate << " step " << step << " layer " << l;
          EXPECT_EQ(a->entropy, b->entropy);
          EXPECT_FALSE(b->chunks.empty());
          EXPECT_EQ(a->first_stage_bytes, b->first_stage_bytes);
        }
      }
      // A NaN or an infinity in q: refused by name, found by the backend's check.
      q[static_cast<size_t>(2) * g.head_dim + 5] = std::numeric_limits<float>::quiet_NaN();
      q[static_cast<size_t>(3) * g.head_dim + 1] = std::numeric_limits<float>::infinity();
      BackendQueries bad;
      bad.q = q.data();
      bad.q_heads = g.q_heads;
      (*dev)->BeginStep();
      auto refused = (*dev)->SelectDecodeOnBackend(seq, 0, bad);
      ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(refused.status().message().find("q[0][2][5] is not finite (2 NaN or infinite"),
                std::string::npos)
          << refused.status().message();
    }
}

TEST(DeviceRetrievalRetriever, DecodeQueriesInBackendMemoryAreCheckedWithoutChunksAndRefusedWithReuse) {
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  TieredStore* s = store->get();
  const Geometry& g = s->options().geometry;
  const SequenceId seq = *s->CreateSequence();
  Fill(s, seq, 8, 5);  // sinks and local only: nothing sealed, nothing to select
  RetrieverOptions ro;
  auto dev = Retriever::Create(s, ro, CpuBackend());
  ASSERT_TRUE(dev.ok());
  std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim, 0.5f);
  BackendQueries queries;
  queries.q = q.data();
  queries.q_heads = g.q_heads;
  (*dev)->BeginStep();
  auto none = (*dev)->SelectDecodeOnBackend(seq, 0, queries);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->chunks.empty());
  q[static_cast<size_t>(g.head_dim) + 3] = -std::numeric_limits<float>::infinity();
  auto refused = (*dev)->SelectDecodeOnBackend(seq, 1, queries);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("q[0][1][3] is not finite"), std::string::npos)
      << refused.status().message();
  // Reuse compares probes on the host: the query must come to the host.
  ro.reuse_cosine = 0.9;
  auto reusing = Retriever::Create(s, ro, CpuBackend());
  ASSERT_TRUE(reusing.ok());
  EXPECT_FALSE((*reusing)->SelectsDecodeOnBackend());
  (*reusing)->BeginStep();
  EXPECT_EQ((*reusing)->SelectDecodeOnBackend(seq, 0, queries).status().code(),
            StatusCode::kFailedPrecondition);
  auto host_only = Retriever::Create(s, RetrieverOptions{});
  ASSERT_TRUE(host_only.ok());
  EXPECT_FALSE((*host_only)->SelectsDecodeOnBackend());
}

TEST(DeviceRetrievalRetriever, FaissKindsStayOnTheHostWithABackend) {
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  TieredStore* s = store->get();
  const SequenceId seq = *s->CreateSequence();
  Fill(s, seq, 4 + 16 + 4 * 20, 2);
  RetrieverOptions ro;
  ro.index = "Flat";
  ro.budget_tokens = 3 * 4;
  auto host = Retriever::Create(s, ro);
  auto dev = Retriever::Create(s, ro, CpuBackend());
  ASSERT_TRUE(host.ok() && dev.ok());
  std::vector<float> q(static_cast<size_t>(s->options().geometry.q_heads) * 16, 0.25f);
  (*host)->BeginStep();
  (*dev)->BeginStep();
  auto a = (*host)->Select(seq, 0, q.data(), 1, true);
  auto b = (*dev)->Select(seq, 0, q.data(), 1, true);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->chunks, b->chunks);
  EXPECT_EQ((*dev)->memory_bytes(), (*host)->memory_bytes());  // no mirror was made
  EXPECT_FALSE((*dev)->SelectsDecodeOnBackend());              // so the query comes to the host
}

// ---- the cuda backend ----------------------------------------------------------------------------

#if KVTIER_HAVE_CUDA
bool HaveDevice(std::string* why) {
  if (kernels::cuda::DeviceCount() > 0) return true;
  *why = std::string("no CUDA device: ") + kernels::cuda::LastCudaErrorString();
  return false;
}
#endif

TEST(DeviceRetrievalCuda, SelectsAsTheCpuBackend) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
#else
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << why;
  auto cuda = MakeRetrievalBackend("cuda");
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (const Fold& f : kFolds) {
      const ChunkShape shape{4, 64, 2, dt};
      const std::string spec = std::string("Exact:heads=") + f.heads;
      auto cpu = CpuBackend();
      auto on_cpu = MakeExact(spec, shape);
      auto on_gpu = MakeExact(spec, shape);
      ASSERT_TRUE(on_cpu->AttachBackend(cpu.get()).ok());
      ASSERT_TRUE(on_gpu->AttachBackend(cuda->get()).ok());
      const std::vector<float> reprs = RandomReprs(3000, shape, 5);
      AddAll(on_cpu.get(), Iota(3000), reprs);
      AddAll(on_gpu.get(), Iota(3000), reprs);
      ASSERT_TRUE(on_cpu->Remove({1, 2, 1000}).ok());
      ASSERT_TRUE(on_gpu->Remove({1, 2, 1000}).ok());
      ASSERT_TRUE(on_cpu->SyncMirror().ok());  // a mirror takes its rows lazily, before a selection
      ASSERT_TRUE(on_gpu->SyncMirror().ok());
      std::vector<uint8_t> ka, kb;
      std::vector<float> ia, ib;
      ASSERT_TRUE(on_cpu->mirror()->Download(&ka, &ia).ok());
      ASSERT_TRUE(on_gpu->mirror()->Download(&kb, &ib).ok());
      EXPECT_EQ(ka, kb);
      EXPECT_EQ(ia, ib);
      for (uint32_t seed = 0; seed < 3; ++seed) {
        const std::vector<float> probe = RandomProbe(shape, seed);
        for (int k : {1, 16, 500}) {
          std::vector<uint64_t> a, b;
          double ta = 0, tb = 0;
          int32_t na = 0, nb = 0;
          ASSERT_TRUE(on_cpu->SelectOnBackend(probe.data(), f.rank, f.entropy, k, &a, &ta, &na).ok());
          const Status st = on_gpu->SelectOnBackend(probe.data(), f.rank, f.entropy, k, &b, &tb, &nb);
          ASSERT_TRUE(st.ok()) << st.ToString();
          // The scoring kernel repeats the twin's arithmetic in its order (bit-equal scores), and
          // CUB's stable descending sort breaks ties by the lower row as the twin: equal lists.
          EXPECT_EQ(a, b) << DTypeName(dt) << " heads=" << f.heads << " rank=" << ChunkRankName(f.rank)
                          << " k=" << k;
          EXPECT_NEAR(ta, tb, 1e-6 * std::max(1.0, ta));
          EXPECT_EQ(nb, 0);
        }
      }
    }
#endif
}

// A mirror that outgrows its capacity with no cap moves its rows across on the device
// (ReprMirror::Update): the rows added one seal at a time past the capacity cost no host wait,
// and the mirror holds what the cpu backend's holds.
TEST(DeviceRetrievalCuda, GrowingMirrorMovesItsRowsOnTheDeviceWithNoHostWait) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
#else
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << why;
  auto cuda = MakeRetrievalBackend("cuda");
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  const ChunkShape shape{2, 64, 2, DType::kF16};
  auto cpu = CpuBackend();
  auto on_cpu = MakeExact("Exact", shape);
  auto on_gpu = MakeExact("Exact", shape);
  ASSERT_TRUE(on_cpu->AttachBackend(cpu.get()).ok());
  ASSERT_TRUE(on_gpu->AttachBackend(cuda->get()).ok());
  const size_t per = shape.repr_floats();
  const std::vector<float> reprs = RandomReprs(1200, shape, 9);
  auto add = [&](size_t b0, size_t b1) {
    const std::vector<float> part(reprs.begin() + b0 * per, reprs.begin() + b1 * per);
    AddAll(on_cpu.get(), Iota(b1 - b0, b0), part);
    AddAll(on_gpu.get(), Iota(b1 - b0, b0), part);
  };
  add(0, 1000);  // a first sync: one big upload (waited)
  ASSERT_TRUE(on_gpu->SyncMirror().ok());
  const size_t first_capacity = on_gpu->mirror()->capacity();
  EXPECT_GE(first_capacity, 1000u + 1000u / 8);  // room for an eighth more before it grows
  uint64_t waits = 0;
  size_t grew = 0;
  auto s = static_cast<cudaStream_t>(cuda->get()->stream());
  for (size_t c = 1000; c < 1200; ++c) {  // one seal at a time, as steps apart as decode's
    add(c, c + 1);
    ASSERT_EQ(device_sync::SyncStream(s), cudaSuccess);  // the step's other work: staging recycled
    const size_t before = on_gpu->mirror()->capacity();
    const uint64_t waits0 = HostSyncsTotal();
    ASSERT_TRUE(on_gpu->SyncMirror().ok());
    waits += HostSyncsTotal() - waits0;
    grew += on_gpu->mirror()->capacity() != before;
  }
  EXPECT_GE(grew, 1u);
  EXPECT_EQ(waits, 0u) << "rows added one at a time, the mirror growing " << grew << " time(s)";
  ASSERT_TRUE(on_cpu->SyncMirror().ok());
  std::vector<uint8_t> ka, kb;
  std::vector<float> ia, ib;
  ASSERT_TRUE(on_cpu->mirror()->Download(&ka, &ia).ok());
  ASSERT_TRUE(on_gpu->mirror()->Download(&kb, &ib).ok());
  EXPECT_EQ(ka, kb);
  EXPECT_EQ(ia, ib);
#endif
}

// The decode query in device memory (what Session::AttendDevice hands over): the cuda backend
// builds the probe from it (rotated first when asked) and checks it there; the choice is the
// cpu backend's from the host query.
TEST(DeviceRetrievalCuda, DecodeQueriesInDeviceMemoryChooseAsTheCpuBackend) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
#else
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << why;
  for (const bool rotate : {false, true}) {
    TempDir dir;
    StoreOptions o = Options(dir.path());
    o.device = Device::kCuda;
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    TieredStore* s = store->get();
    const Geometry& g = s->options().geometry;
    const SequenceId seq = *s->CreateSequence();
    Fill(s, seq, 4 + 16 + 4 * 40, 8);
    RetrieverOptions ro;
    ro.budget_tokens = 5 * 4;
    auto dev = Retriever::Create(s, ro);
    auto cpu = Retriever::Create(s, ro, CpuBackend());
    ASSERT_TRUE(dev.ok() && cpu.ok()) << dev.status().ToString();
    ASSERT_TRUE((*dev)->SelectsDecodeOnBackend());
    const size_t q_bytes = static_cast<size_t>(g.q_heads) * g.head_dim * sizeof(float);
    auto memory = MakeRetrievalBackend("cuda");  // device memory for the query, as an engine's
    ASSERT_TRUE(memory.ok());
    auto q_device = (*memory)->Allocate(q_bytes);
    ASSERT_TRUE(q_device.ok());
    const std::vector<double> inv_freq = kernels::RopeInvFreq(g.head_dim, 10000.0);
    std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (int step = 0; step < 4; ++step) {
      for (auto& x : q) x = nd(rng);
      const BackendCopy up{*q_device, q.data(), q_bytes};
      ASSERT_TRUE((*memory)->Upload(&up, 1).ok());
      const int64_t position = 90 + step;
      std::vector<float> rotated = q;
      if (rotate) kernels::Rope(rotated.data(), 1, g.q_heads, g.head_dim, &position, inv_freq.data());
      BackendQueries queries;
      queries.q = reinterpret_cast<const float*>(*q_device);
      queries.q_heads = g.q_heads;
      queries.rope_inv_freq = rotate ? inv_freq.data() : nullptr;
      queries.rope_position = position;
      (*dev)->BeginStep();
      (*cpu)->BeginStep();
      for (int l = 0; l < g.layers; ++l) {
        auto a = (*cpu)->Select(seq, l, rotated.data(), 1, true);
        auto b = (*dev)->SelectDecodeOnBackend(seq, l, queries);
        ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
        EXPECT_EQ(a->chunks, b->chunks) << "rotate " << rotate << " step " << step << " layer " << l;
        EXPECT_NEAR(a->entropy, b->entropy, 1e-6 * std::max(1.0, a->entropy));
      }
    }
    q[static_cast<size_t>(3) * g.head_dim + 2] = std::numeric_limits<float>::quiet_NaN();
    const BackendCopy up{*q_device, q.data(), q_bytes};
    ASSERT_TRUE((*memory)->Upload(&up, 1).ok());
    BackendQueries bad;
    bad.q = reinterpret_cast<const float*>(*q_device);
    bad.q_heads = g.q_heads;
    (*dev)->BeginStep();
    auto refused = (*dev)->SelectDecodeOnBackend(seq, 0, bad);
    ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("q[0][3][2] is not finite (1 NaN"), std::string::npos)
        << refused.status().message();
    (*memory)->Free(*q_device);
  }
#endif
}

TEST(DeviceRetrievalCuda, RetrieverOnACudaHotTierUsesTheCudaBackend) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
#else
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << why;
  TempDir dir;
  StoreOptions o = Options(dir.path());
  o.device = Device::kCuda;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* s = store->get();
  const SequenceId seq = *s->CreateSequence();
  Fill(s, seq, 4 + 16 + 4 * 40, 8);
  RetrieverOptions ro;
  ro.budget_tokens = 5 * 4;
  auto dev = Retriever::Create(s, ro);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  ASSERT_NE((*dev)->backend(), nullptr);
  EXPECT_STREQ((*dev)->backend()->name(), "cuda");
  auto cpu = Retriever::Create(s, ro, CpuBackend());
  ASSERT_TRUE(cpu.ok());
  std::vector<float> q(static_cast<size_t>(s->options().geometry.q_heads) * 16, 0.0f);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(rng);
  (*dev)->BeginStep();
  (*cpu)->BeginStep();
  for (int l = 0; l < s->options().geometry.layers; ++l) {
    auto a = (*cpu)->Select(seq, l, q.data(), 1, true);
    auto b = (*dev)->Select(seq, l, q.data(), 1, true);
    ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
    // Equal scores and order (above); Theta may differ in its last bits (the kernel's exp and
    // sums), which moves Eq. 12's floor only within 1e-16 of an integer.
    EXPECT_EQ(a->chunks, b->chunks) << "layer " << l;
  }
  // FAISS kinds keep the host on a cuda tier.
  ro.index = "Flat";
  auto flat = Retriever::Create(s, ro);
  ASSERT_TRUE(flat.ok());
  EXPECT_EQ((*flat)->backend(), nullptr);
#endif
}

// The mirror obeys the index's memory cap on the device (issue 44): over a stream of adds eight
// times what a capped layer holds, the mirror's counted device memory (offload/device_memory.h)
// is always what the index counts for it (mirror()->bytes()), the whole index stays within the
// cap, and the mirror never holds two capacities at once (it frees before it grows), so its
// peak is the largest capacity it had. The same stream uncapped takes the mirror past the cap.
TEST(DeviceRetrievalCuda, CappedMirrorsCountedDeviceBytesStayWithinTheCap) {
#if !KVTIER_HAVE_CUDA
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
#else
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << why;
  auto cuda = MakeRetrievalBackend("cuda");
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  const ChunkShape shape{2, 64, 4, DType::kF16};  // 2,696 bytes a chunk with the host's rows and codes
  const size_t n = 3200, per = shape.repr_floats();
  const uint64_t cap = 1 << 20;  // about 390 chunks: the stream is 8x that
  const auto reprs = RandomReprs(n, shape, 71);
  auto mirror_bytes = [] { return ReadDeviceMemory().current_of(DeviceMemoryOwner::kRetrievalMirror); };
  const uint64_t base = mirror_bytes();  // mirrors other tests left alive (none expected)
  ResetDeviceMemoryPeaks();
  uint64_t most = 0;
  {
    auto index = MakeExact("Exact:heads=max", shape);
    ASSERT_TRUE(index->AttachBackend(cuda->get()).ok());
    ASSERT_TRUE(index->SetMemoryCap(cap).ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(index->Add(i, reprs.data() + i * per).ok());
      ASSERT_TRUE(index->SyncMirror().ok());
      ASSERT_EQ(mirror_bytes() - base, index->mirror()->bytes()) << "after chunk " << i;
      ASSERT_LE(index->memory_bytes(), cap) << "after chunk " << i;
      most = std::max(most, index->mirror()->bytes());
    }
    EXPECT_GT(index->evicted_chunks(), n / 2);  // the cap applied
    const uint64_t peak = ReadDeviceMemory().peak_of(DeviceMemoryOwner::kRetrievalMirror) - base;
    EXPECT_EQ(peak, most) << "the mirror held more than its capacity at some point";
    EXPECT_LE(peak, cap);
    // What it chooses is what the cpu backend's mirror of the kept chunks chooses.
    auto cpu = CpuBackend();
    auto fresh = MakeExact("Exact:heads=max", shape);
    const uint64_t first = index->evicted_chunks();
    for (uint64_t i = first; i < n; ++i) ASSERT_TRUE(fresh->Add(i, reprs.data() + i * per).ok());
    ASSERT_TRUE(fresh->AttachBackend(cpu.get()).ok());
    const std::vector<float> probe = RandomProbe(shape, 5);
    std::vector<uint64_t> a, b;
    double ta = 0, tb = 0;
    int32_t na = 0, nb = 0;
    ASSERT_TRUE(index->SelectOnBackend(probe.data(), ChunkRank::kLogit, true, 16, &a, &ta, &na).ok());
    ASSERT_TRUE(fresh->SelectOnBackend(probe.data(), ChunkRank::kLogit, true, 16, &b, &tb, &nb).ok());
    EXPECT_EQ(a, b);
  }
  EXPECT_EQ(mirror_bytes(), base);  // the index's mirror gave its memory back
  auto uncapped = MakeExact("Exact:heads=max", shape);
  ASSERT_TRUE(uncapped->AttachBackend(cuda->get()).ok());
  for (size_t i = 0; i < n; ++i) ASSERT_TRUE(uncapped->Add(i, reprs.data() + i * per).ok());
  ASSERT_TRUE(uncapped->SyncMirror().ok());
  EXPECT_EQ(mirror_bytes() - base, uncapped->mirror()->bytes());
  EXPECT_GT(mirror_bytes() - base, 2 * cap);
#endif
}

}  // namespace
}  // namespace kvtier
