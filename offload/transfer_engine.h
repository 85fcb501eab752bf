// TransferEngine: the part of TieredStore that moves bytes between tiers off the
// caller's thread. It owns the oneTBB task arena the transfers run in, counts
// the tasks in flight, does a fetch's copy work (warm copy or lower-tier read, then
// the upload into the hot slot) and submits chunk writes to the lower tiers.
//
// Why it is separate: the store decides *what* moves (slots, pins, policies,
// counters, all under its one lock); the engine only moves bytes it is handed,
// holds no store lock and knows nothing of sequences. Everything it reads or
// writes was pinned by the store before the call and stays pinned until the
// store's completion code runs. This is also the seam a GPU hot tier plugs into:
// uploads go through HotTier::Upload, whatever memory the slots live in.
//
// Do not block on a FetchHandle from inside an engine task: the workers are few
// (one on two cores) and a task waiting for another task can deadlock them.
#pragma once

#include <oneapi/tbb/task_arena.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "offload/hot_tier.h"
#include "offload/lower_tier.h"
#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

class TransferEngine {
 public:
  struct Options {
    int threads = 2;         ///< worker threads asked for (capped at the process's cores - 1, at least 1)
    size_t chunk_bytes = 0;  ///< bytes of one chunk (K and V): every copy moves exactly this much
    HotTier* hot = nullptr;  ///< where fetched chunks are uploaded to; not owned
    /// The store's lower tiers in order (offload/lower_tier.h), not owned: chunks are
    /// written to each in order and read from the first that serves them. Empty: none.
    std::vector<LowerTier*> lower;
  };
  /// InvalidArgument naming the field for threads < 1, chunk_bytes == 0 or a null hot tier.
  static Result<std::unique_ptr<TransferEngine>> Create(const Options& options);
  /// Waits for every task in flight (they may call back into their submitter).
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  /// Runs fn on a transfer worker. fn must not throw: no exception may cross a oneTBB task.
  void Enqueue(std::function<void()> fn);
  /// Blocks until every task enqueued so far (and any they enqueued) has finished.
  void WaitIdle();
  /// WaitIdle for at most `timeout`; true when idle.
  bool WaitIdleFor(std::chrono::milliseconds timeout);

  /// One chunk of a fetch, copied into its hot slot.
  struct Load {
    ChunkKey key;                       ///< names the chunk in messages
    uint8_t* hot_dst = nullptr;         ///< the hot slot (HotTier::slot_data); null: read only, no upload
    const uint8_t* warm_src = nullptr;  ///< the pinned warm copy; null: read it from a lower tier
    /// For a lower-tier read: where to read it to (a warm slot reserved to keep the copy), or
    /// null to read into `staging`.
    uint8_t* read_buf = nullptr;
    std::vector<uint8_t> staging;
    /// The chunk in the lower tiers (ns set: a publisher's chunk, read only from tiers that
    /// serve published chunks).
    LowerChunkRef ref;
    /// Where the bytes came from, set with status OK: the lower tier that served them, or
    /// null for the warm copy.
    const LowerTier* source = nullptr;
    Status status;  ///< the outcome, per load
  };
  /// Copies every load into its hot slot on the calling thread (a load with no hot_dst is only
  /// read, into its read_buf: a warm-only fetch, no upload and no device wait): the warm ones as one
  /// HotTier::UploadBatch (one wait per fetch on a device tier), the others from the lower
  /// tiers in order, each tier given what the ones before it could not serve: spread over
  /// the workers when the tier reads in parallel and there are two or more (a warm copy is
  /// one memcpy, cheaper than a fork-join, while disk reads are worth overlapping), else as
  /// one batch (LowerTier::GetChunks). Takes no lock. Each load's status says how it went;
  /// a load every tier failed names each failure in order.
  void CopyLoads(std::vector<Load>* loads) const;

  /// Which lower tiers acknowledged a chunk write: their TierBits (LowerTier::tier_bit).
  using WriteAcks = uint8_t;
  /// Writes one chunk (its meta record and payload, one atomic batch) to each lower tier in
  /// order, and returns when every one of them acknowledged it, or at the first failure,
  /// naming the tier (`acks` then says which tiers have it all the same: those before it).
  /// FailedPrecondition without a lower tier.
  Status WriteChunk(const ChunkKey& key, std::string_view meta, const uint8_t* payload,
                    WriteAcks* acks = nullptr) const;

  struct LowerWrite {
    ChunkKey key;
    std::string meta;                  ///< the encoded meta record
    const uint8_t* payload = nullptr;  ///< chunk_bytes, pinned by the submitter until `done` ran
  };
  /// WriteChunk on a worker; `done` then runs on that worker with the write's status
  /// (already naming the chunk when it failed) and the tiers that acknowledged it.
  void SubmitLowerWrite(LowerWrite write, std::function<void(Status, WriteAcks)> done);

  size_t chunk_bytes() const { return options_.chunk_bytes; }
  /// Workers the arena got (after the cap).
  int workers() const { return workers_; }
  /// Tasks enqueued so far (Enqueue and SubmitLowerWrite calls).
  uint64_t enqueued() const {
    std::lock_guard<std::mutex> l(mu_);
    return enqueued_;
  }

 private:
  explicit TransferEngine(const Options& options) : options_(options) {}
  /// Where a lower-tier read of the load lands: its reserved warm slot, or its staging.
  uint8_t* ReadBuffer(Load* ld) const;

  Options options_;
  int workers_ = 1;
  std::unique_ptr<tbb::task_arena> arena_;
  char fork_ = 0;                 // the sync address of Enqueue's TSan fork annotation (kernels/tbb_tsan.h)
  mutable std::mutex mu_;         // guards inflight_ and enqueued_
  std::condition_variable idle_;  // signalled when inflight_ drops to 0
  int64_t inflight_ = 0;
  uint64_t enqueued_ = 0;
};

}  // namespace kvtier
