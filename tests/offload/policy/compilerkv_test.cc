// Tests of the CompilerKV policy (offload/policy/compilerkv.h): hand-computed examples pinning
// Eqs. 6, 7, 8, 10, 12, 13, 15, 16; neutral tables = Top-B; properties; bounded state; the tables
// and traces files; the trace recorder's reward (Eqs. 2, 14) and the CQL compiler (Eqs. 4, 9).
#include "offload/policy/compilerkv.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "store/checksum.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

// One observation's buffers.
struct Obs {
  int layer = 0;
  std::vector<int64_t> kpos, qpos;
  std::vector<float> attn, values, logprobs;
  AttentionObservation view() const {
    AttentionObservation o;
    o.layer = layer;
    o.n_queries = static_cast<int>(qpos.size());
    o.n_keys = static_cast<int64_t>(kpos.size());
    o.key_positions = kpos.data();
    o.query_positions = qpos.data();
    o.attention = attn.data();
    o.values = values.empty() ? nullptr : values.data();
    o.token_logprobs = logprobs.empty() ? nullptr : logprobs.data();
    return o;
  }
};

PolicyGeometry Geo(int layers, int q_heads, int kv_heads, int head_dim, int64_t sink, int64_t local) {
  PolicyGeometry g;
  g.layers = layers;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.sink_tokens = sink;
  g.local_tokens = local;
  return g;
}

// Random causal softmax attention: the queries are the last nq cached positions.
Obs RandomObs(const PolicyGeometry& g, int layer, const std::vector<int64_t>& kpos, int nq, std::mt19937* rng,
              bool logprobs = false) {
  Obs o;
  o.layer = layer;
  o.kpos = kpos;
  const int64_t n = static_cast<int64_t>(kpos.size());
  for (int i = 0; i < nq; ++i) o.qpos.push_back(kpos[n - nq + i]);
  std::normal_distribution<float> nd(0.f, 1.5f);
  o.attn.assign(static_cast<size_t>(g.q_heads) * nq * n, 0.f);
  for (int h = 0; h < g.q_heads; ++h)
    for (int i = 0; i < nq; ++i) {
      float* row = o.attn.data() + (static_cast<size_t>(h) * nq + i) * n;
      double z = 0;
      for (int64_t t = 0; t <= n - nq + i; ++t) z += row[t] = std::exp(nd(*rng));
      for (int64_t t = 0; t <= n - nq + i; ++t) row[t] = static_cast<float>(row[t] / z);
    }
  o.values.resize(static_cast<size_t>(n) * g.kv_heads * g.head_dim);
  for (float& v : o.values) v = nd(*rng);
  if (logprobs)
    for (int i = 0; i < nq; ++i) o.logprobs.push_back(-std::fabs(nd(*rng)));
  return o;
}

std::vector<int64_t> Iota(int64_t n, int64_t from = 0) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

std::unique_ptr<CompilerKvPolicy> Neutral(bool fill = true) {
  CompilerKvOptions o;
  o.fill = fill;
  return std::make_unique<CompilerKvPolicy>(o, nullptr);
}

// The hand example: 2 layers, 2 q heads = 2 kv heads, D = 2, 3 keys, 1 query at position 2.
//   layer 0 attention: head 0 [.5 .3 .2], head 1 [.1 .1 .8]   (q-head mean [.3 .2 .5])
//   layer 1 attention: head 0 [.2 .2 .6], head 1 [.6 .2 .2]   (q-head mean [.4 .2 .4])
//   values (both layers): key 0: h0 (3,4) h1 (1,0); key 1: h0 (0,1) h1 (0,2); key 2: h0 (0,3) h1 (0,3)
//   ‖v‖: h0 [5 1 3] (mean 3), h1 [1 2 3] (mean 2)
Obs HandObs(int layer) {
  Obs o;
  o.layer = layer;
  o.kpos = {0, 1, 2};
  o.qpos = {2};
  if (layer == 0)
    o.attn = {.5f, .3f, .2f, .1f, .1f, .8f};
  else
    o.attn = {.2f, .2f, .6f, .6f, .2f, .2f};
  o.values = {3, 4, 1, 0, 0, 1, 0, 2, 0, 3, 0, 3};
  return o;
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want, double tol = 1e-6) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "index " << i;
}

// Writes body + its CRC-32C trailer, as the file formats require.
void WriteChecksummed(const std::string& path, const std::string& body) {
  char crc[32];
  std::snprintf(crc, sizeof(crc), "crc32c %08x\n", Crc32c(body.data(), body.size()));
  std::ofstream(path, std::ios::binary | std::ios::trunc) << body << crc;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---- the equations ---------------------------------------------------------------------------

TEST(CompilerKv, Eq6To8GlobalMeanAttentionRelativeNormUtility) {
  const PolicyGeometry g = Geo(2, 2, 2, 2, 0, 0);
  auto p = Neutral();
  ASSERT_TRUE(p->Begin(g).ok());
  const Obs o0 = HandObs(0), o1 = HandObs(1);
  ASSERT_TRUE(p->Observe(o0.view()).ok());
  // Only layer 0 seen: Ā is its q-head mean.
  auto a = p->Analyze(0);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->layers_seen, 1);
  ExpectNear(a->alpha, {0.3, 0.2, 0.5});
  ExpectNear(a->rho, {5.0 / 3, 1.0 / 3, 1.0, 0.5, 1.0, 1.5});  // Eq. 7
  ExpectNear(a->uhat, {0.5, 0.2, 0.75});                       // max_h α ρ (Eqs. 8, 10)
  // Both layers: Eq. 6 averages layers too, α = [.35 .2 .45].
  ASSERT_TRUE(p->Observe(o1.view()).ok());
  a = p->Analyze(0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->layers_seen, 2);
  ExpectNear(a->alpha, {0.35, 0.2, 0.45});
  // u h0 = [.583333 .066667 .45], u h1 = [.175 .2 .675] -> û = [.583333 .2 .675].
  ExpectNear(a->uhat, {0.35 * 5 / 3, 0.2, 0.675});
  EXPECT_NEAR(a->alpha_mean, 1.0 / 3, 1e-6);
  auto s = p->Scores(0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->positions, (std::vector<int64_t>{0, 1, 2}));
  ASSERT_EQ(s->per_head.size(), 2u);
  for (const auto& h : s->per_head) ExpectNear(h, {0.35 * 5 / 3, 0.2, 0.675});
}

TEST(CompilerKv, WindowCumulativeAlphaSumsQueriesAndObservations) {
  const PolicyGeometry g = Geo(1, 1, 1, 1, 0, 0);
  auto p = Neutral();
  ASSERT_TRUE(p->Begin(g).ok());
  Obs o;
  o.kpos = {0, 1, 2};
  o.qpos = {1, 2};
  o.attn = {.6f, .4f, 0.f, .2f, .3f, .5f};  // query at 1 cannot see key 2
  o.values = {1, 1, 1};
  ASSERT_TRUE(p->Observe(o.view()).ok());
  auto a = p->Analyze(0);
  ASSERT_TRUE(a.ok());
  ExpectNear(a->alpha, {0.8, 0.7, 0.5});
  // Eq. 12 on α / ‖α‖₁ = [.4 .35 .25] (Alg. 1 line 7).
  EXPECT_NEAR(a->r_struct, -(0.4 * std::log(0.4) + 0.35 * std::log(0.35) + 0.25 * std::log(0.25)), 1e-6);
  // A later observation extends Ω; a key the caller dropped (1) is forgotten.
  Obs o2;
  o2.kpos = {0, 2, 3};
  o2.qpos = {3};
  o2.attn = {.1f, .1f, .8f};
  o2.values = {1, 1, 1};
  ASSERT_TRUE(p->Observe(o2.view()).ok());
  a = p->Analyze(0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->positions, (std::vector<int64_t>{0, 2, 3}));
  ExpectNear(a->alpha, {0.9, 0.6, 0.8});
}

TEST(CompilerKv, Eq10WeightedMaxPoolingUsesHeadTable) {
  const PolicyGeometry g = Geo(2, 2, 2, 2, 0, 0);
  CompilerKvTables t = CompilerKvTables::Neutral(2, 2, CompilerKvBins{});
  t.w_head = {0.5f, 2.0f, 1.0f, 1.0f};  // layer 0: head 0 halved, head 1 doubled
  CompilerKvPolicy p(CompilerKvOptions{}, std::make_shared<const CompilerKvTables>(t));
  ASSERT_TRUE(p.Begin(g).ok());
  const Obs o0 = HandObs(0), o1 = HandObs(1);
  ASSERT_TRUE(p.Observe(o0.view()).ok());
  ASSERT_TRUE(p.Observe(o1.view()).ok());
  auto a = p.Analyze(0);
  ASSERT_TRUE(a.ok());
  // max(u0 * .5, u1 * 2) = max([.291667 .033333 .225], [.35 .4 1.35]).
  ExpectNear(a->uhat, {0.35, 0.4, 1.35});
  a = p.Analyze(1);  // layer 1 keeps weights 1
  ASSERT_TRUE(a.ok());
  ExpectNear(a->uhat, {0.35 * 5 / 3, 0.2, 0.675});
  // An override row (the compiler's actions) replaces the table's.
  const std::vector<float> w = {1.0f, 0.0f};
  a = p.Analyze(0, &w);
  ASSERT_TRUE(a.ok());
  ExpectNear(a->uhat, {0.35 * 5 / 3, 0.2 / 3, 0.45});
}

TEST(CompilerKv, Eq12StructuralRiskAndEntropyBin) {
  const PolicyGeometry g = Geo(2, 2, 2, 2, 0, 0);
  auto p = Neutral();
  ASSERT_TRUE(p->Begin(g).ok());
  const Obs o0 = HandObs(0), o1 = HandObs(1);
  ASSERT_TRUE(p->Observe(o0.view()).ok());
  ASSERT_TRUE(p->Observe(o1.view()).ok());
  auto a = p->Analyze(1);
  ASSERT_TRUE(a.ok());
  const double h = -(0.35 * std::log(0.35) + 0.2 * std::log(0.2) + 0.45 * std::log(0.45));  // 1.048654
  EXPECT_NEAR(a->r_struct, h, 1e-6);
  // b_ent = floor(20 * H / ln 3) = floor(19.09) = 19.
  EXPECT_EQ(a->ent_bin, 19);
  EXPECT_EQ(a->ent_bin, static_cast<int>(std::floor(20 * h / std::log(3.0))));
}

TEST(CompilerKv, Eq13SemanticRiskCountsEachQueryOnce) {
  const PolicyGeometry g = Geo(2, 1, 1, 1, 0, 0);
  auto p = Neutral();
  ASSERT_TRUE(p->Begin(g).ok());
  Obs o;
  o.kpos = {0, 1, 2};
  o.qpos = {1, 2};
  o.attn = {.5f, .5f, 0.f, .2f, .3f, .5f};
  o.values = {1, 2, 3};
  // Without log-probs: the neutral "no model" bucket.
  ASSERT_TRUE(p->Observe(o.view()).ok());
  auto a = p->Analyze(0);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->has_sem);
  EXPECT_EQ(a->ppl_bin, CompilerKvBins{}.ppl_bins);
  ASSERT_TRUE(p->Begin(g).ok());
  o.logprobs = {-1.0f, -2.0f};
  ASSERT_TRUE(p->Observe(o.view()).ok());
  a = p->Analyze(0);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->has_sem);
  EXPECT_NEAR(a->r_sem, std::exp(1.5), 1e-9);  // exp(-(1/|Ω|) Σ log P)
  EXPECT_EQ(a->ppl_bin, 1);                    // floor(1.5 / nll_step 1)
  // The same window fed for layer 1 (other log-probs) does not count again.
  Obs o1 = o;
  o1.layer = 1;
  o1.logprobs = {-5.0f, -5.0f};
  ASSERT_TRUE(p->Observe(o1.view()).ok());
  a = p->Analyze(1);
  ASSERT_TRUE(a.ok());
  EXPECT_NEAR(a->r_sem, std::exp(1.5), 1e-9);
  // A new query extends Ω: mean NLL (1 + 2 + 4) / 3.
  Obs o2;
  o2.kpos = {0, 1, 2, 3};
  o2.qpos = {3};
  o2.attn = {.25f, .25f, .25f, .25f};
  o2.values = {1, 2, 3, 4};
  o2.logprobs = {-4.0f};
  ASSERT_TRUE(p->Observe(o2.view()).ok());
  a = p->Analyze(0);
  ASSERT_TRUE(a.ok());
  EXPECT_NEAR(a->r_sem, std::exp(7.0 / 3), 1e-6);
  EXPECT_EQ(a->ppl_bin, 2);
}

TEST(CompilerKv, BinsDiscretiseAsDocumented) {
  CompilerKvBins b;  // 20 / 4 / 6 / 1
  EXPECT_EQ(b.EntropyBin(0.0), 0);
  EXPECT_EQ(b.EntropyBin(0.049), 0);
  EXPECT_EQ(b.EntropyBin(0.05), 1);
  EXPECT_EQ(b.EntropyBin(1.0), 19);
  EXPECT_EQ(b.PplBin(false, 3.0), 4);
  EXPECT_EQ(b.PplBin(true, 0.99), 0);
  EXPECT_EQ(b.PplBin(true, 2.5), 2);
  EXPECT_EQ(b.PplBin(true, 99.0), 3);
  EXPECT_EQ(b.BudgetBin(100, 100), 0);
  EXPECT_EQ(b.BudgetBin(60, 100), 0);  // T/B = 1.67
  EXPECT_EQ(b.BudgetBin(50, 100), 1);  // 2
  EXPECT_EQ(b.BudgetBin(13, 100), 2);  // 7.7
  EXPECT_EQ(b.BudgetBin(12, 100), 3);  // 8.3
  EXPECT_EQ(b.BudgetBin(1, 1000), 5);  // clamped
  EXPECT_EQ(b.BudgetBin(0, 1000), 5);
}

// s = û/ᾱ = [4.5 .5 2 1 1.5 3.5]; index 0 is a sink, index 5 the local window.
struct SelectCase {
  PolicyGeometry g = Geo(1, 1, 1, 1, 1, 1);
  std::vector<int64_t> pos = Iota(6);
  std::vector<float> uhat = {9, 1, 4, 2, 3, 7};
  double alpha_mean = 2.0;
};

TEST(CompilerKv, Eq15Eq16CandidatesFitKeepAllOrPad) {
  SelectCase c;
  // τ = 1.2 (units of ᾱ): I_cand = {2, 4} fits B' = 5 - 2 = 3.
  auto s = SelectCompilerKv(c.g, c.pos, c.uhat, c.alpha_mean, 1.2, 5, /*fill=*/false);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->candidates, 2);
  EXPECT_EQ(s->protected_count, 2);
  EXPECT_EQ(s->free_budget, 3);
  EXPECT_EQ(s->kept, (std::vector<int64_t>{0, 2, 4, 5}));  // Eq. 16 first case: fewer than B
  s = SelectCompilerKv(c.g, c.pos, c.uhat, c.alpha_mean, 1.2, 5, /*fill=*/true);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kept, (std::vector<int64_t>{0, 2, 3, 4, 5}));  // padded with the best other (3)
  // Raw û against τ would admit key 3 (û = 2 >= 1.2): τ is in units of ᾱ.
  s = SelectCompilerKv(c.g, c.pos, c.uhat, 1.0, 1.2, 5, false);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->candidates, 3);
}

TEST(CompilerKv, Eq16TopBWhenCandidatesExceedBudget) {
  SelectCase c;
  // τ = .9: I_cand = {2, 3, 4} > B' = 2 -> Top-2 by û = {2, 4}.
  auto s = SelectCompilerKv(c.g, c.pos, c.uhat, c.alpha_mean, 0.9, 4, false);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->candidates, 3);
  EXPECT_EQ(s->kept, (std::vector<int64_t>{0, 2, 4, 5}));
  // τ from the budget: the B'-th largest s (1.5), candidates exactly the Top-B'.
  s = SelectCompilerKv(c.g, c.pos, c.uhat, c.alpha_mean, -1.0, 4, false);
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->tau_from_budget);
  EXPECT_DOUBLE_EQ(s->tau, 1.5);
  EXPECT_EQ(s->candidates, 2);
  EXPECT_EQ(s->kept, (std::vector<int64_t>{0, 2, 4, 5}));
  // Budget >= n keeps everything; budget < protected is an error.
  s = SelectCompilerKv(c.g, c.pos, c.uhat, c.alpha_mean, 5.0, 6, false);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kept, Iota(6));
  s = SelectCompilerKv(c.g, c.pos, c.uhat, c.alpha_mean, -1.0, 1, true);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("protected"), std::string::npos) << s.status().message();
}

// ---- the policy ----------------------------------------------------------------------------------

TEST(CompilerKv, NeutralTablesKeepTopBByUhat) {
  const PolicyGeometry g = Geo(3, 4, 2, 8, 4, 16);
  std::mt19937 rng(7);
  auto p = Neutral();
  ASSERT_TRUE(p->Begin(g).ok());
  std::vector<Obs> obs;
  for (int l = 0; l < 3; ++l) obs.push_back(RandomObs(g, l, Iota(200), 8, &rng));
  for (const Obs& o : obs) ASSERT_TRUE(p->Observe(o.view()).ok());
  EXPECT_NE(p->Describe().find("Top-B by û"), std::string::npos) << p->Describe();
  for (int l = 0; l < 3; ++l) {
    auto s = p->Scores(l);
    ASSERT_TRUE(s.ok());
    auto want = KeepTopWithProtected(g, s->positions, s->per_head[0], 60);
    ASSERT_TRUE(want.ok());
    auto k = p->Keep(l, 60);
    ASSERT_TRUE(k.ok()) << k.status().ToString();
    ASSERT_EQ(k->per_head.size(), 2u);
    for (const auto& h : k->per_head) EXPECT_EQ(h, *want) << "layer " << l;
    EXPECT_TRUE(p->last_decision().selection.tau_from_budget);
  }
}

TEST(CompilerKv, FillHonoursBudgetExactlyAndFillZeroFollowsEq16) {
  TempDir dir;
  const PolicyGeometry g = Geo(2, 4, 2, 8, 4, 8);
  // A table whose every τ is 1.2 ᾱ: a random prompt has fewer such keys than a loose budget.
  CompilerKvTables t = CompilerKvTables::Neutral(2, 2, CompilerKvBins{});
  std::fill(t.tau.begin(), t.tau.end(), 1.2f);
  const std::string path = dir.path() + "/t.tables";
  ASSERT_TRUE(SaveCompilerKvTables(t, path).ok());
  std::mt19937 rng(3);
  const Obs o0 = RandomObs(g, 0, Iota(300), 4, &rng), o1 = RandomObs(g, 1, Iota(300), 4, &rng);
  for (int fill = 0; fill <= 1; ++fill) {
    CompilerKvOptions opt;
    opt.tables = path;
    opt.fill = fill == 1;
    auto p = MakeCompilerKvPolicy(opt);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ASSERT_TRUE((*p)->Begin(g).ok());
    ASSERT_TRUE((*p)->Observe(o0.view()).ok());
    ASSERT_TRUE((*p)->Observe(o1.view()).ok());
    auto a = (*p)->Analyze(0);
    ASSERT_TRUE(a.ok());
    auto want = SelectCompilerKv(g, a->positions, a->uhat, a->alpha_mean, 1.2, 200, fill == 1);
    ASSERT_TRUE(want.ok());
    auto k = (*p)->Keep(0, 200);
    ASSERT_TRUE(k.ok());
    const CompilerKvDecision& d = (*p)->last_decision();
    EXPECT_FLOAT_EQ(static_cast<float>(d.selection.tau), 1.2f);
    EXPECT_LT(d.selection.candidates, 200 - 12) << "test premise: candidates must not fill the budget";
    if (fill == 1) {
      EXPECT_EQ(k->per_head[0].size(), 200u);
    } else {
      EXPECT_EQ(static_cast<int64_t>(k->per_head[0].size()), d.selection.candidates + 12);
    }
    ASSERT_EQ(k->per_head[0].size(), want->kept.size());
    for (size_t i = 0; i < want->kept.size(); ++i) EXPECT_EQ(k->per_head[0][i], a->positions[want->kept[i]]);
  }
}

TEST(CompilerKv, PropertiesBudgetProtectedDeterministic) {
  const PolicyGeometry g = Geo(2, 4, 2, 8, 4, 16);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int64_t> nd(60, 400);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t n = nd(rng);
    const Obs o0 = RandomObs(g, 0, Iota(n), 4, &rng, trial % 2 == 0), o1 = RandomObs(g, 1, Iota(n), 4, &rng);
    const int64_t budget = std::uniform_int_distribution<int64_t>(20, n + 10)(rng);
    auto p = Neutral(), q = Neutral();
    for (auto* pol : {p.get(), q.get()}) {
      ASSERT_TRUE(pol->Begin(g).ok());
      ASSERT_TRUE(pol->Observe(o0.view()).ok());
      ASSERT_TRUE(pol->Observe(o1.view()).ok());
    }
    auto k = p->Keep(trial % 2, budget);
    auto k2 = q->Keep(trial % 2, budget);
    ASSERT_TRUE(k.ok() && k2.ok());
    EXPECT_EQ(k->per_head, k2->per_head);  // deterministic
    for (const auto& h : k->per_head) {
      EXPECT_EQ(static_cast<int64_t>(h.size()), std::min(budget, n));
      EXPECT_TRUE(std::is_sorted(h.begin(), h.end()));
      for (int64_t s = 0; s < 4; ++s) EXPECT_TRUE(std::binary_search(h.begin(), h.end(), s)) << "sink " << s;
      for (int64_t s = n - 16; s < n; ++s)
        EXPECT_TRUE(std::binary_search(h.begin(), h.end(), s)) << "local " << s;
    }
    // The kept layer's state now holds only kept keys.
    auto a = p->Analyze(trial % 2);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->positions, k->per_head[0]);
  }
}

TEST(CompilerKv, LongStreamStateStaysBounded) {
  const PolicyGeometry g = Geo(2, 2, 1, 4, 2, 8);
  std::mt19937 rng(5);
  auto p = Neutral();
  ASSERT_TRUE(p->Begin(g).ok());
  std::vector<std::vector<int64_t>> cached(2);
  int64_t next = 0;
  size_t at_warm = 0, peak = 0;
  constexpr int64_t kBudget = 48;
  for (int step = 0; step < 400; ++step) {
    for (int i = 0; i < 4; ++i, ++next) {
      cached[0].push_back(next);
      cached[1].push_back(next);
    }
    for (int l = 0; l < 2; ++l) {
      const Obs o = RandomObs(g, l, cached[l], 2, &rng, true);
      ASSERT_TRUE(p->Observe(o.view()).ok());
    }
    for (int l = 0; l < 2; ++l) {
      auto k = p->Keep(l, kBudget);
      ASSERT_TRUE(k.ok()) << k.status().ToString();
      cached[l] = k->per_head[0];
      ASSERT_LE(static_cast<int64_t>(cached[l].size()), kBudget);
    }
    if (step == 50) at_warm = p->state_bytes();
    peak = std::max(peak, p->state_bytes());
  }
  EXPECT_GT(at_warm, 0u);
  EXPECT_LE(peak, at_warm + 2 * 4 * (8 + 4 + 4) * 2) << "state grows with the stream";
}

TEST(CompilerKv, BadInputsGiveClearStatus) {
  const PolicyGeometry g = Geo(2, 2, 2, 2, 1, 1);
  Obs o = HandObs(0);
  auto p = Neutral();
  Status st = p->Observe(o.view());
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("before Begin"), std::string::npos) << st.message();
  EXPECT_EQ(p->Scores(0).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(p->Begin(g).ok());
  EXPECT_EQ(p->Scores(0).status().code(), StatusCode::kFailedPrecondition);  // no observation yet
  EXPECT_EQ(p->Keep(1, 2).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p->Scores(2).status().code(), StatusCode::kInvalidArgument);
  Obs nov = o;
  nov.values.clear();
  st = p->Observe(nov.view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("values"), std::string::npos) << st.message();
  ASSERT_TRUE(p->Observe(o.view()).ok());
  auto k = p->Keep(0, 1);  // 2 protected keys (sink 0, local 2)
  EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("protected"), std::string::npos) << k.status().message();
  EXPECT_EQ(p->Keep(0, -1).status().code(), StatusCode::kInvalidArgument);
  Obs bad = o;
  bad.attn[0] = 0.9f;  // row no longer sums to 1
  EXPECT_EQ(p->Observe(bad.view()).code(), StatusCode::kInvalidArgument);
}

// ---- factory ----------------------------------------------------------------------------------

TEST(CompilerKv, FactoryRoundTripWithNonDefaultParams) {
  TempDir dir;
  const std::string spec = "compilerkv:fill=0,ent_bins=10,ppl_bins=3,budget_bins=5,nll_step=0.5";
  auto p = MakeScoringPolicy(spec);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->name(), "compilerkv");
  EXPECT_EQ((*p)->ToString(),
            "compilerkv:tables=neutral,fill=0,ent_bins=10,ppl_bins=3,budget_bins=5,nll_step=0.5");
  auto p2 = MakeScoringPolicy((*p)->ToString());
  ASSERT_TRUE(p2.ok());
  EXPECT_EQ((*p2)->ToString(), (*p)->ToString());
  // With a tables file: the file's bins are spelled out and rebuild the same policy.
  CompilerKvBins b;
  b.ent_bins = 7;
  b.budget_bins = 3;
  CompilerKvTables t = CompilerKvTables::Neutral(2, 2, b);
  t.w_head = {0.5f, 1.5f, 2.0f, 0.25f};
  const std::string path = dir.path() + "/t.tables";
  ASSERT_TRUE(SaveCompilerKvTables(t, path).ok());
  auto p3 = MakeScoringPolicy("compilerkv:tables=" + path);
  ASSERT_TRUE(p3.ok()) << p3.status().ToString();
  EXPECT_EQ((*p3)->ToString(),
            "compilerkv:tables=" + path + ",fill=1,ent_bins=7,ppl_bins=4,budget_bins=3,nll_step=1");
  auto p4 = MakeScoringPolicy((*p3)->ToString());
  ASSERT_TRUE(p4.ok()) << p4.status().ToString();
  EXPECT_EQ((*p4)->ToString(), (*p3)->ToString());
  // Listed with its parameters.
  bool listed = false;
  for (const PolicyInfo& info : ListScoringPolicies())
    if (info.name == "compilerkv") {
      listed = true;
      EXPECT_EQ(info.params.size(), 6u);
      EXPECT_NE(info.summary.find("Top-B"), std::string::npos);
    }
  EXPECT_TRUE(listed);
}

TEST(CompilerKv, FactoryRejectsBadSpecs) {
  TempDir dir;
  for (const char* spec : {"compilerkv:foo=1", "compilerkv:fill=2", "compilerkv:ent_bins=0",
                           "compilerkv:nll_step=-1", "compilerkv:budget_bins=x"}) {
    auto p = MakeScoringPolicy(spec);
    ASSERT_FALSE(p.ok()) << spec;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << spec;
  }
  auto missing = MakeScoringPolicy("compilerkv:tables=" + dir.path() + "/nope.tables");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.tables"), std::string::npos);
  // A spec naming other bins than the file's.
  const std::string path = dir.path() + "/t.tables";
  ASSERT_TRUE(SaveCompilerKvTables(CompilerKvTables::Neutral(1, 1, CompilerKvBins{}), path).ok());
  auto clash = MakeScoringPolicy("compilerkv:tables=" + path + ",ent_bins=10");
  ASSERT_FALSE(clash.ok());
  EXPECT_EQ(clash.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(clash.status().message().find("compiled with ent_bins=20"), std::string::npos)
      << clash.status().message();
}

// ---- tables and traces files ----------------------------------------------------------------------

CompilerKvTables SampleTables() {
  CompilerKvBins b;
  b.ent_bins = 3;
  b.ppl_bins = 2;
  b.budget_bins = 2;
  b.nll_step = 0.75;
  CompilerKvTables t = CompilerKvTables::Neutral(2, 3, b);
  for (size_t i = 0; i < t.w_head.size(); ++i) t.w_head[i] = 0.1f * static_cast<float>(i) + 0.3f;
  for (size_t i = 0; i < t.tau.size(); ++i)
    t.tau[i] = i % 3 == 0 ? -1.0f : 0.8f + 0.01f * static_cast<float>(i);
  return t;
}

TEST(CompilerKvTables, SaveLoadRoundTrip) {
  TempDir dir;
  const CompilerKvTables t = SampleTables();
  const std::string path = dir.path() + "/x.tables";
  ASSERT_TRUE(SaveCompilerKvTables(t, path).ok());
  auto r = LoadCompilerKvTables(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(*r == t);
  EXPECT_EQ(ReadAll(path).rfind("kvtier-compilerkv-tables v1\n", 0), 0u);
}

TEST(CompilerKvTables, CorruptFilesAreCorruption) {
  TempDir dir;
  const std::string path = dir.path() + "/x.tables";
  ASSERT_TRUE(SaveCompilerKvTables(SampleTables(), path).ok());
  const std::string good = ReadAll(path);
  auto expect = [&](const std::string& content, StatusCode code, const std::string& needle) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    auto r = LoadCompilerKvTables(path);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x01;
  expect(flipped, StatusCode::kCorruption, "checksum mismatch");
  expect(good.substr(0, good.size() / 2), StatusCode::kCorruption, "checksum");
  expect("", StatusCode::kCorruption, "empty");
  // Checksum-valid but malformed bodies.
  const std::string body = good.substr(0, good.rfind("crc32c"));
  auto expect_body = [&](const std::string& b, const std::string& needle) {
    WriteChecksummed(path + ".b", b);
    auto r = LoadCompilerKvTables(path + ".b");
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  std::string v2 = body;
  v2.replace(0, std::string("kvtier-compilerkv-tables v1").size(), "kvtier-compilerkv-tables v2");
  expect_body(v2, "unsupported version");
  std::string fewer = body;
  fewer.erase(fewer.rfind("tau "));  // drop the last threshold line
  expect_body(fewer, "found end of file");
  std::string nan = body;
  nan.replace(nan.find("w 0 ") + 4, 3, "nan");
  expect_body(nan, "not a finite number");
  std::string extra = body + "w 9 1\n";
  expect_body(extra, "unexpected line");
}

// A header that promises more numbers than the file holds is refused before anything is
// allocated for them (65536 x 65536 head weights would be 16 GiB).
TEST(CompilerKvTables, AHeaderLargerThanTheFileIsRefusedBeforeAllocating) {
  std::string body =
      "kvtier-compilerkv-tables v1\nlayers 65536\nheads 65536\nent_bins 1\nppl_bins 1\nbudget_bins 1\n"
      "nll_step 1\nw 0 1\n";
  char crc[32];
  std::snprintf(crc, sizeof crc, "crc32c %08x\n", Crc32c(body.data(), body.size()));
  auto t = ParseCompilerKvTables(body + crc, "huge.tables");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kCorruption);
  EXPECT_NE(t.status().message().find("more numbers than the"), std::string::npos) << t.status().ToString();
  EXPECT_NE(t.status().message().find("huge.tables"), std::string::npos) << t.status().ToString();
}

TEST(CompilerKvTables, MismatchedGeometryIsInvalidArgumentNamingFile) {
  TempDir dir;
  const std::string path = dir.path() + "/x.tables";
  ASSERT_TRUE(SaveCompilerKvTables(SampleTables(), path).ok());  // 2 layers x 3 heads
  CompilerKvOptions o;
  o.tables = path;
  auto p = MakeCompilerKvPolicy(o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  Status st = (*p)->Begin(Geo(4, 6, 3, 8, 0, 0));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("2 layers x 3 kv heads"), std::string::npos) << st.message();
  EXPECT_EQ((*p)->Begin(Geo(2, 6, 2, 8, 0, 0)).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE((*p)->Begin(Geo(2, 6, 3, 8, 0, 0)).ok());
  EXPECT_NE((*p)->Describe().find(path), std::string::npos);
}

CompilerKvTraces SampleTraces() {
  CompilerKvTraces t;
  t.layers = 2;
  t.heads = 2;
  t.bins.ent_bins = 2;
  t.bins.ppl_bins = 1;
  t.bins.budget_bins = 1;
  t.tau_actions = {0.8, 0.9, 1.0};
  t.weight_actions = {0.5, 1.0, 2.0};
  return t;
}

CompilerKvTraceRecord Gate(int layer, int be, int bp, int action, double reward) {
  CompilerKvTraceRecord r;
  r.kind = CompilerKvTraceRecord::Kind::kGate;
  r.layer = layer;
  r.ent_bin = be;
  r.ppl_bin = bp;
  r.action = action;
  r.reward = reward;
  return r;
}

CompilerKvTraceRecord Head(int layer, int head, int action, double reward) {
  CompilerKvTraceRecord r;
  r.kind = CompilerKvTraceRecord::Kind::kHead;
  r.layer = layer;
  r.head = head;
  r.action = action;
  r.reward = reward;
  return r;
}

TEST(CompilerKvTables, TracesRoundTripAndCorruption) {
  TempDir dir;
  CompilerKvTraces t = SampleTraces();
  t.records = {Gate(0, 1, 1, 2, -0.125), Head(1, 1, 0, -0.3333333333333333), Gate(1, 0, 0, 0, 0.0625)};
  const std::string path = dir.path() + "/x.traces";
  ASSERT_TRUE(SaveCompilerKvTraces(t, path).ok());
  auto r = LoadCompilerKvTraces(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(*r == t);
  std::string content = ReadAll(path);
  content[content.find("head 1 1")] = 'x';
  std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
  auto bad = LoadCompilerKvTraces(path);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  // A record index out of range, with a valid checksum.
  ASSERT_TRUE(SaveCompilerKvTraces(t, path).ok());
  std::string body = ReadAll(path);
  body = body.substr(0, body.rfind("crc32c"));
  body.replace(body.find("gate 0 1 1 0 2"), 14, "gate 0 1 1 0 7");
  WriteChecksummed(path, body);
  bad = LoadCompilerKvTraces(path);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("action 7 is outside"), std::string::npos) << bad.status().message();
}

// ---- recorder and compiler -------------------------------------------------------------------------

TEST(CompilerKvFit, RecorderRewardIsOutputErrorPlusBudgetPenalty) {
  // 1 layer, 1 head, D = 1, values [1 2 10], attention [.5 .3 .2], budget 2, nothing protected.
  // ρ = [3 6 30]/13, û = α ρ = [1.5 1.8 6]/13, ᾱ = 1/3, û/ᾱ = [.346 .415 1.385]; o = 3.1.
  const PolicyGeometry g = Geo(1, 1, 1, 1, 0, 0);
  Obs o;
  o.kpos = {0, 1, 2};
  o.qpos = {2};
  o.attn = {.5f, .3f, .2f};
  o.values = {1, 2, 10};
  CompilerKvRecordOptions ro;
  ro.bins.budget_bins = 2;
  ro.tau_actions = {0.4, 1.0, 2.0};
  ro.weight_actions = {0.5, 1.0};
  ro.beta = 1.0;
  CompilerKvTraces tr;
  ASSERT_TRUE(RecordCompilerKvTraces(g, {o.view()}, 2, ro, &tr).ok());
  ASSERT_EQ(tr.records.size(), 3u + 2u);
  const double keep12 = std::fabs((0.3 * 2 + 0.2 * 10) / 0.5 - 3.1) / 3.1;  // S = {1, 2}
  const double keep2 = std::fabs(10 - 3.1) / 3.1;                           // S = {2}
  // τ = .4: I_cand = {1, 2}, Ψ = 0.  τ = 1: {2}, Ψ = -1.  τ = 2: {}, error 1, Ψ = -2.  λ = β/T = 1/3.
  EXPECT_NEAR(tr.records[0].reward, -keep12, 1e-6);
  EXPECT_NEAR(tr.records[1].reward, -keep2 + 1.0 / 3, 1e-6);
  EXPECT_NEAR(tr.records[2].reward, -1.0 + 2.0 / 3, 1e-6);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(tr.records[i].kind, CompilerKvTraceRecord::Kind::kGate);
    EXPECT_EQ(tr.records[i].action, i);
    EXPECT_EQ(tr.records[i].budget_bin, 0);  // T/B = 1.5
    EXPECT_EQ(tr.records[i].ppl_bin, ro.bins.ppl_bins);
  }
  // Head actions: Top-B by û (λ = 0), the same for any positive weight of a single head.
  EXPECT_EQ(tr.records[3].kind, CompilerKvTraceRecord::Kind::kHead);
  EXPECT_NEAR(tr.records[3].reward, -keep12, 1e-6);
  EXPECT_NEAR(tr.records[4].reward, -keep12, 1e-6);
  // A second recording must match the header.
  CompilerKvRecordOptions other = ro;
  other.tau_actions = {0.9};
  EXPECT_EQ(RecordCompilerKvTraces(g, {o.view()}, 2, other, &tr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RecordCompilerKvTraces(g, {}, 2, ro, &tr).code(), StatusCode::kInvalidArgument);
}

TEST(CompilerKvFit, RecorderStatesMatchThePolicy) {
  const PolicyGeometry g = Geo(2, 4, 2, 8, 2, 4);
  std::mt19937 rng(19);
  const Obs o0 = RandomObs(g, 0, Iota(64), 4, &rng, true);
  Obs o1 = RandomObs(g, 1, Iota(64), 4, &rng);
  o1.logprobs = o0.logprobs;  // the same window's tokens
  CompilerKvRecordOptions ro;
  CompilerKvTraces tr;
  ASSERT_TRUE(RecordCompilerKvTraces(g, {o1.view(), o0.view()}, 16, ro, &tr).ok());
  EXPECT_EQ(tr.records.size(), 2 * (ro.tau_actions.size() + 2 * ro.weight_actions.size()));
  auto p = Neutral();
  ASSERT_TRUE(p->Begin(g).ok());
  ASSERT_TRUE(p->Observe(o0.view()).ok());
  ASSERT_TRUE(p->Observe(o1.view()).ok());
  for (const CompilerKvTraceRecord& r : tr.records) {
    auto a = p->Analyze(r.layer);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(r.budget_bin, ro.bins.BudgetBin(16, 64));
    if (r.kind == CompilerKvTraceRecord::Kind::kGate) {
      EXPECT_EQ(r.ent_bin, a->ent_bin);
      EXPECT_EQ(r.ppl_bin, a->ppl_bin);
      EXPECT_LT(a->ppl_bin, ro.bins.ppl_bins);  // log-probs were given
    } else {
      EXPECT_LE(r.reward, 0.0);
    }
  }
  // Fitting these traces gives tables the policy loads for this geometry.
  auto fit = FitCompilerKvTables(tr, CompilerKvFitOptions{});
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  EXPECT_EQ(fit->gate_states_fitted, 2);  // one risk state per layer
  EXPECT_EQ(fit->head_states_fitted, 4);
  CompilerKvPolicy fitted(CompilerKvOptions{}, std::make_shared<const CompilerKvTables>(fit->tables));
  EXPECT_TRUE(fitted.Begin(g).ok());
}

TEST(CompilerKvFit, PicksTheBestActionPerState) {
  CompilerKvTraces t = SampleTraces();
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> noise(-0.02, 0.02);
  const double gate_mean[2][3] = {{-0.3, -0.1, -0.2}, {-0.5, -0.4, -0.05}};
  const double head_mean[3] = {-0.2, -0.15, -0.1};
  for (int rep = 0; rep < 10; ++rep) {
    for (int a = 0; a < 3; ++a) {
      t.records.push_back(Gate(0, 1, 1, a, gate_mean[0][a] + noise(rng)));
      t.records.push_back(Gate(1, 0, 0, a, gate_mean[1][a] + noise(rng)));
      t.records.push_back(Head(0, 1, a, head_mean[a] + noise(rng)));
      t.records.push_back(Head(1, 0, 2 - a, head_mean[a] + noise(rng)));
    }
  }
  auto fit = FitCompilerKvTables(t, CompilerKvFitOptions{});
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  const CompilerKvTables& tb = fit->tables;
  EXPECT_FLOAT_EQ(tb.tau[tb.tau_index(0, 1, 1, 0)], 0.9f);
  EXPECT_FLOAT_EQ(tb.tau[tb.tau_index(1, 0, 0, 0)], 1.0f);
  EXPECT_FLOAT_EQ(tb.tau[tb.tau_index(0, 0, 0, 0)], -1.0f);  // unseen: from the budget
  EXPECT_FLOAT_EQ(tb.weight(0, 1), 2.0f);                    // Eq. 9
  EXPECT_FLOAT_EQ(tb.weight(1, 0), 0.5f);
  EXPECT_FLOAT_EQ(tb.weight(0, 0), 1.0f);  // no records
  EXPECT_EQ(fit->gate_states_fitted, 2);
}

// The fitted Q is the stationary point of Eq. 4 and the reported objective is Eq. 4.
TEST(CompilerKvFit, SolvesEq4) {
  CompilerKvTraces t = SampleTraces();
  const std::vector<std::pair<int, double>> recs = {{0, -0.3}, {0, -0.25}, {1, -0.1}, {2, -0.4}, {1, -0.12}};
  for (const auto& [a, r] : recs) t.records.push_back(Gate(0, 0, 0, a, r));
  CompilerKvFitOptions o;
  o.alpha_cql = 0.7;
  o.steps = 4000;
  auto fit = FitCompilerKvTables(t, o);
  ASSERT_TRUE(fit.ok());
  const double* q = fit->q_gate.data() + fit->gate_state(0, 0, 0, 0) * 3;
  const double n = 5.0, c[3] = {2, 2, 1}, rsum[3] = {-0.55, -0.22, -0.4};
  const double lse = std::log(std::exp(q[0]) + std::exp(q[1]) + std::exp(q[2]));
  for (int a = 0; a < 3; ++a) {
    // d/dQ_a [α(lse − (1/n)Σ_i Q_{a_i}) + (1/2n)Σ_i (Q_{a_i} − r_i)²] = 0.
    const double grad = o.alpha_cql * (std::exp(q[a] - lse) - c[a] / n) + (c[a] * q[a] - rsum[a]) / n;
    EXPECT_NEAR(grad, 0.0, 1e-9) << "action " << a;
  }
  double eq4 = 0.0;
  for (const auto& [a, r] : recs) eq4 += o.alpha_cql * (lse - q[a]) + 0.5 * (q[a] - r) * (q[a] - r);
  EXPECT_NEAR(fit->objective, eq4 / recs.size(), 1e-9);
}

TEST(CompilerKvFit, ConservativeTermPullsUnseenActionsDown) {
  CompilerKvTraces t = SampleTraces();
  for (int rep = 0; rep < 5; ++rep) {
    t.records.push_back(Gate(0, 0, 0, 0, -0.2));
    t.records.push_back(Gate(0, 0, 0, 1, -0.1));  // action 2 (τ = 1.0) never tried
  }
  CompilerKvFitOptions plain;
  plain.alpha_cql = 0.0;
  auto f0 = FitCompilerKvTables(t, plain);
  ASSERT_TRUE(f0.ok());
  const size_t s = f0->gate_state(0, 0, 0, 0);
  // Without the regulariser the unseen action keeps its initial 0 > every seen reward and wins.
  EXPECT_DOUBLE_EQ(f0->q_gate[s * 3 + 2], 0.0);
  EXPECT_FLOAT_EQ(f0->tables.tau[s], 1.0f);
  CompilerKvFitOptions cql;
  cql.alpha_cql = 1.0;
  auto f1 = FitCompilerKvTables(t, cql);
  ASSERT_TRUE(f1.ok());
  EXPECT_LT(f1->q_gate[s * 3 + 2], f1->q_gate[s * 3 + 1]);
  EXPECT_LT(f1->q_gate[s * 3 + 2], -0.5);
  EXPECT_FLOAT_EQ(f1->tables.tau[s], 0.9f);  // the best seen action
  // More steps push it further down (its gradient α·softmax never vanishes).
  cql.steps = 2000;
  auto f2 = FitCompilerKvTables(t, cql);
  ASSERT_TRUE(f2.ok());
  EXPECT_LT(f2->q_gate[s * 3 + 2], f1->q_gate[s * 3 + 2]);
}

TEST(CompilerKvFit, BadInputs) {
  CompilerKvTraces t = SampleTraces();
  EXPECT_EQ(FitCompilerKvTables(t, CompilerKvFitOptions{}).status().code(), StatusCode::kInvalidArgument);
  t.records.push_back(Gate(0, 0, 0, 0, -0.1));
  CompilerKvFitOptions o;
  o.lr = 0;
  EXPECT_EQ(FitCompilerKvTables(t, o).status().code(), StatusCode::kInvalidArgument);
  t.records.push_back(Gate(0, 0, 0, 5, -0.1));  // action out of range
  EXPECT_EQ(FitCompilerKvTables(t, CompilerKvFitOptions{}).status().code(), StatusCode::kInvalidArgument);
  CompilerKvRecordOptions ro;
  ro.tau_actions = {-0.5};
  EXPECT_EQ(ro.Validate().code(), StatusCode::kInvalidArgument);
}

// `kvtier compile-tables` end to end.
TEST(CompilerKvFit, CliRecordsSyntheticTracesAndCompilesTables) {
  TempDir dir;
  auto kvtier = [](const std::string& args, std::string* out) {
    const std::string cmd = std::string(KVTIER_BINARY_DIR) + "/kvtier compile-tables " + args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) return -1;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  const std::string traces = dir.path() + "/s.traces", tables = dir.path() + "/s.tables";
  std::string out;
  const int rc = kvtier(
      "--record-synthetic 2 --context 512 --window 16 --budget 64,128 --geometry 2,4,2,32 "
      "--local 16 --quiet --out-traces " +
          traces + " --out " + tables,
      &out);
  ASSERT_EQ(rc, 0) << out;
  auto tr = LoadCompilerKvTraces(traces);
  ASSERT_TRUE(tr.ok()) << tr.status().ToString();
  // 2 sequences x 2 budgets x 2 layers x (5 τ actions + 2 heads x 5 weights).
  EXPECT_EQ(tr->records.size(), 2u * 2 * 2 * (5 + 2 * 5));
  auto p = MakeScoringPolicy("compilerkv:tables=" + tables);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE((*p)->Begin(Geo(2, 4, 2, 32, 4, 16)).ok());
  // Compiling the same traces again gives the same bytes.
  out.clear();
  ASSERT_EQ(kvtier("--traces " + traces + " --out " + tables + ".2", &out), 0) << out;
  EXPECT_EQ(ReadAll(tables), ReadAll(tables + ".2"));
  out.clear();
  EXPECT_EQ(kvtier("--traces " + traces, &out), 2) << out;
  EXPECT_NE(out.find("--out"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvtier
