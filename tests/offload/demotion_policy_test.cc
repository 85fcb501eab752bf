#include "offload/demotion_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <list>
#include <random>

#include "offload/policy/scoring_policy.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

TEST(LruDemotion, SameVictimsAsAListKeptMostRecentFirst) {
  // Random inserts, accesses, removals and victim picks (with a random refusal set) against
  // the reference: a std::list, most recent first. Enough ids for the table to grow many times
  // and removals that exercise the backward shift of its probe runs.
  LruPolicy p;
  std::list<uint64_t> ref;
  auto find = [&](uint64_t id) { return std::find(ref.begin(), ref.end(), id); };
  std::mt19937_64 rng(7);
  for (int op = 0; op < 60000; ++op) {
    // Ids from a range near the size, so hits, misses and re-inserts all happen; spaced by
    // 1024 so Fibonacci hashing sees more than consecutive integers.
    const uint64_t id = (rng() % 3000) * 1024 + 5;
    switch (rng() % 4) {
      case 0:
        p.OnInsert(id);
        if (auto it = find(id); it != ref.end()) ref.erase(it);
        ref.push_front(id);
        break;
      case 1:
        p.OnAccess(id);
        if (auto it = find(id); it != ref.end()) ref.splice(ref.begin(), ref, it);
        break;
      case 2:
        p.OnRemove(id);
        if (auto it = find(id); it != ref.end()) ref.erase(it);
        break;
      default: {
        const uint64_t refuse = rng() % 7;  // ids with id % 7 == refuse may not leave
        auto can_leave = [&](uint64_t x) { return x % 7 != refuse; };
        uint64_t want = 0;
        bool any = false;
        for (auto it = ref.rbegin(); it != ref.rend(); ++it)
          if (can_leave(*it)) {
            want = *it;
            any = true;
            break;
          }
        uint64_t got = 0;
        ASSERT_EQ(p.PickVictim(can_leave, &got), any) << "op " << op;
        if (any) ASSERT_EQ(got, want) << "op " << op;
      }
    }
    ASSERT_EQ(p.size(), ref.size()) << "op " << op;
  }
  // Drained through PickVictim + OnRemove, as EvictHot does: least recent first.
  uint64_t v = 0;
  while (p.PickVictim([](uint64_t) { return true; }, &v)) {
    ASSERT_FALSE(ref.empty());
    ASSERT_EQ(v, ref.back());
    ref.pop_back();
    p.OnRemove(v);
  }
  EXPECT_TRUE(ref.empty());
  EXPECT_EQ(p.size(), 0u);
}

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
