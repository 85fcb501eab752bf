// Tests of offload/policy/classic.cc: lru, streaming (StreamingLLM), h2o (Heavy-Hitter Oracle) and
// snapkv. Hand-computed examples pin each definition (the expected numbers are worked out in the
// comments; attention values are multiples of 1/8 where sums must be exact), then properties every
// classic policy must hold on a long random stream (exact budget, protected keys kept, determinism,
// state forgotten and bounded), bad inputs, and the factory strings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "offload/policy/scoring_policy.h"
#include "tests/policy_test_util.h"

namespace kvtier {
namespace {

using policy_test::Feed;
using policy_test::Geo;
using policy_test::Make;
using policy_test::Obs;
using policy_test::Range;
using policy_test::Start;

void ExpectScores(ScoringPolicy* p, int layer, const std::vector<int64_t>& positions,
                  const std::vector<std::vector<double>>& want) {
  auto s = p->Scores(layer);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->positions, positions);
  ASSERT_EQ(s->per_head.size(), want.size());
  for (size_t h = 0; h < want.size(); ++h) {
    ASSERT_EQ(s->per_head[h].size(), want[h].size()) << "head " << h;
    for (size_t i = 0; i < want[h].size(); ++i)
      EXPECT_NEAR(s->per_head[h][i], want[h][i], 1e-6) << "head " << h << " key " << positions[i];
  }
}

std::vector<std::vector<int64_t>> KeepOk(ScoringPolicy* p, int layer, int64_t budget) {
  auto k = p->Keep(layer, budget);
  EXPECT_TRUE(k.ok()) << k.status().ToString();
  return k.ok() ? k->per_head : std::vector<std::vector<int64_t>>{};
}

// ---- lru ---------------------------------------------------------------------------------------

TEST(Lru, ScoreIsTheLatestQueryPositionGivingAtLeastUniformAttention) {
  // 2 query heads, 1 kv head (both heads in its group), no protected keys.
  const PolicyGeometry g = Geo(1, 2, 1, 0, 0);
  auto p = Start("lru", g);
  // Query 3 sees keys 0..3 (uniform 1/4): head 1 gives every key 0.25 -> all used at 3.
  Feed(p.get(), {0, Range(0, 4), {3}, {0.125f, 0.625f, 0.125f, 0.125f, 0.25f, 0.25f, 0.25f, 0.25f}});
  ExpectScores(p.get(), 0, Range(0, 4), {{3, 3, 3, 3}});
  // Keys 0..5, queries at 4 (sees keys 0..4: uniform 1/5) and 5 (sees 0..5: uniform 1/6).
  //   key 0: head 0 query 4 gives 0.4 >= 0.2                                      -> 4
  //   key 1: at most 0.18 from query 4 (< 1/5; it would pass 1/6 = 1/n_keys) and
  //          0.15 from query 5 (< 1/6)                                            -> unused, stays 3
  //   key 2: head 0 query 5 gives 0.5 (only head 0 of the group uses it)          -> 5
  //   key 3: at most 0.15 (< 1/5 for query 4, < 1/6 for query 5)                  -> stays 3
  //   key 4: new, used by query 4 (0.3, 0.4), not by query 5 (0.1, 0.15 < 1/6)    -> 4
  //   key 5: new, invisible to query 4, used by query 5 head 1 (0.3)             -> 5
  Feed(p.get(), {0, Range(0, 6), {4, 5}, {0.4f,  0.1f,  0.1f,  0.1f,  0.3f,  0.0f,
                                          0.1f,  0.1f,  0.5f,  0.1f,  0.1f,  0.1f,  // head 0
                                          0.12f, 0.18f, 0.15f, 0.15f, 0.4f,  0.0f,
                                          0.1f,  0.15f, 0.15f, 0.15f, 0.15f, 0.3f}});  // head 1
  ExpectScores(p.get(), 0, Range(0, 6), {{4, 3, 5, 3, 4, 5}});
  // Key 6 new; query 6 sees all 7 keys (uniform 1/7 = 0.143): head 0 uses key 0 (0.5), head 1
  // key 5 (0.4); key 6 gets 0.05 / 0.1, never used -> its own position 6.
  Feed(p.get(), {0,
                 Range(0, 7),
                 {6},
                 {0.5f, 0.1f, 0.1f, 0.1f, 0.1f, 0.05f, 0.05f,   // head 0
                  0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.4f, 0.1f}});  // head 1
  ExpectScores(p.get(), 0, Range(0, 7), {{6, 3, 5, 3, 4, 6, 6}});
  // Keep 4: the three 6s (0, 5, 6), then key 2 (5).
  EXPECT_EQ(KeepOk(p.get(), 0, 4), (std::vector<std::vector<int64_t>>{{0, 2, 5, 6}}));
  ExpectScores(p.get(), 0, {0, 2, 5, 6}, {{6, 5, 6, 6}});
  // Keys 1 and 4 come back (they were forgotten): each scores its own position, not its old
  // score. Query 7 sees 6 keys (uniform 1/6): only key 0 (0.5) is used; key 7 is new.
  Feed(
      p.get(),
      {0, {0, 1, 4, 5, 6, 7}, {7}, {0.5f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.5f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f}});
  ExpectScores(p.get(), 0, {0, 1, 4, 5, 6, 7}, {{7, 1, 4, 6, 6, 7}});
}

TEST(Lru, KvHeadsScoreOnlyTheirOwnGroup) {
  // 2 query heads, 2 kv heads: head 0 -> kv 0, head 1 -> kv 1. Query 2 twice: first both heads use
  // key 2 only, then query head 0 uses key 0 only and query head 1 key 1 only.
  auto p = Start("lru", Geo(1, 2, 2, 0, 0));
  Feed(p.get(), {0, {0, 1, 2}, {2}, {0.25f, 0.25f, 0.5f, 0.25f, 0.25f, 0.5f}});
  ExpectScores(p.get(), 0, {0, 1, 2}, {{0, 1, 2}, {0, 1, 2}});
  Feed(p.get(), {0, {0, 1, 2}, {2}, {0.75f, 0.125f, 0.125f, 0.125f, 0.75f, 0.125f}});
  ExpectScores(p.get(), 0, {0, 1, 2}, {{2, 1, 2}, {0, 2, 2}});
  EXPECT_EQ(KeepOk(p.get(), 0, 2), (std::vector<std::vector<int64_t>>{{0, 2}, {1, 2}}));
}

// ---- streaming ------------------------------------------------------------------------------------

TEST(Streaming, KeepsSinksAndMostRecentShrinkingTheWindowToTheBudget) {
  // sinks 2, local window 3; keys 0..9.
  const PolicyGeometry g = Geo(1, 1, 1, 2, 3);
  const Obs o{0, Range(0, 10), {9}, std::vector<float>(10, 0.1f)};
  auto p = Start("streaming", g);
  EXPECT_TRUE(p->may_evict_protected());
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 20)[0], Range(0, 10));  // budget >= keys: all
  EXPECT_EQ(KeepOk(p.get(), 0, 10)[0], Range(0, 10));
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 7)[0], (std::vector<int64_t>{0, 1, 5, 6, 7, 8, 9}));
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 5)[0], (std::vector<int64_t>{0, 1, 7, 8, 9}));  // = sinks + local
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 4)[0], (std::vector<int64_t>{0, 1, 8, 9}));  // local window shrinks
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 2)[0], (std::vector<int64_t>{0, 1}));  // sinks only
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 1)[0], (std::vector<int64_t>{0}));  // the first sink
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 0)[0], (std::vector<int64_t>{}));
}

TEST(Streaming, SinksOverrideScoresMatchKeepAndAttentionIsIgnored) {
  const PolicyGeometry g = Geo(1, 1, 1, 2, 3);
  auto p = Start("streaming:sinks=3", g);
  EXPECT_EQ(p->ToString(), "streaming:sinks=3");
  // Sinks are positions < 3 (position 1 was dropped earlier); keys 0, 2, 4, 5, 6, 7.
  const std::vector<int64_t> keys = {0, 2, 4, 5, 6, 7};
  Feed(p.get(), {0, keys, {7}, {0.75f, 0.25f, 0.0f, 0.0f, 0.0f, 0.0f}});
  // 2 sinks: 2 + 2/2 = 3 and 2 + 1/2 = 2.5; then (i + 1) / 6 for i = 2..5.
  ExpectScores(p.get(), 0, keys, {{3.0, 2.5, 3.0 / 6, 4.0 / 6, 5.0 / 6, 1.0}});
  EXPECT_EQ(KeepOk(p.get(), 0, 4)[0], (std::vector<int64_t>{0, 2, 6, 7}));
  // Another attention over the same keys changes nothing.
  auto q = Start("streaming:sinks=3", g);
  Feed(q.get(), {0, keys, {7}, {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f}});
  ExpectScores(q.get(), 0, keys, {{3.0, 2.5, 3.0 / 6, 4.0 / 6, 5.0 / 6, 1.0}});
  // For every budget, Keep = the top-`budget` scores.
  for (int64_t b = 0; b <= 6; ++b) {
    auto r = Start("streaming:sinks=3", g);
    Feed(r.get(), {0, keys, {7}, {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f}});
    auto s = r->Scores(0);
    ASSERT_TRUE(s.ok());
    std::vector<int64_t> top = TopIndexes(s->per_head[0], Range(0, 6), b);
    std::vector<int64_t> want;
    for (int64_t i : top) want.push_back(keys[i]);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(KeepOk(r.get(), 0, b)[0], want) << "budget " << b;
  }
}

// ---- h2o -------------------------------------------------------------------------------------------

TEST(H2o, AccumulatesAttentionOverObservationsAndTheGroupsQueryHeads) {
  // 4 query heads, 2 kv heads (heads 0, 1 -> kv 0; heads 2, 3 -> kv 1); local window 1 key.
  const PolicyGeometry g = Geo(1, 4, 2, 0, 1);
  auto p = Start("h2o", g);
  // Observation 1: keys 0..2, query 2.
  //   kv 0 = head 0 [.5 .25 .25] + head 1 [.125 .625 .25] = [.625 .875 .5]
  //   kv 1 = head 2 [.25 .25 .5] + head 3 [.375 .5 .125]  = [.625 .75 .625]
  Feed(p.get(), {0,
                 {0, 1, 2},
                 {2},
                 {0.5f, 0.25f, 0.25f, 0.125f, 0.625f, 0.25f, 0.25f, 0.25f, 0.5f, 0.375f, 0.5f, 0.125f}});
  ExpectScores(p.get(), 0, {0, 1, 2}, {{0.625, 0.875, 0.5}, {0.625, 0.75, 0.625}});
  // Observation 2: keys 0..3, query 3 (key 3 new, starts at 0).
  //   kv 0 += [.125 .125 .25 .5] + [.5 .125 .125 .25] = [.625 .25 .375 .75] -> [1.25 1.125 .875 .75]
  //   kv 1 += [.125 .5 .125 .25] + [.25 .25 .25 .25] = [.375 .75 .375 .5]   -> [1 1.5 1 .5]
  Feed(p.get(), {0,
                 {0, 1, 2, 3},
                 {3},
                 {0.125f, 0.125f, 0.25f, 0.5f, 0.5f, 0.125f, 0.125f, 0.25f, 0.125f, 0.5f, 0.125f, 0.25f,
                  0.25f, 0.25f, 0.25f, 0.25f}});
  ExpectScores(p.get(), 0, {0, 1, 2, 3}, {{1.25, 1.125, 0.875, 0.75}, {1.0, 1.5, 1.0, 0.5}});
  // Keep 2: key 3 is the local window; kv 0 adds its heavy hitter 0, kv 1 its heavy hitter 1.
  // Key 2 is in neither -> forgotten.
  EXPECT_EQ(KeepOk(p.get(), 0, 2), (std::vector<std::vector<int64_t>>{{0, 3}, {1, 3}}));
  ExpectScores(p.get(), 0, {0, 1, 3}, {{1.25, 1.125, 0.75}, {1.0, 1.5, 0.5}});
  // Key 2 comes back: it starts again from 0 (+ this observation's 0.25 + 0.25 on kv 0).
  Feed(p.get(), {0,
                 {0, 1, 2, 3},
                 {3},
                 {0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f,
                  0.25f, 0.25f, 0.25f}});
  ExpectScores(p.get(), 0, {0, 1, 2, 3}, {{1.75, 1.625, 0.5, 1.25}, {1.5, 2.0, 0.5, 1.0}});
}

TEST(H2o, TiesGoToTheLaterKey) {
  const PolicyGeometry g = Geo(1, 4, 2, 0, 1);
  auto p = Start("h2o", g);
  Feed(p.get(), {0,
                 {0, 1, 2},
                 {2},
                 {0.5f, 0.25f, 0.25f, 0.125f, 0.625f, 0.25f, 0.25f, 0.25f, 0.5f, 0.375f, 0.5f, 0.125f}});
  Feed(p.get(), {0,
                 {0, 1, 2, 3},
                 {3},
                 {0.125f, 0.125f, 0.25f, 0.5f, 0.5f, 0.125f, 0.125f, 0.25f, 0.125f, 0.5f, 0.125f, 0.25f,
                  0.25f, 0.25f, 0.25f, 0.25f}});
  // Keep 3: kv 0 [1.25 1.125 .875 | .75] -> 0, 1 + 3; kv 1 [1 1.5 1 | .5] -> 1, then the tie
  // between keys 0 and 2 (both 1.0) goes to the later key 2.
  EXPECT_EQ(KeepOk(p.get(), 0, 3), (std::vector<std::vector<int64_t>>{{0, 1, 3}, {1, 2, 3}}));
}

TEST(H2o, RecentShareKeepsTheMostRecentKeysBeforeHeavyHitters) {
  // One head, local window 1. Keys 0..7, one query at 7 with attention
  // [.25 .125 .125 .125 .125 .125 .0625 .0625].
  const PolicyGeometry g = Geo(1, 1, 1, 0, 1);
  const Obs o{0, Range(0, 8), {7}, {0.25f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.0625f, 0.0625f}};
  // recent = 0, budget 4: key 7 (local), then heavy hitters 0 (.25), then the .125 tie among 1..5
  // goes to the later keys 5 and 4.
  auto p = Start("h2o", g);
  Feed(p.get(), o);
  EXPECT_EQ(KeepOk(p.get(), 0, 4)[0], (std::vector<int64_t>{0, 4, 5, 7}));
  // recent = 0.5, budget 4: floor(0.5 * 4) = 2 most recent (7, 6), then heavy hitters 0 and 5.
  auto q = Start("h2o:recent=0.5", g);
  Feed(q.get(), o);
  EXPECT_EQ(KeepOk(q.get(), 0, 4)[0], (std::vector<int64_t>{0, 5, 6, 7}));
  // recent = 0.6, budget 5: floor(3) -> 7, 6, 5; then 0 and 4.
  auto r = Start("h2o:recent=0.6", g);
  Feed(r.get(), o);
  EXPECT_EQ(KeepOk(r.get(), 0, 5)[0], (std::vector<int64_t>{0, 4, 5, 6, 7}));
  // recent = 1: the budget is all recent keys.
  auto s = Start("h2o:recent=1", g);
  Feed(s.get(), o);
  EXPECT_EQ(KeepOk(s.get(), 0, 3)[0], (std::vector<int64_t>{5, 6, 7}));
}

// ---- snapkv ------------------------------------------------------------------------------------------

TEST(SnapKv, VotesPoolsPerHeadThenAveragesTheGroup) {
  // 2 query heads, 1 kv head, kernel 3; keys 0..5, window queries at 4 and 5.
  const PolicyGeometry g = Geo(1, 2, 1, 0, 0);
  const Obs o{0, Range(0, 6), {4, 5}, {0.5f, 0.0f,  0.0f,  0.25f,  0.25f,  0.0f,
                                       0.0f, 0.0f,  0.25f, 0.0f,   0.25f,  0.5f,  // head 0
                                       0.0f, 0.75f, 0.0f,  0.0f,   0.25f,  0.0f,
                                       0.0f, 0.0f,  0.0f,  0.125f, 0.125f, 0.75f}};  // head 1
  // Vote (sum over the window): C0 = [.5 0 .25 .25 .5 .5], C1 = [0 .75 0 .125 .375 .75].
  // Max pool, kernel 3: P0 = [.5 .5 .25 .5 .5 .5], P1 = [.75 .75 .75 .375 .75 .75].
  // Group mean: [.625 .625 .5 .4375 .625 .625].
  // (Mean first, then pool would give [.375 .375 .375 .4375 .625 .625]; no pooling [.25 .375 .125
  // .1875 .4375 .625]; a group sum twice the values.)
  auto p = Start("snapkv:kernel=3", g);
  Feed(p.get(), o);
  ExpectScores(p.get(), 0, Range(0, 6), {{0.625, 0.625, 0.5, 0.4375, 0.625, 0.625}});
  // Keep 3: the four .625 tie -> the latest three, 1, 4, 5.
  EXPECT_EQ(KeepOk(p.get(), 0, 3)[0], (std::vector<int64_t>{1, 4, 5}));

  auto k1 = Start("snapkv:kernel=1", g);
  Feed(k1.get(), o);
  ExpectScores(k1.get(), 0, Range(0, 6), {{0.25, 0.375, 0.125, 0.1875, 0.4375, 0.625}});
  // Kernel 7 (half-width 3): every key's neighbourhood reaches both heads' maxima, so (.5 + .75) / 2.
  auto k7 = Start("snapkv", g);
  EXPECT_EQ(k7->ToString(), "snapkv:kernel=7");
  Feed(k7.get(), o);
  ExpectScores(k7.get(), 0, Range(0, 6), {{0.625, 0.625, 0.625, 0.625, 0.625, 0.625}});
}

TEST(SnapKv, OnlyTheLatestObservationCounts) {
  const PolicyGeometry g = Geo(1, 2, 1, 0, 0);
  auto p = Start("snapkv:kernel=3", g);
  Feed(p.get(),
       {0, Range(0, 6), {5}, {0.0f, 0.0f, 0.5f, 0.5f, 0.0f, 0.0f, 0.25f, 0.25f, 0.25f, 0.25f, 0.0f, 0.0f}});
  // Second observation: head 0 all on key 5, head 1 all on key 0.
  // P0 = [0 0 0 0 1 1], P1 = [1 1 0 0 0 0] -> mean [.5 .5 0 0 .5 .5], nothing of the first.
  Feed(p.get(),
       {0, Range(0, 6), {5}, {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}});
  ExpectScores(p.get(), 0, Range(0, 6), {{0.5, 0.5, 0.0, 0.0, 0.5, 0.5}});
}

// ---- properties on a long random stream, for every classic policy ------------------------------------

// Random causal softmax rows: query q attends to the keys at or before it.
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
  std::vector<std::vector<std::vector<int64_t>>> keeps;  // per (step, layer): per head
  std::vector<size_t> state_bytes;                       // per step
};

// `steps` rounds: each appends `add` tokens to every layer's cache (they are the round's queries),
// observes every layer, keeps `budget` and checks the keep set; the cache becomes the kept union.
StreamLog RunStream(ScoringPolicy* p, const PolicyGeometry& g, int steps, int add, int64_t budget,
                    uint32_t seed) {
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
      EXPECT_EQ(static_cast<int>(ks->per_head.size()), g.kv_heads);
      const std::vector<int64_t> prot = ProtectedIndexes(g, cache[l]);
      for (const auto& head : ks->per_head) {
        EXPECT_EQ(static_cast<int64_t>(head.size()), std::min(budget, n))
            << p->ToString() << " step " << step;
        EXPECT_TRUE(std::is_sorted(head.begin(), head.end()));
        EXPECT_TRUE(std::adjacent_find(head.begin(), head.end()) == head.end());
        EXPECT_TRUE(std::includes(cache[l].begin(), cache[l].end(), head.begin(), head.end()));
        // Every protected key is kept; streaming (whose sinks may differ from the geometry's) keeps
        // at least the local window when the budget holds sinks + local window.
        if (!p->may_evict_protected()) {
          for (int64_t i : prot)
            EXPECT_TRUE(std::binary_search(head.begin(), head.end(), cache[l][i]))
                << p->ToString() << " dropped protected position " << cache[l][i] << " at step " << step;
        } else if (budget >= g.sink_tokens + g.local_tokens) {
          for (int64_t i = std::max<int64_t>(0, n - g.local_tokens); i < n; ++i)
            EXPECT_TRUE(std::binary_search(head.begin(), head.end(), cache[l][i]))
                << p->ToString() << " dropped local position " << cache[l][i] << " at step " << step;
        }
      }
      cache[l] = ks->Union();
      // State of the dropped positions is gone: Scores covers exactly the kept union.
      auto sc = p->Scores(l);
      EXPECT_TRUE(sc.ok());
      if (sc.ok()) {
        EXPECT_EQ(sc->positions, cache[l]) << p->ToString();
      }
      log.keeps.push_back(ks->per_head);
    }
    log.state_bytes.push_back(p->state_bytes());
  }
  return log;
}

class ClassicPolicyProperties : public ::testing::TestWithParam<const char*> {};

TEST_P(ClassicPolicyProperties, ExactBudgetProtectedKeptDeterministicAndBoundedOverALongStream) {
  const PolicyGeometry g = Geo(2, 4, 2, 2, 4);
  auto a = Start(GetParam(), g);
  auto b = Start(GetParam(), g);
  const StreamLog la = RunStream(a.get(), g, 300, 3, 12, 7);
  const StreamLog lb = RunStream(b.get(), g, 300, 3, 12, 7);
  ASSERT_EQ(la.keeps.size(), 600u);
  EXPECT_EQ(la.keeps, lb.keeps) << "identical input, different keep sets";
  // Bounded: the cache never exceeds kv_heads * budget + add keys, so neither may the state.
  size_t early = 0, late = 0;
  for (size_t s = 20; s < 100; ++s) early = std::max(early, la.state_bytes[s]);
  for (size_t s = 100; s < 300; ++s) late = std::max(late, la.state_bytes[s]);
  EXPECT_GT(early, 0u);
  EXPECT_LE(late, early * 3 / 2) << "state grows with the stream";
}

TEST_P(ClassicPolicyProperties, SmallBudgetsAndBadInputsGiveClearErrors) {
  const PolicyGeometry g = Geo(2, 2, 1, 2, 4);
  const std::string spec = GetParam();
  auto p = Make(spec);
  const std::string name = p->name();
  const Obs o{0, Range(0, 10), {9}, std::vector<float>(20, 0.1f)};
  auto expect = [&](const Status& st, StatusCode code, const std::string& what) {
    EXPECT_EQ(st.code(), code) << what << ": " << st.ToString();
    EXPECT_NE(st.message().find(name), std::string::npos) << what << " names the policy: " << st.message();
  };
  expect(p->Observe(o.View()), StatusCode::kFailedPrecondition, "Observe before Begin");
  expect(p->Scores(0).status(), StatusCode::kFailedPrecondition, "Scores before Begin");
  expect(p->Keep(0, 8).status(), StatusCode::kFailedPrecondition, "Keep before Begin");
  PolicyGeometry bad = g;
  bad.kv_heads = 3;
  expect(p->Begin(bad), StatusCode::kInvalidArgument, "bad geometry");
  ASSERT_TRUE(p->Begin(g).ok());
  expect(p->Scores(0).status(), StatusCode::kFailedPrecondition, "Scores before any Observe");
  expect(p->Keep(1, 8).status(), StatusCode::kFailedPrecondition, "Keep before any Observe");
  Obs wrong = o;
  wrong.layer = 2;
  expect(p->Observe(wrong.View()), StatusCode::kInvalidArgument, "layer out of range");
  Obs unnormalised = o;
  unnormalised.att[3] = 0.5f;
  expect(p->Observe(unnormalised.View()), StatusCode::kInvalidArgument, "row not summing to 1");
  ASSERT_TRUE(p->Observe(o.View()).ok());
  expect(p->Scores(2).status(), StatusCode::kInvalidArgument, "Scores of a layer out of range");
  expect(p->Scores(-1).status(), StatusCode::kInvalidArgument, "Scores of a negative layer");
  expect(p->Keep(2, 8).status(), StatusCode::kInvalidArgument, "Keep of a layer out of range");
  expect(p->Scores(1).status(), StatusCode::kFailedPrecondition, "Scores of a layer never observed");
  expect(p->Keep(0, -1).status(), StatusCode::kInvalidArgument, "negative budget");
  // 6 protected keys (2 sinks + 4 local) out of 10: budget 5 is too small, except for streaming.
  auto small = p->Keep(0, 5);
  if (p->may_evict_protected()) {
    ASSERT_TRUE(small.ok()) << small.status().ToString();
    EXPECT_EQ(small->per_head[0].size(), 5u);
  } else {
    expect(small.status(), StatusCode::kInvalidArgument, "budget < protected");
    EXPECT_NE(small.status().message().find("protected"), std::string::npos) << small.status().message();
  }
  // Begin again drops all state.
  ASSERT_TRUE(p->Begin(g).ok());
  expect(p->Scores(0).status(), StatusCode::kFailedPrecondition, "Scores after a new Begin");
}

INSTANTIATE_TEST_SUITE_P(All, ClassicPolicyProperties,
                         ::testing::Values("lru", "streaming", "streaming:sinks=1", "h2o", "h2o:recent=0.5",
                                           "snapkv", "snapkv:kernel=1"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

TEST(ClassicPolicies, OnlyStreamingMayEvictProtectedKeys) {
  for (const char* spec : {"lru", "h2o", "snapkv"}) EXPECT_FALSE(Make(spec)->may_evict_protected()) << spec;
  EXPECT_TRUE(Make("streaming")->may_evict_protected());
  for (const char* spec : {"lru", "streaming", "h2o", "snapkv"})
    EXPECT_EQ(Make(spec)->compress_every(), 0) << spec;
}

// ---- factory strings -------------------------------------------------------------------------------------

TEST(ClassicPolicies, FactoryStringsRoundTripWithNonDefaultParameters) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"lru", "lru"},
      {"streaming", "streaming:sinks=auto"},
      {"streaming:sinks=auto", "streaming:sinks=auto"},
      {"streaming:sinks=0", "streaming:sinks=0"},
      {"streaming:sinks=16", "streaming:sinks=16"},
      {"h2o", "h2o:recent=0"},
      {"h2o:recent=0.25", "h2o:recent=0.25"},
      {"h2o:recent=1", "h2o:recent=1"},
      {"snapkv", "snapkv:kernel=7"},
      {"snapkv:kernel=5", "snapkv:kernel=5"},
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

TEST(ClassicPolicies, FactoryRejectsBadParameters) {
  for (const char* spec :
       {"lru:x=1", "streaming:sink=2", "streaming:sinks=-1", "streaming:sinks=two", "h2o:recent=-0.1",
        "h2o:recent=1.5", "h2o:recent=nan", "h2o:window=4", "snapkv:kernel=0", "snapkv:kernel=4",
        "snapkv:kernel=-3", "snapkv:kernel=3.5", "snapkv:window=8"}) {
    auto r = MakeScoringPolicy(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(spec), std::string::npos)
        << "names the spec: " << r.status().message();
  }
}

}  // namespace
}  // namespace kvtier
