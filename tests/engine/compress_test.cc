// The compression budget (engine/compress.h ChunkBudget): one definition, from what the
// store holds, used by `kvtier run --compress` and `kvtier infinite --compress`, so a layer
// never holds more than kv_budget tokens (apart from the documented exception: sinks and a
// local window that alone exceed the budget).
#include "engine/compress.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "integration/run_job.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

StoreOptions TinyStore() {
  StoreOptions o;
  o.geometry = Geometry{1, 1, 1, 4, DType::kF32};
  o.n_sink = 5;
  o.n_local = 8;
  o.chunk_size = 4;
  o.repr_topk = 1;
  o.hot_bytes = 16 * o.chunk_bytes();
  o.warm_bytes = 64 * o.chunk_bytes();
  return o;
}

// Appends n tokens to layer 0 of a fresh sequence.
SequenceId Fill(TieredStore* store, int64_t n) {
  auto seq = store->CreateSequence();
  EXPECT_TRUE(seq.ok());
  std::vector<float> kv(static_cast<size_t>(n) * 4, 1.0f);
  EXPECT_TRUE(store->Append(*seq, 0, kv.data(), kv.data(), static_cast<int>(n), DType::kF32).ok());
  return *seq;
}

// Tokens the layer holds: appended less the dropped chunks'.
int64_t Held(TieredStore& store, SequenceId seq) {
  auto kept = KeptTokensPerLayer(store, seq, 1);
  EXPECT_TRUE(kept.ok());
  return static_cast<int64_t>(*kept);
}

TEST(ChunkBudget, FromWhatTheStoreHoldsSoTheLayerStaysWithinTheBudget) {
  const StoreOptions o = TinyStore();
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  // 5 sinks + 6 sealed chunks + a local window of n_local + 3 = 11 tokens.
  const int64_t n = 5 + 6 * 4 + 11;
  const SequenceId seq = Fill(store->get(), n);
  auto count = (*store)->ChunkCount(seq, 0);
  ASSERT_TRUE(count.ok());
  ASSERT_EQ(*count, 6u);
  for (int64_t kv_budget = o.n_sink + o.n_local; kv_budget <= n + 8; ++kv_budget) {
    auto cb = ChunkBudget(**store, seq, 0, kv_budget);
    ASSERT_TRUE(cb.ok()) << cb.status().ToString();
    // What the store holds outside chunks: 5 sinks + 11 local tokens = 16.
    EXPECT_EQ(*cb, std::max<int64_t>(0, (kv_budget - 16) / 4)) << kv_budget;
    if (kv_budget >= 16) EXPECT_LE(16 + *cb * 4, kv_budget) << kv_budget;
    // The budget the sinks and n_local alone would give ((kv - 13) / 4) is one chunk too many
    // whenever the 3 extra local tokens cross a chunk boundary.
    if ((kv_budget - 13) / 4 != (kv_budget - 16) / 4) EXPECT_LT(*cb, (kv_budget - 13) / 4);
  }
  // Dropping down to the chunk budget (every chunk kept by the policy, chunk i worth i) leaves
  // at most kv_budget tokens.
  const int64_t kv_budget = 16 + 2 * 4 + 3;  // room for 2 chunks and 3 spare tokens
  auto cb = ChunkBudget(**store, seq, 0, kv_budget);
  ASSERT_TRUE(cb.ok());
  EXPECT_EQ(*cb, 2);
  TokenScores ts;
  ts.positions.resize(static_cast<size_t>(n));
  std::iota(ts.positions.begin(), ts.positions.end(), 0);
  ts.per_head = {std::vector<float>(static_cast<size_t>(n))};
  for (int64_t p = 0; p < n; ++p) ts.per_head[0][static_cast<size_t>(p)] = static_cast<float>(p);
  KeepSet keep;
  keep.per_head = {ts.positions};
  const std::vector<uint64_t> drop = ChunksToDrop(ts, keep, o.n_sink, o.chunk_size, *count, *cb);
  EXPECT_EQ(drop, (std::vector<uint64_t>{0, 1, 2, 3}));
  ASSERT_TRUE((*store)->DropChunks(seq, 0, drop).ok());
  EXPECT_EQ(Held(**store, seq), 16 + 2 * 4);
  EXPECT_LE(Held(**store, seq), kv_budget);
}

// The documented exception: sinks and local window are never dropped, so a budget below what
// they hold gets no chunk and the layer holds the sinks and local window.
TEST(ChunkBudget, BudgetBelowSinksAndLocalWindowKeepsNoChunk) {
  const StoreOptions o = TinyStore();
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok());
  const SequenceId seq = Fill(store->get(), 5 + 3 * 4 + 12);  // local window of n_local + 4 = 12
  for (int64_t kv_budget : {13, 16, 17}) {
    auto cb = ChunkBudget(**store, seq, 0, kv_budget);
    ASSERT_TRUE(cb.ok());
    EXPECT_EQ(*cb, 0) << kv_budget;
  }
  auto cb = ChunkBudget(**store, seq, 0, 5 + 12 + 4);
  ASSERT_TRUE(cb.ok());
  EXPECT_EQ(*cb, 1);
  // Early on, before the sinks fill, only what was appended counts.
  const SequenceId young = Fill(store->get(), 3);
  cb = ChunkBudget(**store, young, 0, 13);
  ASSERT_TRUE(cb.ok());
  EXPECT_EQ(*cb, (13 - 3) / 4);
  EXPECT_FALSE(ChunkBudget(**store, 999, 0, 13).ok());
}

// `kvtier run --compress` end to end: the context leaves n_local + 16 tokens in the local
// window, so the former budget (kv_budget - n_sink - n_local) / chunk kept one chunk too many
// and the layer held kv_budget + 16 tokens.
TEST(ChunkBudget, RunCompressNeverHoldsMoreThanTheBudget) {
  TempDir dir;
  RunOptions o;
  o.store.geometry = Geometry{2, 4, 2, 32, DType::kF16};
  o.store.n_sink = 64;
  o.store.n_local = 512;
  o.store.chunk_size = 32;
  o.store.data_dir = dir.path() + "/data";
  o.workload.context = 64 + 512 + 32 * 40 + 16;
  o.workload.decode_steps = 2;
  o.budget = 256;
  o.spearman_windows = 0;
  o.baseline = false;
  o.progress = false;
  o.compress = "h2o";
  o.kv_budget = 64 + 512 + 32 * 10;  // 896: 10 chunks by the old formula, 9 by what the store holds
  auto rep = RunJob(o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_TRUE(rep->policy.compressed);
  EXPECT_GT(rep->policy.dropped_chunks, 0u);
  EXPECT_LE(rep->policy.kept_tokens, static_cast<uint64_t>(o.kv_budget));
  EXPECT_GE(rep->policy.kept_tokens, static_cast<uint64_t>(o.kv_budget) - 32);
}

}  // namespace
}  // namespace kvtier
