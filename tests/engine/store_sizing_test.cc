// SizeStoreForContext (engine/store_sizing.h), the one sizing the CLI (kvtier infinite), the
// Python module and kvtier.hf use: warm holds every chunk, hot what one layer may attend.
#include "engine/store_sizing.h"

#include <gtest/gtest.h>

#include "kvtier/kvtier.h"

namespace kvtier {
namespace {

StoreOptions Small() {
  StoreOptions o;
  o.geometry = Geometry{4, 8, 2, 16, DType::kF32};
  o.n_sink = 4;
  o.n_local = 32;
  o.chunk_size = 16;
  o.repr_topk = 4;
  return o;
}

TEST(StoreSizing, WarmHoldsEveryChunkHotWhatOneLayerMayAttend) {
  const StoreOptions o = Small();
  const uint64_t cb = o.chunk_bytes();
  ASSERT_EQ(cb, 16u * 2 * 2 * 16 * 4);
  // 4096 tokens: 256 + 2 chunks a layer, 4 layers.
  StoreSize s = SizeStoreForContext(o, 4096, 128, /*retrieve=*/true);
  EXPECT_EQ(s.warm_bytes, 4u * 258 * cb);
  // k = 8 chunks; the entropy allocator may grant one layer up to layers * k + 1 = 33.
  EXPECT_EQ(s.hot_bytes, 33u * cb);
  // Full attention: every chunk of a layer.
  s = SizeStoreForContext(o, 4096, 128, /*retrieve=*/false);
  EXPECT_EQ(s.hot_bytes, 258u * cb);
  // A short context: at least 4 chunks of warm, never less hot than the budget's k + 1 chunks.
  s = SizeStoreForContext(o, 0, 128, true);
  EXPECT_EQ(s.warm_bytes, 8u * cb);  // 4 layers x 2 chunks
  EXPECT_EQ(s.hot_bytes, 9u * cb);
  StoreOptions one = o;
  one.geometry.layers = 1;
  EXPECT_EQ(SizeStoreForContext(one, 0, 0, true).warm_bytes, 4u * cb);
  // A budget of 0 (sinks and local only) still gets one slot.
  EXPECT_EQ(SizeStoreForContext(o, 4096, 0, true).hot_bytes, 1u * cb);
}

TEST(StoreSizing, ASessionOpensOnTheSizedStoreAndItsBudget) {
  for (int budget : {0, 16, 128, 512}) {
    StoreOptions o = Small();
    const StoreSize s = SizeStoreForContext(o, 2048, budget, true);
    o.hot_bytes = s.hot_bytes;
    o.warm_bytes = s.warm_bytes;
    auto store = Store::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().message();
    SessionOptions so;
    so.retrieval.budget_tokens = budget;
    auto session = Session::Open(store->get(), so);
    EXPECT_TRUE(session.ok()) << "budget " << budget << ": " << session.status().message();
  }
}

}  // namespace
}  // namespace kvtier
