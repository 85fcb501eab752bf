// WarmTier: the warm tier, host slabs of one chunk each (pinned when a CUDA device is present),
// and its demotion policy. It hands out slots (a sealed chunk's, a chunk read back from a lower
// tier), holds chunks under the policy, and makes room: MakeRoom drops warm copies the lower
// tiers already acknowledged, writes an unacknowledged victim down first (LowerWriter), lands
// chunks still landing (their slots are the only room left), and otherwise waits for a busy
// chunk to finish. A chunk leaves warm only once a lower tier acknowledged it; its
// representatives leave memory with it when that tier reads metas alone
// (ChunkCatalog::ReleaseReprIfDurable). A chunk's warm_slot, warm_pins and kTierWarm bit are on
// its record.
//
// Locking: guarded by the coordinator's mutex (StoreSync::mu). MakeRoom may drop it while it
// writes a victim down or waits, and holds it again on return.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "offload/demotion_policy.h"
#include "offload/host_memory.h"
#include "offload/store/chunk_catalog.h"
#include "offload/store/lower_tiers.h"
#include "offload/store/store_sync.h"
#include "offload/store_state.h"
#include "store/status.h"

namespace kvtier {

class LowerWriter;

class WarmTier {
 public:
  /// The slabs (options.warm_bytes, chunks of `chunk_bytes`) and options.warm_policy; the
  /// catalog, tiers and counters are the store's and outlive it.
  static Result<std::unique_ptr<WarmTier>> Create(const StoreOptions& options, size_t chunk_bytes,
                                                  ChunkCatalog* catalog, const LowerTiers* lower,
                                                  StoreCounters* counters);

  /// A free slot, or -1.
  int32_t Acquire() { return slots_->Acquire(); }
  /// A slot for a chunk just read from a lower tier: a free one, or one freed by dropping the
  /// policy's victim among acknowledged chunks; -1 when neither (never waits, never writes).
  int32_t AcquireForRead();
  void Release(int32_t slot) { slots_->Release(slot); }
  /// Puts `c` in warm at `slot` (filled): under the policy, kTierWarm set.
  void Hold(store_internal::Chunk* c, int32_t slot);
  /// Takes `c` out of warm (slot released, out of the policy); nothing when it holds no slot.
  void Forget(store_internal::Chunk* c);
  void OnAccess(uint64_t id) { policy_->OnAccess(id); }
  void OnScore(uint64_t id, float score) { policy_->OnScore(id, score); }

  /// Drops the warm copy of the policy's victim among unpinned chunks a lower tier has
  /// acknowledged (counted in demotions); false when there is none.
  bool DropVictimCopy();
  /// Waits until a slot is free (see the top of this file). `land` lands the chunks still
  /// landing and says whether any did (the store's Landing::LandEverything); `writer` writes an
  /// unacknowledged victim down. ResourceExhausted when warm is full with no lower tier, the
  /// sticky lower-tier error when the writes it would wait for are failing.
  Status MakeRoom(std::unique_lock<CountingMutex>& lock, StoreSync& sync, LowerWriter& writer,
                  const std::function<bool()>& land);

  uint8_t* slot_data(int32_t slot) { return slots_->slot_data(slot); }
  int32_t used() const { return slots_->used(); }
  int32_t capacity() const { return slots_->capacity(); }

 private:
  WarmTier() = default;
  std::unique_ptr<SlotPool> slots_;
  std::unique_ptr<DemotionPolicy> policy_;
  ChunkCatalog* catalog_ = nullptr;
  const LowerTiers* lower_ = nullptr;
  StoreCounters* counters_ = nullptr;
};

}  // namespace kvtier
