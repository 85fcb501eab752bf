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
// Device readers: it also owns which slots are EXPOSED (their address was handed to a device
// reader, TieredStore::WarmAddresses, through Expose), the warm epoch and the reader fence
// (WarmReaderFence, offload/store_types.h). An exposed slot never changes hands (its chunk's
// copy dropped, the chunk forgotten, the slabs freed) before FenceReaders ran: it moves the
// epoch (so a reader checking it under the fence's own lock after this is not waited for and
// asks again), calls the fence's WaitForReaders once, and then clears every exposed mark (the
// wait covered every read issued so far). A failed wait keeps the marks (the epoch moved: the
// readers ask again, harmlessly), and the slot is not given up. Slots never exposed turn over
// with no fence call. Invariant: a free slot is never exposed. The epoch is an atomic, read
// without the mutex (TieredStore::warm_epoch); everything else here is under it.
//
// Locking: guarded by the coordinator's mutex (StoreSync::mu). MakeRoom may drop it while it
// writes a victim down or waits, and holds it again on return. The fence is waited on with the
// mutex held, so that nothing a reuse decided changes during the wait; that cannot deadlock,
// because the fence only waits on device work already submitted and never calls the store.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "offload/demotion_policy.h"
#include "offload/host_memory.h"
#include "offload/store/chunk_catalog.h"
#include "offload/store/lower_tiers.h"
#include "offload/store/store_sync.h"
#include "offload/store_state.h"
#include "offload/store_types.h"
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
  /// policy's victim among acknowledged chunks; -1 when neither, or when the victim's slot is
  /// exposed and the reader fence failed (the victim stays; the caller keeps no warm copy).
  /// Never waits on other chunks and never writes; it waits on the fence for an exposed victim.
  int32_t AcquireForRead();
  void Release(int32_t slot) { slots_->Release(slot); }
  /// Puts `c` in warm at `slot` (filled): under the policy, kTierWarm set.
  void Hold(store_internal::Chunk* c, int32_t slot);
  /// Takes `c` out of warm (slot released, out of the policy); nothing when it holds no slot.
  /// The caller ran FenceFor(c) first (the slot is not exposed).
  void Forget(store_internal::Chunk* c);
  void OnAccess(uint64_t id) { policy_->OnAccess(id); }
  void OnScore(uint64_t id, float score) { policy_->OnScore(id, score); }

  /// Drops the warm copy of the policy's victim among unpinned chunks a lower tier has
  /// acknowledged (counted in demotions); false when there is none. An exposed victim is fenced
  /// first (FenceReaders); the fence's error is returned and the copy stays.
  Result<bool> DropVictimCopy();
  /// Waits until a slot is free (see the top of this file). `land` lands the chunks still
  /// landing and says whether any did (the store's Landing::LandEverything); `writer` writes an
  /// unacknowledged victim down. ResourceExhausted when warm is full with no lower tier, the
  /// sticky lower-tier error when the writes it would wait for are failing, the reader fence's
  /// error when the victim's slot is exposed and the fence failed (nothing dropped).
  Status MakeRoom(std::unique_lock<CountingMutex>& lock, StoreSync& sync, LowerWriter& writer,
                  const std::function<bool()>& land);

  uint8_t* slot_data(int32_t slot) { return slots_->slot_data(slot); }

  // ---- device readers (see the top of this file) ----
  /// The fence FenceReaders waits on (not owned; null: none, and a turnover of exposed slots
  /// only clears the marks and moves the epoch).
  void SetReaderFence(WarmReaderFence* fence) { fence_ = fence; }
  /// Marks `c`'s warm slot exposed (c holds one) and returns its data: [K chunk][V chunk].
  const uint8_t* Expose(const store_internal::Chunk* c);
  bool exposed(int32_t slot) const { return slot >= 0 && exposed_[static_cast<size_t>(slot)] != 0; }
  /// Slots exposed now.
  int32_t exposed_count() const { return exposed_count_; }
  /// Moves each time exposed slots are released to change hands; a handed-out address is
  /// valid while the epoch it came with is the current one. Lock-free.
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  /// When any slot is exposed: moves the epoch, waits on the fence (counted in
  /// warm_reader_fences), then clears every exposed mark. Nothing when none is. The fence's
  /// error is returned with the marks kept.
  Status FenceReaders();
  /// FenceReaders when `c`'s warm slot is exposed; nothing otherwise.
  Status FenceFor(const store_internal::Chunk* c);
  int32_t used() const { return slots_->used(); }
  int32_t capacity() const { return slots_->capacity(); }

 private:
  WarmTier() = default;
  std::unique_ptr<SlotPool> slots_;
  std::unique_ptr<DemotionPolicy> policy_;
  ChunkCatalog* catalog_ = nullptr;
  const LowerTiers* lower_ = nullptr;
  StoreCounters* counters_ = nullptr;
  WarmReaderFence* fence_ = nullptr;
  std::vector<uint8_t> exposed_;  // by slot: 1 while exposed
  int32_t exposed_count_ = 0;
  std::atomic<uint64_t> epoch_{0};
};

}  // namespace kvtier
