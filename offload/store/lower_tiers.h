// LowerTiers: the tiers below warm as one object, in order (the cold tier, RocksDB, then the
// remote tier, Redis; each behind offload/lower_tier.h). It owns the list and what is about all
// of them at once: the reads that fall through the list (a chunk's payload, its
// representatives from its meta record), the removals, a chunk's acknowledgement (what the
// tiers acknowledged, on the chunk record and in the counters), the sticky background write
// error and its window, and the acknowledgement listener (a test hook). Writes go through the
// transfer engine (TieredStore::SubmitLowerWrite, WriteLower), which holds the same list.
// "Cold" names the RocksDB tier alone (cold()); "lower" any tier of the list.
//
// Locking: the list is fixed at Open and read without a lock (every LowerTier locks itself).
// The sticky error, the listener and a chunk's acknowledgement are guarded by
// TieredStore::mu_ (members named ...Locked): a layer step reads the error under the one lock
// entry it already holds (TieredStore::BeginLayerStep).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kvtier/counters.h"
#include "offload/cold_tier.h"
#include "offload/lower_tier.h"
#include "offload/remote_tier.h"
#include "offload/store_state.h"
#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

class LowerTiers {
 public:
  using Tiers = std::vector<std::unique_ptr<LowerTier>>;
  using AckListener = std::function<void(const ChunkKey&)>;

  /// Appends a tier below the ones added so far (at Open: cold first, then remote; tests add
  /// tiers of their own with Add).
  void Add(std::unique_ptr<LowerTier> tier);
  void AddCold(std::unique_ptr<ColdTier> cold);
  void AddRemote(std::unique_ptr<RemoteTier> remote);

  bool empty() const { return tiers_.empty(); }
  size_t size() const { return tiers_.size(); }
  LowerTier* operator[](size_t i) const { return tiers_[i].get(); }
  Tiers::const_iterator begin() const { return tiers_.begin(); }
  Tiers::const_iterator end() const { return tiers_.end(); }
  /// The RocksDB tier (sequence records, recovery) and the Redis tier (publications); null when absent.
  ColdTier* cold() const { return cold_; }
  RemoteTier* remote() const { return remote_; }
  /// TierBits of the tiers that read chunk metas alone (LowerTier::reads_chunk_meta).
  uint8_t meta_tiers() const { return meta_tiers_; }

  /// Reads a chunk of `s` no memory tier holds, trying the tiers in order (each serves what
  /// the ones before lost or damaged); every failure is in the error.
  Status ReadChunk(const store_internal::Sequence* s, const ChunkKey& key, void* dst, size_t bytes) const;
  /// One chunk of ReadReprs: its key and room for the representatives' bytes.
  struct ReprRead {
    ChunkKey key;
    uint8_t* dst = nullptr;
    Status status;  ///< the outcome, naming the chunk
  };
  /// Reads the representatives (`repr_bytes` each, storage dtype) of chunks of `s` from their
  /// meta records in the tiers that read metas alone, in order, in batches. Returns the first
  /// failure (each read has its own).
  Status ReadReprs(const store_internal::Sequence* s, size_t repr_bytes, std::vector<ReprRead>* reads) const;
  /// Removes chunks, `per_tier[t]` from tier t (what the caller found that tier may hold).
  Status RemoveChunks(const std::vector<std::vector<ChunkKey>>& per_tier) const;
  /// Removes a sequence: its record and `per_tier[t]` from tier t.
  Status RemoveSequence(SequenceId seq, const std::vector<std::vector<ChunkKey>>& per_tier) const;
  /// Adds the tiers' own counters; host memory their machinery holds.
  void AddCounters(StoreCounters* c) const;
  uint64_t memory_bytes() const;

  /// Marks chunk `c` acknowledged by the tiers in `acks` (TierBits, at least one), counting it
  /// once in `counters` (a chunk of `chunk_bytes`); returns the listener to call outside the lock.
  AckListener AckLocked(store_internal::Chunk* c, uint8_t acks, size_t chunk_bytes, StoreCounters* counters);
  void SetAckListenerLocked(AckListener listener) { ack_listener_ = std::move(listener); }
  /// Uncounts a chunk that is going away (dropped) from what `counters` say the cold tier holds.
  static void ForgetLocked(const store_internal::Chunk* c, size_t chunk_bytes, StoreCounters* counters);
  /// The chunks the cold tier acknowledged and that were not dropped since, read from its
  /// manifest (ColdTier::AcknowledgedChunks); empty without a cold tier, where nothing is durable.
  std::vector<ChunkRange> AcknowledgedChunks() const;
  /// The acknowledged chunks found missing when the store was opened and accepted as lost
  /// (accept_lost_chunks); empty otherwise.
  std::vector<ChunkRange> LostChunks() const;

  /// A failed background write: held (sticky) unless one is held already and still in its window.
  void RecordWriteFailureLocked(const Status& st);
  /// The sticky error while it is in the way: until TakeBackgroundErrorLocked reports it, or
  /// until the tiers' error window after it has passed. OK when none.
  Status BackgroundErrorLocked() const;
  /// The held error, cleared (whether or not its window has passed); OK when none.
  Status TakeBackgroundErrorLocked();
  /// Whether a held error stops being in the way after a window (a remote tier's retry window).
  bool errors_expire() const { return error_window_ != std::chrono::milliseconds::max(); }

 private:
  Tiers tiers_;
  ColdTier* cold_ = nullptr;
  RemoteTier* remote_ = nullptr;
  uint8_t meta_tiers_ = 0;
  // How long a failed background write stays in the way: the shortest window of the tiers;
  // max(): until TakeBackgroundErrorLocked reports it.
  std::chrono::milliseconds error_window_ = std::chrono::milliseconds::max();
  // Guarded by TieredStore::mu_.
  AckListener ack_listener_;
  Status background_error_;
  std::chrono::steady_clock::time_point background_error_until_;
};

}  // namespace kvtier
