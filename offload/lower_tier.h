// LowerTier: one tier below the warm tier, the kind that acknowledges chunks (holds them
// durably or shared), behind one small interface. TieredStore holds its lower tiers as an
// ordered list, fastest and most local first (today the RocksDB cold tier, then the Redis
// remote tier), and writes the three rules that involve them once, as loops over the list:
//
//  * Write-through (TransferEngine::WriteChunk): a chunk is put to each tier in order; the
//    first refusal stops the walk and is the write's error. The tiers that acknowledged it
//    before the refusal still have it: the chunk counts as acknowledged once any tier
//    acknowledged it (so a chunk RocksDB acknowledged and Redis refused may leave warm and
//    is read back from RocksDB; the Redis error is reported as a background error).
//  * Fall-through reads (TransferEngine::CopyLoads, the store's ReadLowerTier): a chunk no
//    memory tier holds is read from each tier in order until one serves it; when every
//    tier tried failed, the error names each failure, in order.
//  * Meta reads (GetChunkMetas, the store's ReadLowerTierRepr): a chunk whose representative
//    keys the store released from memory (see TieredStore::metadata_bytes) has them read back
//    from its meta record, from each tier that reads metas alone (reads_chunk_meta()) in order
//    until one serves it.
//  * Counters: each tier counts the fetched chunks it served (CountLoad) and adds its own
//    counters to a snapshot (AddCounters).
//
// Tier-specific features stay with the concrete classes: the cold tier's sequence records,
// blobs and ack manifest (offload/cold_tier.h, used by recovery and CloseSequence) and the
// remote tier's publications (offload/remote_tier.h, used by sharing).
//
// Implementations are thread-safe: the store calls them from transfer workers and callers'
// threads at once, never under the store mutex.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "offload/store_counters.h"
#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

class ColdTier;
class RemoteTier;

/// Where a chunk lies in a lower tier: its key, and for a chunk of a sequence attached from
/// another store's publication (TieredStore::AttachPublished) the publisher's namespace
/// (ns) with the publisher's sequence id in key.seq. Only a tier whose serves_published()
/// is true holds such chunks.
struct LowerChunkRef {
  const std::string* ns = nullptr;  ///< null: the store's own chunk
  ChunkKey key;
};

class LowerTier {
 public:
  virtual ~LowerTier() = default;

  /// Names the tier in messages: "cold tier", "remote tier".
  virtual std::string_view name() const = 0;
  /// The TierBits bit (ChunkInfo::tiers) of a chunk this tier acknowledged.
  virtual uint8_t tier_bit() const = 0;
  /// Whether it holds the chunks of attached sequences (refs with ns set). Such a tier never
  /// has them written or removed by the store that attached them: they are the publisher's.
  virtual bool serves_published() const = 0;
  /// Whether reads are independent blocking calls, worth spreading over the transfer
  /// workers (a fetch that reads two or more chunks from it forks); false: GetChunks
  /// batches them itself.
  virtual bool parallel_reads() const = 0;
  /// How long a failed write of this tier stays in the way of new work (the store's sticky
  /// background error, TieredStore::WaitForDurable); max(): until it is reported. A store's
  /// window is the shortest of its tiers'.
  virtual std::chrono::milliseconds error_window() const = 0;

  /// Writes the chunk's meta record and payload (payload_bytes) as one unit and returns once
  /// the tier acknowledged it. The error names the chunk and the tier.
  virtual Status PutChunk(const ChunkKey& key, std::string_view meta, const void* payload,
                          size_t payload_bytes) = 0;
  /// Reads and verifies one chunk's payload into dst: NotFound, Corruption, Unavailable,
  /// TimedOut naming the chunk. On error dst is unspecified.
  virtual Status GetChunk(const LowerChunkRef& ref, void* dst, size_t payload_bytes) = 0;
  /// One chunk of GetChunks.
  struct Get {
    LowerChunkRef ref;
    void* dst = nullptr;  ///< payload_bytes of room
    Status status;        ///< the outcome
  };
  /// GetChunk for each, as one batch where the tier can (pipelined for Redis).
  virtual void GetChunks(std::vector<Get>* gets, size_t payload_bytes);
  /// Whether the tier reads a chunk's meta record without its payload (GetChunkMetas): the
  /// store releases a chunk's in-memory representatives only once such a tier acknowledged it.
  virtual bool reads_chunk_meta() const { return false; }
  /// One chunk of GetChunkMetas.
  struct MetaGet {
    LowerChunkRef ref;
    std::string meta;  ///< the meta record (offload/store_records.h) as written with the chunk
    Status status;     ///< the outcome
  };
  /// Reads the meta records of chunks, verified, as one batch; each status names the chunk and
  /// the tier. A tier whose reads_chunk_meta() is false answers FailedPrecondition for each.
  virtual void GetChunkMetas(std::vector<MetaGet>* gets);
  /// Removes chunks of the store's own (missing ones are not an error); stops at the first
  /// failure.
  virtual Status RemoveChunks(const std::vector<ChunkKey>& keys) = 0;
  /// Removes a dropped sequence: `keys` are its chunks that carry tier_bit() (and are not a
  /// publisher's). A tier that keeps per-sequence records removes those too.
  virtual Status RemoveSequence(SequenceId seq, const std::vector<ChunkKey>& keys) = 0;

  /// Counts one fetched chunk this tier served (StoreCounters::cold_loads, remote_loads).
  virtual void CountLoad(StoreCounters* c) const = 0;
  /// Adds the tier's own counters to a snapshot (nothing for a tier without any).
  virtual void AddCounters(StoreCounters* c) const { (void)c; }
  /// Host memory the tier's own machinery holds in this process (RocksDB's memtables, table
  /// readers and block cache); 0 for a tier whose data lives elsewhere.
  virtual uint64_t memory_bytes() const { return 0; }
};

/// The RocksDB cold tier as a LowerTier: owns `cold`. Reads in parallel, errors sticky until
/// reported, keeps sequence records (RemoveSequence deletes the whole sequence).
std::unique_ptr<LowerTier> MakeColdLowerTier(std::unique_ptr<ColdTier> cold);
/// The Redis remote tier as a LowerTier: owns `remote`. Batched reads, errors in the way
/// for its retry window (RemoteTierOptions::retry_ms), serves published chunks.
std::unique_ptr<LowerTier> MakeRemoteLowerTier(std::unique_ptr<RemoteTier> remote);

}  // namespace kvtier
