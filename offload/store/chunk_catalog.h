// ChunkCatalog: the records of the store's sealed chunks (store_internal::Chunk) by id, the
// next id, and the accounting of their representative keys in memory (metadata_bytes). It
// answers what readers ask of a layer's chunks (the landed end, their metadata, the change
// feed ChunkUpdatesSince with representatives read back from the lower tiers when they left
// memory) and forgets a chunk when it is dropped. A layer's table of its chunks by index
// (LayerState::chunks) and its drops (LayerState::dropped) live on the layer; the catalog owns
// the records they point to. Which tier holds a chunk's bytes is on its record, kept by the
// tiers' parts (WarmTier, HotPool, LowerTiers).
//
// Locking: guarded by the coordinator's mutex (StoreSync::mu). UpdatesSince may drop it to read
// representatives back (holding the sequence busy) and holds it again on return.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kvtier/options.h"
#include "offload/store/lower_tiers.h"
#include "offload/store/store_sync.h"
#include "offload/store_state.h"
#include "offload/store_types.h"
#include "store/status.h"

namespace kvtier {

class ChunkCatalog {
 public:
  using ById = std::unordered_map<uint64_t, store_internal::Chunk*>;

  ChunkCatalog(const StoreOptions& options, size_t token_bytes);

  /// A new record for chunk `key`, registered under a fresh id; `repr` (the representatives'
  /// room, storage dtype) is held in memory. The caller puts it on its layer.
  store_internal::Chunk* Create(const ChunkKey& key, int64_t first_token, std::vector<uint8_t> repr);
  /// Registers a record built elsewhere (an attached sequence's chunks): it gets a fresh id.
  void Register(store_internal::Chunk* c);
  /// Unregisters and deletes a record (its slots must be released already).
  void Forget(store_internal::Chunk* c);
  /// The record of `id`, or null when it was dropped.
  store_internal::Chunk* Find(uint64_t id) const;
  const ById& by_id() const { return by_id_; }
  /// Takes over what recovery rebuilt: records (owned through their layers) and the next id.
  void Adopt(ById chunks, uint64_t next_id);

  /// Releases the chunk's in-memory representatives once a tier in `meta_tiers` (tiers that read
  /// metas alone, LowerTiers::meta_tiers) acknowledged its meta record and it holds no warm
  /// copy and is not being written: that record is then the other copy of these bytes.
  void ReleaseReprIfDurable(store_internal::Chunk* c, uint8_t meta_tiers);
  /// Host bytes of the records and of the representatives held in memory (TieredStore::metadata_bytes).
  uint64_t MetadataBytes() const;

  /// The end of what readers see of a layer's chunks: the index of its oldest chunk still
  /// landing, or chunks.size().
  static uint64_t LandedEnd(const store_internal::LayerState& ls);
  /// ChunkInfo of the landed chunks of a layer, in token order.
  std::vector<ChunkInfo> List(const store_internal::LayerState& ls) const;
  /// TieredStore::ChunkUpdatesSince of layer `layer` of `s` (checked by the caller, who holds
  /// `lock`). Drops the lock to read released representatives back through `lower`, holding
  /// `s` busy (and notifying `sync.cv` when it lets go).
  Status UpdatesSince(std::unique_lock<CountingMutex>& lock, StoreSync& sync, const LowerTiers& lower,
                      store_internal::Sequence* s, int layer, const ChunkCursor& since, ChunkUpdate* out,
                      size_t max_added) const;

 private:
  const StoreOptions& options_;
  size_t repr_bytes_;  // one chunk's representatives, storage dtype
  ById by_id_;
  uint64_t next_id_ = 1;
  uint64_t repr_chunks_ = 0;  // records holding their representatives in memory (non-empty repr)
};

}  // namespace kvtier
