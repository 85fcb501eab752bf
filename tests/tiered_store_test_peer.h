// TieredStoreTestPeer: the test-only door into TieredStore (a friend). Hooks that tests and
// their child processes need and an engine must not call live here, not in the store's
// public API.
#pragma once

#include <functional>
#include <utility>

#include "offload/tiered_store.h"

namespace kvtier {

class TieredStoreTestPeer {
 public:
  /// Runs `listener` (on a transfer thread) each time the lower tiers acknowledge a chunk:
  /// from then on it is in TieredStore::AcknowledgedChunks. The crash and soak children
  /// print it, so that the parent knows what a reopen after SIGKILL must bring back.
  static void SetAckListener(TieredStore& store, std::function<void(const ChunkKey&)> listener) {
    store.SetColdAckListener(std::move(listener));
  }
};

}  // namespace kvtier
