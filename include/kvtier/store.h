// kvtier::Store: the KV memory an engine opens once and shares between its sessions (the
// tiers: hot slots, warm host memory, the RocksDB cold tier, the Redis remote tier). An
// engine opens it, hands it to Session::Open for each sequence, reads its counters, and
// destroys it after the last session. The store's internals (TieredStore, in offload/) are
// not part of this API.
//
// Threading: every call may come from any thread; destroying the store must not race any
// call on it or on its sessions. Destroy every Session before the store.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "kvtier/status.h"
#include "kvtier/types.h"

namespace kvtier {

class Store {
 public:
  /// Opens (and, with a data_dir holding an earlier store, recovers) a store.
  /// InvalidArgument names a bad option (StoreOptions::Validate); a damaged cold tier is
  /// Corruption naming the lost chunks (see StoreOptions::accept_lost_chunks).
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  virtual ~Store() = default;

  /// The options the store was opened with.
  virtual const StoreOptions& options() const = 0;
  /// Every sequence the store holds (recovered ones included), in no particular order.
  virtual std::vector<SequenceId> ListSequences() const = 0;
  /// Tokens appended to one layer of a sequence; NotFound for an unknown sequence.
  virtual Result<int64_t> SequenceLength(SequenceId seq, int layer) const = 0;
  /// Sealed chunks of one layer of a sequence (dropped ones included: their indices stay),
  /// as far as they have landed (a chunk sealed on a device lands on its sequence's next call).
  virtual Result<uint64_t> ChunkCount(SequenceId seq, int layer) const = 0;
  /// Persists the sinks and the local window; the sequence becomes read-only.
  virtual Status CloseSequence(SequenceId seq) = 0;
  /// Removes the sequence from every tier.
  virtual Status DropSequence(SequenceId seq) = 0;
  /// Waits until every chunk written so far is acknowledged by the lower tiers (durable
  /// across SIGKILL) and returns the first failed background write, if any.
  virtual Status WaitForDurable() = 0;
  /// A consistent snapshot of the store's counters.
  virtual StoreCounters counters() const = 0;
  /// Publishes a closed sequence under `name` in the remote tier, for other stores to attach.
  virtual Status PublishSequence(SequenceId seq, std::string_view name) = 0;
  /// A sequence another store published under `name` (NotFound until it exists).
  virtual Result<SequenceId> AttachPublished(std::string_view name) = 0;

 protected:
  Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;
};

}  // namespace kvtier
