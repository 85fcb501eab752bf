// A layer's hot regions (offload/store/layer_regions.h), tested alone over a host tier: the
// sizes, and a restore that puts the sinks and the local window where the ring keeps them.
#include "offload/store/layer_regions.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

namespace kvtier {
namespace {

using store_internal::LayerState;

StoreOptions Small() {
  StoreOptions o;
  o.geometry = Geometry{1, 2, 1, 4, DType::kF16};  // 8 bytes a token (K or V)
  o.n_sink = 2;
  o.n_local = 4;
  o.chunk_size = 2;
  return o;
}

TEST(LayerRegions, AllocateRestoreAndFreeOneLayer) {
  const StoreOptions o = Small();
  const size_t tok = o.geometry.token_elems() * 2;
  auto hot = MakeHotTier(Device::kCpu, 16 * o.chunk_bytes(), o.chunk_bytes());
  ASSERT_TRUE(hot.ok());
  EXPECT_EQ(store_internal::LayerRegionBytes(o, tok), 2u * (2 + 4 + 2) * tok);
  LayerState ls;
  ASSERT_TRUE(store_internal::AllocateLayerRegions(o, tok, hot->get(), &ls).ok());
  ASSERT_NE(ls.sink_k, nullptr);
  ASSERT_NE(ls.ring_v, nullptr);
  EXPECT_EQ(ls.ring_mass.size(), 1u * 6);  // kv_heads x (n_local + chunk_size)
  // 11 tokens: sinks [0, 2), chunks [2, 6) sealed, local window [6, 11) in ring slots 4, 5, 0, 1, 2.
  ls.n_tokens = 11;
  ls.sealed_end = 6;
  std::string sinks(2 * 2 * tok, '\0'), local(2 * 5 * tok, '\0');
  for (size_t i = 0; i < sinks.size(); ++i) sinks[i] = static_cast<char>(i / tok);       // K 0 1, V 2 3
  for (size_t i = 0; i < local.size(); ++i) local[i] = static_cast<char>(10 + i / tok);  // K 10.., V 15..
  ASSERT_TRUE(store_internal::RestoreLayerRegions(o, tok, hot->get(), sinks, local, &ls).ok());
  EXPECT_EQ(ls.sink_k[0], 0);
  EXPECT_EQ(ls.sink_k[tok], 1);
  EXPECT_EQ(ls.sink_v[0], 2);
  const int slot_of[5] = {4, 5, 0, 1, 2};  // (p - n_sink) % 6 for p = 6..10
  for (int t = 0; t < 5; ++t) {
    EXPECT_EQ(ls.ring_k[slot_of[t] * tok], 10 + t) << t;
    EXPECT_EQ(ls.ring_v[slot_of[t] * tok], 15 + t) << t;
  }
  store_internal::FreeLayerRegions(hot->get(), &ls);
  EXPECT_EQ(ls.sink_k, nullptr);
  EXPECT_EQ(ls.ring_v, nullptr);
  store_internal::FreeLayerRegions(hot->get(), &ls);  // nothing left: a no-op
}

}  // namespace
}  // namespace kvtier
