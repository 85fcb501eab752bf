// Recovery: what TieredStore::Open does with a data_dir that holds an earlier
// store. It reads the records of offload/store_records.h back from the cold
// tier and rebuilds the in-memory state (offload/store_state.h):
//  * the store record must match the options' layout (else InvalidArgument
//    naming both); a new directory gets one;
//  * every sequence comes back. A closed one is complete: its sinks and local
//    window are uploaded into fresh hot regions exactly as they were at close.
//    One that was never closed comes back read-only with every chunk the cold
//    tier acknowledged (a crash can leave holes: chunk k+1 acknowledged before
//    chunk k; chunks are addressed by index, so a hole reads back as NotFound,
//    never as someone else's tokens);
//  * chunks are cold-only (their metas are read, never their payloads).
//
// Kept apart from the store because it is the only code that turns disk bytes
// back into store state: reading it alone should be enough to know what a
// reopened store contains.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "offload/cold_tier.h"
#include "offload/hot_tier.h"
#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

struct RecoveredStore {
  std::unordered_map<SequenceId, std::unique_ptr<store_internal::Sequence>> sequences;
  std::unordered_map<uint64_t, store_internal::Chunk*> chunk_by_id;  // owned through sequences' layers
  uint64_t next_chunk_id = 1;
  SequenceId next_seq_id = 1;
  uint64_t cold_chunks = 0, cold_bytes = 0;  // chunks recovered (all acknowledged by the cold tier)
  uint64_t region_bytes = 0;                 // hot regions allocated for closed sequences
};

/// Rebuilds the store's state from `cold` into *out; hot regions come from `hot`.
/// On failure *out still holds everything built so far (chunks, hot regions), so the
/// caller frees it exactly as it frees its own state.
Status RecoverStore(const StoreOptions& options, ColdTier* cold, HotTier* hot, RecoveredStore* out);

/// Frees what RecoverStore built into *rec (hot regions from `hot`, the chunks): for a caller
/// that rebuilt a store only to check it (kvtier check), not to run it.
void FreeRecoveredStore(HotTier* hot, RecoveredStore* rec);

}  // namespace kvtier
