// Promoter: promotion into hot slots. Fetch takes every hot slot a fetch needs or none
// (waiting for pins to drop, oldest waiter first, within the hot slot reservations, never for
// pins its own thread holds; with FetchFit::kWithinClaims it leaves out a grant's tail that
// other sequences' reservations claim: see TieredStore::FetchChunks), pins the chunks under a
// lease, and Run copies them in (a warm copy, or a lower-tier read through the transfer engine,
// keeping a warm copy when a slot is free or can be freed). FetchHandle waits for and releases
// the pins. HotPool (offload/store/hot_pool.h) keeps who holds which slot: the policy, the
// reservations, the waiters and the live handles, and says why nothing deadlocks.
//
// FetchToWarm is the warm-only fetch: it brings chunks back from the lower tiers into warm
// slots (no hot slot, no upload, nothing waited for on the caller's thread) on a transfer
// worker, for a device reader that reads warm copies (the session's device lane);
// WarmFetchHandle says when it is done.
//
// Locking: guarded by the coordinator's mutex (StoreSync::mu). Fetch decides and pins under
// one lock entry; Run takes it twice per fetch (pin the warm copies and reserve read slots,
// then publish), never per chunk, and copies without it; a chunk loading into a hot slot is
// marked hot_loading until then.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "offload/hot_tier.h"
#include "offload/store/chunk_catalog.h"
#include "offload/store/hot_pool.h"
#include "offload/store/landing.h"
#include "offload/store/sequence_table.h"
#include "offload/store/store_sync.h"
#include "offload/store/warm_tier.h"
#include "offload/store_hooks.h"
#include "offload/store_types.h"
#include "store/status.h"

namespace kvtier {

class TransferEngine;

/// Completion handle of an asynchronous fetch. Wait() returns the transfer's
/// status; a wait that times out does not cancel the transfer. Until Release()
/// (or destruction, or the lease running out) the chunks stay pinned in hot
/// slots and spans() point at them. After the lease runs out, or after the
/// sequence is dropped, the spans may point at reused slots. Release or
/// destroy every handle before the store that issued it.
class FetchHandle {
 public:
  FetchHandle() = default;
  ~FetchHandle();
  FetchHandle(FetchHandle&&) noexcept;
  FetchHandle& operator=(FetchHandle&&) noexcept;
  FetchHandle(const FetchHandle&) = delete;
  FetchHandle& operator=(const FetchHandle&) = delete;

  bool Ready() const;
  Status Wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));
  /// One span per chunk fetched, in request order (valid after Wait() returned OK): every
  /// requested chunk, or the first ones a FetchFit::kWithinClaims fetch kept.
  const std::vector<kernels::KvSpan>& spans() const;
  /// Unpins the chunks; the handle becomes empty.
  void Release();
  bool empty() const { return state_ == nullptr; }

 private:
  friend class Promoter;

 public:
  struct State;  // internal
 private:
  std::shared_ptr<State> state_;
};

/// Completion handle of a warm-only fetch (TieredStore::FetchToWarm). It pins nothing: once
/// Ready(), each chunk it read is in warm (until warm's policy demotes it again) or its status
/// says why not. Dropping the handle does not cancel the read. Destroy every handle before the
/// store that issued it.
class WarmFetchHandle {
 public:
  /// Done (or empty); lock-free, never waits.
  bool Ready() const;
  /// Waits for the reads (at most `timeout`, which does not cancel them) and returns how they went:
  /// the first failed read naming its chunk, ResourceExhausted naming a chunk warm had no room
  /// for (it stays where it was: in the lower tiers), OK when every chunk is in warm.
  Status Wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) const;
  /// Wait's answer once Ready() (OK for an empty handle); FailedPrecondition before.
  Status status() const;
  /// Chunks this fetch reads from a lower tier (the others were in warm, or being read by an
  /// earlier warm-only fetch, when it was issued).
  size_t reads() const;
  bool empty() const { return state_ == nullptr; }

  struct State;  // internal

 private:
  friend class Promoter;
  std::shared_ptr<State> state_;
};

class Promoter {
 public:
  /// The store's parts it moves chunks between; all outlive it.
  struct Parts {
    HotTier* hot = nullptr;
    HotPool* pool = nullptr;
    WarmTier* warm = nullptr;
    ChunkCatalog* catalog = nullptr;
    SequenceTable* sequences = nullptr;
    Landing* landing = nullptr;
    TransferEngine* engine = nullptr;
    StoreSync* sync = nullptr;
    StoreCounters* counters = nullptr;
  };
  Promoter(const StoreOptions& options, const StoreHooks& hooks, size_t chunk_bytes, const Parts& parts)
      : options_(options), hooks_(hooks), chunk_bytes_(chunk_bytes), parts_(parts) {}

  /// TieredStore::FetchChunks (its contract is written there).
  Result<FetchHandle> Fetch(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices,
                            FetchFit fit);
  /// TieredStore::FetchToWarm (its contract is written there).
  Result<WarmFetchHandle> FetchToWarm(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices);

 private:
  friend class WarmFetchHandle;
  /// Reads a warm-only fetch's chunks from the lower tiers into warm slots and marks it done.
  void RunToWarm(const std::shared_ptr<WarmFetchHandle::State>& st);
  friend class FetchHandle;
  /// Copies a fetch's loads into their hot slots and marks it done.
  void Run(const std::shared_ptr<FetchHandle::State>& st);
  /// Waits for the fetch's transfer to finish, then unpins its chunks: one lock entry.
  void Release(FetchHandle::State* st);
  bool CompleteLocked(const FetchHandle::State* st) const;

  const StoreOptions& options_;
  const StoreHooks& hooks_;
  size_t chunk_bytes_;
  Parts parts_;
};

}  // namespace kvtier
