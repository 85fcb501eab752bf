// WarmTier (offload/store/warm_tier.h), tested alone over hand-made chunk records in a
// ChunkCatalog, with no lower tier: slot acquisition, which warm copies may be dropped (only
// acknowledged, unpinned chunks not being written), reads that take a victim's slot without
// waiting, and MakeRoom's answers when nothing can be demoted.
#include "offload/store/warm_tier.h"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "offload/store/lower_writer.h"

namespace kvtier {
namespace {

using store_internal::Chunk;

StoreOptions Small() {
  StoreOptions o;
  o.geometry = Geometry{1, 2, 1, 4, DType::kF16};
  o.n_sink = 2;
  o.n_local = 4;
  o.chunk_size = 2;
  o.repr_topk = 1;
  o.warm_bytes = 3 * o.chunk_bytes();  // three slots
  o.warm_policy = "lru";
  return o;
}

struct Fixture {
  StoreOptions options = Small();
  ChunkCatalog catalog{options, options.geometry.token_elems() * 2};
  LowerTiers lower;  // none
  StoreCounters counters;
  StoreSync sync;
  LowerWriter writer{nullptr, &lower, &sync, &counters, options.chunk_bytes()};
  std::unique_ptr<WarmTier> warm;
  std::vector<Chunk*> chunks;

  Fixture() {
    auto w = WarmTier::Create(options, options.chunk_bytes(), &catalog, &lower, &counters);
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    warm = std::move(*w);
  }
  ~Fixture() {
    for (Chunk* c : chunks) {
      warm->Forget(c);
      catalog.Forget(c);
    }
  }
  // A chunk held in warm (a fresh slot), acknowledged by a lower tier or not.
  Chunk* HoldNew(bool acked) {
    Chunk* c = catalog.Create(ChunkKey{1, 0, chunks.size()}, 0, std::vector<uint8_t>(8, 1));
    chunks.push_back(c);
    const int32_t slot = warm->Acquire();
    EXPECT_GE(slot, 0);
    warm->Hold(c, slot);
    c->lower_acked = acked;
    if (acked) c->tiers |= kTierCold;
    return c;
  }
};

TEST(WarmTier, AcquireHandsOutDistinctSlotsUntilFull) {
  Fixture f;
  EXPECT_EQ(f.warm->capacity(), 3);
  std::set<int32_t> slots;
  for (int i = 0; i < 3; ++i) slots.insert(f.warm->Acquire());
  EXPECT_EQ(slots.size(), 3u);
  EXPECT_EQ(slots.count(-1), 0u);
  EXPECT_EQ(f.warm->used(), 3);
  EXPECT_EQ(f.warm->Acquire(), -1);
  f.warm->Release(*slots.begin());
  EXPECT_EQ(f.warm->used(), 2);
  EXPECT_EQ(f.warm->Acquire(), *slots.begin());
  EXPECT_NE(f.warm->slot_data(0), f.warm->slot_data(1));
}

TEST(WarmTier, OnlyAcknowledgedUnpinnedChunksNotBeingWrittenLoseTheirWarmCopy) {
  Fixture f;
  Chunk* unacked = f.HoldNew(false);
  Chunk* pinned = f.HoldNew(true);
  pinned->warm_pins = 1;
  Chunk* writing = f.HoldNew(true);
  writing->lower_writing = true;
  EXPECT_EQ(unacked->tiers & kTierWarm, kTierWarm);
  EXPECT_FALSE(*f.warm->DropVictimCopy());
  EXPECT_EQ(f.counters.demotions, 0u);
  for (Chunk* c : {unacked, pinned, writing}) EXPECT_GE(c->warm_slot, 0);
  writing->lower_writing = false;
  ASSERT_TRUE(*f.warm->DropVictimCopy());
  EXPECT_EQ(writing->warm_slot, -1);
  EXPECT_EQ(writing->tiers & kTierWarm, 0);
  EXPECT_EQ(writing->tiers & kTierCold, kTierCold);  // still in the tier that acknowledged it
  EXPECT_EQ(f.counters.demotions, 1u);
  EXPECT_EQ(f.warm->used(), 2);
  EXPECT_FALSE(*f.warm->DropVictimCopy());  // the pinned one stays
  EXPECT_GE(pinned->warm_slot, 0);
}

TEST(WarmTier, AcquireForReadTakesAVictimsSlotOrGivesUpAtOnce) {
  Fixture f;
  f.HoldNew(false);
  Chunk* acked = f.HoldNew(true);
  const int32_t acked_slot = acked->warm_slot;
  EXPECT_GE(f.warm->AcquireForRead(), 0);  // a free slot first: nothing dropped
  EXPECT_EQ(f.counters.demotions, 0u);
  EXPECT_EQ(acked->warm_slot, acked_slot);
  EXPECT_EQ(f.warm->AcquireForRead(), acked_slot);  // full: the acknowledged chunk's slot
  EXPECT_EQ(acked->warm_slot, -1);
  EXPECT_EQ(f.counters.demotions, 1u);
  EXPECT_EQ(f.warm->AcquireForRead(), -1);  // full of unacknowledged chunks: no wait, no write
  EXPECT_EQ(f.warm->used(), 3);
}

TEST(WarmTier, MakeRoomWithNoLowerTierAndNothingLandingIsResourceExhausted) {
  Fixture f;
  for (int i = 0; i < 3; ++i) f.HoldNew(false);
  int lands = 0;
  std::unique_lock<CountingMutex> lock(f.sync.mu);
  const Status st = f.warm->MakeRoom(lock, f.sync, f.writer, [&] {
    lands++;
    return false;
  });
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("warm tier is full (3 chunks)"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("no cold tier"), std::string::npos) << st.ToString();
  EXPECT_EQ(lands, 1);
  EXPECT_TRUE(lock.owns_lock());
}

TEST(WarmTier, MakeRoomDropsAnAcknowledgedCopyBeforeLandingAnything) {
  Fixture f;
  f.HoldNew(false);
  f.HoldNew(false);
  Chunk* acked = f.HoldNew(true);
  int lands = 0;
  std::unique_lock<CountingMutex> lock(f.sync.mu);
  ASSERT_TRUE(f.warm->MakeRoom(lock, f.sync, f.writer, [&] { return ++lands, false; }).ok());
  EXPECT_EQ(lands, 0);
  EXPECT_EQ(acked->warm_slot, -1);
  EXPECT_EQ(f.warm->used(), 2);
}

TEST(WarmTier, MakeRoomLandsChunksWhenNothingElseFreesRoom) {
  Fixture f;
  f.HoldNew(false);
  f.HoldNew(false);
  // The third slot belongs to a chunk still landing: not under the policy, not demotable.
  Chunk* landing = f.catalog.Create(ChunkKey{1, 0, 9}, 0, std::vector<uint8_t>(8, 1));
  f.chunks.push_back(landing);
  const int32_t landing_slot = f.warm->Acquire();
  ASSERT_GE(landing_slot, 0);
  landing->warm_slot = landing_slot;
  landing->landing = true;
  int lands = 0;
  std::unique_lock<CountingMutex> lock(f.sync.mu);
  // Landing it makes it a warm chunk; its write-through was acknowledged, so it can then go.
  const Status st = f.warm->MakeRoom(lock, f.sync, f.writer, [&] {
    if (!landing->landing) return false;
    lands++;
    landing->landing = false;
    landing->warm_slot = -1;
    f.warm->Hold(landing, landing_slot);
    landing->lower_acked = true;
    landing->tiers |= kTierCold;
    return true;
  });
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(lands, 1);
  EXPECT_EQ(landing->warm_slot, -1);
  EXPECT_EQ(f.counters.demotions, 1u);
  EXPECT_EQ(f.warm->used(), 2);
}

// Counts its calls; fails them with `fail` set.
struct CountingFence : WarmReaderFence {
  Status WaitForReaders() override {
    calls++;
    return fail ? Unavailable("the device reader's event failed") : Status::Ok();
  }
  int calls = 0;
  bool fail = false;
};

TEST(WarmTier, AcquireForReadFencesAnExposedVictimOnceAndKeepsItWhenTheFenceFails) {
  Fixture f;
  CountingFence fence;
  f.warm->SetReaderFence(&fence);
  f.HoldNew(false);
  f.HoldNew(false);
  Chunk* acked = f.HoldNew(true);
  const int32_t acked_slot = acked->warm_slot;
  EXPECT_EQ(f.warm->Expose(acked), f.warm->slot_data(acked_slot));
  EXPECT_TRUE(f.warm->exposed(acked_slot));
  fence.fail = true;
  EXPECT_EQ(f.warm->AcquireForRead(), -1);  // the victim is kept: no warm copy for the read
  EXPECT_EQ(fence.calls, 1);
  EXPECT_EQ(f.counters.warm_reader_fences, 1u);
  EXPECT_EQ(acked->warm_slot, acked_slot);
  EXPECT_TRUE(f.warm->exposed(acked_slot));
  EXPECT_EQ(f.counters.demotions, 0u);
  fence.fail = false;
  const uint64_t epoch = f.warm->epoch();
  EXPECT_EQ(f.warm->AcquireForRead(), acked_slot);
  EXPECT_EQ(fence.calls, 2);
  EXPECT_EQ(f.warm->epoch(), epoch + 1);
  EXPECT_FALSE(f.warm->exposed(acked_slot));
  EXPECT_EQ(f.warm->exposed_count(), 0);
  f.warm->Release(acked_slot);
}

TEST(WarmTier, MakeRoomReturnsTheFencesErrorAndDropsNothing) {
  Fixture f;
  CountingFence fence;
  fence.fail = true;
  f.warm->SetReaderFence(&fence);
  f.HoldNew(false);
  f.HoldNew(false);
  Chunk* acked = f.HoldNew(true);
  f.warm->Expose(acked);
  std::unique_lock<CountingMutex> lock(f.sync.mu);
  const Status st = f.warm->MakeRoom(lock, f.sync, f.writer, [] { return false; });
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("the device reader's event failed"), std::string::npos) << st.ToString();
  EXPECT_GE(acked->warm_slot, 0);
  EXPECT_EQ(f.warm->used(), 3);
  fence.fail = false;
  ASSERT_TRUE(f.warm->MakeRoom(lock, f.sync, f.writer, [] { return false; }).ok());
  EXPECT_EQ(acked->warm_slot, -1);
  EXPECT_EQ(fence.calls, 2);
}

}  // namespace
}  // namespace kvtier
