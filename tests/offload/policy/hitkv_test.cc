// Tests of offload/policy/hitkv.cc: HitKV's hit (Definition 1), hit rate (Eq. 1), the θ threshold with
// cumulative-attention padding, the GQA and window choices, P-HitKV's PyramidKV per-layer budgets, and
// the properties every policy must hold on a long random stream. Every expected number is worked out
// in the comment next to it; attention values are multiples of 1/16 so that sums are exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "offload/policy/policies.h"
#include "offload/policy/scoring_policy.h"
#include "tests/policy_test_util.h"

namespace kvtier {
namespace {

using policies::PyramidLayerBudgets;

using policy_test::Feed;
using policy_test::Geo;
using policy_test::Make;
using policy_test::Obs;
using policy_test::Range;
using policy_test::Start;

std::vector<float> HeadScores(ScoringPolicy* p, int layer, int head) {
  auto s = p->Scores(layer);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? s->per_head[head] : std::vector<float>{};
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << what << " key " << i;
}

std::vector<int64_t> KeepHead(ScoringPolicy* p, int layer, int64_t budget, int head = 0) {
  auto k = p->Keep(layer, budget);
  EXPECT_TRUE(k.ok()) << k.status().ToString();
  return k.ok() ? k->per_head[head] : std::vector<int64_t>{};
}

// The worked example. 2 query heads sharing 1 kv head (G = 2), no protected keys; keys 0..5; the
// recent window L_w is the queries at positions 4 and 5 (query 4 cannot see key 5).
//   head 0, query 4: [.5   .25  .125 .125  0     0  ]   Top-2 {0, 1}
//   head 0, query 5: [.375 .125 .25  .0625 .1875 0  ]   Top-2 {0, 2}
//   head 1, query 4: [.125 .5   .125 .25   0     0  ]   Top-2 {1, 3}
//   head 1, query 5: [.25  .125 .125 .125  .125  .25]   Top-2 {0, 5}
// With K = 2 (Definition 1), hits over the G |L_w| = 4 observers (our GQA rule):
//   hits = [3 2 1 1 0 1] -> T_hr (Eq. 1) = [.75 .5 .25 .25 0 .25]
// Recent cumulative attention (sum of the four rows): cum = [1.25 1 .625 .5625 .3125 .25].
const PolicyGeometry kG = Geo(1, 2, 1, 0, 0);
const Obs kWindow{0, Range(0, 6), {4, 5}, {0.5f,  0.25f,   0.125f,  0.125f, 0.0f,   0.0f,   0.375f, 0.125f,
                                           0.25f, 0.0625f, 0.1875f, 0.0f,   0.125f, 0.5f,   0.125f, 0.25f,
                                           0.0f,  0.0f,    0.25f,   0.125f, 0.125f, 0.125f, 0.125f, 0.25f}};

std::vector<int64_t> KeepOnWindow(const std::string& spec, int64_t budget) {
  auto p = Start(spec, kG);
  Feed(p.get(), kWindow);
  return KeepHead(p.get(), 0, budget);
}

TEST(HitKv, ScoresFollowDefinition1AndEq1WithGqaHitsOverTheGroup) {
  auto p = Start("hitkv:k=2", kG);
  Feed(p.get(), kWindow);
  // θ = 0.5: keys 0 and 1 pass and score 2 + T_hr + cum / (o (o + 1)) with o = 4:
  //   key 0: 2 + .75 + 1.25 / 20 = 2.8125;  key 1: 2 + .5 + 1 / 20 = 2.55  (T_hr = θ passes: >=)
  // the others score cum / o: .15625, .140625, .078125, .0625.
  // (Averaging the group's attention before Top-2 instead would give key 2 T_hr = .5 and a score > 2;
  // dividing by |L_w| = 2 instead of G |L_w| would let every key but 4 pass.)
  ExpectNear(HeadScores(p.get(), 0, 0), {2.8125, 2.55, 0.15625, 0.140625, 0.078125, 0.0625}, "k=2");
}

TEST(HitKv, TopKRanksOnlyTheKeysAQueryCanSee) {
  // K = 5. Query 4 sees 5 keys (0..4): K >= 5, so all five hit, key 4 with attention 0 included and
  // key 5 (in its future) not. Query 5: the Top-5 of 6 drops the lowest: head 0 drops key 5 (0),
  // head 1 drops one of the four .125s, the earliest (key 1; ties go to the later key).
  //   hits = [4 3 4 4 4 1] -> T_hr = [1 .75 1 1 1 .25]; θ = .25 lets all pass: score 2 + T_hr + cum / 20
  //   -> [3.0625 2.8 3.03125 3.028125 3.015625 2.2625].
  // (Ranking key 5 in query 4's Top-5 would tie it with key 4 at 0 and, by the later-key rule, give
  // it the hit: key 4 T_hr .75, key 5 .5.)
  auto p = Start("hitkv:k=5,theta=0.25", kG);
  Feed(p.get(), kWindow);
  ExpectNear(HeadScores(p.get(), 0, 0), {3.0625, 2.8, 3.03125, 3.028125, 3.015625, 2.2625}, "k=5");
}

TEST(HitKv, KeepsHitRateAtLeastThetaThenPadsWithCumulativeAttention) {
  // θ = .5, K = 2, budget 4: T_hr >= .5 keeps {0, 1}; padding by cum among the rest
  // (2: .625, 3: .5625, 4: .3125, 5: .25) adds 2 and 3.
  EXPECT_EQ(KeepOnWindow("hitkv:k=2", 4), (std::vector<int64_t>{0, 1, 2, 3}));
  // Budget 1: two keys pass, the higher T_hr (key 0) wins.
  EXPECT_EQ(KeepOnWindow("hitkv:k=2", 1), (std::vector<int64_t>{0}));
  // θ = .25: {0, 1, 2, 3, 5} pass (T_hr >= .25) and fill budget 5 exactly; key 4 has the higher
  // cumulative attention (.3125 > .25) but T_hr 0 < θ, so it is the one evicted. (A pure cumulative
  // ranking, or T_hr > θ, would keep 4 instead of 5.)
  EXPECT_EQ(KeepOnWindow("hitkv:k=2,theta=0.25", 5), (std::vector<int64_t>{0, 1, 2, 3, 5}));
  // Budget 3 < 5 passing: by T_hr (0: .75, 1: .5), then the .25 tie {2, 3, 5} goes by cumulative
  // attention (2: .625), not by position (which would pick 5).
  EXPECT_EQ(KeepOnWindow("hitkv:k=2,theta=0.25", 3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(KeepOnWindow("hitkv:k=2,theta=0.25", 4), (std::vector<int64_t>{0, 1, 2, 3}));
  // θ = 1: nobody passes (max T_hr .75): pure cumulative attention.
  EXPECT_EQ(KeepOnWindow("hitkv:k=2,theta=1", 3), (std::vector<int64_t>{0, 1, 2}));
  // Budget >= keys keeps everything.
  EXPECT_EQ(KeepOnWindow("hitkv:k=2", 6), Range(0, 6));
}

TEST(HitKv, HitCoefficientDefaultsToTheBudget) {
  // k = 0 means K = budget. Budget 5, θ = .25: K = 5 gives T_hr = [1 .75 1 1 1 .25] (see above),
  // all pass, the four 1s then key 1 -> {0, 1, 2, 3, 4}; K = 2 would keep {0, 1, 2, 3, 5}.
  EXPECT_EQ(KeepOnWindow("hitkv:theta=0.25", 5), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(KeepOnWindow("hitkv:k=5,theta=0.25", 5), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  for (int64_t b = 1; b <= 6; ++b)
    EXPECT_EQ(KeepOnWindow("hitkv", b), KeepOnWindow("hitkv:k=" + std::to_string(b), b)) << "budget " << b;
  // Scores with k = 0: K = sink_tokens + local_tokens (here 0 -> at least 1) before any Keep, then
  // the latest Keep's budget.
  auto p = Start("hitkv", kG);
  auto k1 = Start("hitkv:k=1", kG);
  auto k6 = Start("hitkv:k=6", kG);
  Feed(p.get(), kWindow);
  Feed(k1.get(), kWindow);
  Feed(k6.get(), kWindow);
  EXPECT_EQ(HeadScores(p.get(), 0, 0), HeadScores(k1.get(), 0, 0));
  EXPECT_EQ(KeepHead(p.get(), 0, 6), Range(0, 6));
  EXPECT_EQ(HeadScores(p.get(), 0, 0), HeadScores(k6.get(), 0, 0));
}

TEST(HitKv, ProtectedKeysComeFirstAndCountInTheBudget) {
  // Sink 1 (position 0) and local window 1 (key 5): budget 3 leaves one slot, for T_hr = .5 key 1
  // (key 0 is already kept as a sink).
  auto p = Start("hitkv:k=2", Geo(1, 2, 1, 1, 1));
  Feed(p.get(), kWindow);
  EXPECT_EQ(KeepHead(p.get(), 0, 3), (std::vector<int64_t>{0, 1, 5}));
  auto q = Start("hitkv:k=2", Geo(1, 2, 1, 1, 1));
  Feed(q.get(), kWindow);
  auto r = q->Keep(0, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("protected"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("hitkv"), std::string::npos) << r.status().message();
}

TEST(HitKv, KvHeadsCountHitsOnlyFromTheirOwnGroup) {
  // 2 query heads, 2 kv heads (G = 1): kv 0 sees only head 0's rows, kv 1 only head 1's.
  // K = 2, o = 2. kv 0: hits [2 1 1 0 0 0] -> T_hr [1 .5 .5 0 0 0]; kv 1: hits [1 1 0 1 0 1].
  auto p = Start("hitkv:k=2", Geo(1, 2, 2, 0, 0));
  Feed(p.get(), kWindow);
  // kv 0 budget 2: pass {0, 1, 2}; T_hr 1 (key 0), then the .5 tie by cum of head 0's rows:
  // key 1 .375 vs key 2 .375 -> tie -> the later key 2.
  // kv 1 budget 2: pass {0, 1, 3, 5} all .5; cum over head 1's rows: 0 .375, 1 .625, 3 .375, 5 .25
  // -> key 1, then 0 and 3 tie at .375 -> the later key 3.
  auto k = p->Keep(0, 2);
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->per_head, (std::vector<std::vector<int64_t>>{{0, 2}, {1, 3}}));
}

// ---- the recent window across observations (window=W) ----------------------------------------------

// One head. Observation 1: keys 0..2, queries 1 and 2; observation 2: keys 0..3, query 3.
//   q1: [.75 .25 0]   q2: [.25 .5 .25]   q3: [.25 .25 .125 .375]
const Obs kFirst{0, {0, 1, 2}, {1, 2}, {0.75f, 0.25f, 0.0f, 0.25f, 0.5f, 0.25f}};
const Obs kSecond{0, {0, 1, 2, 3}, {3}, {0.25f, 0.25f, 0.125f, 0.375f}};

TEST(HitKv, WindowSpansObservations) {
  const PolicyGeometry g = Geo(1, 1, 1, 0, 0);
  // window = 3: L_w = {q1, q2, q3}; q1's row gives 0 to keys 2 and 3 (its future). K = 1:
  // hits: q1 -> 0, q2 -> 1, q3 -> 3: T_hr 1/3 < .5 for all -> scores cum / 3 with
  // cum = [1.25 1 .375 .375].
  auto w3 = Start("hitkv:k=1,window=3", g);
  Feed(w3.get(), kFirst);
  Feed(w3.get(), kSecond);
  ExpectNear(HeadScores(w3.get(), 0, 0), {1.25 / 3, 1.0 / 3, 0.125, 0.125}, "window=3");
  // Observing the second observation again replaces q3's row instead of adding a second one.
  Feed(w3.get(), kSecond);
  ExpectNear(HeadScores(w3.get(), 0, 0), {1.25 / 3, 1.0 / 3, 0.125, 0.125}, "window=3 again");
  // window = 2: L_w = {q2, q3}, o = 2: keys 1 and 3 have T_hr .5 and pass:
  //   key 1: 2 + .5 + .75 / 6 = 2.625; key 3: 2 + .5 + .375 / 6 = 2.5625; key 0: .5 / 2; key 2: .375 / 2.
  auto w2 = Start("hitkv:k=1,window=2", g);
  Feed(w2.get(), kFirst);
  Feed(w2.get(), kSecond);
  ExpectNear(HeadScores(w2.get(), 0, 0), {0.25, 2.625, 0.1875, 2.5625}, "window=2");
  // window = 0 (default): the latest observation only, L_w = {q3}: key 3 T_hr 1 -> 2 + 1 + .375 / 2.
  auto w0 = Start("hitkv:k=1", g);
  Feed(w0.get(), kFirst);
  Feed(w0.get(), kSecond);
  ExpectNear(HeadScores(w0.get(), 0, 0), {0.25, 0.25, 0.125, 3.1875}, "window=0");
}

TEST(HitKv, KeepForgetsDroppedKeysInTheStoredWindow) {
  const PolicyGeometry g = Geo(1, 1, 1, 0, 0);
  auto p = Start("hitkv:k=1,window=4", g);
  Feed(p.get(), kFirst);
  // L_w = {q1, q2}, K = 1: hits key 0 (q1) and key 1 (q2): T_hr .5 each -> keep {0, 1}, forget 2.
  EXPECT_EQ(KeepHead(p.get(), 0, 2), (std::vector<int64_t>{0, 1}));
  auto s = p->Scores(0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->positions, (std::vector<int64_t>{0, 1}));
  // Key 2 comes back: the stored rows q1, q2 no longer hold its attention (q2's .25 is gone), so its
  // cumulative attention is q3's .125 only. o = 3, hits 0, 1, 3 -> T_hr 1/3 < .5 -> cum / 3.
  Feed(p.get(), kSecond);
  ExpectNear(HeadScores(p.get(), 0, 0), {1.25 / 3, 1.0 / 3, 0.125 / 3, 0.125}, "after forgetting");
}

// ---- P-HitKV: PyramidKV's per-layer budgets ----------------------------------------------------------

TEST(HitKvPyramid, ScheduleHandComputed) {
  // extra = 100 - 20 = 80: layer 0 gets 2*80 - 80/2 = 120, layer 3 gets 80/2 = 40, linear between:
  // 120, 93.33, 66.67, 40 -> floors 120 93 66 40 (319), the missing 1 to layer 0; + 20 each.
  EXPECT_EQ(*PyramidLayerBudgets(4, 100, 2.0, 20), (std::vector<int64_t>{141, 113, 86, 60}));
  // PyramidKV's beta = 20, two layers, no floor: 100/20 = 5 on top, 200 - 5 = 195 below.
  EXPECT_EQ(*PyramidLayerBudgets(2, 100, 20.0, 0), (std::vector<int64_t>{195, 5}));
  // 17.5 13.75 10 6.25 2.5 -> 17 13 10 6 2 (48), remainder 2 to layers 0 and 1.
  EXPECT_EQ(*PyramidLayerBudgets(5, 10, 4.0, 0), (std::vector<int64_t>{18, 14, 10, 6, 2}));
  // extra 6: 10 6 2, + floor 1.
  EXPECT_EQ(*PyramidLayerBudgets(3, 7, 3.0, 1), (std::vector<int64_t>{11, 7, 3}));
  EXPECT_EQ(*PyramidLayerBudgets(3, 10, 1.0, 0), (std::vector<int64_t>{10, 10, 10}));  // beta 1: uniform
  EXPECT_EQ(*PyramidLayerBudgets(1, 50, 20.0, 10), (std::vector<int64_t>{50}));
  EXPECT_EQ(*PyramidLayerBudgets(4, 10, 20.0, 10), (std::vector<int64_t>{10, 10, 10, 10}));  // no extra
  EXPECT_EQ(*PyramidLayerBudgets(3, 0, 5.0, 0), (std::vector<int64_t>{0, 0, 0}));
}

TEST(HitKvPyramid, ScheduleRejectsBadArguments) {
  for (auto r : {PyramidLayerBudgets(0, 10, 2.0, 0), PyramidLayerBudgets(2, -1, 2.0, 0),
                 PyramidLayerBudgets(2, 10, 0.5, 0), PyramidLayerBudgets(2, 10, std::nan(""), 0),
                 PyramidLayerBudgets(2, 10, std::numeric_limits<double>::infinity(), 0),
                 PyramidLayerBudgets(2, 10, 2.0, -1), PyramidLayerBudgets(2, 10, 2.0, 11)}) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  }
}

TEST(HitKvPyramid, ScheduleInvariantsOnRandomArguments) {
  // Σ = layers * budget exactly, non-increasing from the lowest layer, every layer >= the floor,
  // layer 0 >= budget >= top layer.
  std::mt19937 rng(99);
  for (int t = 0; t < 2000; ++t) {
    const int L = 1 + static_cast<int>(rng() % 48);
    const int64_t B = static_cast<int64_t>(rng() % 5000);
    const int64_t F = B == 0 ? 0 : static_cast<int64_t>(rng() % (B + 1));
    const double beta = 1.0 + static_cast<double>(rng() % 3000) / 100.0;
    auto r = PyramidLayerBudgets(L, B, beta, F);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(static_cast<int>(r->size()), L);
    EXPECT_EQ(std::accumulate(r->begin(), r->end(), int64_t{0}), L * B) << L << " " << B << " " << beta;
    for (int l = 0; l < L; ++l) {
      EXPECT_GE((*r)[l], F);
      if (l > 0) {
        EXPECT_LE((*r)[l], (*r)[l - 1]) << L << " " << B << " " << beta << " " << F;
      }
    }
    EXPECT_GE(r->front(), B);
    EXPECT_LE(r->back(), B);
  }
}

Obs RampObs(int layer, int n) {
  // One query at position n - 1 per head over keys 0..n-1, attention rising with the position.
  Obs o{layer, Range(0, n), {n - 1}, {}};
  const double total = n * (n + 1) / 2.0;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < n; ++k) o.att.push_back(static_cast<float>((k + 1) / total));
  return o;
}

TEST(HitKvPyramid, EachLayerKeepsItsScheduledBudgetWithKEqualToIt) {
  // 4 layers, sinks 2 + local 2 = floor 4; budget 10: extra 6 -> 9 7 5 3 -> 13 11 9 7 keys.
  const PolicyGeometry g = Geo(4, 2, 1, 2, 2);
  auto p = Start("hitkv:pyramid=2", g);
  const std::vector<int64_t> want = {13, 11, 9, 7};
  for (int l = 0; l < 4; ++l) {
    Feed(p.get(), RampObs(l, 30));
    const auto kept = KeepHead(p.get(), l, 10);
    EXPECT_EQ(static_cast<int64_t>(kept.size()), want[l]) << "layer " << l;
    // Same keys as uniform HitKV (K = budget) given that layer's budget.
    auto u = Start("hitkv", g);
    Feed(u.get(), RampObs(l, 30));
    EXPECT_EQ(kept, KeepHead(u.get(), l, want[l])) << "layer " << l;
  }
  // A budget below sinks + local flattens the schedule (every layer's floor is the budget itself),
  // and the protected keys still do not fit.
  auto q = Start("hitkv:pyramid=2", g);
  Feed(q.get(), RampObs(0, 30));
  auto r = q->Keep(0, 3);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  Feed(q.get(), RampObs(3, 30));
  EXPECT_EQ(KeepHead(q.get(), 3, 4).size(), 4u);
}

// ---- properties on a long random stream -----------------------------------------------------------------

std::vector<float> RandomAttention(std::mt19937& rng, int q_heads, const std::vector<int64_t>& keys,
                                   const std::vector<int64_t>& queries) {
  std::normal_distribution<double> nd(0.0, 1.5);
  const size_t n = keys.size(), m = queries.size();
  std::vector<float> att(q_heads * m * n, 0.0f);
  for (int h = 0; h < q_heads; ++h)
    for (size_t i = 0; i < m; ++i) {
      float* row = att.data() + (h * m + i) * n;
      double sum = 0.0;
      for (size_t k = 0; k < n && keys[k] <= queries[i]; ++k)
        sum += row[k] = static_cast<float>(std::exp(nd(rng)));
      for (size_t k = 0; k < n; ++k) row[k] = static_cast<float>(row[k] / sum);
    }
  return att;
}

struct StreamLog {
  std::vector<std::vector<std::vector<int64_t>>> keeps;
  std::vector<size_t> state_bytes;
};

// Each round appends `add` tokens (the round's queries) to every layer, observes, keeps; the cache
// becomes the kept union. Checks exact per-layer budget, protected keys, forgetting.
StreamLog RunStream(ScoringPolicy* p, const PolicyGeometry& g, const std::vector<int64_t>& layer_budget,
                    int steps, int add, int64_t budget, uint32_t seed) {
  std::mt19937 rng(seed);
  StreamLog log;
  std::vector<std::vector<int64_t>> cache(g.layers);
  int64_t next = 0;
  for (int step = 0; step < steps; ++step) {
    std::vector<int64_t> queries;
    for (int a = 0; a < add; ++a) queries.push_back(next++);
    for (int l = 0; l < g.layers; ++l) {
      cache[l].insert(cache[l].end(), queries.begin(), queries.end());
      Obs o{l, cache[l], queries, RandomAttention(rng, g.q_heads, cache[l], queries)};
      const Status st = p->Observe(o.View());
      EXPECT_TRUE(st.ok()) << st.ToString();
      auto ks = p->Keep(l, budget);
      EXPECT_TRUE(ks.ok()) << p->ToString() << " step " << step << ": " << ks.status().ToString();
      if (!ks.ok()) return log;
      const int64_t n = static_cast<int64_t>(cache[l].size());
      const std::vector<int64_t> prot = ProtectedIndexes(g, cache[l]);
      for (const auto& head : ks->per_head) {
        EXPECT_EQ(static_cast<int64_t>(head.size()), std::min(layer_budget[l], n))
            << p->ToString() << " layer " << l;
        EXPECT_TRUE(std::is_sorted(head.begin(), head.end()));
        EXPECT_TRUE(std::adjacent_find(head.begin(), head.end()) == head.end());
        EXPECT_TRUE(std::includes(cache[l].begin(), cache[l].end(), head.begin(), head.end()));
        for (int64_t i : prot)
          EXPECT_TRUE(std::binary_search(head.begin(), head.end(), cache[l][i]))
              << p->ToString() << " dropped protected position " << cache[l][i];
      }
      cache[l] = ks->Union();
      auto sc = p->Scores(l);
      EXPECT_TRUE(sc.ok());
      if (sc.ok()) {
        EXPECT_EQ(sc->positions, cache[l]);
      }
      log.keeps.push_back(ks->per_head);
    }
    log.state_bytes.push_back(p->state_bytes());
  }
  return log;
}

class HitKvProperties : public ::testing::TestWithParam<const char*> {};

TEST_P(HitKvProperties, ExactBudgetProtectedKeptDeterministicAndBoundedOverALongStream) {
  const PolicyGeometry g = Geo(3, 4, 2, 2, 4);
  const int64_t budget = 12;
  std::vector<int64_t> layer_budget(g.layers, budget);
  const std::string spec = GetParam();
  if (spec.find("pyramid=4") != std::string::npos) {
    auto sched = PyramidLayerBudgets(g.layers, budget, 4.0, 6);  // floor = sinks + local
    ASSERT_TRUE(sched.ok());
    layer_budget = *sched;  // extra 6: 10.5 6 1.5 -> 10 6 1 (+1 to layer 0) -> 6 + (11 6 1)
    EXPECT_EQ(layer_budget, (std::vector<int64_t>{17, 12, 7}));
  }
  auto a = Start(spec, g);
  auto b = Start(spec, g);
  const StreamLog la = RunStream(a.get(), g, layer_budget, 300, 3, budget, 11);
  const StreamLog lb = RunStream(b.get(), g, layer_budget, 300, 3, budget, 11);
  ASSERT_EQ(la.keeps.size(), 900u);
  EXPECT_EQ(la.keeps, lb.keeps) << "identical input, different keep sets";
  size_t early = 0, late = 0;
  for (size_t s = 20; s < 100; ++s) early = std::max(early, la.state_bytes[s]);
  for (size_t s = 100; s < 300; ++s) late = std::max(late, la.state_bytes[s]);
  EXPECT_GT(early, 0u);
  EXPECT_LE(late, early * 3 / 2) << "state grows with the stream";
}

INSTANTIATE_TEST_SUITE_P(All, HitKvProperties,
                         ::testing::Values("hitkv", "hitkv:k=4,theta=0.25", "hitkv:theta=0", "hitkv:window=8",
                                           "hitkv:pyramid=4", "hitkv:pyramid=4,window=5"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

TEST(HitKv, BadInputsGiveClearErrors) {
  const PolicyGeometry g = Geo(2, 2, 1, 2, 4);
  auto p = Make("hitkv");
  const Obs o{0, Range(0, 10), {9}, std::vector<float>(20, 0.1f)};
  auto expect = [&](const Status& st, StatusCode code, const std::string& what) {
    EXPECT_EQ(st.code(), code) << what << ": " << st.ToString();
    EXPECT_NE(st.message().find("hitkv"), std::string::npos) << what << ": " << st.message();
  };
  expect(p->Observe(o.View()), StatusCode::kFailedPrecondition, "Observe before Begin");
  expect(p->Scores(0).status(), StatusCode::kFailedPrecondition, "Scores before Begin");
  expect(p->Keep(0, 8).status(), StatusCode::kFailedPrecondition, "Keep before Begin");
  PolicyGeometry bad = g;
  bad.layers = 0;
  expect(p->Begin(bad), StatusCode::kInvalidArgument, "bad geometry");
  ASSERT_TRUE(p->Begin(g).ok());
  expect(p->Scores(0).status(), StatusCode::kFailedPrecondition, "Scores before any Observe");
  expect(p->Keep(0, 8).status(), StatusCode::kFailedPrecondition, "Keep before any Observe");
  Obs wrong = o;
  wrong.layer = 5;
  expect(p->Observe(wrong.View()), StatusCode::kInvalidArgument, "layer out of range");
  Obs nan = o;
  nan.att[0] = std::nanf("");
  expect(p->Observe(nan.View()), StatusCode::kInvalidArgument, "NaN attention");
  ASSERT_TRUE(p->Observe(o.View()).ok());
  expect(p->Scores(2).status(), StatusCode::kInvalidArgument, "Scores of a layer out of range");
  expect(p->Keep(-1, 8).status(), StatusCode::kInvalidArgument, "Keep of a negative layer");
  expect(p->Keep(1, 8).status(), StatusCode::kFailedPrecondition, "Keep of a layer never observed");
  expect(p->Keep(0, -3).status(), StatusCode::kInvalidArgument, "negative budget");
  expect(p->Keep(0, 5).status(), StatusCode::kInvalidArgument, "budget 5 < 6 protected");
  EXPECT_FALSE(p->may_evict_protected());
  EXPECT_EQ(p->compress_every(), 0);
  ASSERT_TRUE(p->Begin(g).ok());
  expect(p->Scores(0).status(), StatusCode::kFailedPrecondition, "Scores after a new Begin");
}

// ---- factory strings ------------------------------------------------------------------------------------

TEST(HitKv, FactoryStringsRoundTripWithNonDefaultParameters) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"hitkv", "hitkv:k=0,theta=0.5,pyramid=0,window=0"},
      {"hitkv:window=16,k=8", "hitkv:k=8,theta=0.5,pyramid=0,window=16"},
      {"hitkv:theta=0.25,pyramid=20", "hitkv:k=0,theta=0.25,pyramid=20,window=0"},
      {"hitkv:pyramid=1.5,theta=1", "hitkv:k=0,theta=1,pyramid=1.5,window=0"},
      {"hitkv:k=64,theta=0,pyramid=0,window=32", "hitkv:k=64,theta=0,pyramid=0,window=32"},
  };
  for (const auto& [spec, want] : cases) {
    auto p = Make(spec);
    ASSERT_NE(p, nullptr) << spec;
    EXPECT_EQ(p->ToString(), want) << spec;
    auto again = Make(p->ToString());
    ASSERT_NE(again, nullptr);
    EXPECT_EQ(again->ToString(), want);
  }
}

TEST(HitKv, FactoryRejectsBadParameters) {
  for (const char* spec :
       {"hitkv:k=-1", "hitkv:k=x", "hitkv:k=2.5", "hitkv:theta=1.5", "hitkv:theta=-0.1", "hitkv:theta=inf",
        "hitkv:pyramid=0.5", "hitkv:pyramid=-2", "hitkv:window=-1", "hitkv:kk=1", "hitkv:beta=20"}) {
    auto r = MakeScoringPolicy(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(spec), std::string::npos)
        << "names the spec: " << r.status().message();
  }
}

}  // namespace
}  // namespace kvtier
