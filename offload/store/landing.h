// Landing: sealing a layer's oldest ring chunk and completing it. Seal takes a warm slot
// (WarmTier::MakeRoom), creates the chunk's record (ChunkCatalog), submits the download of its
// tokens from the ring into the slot (HotTier::DownloadBatchAsync: asynchronous on a device tier,
// done at submit on the host tier) and queues it on the layer (LayerState::landing). Landing a
// chunk waits for its download, chooses its representative keys from the warm copy, puts it in
// warm (WarmTier::Hold) and issues its write-through (LowerWriter::Submit). Until then the chunk
// is not fetchable, not indexed, not written down and not demotable, and readers do not see it
// ("Landing" in offload/tiered_store.h says who lands, and when).
//
// It owns the count of chunks landing in the whole store and of landings that failed; a
// layer's queue, its landers and its unreported failure are on the layer (LayerState).
//
// Locking: guarded by the coordinator's mutex (StoreSync::mu). A lander claims the queue's
// oldest entry under it, then drops it to wait for the download and choose representatives
// (nobody reads the chunk's repr before it is published, under the mutex again). The sequence is
// held busy while the mutex is dropped, so a concurrent DropSequence waits instead of freeing the
// layer.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "offload/hot_tier.h"
#include "offload/store/chunk_catalog.h"
#include "offload/store/layer_ring.h"
#include "offload/store/lower_tiers.h"
#include "offload/store/lower_writer.h"
#include "offload/store/sequence_table.h"
#include "offload/store/store_sync.h"
#include "offload/store/warm_tier.h"
#include "offload/store_state.h"
#include "store/status.h"

namespace kvtier {

class Landing {
 public:
  /// The store's parts it moves chunks between; all outlive it.
  struct Parts {
    HotTier* hot = nullptr;
    WarmTier* warm = nullptr;
    ChunkCatalog* catalog = nullptr;
    LowerWriter* writer = nullptr;
    const LowerTiers* lower = nullptr;
    SequenceTable* sequences = nullptr;
    StoreSync* sync = nullptr;
    StoreCounters* counters = nullptr;
    std::function<bool()> hold_landing;  ///< StoreHooks::hold_landing (may be empty)
  };
  Landing(const StoreOptions& options, size_t chunk_bytes, const LayerRing& ring, const Parts& parts);

  /// Seals the oldest chunk of a full ring of layer `layer` of `s` (called by its driver,
  /// without the lock; `s` held busy). Waits for warm room first. A failed submit leaves the
  /// tokens in the ring (the next Append seals them again). A host tier's chunk lands before
  /// this returns; a device tier's lands later, or here when more than max_landing_chunks of
  /// the layer are in flight.
  Status Seal(store_internal::Sequence* s, int layer);
  /// Lands the oldest landing chunks of one layer until at most `keep` are left; with
  /// `only_complete`, stops at the first whose download is not complete yet (never waits for a
  /// download). With keep == 0 and !only_complete, also waits for landings other threads
  /// claimed, so that on return no chunk of the layer is landing. Failures go to the layer's
  /// landing_error.
  void LandLayer(std::unique_lock<CountingMutex>& lock, store_internal::Sequence* s, int layer,
                 size_t keep = 0, bool only_complete = false);
  /// The layer's chunks still landing (queued, not claimed by a lander), in seal order.
  void ListLanding(const store_internal::LayerState& ls, std::vector<SealingChunk>* out) const;
  /// Every layer of the sequence landed completely.
  void LandSequence(std::unique_lock<CountingMutex>& lock, store_internal::Sequence* s);
  /// Every sequence landed completely; whether anything landed (by this thread or another it waited for).
  bool LandEverything(std::unique_lock<CountingMutex>& lock);
  /// The layer's (or sequence's) unreported landing failure, cleared; OK when none.
  static Status TakeError(store_internal::LayerState& ls);
  static Status TakeError(store_internal::Sequence* s);
  /// Sealed chunks of the store whose download has not landed yet.
  uint64_t in_flight() const { return in_flight_; }

 private:
  const StoreOptions& options_;
  size_t chunk_bytes_;
  const LayerRing& ring_;
  Parts parts_;
  uint64_t in_flight_ = 0;  // sealed chunks whose warm slot is still being filled (every layer)
  uint64_t failures_ = 0;   // landings that lost their chunk (with chunks_sealed: landing progress)
};

}  // namespace kvtier
