// DeviceLane: a session's decode layer step as one chain on the device, with no host wait
// (issue 44; docs/architecture.md, "The device decode step"). Session::AttendDevice runs a
// decode layer through it when the queries stay on the device (SessionImpl::QueriesStayOnDevice)
// and every chunk of the layer has a pinned warm copy (PrepareLayer); any other layer call runs
// the host path unchanged.
//
// The chain of one layer, all on the retrieval backend's stream (RetrievalBackend::stream(),
// where the Exact index's mirror lives), after an event of the engine's stream:
//   CountNonFinite(q) -> q copied, rotated to memory's position (InfLLM) -> MeanPoolProbe ->
//   ScoreChunks over the mirror -> [entropy] SegmentEntropy (Eq. 11) -> EntropyGrant (Eq. 12,
//   the allocator's state in device memory; topk: min(k, n)) -> SegmentedTopK with the grant as
//   its k -> ChunkTableAssign (kernels/cpu/chunk_table.h) -> ChunkTableGather of the misses from
//   their warm copies -> the layer's step report copied to pinned memory.
// The attention then reads the lane's slot list, first positions and count in device memory
// (AttentionPlanInput::device_slot_*, device_pool_*), on the hot tier's stream after an event of
// the lane's.
//
// What the lane owns:
//  * a device slot pool of `slots` chunks (K and V halves in two arrays; owner kHotTier: a
//    slot pool as the tier's), min(layers x k, hot pool capacity) slots, so a layer's grant
//    (at most max_rows <= slots) never overflows it and a step's chunks stay for the next step;
//  * the chunk table over it ([layers, row_capacity] rows: the Exact index's mirror rows);
//  * per layer and row, the chunk's warm K and V address and first position
//    (TieredStore::WarmAddresses), uploaded through pinned staging with no wait;
//  * the Eq. 12 allocator state in device memory, uploaded from the host allocator at the first
//    lane layer after a host-path layer and handed back (a wait) by ReturnGrantState;
//  * a ring of pinned step reports, read one step late (cudaEventQuery) or on a flush.
//
// Rows move: the index's Remove (and its memory cap) compacts the mirror rows. The rule here is
// the simplest correct one: when a layer's rows differ in any way from those the lane last saw,
// its table entries are reset (a device memset of its row_slot; a slot whose owner row lost its
// entry is then read as free, chunk_table.h) and its sources uploaded again. A warm epoch that
// moved (TieredStore::warm_epoch) re-asks a layer's addresses before its next gather.
//
// The fence: the lane registers with its store (one shared fence per store for every lane over
// it) a WarmReaderFence whose wait is on an event recorded after the lane's last gather; the
// check of the epoch, the gather's submission and that event are one critical section of the
// lane's mutex, which the fence takes too.
//
// Thread-safety: one session's thread drives a lane; the fence may be called from any thread
// (under the store's lock).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/entropy_grant.h"
#include "offload/attention_backend.h"
#include "offload/tiered_store.h"
#include "retrieval/retriever.h"

namespace kvtier {

/// The shape of a lane, fixed for its life.
struct DeviceLaneOptions {
  int layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kF16;
  int chunk_tokens = 0;     ///< tokens of a chunk (the store's chunk_size)
  int slots = 0;            ///< chunks the device pool holds
  int max_rows = 0;         ///< the most chunks one layer takes (<= slots): the slot list's capacity
  int initial_rows = 1024;  ///< rows per layer the table holds at first (it grows by an eighth)
  /// Host [head_dim / 2] RoPE frequencies when memory sees the queries rotated (InfLLM), else empty.
  std::vector<double> rope_inv_freq;
  /// A row with no warm copy: false, PrepareLayer answers false (the layer takes the host path,
  /// whose fetch waits for the chunk); true, the row gets no source and a chosen one is deferred.
  bool defer_cold = false;
  /// InvalidArgument naming the field that is out of range.
  Status Validate() const;
};

/// One layer of a step report, read back from the device.
struct LaneLayerReport {
  int layer = 0;
  std::vector<uint64_t> chunks;  ///< attended chunk indices, selection order
  int32_t take = 0;              ///< the grant (top-k's k)
  int32_t hits = 0, misses = 0;  ///< chunk table: served from the pool, gathered from warm
  int32_t skipped = 0;           ///< chunk table: invalid or overflow (a fault)
  int32_t no_source = 0;         ///< chunk table: chosen, not in the pool and no warm copy (deferred)
  /// Chosen chunks the attention did not read: no warm copy and not in the lane's pool (their
  /// count is no_source). Not in `chunks`.
  std::vector<uint64_t> deferred;
  int32_t q_non_finite = 0, q_first = 0;
  int32_t non_finite = 0;   ///< non-finite cosines (entropy)
  int32_t grant_error = 0;  ///< kEntropyGrant... code, 0 = none
  double theta = 0.0;       ///< Eq. 11 (entropy)
};

/// The lane layers of one step, in the order they ran.
struct LaneStepReport {
  uint64_t step = 0;
  std::vector<LaneLayerReport> layers;
};

class DeviceLane {
 public:
  /// A lane over `seq` of `store`, its work on `stream` (the retrieval backend's cudaStream_t).
  /// Unavailable in a build without CUDA; ResourceExhausted when its memory cannot be had.
  static Result<std::unique_ptr<DeviceLane>> Create(TieredStore* store, SequenceId seq, void* stream,
                                                    const DeviceLaneOptions& options);
  ~DeviceLane();  ///< leaves the store's fence, waits for its own work
  DeviceLane(const DeviceLane&) = delete;
  DeviceLane& operator=(const DeviceLane&) = delete;

  /// Makes `layer`'s sources match its rows: `row_ids` (the index's rows), then `sealing` (the
  /// layer's chunks still landing, TieredStore::BeginLayerStep with LandRule::kCompleteOnly), at
  /// the current warm epoch. Rows that only grew at the end keep their table entries and
  /// sources; any other change resets the layer's entries; a moved epoch asks every address
  /// again. A row with no warm copy (only in a lower tier) gets no source: chosen, it is skipped
  /// unless the lane's pool still holds it (LaneLayerReport::deferred), and its source is asked
  /// again after RefreshRows. False (the layer takes the host path) when more than 8 chunks are
  /// landing, or when a landing chunk is not above the index's rows.
  Result<bool> PrepareLayer(int layer, const std::vector<uint64_t>& row_ids,
                            const std::vector<SealingChunk>& sealing = {});

  /// One layer call: what the chain reads besides the lane's own state.
  struct LayerCall {
    int layer = 0;
    uint64_t step = 0;  ///< the session's step number
    const Retriever::LaneLayer* select = nullptr;
    const float* q = nullptr;                     ///< device [q_heads, head_dim] fp32
    void* q_stream = nullptr;                     ///< the stream whose work wrote q
    int64_t rope_position = 0;                    ///< memory's position of the query (InfLLM)
    kernels::EntropyGrantState* grant = nullptr;  ///< the host allocator's state (entropy), else null
  };
  /// Submits the chain (no host wait) and points `in`'s device slot fields at its slot list.
  /// Returns false, submitting nothing, when the warm epoch moved since PrepareLayer: prepare
  /// again. FailedPrecondition when the ring of reports is full (TakeReport first).
  Result<bool> Launch(const LayerCall& call, AttentionPlanInput* in);

  /// The oldest step report of a step before `before_step` (UINT64_MAX: any, the current one
  /// included): false when none is pending, or when it is not done and !wait (cudaEventQuery;
  /// wait: one event wait).
  Result<bool> TakeReport(uint64_t before_step, bool wait, LaneStepReport* out);
  /// Asks `layer`'s rows with no source again at its next PrepareLayer (a fetch may have brought
  /// them back to warm).
  void RefreshRows(int layer);
  /// Whether a report is pending (submitted, not taken).
  bool has_pending() const;
  /// Whether the ring holds no room for another step's report.
  bool ring_full() const;

  /// Whether the allocator's state is on the device (uploaded by Launch).
  bool grant_on_device() const { return grant_on_device_; }
  /// Brings the allocator's state back into `host` (one wait); when the device has not begun
  /// step `step`, begins it on the host with k (EntropyGrantBeginStep). A no-op when the state
  /// is not on the device.
  Status ReturnGrantState(kernels::EntropyGrantState* host, uint64_t step, int k);

  /// The stream the lane's work is ordered on (a cudaStream_t).
  void* stream() const { return stream_; }
  /// Waits for the reads of warm addresses issued so far (the store's fence calls it).
  Status WaitForReaders();

 private:
  DeviceLane(TieredStore* store, SequenceId seq, void* stream, const DeviceLaneOptions& options);
  // The layer's chunks still landing, as rows sel.n, sel.n + 1, ...: their representatives chosen
  // on the device from their warm slots (after the hot tier's downloads), then scored into the
  // scores past `index_rows`' (the index's rows as just scored).
  Status ScoreSealedRows(int layer, const Retriever::LaneLayer& sel,
                         const kernels::ChunkScoreParams& index_rows);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  TieredStore* store_;
  SequenceId seq_;
  void* stream_;
  DeviceLaneOptions options_;
  bool grant_on_device_ = false;
};

}  // namespace kvtier
