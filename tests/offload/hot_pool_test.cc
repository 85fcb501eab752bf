// HotPool (offload/store/hot_pool.h), tested alone over a host slot pool and chunk records:
// slot acquisition and leases, reservations, claims, the holders of each thread, the waiters.
#include "offload/store/hot_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "offload/clock.h"
#include "offload/demotion_policy.h"
#include "offload/hot_tier.h"

namespace kvtier {
namespace {

using std::chrono::milliseconds;
using store_internal::Chunk;

constexpr size_t kSlot = 256;

// A pool of `slots` slots over chunk records of two sequences (ids 1.., sequence 1 then 2).
struct Fixture {
  std::unique_ptr<HotTier> tier;
  HotPool::ChunkById chunks;
  std::vector<std::unique_ptr<Chunk>> owned;
  std::unique_ptr<HotPool> pool;
  Clock::time_point now{};
  StoreCounters counters;

  explicit Fixture(int slots) {
    tier = *MakeHotTier(Device::kCpu, slots * kSlot, kSlot);
    pool = std::make_unique<HotPool>(tier.get(), *MakeDemotionPolicy("lru"), &chunks);
  }
  Chunk* NewChunk(SequenceId seq) {
    auto c = std::make_unique<Chunk>();
    c->id = owned.size() + 1;
    c->key = ChunkKey{seq, 0, owned.size()};
    chunks[c->id] = c.get();
    owned.push_back(std::move(c));
    return owned.back().get();
  }
  // Puts `c` in a hot slot, pinned until now + lease (0: unpinned).
  bool MakeHot(Chunk* c, milliseconds lease) {
    const int32_t slot = pool->AcquireSlotLocked(now, &counters);
    if (slot < 0) return false;
    c->hot_slot = slot;
    c->tiers |= kTierHot;
    pool->policy().OnInsert(c->id);
    if (lease.count() > 0) {
      c->hot_pins = 1;
      c->pin_deadline = now + lease;
    }
    return true;
  }
};

TEST(HotPool, FreeSlotsFirstThenTheVictimNeitherPinnedNorLoading) {
  Fixture f(2);
  Chunk* a = f.NewChunk(1);
  Chunk* b = f.NewChunk(1);
  Chunk* c = f.NewChunk(2);
  ASSERT_TRUE(f.MakeHot(a, milliseconds(0)));
  ASSERT_TRUE(f.MakeHot(b, milliseconds(50)));  // pinned
  EXPECT_EQ(f.counters.demotions, 0u);
  // Full: the unpinned chunk leaves hot (demoted), the pinned one stays.
  ASSERT_TRUE(f.MakeHot(c, milliseconds(50)));
  EXPECT_EQ(a->hot_slot, -1);
  EXPECT_EQ(a->tiers & kTierHot, 0);
  EXPECT_GE(b->hot_slot, 0);
  EXPECT_EQ(f.counters.demotions, 1u);
  // Everything pinned: no slot.
  Chunk* d = f.NewChunk(2);
  EXPECT_FALSE(f.MakeHot(d, milliseconds(0)));
  // A lease that ran out no longer protects: its chunk is the victim, the expiry counted.
  f.now += milliseconds(60);
  EXPECT_FALSE(HotPool::Pinned(b, f.now));
  ASSERT_TRUE(f.MakeHot(d, milliseconds(0)));
  EXPECT_EQ(f.counters.lease_expired, 1u);
  // A chunk loading into its slot is never a victim, pinned or not.
  c->hot_pins = 0;
  c->hot_loading = true;
  f.pool->EvictUnpinnedLocked(f.now);
  EXPECT_GE(c->hot_slot, 0);
  EXPECT_EQ(d->hot_slot, -1);
}

TEST(HotPool, ReservationsCountOncePerSequenceAndNeverExceedThePool) {
  Fixture f(4);
  uint64_t after = 0;
  auto r1 = f.pool->ReserveLocked(1, 2, &after);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(after, 2u);
  auto r1b = f.pool->ReserveLocked(1, 3, &after);  // the same sequence: its largest counts
  ASSERT_TRUE(r1b.ok());
  EXPECT_EQ(after, 3u);
  EXPECT_EQ(f.pool->ReservedForLocked(1), 3);
  auto r2 = f.pool->ReserveLocked(2, 2, &after);
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r2.status().message().find("4 slots, 3 reserved"), std::string::npos) << r2.status().ToString();
  ASSERT_TRUE(f.pool->ReleaseLocked(*r1b, &after));
  EXPECT_EQ(after, 2u);
  EXPECT_FALSE(f.pool->ReleaseLocked(*r1b, &after));  // unknown now
  ASSERT_TRUE(f.pool->ReserveLocked(2, 2, &after).ok());
  EXPECT_EQ(f.pool->ReservedTotalLocked(), 4);
}

TEST(HotPool, AFetchPastItsReservationKeepsWhatTheOthersClaimsLeave) {
  Fixture f(6);
  uint64_t after = 0;
  ASSERT_TRUE(f.pool->ReserveLocked(1, 2, &after).ok());
  ASSERT_TRUE(f.pool->ReserveLocked(2, 1, &after).ok());
  EXPECT_EQ(f.pool->FitWithinClaimsLocked(1, 2, f.now), 2u);  // within its reservation
  EXPECT_EQ(f.pool->FitWithinClaimsLocked(1, 9, f.now), 5u);  // 6 - sequence 2's claim of 1
  // Sequence 2 holds 3 slots through a live handle: its claim is 3, not 1.
  HotPool::Holder h;
  h.thread = std::this_thread::get_id();
  for (int i = 0; i < 3; ++i) {
    Chunk* c = f.NewChunk(2);
    ASSERT_TRUE(f.MakeHot(c, milliseconds(50)));
    h.chunk_ids.push_back(c->id);
  }
  f.pool->AddHolderLocked(&h);
  EXPECT_EQ(f.pool->FitWithinClaimsLocked(1, 9, f.now), 3u);
  EXPECT_EQ(f.pool->HeldByThreadLocked(std::this_thread::get_id(), f.now), 3);
  EXPECT_EQ(f.pool->HeldByThreadLocked(std::thread::id(), f.now), 0);
  // Room for sequence 1: three free slots; the three held count as another sequence's.
  const HotPool::Room room = f.pool->RoomLocked(1, 4, {}, f.now, true);
  EXPECT_EQ(room.available, 3);
  EXPECT_EQ(room.held_other, 3);
  EXPECT_EQ(room.held_self, 0);
  f.pool->RemoveHolderLocked(&h);
  EXPECT_EQ(f.pool->FitWithinClaimsLocked(1, 9, f.now), 5u);  // no live holder: claims are reservations
  EXPECT_EQ(f.pool->HeldByThreadLocked(std::this_thread::get_id(), f.now), 0);
}

TEST(HotPool, WaitersAreServedOldestFirst) {
  Fixture f(1);
  EXPECT_FALSE(f.pool->BehindLocked(0));
  const uint64_t first = f.pool->StartWaitLocked();
  const uint64_t second = f.pool->StartWaitLocked();
  EXPECT_FALSE(f.pool->BehindLocked(first));
  EXPECT_TRUE(f.pool->BehindLocked(second));
  EXPECT_TRUE(f.pool->BehindLocked(0));  // a fetch not waiting yet queues behind them
  f.pool->EndWaitLocked(first);
  EXPECT_FALSE(f.pool->BehindLocked(second));
  f.pool->EndWaitLocked(second);
  EXPECT_FALSE(f.pool->BehindLocked(0));
}

}  // namespace
}  // namespace kvtier
