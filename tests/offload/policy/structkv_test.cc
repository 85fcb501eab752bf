// Tests of the `structkv` scoring policy (offload/policy/structkv.h): local saliency (Eq. 2), the
// layer-decayed global centrality (Eq. 3), the pivot metrics and transition score (Eq. 4-9), the
// structural set (Eq. 10), the storage set (Eq. 13) with both budget modes, block aggregation,
// keep-set properties, bounded state, bad inputs and the factory string. Every expected number is
// worked out by hand in the comment next to it.
#include "offload/policy/structkv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace kvtier {
namespace {

// One observation's buffers. rows[h][t] is query t's attention row for query head h.
struct Obs {
  std::vector<int64_t> key_pos, query_pos;
  std::vector<float> attention;
  int n_queries = 0;

  AttentionObservation View(int layer) const {
    AttentionObservation o;
    o.layer = layer;
    o.n_queries = n_queries;
    o.n_keys = static_cast<int64_t>(key_pos.size());
    o.key_positions = key_pos.data();
    o.query_positions = query_pos.data();
    o.attention = attention.data();
    return o;
  }
};

Obs MakeObs(const std::vector<int64_t>& key_pos, const std::vector<std::vector<std::vector<float>>>& rows) {
  Obs o;
  o.key_pos = key_pos;
  o.n_queries = static_cast<int>(rows[0].size());
  for (int t = 0; t < o.n_queries; ++t) o.query_pos.push_back(key_pos.back() + 1 + t);
  for (const auto& head : rows)
    for (const auto& row : head) o.attention.insert(o.attention.end(), row.begin(), row.end());
  return o;
}

// One query head, one query: the row itself.
Obs Row(const std::vector<float>& row) {
  std::vector<int64_t> pos;
  for (size_t i = 0; i < row.size(); ++i) pos.push_back(static_cast<int64_t>(i));
  return MakeObs(pos, {{row}});
}

PolicyGeometry Geo(int layers, int q_heads, int kv_heads, int64_t sinks, int64_t local) {
  PolicyGeometry g;
  g.layers = layers;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = 4;
  g.sink_tokens = sinks;
  g.local_tokens = local;
  return g;
}

std::unique_ptr<StructKvPolicy> Make(const std::string& spec, const PolicyGeometry& g) {
  auto r = MakeScoringPolicy(spec);
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  if (!r.ok()) return nullptr;
  auto base = std::move(r).value();
  auto* raw = dynamic_cast<StructKvPolicy*>(base.get());
  EXPECT_NE(raw, nullptr) << spec;
  if (raw == nullptr) return nullptr;
  base.release();
  std::unique_ptr<StructKvPolicy> p(raw);
  const Status st = p->Begin(g);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return p;
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << what << " [" << i << "]";
}

const std::vector<float> kU = {.1f, .1f, .1f, .1f, .1f, .1f, .1f, .1f, .1f, .1f};  // uniform over 10
std::vector<float> OneHot(int at) {
  std::vector<float> r(10, 0.0f);
  r[at] = 1.0f;
  return r;
}

// ---- Eq. 2 and block aggregation --------------------------------------------------------------

// 4 query heads in 2 kv groups ({0,1} -> g0, {2,3} -> g1), w = 2 of 3 queries, 4 keys.
//   query 0 is outside the window (all rows on key 0).
//   query 1: h0 [.1 .2 .3 .4] h1 [.4 .3 .2 .1] h2 [.25 .25 .25 .25] h3 [0 0 0 1]
//   query 2: h0 [.5 .5 0 0]   h1 [0 0 1 0]     h2 [.1 .1 .1 .7]     h3 [.3 .3 .2 .2]
//   S_g0 = 1/2 ([.5 .5 .5 .5] + [.5 .5 1 0]) = [.5 .5 .75 .25]
//   S_g1 = 1/2 ([.25 .25 .25 1.25] + [.4 .4 .3 .9]) = [.325 .325 .275 1.075]
// One layer: the pivot is layer 0 and C = S (Eq. 3 with L* = 0). Chunks of 2 tokens (Sec. 4.1):
//   S_block0 = C[0] + C[1] = .825 + .825 = 1.65;  S_block1 = 1.025 + 1.325 = 2.35.
TEST(StructKv, LocalSaliencyEq2AndBlockAggregation) {
  const auto g = Geo(1, 4, 2, 0, 0);
  auto p = Make("structkv:w=2", g);
  const Obs o = MakeObs({0, 1, 2, 3}, {{{1, 0, 0, 0}, {.1, .2, .3, .4}, {.5, .5, 0, 0}},
                                       {{1, 0, 0, 0}, {.4, .3, .2, .1}, {0, 0, 1, 0}},
                                       {{1, 0, 0, 0}, {.25, .25, .25, .25}, {.1, .1, .1, .7}},
                                       {{1, 0, 0, 0}, {0, 0, 0, 1}, {.3, .3, .2, .2}}});
  ASSERT_TRUE(p->Observe(o.View(0)).ok());
  auto s = p->LocalSaliency(0);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ExpectNear(s->per_head[0], {.5, .5, .75, .25}, "S_g0");
  ExpectNear(s->per_head[1], {.325, .325, .275, 1.075}, "S_g1");
  EXPECT_EQ(p->pivot_layer(), 0);
  auto c = p->Scores(0);
  ASSERT_TRUE(c.ok());
  ExpectNear(c->per_head[0], {.5, .5, .75, .25}, "C_g0");
  const auto blocks = AggregateToChunks(*c, /*n_sink=*/0, 2, /*n_chunks=*/2);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[0].first, 0);
  EXPECT_NEAR(blocks[0].second, 1.65, 1e-5);
  EXPECT_EQ(blocks[1].first, 1);
  EXPECT_NEAR(blocks[1].second, 2.35, 1e-5);
}

// ---- Eq. 3 --------------------------------------------------------------------------------

// Three layers, one head, λ = .5, rows S0 = [.2 .3 .5], S1 = [.6 .2 .2], S2 = [.1 .1 .8].
//   running C after layer 1: .5*S0 + S1 = [.7 .35 .45] (before the pivot, Scores is the running C)
//   after layer 2 (L_lim = 2; T over l = 1, 2; L* = min(argmax + 1, 2) = 2):
//   C = λ²S0 + λS1 + S2 = [.05+.3+.1, .075+.1+.1, .125+.1+.8] = [.45 .275 1.025].
TEST(StructKv, GlobalCentralityEq3) {
  const auto g = Geo(3, 1, 1, 0, 0);
  auto p = Make("structkv:w=1,lambda=0.5", g);
  const Obs l0 = Row({.2f, .3f, .5f}), l1 = Row({.6f, .2f, .2f}), l2 = Row({.1f, .1f, .8f});
  ASSERT_TRUE(p->Observe(l0.View(0)).ok());
  ASSERT_TRUE(p->Observe(l1.View(1)).ok());
  EXPECT_EQ(p->pivot_layer(), -1);
  ExpectNear(p->Scores(0)->per_head[0], {.7, .35, .45}, "running C after layer 1");
  ASSERT_TRUE(p->Observe(l2.View(2)).ok());
  EXPECT_EQ(p->pivot_layer(), 2);
  ExpectNear(p->Scores(2)->per_head[0], {.45, .275, 1.025}, "C at L* = 2");
}

// ---- Eq. 4-6 -------------------------------------------------------------------------------

// Two query heads, one query, 10 keys:
//   h0 uniform .1:      H = ln 10 = 2.302585, top-1 mass .1, top-2 mass .2, variance 0
//   h1 [.5 .5 0 ... 0]: H = ln 2  = .693147,  top-1 mass .5, top-2 mass 1,  variance
//       (2*.4² + 8*.1²)/10 = .04
//   Eq. 4: H = (2.302585 + .693147)/2 = 1.497866;  Eq. 6: V = .02
//   Eq. 5 with k = .1*10 = 1: ρ = (.1 + .5)/2 = .3;  with topk = .2 (k = 2): ρ = (.2 + 1)/2 = .6
TEST(StructKv, MetricsEq4To6) {
  const auto g = Geo(1, 2, 1, 0, 0);
  const std::vector<float> half = {.5f, .5f, 0, 0, 0, 0, 0, 0, 0, 0};
  const Obs o = MakeObs({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {{kU}, {half}});
  for (const auto& [spec, rho] :
       {std::pair<const char*, double>{"structkv", .3}, {"structkv:topk=0.2", .6}}) {
    SCOPED_TRACE(spec);
    auto p = Make(spec, g);
    ASSERT_TRUE(p->Observe(o.View(0)).ok());
    auto m = p->Metrics(0);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_NEAR(m->entropy, (std::log(10.0) + std::log(2.0)) / 2, 1e-5);
    EXPECT_NEAR(m->sparsity, rho, 1e-6);
    EXPECT_NEAR(m->variance, .02, 1e-7);
  }
}

// ---- Eq. 7-9 -------------------------------------------------------------------------------

// Five layers, rows over 10 keys: L0 U, L1 U, L2 P5 (.2 on keys 0..4), L3 P1, L4 P1.
//   metrics (H, ρ with k = 1, V):  U (ln 10, .1, 0)   P5 (ln 5, .2, .01)   P1 (0, 1, .09)
//   Δ(−H): l1 0, l2 ln 2 = .693147, l3 ln 5 = 1.609438, l4 0  -> Eq. 7: 0, .430677, 1, 0
//   Δρ   : 0, .1, .8, 0                                       -> 0, .125, 1, 0
//   ΔV   : 0, .01, .08, 0                                     -> 0, .125, 1, 0
//   Eq. 8: T2 = .2*.430677 + .3*.125 + .5*.125 = .186135; T3 = 1; T1 = T4 = 0
//   Eq. 9: L* = argmax + 1 = 4 (the limit is the last layer, 4).
TEST(StructKv, TransitionScoreEq7Eq8) {
  const auto g = Geo(5, 1, 1, 0, 0);
  auto p = Make("structkv:w=1", g);
  const std::vector<float> p5 = {.2f, .2f, .2f, .2f, .2f, 0, 0, 0, 0, 0};
  const std::vector<std::vector<float>> rows = {kU, kU, p5, OneHot(0), OneHot(0)};
  for (int l = 0; l < 5; ++l) ASSERT_TRUE(p->Observe(Row(rows[l]).View(l)).ok());
  ASSERT_EQ(p->transition_scores().size(), 5u);
  const std::vector<double> want = {0, 0, .2 * std::log(2.0) / std::log(5.0) + .3 * .125 + .5 * .125, 1, 0};
  for (int l = 0; l < 5; ++l) EXPECT_NEAR(p->transition_scores()[l], want[l], 1e-5) << l;
  EXPECT_EQ(p->pivot_layer(), 4);
}

// Six layers over 10 keys, w = 2: L0 U, L1 U, then one-hot rows on keys 0, 1, 2, 3 (same metrics).
//   Only l = 2 changes the metrics: T2 = 1, the rest 0 -> Eq. 9: L* = 2 + 1 = 3 (not 2: the +1).
//   C at L* (Eq. 3, λ = .9): .729 U + .81 U + .9 e0 + e1 = .1539 everywhere, +.9 on key 0, +1 on key 1
//   -> [1.0539 1.1539 .1539 ...]; the snapshot excludes layers 4 and 5 (keys 2, 3).
//   Eq. 10: top-k(C, 10*.2 = 2) = {1, 0} ∪ I_win {8, 9} = {0, 1, 8, 9}.
//   (C after layer 5 would pick keys 3 and 2.)
TEST(StructKv, PivotEq9AndStructuralSetEq10) {
  const auto g = Geo(6, 1, 1, 0, 0);
  auto p = Make("structkv:w=2", g);
  const std::vector<std::vector<float>> rows = {kU, kU, OneHot(0), OneHot(1), OneHot(2), OneHot(3)};
  for (int l = 0; l < 6; ++l) {
    ASSERT_TRUE(p->Observe(Row(rows[l]).View(l)).ok());
    EXPECT_EQ(p->pivot_layer(), l < 5 ? -1 : 3) << l;
  }
  const std::vector<double> t = {0, 0, 1, 0, 0, 0};
  for (int l = 0; l < 6; ++l) EXPECT_NEAR(p->transition_scores()[l], t[l], 1e-6) << l;
  ExpectNear(p->Scores(5)->per_head[0],
             {1.0539, 1.1539, .1539, .1539, .1539, .1539, .1539, .1539, .1539, .1539}, "C at L* = 3");
  EXPECT_EQ(p->structural(), (std::vector<int64_t>{0, 1, 8, 9}));
  auto k = p->Keep(5, 10);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->structural, (std::vector<int64_t>{0, 1, 8, 9}));
}

// The layer limit caps the pivot (Algorithm 1 line 8) and decides it as soon as that layer is seen:
// layer_limit = 2: T over l = 1, 2, argmax 2 -> L* = min(3, 2) = 2.
//   C = .81 U + .9 U + e0 = .171 everywhere, +1 on key 0. top-2: key 0, then the .171 tie goes to the
//   later key, 9 -> I_struct = {0, 9} ∪ {8, 9} = {0, 8, 9}. Later layers do not move C.
TEST(StructKv, LayerLimitCapsPivot) {
  const auto g = Geo(6, 1, 1, 0, 0);
  auto p = Make("structkv:w=2,layer_limit=2", g);
  const std::vector<std::vector<float>> rows = {kU, kU, OneHot(0), OneHot(1), OneHot(2), OneHot(3)};
  for (int l = 0; l < 3; ++l) ASSERT_TRUE(p->Observe(Row(rows[l]).View(l)).ok());
  EXPECT_EQ(p->pivot_layer(), 2);
  EXPECT_EQ(p->structural(), (std::vector<int64_t>{0, 8, 9}));
  for (int l = 3; l < 6; ++l) ASSERT_TRUE(p->Observe(Row(rows[l]).View(l)).ok());
  EXPECT_EQ(p->pivot_layer(), 2);
  ExpectNear(p->Scores(4)->per_head[0], {1.171, .171, .171, .171, .171, .171, .171, .171, .171, .171}, "C");
  // A new pass (layer 0 again) drops the pivot until the limit is seen again.
  ASSERT_TRUE(p->Observe(Row(kU).View(0)).ok());
  EXPECT_EQ(p->pivot_layer(), -1);
  EXPECT_TRUE(p->structural().empty());
}

// ---- Eq. 13 --------------------------------------------------------------------------------

// Two layers over 10 keys, sink 1, local 1, w = 2 (protected: key 0, keys 8 and 9), r_kv = .3.
//   layer 0 puts .91 on key 2 (C[2] is large), layer 1 is
//   S1 = [.05 .2 .05 .15 .1 .05 .25 .05 .05 .05]: Keep(1) ranks by S^(1), not by C.
//   budget 5: {0, 8, 9} + the top 2 of S1 among the rest: 6 (.25), 1 (.2) -> {0 1 6 8 9}.
//   budget_from_ratio=1: I_KV = top-k(S1, ⌊10*.3⌋ = 3) = {6, 1, 3} ∪ I_win {8, 9} (+ sink 0):
//   6 keys; budget 100 -> {0 1 3 6 8 9}; budget 5 caps it -> {0 1 6 8 9}.
TEST(StructKv, StorageSetEq13BudgetModes) {
  const auto g = Geo(2, 1, 1, 1, 1);
  const std::vector<float> s0 = {.01f, .01f, .91f, .01f, .01f, .01f, .01f, .01f, .01f, .01f};
  const std::vector<float> s1 = {.05f, .2f, .05f, .15f, .1f, .05f, .25f, .05f, .05f, .05f};
  for (int ratio = 0; ratio < 2; ++ratio) {
    SCOPED_TRACE(ratio);
    auto p = Make("structkv:w=2,r_kv=0.3,budget_from_ratio=" + std::to_string(ratio), g);
    ASSERT_TRUE(p->Observe(Row(s0).View(0)).ok());
    ASSERT_TRUE(p->Observe(Row(s1).View(1)).ok());
    EXPECT_GT(p->Scores(1)->per_head[0][2], p->Scores(1)->per_head[0][6]);  // C favours key 2
    auto big = p->Keep(1, 100);
    ASSERT_TRUE(big.ok()) << big.status().ToString();
    if (ratio == 1) {
      EXPECT_EQ(big->per_head[0], (std::vector<int64_t>{0, 1, 3, 6, 8, 9}));
    } else {
      EXPECT_EQ(big->per_head[0].size(), 10u);
    }
    ASSERT_TRUE(p->Observe(Row(s0).View(0)).ok());  // a fresh pass (Keep(1, 100) kept 6 keys)
    ASSERT_TRUE(p->Observe(Row(s1).View(1)).ok());
    auto k = p->Keep(1, 5);
    ASSERT_TRUE(k.ok()) << k.status().ToString();
    EXPECT_EQ(k->per_head[0], (std::vector<int64_t>{0, 1, 6, 8, 9}));
  }
}

// ---- properties --------------------------------------------------------------------------

Obs RandomObs(std::mt19937& rng, const std::vector<int64_t>& pos, int q_heads, int n_queries) {
  Obs o;
  o.key_pos = pos;
  o.n_queries = n_queries;
  for (int t = 0; t < n_queries; ++t) o.query_pos.push_back(pos.back() + 1 + t);
  std::exponential_distribution<float> ex(1.0f);
  for (int h = 0; h < q_heads; ++h)
    for (int t = 0; t < n_queries; ++t) {
      std::vector<float> row(pos.size());
      float sum = 0.0f;
      for (auto& v : row) sum += (v = ex(rng) * ex(rng));
      for (auto& v : row) v /= sum;
      o.attention.insert(o.attention.end(), row.begin(), row.end());
    }
  return o;
}

std::vector<int64_t> Iota(int64_t from, int64_t to) {
  std::vector<int64_t> v;
  for (int64_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

TEST(StructKv, KeepsExactlyBudgetSameSetPerHeadWithProtected) {
  const auto g = Geo(3, 4, 2, 2, 3);
  std::mt19937 rng(5);
  for (int64_t budget : {7, 8, 15, 30, 50}) {
    auto p = Make("structkv:w=5", g);  // protected: sinks 0, 1 and the last max(3, 5) = 5 keys
    const auto pos = Iota(0, 40);
    for (int l = 0; l < 3; ++l) ASSERT_TRUE(p->Observe(RandomObs(rng, pos, 4, 6).View(l)).ok());
    for (int l = 0; l < 3; ++l) {
      auto k = p->Keep(l, budget);
      ASSERT_TRUE(k.ok()) << k.status().ToString();
      ASSERT_EQ(k->per_head.size(), 2u);
      EXPECT_EQ(k->per_head[0], k->per_head[1]);
      const auto& head = k->per_head[0];
      EXPECT_EQ(static_cast<int64_t>(head.size()), std::min<int64_t>(budget, 40));
      EXPECT_TRUE(std::is_sorted(head.begin(), head.end()));
      for (int64_t must : {0, 1, 35, 36, 37, 38, 39})
        EXPECT_TRUE(std::binary_search(head.begin(), head.end(), must)) << must << " budget " << budget;
      // I_struct: ⌊40 * .2⌋ = 8 by C, plus I_win (5 keys), overlaps counted once.
      EXPECT_GE(k->structural.size(), 8u);
      EXPECT_LE(k->structural.size(), 13u);
    }
  }
}

TEST(StructKv, Deterministic) {
  const auto g = Geo(2, 2, 1, 1, 2);
  std::vector<std::vector<int64_t>> runs[2];
  for (auto& run : runs) {
    std::mt19937 rng(9);
    auto p = Make("structkv:w=3", g);
    for (int l = 0; l < 2; ++l) ASSERT_TRUE(p->Observe(RandomObs(rng, Iota(0, 30), 2, 3).View(l)).ok());
    for (int l = 0; l < 2; ++l) {
      auto k = p->Keep(l, 12);
      ASSERT_TRUE(k.ok());
      run.push_back(k->per_head[0]);
      run.push_back(k->structural);
    }
  }
  EXPECT_EQ(runs[0], runs[1]);
}

// 300 observations (150 passes over 2 layers), Keep after each, 6 new keys per pass: the state stays
// bounded by what is cached.
TEST(StructKv, LongStreamStateBounded) {
  const auto g = Geo(2, 4, 2, 2, 4);
  auto p = Make("structkv", g);
  EXPECT_EQ(p->compress_every(), 0);
  std::mt19937 rng(1);
  std::vector<std::vector<int64_t>> cache(2, Iota(0, 6));
  int64_t next = 6;
  size_t max_bytes = 0;
  for (int step = 0; step < 150; ++step) {
    for (int l = 0; l < 2; ++l) {
      ASSERT_TRUE(p->Observe(RandomObs(rng, cache[l], 4, 3).View(l)).ok());
      auto k = p->Keep(l, 20);
      ASSERT_TRUE(k.ok()) << k.status().ToString();
      ASSERT_EQ(k->per_head[0].size(), std::min<size_t>(20, cache[l].size()));
      cache[l] = k->Union();
      max_bytes = std::max(max_bytes, p->state_bytes());
    }
    for (int i = 0; i < 6; ++i, ++next)
      for (auto& c : cache) c.push_back(next);
  }
  EXPECT_EQ(p->pivot_layer(), 1);
  // At most 26 keys per layer: per layer 26 x (8 + 2 x 4) bytes of S; C (and, before the pivot, its
  // snapshot) on the union of the two layers' keys, at most 20 + 20 + 6 = 46, again 16 bytes a key;
  // a few metrics; x2 for capacity slack.
  EXPECT_GT(max_bytes, 0u);
  EXPECT_LE(max_bytes, 2u * (2u * 26u * 16u + 2u * 46u * 16u + 256u));
}

// ---- bad inputs ------------------------------------------------------------------------------

TEST(StructKv, BadInputsGiveClearErrors) {
  const auto g = Geo(3, 1, 1, 1, 2);
  auto made = MakeScoringPolicy("structkv:w=2");
  ASSERT_TRUE(made.ok());
  auto p = std::move(made).value();
  const Obs o = Row({.1f, .1f, .2f, .2f, .2f, .2f});

  Status st = p->Observe(o.View(0));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.message().find("Begin"), std::string::npos);
  EXPECT_EQ(p->Keep(0, 5).status().code(), StatusCode::kFailedPrecondition);

  ASSERT_TRUE(p->Begin(g).ok());
  auto sc = p->Scores(0);
  EXPECT_EQ(sc.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(sc.status().message().find("before any observation"), std::string::npos)
      << sc.status().ToString();
  EXPECT_EQ(p->Keep(1, 5).status().code(), StatusCode::kFailedPrecondition);

  st = p->Observe(o.View(3));  // out of range
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  st = p->Observe(o.View(1));  // out of order: a pass starts at layer 0
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.message().find("expected layer 0"), std::string::npos) << st.ToString();
  ASSERT_TRUE(p->Observe(o.View(0)).ok());
  st = p->Observe(o.View(2));  // skips layer 1
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("expected layer 1"), std::string::npos) << st.ToString();
  EXPECT_EQ(p->Scores(7).status().code(), StatusCode::kInvalidArgument);

  // Budget below the protected keys: sink 0 + the last max(local 2, w 2) = 3.
  auto k = p->Keep(0, 2);
  EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("smaller than the 3 protected"), std::string::npos)
      << k.status().ToString();
  EXPECT_EQ(p->Keep(0, -3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(p->Keep(0, 3).ok());
}

// ---- factory -------------------------------------------------------------------------------

TEST(StructKv, FactoryRoundTrip) {
  auto d = MakeScoringPolicy("structkv");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->name(), "structkv");
  EXPECT_EQ((*d)->ToString(),
            "structkv:w=8,lambda=0.9,r_struct=0.2,r_kv=0.1,w1=0.2,w2=0.3,w3=0.5,topk=0.1,layer_limit=-1,"
            "budget_from_ratio=0");
  EXPECT_EQ((*d)->compress_every(), 0);

  const std::string spec =
      "structkv:w=4,lambda=0.8,r_struct=0.3,r_kv=0.15,w1=0.1,w2=0.4,w3=0.5,topk=0.05,layer_limit=12,"
      "budget_from_ratio=1";
  auto p = MakeScoringPolicy(
      "structkv:budget_from_ratio=1,layer_limit=12,topk=0.05,w3=0.5,w2=0.4,w1=0.1,r_kv=0.15,r_struct=0.3,"
      "lambda=0.8,w=4");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->ToString(), spec);
  auto again = MakeScoringPolicy((*p)->ToString());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->ToString(), spec);
  const auto* a = dynamic_cast<const StructKvPolicy*>(again->get());
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->options().layer_limit, 12);
  EXPECT_TRUE(a->options().budget_from_ratio);
  EXPECT_DOUBLE_EQ(a->options().r_kv, 0.15);

  bool listed = false;
  for (const auto& info : ListScoringPolicies())
    if (info.name == "structkv") {
      listed = true;
      EXPECT_EQ(info.params.size(), 10u);
      EXPECT_EQ(info.params[0].key, "w");
      EXPECT_EQ(info.params[0].default_value, "8");
    }
  EXPECT_TRUE(listed);
}

TEST(StructKv, FactoryRejectsBadSpecs) {
  struct Bad {
    const char* spec;
    const char* mentions;
  };
  for (const Bad& b : {Bad{"structkv:w=0", "w"}, Bad{"structkv:lambda=0", "lambda"},
                       Bad{"structkv:lambda=1.5", "lambda"}, Bad{"structkv:r_struct=2", "r_struct"},
                       Bad{"structkv:r_kv=-0.1", "r_kv"}, Bad{"structkv:w2=-1", "w2"},
                       Bad{"structkv:topk=0", "topk"}, Bad{"structkv:layer_limit=-2", "layer_limit"},
                       Bad{"structkv:budget_from_ratio=yes", "budget_from_ratio"},
                       Bad{"structkv:alpha=1", "unknown key 'alpha'"}}) {
    auto r = MakeScoringPolicy(b.spec);
    ASSERT_FALSE(r.ok()) << b.spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << b.spec;
    EXPECT_NE(r.status().message().find(b.mentions), std::string::npos)
        << b.spec << ": " << r.status().message();
  }
}

}  // namespace
}  // namespace kvtier
