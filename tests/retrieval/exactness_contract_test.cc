// The exactness contract of the default retrieval (the "kvtier" preset: Exact:heads=max with
// the int8 screen, entropy:rank=logit), docs/retrieval.md "The exactness contract":
//   - each layer's chunks are the fp32 pass's top-B for the grant B the layer got;
//   - the grant's Θ (Eq. 11, from the screened cosines) is within ThetaErrorBound of the fp32 Θ
//     of the same chunks at every step, and within 1e-3 nats of it as measured;
//   - the grant equals the one the fp32 Θ gets in >= 99.5% of layer steps and is never off by
//     more than one chunk.
// Measured over the synthetic needle workload (integration/workload.h), several seeds. The
// reference side is independent of the Retriever: a twin probe builder fed the same queries,
// an fp32 index (rerank=0: one exact pass) built from the store's representatives, and a twin
// allocator that follows the Retriever's grants, so that both grants are asked of the same
// allocator state.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "integration/workload.h"
#include "kernels/dtype.h"
#include "retrieval/budget.h"
#include "retrieval/chunk_index.h"
#include "retrieval/probe.h"
#include "retrieval/retriever.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

struct ContractFigures {
  int64_t layer_steps = 0;
  int64_t equal_grants = 0;
  int max_grant_difference = 0;
  double max_theta_error = 0.0;  // max |Θ_default - Θ_fp32|, nats
  double max_theta_bound = 0.0;  // max of ThetaErrorBound over the layer steps, nats
  int64_t chunks_not_top_b = 0;  // layer steps whose chunks are not the fp32 top-B
};

// The stated bound on |Θ(screened) - Θ(exact)| (docs/retrieval.md): with e the largest cosine
// error bound of the screen and R the spread (max - min) of the screened cosines,
// |ΔΘ| <= e (R / 2 + e). Along the segment from one score vector to the other, dΘ/dτ =
// -sum_i p_i (s_i - mean_p s) δ_i, whose size is at most e times the standard deviation of s
// under p, which is at most half the spread of s, and the spread stays below R + 2e.
double ThetaErrorBound(const ChunkScores& screened) {
  if (screened.cosine.empty()) return 0.0;
  const auto [lo, hi] = std::minmax_element(screened.cosine.begin(), screened.cosine.end());
  const double e = screened.cosine_error.empty()
                       ? 0.0
                       : *std::max_element(screened.cosine_error.begin(), screened.cosine_error.end());
  return e * ((static_cast<double>(*hi) - *lo) / 2.0 + e);
}

// Runs the default retrieval over one workload's question window and decode steps (one query
// per step, every layer) and adds what it measured to *f.
void MeasureWorkload(const WorkloadOptions& wo, ContractFigures* f) {
  const Geometry g{4, 8, 2, 32, DType::kF16};
  auto workload = Workload::Create(g, wo);
  ASSERT_TRUE(workload.ok()) << workload.status().ToString();
  TempDir dir;
  StoreOptions so;
  so.geometry = g;
  so.n_sink = 4;
  so.n_local = 64;
  so.chunk_size = 16;
  so.repr_topk = 8;
  so.hot_bytes = 4096 * so.chunk_bytes();  // never clips a grant: the step budget is far below
  so.warm_bytes = 64 * so.chunk_bytes();
  so.data_dir = dir.path();
  auto store = TieredStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* s = store->get();
  const SequenceId seq = *s->CreateSequence();
  const int64_t context = wo.context;
  {
    std::vector<float> k(static_cast<size_t>(context) * g.token_elems()), v(k.size());
    std::vector<uint16_t> k16(k.size()), v16(k.size());  // the store holds fp16 keys
    for (int l = 0; l < g.layers; ++l) {
      workload->Generate(l, 0, context, nullptr, k.data(), v.data());
      FromFloat(DType::kF16, k.data(), k16.data(), k.size());
      FromFloat(DType::kF16, v.data(), v16.data(), v.size());
      const Status appended =
          s->Append(seq, l, k16.data(), v16.data(), static_cast<int>(context), DType::kF16);
      ASSERT_TRUE(appended.ok()) << appended.ToString();
    }
  }

  RetrieverOptions ro = RecommendedRetrieval();
  ro.budget_tokens = 256;  // k = 16 chunks of 16 per layer
  auto retriever = Retriever::Create(s, ro);
  ASSERT_TRUE(retriever.ok()) << retriever.status().ToString();
  Retriever* r = retriever->get();

  // The reference: the same probe, the fp32 pass, and the allocator in the Retriever's state.
  auto probe = MakeProbeBuilder(ro.probe, g);
  ASSERT_TRUE(probe.ok());
  auto twin = MakeBudgetAllocator(ro.alloc);
  ASSERT_TRUE(twin.ok());
  ASSERT_EQ((*twin)->rank(), ChunkRank::kLogit);
  auto fp32_options = ExactIndexOptions::Parse(ro.index);
  ASSERT_TRUE(fp32_options.ok());
  fp32_options->rerank_factor = 0;
  const ChunkShape shape{g.kv_heads, g.head_dim, so.repr_topk, g.dtype};
  auto default_options = ExactIndexOptions::Parse(ro.index);
  ASSERT_TRUE(default_options.ok());
  ASSERT_GT(default_options->rerank_factor, 0);  // the default screens with int8 codes
  // Per layer: the fp32 pass, and the default's first stage (for its error bounds).
  std::vector<std::unique_ptr<ExactChunkIndex>> fp32(g.layers), screen(g.layers);
  for (int l = 0; l < g.layers; ++l) {
    auto count = s->ChunkCount(seq, l);
    ASSERT_TRUE(count.ok());
    std::vector<uint64_t> chunks(*count);
    for (uint64_t c = 0; c < *count; ++c) chunks[c] = c;
    const ReprReader read = [&](uint64_t c, float* repr) {
      return s->GetRepresentatives(ChunkKey{seq, static_cast<uint32_t>(l), c}, repr);
    };
    auto exact_index = ExactChunkIndex::Create(shape, *fp32_options);
    auto screen_index = ExactChunkIndex::Create(shape, *default_options);
    ASSERT_TRUE(exact_index.ok() && screen_index.ok());
    fp32[l] = std::move(exact_index).value();
    screen[l] = std::move(screen_index).value();
    ASSERT_TRUE(fp32[l]->Add(chunks, read).ok());
    ASSERT_TRUE(screen[l]->Add(chunks, read).ok());
    ASSERT_GT(fp32[l]->size(), 100u);
  }

  std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim), p(shape.dim());
  ChunkScores exact, screened;
  std::vector<uint64_t> top_b;
  const int k = ro.budget_tokens / so.chunk_size;
  for (int64_t t = workload->question_begin(); t < workload->total_tokens(); ++t) {
    r->BeginStep();
    (*twin)->BeginStep(g.layers, k);
    for (int l = 0; l < g.layers; ++l) {
      workload->Generate(l, t, t + 1, q.data(), nullptr, nullptr);
      auto sel = r->Select(seq, l, q.data(), 1, /*decode=*/true);
      ASSERT_TRUE(sel.ok()) << sel.status().ToString();
      ASSERT_TRUE((*probe)->BuildDecode(l, q.data(), p.data()).ok());
      ASSERT_TRUE(fp32[l]->Score(p.data(), &exact).ok());
      const int n = static_cast<int>(exact.ids.size());
      const double theta_fp32 = SoftmaxEntropy(exact.cosine.data(), n);
      ASSERT_TRUE(screen[l]->Screen(p.data(), &screened).ok());
      ASSERT_FALSE(screened.cosine_error.empty());
      const double bound = ThetaErrorBound(screened);
      EXPECT_LE(std::abs(sel->entropy - theta_fp32), bound) << "layer " << l << " step " << t;
      f->max_theta_bound = std::max(f->max_theta_bound, bound);
      const int grant_fp32 = (*twin)->WouldTake(l, n, theta_fp32);
      auto grant = (*twin)->AllocateWithEntropy(l, n, sel->entropy);
      ASSERT_TRUE(grant.ok());
      ASSERT_EQ(sel->clipped, 0u);
      ASSERT_EQ(static_cast<int>(sel->chunks.size()), *grant) << "layer " << l << " step " << t;
      ASSERT_TRUE(fp32[l]->Best(p.data(), exact, ChunkRank::kLogit, *grant, &top_b).ok());
      ++f->layer_steps;
      f->equal_grants += *grant == grant_fp32;
      f->max_grant_difference = std::max(f->max_grant_difference, std::abs(*grant - grant_fp32));
      f->max_theta_error = std::max(f->max_theta_error, std::abs(sel->entropy - theta_fp32));
      f->chunks_not_top_b += sel->chunks != top_b;
    }
  }
}

TEST(ExactnessContract, DefaultRetrievalChoosesTheFp32TopBForAGrantWithinTheBounds) {
  ContractFigures f;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    WorkloadOptions wo;
    wo.context = 4096;
    wo.question_len = 64;
    wo.decode_steps = 192;
    wo.needle_count = static_cast<int>(seed);  // 1..4 needles
    wo.question_anchor_every = 2;              // filler queries among the seekers: spread entropies
    wo.topic_len = 128;
    wo.seed = seed;
    MeasureWorkload(wo, &f);
    if (HasFatalFailure()) return;
  }
  const double equal_share = static_cast<double>(f.equal_grants) / static_cast<double>(f.layer_steps);
  std::printf(
      "[exactness contract] layer steps %lld, max |dTheta| %.3g nats (bound %.3g), equal grants %.4f, max "
      "|dB| %d, "
      "chunks not the fp32 top-B %lld\n",
      static_cast<long long>(f.layer_steps), f.max_theta_error, f.max_theta_bound, equal_share,
      f.max_grant_difference, static_cast<long long>(f.chunks_not_top_b));
  EXPECT_GE(f.layer_steps, 4000);
  EXPECT_EQ(f.chunks_not_top_b, 0);
  // Every step's |ΔΘ| lies within ThetaErrorBound (checked above). That guaranteed bound is not
  // within 1e-3 nats (measured up to 8.1e-3: the screen's per-chunk cosine bounds are worst
  // cases); the measured error is, by a wide margin.
  EXPECT_LE(f.max_theta_error, 1e-3);
  EXPECT_GE(equal_share, 0.995);
  EXPECT_LE(f.max_grant_difference, 1);
}

}  // namespace
}  // namespace kvtier
