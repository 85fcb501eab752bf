// StoreSync: the coordinator's lock, shared by the store's parts. TieredStore owns it; every
// part that keeps mutable state (SequenceTable, ChunkCatalog, WarmTier, Landing, LowerTiers'
// acknowledgements, HotPool) is guarded by `mu`, and waits for transfers and unpins on `cv`.
// One lock for all of them is deliberate: a fetch decides what moves between the tiers and
// pins it in one lock entry, and a layer step reads what it needs in one (offload/store/layer_step.cc).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>

#include "offload/store/counting_mutex.h"

namespace kvtier {

struct StoreSync {
  CountingMutex mu;
  /// Signalled when a transfer finishes, a pin or a warm pin drops, a landing completes, or a
  /// sequence stops being busy.
  std::condition_variable_any cv;
};

/// Calls of the store's public API so far (TieredStoreTestPeer::Visits: a layer step's are held
/// to a bound by a test): a relaxed counter.
class CallCounter {
 public:
  void Count() { n_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t value() const { return n_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> n_{0};
};

}  // namespace kvtier
