// The offload stress job (integration/stress_job.h) in process, and the concurrency it
// exists for: many sequences on many threads into tiny tiers, score-driven demotion whose
// scores change while the same chunks are being written through to the cold tier.
// Part of the ThreadSanitizer job (make test-tsan), where a data race fails the test.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "integration/pattern.h"
#include "integration/stress_job.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

StressOptions TinyStress(const std::string& dir) {
  StressOptions o;
  o.store.geometry = Geometry{2, 4, 2, 32, DType::kF16};
  o.store.n_sink = 16;
  o.store.n_local = 64;
  o.store.chunk_size = 16;
  o.store.warm_bytes = 24 * o.store.chunk_bytes();
  o.store.hot_bytes = 32 * o.store.chunk_bytes();
  o.store.data_dir = dir;
  o.sequences = 6;
  o.threads = 3;
  o.tokens = 700;
  o.max_block = 37;
  o.fetch_chunks = 4;
  return o;
}

TEST(Stress, EverySequenceVerifiesBeforeAndAfterReopen) {
  TempDir dir;
  StressOptions o = TinyStress(dir.path());
  auto rep = RunStress(o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_EQ(rep->errors, 0u) << rep->first_error;
  const uint64_t tokens = static_cast<uint64_t>(o.sequences) * o.store.geometry.layers * o.tokens;
  EXPECT_EQ(rep->verified_tokens, tokens);
  EXPECT_EQ(rep->verified_after_reopen, tokens);
  EXPECT_GT(rep->counters.cold_writes, 0u);
  EXPECT_GT(rep->fetches, 0u);
}

TEST(Stress, ScoreDrivenDemotionWhileScoresChange) {
  // The stress job sets random chunk scores before its fetches when a policy is score-driven:
  // SetChunkScores runs on the driver threads while write-through encodes chunk metas on the
  // transfer thread (the race fixed in 29c3674).
  TempDir dir;
  StressOptions o = TinyStress(dir.path());
  o.store.warm_policy = "h2o";
  o.store.hot_policy = "snapkv";
  o.fetch_probability = 0.6;
  auto rep = RunStress(o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_EQ(rep->errors, 0u) << rep->first_error;
  EXPECT_EQ(rep->verified_after_reopen,
            static_cast<uint64_t>(o.sequences) * o.store.geometry.layers * o.tokens);
}

// The race itself, with nothing else in the way: one thread seals chunks (each sealed chunk's
// meta, score included, is encoded for its cold write), another rescores every chunk of the
// layer as fast as it can. Under ThreadSanitizer a score read without the store mutex is a
// reported race; everywhere, the scores that end up on disk are ones that were set.
TEST(Stress, ScoresSetWhileChunksAreWrittenThrough) {
  TempDir dir;
  StoreOptions o = TinyStress(dir.path()).store;
  o.warm_policy = "h2o";
  SequenceId seq = 0;
  {
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    TieredStore* st = store->get();
    seq = *st->CreateSequence();
    std::atomic<bool> done{false};
    std::thread scorer([&] {
      std::mt19937 rng(5);
      while (!done.load()) {
        auto n = st->ChunkCount(seq, 0);
        ASSERT_TRUE(n.ok()) << n.status().ToString();
        std::vector<std::pair<uint64_t, float>> scores;
        for (uint64_t i = 0; i < *n; ++i) scores.emplace_back(i, static_cast<float>(rng() % 1000) / 8.0f);
        ASSERT_TRUE(st->SetChunkScores(seq, 0, scores).ok());
      }
    });
    const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
    std::vector<uint8_t> k(tb * 7), v(tb * 7);
    for (int64_t p = 0; p < 3000; p += 7) {
      FillPattern(1, seq, 0, 0, p, 7, tb, k.data());
      FillPattern(1, seq, 0, 1, p, 7, tb, v.data());
      ASSERT_TRUE(st->Append(seq, 0, k.data(), v.data(), 7, o.geometry.dtype).ok());
    }
    done = true;
    scorer.join();
    ASSERT_TRUE(st->WaitForDurable().ok());
    ASSERT_TRUE(st->CloseSequence(seq).ok());  // rewrites nothing acknowledged; persists the rest
  }
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto chunks = (*store)->ListChunks(seq, 0);
  ASSERT_TRUE(chunks.ok());
  ASSERT_FALSE(chunks->empty());
  for (const ChunkInfo& c : *chunks) {
    // 0 (never scored before its write) or one of the values the scorer sets: k / 8, k < 1000.
    EXPECT_TRUE(c.score >= 0.0f && c.score < 125.0f &&
                c.score * 8.0f == static_cast<float>(static_cast<int>(c.score * 8.0f)))
        << c.key.ToString() << " score " << c.score;
  }
}

}  // namespace
}  // namespace kvtier
