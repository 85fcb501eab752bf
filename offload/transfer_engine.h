// TransferEngine: the part of TieredStore that moves bytes between tiers off the
// caller's thread. It owns the oneTBB task arena the transfers run in, counts
// the tasks in flight, does a fetch's copy work (warm copy or cold read, then
// the upload into the hot slot) and submits chunk writes to the cold tier.
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

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "offload/cold_tier.h"
#include "offload/hot_tier.h"
#include "offload/remote_tier.h"
#include "store/chunk.h"
#include "store/status.h"

#include <oneapi/tbb/task_arena.h>

namespace kvtier {

class TransferEngine {
 public:
  struct Options {
    int threads = 2;          ///< worker threads asked for (capped at the process's cores - 1, at least 1)
    size_t chunk_bytes = 0;   ///< bytes of one chunk (K and V): every copy moves exactly this much
    HotTier* hot = nullptr;   ///< where fetched chunks are uploaded to; not owned
    ColdTier* cold = nullptr; ///< null when the store has no cold tier; not owned
    /// null when the store has no remote tier; not owned. With both, a chunk is written to
    /// both (acknowledged when both acknowledged it) and read from cold first: the remote
    /// copy serves what the local disk lost or damaged, and chunks of sequences attached
    /// from another process, which only the remote tier holds.
    RemoteTier* remote = nullptr;
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
    ChunkKey key;                      ///< names the chunk in the cold tier and in messages
    uint8_t* hot_dst = nullptr;        ///< the hot slot (HotTier::slot_data)
    const uint8_t* warm_src = nullptr; ///< the pinned warm copy; null: read the chunk from cold
    /// For a cold read: where to read it to (a warm slot reserved to keep the copy), or
    /// null to read into `staging`.
    uint8_t* read_buf = nullptr;
    std::vector<uint8_t> staging;
    RemoteChunkRef remote_ref;         ///< the chunk in the remote tier (ns null: the store's own)
    bool in_cold = true;               ///< false: only the remote tier holds it (an attached sequence)
    /// Where the bytes came from: 'w' warm, 'c' cold, 'r' remote (set with status OK).
    char source = 0;
    Status status;                     ///< the outcome, per load
  };
  /// Copies every load into its hot slot on the calling thread: the warm ones as one
  /// HotTier::UploadBatch (one wait per fetch on a device tier), the cold reads spread
  /// over the workers when there are two or more (a warm copy is one memcpy, cheaper
  /// than a fork-join, while cold reads are worth overlapping). Loads the cold tier cannot
  /// serve go to the remote tier in one pipelined batch. Takes no lock. Each load's
  /// status says how it went.
  void CopyLoads(std::vector<Load>* loads) const;

  /// Which lower tiers acknowledged a chunk write.
  struct WriteAcks {
    bool cold = false;    ///< the cold tier has it (durable on the local disk)
    bool remote = false;  ///< the remote tier has it
  };
  /// Writes one chunk (its meta record and payload, one atomic batch) to the cold tier
  /// and to the remote tier, and returns when every one of them acknowledged it (or the
  /// first failure, naming the tier; `acks` then says which tiers have it all the same).
  /// FailedPrecondition with neither.
  Status WriteChunk(const ChunkKey& key, std::string_view meta, const uint8_t* payload,
                    WriteAcks* acks = nullptr) const;

  struct ColdWrite {
    ChunkKey key;
    std::string meta;                  ///< the encoded meta record
    const uint8_t* payload = nullptr;  ///< chunk_bytes, pinned by the submitter until `done` ran
  };
  /// WriteChunk on a worker; `done` then runs on that worker with the write's status
  /// (already naming the chunk when it failed) and the tiers that acknowledged it.
  void SubmitColdWrite(ColdWrite write, std::function<void(Status, WriteAcks)> done);

  size_t chunk_bytes() const { return options_.chunk_bytes; }
  bool has_cold() const { return options_.cold != nullptr; }
  bool has_remote() const { return options_.remote != nullptr; }
  /// Workers the arena got (after the cap).
  int workers() const { return workers_; }

 private:
  explicit TransferEngine(const Options& options) : options_(options) {}
  Status CopyOne(Load* ld) const;
  /// Where a cold or remote read of the load lands: its reserved warm slot, or its staging.
  uint8_t* ReadBuffer(Load* ld) const;

  Options options_;
  int workers_ = 1;
  std::unique_ptr<tbb::task_arena> arena_;
  char fork_ = 0;  // the sync address of Enqueue's TSan fork annotation (kernels/tbb_tsan.h)
  std::mutex mu_;                 // guards inflight_
  std::condition_variable idle_;  // signalled when inflight_ drops to 0
  int64_t inflight_ = 0;
};

}  // namespace kvtier
