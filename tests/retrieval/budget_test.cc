// Tests of retrieval/budget.h: Eq. 10 cosine, Eq. 11 softmax entropy and the Eq. 12 budget
// bookkeeping of ActQKV's dynamic KV cut-off, plus the factory strings.
// Every expected number below is worked out by hand in the comment next to it.
#include "retrieval/budget.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace kvtier {
namespace {

std::unique_ptr<BudgetAllocator> Make(const std::string& spec) {
  auto r = MakeBudgetAllocator(spec);
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

// ---- Eq. 10 ------------------------------------------------------------------------------

TEST(Budget, CosineHandValues) {
  const float x[] = {1, 0}, y[] = {1, 1}, z[] = {0, 0};
  EXPECT_NEAR(Cosine(x, y, 2), 1.0 / std::sqrt(2.0), 1e-7);  // 1 / (1 * sqrt 2)
  const float a[] = {1, 2, 3}, b[] = {-2, -4, -6}, c[] = {3, 0, -1};
  EXPECT_NEAR(Cosine(a, b, 3), -1.0, 1e-7);  // opposite directions
  EXPECT_NEAR(Cosine(a, c, 3), 0.0, 1e-7);   // 3 + 0 - 3 = 0: orthogonal
  const float p[] = {3, 4}, k[] = {4, 3};
  EXPECT_NEAR(Cosine(p, k, 2), 24.0 / 25.0, 1e-7);  // (12 + 12) / (5 * 5)
  EXPECT_EQ(Cosine(x, z, 2), 0.0f);                 // zero norm -> 0, not NaN
  EXPECT_EQ(Cosine(z, z, 2), 0.0f);
  EXPECT_NEAR(Cosine(p, p, 2), 1.0, 1e-7);  // scale-free
}

// ---- Eq. 11 ------------------------------------------------------------------------------

TEST(Budget, SoftmaxEntropyHandValues) {
  // Uniform over n -> log n nats.
  for (int n : {1, 2, 5, 1000}) {
    std::vector<float> s(n, 0.3f);
    EXPECT_NEAR(SoftmaxEntropy(s.data(), n), std::log(static_cast<double>(n)), 1e-12) << n;
  }
  EXPECT_EQ(SoftmaxEntropy(nullptr, 0), 0.0);
  const float one[] = {0.7f};
  EXPECT_EQ(SoftmaxEntropy(one, 1), 0.0);
  // s = (1, 0): p = (e/(1+e), 1/(1+e)) = (0.7310585786, 0.2689414214);
  // -(p1 ln p1 + p2 ln p2) = 0.5822031088882179 nats.
  const float s2[] = {1, 0};
  EXPECT_NEAR(SoftmaxEntropy(s2, 2), 0.5822031088882179, 1e-9);
  // s = (0, ln 3): p = (1/4, 3/4) -> ln 4 - (3/4) ln 3 = 0.5623351446188083.
  const float s3[] = {0, static_cast<float>(std::log(3.0))};
  EXPECT_NEAR(SoftmaxEntropy(s3, 2), std::log(4.0) - 0.75 * std::log(3.0), 1e-7);
  // One-hot-ish: (1000, 0, 0) has p ~ (1, e^-1000, e^-1000): entropy ~0, and no overflow
  // (a naive exp(1000) would be inf).
  const float hot[] = {1000, 0, 0};
  const double h = SoftmaxEntropy(hot, 3);
  EXPECT_TRUE(std::isfinite(h));
  EXPECT_NEAR(h, 0.0, 1e-12);
  // Shift invariance (the max is subtracted): (1000, 1001) == (0, 1) == 0.5822...
  const float big[] = {1000, 1001};
  EXPECT_NEAR(SoftmaxEntropy(big, 2), 0.5822031088882179, 1e-9);
  // More concentrated -> lower entropy (the paper's reading of Theta).
  const float spread[] = {0.1f, 0.1f, 0.1f, 0.1f}, peaked[] = {1, -1, -1, -1};
  EXPECT_GT(SoftmaxEntropy(spread, 4), SoftmaxEntropy(peaked, 4));
}

// ---- topk --------------------------------------------------------------------------------

TEST(Budget, TopKIsFixedAndClamped) {
  auto a = Make("topk");
  EXPECT_EQ(a->ToString(), "topk");
  a->BeginStep(4, 5);
  const int ns[] = {100, 3, 0, 5};
  const int want[] = {5, 3, 0, 5};
  for (int l = 0; l < 4; ++l) {
    auto r = a->Allocate(l, LayerScores{nullptr, ns[l]});  // topk reads no scores
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*r, want[l]) << l;
  }
}

// ---- Eq. 12 ------------------------------------------------------------------------------

// Scores all equal over n chunks: softmax is uniform, so Eq. 11 gives Theta = ln n exactly.
// With u = ln 2, n = 1, 2, 4, 8, 16, 32, 64 give Theta = 0, 1u, 2u, 3u, 4u, 5u, 6u, and the
// ratios in Eq. 12 are rational: every B^l below is worked out by hand in units of u.
Result<int> AllocUniform(BudgetAllocator* a, int layer, int n) {
  static std::vector<float> scores(1024, 0.25f);
  return a->Allocate(layer, LayerScores{scores.data(), n});
}

std::vector<int> Step(BudgetAllocator* a, int L, int k, const std::vector<int>& ns) {
  a->BeginStep(L, k);
  std::vector<int> got;
  for (int l = 0; l < L; ++l) {
    auto r = AllocUniform(a, l, ns[l]);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    got.push_back(r.ok() ? *r : -1);
  }
  return got;
}

TEST(Budget, EntropyHandComputedThreeSteps) {
  // L = 4, k = 4: B_kv = 16 at every BeginStep. Reserve for layer l = 3 - l (min 1 per deeper layer).
  auto owned = EntropyBudget::Make();
  ASSERT_TRUE(owned.ok());
  EntropyBudget* a = owned->get();
  const double u = std::log(2.0);

  // Step 1, n = (16, 0, 2, 8). No running means yet.
  //  l0: Theta 4u. Layers 1..3 never seen: the mean of this step's Theta so far = 4u each.
  //      B = 4 / (4 + 12) * 16 = 4 -> 4 (hi = min(16, 16 - 3) = 13).          B_kv 16 -> 12
  //  l1: n = 0 -> 0; no Theta recorded (layer 1 stays unseen).                 B_kv 12
  //  l2: Theta 1u. Layer 3 unseen: mean of this step's {4u, 1u} = 2.5u.
  //      B = 1 / 3.5 * 12 = 3.43 -> floor 3 -> clamped to n = 2.               B_kv 12 -> 10
  //  l3: last layer: B = B_kv = 10 -> clamped to n = 8 (the rest is unused).   B_kv 10 -> 2
  //  Total 14 <= 16. Running means: Theta-bar = (4u, -, 1u, 3u).
  EXPECT_EQ(Step(a, 4, 4, {16, 0, 2, 8}), (std::vector<int>{4, 0, 2, 8}));
  EXPECT_EQ(a->remaining(), 2);
  EXPECT_NEAR(*a->MeanEntropy(0), 4 * u, 1e-9);
  EXPECT_FALSE(a->MeanEntropy(1).has_value());
  EXPECT_NEAR(*a->MeanEntropy(2), 1 * u, 1e-9);
  EXPECT_NEAR(*a->MeanEntropy(3), 3 * u, 1e-9);

  // Step 2, n = (64, 4, 1, 32).
  //  l0: Theta 6u. Layer 1 still unseen -> this step's mean so far = 6u; Theta-bar2 = 1u,
  //      Theta-bar3 = 3u. B = 6 / (6 + 6 + 1 + 3) * 16 = 6 -> 6.                B_kv 16 -> 10
  //  l1: Theta 2u. B = 2 / (2 + 1 + 3) * 10 = 3.33 -> floor 3 (0.33 handed on). B_kv 10 -> 7
  //  l2: Theta 0 (one chunk). B = 0 -> raised to the minimum 1 = n.            B_kv 7 -> 6
  //  l3: last layer: all that is left, 6 (n = 32).                             B_kv 6 -> 0
  //  Total 16. Running means: Theta-bar = (5u, 2u, 0.5u, 4u).
  EXPECT_EQ(Step(a, 4, 4, {64, 4, 1, 32}), (std::vector<int>{6, 3, 1, 6}));
  EXPECT_EQ(a->remaining(), 0);
  EXPECT_NEAR(*a->MeanEntropy(0), 5 * u, 1e-9);
  EXPECT_NEAR(*a->MeanEntropy(1), 2 * u, 1e-9);
  EXPECT_NEAR(*a->MeanEntropy(2), 0.5 * u, 1e-9);
  EXPECT_NEAR(*a->MeanEntropy(3), 4 * u, 1e-9);

  // Step 3, n = (16, 8, 4, 32): the running means are means over steps (not the last value:
  // with last values layer 0 would get 4 / (4 + 2 + 0 + 5) * 16 = 5.8 -> 5).
  //  l0: Theta 4u. B = 4 / (4 + 2 + 0.5 + 4) * 16 = 6.095 -> 6.                B_kv 16 -> 10
  //  l1: Theta 3u. B = 3 / (3 + 0.5 + 4) * 10 = 4 exactly -> 4 (the 1e-9 tolerance keeps a
  //      computed 3.9999999 from flooring to 3).                              B_kv 10 -> 6
  //  l2: Theta 2u. B = 2 / (2 + 4) * 6 = 2 -> 2.                               B_kv 6 -> 4
  //  l3: last layer: 4.                                                        B_kv 4 -> 0
  EXPECT_EQ(Step(a, 4, 4, {16, 8, 4, 32}), (std::vector<int>{6, 4, 2, 4}));
  EXPECT_EQ(a->remaining(), 0);
}

TEST(Budget, EntropyFloorsAndHandsTheFractionForward) {
  // L = 3, k = 3: B_kv = 9.
  auto a = Make("entropy");
  // Step 1, n = (8, 8, 8): Theta 3u everywhere -> 3 / 9 * 9 = 3, then 3 / 6 * 6 = 3, then 3.
  EXPECT_EQ(Step(a.get(), 3, 3, {8, 8, 8}), (std::vector<int>{3, 3, 3}));
  // Step 2, n = (16, 2, 8); Theta-bar = (3u, 3u, 3u).
  //  l0: Theta 4u. B = 4 / (4 + 3 + 3) * 9 = 3.6 -> floor 3 (rounding would give 4).  B_kv 9 -> 6
  //  l1: Theta 1u. B = 1 / (1 + 3) * 6 = 1.5 -> floor 1 (rounding would give 2).      B_kv 6 -> 5
  //  l2: last layer: 5, the 0.6 + 0.5 handed forward included.                         B_kv 5 -> 0
  EXPECT_EQ(Step(a.get(), 3, 3, {16, 2, 8}), (std::vector<int>{3, 1, 5}));
}

TEST(Budget, EntropyReservesMinimumForDeeperLayersAndSplitsZeroEntropyEvenly) {
  // L = 3, k = 2: B_kv = 6.
  auto a = Make("entropy");
  // Step 1, n = (1, 1, 1): every Theta is 0, so Eq. 12 is 0/0 -> even split of what is left:
  //  l0: 6 / 3 = 2 -> clamped to n = 1.   l1: 5 / 2 = 2.5 -> 2 -> n = 1.   l2: last, 4 -> n = 1.
  EXPECT_EQ(Step(a.get(), 3, 2, {1, 1, 1}), (std::vector<int>{1, 1, 1}));
  // Step 2, n = (32, 8, 8): Theta-bar1 = Theta-bar2 = 0 from step 1.
  //  l0: Theta 5u. B = 5 / (5 + 0 + 0) * 6 = 6, but 2 must stay for layers 1 and 2:
  //      hi = min(32, 6 - 2) = 4 -> 4.                                         B_kv 6 -> 2
  //  l1: Theta 3u. B = 3 / (3 + 0) * 2 = 2 -> hi = min(8, 2 - 1) = 1 -> 1.     B_kv 2 -> 1
  //  l2: last layer: 1.                                                        B_kv 1 -> 0
  EXPECT_EQ(Step(a.get(), 3, 2, {32, 8, 8}), (std::vector<int>{4, 1, 1}));
}

TEST(Budget, EntropyFirstLayerOfFirstStepIsEvenShare) {
  // With no history, the unseen deeper layers are assumed to be like layer 0 itself:
  // B^0 = Theta / (L * Theta) * B_kv = k, whatever the scores (here non-uniform).
  auto a = Make("entropy");
  a->BeginStep(8, 10);
  const float s[] = {0.9f, -0.2f, 0.1f, 0.5f, 0.3f, -0.7f, 0.0f, 0.2f, 0.4f, 0.6f, 0.8f, -0.1f, 0.05f};
  auto r = a->Allocate(0, LayerScores{s, 13});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 10);
}

TEST(Budget, EntropyInvariantsOnRandomSteps) {
  // Sum <= L*k, each layer in [min(M, n), n] (so >= 1 when it has chunks), over random steps.
  std::mt19937 rng(12345);
  for (int M : {1, 2}) {
    auto a = Make("entropy:min=" + std::to_string(M));
    for (int step = 0; step < 300; ++step) {
      const int L = 1 + static_cast<int>(rng() % 6);
      const int k = M + static_cast<int>(rng() % 5);
      a->BeginStep(L, k);
      int64_t total = 0;
      for (int l = 0; l < L; ++l) {
        const int n = (rng() % 5 == 0) ? 0 : static_cast<int>(rng() % (3 * k + 2));
        std::vector<float> s(n);
        std::uniform_real_distribution<float> cosd(-1.0f, 1.0f);
        const float sharp = (rng() % 2) ? 1.0f : 0.05f;
        for (auto& x : s) x = sharp * cosd(rng);
        auto r = a->Allocate(l, LayerScores{s.data(), n});
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        EXPECT_GE(*r, std::min(M, n));
        EXPECT_LE(*r, n);
        total += *r;
      }
      EXPECT_LE(total, static_cast<int64_t>(L) * k);
      EXPECT_GE(static_cast<EntropyBudget*>(a.get())->remaining(), 0);
    }
  }
}

TEST(Budget, ProtocolErrors) {
  for (const char* spec : {"topk", "entropy"}) {
    auto a = Make(spec);
    const float s[] = {0.1f, 0.2f};
    EXPECT_EQ(a->Allocate(0, LayerScores{s, 2}).status().code(), StatusCode::kFailedPrecondition) << spec;
    a->BeginStep(2, 3);
    EXPECT_EQ(a->Allocate(1, LayerScores{s, 2}).status().code(), StatusCode::kFailedPrecondition) << spec;
    EXPECT_EQ(a->Allocate(0, LayerScores{s, -1}).status().code(), StatusCode::kInvalidArgument) << spec;
    ASSERT_TRUE(a->Allocate(0, LayerScores{s, 2}).ok()) << spec;
    ASSERT_TRUE(a->Allocate(1, LayerScores{s, 2}).ok()) << spec;
    EXPECT_EQ(a->Allocate(2, LayerScores{s, 2}).status().code(), StatusCode::kFailedPrecondition) << spec;
    a->BeginStep(0, 3);
    auto r = a->Allocate(0, LayerScores{s, 2});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find("layers"), std::string::npos) << r.status().message();
    a->BeginStep(2, 0);
    r = a->Allocate(0, LayerScores{s, 2});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find("k must"), std::string::npos) << r.status().message();
  }
  auto e = Make("entropy:min=3");
  e->BeginStep(2, 2);  // k < min: the minimum cannot be guaranteed
  const float s[] = {0.1f, 0.2f};
  auto r = e->Allocate(0, LayerScores{s, 2});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("min"), std::string::npos) << r.status().message();
  auto f = Make("entropy");
  f->BeginStep(2, 2);
  EXPECT_EQ(f->Allocate(0, LayerScores{nullptr, 2}).status().code(), StatusCode::kInvalidArgument);
  const float bad[] = {0.1f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_EQ(f->Allocate(0, LayerScores{bad, 2}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(f->Allocate(0, LayerScores{s, 2}).ok());  // the failed calls did not advance the layer
}

TEST(Budget, ResetAndNewLayerCountForgetRunningMeans) {
  auto owned = EntropyBudget::Make();
  ASSERT_TRUE(owned.ok());
  EntropyBudget* a = owned->get();
  Step(a, 2, 2, {4, 4});
  EXPECT_TRUE(a->MeanEntropy(1).has_value());
  a->Reset();
  EXPECT_FALSE(a->MeanEntropy(0).has_value());
  Step(a, 2, 2, {4, 4});
  Step(a, 3, 2, {4, 4, 4});  // a different L: history of the 2-layer model dropped
  EXPECT_NEAR(*a->MeanEntropy(0), std::log(4.0), 1e-9);
  EXPECT_NEAR(*a->MeanEntropy(2), std::log(4.0), 1e-9);
}

// ---- factory strings ------------------------------------------------------------------------

TEST(Budget, FactoryRoundTrips) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"topk", "topk"},
      {"topk:rank=logit", "topk"},  // topk's only order, spelled out or not
      {"entropy", "entropy:min=1,rank=cosine"},
      {"entropy:min=1", "entropy:min=1,rank=cosine"},
      {"entropy:min=4", "entropy:min=4,rank=cosine"},
      {"entropy:rank=logit", "entropy:min=1,rank=logit"},
      {"entropy:rank=cosine,min=2", "entropy:min=2,rank=cosine"},
  };
  for (const auto& [spec, canonical] : cases) {
    auto a = Make(spec);
    ASSERT_NE(a, nullptr) << spec;
    const std::string s1 = a->ToString();
    EXPECT_EQ(s1, canonical);
    auto b = Make(s1);
    ASSERT_NE(b, nullptr) << s1;
    EXPECT_EQ(b->ToString(), s1);
  }
}

TEST(Budget, RankAndScoreNeedsComeFromTheSpec) {
  auto topk = Make("topk");
  ASSERT_NE(topk, nullptr);
  EXPECT_FALSE(topk->reads_scores());
  EXPECT_EQ(topk->rank(), ChunkRank::kLogit);
  auto entropy = Make("entropy");
  ASSERT_NE(entropy, nullptr);
  EXPECT_TRUE(entropy->reads_scores());
  EXPECT_EQ(entropy->rank(), ChunkRank::kCosine);  // Algorithm 1
  auto logit = Make("entropy:rank=logit");
  ASSERT_NE(logit, nullptr);
  EXPECT_EQ(logit->rank(), ChunkRank::kLogit);
  EXPECT_STREQ(ChunkRankName(ChunkRank::kCosine), "cosine");
  EXPECT_STREQ(ChunkRankName(ChunkRank::kLogit), "logit");
}

TEST(Budget, FactoryRejectsBadSpecsNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"bogus", "bogus"},
      {"topk:k=3", "'k'"},
      {"entropy:max=1", "'max'"},
      {"entropy:min=0", "'min'"},
      {"entropy:min=-2", "'min'"},
      {"entropy:min=x", "'min'"},
      {"entropy:min=1.5", "'min'"},
      {"entropy:min=99999999999", "'min'"},
      {"entropy:min", "'min'"},
      {"entropy:", "key=value"},
      {"entropy:min=1,min=2", "duplicate key 'min'"},
      {"entropy:rank=norm", "'rank'"},
      {"entropy:rank=", "key=value"},
      {"topk:rank=cosine", "topk takes the index's top k by logit"},
      {"topk:rank=norm", "'rank'"},
  };
  for (const auto& [spec, needle] : cases) {
    auto r = MakeBudgetAllocator(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(needle), std::string::npos)
        << spec << " -> " << r.status().message() << " (wanted " << needle << ")";
  }
  EntropyBudgetOptions o;
  o.min_chunks = 0;
  EXPECT_NE(o.Validate().message().find("min_chunks"), std::string::npos);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

TEST(EntropyBudget, LastEntropyIsTheEq11EntropyOfTheLastLayer) {
  auto a = MakeBudgetAllocator("entropy");
  ASSERT_TRUE(a.ok());
  (*a)->BeginStep(2, 2);
  const float s0[] = {0.9f, 0.1f, -0.3f}, s1[] = {0.2f, 0.2f};
  ASSERT_TRUE((*a)->Allocate(0, LayerScores{s0, 3}).ok());
  EXPECT_DOUBLE_EQ((*a)->last_entropy(), SoftmaxEntropy(s0, 3));
  ASSERT_TRUE((*a)->Allocate(1, LayerScores{s1, 2}).ok());
  EXPECT_NEAR((*a)->last_entropy(), std::log(2.0), 1e-12);  // two equal scores: ln 2
  auto t = MakeBudgetAllocator("topk");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->last_entropy(), 0.0);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// WouldTake is the grant AllocateWithEntropy (entropy) or Allocate (topk) makes next, and
// asking changes nothing.
TEST(BudgetAllocator, WouldTakeIsTheNextGrantWithoutGrantingIt) {
  std::mt19937 rng(23);
  std::uniform_real_distribution<double> theta(0.0, 6.0);
  std::uniform_int_distribution<int> chunks(0, 300);
  for (const char* spec : {"entropy", "entropy:min=3", "topk"}) {
    auto a = MakeBudgetAllocator(spec);
    ASSERT_TRUE(a.ok());
    auto b = MakeBudgetAllocator(spec);  // the same steps without the questions
    ASSERT_TRUE(b.ok());
    for (int step = 0; step < 30; ++step) {
      (*a)->BeginStep(6, 16);
      (*b)->BeginStep(6, 16);
      for (int l = 0; l < 6; ++l) {
        const int n = chunks(rng);
        const double t = theta(rng);
        const int would = (*a)->WouldTake(l, n, t);
        EXPECT_EQ((*a)->WouldTake(l, n, t), would) << spec;
        Result<int> got = (*a)->reads_scores() ? (*a)->AllocateWithEntropy(l, n, t)
                                               : (*a)->Allocate(l, LayerScores{nullptr, n});
        Result<int> plain = (*b)->reads_scores() ? (*b)->AllocateWithEntropy(l, n, t)
                                                 : (*b)->Allocate(l, LayerScores{nullptr, n});
        ASSERT_TRUE(got.ok() && plain.ok()) << spec;
        EXPECT_EQ(*got, would) << spec << " step " << step << " layer " << l;
        EXPECT_EQ(*plain, *got) << spec;
      }
    }
  }
}

}  // namespace
}  // namespace kvtier
