// What kvtier counts, for an engine to read: StoreCounters (the store's tiers and
// transfers, a consistent snapshot from Store::counters()), AttendStats (one
// Session::Attend) and SessionCounters (a session's totals, Session::counters()).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

/// Counters a user can read at any time (a consistent snapshot).
struct StoreCounters {
  uint64_t hot_chunks = 0, hot_bytes = 0;    ///< chunk slots in use (+ sinks/local bytes in hot_bytes)
  uint64_t warm_chunks = 0, warm_bytes = 0;  ///< chunks resident in the warm tier
  uint64_t cold_chunks = 0, cold_bytes = 0;  ///< chunks acknowledged by the cold tier
  uint64_t promotions = 0;                   ///< chunk copies to a higher tier (cold->warm, warm->hot)
  uint64_t demotions = 0;    ///< chunks that left a tier for a lower one (warm->cold, hot slot freed)
  uint64_t hits = 0;         ///< fetched chunks already hot
  uint64_t misses = 0;       ///< fetched chunks that had to be promoted
  uint64_t bytes_moved = 0;  ///< bytes copied between tiers (either direction)
  uint64_t cold_writes = 0, cold_reads = 0;
  uint64_t lease_expired = 0;      ///< pins that ran past pin_timeout_ms and stopped protecting
  uint64_t pin_waits = 0;          ///< fetches that waited for hot slots other fetches held (FetchChunks)
  uint64_t pin_wait_us = 0;        ///< total time those fetches waited, microseconds
  uint64_t pin_wait_timeouts = 0;  ///< waits that ran past pin_wait_ms (the fetch was ResourceExhausted)
  uint64_t hot_reserved = 0;       ///< hot slots reserved by open sessions now (ReserveHotSlots)
  uint64_t chunks_sealed = 0;      ///< chunks formed from the local window and landed
  uint64_t chunks_landing = 0;     ///< chunks sealed whose copy into the warm tier has not landed yet
  uint64_t dropped_chunks = 0;     ///< chunks removed for good by DropChunks (compression)
  /// Waits on the warm reader fence (TieredStore::SetWarmReaderFence) before a warm slot whose
  /// address a device reader was handed changed hands.
  uint64_t warm_reader_fences = 0;
  // Where fetched chunks that were not hot came from (hits + the three = fetched chunks).
  uint64_t warm_loads = 0;    ///< fetched chunks copied from the warm tier
  uint64_t cold_loads = 0;    ///< fetched chunks read from the cold tier (RocksDB)
  uint64_t remote_loads = 0;  ///< fetched chunks read from the remote tier (Redis)
  // The remote tier's own counters (offload/remote_tier.h), 0 without one.
  uint64_t remote_puts = 0, remote_put_bytes = 0;  ///< chunks acknowledged by the remote tier, payload bytes
  uint64_t remote_gets = 0, remote_get_bytes = 0;  ///< chunks read back and verified, payload bytes
  uint64_t remote_not_found = 0;                   ///< remote reads of a missing chunk (evicted by maxmemory)
  uint64_t remote_corrupt = 0;                     ///< remote reads that failed the CRC or format check
  uint64_t remote_errors = 0;                      ///< remote calls with no usable answer (node down or slow)
};

/// One Attend (or Gather) call.
struct AttendStats {
  double probe_ms = 0, search_ms = 0, alloc_ms = 0;  ///< retrieval: Eq. 7-9, Eq. 10 search, Eq. 11-12
  double fetch_ms = 0;                               ///< promotion into hot slots, pin waits included
  double attention_ms = 0;                           ///< the attention kernel (and kInfLLM rotation)
  double entropy = 0;                                ///< Θ^ℓ of Eq. 11 when the allocator computed it
  size_t chunks = 0;                                 ///< chunks attended
  /// Chunks the budget granted this layer and left out: beyond the hot slot pool, or, when the pool
  /// is short, beyond the session's reservation (kvtier/session.h, "Sharing the hot slot pool").
  size_t chunks_clipped = 0;
  bool reused = false;  ///< the chunks came from the layer's last search (RetrieverOptions::reuse_cosine)
  bool sliced = false;  ///< the search screened a slice of the chunks (RetrieverOptions::screen_period)
  /// Bytes the layer step read, by part (the step's byte floor; the fetch's bytes are the store's
  /// promotions, StoreCounters). Counted per call from chunk and token counts, not measured:
  /// the first stage over the chunks (the Exact index's int8 screen: codes and scales), the
  /// chunks rescored from their stored keys (keys and inverse norms), and the K and V of every
  /// token attended (sinks, chunks, local window). FAISS index kinds count their exhaustive scans
  /// only (retrieval/faiss_index.h).
  uint64_t first_stage_bytes = 0, rescoring_bytes = 0, attention_bytes = 0;
};

/// Totals over the session's life.
struct SessionCounters {
  uint64_t steps = 0;             ///< BeginStep calls
  uint64_t attends = 0;           ///< Attend/Gather calls (layer steps)
  uint64_t tokens_appended = 0;   ///< summed over layers
  uint64_t chunks_attended = 0;   ///< summed over layer steps
  uint64_t max_layer_chunks = 0;  ///< most chunks one layer attended in one step
  uint64_t compressions = 0;      ///< Compress calls that ran
  uint64_t dropped_chunks = 0;    ///< chunks Compress removed
  uint64_t chunks_clipped = 0;    ///< chunks granted and left out (AttendStats::chunks_clipped)
  /// Chunks a device-lane step chose and did not attend: no warm copy (only in a lower tier) and
  /// not in the lane's pool. Each is brought back to warm for a later step (Session::AttendDevice).
  uint64_t chunks_deferred = 0;
  uint64_t selections_reused =
      0;  ///< layer steps whose chunks came from the last search (AttendStats::reused)
  uint64_t selections_sliced = 0;  ///< layer steps that screened a slice of the chunks (AttendStats::sliced)
  /// AttendStats' byte counts, summed over layer steps.
  uint64_t first_stage_bytes = 0, rescoring_bytes = 0, attention_bytes = 0;
  double probe_ms = 0, search_ms = 0, alloc_ms = 0, fetch_ms = 0, attention_ms = 0;
  /// Blocking host waits on the device (stream, event and device synchronisations, synchronous
  /// copies, copies to or from pageable host memory) on the calling thread during the session's
  /// Append, Attend, Gather, Observe, Compress and device calls: the step's own waits. 0 on a cpu tier.
  uint64_t host_syncs = 0;
  /// The same waits made meanwhile on worker threads (threads running no session call: the
  /// store's transfer workers bringing chunks in, another program thread's); a wait made
  /// between two calls counts in neither. 0 on a cpu tier.
  uint64_t worker_host_syncs = 0;
};

}  // namespace kvtier
