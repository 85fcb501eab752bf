// Tests of retrieval/probe.h: mean pooling, the ActQKV activation-aware probe (Eq. 7-9, with the
// running statistics of Eq. 8), the question probe, decode probes and the factory strings.
// Every expected number below is worked out by hand in the comment next to it.
#include "retrieval/probe.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace kvtier {
namespace {

Geometry G(int layers, int q_heads, int kv_heads, int head_dim) {
  return Geometry{layers, q_heads, kv_heads, head_dim, DType::kF32};
}

std::unique_ptr<ProbeBuilder> Make(const std::string& spec, const Geometry& g) {
  auto r = MakeProbeBuilder(spec, g);
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

ActProbeBuilder* AsAct(ProbeBuilder* b) { return dynamic_cast<ActProbeBuilder*>(b); }

// Builds q [m, q_heads, D] from per-head query lists: heads[h][j] is query j of head h.
std::vector<float> Queries(const std::vector<std::vector<std::vector<float>>>& heads) {
  const size_t H = heads.size(), m = heads[0].size(), D = heads[0][0].size();
  std::vector<float> q(m * H * D);
  for (size_t h = 0; h < H; ++h)
    for (size_t j = 0; j < m; ++j)
      for (size_t d = 0; d < D; ++d) q[(j * H + h) * D + d] = heads[h][j][d];
  return q;
}

void ExpectProbe(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << what << " [" << i << "]";
}

void ExpectStats(ProbeBuilder* b, int layer, int head, int64_t count, const std::vector<double>& mean,
                 const std::vector<double>& var) {
  auto st = AsAct(b)->Stats(layer, head);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->count, count);
  ASSERT_EQ(st->mean.size(), mean.size());
  for (size_t d = 0; d < mean.size(); ++d) EXPECT_NEAR(st->mean[d], mean[d], 1e-12) << "mean " << d;
  ASSERT_EQ(st->variance.size(), var.size());
  for (size_t d = 0; d < var.size(); ++d) EXPECT_NEAR(st->variance[d], var[d], 1e-12) << "variance " << d;
}

// ---- mean ------------------------------------------------------------------------------

TEST(Probe, MeanPoolsQueriesAndGroupHeads) {
  // Hq = 4, Hkv = 2 (groups {0,1} -> kv 0, {2,3} -> kv 1), D = 2, m = 2.
  const Geometry g = G(2, 4, 2, 2);
  const std::vector<float> q = Queries({{{1, 2}, {3, 4}},    // head 0
                                        {{5, 6}, {7, 8}},    // head 1
                                        {{0, 0}, {4, -4}},   // head 2
                                        {{8, 8}, {0, 0}}});  // head 3
  // kv 0 = (1+3+5+7, 2+4+6+8) / 4 = (4, 5); kv 1 = (0+4+8+0, 0-4+8+0) / 4 = (3, 1).
  auto b = Make("mean", g);
  std::vector<float> probe(4);
  ASSERT_TRUE(b->Build(1, q.data(), 2, probe.data()).ok());
  ExpectProbe(probe, {4, 5, 3, 1}, "mean");
  EXPECT_EQ(b->ToString(), "mean");
}

// ---- act: Eq. 7-9 with the running statistics of Eq. 8 ------------------------------------

// One q head, D = 2, two windows of m = 3 queries.
//
// Window 1: q1 = (0,0), q2 = (0,6), q3 = (3,0).
//   Eq. 8 (t = 1, mt = 3): z-bar = ((0+0+3)/3, (0+6+0)/3) = (1, 2).
//     dim 0 squared deviations 1, 1, 4 -> sum 6  -> sigma^2 = 6 / (3-1)  = 3
//     dim 1 squared deviations 4, 16, 4 -> sum 24 -> sigma^2 = 24 / (3-1) = 12
//   Eq. 7: phi_1 = (1/3, 4/12)  = (1/3, 1/3)  -> ||phi_1||_1 = 2/3
//          phi_2 = (1/3, 16/12) = (1/3, 4/3)  -> 5/3
//          phi_3 = (4/3, 4/12)  = (4/3, 1/3)  -> 5/3          ||Phi||_1 = 4
//   Eq. 9: weights 1/6, 5/12, 5/12 -> probe = 5/12 (0,6) + 5/12 (3,0) = (1.25, 2.5).
//   (Mean pooling would give (1, 2). A scalar sigma^2 (mean over dims, 7.5) would give
//    weights 5/30, 17/30, 8/30 and probe (0.8, 3.4): the per-dimension sigma^2 is pinned.)
//
// Window 2: q4 = (0,0), q5 = (0,6), q6 = (3,6). Eq. 8 sums over BOTH windows (mt = 6):
//   z-bar = ((0+0+3+0+0+3)/6, (0+6+0+0+6+6)/6) = (1, 3).
//     dim 0 squared deviations 1,1,4,1,1,4 -> 12 -> sigma^2 = 12/5 = 2.4
//     dim 1 squared deviations 9,9,9,9,9,9 -> 54 -> sigma^2 = 54/5 = 10.8
//   Eq. 7 (current window only, j = 1..m):
//     phi_4 = (1/2.4, 9/10.8) = (5/12, 5/6) -> 5/4
//     phi_5 = (1/2.4, 9/10.8)               -> 5/4
//     phi_6 = (4/2.4, 9/10.8) = (5/3, 5/6)  -> 5/2               ||Phi||_1 = 5
//   Eq. 9: weights 1/4, 1/4, 1/2 -> probe = 1/4 (0,6) + 1/2 (3,6) = (1.5, 4.5).
//   (Statistics of window 2 alone would give (1.25, 3.5); mean pooling gives (1, 4).)
const std::vector<std::vector<float>> kWin1 = {{0, 0}, {0, 6}, {3, 0}};
const std::vector<std::vector<float>> kWin2 = {{0, 0}, {0, 6}, {3, 6}};

TEST(Probe, ActHandExampleAcrossTwoWindows) {
  const Geometry g = G(1, 1, 1, 2);
  auto b = Make("act", g);
  std::vector<float> probe(2);
  const auto q1 = Queries({kWin1});
  ASSERT_TRUE(b->Build(0, q1.data(), 3, probe.data()).ok());
  ExpectStats(b.get(), 0, 0, 3, {1, 2}, {3, 12});
  ExpectProbe(probe, {1.25, 2.5}, "window 1");

  const auto q2 = Queries({kWin2});
  ASSERT_TRUE(b->Build(0, q2.data(), 3, probe.data()).ok());
  ExpectStats(b.get(), 0, 0, 6, {1, 3}, {2.4, 10.8});  // unbiased: / (mt - 1) = / 5
  ExpectProbe(probe, {1.5, 4.5}, "window 2");
}

TEST(Probe, ActStatisticsArePerLayer) {
  // Layer 1 has seen nothing when layer 0 took window 1: window 2 on layer 1 uses its own stats
  // (window 2 alone: z-bar (1,4), sigma^2 (3, 12); phi = (1/3+16/12, 1/3+4/12, 4/3+4/12) =
  //  (5/3, 2/3, 5/3), weights 5/12, 1/6, 5/12 -> probe 1/6 (0,6) + 5/12 (3,6) = (1.25, 3.5)).
  const Geometry g = G(2, 1, 1, 2);
  auto b = Make("act", g);
  std::vector<float> probe(2);
  const auto q1 = Queries({kWin1}), q2 = Queries({kWin2});
  ASSERT_TRUE(b->Build(0, q1.data(), 3, probe.data()).ok());
  ASSERT_TRUE(b->Build(1, q2.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {1.25, 3.5}, "layer 1");
  ExpectStats(b.get(), 1, 0, 3, {1, 4}, {3, 12});
}

TEST(Probe, ActFirstWindowOfOneQueryFallsBackToMean) {
  // Window 1: m = 1, q = (2, 0). mt - 1 = 0: sigma^2 undefined -> mean pooling = the query.
  // Window 2: (0,0), (4,3). Eq. 8 over all 3: z-bar = (2, 1);
  //   dim 0 squared deviations 0, 4, 4 -> sigma^2 = 8/2 = 4; dim 1: 1, 1, 4 -> sigma^2 = 6/2 = 3.
  //   phi(0,0) = (4/4, 1/3) -> 4/3;  phi(4,3) = (4/4, 4/3) -> 7/3;  ||Phi||_1 = 11/3.
  //   weights 4/11, 7/11 -> probe = 7/11 (4, 3) = (28/11, 21/11).
  const Geometry g = G(1, 2, 1, 2);  // two q heads with the same queries -> same kv probe
  auto b = Make("act", g);
  std::vector<float> probe(2);
  const auto w1 = Queries({{{2, 0}}, {{2, 0}}});
  ASSERT_TRUE(b->Build(0, w1.data(), 1, probe.data()).ok());
  ExpectProbe(probe, {2, 0}, "first window, m = 1");
  auto st = AsAct(b.get())->Stats(0, 0);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->count, 1);
  EXPECT_TRUE(st->variance.empty());  // undefined with one query
  for (float v : probe) EXPECT_TRUE(std::isfinite(v));

  const auto w2 = Queries({{{0, 0}, {4, 3}}, {{0, 0}, {4, 3}}});
  ASSERT_TRUE(b->Build(0, w2.data(), 2, probe.data()).ok());
  ExpectStats(b.get(), 0, 1, 3, {2, 1}, {4, 3});
  ExpectProbe(probe, {28.0 / 11, 21.0 / 11}, "second window");
}

TEST(Probe, ActLaterWindowOfOneQueryIsThatQuery) {
  // After window 1 (count 3), a window of m = 1 has sigma^2 defined; its single weight is 1.
  const Geometry g = G(1, 1, 1, 2);
  auto b = Make("act", g);
  std::vector<float> probe(2);
  const auto q1 = Queries({kWin1});
  ASSERT_TRUE(b->Build(0, q1.data(), 3, probe.data()).ok());
  const std::vector<float> one = {7, -1};
  ASSERT_TRUE(b->Build(0, one.data(), 1, probe.data()).ok());
  ExpectProbe(probe, {7, -1}, "m = 1 later");
}

TEST(Probe, ActZeroVarianceDimensionContributesNothing) {
  // q = (0,5), (0,5), (3,5): dim 1 is constant -> sigma^2 = 0 -> contributes 0 (no inf/NaN).
  // dim 0: z-bar 1, squared deviations 1, 1, 4 -> sigma^2 = 3 -> phi = 1/3, 1/3, 4/3 (sum 2)
  // weights 1/6, 1/6, 2/3 -> probe = (2/3 * 3, 5) = (2, 5). (Mean pooling: (1, 5).)
  const Geometry g = G(1, 1, 1, 2);
  auto b = Make("act", g);
  std::vector<float> probe(2);
  const auto q = Queries({{{0, 5}, {0, 5}, {3, 5}}});
  ASSERT_TRUE(b->Build(0, q.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {2, 5}, "sigma^2 = 0");
}

TEST(Probe, ActVarianceAtOrBelowEpsIsDropped) {
  // q = (0,1), (0,0), (3,0). z-bar = (1, 1/3).
  //   dim 0: squared deviations 1, 1, 4 -> sigma^2 = 3; phi = 1/3, 1/3, 4/3
  //   dim 1: squared deviations 4/9, 1/9, 1/9 -> sigma^2 = (6/9)/2 = 1/3; phi = 4/3, 1/3, 1/3
  // Default eps: ||phi_j||_1 = 5/3, 2/3, 5/3 (sum 4) -> weights 5/12, 1/6, 5/12
  //   -> probe = 5/12 (0,1) + 5/12 (3,0) = (5/4, 5/12).
  // eps = 0.5 > 1/3 drops dim 1: ||phi_j||_1 = 1/3, 1/3, 4/3 -> weights 1/6, 1/6, 2/3
  //   -> probe = 1/6 (0,1) + 2/3 (3,0) = (2, 1/6).
  const Geometry g = G(1, 1, 1, 2);
  const auto q = Queries({{{0, 1}, {0, 0}, {3, 0}}});
  std::vector<float> probe(2);
  auto b = Make("act", g);
  ASSERT_TRUE(b->Build(0, q.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {5.0 / 4, 5.0 / 12}, "eps 1e-6");
  auto c = Make("act:eps=0.5", g);
  ASSERT_TRUE(c->Build(0, q.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {2, 1.0 / 6}, "eps 0.5");
  // eps = 0.3 sits between the unbiased sigma^2 of dim 1, (2/3) / (mt - 1) = 1/3, which is kept,
  // and a biased (2/3) / mt = 2/9, which would be dropped: this pins Eq. 8's mt - 1 inside Build
  // (weights alone are blind to a common scale of sigma^2).
  auto e = Make("act:eps=0.3", g);
  ASSERT_TRUE(e->Build(0, q.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {5.0 / 4, 5.0 / 12}, "eps 0.3");
}

TEST(Probe, ActZeroPhiNormGivesUniformWeights) {
  // eps = 10 is above every sigma^2 here (1/3 and 1/3), so ||Phi||_1 = 0 -> uniform weights:
  // probe = mean of (0,0), (0,1), (1,0) = (1/3, 1/3).
  const Geometry g = G(1, 1, 1, 2);
  std::vector<float> probe(2);
  auto b = Make("act:eps=10", g);
  const auto q = Queries({{{0, 0}, {0, 1}, {1, 0}}});
  ASSERT_TRUE(b->Build(0, q.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {1.0 / 3, 1.0 / 3}, "||Phi|| = 0");
  // All queries identical (and equal to the mean): sigma^2 = 0 everywhere, still finite.
  auto c = Make("act", g);
  const auto same = Queries({{{2, 3}, {2, 3}, {2, 3}}});
  ASSERT_TRUE(c->Build(0, same.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {2, 3}, "identical queries");
}

TEST(Probe, ActGqaStatisticsPerQHeadThenMeanOverGroup) {
  // Hq = 4, Hkv = 2, D = 2, m = 3; statistics are kept per q head.
  //   head 0: window 1 of the hand example          -> (1.25, 2.5)
  //   head 1: (2,3) three times: ||Phi||_1 = 0        -> (2, 3)
  //   head 2: (0,5), (0,5), (3,5): sigma^2 = (3, 0)  -> (2, 5)
  //   head 3: (0,0), (0,6), (3,6) alone: z-bar (1,4), sigma^2 (3, 12),
  //           phi = 5/3, 2/3, 5/3 -> weights 5/12, 1/6, 5/12 -> (1.25, 3.5)
  // kv 0 = mean(head 0, head 1) = (1.625, 2.75); kv 1 = mean(head 2, head 3) = (1.625, 4.25).
  const Geometry g = G(1, 4, 2, 2);
  auto b = Make("act", g);
  const auto q = Queries({kWin1, {{2, 3}, {2, 3}, {2, 3}}, {{0, 5}, {0, 5}, {3, 5}}, kWin2});
  std::vector<float> probe(4);
  ASSERT_TRUE(b->Build(0, q.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {1.625, 2.75, 1.625, 4.25}, "GQA");
  ExpectStats(b.get(), 0, 0, 3, {1, 2}, {3, 12});
  ExpectStats(b.get(), 0, 1, 3, {2, 3}, {0, 0});
  ExpectStats(b.get(), 0, 3, 3, {1, 4}, {3, 12});
}

TEST(Probe, ActRejectsNonFiniteInputAndKeepsStatistics) {
  const Geometry g = G(1, 1, 1, 2);
  auto b = Make("act", g);
  std::vector<float> probe(2);
  const auto q1 = Queries({kWin1});
  ASSERT_TRUE(b->Build(0, q1.data(), 3, probe.data()).ok());
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto q = Queries({kWin2});
    q[5] = bad;
    Status st = b->Build(0, q.data(), 3, probe.data());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("non-finite"), std::string::npos) << st.message();
  }
  ExpectStats(b.get(), 0, 0, 3, {1, 2}, {3, 12});  // untouched
  // ...so the next good window still gives the hand value of window 2.
  const auto q2 = Queries({kWin2});
  ASSERT_TRUE(b->Build(0, q2.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {1.5, 4.5}, "after rejected windows");
}

TEST(Probe, ArgumentChecks) {
  const Geometry g = G(2, 2, 1, 2);
  for (const char* spec : {"mean", "act", "question"}) {
    auto b = Make(spec, g);
    std::vector<float> q(2 * 2 * 2, 1.0f), probe(2);
    EXPECT_EQ(b->Build(2, q.data(), 2, probe.data()).code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_EQ(b->Build(-1, q.data(), 2, probe.data()).code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_EQ(b->Build(0, q.data(), 0, probe.data()).code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_EQ(b->Build(0, nullptr, 2, probe.data()).code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_EQ(b->Build(0, q.data(), 2, nullptr).code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_EQ(b->BuildDecode(5, q.data(), probe.data()).code(), StatusCode::kInvalidArgument) << spec;
    q[1] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(b->BuildDecode(0, q.data(), probe.data()).code(), StatusCode::kInvalidArgument) << spec;
  }
  EXPECT_EQ(AsAct(Make("act", g).get())->Stats(0, 2).status().code(), StatusCode::kInvalidArgument);
}

TEST(Probe, ResetForgetsStatistics) {
  const Geometry g = G(1, 1, 1, 2);
  auto b = Make("act", g);
  std::vector<float> probe(2);
  const auto q1 = Queries({kWin1}), q2 = Queries({kWin2});
  ASSERT_TRUE(b->Build(0, q1.data(), 3, probe.data()).ok());
  b->Reset();
  auto st = AsAct(b.get())->Stats(0, 0);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->count, 0);
  // Window 2 on a fresh sequence: its own statistics -> (1.25, 3.5), not (1.5, 4.5).
  ASSERT_TRUE(b->Build(0, q2.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {1.25, 3.5}, "after Reset");
}

// ---- decode ------------------------------------------------------------------------------

TEST(Probe, DecodeProbeIsCurrentQueryAndLeavesStatistics) {
  // Hq = 4, Hkv = 2: decode probe = current query, mean over each group:
  // kv 0 = ((1,2) + (3,6)) / 2 = (2, 4); kv 1 = ((-1,0) + (1,8)) / 2 = (0, 4).
  const Geometry g = G(1, 4, 2, 2);
  const std::vector<float> q = {1, 2, 3, 6, -1, 0, 1, 8};
  for (const char* spec : {"mean", "act", "question", "question:base=mean,weight=1"}) {
    auto b = Make(spec, g);
    std::vector<float> probe(4);
    const auto win = Queries({kWin1, kWin1, kWin2, kWin2});
    ASSERT_TRUE(b->Build(0, win.data(), 3, probe.data()).ok());
    if (std::string(spec).rfind("question", 0) == 0) {
      ASSERT_TRUE(b->SetQuestion(0, q.data(), 1).ok());
    }
    ASSERT_TRUE(b->BuildDecode(0, q.data(), probe.data()).ok());
    ExpectProbe(probe, {2, 4, 0, 4}, spec);
    if (AsAct(b.get()) != nullptr) {
      ExpectStats(b.get(), 0, 0, 3, {1, 2}, {3, 12});  // decode did not count
    }
  }
  // The act statistics after decode steps: window 2 still gives its two-window hand value.
  const Geometry g1 = G(1, 1, 1, 2);
  auto b = Make("act", g1);
  std::vector<float> probe(2);
  const auto q1 = Queries({kWin1}), q2 = Queries({kWin2});
  const std::vector<float> dq = {100, -100};
  ASSERT_TRUE(b->Build(0, q1.data(), 3, probe.data()).ok());
  ASSERT_TRUE(b->BuildDecode(0, dq.data(), probe.data()).ok());
  ExpectProbe(probe, {100, -100}, "decode");
  ASSERT_TRUE(b->Build(0, q2.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {1.5, 4.5}, "window 2 after a decode step");
}

// ---- question ------------------------------------------------------------------------------

TEST(Probe, QuestionMixesBaseAndQuestion) {
  // base = mean, w = 0.25, Hq = 2, Hkv = 1, D = 2.
  // Window: head 0 (1,1), (3,3); head 1 (1,3), (3,5) -> mean probe (2, 3).
  // Question (m = 2): head 0 (4,0), (8,0); head 1 (6,4), (6,-4) -> pooled (6, 0).
  // probe = 0.75 (2,3) + 0.25 (6,0) = (3, 2.25).
  const Geometry g = G(2, 2, 1, 2);
  auto b = Make("question:base=mean,weight=0.25", g);
  const auto win = Queries({{{1, 1}, {3, 3}}, {{1, 3}, {3, 5}}});
  const auto question = Queries({{{4, 0}, {8, 0}}, {{6, 4}, {6, -4}}});
  std::vector<float> probe(2);
  ASSERT_TRUE(b->Build(0, win.data(), 2, probe.data()).ok());
  ExpectProbe(probe, {2, 3}, "no question = base");
  ASSERT_TRUE(b->SetQuestion(0, question.data(), 2).ok());
  auto* qb = dynamic_cast<QuestionProbeBuilder*>(b.get());
  ASSERT_NE(qb, nullptr);
  EXPECT_TRUE(qb->has_question(0));
  EXPECT_FALSE(qb->has_question(1));
  ASSERT_TRUE(b->Build(0, win.data(), 2, probe.data()).ok());
  ExpectProbe(probe, {3, 2.25}, "with question");
  ASSERT_TRUE(b->Build(1, win.data(), 2, probe.data()).ok());  // layer 1 has no question
  ExpectProbe(probe, {2, 3}, "other layer");
  b->Reset();  // new sequence: question forgotten
  EXPECT_FALSE(qb->has_question(0));
  ASSERT_TRUE(b->Build(0, win.data(), 2, probe.data()).ok());
  ExpectProbe(probe, {2, 3}, "after Reset");
}

TEST(Probe, QuestionOverActBase) {
  // Default base act, w = 0.5: without a question it equals act (window 1: (1.25, 2.5));
  // with question (4, -2): window 2 -> 0.5 (1.5, 4.5) + 0.5 (4, -2) = (2.75, 1.25): the act
  // statistics advanced through window 1 even though the question builder wrapped them.
  const Geometry g = G(1, 1, 1, 2);
  auto b = Make("question", g);
  EXPECT_EQ(b->ToString(), "question:base=act,eps=1e-06,weight=0.5");
  std::vector<float> probe(2);
  const auto q1 = Queries({kWin1}), q2 = Queries({kWin2});
  ASSERT_TRUE(b->Build(0, q1.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {1.25, 2.5}, "no question = act");
  const std::vector<float> question = {4, -2};
  ASSERT_TRUE(b->SetQuestion(0, question.data(), 1).ok());
  ASSERT_TRUE(b->Build(0, q2.data(), 3, probe.data()).ok());
  ExpectProbe(probe, {2.75, 1.25}, "act + question");
}

TEST(Probe, SetQuestionOnBuildersWithoutOneFails) {
  const Geometry g = G(1, 1, 1, 2);
  const std::vector<float> q = {1, 2};
  for (const char* spec : {"mean", "act"}) {
    Status st = Make(spec, g)->SetQuestion(0, q.data(), 1);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << spec;
  }
  auto b = Make("question", g);
  EXPECT_EQ(b->SetQuestion(1, q.data(), 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b->SetQuestion(0, q.data(), 0).code(), StatusCode::kInvalidArgument);
}

// ---- factory strings ------------------------------------------------------------------------

TEST(Probe, FactoryRoundTrips) {
  const Geometry g = G(2, 4, 2, 8);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"mean", "mean"},
      {"act", "act:eps=1e-06"},
      {"act:eps=1e-06", "act:eps=1e-06"},
      {"act:eps=0", "act:eps=0"},
      {"act:eps=0.001", "act:eps=0.001"},
      {"act:eps=1.23456789e-07", "act:eps=1.23456789e-07"},
      {"act:eps=0.000000123456789012345678", "act:eps=1.2345678901234568e-07"},
      {"question", "question:base=act,eps=1e-06,weight=0.5"},
      {"question:base=mean", "question:base=mean,weight=0.5"},
      {"question:weight=0.25,base=mean", "question:base=mean,weight=0.25"},
      {"question:weight=1,eps=2e-06,base=act", "question:base=act,eps=2e-06,weight=1"},
  };
  for (const auto& [spec, canonical] : cases) {
    auto b1 = Make(spec, g);
    ASSERT_NE(b1, nullptr) << spec;
    const std::string s1 = b1->ToString();
    EXPECT_EQ(s1, canonical) << spec;
    auto b2 = Make(s1, g);
    ASSERT_NE(b2, nullptr) << s1;
    EXPECT_EQ(b2->ToString(), s1) << spec;
  }
  // Shortest round-trip formatting: the rebuilt eps is the same double, bit for bit.
  EXPECT_EQ(AsAct(Make("act:eps=0.000000123456789012345678", g).get())->options().eps,
            1.23456789012345678e-07);
}

TEST(Probe, FactoryRejectsBadSpecsNamingThem) {
  const Geometry g = G(2, 4, 2, 8);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"bogus", "bogus"},
      {"bogus:eps=1", "bogus"},
      {":eps=1", "no name"},
      {"act:", "key=value"},
      {"act:eps", "'eps'"},
      {"act:eps=", "'eps='"},
      {"act:=1", "'=1'"},
      {"act:eps=1e-6,", "''"},
      {"act:foo=1", "'foo'"},
      {"act:eps=abc", "'eps'"},
      {"act:eps=1e-6x", "'eps'"},
      {"act:eps=nan", "'eps'"},
      {"act:eps=inf", "'eps'"},
      {"act:eps=-1", "'eps'"},
      {"act:eps=1e-6,eps=1e-5", "duplicate key 'eps'"},
      {"mean:eps=1", "'eps'"},
      {"question:weight=1.5", "'weight'"},
      {"question:weight=-0.1", "'weight'"},
      {"question:weight=x", "'weight'"},
      {"question:base=question", "'base'"},
      {"question:base=", "'base='"},
      {"question:base=mean,eps=1e-6", "'eps'"},
      {"question:eps=-1", "'eps'"},
      {"question:gamma=1", "'gamma'"},
  };
  for (const auto& [spec, needle] : cases) {
    auto r = MakeProbeBuilder(spec, g);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(needle), std::string::npos)
        << spec << " -> " << r.status().message() << " (wanted " << needle << ")";
  }
  Geometry bad = g;
  bad.kv_heads = 3;
  EXPECT_EQ(MakeProbeBuilder("act", bad).status().code(), StatusCode::kInvalidArgument);
  ActProbeOptions ao;
  ao.eps = -1;
  EXPECT_NE(ao.Validate().message().find("eps"), std::string::npos);
  QuestionProbeOptions qo;
  qo.weight = 2;
  EXPECT_NE(qo.Validate().message().find("weight"), std::string::npos);
  qo = QuestionProbeOptions{};
  qo.base = "x";
  EXPECT_NE(qo.Validate().message().find("base"), std::string::npos);
}

}  // namespace
}  // namespace kvtier
