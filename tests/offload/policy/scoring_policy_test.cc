// Tests of offload/policy/scoring_policy.h: the helpers every policy shares (protected keys, top-k
// with ties, keep sets, chunk aggregation, position remapping, observation validation) and the
// factory registry (MakeScoringPolicy / ListScoringPolicies), generically over every listed policy.
#include "offload/policy/scoring_policy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace kvtier {
namespace {

PolicyGeometry Geo(int64_t sinks, int64_t local) {
  PolicyGeometry g;
  g.layers = 2;
  g.q_heads = 2;
  g.kv_heads = 1;
  g.head_dim = 4;
  g.sink_tokens = sinks;
  g.local_tokens = local;
  return g;
}

// ---- ProtectedIndexes / TopIndexes / KeepTopWithProtected ---------------------------------------

TEST(ScoringPolicyHelpers, ProtectedIndexesAreSinksByPositionAndTheLastLocalKeys) {
  // Sinks are positions < 3 (0 and 2 are cached, 1 was dropped); the local window is the last 2 keys.
  const std::vector<int64_t> pos = {0, 2, 5, 9, 11, 12};
  EXPECT_EQ(ProtectedIndexes(Geo(3, 2), pos), (std::vector<int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(ProtectedIndexes(Geo(0, 0), pos), (std::vector<int64_t>{}));
  // Overlapping sinks and window are counted once.
  EXPECT_EQ(ProtectedIndexes(Geo(4, 10), {0, 1, 2}), (std::vector<int64_t>{0, 1, 2}));
}

TEST(ScoringPolicyHelpers, TopIndexesOrdersByScoreThenLaterIndex) {
  const std::vector<float> s = {0.5f, 0.9f, 0.5f, 0.1f, 0.5f};
  // 0.9 first, then the three 0.5s from the latest index down.
  EXPECT_EQ(TopIndexes(s, {0, 1, 2, 3, 4}, 3), (std::vector<int64_t>{1, 4, 2}));
  EXPECT_EQ(TopIndexes(s, {0, 2, 3}, 10), (std::vector<int64_t>{2, 0, 3}));  // k clamped
  EXPECT_EQ(TopIndexes(s, {0, 1}, -1), (std::vector<int64_t>{}));
}

TEST(ScoringPolicyHelpers, KeepTopWithProtectedKeepsProtectedThenTopScoresTiesToLater) {
  // sinks: position 0; local window: the last key (position 20). Their low scores do not matter.
  const std::vector<int64_t> pos = {0, 4, 8, 12, 16, 20};
  const std::vector<float> s = {0.0f, 0.7f, 0.3f, 0.7f, 0.3f, 0.0f};
  auto r = KeepTopWithProtected(Geo(1, 1), pos, s, 4);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (std::vector<int64_t>{0, 4, 12, 20}));
  // One slot left among 4, 8, 12, 16: the 0.7 tie goes to the later position 12.
  r = KeepTopWithProtected(Geo(1, 1), pos, s, 3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (std::vector<int64_t>{0, 12, 20}));
  // Among the 0.3s the later (16) wins as well.
  r = KeepTopWithProtected(Geo(1, 1), pos, s, 5);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (std::vector<int64_t>{0, 4, 12, 16, 20}));
  // Budget >= keys keeps everything.
  r = KeepTopWithProtected(Geo(1, 1), pos, s, 6);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, pos);
  // Budget exactly the protected count.
  r = KeepTopWithProtected(Geo(1, 1), pos, s, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (std::vector<int64_t>{0, 20}));
}

TEST(ScoringPolicyHelpers, KeepTopWithProtectedRejectsSmallBudgetAndMismatchedSizes) {
  const std::vector<int64_t> pos = {0, 1, 2, 3, 4, 5};
  const std::vector<float> s(6, 1.0f);
  auto r = KeepTopWithProtected(Geo(2, 2), pos, s, 3);  // 4 protected
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("protected"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("budget 3"), std::string::npos) << r.status().message();
  r = KeepTopWithProtected(Geo(0, 0), pos, s, -1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  r = KeepTopWithProtected(Geo(0, 0), pos, std::vector<float>(5, 1.0f), 3);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

// ---- KeepSet / AggregateToChunks / RemapByPosition ------------------------------------------------

TEST(ScoringPolicyHelpers, KeepSetUnionIsSortedAndDeduplicated) {
  KeepSet ks;
  EXPECT_TRUE(ks.Union().empty());
  ks.per_head = {{1, 5, 9}, {0, 5, 7}, {}, {9, 12}};
  EXPECT_EQ(ks.Union(), (std::vector<int64_t>{0, 1, 5, 7, 9, 12}));
}

TEST(ScoringPolicyHelpers, AggregateToChunksSumsHeadsAndTokensPerChunk) {
  TokenScores s;
  s.positions = {0, 3, 4, 9, 10, 11};
  s.per_head = {{1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f}, {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f}};
  // chunk_tokens 4: chunk 0 = {0, 3}: 1 + 2 + 0.5 + 0.5 = 4; chunk 1 = {4}: 3.5;
  // chunk 2 = {9, 10, 11}: 4 + 5 + 6 + 1.5 = 16.5.
  auto c = AggregateToChunks(s, 0, 4, kAnyChunkCount);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].first, 0);
  EXPECT_FLOAT_EQ(c[0].second, 4.0f);
  EXPECT_EQ(c[1].first, 1);
  EXPECT_FLOAT_EQ(c[1].second, 3.5f);
  EXPECT_EQ(c[2].first, 2);
  EXPECT_FLOAT_EQ(c[2].second, 16.5f);
  // chunk_tokens 5: chunk 0 = {0, 3, 4}: 1 + 2 + 3 + 1.5 = 7.5; chunk 1 = {9}: 4.5;
  // chunk 2 = {10, 11}: 5.5 + 6.5 = 12.
  c = AggregateToChunks(s, 0, 5, kAnyChunkCount);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_FLOAT_EQ(c[0].second, 7.5f);
  EXPECT_FLOAT_EQ(c[1].second, 4.5f);
  EXPECT_FLOAT_EQ(c[2].second, 12.0f);
  // A chunk without any scored key is absent: with chunk_tokens 2, positions 0 -> 0, 3 -> 1, 4 -> 2,
  // 9 -> 4, 10 and 11 -> 5, so chunk 3 (positions 6, 7) is not listed.
  c = AggregateToChunks(s, 0, 2, kAnyChunkCount);
  std::vector<int64_t> ids;
  for (const auto& [id, v] : c) ids.push_back(id);
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 1, 2, 4, 5}));
  EXPECT_TRUE(AggregateToChunks(s, 0, 0, kAnyChunkCount).empty());
  EXPECT_TRUE(AggregateToChunks(TokenScores{}, 0, 4, kAnyChunkCount).empty());
}

// The store's chunks start after the sinks (chunk i = [n_sink + i*chunk, ...)) and end where the
// local window begins; sinks and the local window are never chunks.
TEST(ScoringPolicyHelpers, AggregateToChunksCutsChunksAfterTheSinksAsTheStoreDoes) {
  TokenScores s;
  // n_sink 3, chunk 4, 2 sealed chunks: sinks 0..2, chunk 0 = 3..6, chunk 1 = 7..10, local 11...
  s.positions = {0, 1, 2, 3, 6, 7, 10, 11, 12};
  s.per_head = {{100, 100, 100, 1, 2, 3, 4, 50, 50}, {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f}};
  auto c = AggregateToChunks(s, 3, 4, 2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].first, 0);
  EXPECT_FLOAT_EQ(c[0].second, 1 + 2 + 1.0f);  // positions 3 and 6
  EXPECT_EQ(c[1].first, 1);
  EXPECT_FLOAT_EQ(c[1].second, 3 + 4 + 1.0f);  // positions 7 and 10
  // Without the sink offset position 3 would have landed in chunk 0 with the sinks, and
  // positions 4..7 in chunk 1: the chunk boundaries must be the store's.
  for (const auto& [id, v] : c) EXPECT_LT(v, 100.0f) << "a sink's score leaked into chunk " << id;
  // Only sinks and local window scored: no chunk at all.
  TokenScores edges;
  edges.positions = {0, 1, 2, 11, 12};
  edges.per_head = {{1, 1, 1, 1, 1}};
  EXPECT_TRUE(AggregateToChunks(edges, 3, 4, 2).empty());
  // With every position past the sinks in a chunk, position 11 is chunk 2.
  c = AggregateToChunks(edges, 3, 4, kAnyChunkCount);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].first, 2);
  EXPECT_FLOAT_EQ(c[0].second, 2.0f);
}

TEST(ScoringPolicyHelpers, RemapByPositionCarriesFillsAndDrops) {
  const std::vector<int64_t> old_pos = {1, 3, 5, 7};
  const std::vector<float> old_v = {10.0f, 30.0f, 50.0f, 70.0f};
  // 3 and 7 carried, 1 and 5 dropped, 0 / 4 / 8 new.
  EXPECT_EQ(RemapByPosition(old_pos, old_v, {0, 3, 4, 7, 8}, -1.0f),
            (std::vector<float>{-1.0f, 30.0f, -1.0f, 70.0f, -1.0f}));
  EXPECT_EQ(RemapByPosition({}, {}, {2, 4}, 0.5f), (std::vector<float>{0.5f, 0.5f}));
  EXPECT_TRUE(RemapByPosition(old_pos, old_v, {}, 0.0f).empty());
}

// ---- validation -----------------------------------------------------------------------------------

TEST(ScoringPolicyHelpers, PolicyGeometryValidate) {
  EXPECT_TRUE(Geo(4, 32).Validate().ok());
  PolicyGeometry g = Geo(4, 32);
  g.layers = 0;
  EXPECT_EQ(g.Validate().code(), StatusCode::kInvalidArgument);
  g = Geo(4, 32);
  g.q_heads = 3;
  g.kv_heads = 2;
  EXPECT_EQ(g.Validate().code(), StatusCode::kInvalidArgument);
  g = Geo(4, 32);
  g.kv_heads = 0;
  EXPECT_EQ(g.Validate().code(), StatusCode::kInvalidArgument);
  g = Geo(4, 32);
  g.head_dim = 0;
  EXPECT_EQ(g.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Geo(-1, 32).Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Geo(4, -1).Validate().code(), StatusCode::kInvalidArgument);
}

// A valid observation for Geo(): 2 q heads, 2 queries at 2 and 3 over keys 0..3.
struct ValidObs {
  std::vector<int64_t> keys = {0, 1, 2, 3};
  std::vector<int64_t> queries = {2, 3};
  std::vector<float> att = {0.5f, 0.25f, 0.25f, 0.0f, 0.25f,  0.25f,  0.25f, 0.25f,  // head 0
                            1.0f, 0.0f,  0.0f,  0.0f, 0.125f, 0.125f, 0.25f, 0.5f};  // head 1
  std::vector<float> logp = {-1.0f, -0.5f};
  AttentionObservation View() const {
    AttentionObservation o;
    o.layer = 1;
    o.n_queries = 2;
    o.n_keys = 4;
    o.key_positions = keys.data();
    o.query_positions = queries.data();
    o.attention = att.data();
    o.token_logprobs = logp.data();
    return o;
  }
};

TEST(ScoringPolicyHelpers, AttentionObservationValidateAcceptsAValidOne) {
  ValidObs v;
  EXPECT_TRUE(v.View().Validate(Geo(1, 1)).ok()) << v.View().Validate(Geo(1, 1)).ToString();
  EXPECT_FLOAT_EQ(v.View().at(1, 1, 3), 0.5f);
}

TEST(ScoringPolicyHelpers, AttentionObservationValidateRejectsEachBadInput) {
  const PolicyGeometry g = Geo(1, 1);
  auto expect_bad = [&](const AttentionObservation& o, const std::string& what, const std::string& needle) {
    const Status st = o.Validate(g);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.ToString();
    EXPECT_NE(st.message().find(needle), std::string::npos) << what << ": " << st.message();
  };
  {
    ValidObs v;
    auto o = v.View();
    o.layer = 2;
    expect_bad(o, "layer past the end", "layer out of range");
    o.layer = -1;
    expect_bad(o, "negative layer", "layer out of range");
  }
  {
    ValidObs v;
    auto o = v.View();
    o.n_queries = 0;
    expect_bad(o, "no queries", "n_queries");
  }
  {
    ValidObs v;
    auto o = v.View();
    o.n_keys = 0;
    expect_bad(o, "no keys", "n_keys");
  }
  {
    ValidObs v;
    auto o = v.View();
    o.attention = nullptr;
    expect_bad(o, "no attention", "required");
    o = v.View();
    o.key_positions = nullptr;
    expect_bad(o, "no key positions", "required");
    o = v.View();
    o.query_positions = nullptr;
    expect_bad(o, "no query positions", "required");
  }
  {
    ValidObs v;
    v.keys = {-1, 1, 2, 3};
    expect_bad(v.View(), "negative key position", "negative key position");
  }
  {
    ValidObs v;
    v.keys = {0, 2, 2, 3};
    expect_bad(v.View(), "repeated key position", "key positions not strictly increasing");
  }
  {
    ValidObs v;
    v.queries = {3, 2};
    expect_bad(v.View(), "decreasing queries", "query positions not strictly increasing");
  }
  {
    ValidObs v;
    v.att[1] = std::numeric_limits<float>::quiet_NaN();
    expect_bad(v.View(), "NaN attention", "not a finite probability");
  }
  {
    ValidObs v;
    v.att[1] = -0.25f;
    v.att[2] = 0.75f;
    expect_bad(v.View(), "negative attention", "not a finite probability");
  }
  {
    ValidObs v;
    v.att[12] = 0.5f;  // head 1, query 1 sums to 1.375
    expect_bad(v.View(), "row not summing to 1", "sums to");
  }
  {
    ValidObs v;
    v.logp[1] = 0.5f;
    expect_bad(v.View(), "positive log-probability", "token_logprobs[1]");
    v.logp[1] = -std::numeric_limits<float>::infinity();
    expect_bad(v.View(), "infinite log-probability", "token_logprobs[1]");
  }
}

// ---- registry --------------------------------------------------------------------------------------

TEST(PolicyRegistry, UnknownNameKeyAndBadValueAreInvalidArgumentNamingThem) {
  auto r = MakeScoringPolicy("nosuchpolicy");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("nosuchpolicy"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("hitkv"), std::string::npos)
      << "lists the known names: " << r.status().message();

  r = MakeScoringPolicy("snapkv:kernal=7");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kernal"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("kernel"), std::string::npos)
      << "lists the known keys: " << r.status().message();

  r = MakeScoringPolicy("lru:k=1");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'k'"), std::string::npos) << r.status().message();

  r = MakeScoringPolicy("hitkv:theta=abc");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("abc"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("theta"), std::string::npos) << r.status().message();

  r = MakeScoringPolicy("snapkv:kernel=4");  // parses, but out of range
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'4'"), std::string::npos) << r.status().message();

  for (const char* bad : {"", ":k=1", "hitkv:", "hitkv:k", "hitkv:k=1,k=2"}) {
    r = MakeScoringPolicy(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(PolicyRegistry, ListsTheClassicPoliciesAndHitKvFirstInOrder) {
  const auto infos = ListScoringPolicies();
  ASSERT_GE(infos.size(), 5u);
  const std::vector<std::string> want = {"lru", "streaming", "h2o", "snapkv", "hitkv"};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(infos[i].name, want[i]);
}

// Generic over every registered policy (including those added later): names are unique, the info is
// filled in, and name -> ToString -> Make -> ToString is a fixed point.
TEST(PolicyRegistry, EveryPolicyRoundTripsThroughItsFactoryString) {
  std::set<std::string> names;
  for (const PolicyInfo& info : ListScoringPolicies()) {
    SCOPED_TRACE(info.name);
    EXPECT_TRUE(names.insert(info.name).second) << "duplicate name";
    EXPECT_FALSE(info.summary.empty());
    EXPECT_FALSE(info.source.empty());
    for (const auto& p : info.params) {
      EXPECT_FALSE(p.key.empty());
      EXPECT_FALSE(p.meaning.empty()) << p.key;
    }
    auto first = MakeScoringPolicy(info.name);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    EXPECT_EQ((*first)->name(), info.name);
    const std::string s1 = (*first)->ToString();
    EXPECT_EQ(s1.rfind(info.name, 0), 0u) << s1;
    auto second = MakeScoringPolicy(s1);
    ASSERT_TRUE(second.ok()) << s1 << ": " << second.status().ToString();
    EXPECT_EQ((*second)->ToString(), s1);
    EXPECT_EQ((*second)->name(), info.name);
  }
}

}  // namespace
}  // namespace kvtier
