// TieredStoreTestPeer: the test-only door into TieredStore (a friend). Hooks that tests and
// their child processes need and an engine must not call live here, not in the store's
// public API.
#pragma once

#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "offload/store_state.h"
#include "offload/tiered_store.h"
#include "offload/transfer_engine.h"

namespace kvtier {

class TieredStoreTestPeer {
 public:
  /// Runs `listener` (on a transfer thread) each time the lower tiers acknowledge a chunk:
  /// from then on it is in LowerTiers::AcknowledgedChunks. The crash and soak children
  /// print it, so that the parent knows what a reopen after SIGKILL must bring back.
  static void SetAckListener(TieredStore& store, std::function<void(const ChunkKey&)> listener) {
    std::lock_guard<CountingMutex> l(store.sync_.mu);
    store.lower_.SetAckListenerLocked(std::move(listener));
  }

  /// Calls of the store's public API so far (each public member function counts once per call;
  /// the inline accessors options(), hot_tier() and lower_tiers() and the FetchHandle's own
  /// calls do not).
  static uint64_t Visits(const TieredStore& store) { return store.visits_.value(); }
  /// Entries into the store's mutex so far, by any thread (a wait's re-entry included).
  static uint64_t LockEntries(const TieredStore& store) { return store.sync_.mu.entries(); }

  /// Tasks the store has handed its transfer engine so far.
  static uint64_t TransferTasks(const TieredStore& store) { return store.engine_->enqueued(); }

  /// A copy of the attention mass the local ring of (seq, layer) holds, [kv_heads, n_local +
  /// chunk_size] by ring slot (token p at (p - n_sink) % ring); empty for an unknown sequence.
  /// Call from the sequence's driving thread (the ring is that thread's).
  static std::vector<float> RingMass(TieredStore& store, SequenceId seq, int layer) {
    std::lock_guard<CountingMutex> l(store.sync_.mu);
    const store_internal::Sequence* s = store.sequences_->Find(seq);
    if (s == nullptr || layer < 0 || layer >= static_cast<int>(s->layers.size())) return {};
    return s->layers[static_cast<size_t>(layer)].ring_mass;
  }
};

}  // namespace kvtier
