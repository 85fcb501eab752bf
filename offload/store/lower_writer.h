// LowerWriter: chunks going down to the lower tiers (LowerTiers, the ordered list behind
// offload/lower_tier.h) through the transfer engine. Submit hands a landed chunk's
// write-through to the engine; Write writes one synchronously (demotion, CloseSequence);
// WriteDown writes a warm chunk down with the coordinator's lock dropped. LowerTiers
// acknowledges what the tiers took (on the chunk record and in the counters) and keeps the
// sticky error of a failed background write.
//
// Locking: the chunk being written is pinned (lower_writing, warm_pins) so its warm slot and
// key stay valid while transfer threads read them without the coordinator's mutex
// (StoreSync::mu); acknowledgements are recorded under it. A chunk's meta is encoded on the
// calling thread from fields that never change once it landed, with the score the caller
// snapshotted under the lock.
#pragma once

#include <cstdint>
#include <mutex>

#include "kvtier/counters.h"
#include "offload/store/lower_tiers.h"
#include "offload/store/store_sync.h"
#include "offload/store_state.h"
#include "store/status.h"

namespace kvtier {

class TransferEngine;

class LowerWriter {
 public:
  /// Everything is the store's and outlives the writer.
  LowerWriter(TransferEngine* engine, LowerTiers* lower, StoreSync* sync, StoreCounters* counters,
              size_t chunk_bytes)
      : engine_(engine), lower_(lower), sync_(sync), counters_(counters), chunk_bytes_(chunk_bytes) {}

  /// Writes `c` (its bytes at `payload`) to the lower tiers now and acknowledges what they
  /// took. Called without the lock, `c` pinned by the caller. A later tier's refusal of what an
  /// earlier one acknowledged is still returned (the chunk is durable all the same).
  Status Write(store_internal::Chunk* c, const uint8_t* payload, float score);
  /// Hands the write to the transfer engine. `c` must be marked lower_writing with a warm pin,
  /// which the completion clears (a failure becomes the sticky background error).
  void Submit(store_internal::Chunk* c, const uint8_t* payload, float score);
  /// Writes a warm chunk the lower tiers have not acknowledged (`payload` its warm slot),
  /// pinning it while the lock is dropped.
  Status WriteDown(std::unique_lock<CountingMutex>& lock, store_internal::Chunk* c, const uint8_t* payload);

 private:
  TransferEngine* engine_;
  LowerTiers* lower_;
  StoreSync* sync_;
  StoreCounters* counters_;
  size_t chunk_bytes_;
};

}  // namespace kvtier
