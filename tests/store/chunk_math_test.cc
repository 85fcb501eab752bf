// Position <-> chunk arithmetic (store/chunk.h): the one definition every caller uses, checked
// against how the store itself cuts a layer into sinks, chunks and the local window.
#include <gtest/gtest.h>

#include <vector>

#include "offload/tiered_store.h"
#include "store/chunk.h"

namespace kvtier {
namespace {

TEST(ChunkMath, SinksAndLocalWindowAreNoChunk) {
  // n_sink 5, chunk 4, 3 sealed chunks: sinks 0..4, chunks [5,9) [9,13) [13,17), local 17...
  for (int64_t p = 0; p < 5; ++p) EXPECT_EQ(ChunkOfPosition(p, 5, 4, 3), -1) << p;
  EXPECT_EQ(ChunkOfPosition(5, 5, 4, 3), 0);
  EXPECT_EQ(ChunkOfPosition(8, 5, 4, 3), 0);
  EXPECT_EQ(ChunkOfPosition(9, 5, 4, 3), 1);
  EXPECT_EQ(ChunkOfPosition(16, 5, 4, 3), 2);
  EXPECT_EQ(ChunkOfPosition(17, 5, 4, 3), -1);  // the local window
  EXPECT_EQ(ChunkOfPosition(1000, 5, 4, 3), -1);
  EXPECT_EQ(ChunkOfPosition(17, 5, 4, 0), -1);  // no sealed chunk: everything past the sinks is local
  EXPECT_EQ(ChunkOfPosition(5, 5, 4, 0), -1);
  // Unbounded: every position past the sinks is in a chunk.
  EXPECT_EQ(ChunkOfPosition(17, 5, 4, kAnyChunkCount), 3);
  EXPECT_EQ(ChunkOfPosition(4, 5, 4, kAnyChunkCount), -1);
  // No sinks.
  EXPECT_EQ(ChunkOfPosition(0, 0, 32, 10), 0);
  EXPECT_EQ(ChunkOfPosition(31, 0, 32, 10), 0);
  EXPECT_EQ(ChunkOfPosition(32, 0, 32, 10), 1);
}

TEST(ChunkMath, FirstTokenIsTheInverse) {
  for (int64_t n_sink : {0, 1, 5, 64})
    for (int64_t cs : {1, 4, 32})
      for (uint64_t i = 0; i < 20; ++i) {
        const int64_t first = ChunkFirstToken(i, n_sink, cs);
        EXPECT_EQ(first, n_sink + static_cast<int64_t>(i) * cs);
        EXPECT_EQ(ChunkOfPosition(first, n_sink, cs, kAnyChunkCount), static_cast<int64_t>(i));
        EXPECT_EQ(ChunkOfPosition(first + cs - 1, n_sink, cs, kAnyChunkCount), static_cast<int64_t>(i));
        EXPECT_EQ(ChunkOfPosition(first - 1, n_sink, cs, kAnyChunkCount), static_cast<int64_t>(i) - 1);
        // With i sealed chunks the local window starts at ChunkFirstToken(i).
        EXPECT_EQ(ChunkOfPosition(first, n_sink, cs, i), -1);
      }
  static_assert(ChunkOfPosition(9, 5, 4, 3) == 1 && ChunkFirstToken(2, 5, 4) == 13, "usable at compile time");
}

// The store's own chunks: first_token, count and the sealed end agree with the functions.
TEST(ChunkMath, AgreesWithTheStore) {
  StoreOptions o;
  o.geometry = Geometry{1, 1, 1, 4, DType::kF32};
  o.n_sink = 5;
  o.n_local = 8;
  o.chunk_size = 4;
  o.repr_topk = 1;
  o.hot_bytes = 16 * o.chunk_bytes();
  o.warm_bytes = 64 * o.chunk_bytes();
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto seq = (*store)->CreateSequence();
  ASSERT_TRUE(seq.ok());
  const int64_t n = 5 + 8 + 4 * 6 + 3;
  std::vector<float> k(static_cast<size_t>(n) * 4), v(k.size());
  for (size_t i = 0; i < k.size(); ++i)
    k[i] = v[i] = static_cast<float>(i / 4);  // each token holds its position
  ASSERT_TRUE((*store)->Append(*seq, 0, k.data(), v.data(), static_cast<int>(n), DType::kF32).ok());
  auto count = (*store)->ChunkCount(*seq, 0);
  auto chunks = (*store)->ListChunks(*seq, 0);
  ASSERT_TRUE(count.ok() && chunks.ok());
  ASSERT_GT(*count, 0u);
  ASSERT_EQ(chunks->size(), *count);
  for (const ChunkInfo& c : *chunks) {
    EXPECT_EQ(c.first_token, ChunkFirstToken(c.key.index, o.n_sink, o.chunk_size)) << c.key.ToString();
    for (int64_t p = c.first_token; p < c.first_token + o.chunk_size; ++p) {
      EXPECT_EQ(ChunkOfPosition(p, o.n_sink, o.chunk_size, *count), static_cast<int64_t>(c.key.index)) << p;
      float kk[4] = {-1}, vv[4] = {-1};  // one token: 1 kv head x head_dim 4
      ASSERT_TRUE((*store)->ReadTokens(*seq, 0, p, p + 1, kk, vv).ok());
      EXPECT_EQ(kk[0], static_cast<float>(p));
    }
  }
  // What lies past the sealed chunks is the local window: between n_local and n_local + chunk tokens.
  const int64_t local_begin = ChunkFirstToken(*count, o.n_sink, o.chunk_size);
  EXPECT_GT(n - local_begin, o.n_local);
  EXPECT_LE(n - local_begin, o.n_local + o.chunk_size);
  for (int64_t p = local_begin; p < n; ++p) EXPECT_EQ(ChunkOfPosition(p, o.n_sink, o.chunk_size, *count), -1);
}

}  // namespace
}  // namespace kvtier
