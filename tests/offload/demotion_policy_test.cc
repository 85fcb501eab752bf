#include "offload/demotion_policy.h"

#include <gtest/gtest.h>

#include <cmath>

#include "offload/policy/scoring_policy.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

TEST(ScoredDemotion, LowestScoreLeavesFirstTiesByInsertion) {
  ScoredDemotionPolicy p("h2o");
  for (uint64_t id : {10, 11, 12, 13}) p.OnInsert(id);
  auto any = [](uint64_t) { return true; };
  uint64_t v = 0;
  ASSERT_TRUE(p.PickVictim(any, &v));
  EXPECT_EQ(v, 10u);  // all unscored (0): the first inserted
  p.OnScore(10, 5.0f);
  p.OnScore(11, 2.0f);
  p.OnScore(12, -1.0f);
  p.OnScore(13, 2.0f);
  ASSERT_TRUE(p.PickVictim(any, &v));
  EXPECT_EQ(v, 12u);
  ASSERT_TRUE(p.PickVictim([](uint64_t id) { return id != 12; }, &v));
  EXPECT_EQ(v, 11u);  // 11 and 13 tie at 2: 11 was inserted first
  p.OnRemove(11);
  p.OnRemove(12);
  ASSERT_TRUE(p.PickVictim(any, &v));
  EXPECT_EQ(v, 13u);
  p.OnScore(99, 1.0f);  // unknown: ignored
  EXPECT_EQ(p.size(), 2u);
  EXPECT_FALSE(p.PickVictim([](uint64_t) { return false; }, &v));
}

TEST(ScoredDemotion, FactoryAcceptsScoringPoliciesOnly) {
  auto lru = MakeDemotionPolicy("lru");
  ASSERT_TRUE(lru.ok());
  EXPECT_EQ((*lru)->ToString(), "lru");
  for (const PolicyInfo& info : ListScoringPolicies()) {
    auto p = MakeDemotionPolicy(info.name);
    ASSERT_TRUE(p.ok()) << info.name << ": " << p.status().ToString();
    EXPECT_EQ((*p)->ToString().rfind(info.name, 0), 0u) << (*p)->ToString();
  }
  auto bad = MakeDemotionPolicy("bogus");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bogus"), std::string::npos);
}

TEST(ScoredDemotion, WarmTierDemotesTheLowestScoredChunk) {
  TempDir dir;
  StoreOptions o;
  o.geometry = Geometry{1, 2, 1, 8, DType::kF32};
  o.n_sink = 4;
  o.n_local = 8;
  o.chunk_size = 4;
  o.repr_topk = 1;
  o.warm_bytes = 6 * o.chunk_bytes();
  o.hot_bytes = 4 * o.chunk_bytes();
  o.warm_policy = "h2o";  // any scoring policy: demotion follows SetChunkScores
  o.data_dir = dir.path();
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* s = store->get();
  SequenceId seq = *s->CreateSequence();
  std::vector<float> k(8, 1.0f), v(8, 1.0f);
  auto append = [&](int n) {
    for (int i = 0; i < n; ++i) ASSERT_TRUE(s->Append(seq, 0, k.data(), v.data(), 1, DType::kF32).ok());
  };
  append(4 + 8 + 4 + 6 * 4);  // 6 chunks sealed: the warm tier is full
  ASSERT_TRUE(s->WaitForDurable().ok());
  ASSERT_EQ(*s->ChunkCount(seq, 0), 6u);
  ASSERT_TRUE(
      s->SetChunkScores(seq, 0, {{0, 9.0f}, {1, 8.0f}, {2, 0.5f}, {3, 7.0f}, {4, 6.0f}, {5, 5.0f}}).ok());
  append(4);  // a 7th chunk needs a warm slot: chunk 2 (lowest score) leaves, not chunk 0 (oldest)
  ASSERT_TRUE(s->WaitForDurable().ok());
  auto chunks = s->ListChunks(seq, 0);
  ASSERT_TRUE(chunks.ok());
  for (const ChunkInfo& c : *chunks) {
    const bool warm = (c.tiers & kTierWarm) != 0;
    EXPECT_EQ(warm, c.key.index != 2) << "chunk " << c.key.index;
  }
  EXPECT_EQ(s->SetChunkScores(seq, 0, {{99, 1.0f}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->SetChunkScores(seq, 0, {{0, std::nanf("")}}).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
