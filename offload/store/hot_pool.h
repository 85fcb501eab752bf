// HotPool: the hot tier's slot pool as the store hands it out. It owns the bookkeeping of who
// may hold which slots: the hot demotion policy (which slot a fetch takes when none is free),
// the pins and their leases (Pinned), the reservations of the sessions (ReserveHotSlots), the
// queue of fetches waiting for slots, and the live fetch handles (whose thread holds which
// pins). The slots' memory is the HotTier's (offload/hot_tier.h), owned by the store; a chunk's
// hot_slot, hot_pins, pin_deadline and hot_loading are on its record (store_internal::Chunk),
// which the pool reads through the store's chunk map.
//
// Why nothing deadlocks (TieredStore::FetchChunks applies it): a fetch takes every slot it
// needs under the store lock, or none, and waits (at most pin_wait_ms) holding no pin of its
// own call. A waiter that holds pins (set W) holds at most its reservation R less what it
// asks, n; reservations sum to at most the pool P (ReserveLocked refuses more). Once the
// holders outside any wait have unpinned (an Attend unpins before it returns; a lease runs
// out), the room is P - sum_W H >= sum_W (R - H) >= n of any member of W, which never queues
// behind others (a sequence that holds pins does not wait behind older waiters); and with W
// empty no pin is left, so the oldest waiter has the whole pool. A fetch whose sequence
// holds pins and would exceed its reservation fails at once instead of waiting. The argument
// needs the holders to unpin while the waiter waits, so a fetch never waits for pins its own
// thread holds (HeldByThreadLocked): it fails at once instead. A fetch past its reservation
// with FetchFit::kWithinClaims keeps only what leaves every other sequence's claim free
// (FitWithinClaimsLocked), so the claims never exceed the pool and a sequence can always pin
// its reservation without waiting.
//
// Locking: guarded by TieredStore::mu_ (every member named ...Locked): a fetch decides what
// it takes, and pins it, under the one lock entry of FetchChunks.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvtier/counters.h"
#include "offload/clock.h"
#include "offload/demotion_policy.h"
#include "offload/hot_tier.h"
#include "offload/store_state.h"
#include "store/status.h"

namespace kvtier {

class HotPool {
 public:
  /// What a live fetch handle holds: its pinned chunks (ids, request order) and the thread
  /// whose FetchChunks took them (FetchHandle::State is one).
  struct Holder {
    std::vector<uint64_t> chunk_ids;
    std::thread::id thread;
  };
  using ChunkById = std::unordered_map<uint64_t, store_internal::Chunk*>;

  /// `tier` and `chunks` are the store's and outlive the pool.
  HotPool(HotTier* tier, std::unique_ptr<DemotionPolicy> policy, const ChunkById* chunks)
      : tier_(tier), policy_(std::move(policy)), chunks_(chunks) {}

  DemotionPolicy& policy() { return *policy_; }
  int64_t capacity() const { return tier_->slot_capacity(); }

  /// A pin protects its chunk until its lease (pin_deadline) runs out at `now`.
  static bool Pinned(const store_internal::Chunk* c, Clock::time_point now) {
    return c->hot_pins > 0 && now < c->pin_deadline;
  }

  /// A free slot, or the policy's victim among slots neither loading nor pinned at `now`
  /// (its chunk leaves hot: counted in demotions, an expired lease in lease_expired); -1 when none.
  int32_t AcquireSlotLocked(Clock::time_point now, StoreCounters* counters);
  /// Takes a chunk that is going away out of hot (slot released, out of the policy).
  void ForgetLocked(store_internal::Chunk* c);
  /// Frees every slot neither loading nor pinned at `now` (the chunks stay in warm or below).
  void EvictUnpinnedLocked(Clock::time_point now);

  /// What the pool offers a fetch of `seq` that needs `need` slots it has no slot for,
  /// `requested` (sorted chunk ids) being the chunks the fetch asks for.
  struct Room {
    int64_t available = 0;   // free slots + slots of unpinned, not loading chunks outside `requested`
    int64_t held_self = 0;   // slots pinned or loading for chunks of `seq` (filled when available < need)
    int64_t held_other = 0;  // the same for other sequences' chunks (filled when available < need)
  };
  /// `full`: count held_self and held_other in any case (no early stop).
  Room RoomLocked(SequenceId seq, int64_t need, const std::vector<uint64_t>& requested, Clock::time_point now,
                  bool full) const;
  /// How many of a kWithinClaims fetch's n chunks `seq` may pin: n within its reservation,
  /// else what the other sequences' claims leave, at least the reservation. Reads the live
  /// holders' pins, not the whole pool.
  size_t FitWithinClaimsLocked(SequenceId seq, size_t n, Clock::time_point now) const;
  /// Slots pinned or loading for chunks that live holders of `thread` hold.
  int64_t HeldByThreadLocked(std::thread::id thread, Clock::time_point now) const;

  /// Reserves `slots` for `seq` (a sequence's reservations count once, at their largest):
  /// the reservation's id (never 0), or ResourceExhausted naming the numbers when the
  /// reservations would exceed the pool. *reserved_after: the slots reserved in total then.
  Result<uint64_t> ReserveLocked(SequenceId seq, int32_t slots, uint64_t* reserved_after);
  /// Gives a reservation back; false for an unknown id. *reserved_after as above.
  bool ReleaseLocked(uint64_t reservation, uint64_t* reserved_after);
  int64_t ReservedForLocked(SequenceId seq) const;
  int64_t ReservedTotalLocked() const;

  /// The queue of fetches waiting for slots, oldest first: a ticket for a fetch that starts
  /// waiting, its end, and whether a fetch holding `ticket` (0: not waiting) is behind an older one.
  uint64_t StartWaitLocked();
  void EndWaitLocked(uint64_t ticket) { waiters_.erase(ticket); }
  bool BehindLocked(uint64_t ticket) const { return !waiters_.empty() && *waiters_.begin() != ticket; }

  /// The live fetch handles holding pins.
  void AddHolderLocked(const Holder* h) { holders_.insert(h); }
  void RemoveHolderLocked(const Holder* h) { holders_.erase(h); }

 private:
  HotTier* tier_;
  std::unique_ptr<DemotionPolicy> policy_;
  const ChunkById* chunks_;
  struct Reservation {
    SequenceId seq = 0;
    int32_t slots = 0;
  };
  std::unordered_map<uint64_t, Reservation> reservations_;  // by id
  uint64_t next_reservation_ = 1;
  std::set<uint64_t> waiters_;  // tickets, oldest first
  uint64_t next_ticket_ = 1;
  std::unordered_set<const Holder*> holders_;
};

}  // namespace kvtier
