// Tests of the `gkv` scoring policy (offload/policy/gkv.cc): the local score of Eq. 2, the max
// normalisation, the three global-score forms of Eq. 3-5 over consecutive compressions, the R-KV
// redundancy R' and F' = λF − (1−λ)R' of Appendix D, the keep-set properties, bounded state over a
// long stream, bad inputs and the factory string. Every expected number is worked out by hand in
// the comment next to it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "offload/policy/scoring_policy.h"

namespace kvtier {
namespace {

// One observation's buffers. rows[h][t] is query t's attention row for query head h.
struct Obs {
  std::vector<int64_t> key_pos, query_pos;
  std::vector<float> attention, keys;
  int n_queries = 0;

  AttentionObservation View(int layer) const {
    AttentionObservation o;
    o.layer = layer;
    o.n_queries = n_queries;
    o.n_keys = static_cast<int64_t>(key_pos.size());
    o.key_positions = key_pos.data();
    o.query_positions = query_pos.data();
    o.attention = attention.data();
    o.keys = keys.empty() ? nullptr : keys.data();
    return o;
  }
};

Obs MakeObs(const std::vector<int64_t>& key_pos, const std::vector<std::vector<std::vector<float>>>& rows,
            const std::vector<std::vector<float>>& keys = {}) {
  Obs o;
  o.key_pos = key_pos;
  o.n_queries = static_cast<int>(rows[0].size());
  for (int t = 0; t < o.n_queries; ++t) o.query_pos.push_back(key_pos.back() + 1 + t);
  for (const auto& head : rows)
    for (const auto& row : head) o.attention.insert(o.attention.end(), row.begin(), row.end());
  for (const auto& k : keys) o.keys.insert(o.keys.end(), k.begin(), k.end());  // one kv head: [n][d]
  return o;
}

PolicyGeometry Geo(int layers, int q_heads, int kv_heads, int head_dim, int64_t sinks, int64_t local) {
  PolicyGeometry g;
  g.layers = layers;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.sink_tokens = sinks;
  g.local_tokens = local;
  return g;
}

std::unique_ptr<ScoringPolicy> Make(const std::string& spec, const PolicyGeometry& g) {
  auto r = MakeScoringPolicy(spec);
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  if (!r.ok()) return nullptr;
  auto p = std::move(r).value();
  const Status st = p->Begin(g);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return p;
}

void ExpectScores(const ScoringPolicy& p, int layer, int head, const std::vector<int64_t>& positions,
                  const std::vector<double>& want, const char* what) {
  auto s = p.Scores(layer);
  ASSERT_TRUE(s.ok()) << what << ": " << s.status().ToString();
  EXPECT_EQ(s->positions, positions) << what;
  ASSERT_EQ(s->per_head[head].size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(s->per_head[head][i], want[i], 1e-5) << what << " [" << i << "]";
}

std::vector<int64_t> KeepHead(ScoringPolicy& p, int layer, int64_t budget, int head = 0) {
  auto k = p.Keep(layer, budget);
  EXPECT_TRUE(k.ok()) << k.status().ToString();
  return k.ok() ? k->per_head[head] : std::vector<int64_t>{};
}

// ---- Eq. 1-2 and the max normalisation ---------------------------------------------------

// Two query heads share one kv head; w = 2 of 3 queries; 5 keys, the last w = 2 (positions 3, 4)
// are the window, keys 0..2 the candidates.
//   query 0 is outside the window (its rows, all mass on key 0, must not count).
//   query 1: h0 [.1 .2 .1 .5 .1], h1 [.3 .1 .1 .4 .1] -> A' = max = [.3 .2 .1 .5 .1]
//   query 2: h0 [.2 .1 .1 .5 .1], h1 [.1 .5 .1 .2 .1] -> A' = max = [.2 .5 .1 .5 .1]
//   Eq. 2: S = mean over the window = [.25 .35 .1 .5 .1]
//   normalised by the candidates' max .35 (not the window key's .5):
//   Ŝ = [5/7, 1, 2/7, 10/7, 2/7]. At the first compression F = Ŝ; lambda=1 -> F' = F.
//   (A mean over the group would give S_0/S_1 = .175/.225 = 7/9 instead of 5/7.)
TEST(Gkv, LocalScoreMaxOverGroupMeanOverWindowNormalised) {
  const auto g = Geo(1, 2, 1, 2, 0, 0);
  auto p = Make("gkv:w=2,lambda=1", g);
  const Obs o = MakeObs({0, 1, 2, 3, 4}, {{{1, 0, 0, 0, 0}, {.1, .2, .1, .5, .1}, {.2, .1, .1, .5, .1}},
                                          {{1, 0, 0, 0, 0}, {.3, .1, .1, .4, .1}, {.1, .5, .1, .2, .1}}});
  ASSERT_TRUE(p->Observe(o.View(0)).ok());
  ExpectScores(*p, 0, 0, {0, 1, 2, 3, 4}, {5.0 / 7, 1.0, 2.0 / 7, 10.0 / 7, 2.0 / 7}, "first compression");
}

// ---- Eq. 3, 4, 5 over three compressions ---------------------------------------------------

// One head, w = 1, no sinks / local window, alpha = 0.8, budget 3 (window key + 2).
// Step 1: keys 0..3, row [.4 .1 .2 .3]; candidates 0..2, max .4 -> F = Ŝ = [1 .25 .5 .75].
//   Keep 3: window key 3 + keys 0 (1) and 2 (.5). Recorded: F(0) = 1, F(2) = .5; key 3 was the
//   window: not recorded.
// Step 2: keys 0 2 3 4 5, row [.1 .4 .1 .2 .2]; candidates 0 2 3 4, max .4 -> Ŝ = [.25 1 .25 .5 .5].
//   Eq. 3 max : 0: max(.8*1, .25) = .8      2: max(.8*.5, 1) = 1
//   Eq. 4 mean: 0: .8*1 + .2*.25 = .85      2: .8*.5 + .2*1 = .6
//   Eq. 5 sum : 0: .8*1 + .25 = 1.05        2: .8*.5 + 1 = 1.4
//   keys 3, 4, 5 have no record: F = Ŝ = .25, .5, .5 (a recorded key 3 would give .8*.75 ...).
struct FormCase {
  const char* form;
  std::vector<double> step2;
};

TEST(Gkv, GlobalScoreFormsEq3Eq4Eq5) {
  const auto g = Geo(1, 1, 1, 2, 0, 0);
  for (const FormCase& c : {FormCase{"max", {.8, 1, .25, .5, .5}}, FormCase{"mean", {.85, .6, .25, .5, .5}},
                            FormCase{"sum", {1.05, 1.4, .25, .5, .5}}}) {
    SCOPED_TRACE(c.form);
    auto p = Make(std::string("gkv:w=1,lambda=1,alpha=0.8,form=") + c.form, g);
    const Obs o1 = MakeObs({0, 1, 2, 3}, {{{.4, .1, .2, .3}}});
    ASSERT_TRUE(p->Observe(o1.View(0)).ok());
    ExpectScores(*p, 0, 0, {0, 1, 2, 3}, {1, .25, .5, .75}, "step 1");
    EXPECT_EQ(KeepHead(*p, 0, 3), (std::vector<int64_t>{0, 2, 3}));
    const Obs o2 = MakeObs({0, 2, 3, 4, 5}, {{{.1, .4, .1, .2, .2}}});
    ASSERT_TRUE(p->Observe(o2.View(0)).ok());
    ExpectScores(*p, 0, 0, {0, 2, 3, 4, 5}, c.step2, "step 2");
  }
}

// Continues the max form: step 2 keeps window key 5 + keys 2 (1) and 0 (.8); records F(2) = 1,
// F(0) = .8. Step 3: keys 0 2 5 6, row [.5 .1 .2 .2], candidates 0 2 5, max .5 ->
//   Ŝ = [1 .2 .4 .4]: 0: max(.8*.8, 1) = 1; 2: max(.8*1, .2) = .8; 5 (window at step 2): .4; 6: .4.
// Observing step 3 twice before the next Keep gives the same scores (the history advances in Keep).
TEST(Gkv, HistoryAdvancesAtEachKeepOnly) {
  const auto g = Geo(1, 1, 1, 2, 0, 0);
  auto p = Make("gkv:w=1,lambda=1,alpha=0.8,form=max", g);
  const Obs o1 = MakeObs({0, 1, 2, 3}, {{{.4, .1, .2, .3}}});
  ASSERT_TRUE(p->Observe(o1.View(0)).ok());
  ASSERT_EQ(KeepHead(*p, 0, 3), (std::vector<int64_t>{0, 2, 3}));
  const Obs o2 = MakeObs({0, 2, 3, 4, 5}, {{{.1, .4, .1, .2, .2}}});
  ASSERT_TRUE(p->Observe(o2.View(0)).ok());
  EXPECT_EQ(KeepHead(*p, 0, 3), (std::vector<int64_t>{0, 2, 5}));
  const Obs o3 = MakeObs({0, 2, 5, 6}, {{{.5, .1, .2, .2}}});
  ASSERT_TRUE(p->Observe(o3.View(0)).ok());
  ExpectScores(*p, 0, 0, {0, 2, 5, 6}, {1, .8, .4, .4}, "step 3");
  ASSERT_TRUE(p->Observe(o3.View(0)).ok());
  ExpectScores(*p, 0, 0, {0, 2, 5, 6}, {1, .8, .4, .4}, "step 3 observed again");
}

// A recorded key that the caller dropped is forgotten: when the same position comes back it is new.
// Step 1 as above records F(0) = 1. Step 2 lacks key 0; step 3 has it again with row [.1 .1 .4 .4]
// over keys 0 2 3 6: candidates 0 2 3, max .4 -> Ŝ(0) = .25, no record -> F(0) = .25 (not .8).
TEST(Gkv, DroppedKeysAreForgotten) {
  const auto g = Geo(1, 1, 1, 2, 0, 0);
  auto p = Make("gkv:w=1,lambda=1", g);
  const Obs o1 = MakeObs({0, 1, 2, 3}, {{{.4, .1, .2, .3}}});
  ASSERT_TRUE(p->Observe(o1.View(0)).ok());
  ASSERT_EQ(KeepHead(*p, 0, 3), (std::vector<int64_t>{0, 2, 3}));
  const Obs o2 = MakeObs({2, 3, 6}, {{{.5, .25, .25}}});
  ASSERT_TRUE(p->Observe(o2.View(0)).ok());
  const Obs o3 = MakeObs({0, 2, 3, 6}, {{{.1, .1, .4, .4}}});
  ASSERT_TRUE(p->Observe(o3.View(0)).ok());
  auto s = p->Scores(0);
  ASSERT_TRUE(s.ok());
  EXPECT_NEAR(s->per_head[0][0], .25, 1e-6);
}

// ---- R-KV redundancy (Appendix D) -----------------------------------------------------------

// Keys (head_dim 3, one kv head, w = 1: key 4 is the window, keys 0..3 the candidates):
//   k0 (1,0,0), k1 (2,0,0), k2 (0,1,0), k3 (3,4,0), k4 (0,3,4).
// Cosines: c01 = 1 (k1 has norm 2: the normalisation matters), c03 = c13 = .6, c23 = .8, c24 = .6,
//   c34 = 12/25 = .48 (below tau = .5: zeroed), all others 0.
// C' per row k (diagonal 0; below tau 0; the most recent j with c >= tau zeroed):
//   row 0: similar 1, 3 -> zero 3 -> [0 1 0 0 0]      row 1: similar 0, 3 -> zero 3 -> [1 0 0 0 0]
//   row 2: similar 3, 4 -> zero 4 -> [0 0 0 .8 0]     row 3: similar 0, 1, 2 (.48 to 4 dropped) ->
//   zero 2 -> [.6 .6 0 0 0]                            row 4: similar 2 (.48 dropped) -> zero 2 -> 0
// Column sums [1.6 1.6 0 .8 0]; the average (1/5): C̄' = [.32 .32 0 .16 0].
// R = softmax(C̄'); R' = R / max over the candidates = exp(C̄' − .32):
//   R' = [1, 1, e^-.32, e^-.16, e^-.32].
// (The printed sum instead of the average would give e^-1.6 = .20 for key 2; without the
//  threshold, key 3's column would gain .48; without the most-recent mask key 3's column would be
//  .6+.6+.8 = 2.0.)
const std::vector<std::vector<float>> kRkvKeys = {{1, 0, 0}, {2, 0, 0}, {0, 1, 0}, {3, 4, 0}, {0, 3, 4}};

TEST(Gkv, RkvRedundancyNormalised) {
  const auto g = Geo(1, 1, 1, 3, 0, 0);
  auto p = Make("gkv:w=1,lambda=0,tau=0.5", g);  // lambda = 0: F' = -R'
  const Obs o = MakeObs({0, 1, 2, 3, 4}, {{{.1, .2, .3, .2, .2}}}, kRkvKeys);
  ASSERT_TRUE(p->Observe(o.View(0)).ok());
  const double e32 = std::exp(-0.32), e16 = std::exp(-0.16);
  ExpectScores(*p, 0, 0, {0, 1, 2, 3, 4}, {-1, -1, -e32, -e16, -e32}, "-R'");
}

// F' = λF − (1−λ)R' with λ = .5: row [.1 .2 .3 .2 .2], candidates 0..3, max .3 ->
//   F = Ŝ = [1/3 2/3 1 2/3 2/3]; F' = .5 F − .5 R' (R' as above).
TEST(Gkv, CombinedScoreLambda) {
  const auto g = Geo(1, 1, 1, 3, 0, 0);
  auto p = Make("gkv:w=1,lambda=0.5,tau=0.5", g);
  const Obs o = MakeObs({0, 1, 2, 3, 4}, {{{.1, .2, .3, .2, .2}}}, kRkvKeys);
  ASSERT_TRUE(p->Observe(o.View(0)).ok());
  const double e32 = std::exp(-0.32), e16 = std::exp(-0.16);
  ExpectScores(*p, 0, 0, {0, 1, 2, 3, 4},
               {.5 / 3 - .5, 1.0 / 3 - .5, .5 - .5 * e32, 1.0 / 3 - .5 * e16, 1.0 / 3 - .5 * e32}, "F'");
}

// The history records F, not F'. Orthogonal / opposite keys have no similarity >= tau, so R' = 1
// everywhere and F' = .5 F − .5.
// Step 1: keys 0 1 2 = (1,0) (0,1) (-1,0), row [.5 .25 .25], candidates 0 1 -> F = [1 .5 .5],
//   F' = [0 -.25 -.25]. Keep 2: window key 2 + key 0; records F(0) = 1 (F'(0) would be 0).
// Step 2 (sum form): keys 0 2 3 = (1,0) (-1,0) (0,1), row [.5 .25 .25], candidates 0 2 ->
//   Ŝ = [1 .5 .5]; F(0) = .8*1 + 1 = 1.8 -> F' = .4 (recording F' would give 0);
//   key 2 (window at step 1) and key 3 are new: F = .5 -> F' = -.25.
TEST(Gkv, HistoryRecordsGlobalScoreNotCombined) {
  const auto g = Geo(1, 1, 1, 2, 0, 0);
  auto p = Make("gkv:form=sum,alpha=0.8,w=1,lambda=0.5", g);
  const Obs o1 = MakeObs({0, 1, 2}, {{{.5, .25, .25}}}, {{1, 0}, {0, 1}, {-1, 0}});
  ASSERT_TRUE(p->Observe(o1.View(0)).ok());
  ExpectScores(*p, 0, 0, {0, 1, 2}, {0, -.25, -.25}, "step 1");
  ASSERT_EQ(KeepHead(*p, 0, 2), (std::vector<int64_t>{0, 2}));
  const Obs o2 = MakeObs({0, 2, 3}, {{{.5, .25, .25}}}, {{1, 0}, {-1, 0}, {0, 1}});
  ASSERT_TRUE(p->Observe(o2.View(0)).ok());
  ExpectScores(*p, 0, 0, {0, 2, 3}, {.4, -.25, -.25}, "step 2");
}

// ---- properties --------------------------------------------------------------------------

// Random softmax rows over n keys for every (q head, query).
Obs RandomObs(std::mt19937& rng, const std::vector<int64_t>& pos, int q_heads, int n_queries, int kv_heads,
              int head_dim) {
  Obs o;
  o.key_pos = pos;
  o.n_queries = n_queries;
  for (int t = 0; t < n_queries; ++t) o.query_pos.push_back(pos.back() + 1 + t);
  std::exponential_distribution<float> ex(1.0f);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t n = pos.size();
  for (int h = 0; h < q_heads; ++h)
    for (int t = 0; t < n_queries; ++t) {
      std::vector<float> row(n);
      float sum = 0.0f;
      for (auto& v : row) sum += (v = ex(rng) * ex(rng));
      for (auto& v : row) v /= sum;
      o.attention.insert(o.attention.end(), row.begin(), row.end());
    }
  o.keys.resize(n * kv_heads * head_dim);
  for (auto& v : o.keys) v = nd(rng);
  return o;
}

std::vector<int64_t> Iota(int64_t from, int64_t to) {
  std::vector<int64_t> v;
  for (int64_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

TEST(Gkv, KeepsExactlyBudgetWithSinksLocalAndWindow) {
  const auto g = Geo(2, 4, 2, 8, 2, 3);
  std::mt19937 rng(7);
  for (int64_t budget : {10, 11, 20, 40, 60}) {
    auto p = Make("gkv:w=5", g);  // window 5 > local 3: the last 5 keys are protected
    const auto pos = Iota(0, 40);
    const Obs o = RandomObs(rng, pos, 4, 5, 2, 8);
    ASSERT_TRUE(p->Observe(o.View(1)).ok());
    auto k = p->Keep(1, budget);
    ASSERT_TRUE(k.ok()) << k.status().ToString();
    ASSERT_EQ(k->per_head.size(), 2u);
    EXPECT_TRUE(k->structural.empty());
    for (const auto& head : k->per_head) {
      EXPECT_EQ(static_cast<int64_t>(head.size()), std::min<int64_t>(budget, 40)) << budget;
      EXPECT_TRUE(std::is_sorted(head.begin(), head.end()));
      for (int64_t must : {0, 1, 35, 36, 37, 38, 39})
        EXPECT_TRUE(std::binary_search(head.begin(), head.end(), must)) << must << " budget " << budget;
    }
  }
}

TEST(Gkv, Deterministic) {
  const auto g = Geo(1, 4, 2, 8, 1, 2);
  std::vector<std::vector<std::vector<int64_t>>> runs;
  for (int run = 0; run < 2; ++run) {
    std::mt19937 rng(11);
    auto p = Make("gkv:w=4,form=mean", g);
    std::vector<std::vector<int64_t>> keeps;
    std::vector<int64_t> cache = Iota(0, 30);
    for (int step = 0; step < 5; ++step) {
      const Obs o = RandomObs(rng, cache, 4, 4, 2, 8);
      ASSERT_TRUE(p->Observe(o.View(0)).ok());
      auto k = p->Keep(0, 16);
      ASSERT_TRUE(k.ok());
      for (const auto& h : k->per_head) keeps.push_back(h);
      cache = k->Union();
      for (int i = 0; i < 6; ++i) cache.push_back(30 + step * 6 + i);
    }
    runs.push_back(keeps);
  }
  EXPECT_EQ(runs[0], runs[1]);
}

// 300 compressions of a 2-layer stream, 8 new keys each, keys supplied (R-KV on): the state stays
// bounded by what is cached (at most 2 heads x budget 24 + 8 new keys per layer).
TEST(Gkv, LongStreamStateBounded) {
  const auto g = Geo(2, 4, 2, 8, 2, 4);
  auto p = Make("gkv:w=4,s=8", g);
  ASSERT_EQ(p->compress_every(), 8);
  std::mt19937 rng(3);
  std::vector<std::vector<int64_t>> cache(2, Iota(0, 8));
  int64_t next = 8;
  size_t max_bytes = 0;
  for (int step = 0; step < 300; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      const Obs o = RandomObs(rng, cache[layer], 4, 4, 2, 8);
      ASSERT_TRUE(p->Observe(o.View(layer)).ok());
      auto k = p->Keep(layer, 24);
      ASSERT_TRUE(k.ok()) << k.status().ToString();
      for (const auto& h : k->per_head) ASSERT_EQ(h.size(), std::min<size_t>(24, cache[layer].size()));
      cache[layer] = k->Union();
      ASSERT_LE(cache[layer].size(), 48u);
    }
    for (int i = 0; i < 8; ++i, ++next)
      for (auto& c : cache) c.push_back(next);
    max_bytes = std::max(max_bytes, p->state_bytes());
  }
  // Per layer: <= 56 keys x (8-byte position + 3 scores x 2 heads x 4 bytes) = 56 x 32 bytes.
  EXPECT_GT(max_bytes, 0u);
  EXPECT_LE(max_bytes, 2u * 56u * 32u * 2u);  // x2 for vector capacity slack
}

// ---- bad inputs ------------------------------------------------------------------------------

TEST(Gkv, BadInputsGiveClearErrors) {
  const auto g = Geo(2, 2, 1, 2, 1, 2);
  auto made = MakeScoringPolicy("gkv:w=2");
  ASSERT_TRUE(made.ok());
  auto p = std::move(made).value();
  const Obs o = MakeObs({0, 1, 2, 3, 4, 5}, {{{.1, .1, .2, .2, .2, .2}}, {{.5, .1, .1, .1, .1, .1}}},
                        {{1, 0}, {0, 1}, {1, 1}, {1, -1}, {2, 1}, {1, 2}});

  Status st = p->Observe(o.View(0));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.message().find("Begin"), std::string::npos);

  ASSERT_TRUE(p->Begin(g).ok());
  auto sc = p->Scores(0);
  EXPECT_EQ(sc.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(sc.status().message().find("before any observation"), std::string::npos)
      << sc.status().ToString();
  EXPECT_EQ(p->Keep(0, 10).status().code(), StatusCode::kFailedPrecondition);

  st = p->Observe(o.View(2));  // layer out of range
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("layer"), std::string::npos);
  EXPECT_EQ(p->Scores(-1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p->Keep(5, 10).status().code(), StatusCode::kInvalidArgument);

  // Keys missing while lambda < 1.
  AttentionObservation no_keys = o.View(0);
  no_keys.keys = nullptr;
  st = p->Observe(no_keys);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("keys"), std::string::npos) << st.ToString();
  // ... fine with lambda = 1.
  auto p1 = Make("gkv:w=2,lambda=1", g);
  EXPECT_TRUE(p1->Observe(no_keys).ok());

  // Budget below the protected keys: sink 0 + the last max(local 2, w 2) = 3.
  ASSERT_TRUE(p->Observe(o.View(0)).ok());
  auto k = p->Keep(0, 2);
  EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("smaller than the 3 protected"), std::string::npos)
      << k.status().ToString();
  EXPECT_TRUE(p->Keep(0, 3).ok());
  EXPECT_EQ(p->Keep(0, -1).status().code(), StatusCode::kInvalidArgument);
}

// ---- factory -------------------------------------------------------------------------------

TEST(Gkv, FactoryRoundTrip) {
  auto d = MakeScoringPolicy("gkv");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->name(), "gkv");
  EXPECT_EQ((*d)->ToString(), "gkv:form=max,alpha=0.8,w=16,s=128,lambda=0.9,tau=0.5");
  EXPECT_EQ((*d)->compress_every(), 128);
  EXPECT_FALSE((*d)->may_evict_protected());

  const std::string spec = "gkv:form=sum,alpha=0.85,w=8,s=64,lambda=0.7,tau=0.6";
  auto p = MakeScoringPolicy("gkv:tau=0.6,lambda=0.7,s=64,w=8,alpha=0.85,form=sum");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->ToString(), spec);
  EXPECT_EQ((*p)->compress_every(), 64);
  auto again = MakeScoringPolicy((*p)->ToString());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->ToString(), spec);

  // Same behaviour: the rebuilt policy scores identically.
  const auto g = Geo(1, 1, 1, 3, 0, 0);
  ASSERT_TRUE((*p)->Begin(g).ok());
  ASSERT_TRUE((*again)->Begin(g).ok());
  const Obs o = MakeObs({0, 1, 2, 3, 4}, {{{.1, .2, .3, .2, .2}}}, kRkvKeys);
  ASSERT_TRUE((*p)->Observe(o.View(0)).ok());
  ASSERT_TRUE((*again)->Observe(o.View(0)).ok());
  EXPECT_EQ((*p)->Scores(0)->per_head, (*again)->Scores(0)->per_head);

  bool listed = false;
  for (const auto& info : ListScoringPolicies())
    if (info.name == "gkv") {
      listed = true;
      ASSERT_EQ(info.params.size(), 6u);
      EXPECT_EQ(info.params[0].key, "form");
      EXPECT_EQ(info.params[0].default_value, "max");
      EXPECT_EQ(info.params[4].key, "lambda");
      EXPECT_EQ(info.params[4].default_value, "0.9");
    }
  EXPECT_TRUE(listed);
}

TEST(Gkv, FactoryRejectsBadSpecs) {
  struct Bad {
    const char* spec;
    const char* mentions;
  };
  for (const Bad& b :
       {Bad{"gkv:form=median", "form"}, Bad{"gkv:alpha=1.5", "alpha"}, Bad{"gkv:alpha=x", "alpha"},
        Bad{"gkv:w=0", "w"}, Bad{"gkv:s=-1", "s"}, Bad{"gkv:lambda=2", "lambda"}, Bad{"gkv:tau=3", "tau"},
        Bad{"gkv:beta=1", "unknown key 'beta'"}}) {
    auto r = MakeScoringPolicy(b.spec);
    ASSERT_FALSE(r.ok()) << b.spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << b.spec;
    EXPECT_NE(r.status().message().find(b.mentions), std::string::npos)
        << b.spec << ": " << r.status().message();
  }
}

}  // namespace
}  // namespace kvtier
