// LayerRing (offload/store/layer_ring.h), tested alone over a host tier and a hand-made
// LayerState: where Append puts each token (sinks, ring, wrap point), when it asks for a seal,
// the spans View gives attention, the local window's attention mass, and CopyOut's round trip
// through store_internal::RestoreLayerRegions.
#include "offload/store/layer_ring.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "offload/store/layer_regions.h"

namespace kvtier {
namespace {

using store_internal::LayerState;

// 2 sinks, a ring of 4 + 2 = 6 tokens, 8 bytes a token (K or V), one kv head.
StoreOptions Small() {
  StoreOptions o;
  o.geometry = Geometry{1, 2, 1, 4, DType::kF16};
  o.n_sink = 2;
  o.n_local = 4;
  o.chunk_size = 2;
  return o;
}

struct Fixture {
  StoreOptions options = Small();
  size_t tok = options.geometry.token_elems() * 2;
  std::unique_ptr<HotTier> hot = *MakeHotTier(Device::kCpu, 4 * options.chunk_bytes(), options.chunk_bytes());
  LayerRing ring{options, tok};
  LayerState ls;
  std::vector<int64_t> full_at_seal;  // n_tokens - sealed_end at each seal call
  int64_t next = 0;                   // the next token's position

  Fixture() { EXPECT_TRUE(store_internal::AllocateLayerRegions(options, tok, hot.get(), &ls).ok()); }
  ~Fixture() { store_internal::FreeLayerRegions(hot.get(), &ls); }

  // Appends n tokens whose K bytes all hold their position and V bytes 100 + it; each seal
  // advances past the oldest chunk.
  Status Append(int n) {
    std::vector<uint8_t> k(n * tok), v(n * tok);
    for (int t = 0; t < n; ++t) {
      std::memset(k.data() + t * tok, static_cast<int>(next + t), tok);
      std::memset(v.data() + t * tok, static_cast<int>(100 + next + t), tok);
    }
    next += n;
    HotTier* h = hot.get();
    return ring.Append(
        ls, k.data(), v.data(), n,
        [h](uint8_t* dst, const uint8_t* src, size_t b) { return h->Upload(dst, src, b); },
        [this] {
          full_at_seal.push_back(ls.n_tokens - ls.sealed_end);
          ring.AdvancePastOldestChunk(ls);
          return Status::Ok();
        });
  }
  int64_t Slot(int64_t p) const { return (p - options.n_sink) % ring.capacity(); }
  // Every byte of token p's K and V in the ring holds what Append wrote.
  void ExpectInRing(int64_t p) const {
    for (size_t b = 0; b < tok; ++b) {
      ASSERT_EQ(ls.ring_k[Slot(p) * tok + b], static_cast<uint8_t>(p)) << "token " << p;
      ASSERT_EQ(ls.ring_v[Slot(p) * tok + b], static_cast<uint8_t>(100 + p)) << "token " << p;
    }
  }
};

TEST(LayerRing, AppendPutsTokenPAtItsRingSlotAcrossTheSinksAndTheWrapPoint) {
  Fixture f;
  EXPECT_EQ(f.ring.capacity(), 6);
  ASSERT_TRUE(f.Append(3).ok());  // sinks 0 1, token 2 in the ring: across the boundary in one call
  EXPECT_EQ(f.ls.n_tokens, 3);
  EXPECT_EQ(f.ls.sealed_end, 2);
  EXPECT_EQ(f.ls.sink_k[0], 0);
  EXPECT_EQ(f.ls.sink_k[f.tok], 1);
  EXPECT_EQ(f.ls.sink_v[f.tok], 101);
  f.ExpectInRing(2);
  EXPECT_TRUE(f.full_at_seal.empty());
  ASSERT_TRUE(f.Append(5).ok());  // tokens 3..7 fill the ring exactly: no seal yet
  EXPECT_TRUE(f.full_at_seal.empty());
  ASSERT_TRUE(f.Append(7).ok());  // tokens 8..14 wrap: a seal before each chunk's worth
  EXPECT_EQ(f.ls.n_tokens, 15);
  EXPECT_EQ(f.full_at_seal, (std::vector<int64_t>{6, 6, 6, 6}));  // only ever when full
  EXPECT_EQ(f.ls.sealed_end, 10);
  for (int64_t p = f.ls.sealed_end; p < f.ls.n_tokens; ++p) f.ExpectInRing(p);
  EXPECT_EQ(f.ls.sink_k[0], 0);  // the sinks are never overwritten
}

TEST(LayerRing, AFailedSealStopsTheAppendWithWhatWasCopiedKept) {
  Fixture f;
  ASSERT_TRUE(f.Append(8).ok());  // sinks and a full ring
  std::vector<uint8_t> k(2 * f.tok, 9), v(2 * f.tok, 9);
  HotTier* h = f.hot.get();
  const Status st = f.ring.Append(
      f.ls, k.data(), v.data(), 2, [h](uint8_t* d, const uint8_t* s, size_t b) { return h->Upload(d, s, b); },
      [] { return ResourceExhausted("no warm slot"); });
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(f.ls.n_tokens, 8);
  f.ExpectInRing(2);  // the oldest token was not overwritten
}

TEST(LayerRing, ViewGivesTheSinksAndOneOrTwoLocalSpans) {
  Fixture f;
  HotView v;
  ASSERT_TRUE(f.Append(1).ok());
  ASSERT_TRUE(f.ring.View(1, f.ls, &v).ok());
  EXPECT_EQ(v.sinks.n_tokens, 1);
  EXPECT_EQ(v.n_local_spans, 0);
  ASSERT_TRUE(f.Append(13).ok());  // n 14, sealed_end 8: the window [8, 14) is ring slots 0..5
  ASSERT_TRUE(f.ring.View(1, f.ls, &v).ok());
  EXPECT_EQ(v.n_tokens, 14);
  EXPECT_EQ(v.sinks.n_tokens, 2);
  EXPECT_EQ(v.sinks.k, f.ls.sink_k);
  ASSERT_EQ(v.n_local_spans, 1);
  EXPECT_EQ(v.local[0].first_position, 8);
  EXPECT_EQ(v.local[0].n_tokens, 6);
  EXPECT_EQ(v.local[0].k, f.ls.ring_k);
  ASSERT_TRUE(f.Append(1).ok());  // n 15, sealed_end 10: [10, 14) at slots 2..5, then 14 at slot 0
  ASSERT_TRUE(f.ring.View(1, f.ls, &v).ok());
  ASSERT_EQ(v.n_local_spans, 2);
  EXPECT_EQ(v.local[0].first_position, 10);
  EXPECT_EQ(v.local[0].n_tokens, 4);
  EXPECT_EQ(v.local[0].k, f.ls.ring_k + 2 * f.tok);
  EXPECT_EQ(v.local[0].v, f.ls.ring_v + 2 * f.tok);
  EXPECT_EQ(v.local[1].first_position, 14);
  EXPECT_EQ(v.local[1].n_tokens, 1);
  EXPECT_EQ(v.local[1].k, f.ls.ring_k);
  f.ls.sinks_restored = false;
  const Status st = f.ring.View(5, f.ls, &v);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("sequence 5"), std::string::npos) << st.ToString();
}

TEST(LayerRing, MassOutsideTheLocalWindowIsRejectedAndTheOldestChunksMassIsSealedAway) {
  Fixture f;
  const float one[2] = {1.0f, 2.0f};
  ASSERT_TRUE(f.Append(2).ok());  // sinks only
  EXPECT_EQ(f.ring.AddMass(f.ls, 0, 1, one).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(f.Append(13).ok());  // window [10, 15)
  const Status before = f.ring.AddMass(f.ls, 9, 2, one);
  EXPECT_EQ(before.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(before.message().find("[9, 11)"), std::string::npos) << before.ToString();
  EXPECT_NE(before.message().find("[10, 15)"), std::string::npos) << before.ToString();
  EXPECT_EQ(f.ring.AddMass(f.ls, 14, 2, one).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.ring.AddMass(f.ls, 10, 0, one).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.ring.AddMass(f.ls, 10, 1, nullptr).code(), StatusCode::kInvalidArgument);
  for (float m : f.ls.ring_mass) EXPECT_EQ(m, 0.0f);  // nothing added by a rejected call
  ASSERT_TRUE(f.ring.AddMass(f.ls, 10, 2, one).ok());
  ASSERT_TRUE(f.ring.AddMass(f.ls, 11, 2, one).ok());  // adds: token 11 gets 2 + 1
  EXPECT_EQ(f.ring.OldestChunkSlot(f.ls), 2);
  EXPECT_EQ(f.ring.OldestChunkMass(f.ls), (std::vector<float>{1.0f, 3.0f}));
  f.ring.AdvancePastOldestChunk(f.ls);
  EXPECT_EQ(f.ls.sealed_end, 12);
  EXPECT_EQ(f.ls.ring_mass[2], 0.0f);  // reset for the tokens that reuse the slots
  EXPECT_EQ(f.ls.ring_mass[3], 0.0f);
  EXPECT_EQ(f.ring.OldestChunkSlot(f.ls), 4);
  EXPECT_EQ(f.ring.OldestChunkMass(f.ls), (std::vector<float>{2.0f, 0.0f}));  // token 12's 2
}

TEST(LayerRing, CopyOutRoundTripsThroughRestoreLayerRegions) {
  Fixture f;
  ASSERT_TRUE(f.Append(15).ok());  // window [10, 15), wrapped
  std::string sinks, local;
  ASSERT_TRUE(f.ring.CopyOut(f.hot.get(), f.ls, &sinks, &local).ok());
  EXPECT_EQ(sinks.size(), 2 * 2 * f.tok);
  ASSERT_EQ(local.size(), 2 * 5 * f.tok);
  EXPECT_EQ(static_cast<uint8_t>(local[0]), 10);           // K of the oldest local token first
  EXPECT_EQ(static_cast<uint8_t>(local[5 * f.tok]), 110);  // then V
  Fixture g;
  g.ls.n_tokens = f.ls.n_tokens;
  g.ls.sealed_end = f.ls.sealed_end;
  ASSERT_TRUE(store_internal::RestoreLayerRegions(g.options, g.tok, g.hot.get(), sinks, local, &g.ls).ok());
  EXPECT_EQ(std::memcmp(g.ls.sink_k, f.ls.sink_k, 2 * f.tok), 0);
  EXPECT_EQ(std::memcmp(g.ls.sink_v, f.ls.sink_v, 2 * f.tok), 0);
  for (int64_t p = 10; p < 15; ++p) g.ExpectInRing(p);
}

}  // namespace
}  // namespace kvtier
