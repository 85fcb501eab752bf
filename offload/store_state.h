// TieredStore's in-memory state: sequences, their layers and their chunks.
// Internal to offload/ (tiered_store.cc, the parts in offload/store/ and store_recovery.cc
// build it); not part of the public API.
//
// Locking: every mutable field is guarded by TieredStore's mutex, except where
// a field says otherwise. A chunk's id, key and first_token never change, so transfer
// threads may read them without the lock while the chunk is pinned. Its repr is chosen
// once (at landing) and never changes; it is released (emptied, under the lock) only once
// the chunk holds no warm copy, is not being written and a lower tier that reads metas
// alone acknowledged its meta record (TieredStore::MaybeReleaseReprLocked), so a writer
// of an unacknowledged chunk may read it without the lock.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "offload/clock.h"
#include "offload/hot_tier.h"
#include "offload/store_records.h"
#include "store/chunk.h"

namespace kvtier {
namespace store_internal {

using store_records::SeqState;

struct Chunk {
  uint64_t id = 0;
  ChunkKey key;
  int64_t first_token = 0;
  // [repr_topk, repr heads, head_dim] in storage dtype (StoreOptions::repr_head_count()); empty once released
  // (read back from the chunk's meta record in the lower tiers) and for a chunk recovered at Open.
  std::vector<uint8_t> repr;
  uint8_t tiers = kTierNone;
  int32_t warm_slot = -1;
  int32_t hot_slot = -1;
  int warm_pins = 0;                 // internal copies reading/writing the warm slot
  int hot_pins = 0;                  // FetchHandles holding the hot slot
  Clock::time_point pin_deadline{};  // from StoreHooks::clock
  bool hot_loading = false;          // hot slot assigned, bytes not there yet
  bool warm_reading = false;         // a warm-only fetch is reading it from a lower tier (Promoter)
  bool lower_acked = false;
  bool lower_writing = false;
  // Sealed, its download into the warm slot not landed yet (LandingChunk): readers do not
  // see it (TieredStore: "Landing"); cleared under the store mutex when it lands.
  bool landing = false;
  // Written by SetChunkScores under the store mutex. A cold write encodes the
  // score it snapshotted under the mutex when it was issued, never this field
  // from a transfer thread.
  float score = 0.0f;

  /// A transfer still reads or writes its bytes (a warm read, a lower-tier write, a hot load, a
  /// warm-only fetch): dropping it waits for this to clear.
  bool transferring() const { return warm_pins > 0 || lower_writing || hot_loading || warm_reading; }
};

/// A sealed chunk whose ring -> warm download was submitted (HotTier::DownloadBatchAsync)
/// and has not landed yet. Until the sequence's driver lands it (TieredStore::LandLayerLocked)
/// the chunk sits in LayerState::chunks at its index (Chunk::landing), holding its warm slot
/// with warm_pins = 1, but is not held by warm (not in the warm policy), not fetchable, not
/// indexed, not written to a lower tier and not demotable; readers skip it.
struct LandingChunk {
  Chunk* chunk = nullptr;
  TransferTicket ticket = kCompletedTransfer;
  // [repr heads, chunk_size]: the attention mass its tokens received in the local window,
  // snapshotted at seal time (the ring positions are reset and reused right after).
  std::vector<float> mass;
};

struct LayerState {
  // Sinks and local ring are owned by the sequence's driving thread (one at a
  // time), not by the store mutex.
  uint8_t* sink_k = nullptr;  // [n_sink, kv_heads, head_dim]
  uint8_t* sink_v = nullptr;
  uint8_t* ring_k = nullptr;  // [ring, kv_heads, head_dim], token p at (p - n_sink) % ring
  uint8_t* ring_v = nullptr;
  std::vector<float> ring_mass;  // [repr heads, ring] attention mass while in the local window
  int64_t n_tokens = 0;
  int64_t sealed_end = 0;      // first position not yet in a chunk (>= n_sink once sinks are full)
  bool sinks_restored = true;  // false for a recovered sequence without a sinks record
  std::vector<Chunk*> chunks;  // by chunk index; null for a dropped chunk or a hole left by a crash
  // Under the store mutex: the chunk indices DropChunks removed, in drop order (the
  // retrieval indexes over the layer read it through TieredStore::ChunkUpdatesSince).
  std::vector<uint64_t> dropped;
  // Of an attached sequence: chunks [0, shared_chunks) are the publisher's (remote only, never
  // written or deleted here); later ones are this store's own. Fixed at attach.
  uint64_t shared_chunks = 0;
  // Guarded by the store mutex: chunks sealed from this layer whose download has not landed,
  // oldest first; how many landings threads have claimed and run without the lock; and the
  // first landing failure no call has reported yet (TieredStore::TakeLandingErrorLocked).
  std::deque<LandingChunk> landing;
  int landers = 0;
  Status landing_error;
};

struct Sequence;
/// Whether chunk `key` of `s` is a publisher's chunk (see Sequence::attached).
bool SharedChunk(const Sequence* s, const ChunkKey& key);

struct Sequence {
  SequenceId id = 0;
  SeqState state = SeqState::kOpen;
  std::vector<LayerState> layers;
  int busy = 0;  // operations in progress that must finish before a drop
  // Attached from another store's publication (TieredStore::AttachPublished): its shared
  // chunks (LayerState::shared_chunks) live only in the remote tier under the publisher's
  // namespace and sequence id; tokens appended here are this store's own.
  // Set before the sequence becomes visible and never changed: read without the lock.
  bool attached = false;
  std::string remote_ns;
  SequenceId remote_seq = 0;
};

inline bool SharedChunk(const Sequence* s, const ChunkKey& key) {
  return s->attached && key.index < s->layers[key.layer].shared_chunks;
}

}  // namespace store_internal
}  // namespace kvtier
