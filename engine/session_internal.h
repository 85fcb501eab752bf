// SessionImpl: the implementation behind every kvtier::Session (include/kvtier/session.h), and
// what tools, tests and the Python module, built with the library's sources, use beyond the
// installed API: Gather (the spans to attend, for engines with their own attention kernel), a
// ChunkSelector in place of retrieval, and the store and retriever behind a session. Reach it
// with ImplOf(session): Session::Open and Attach make every Session a SessionImpl.
//
// Inside a layer step. Gather chooses and fetches the chunks: the probe and search of the
// Retriever (retrieval/retriever.h), or the selector, then TieredStore::FetchChunks pins them in
// hot slots; it returns LayerParts (engine/layer_parts.h): sinks | chunks | local window as the
// kernels' spans, pinned until released. Attend builds an AttentionPlan from them (the
// kernels' POD params: sinks, the retrieved chunks as hot-slot indices, the local runs) and runs
// it on the backend of the store's hot tier (offload/attention_backend.h):
// kernels::SlotAttention over host memory for "host", the CUDA launcher over device memory for
// "cuda" (one device workspace per session, one stream synchronisation per Attend). With a
// "cuda" hot tier Gather's spans are device pointers, and kInfLLM is refused (its key rotation
// runs on the host). A kPrefill window's representative-key statistics come from Attend's own
// attention on the tier's device (sinks | local with per-key mass, the chunks apart, merged by
// log-sum-exp); a store whose repr_topk equals chunk_size keeps every key and needs none.
//
// kInfLLM positions: with L0 = the local window's first position, local keys sit at their true
// positions, retrieved chunks all at L0, and the sinks at L0 once chunks separate them from the
// local window (true positions while contiguous). Retrieval sees the queries rotated by p - L0,
// so q.k_stored is the score a key gets as a memory unit.
//
// Sharing the hot slot pool, in full. Open and Attach refuse a retrieval budget the pool cannot
// hold (SessionOptions::Validate(const StoreOptions&)) and reserve the session's budget in
// chunks (budget_tokens / chunk_size: what one Attend pins in the steady state) with
// TieredStore::ReserveHotSlots; sessions attached to one sequence count once, at the largest;
// retrieve = false reserves nothing. The entropy cut-off may grant a layer more chunks than the
// reservation; the chunks past it are fetched only from slots no other open session's
// reservation claims (a claim: the larger of a session's reservation and the slots it holds
// pinned), and the rest is left out (chunks_clipped) rather than waited for. Reserving what a
// layer can be granted instead would reserve nearly the step's whole budget, layers x budget
// chunks, per session: Eq. 12 may hand one layer almost all of it. An engine that batches many
// sessions on one thread (per layer: Gather every session, attend, release all) therefore never
// waits. A fetch never waits for pins the calling thread holds: it fails at once with
// ResourceExhausted saying so; otherwise, where it must, it waits for other threads' Attends to
// unpin (StoreOptions::pin_wait_ms, StoreCounters::pin_waits). An engine that keeps one layer's
// LayerParts while it gathers the next gets ResourceExhausted at once where the two together
// would pass its reservation and the pool is short, never a deadlock (TieredStore::FetchChunks
// says why). tests/engine/session_pins_test.cc runs many sessions on many threads at a pool just
// above their summed budgets, and 8 and 16 sessions batched on one thread;
// tests/engine/session_test.cc checks 8 sessions on 4 threads bit for bit against their
// single-threaded runs.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/layer_parts.h"
#include "kvtier/session.h"
#include "offload/attention_backend.h"
#include "offload/host_memory.h"
#include "offload/tiered_store.h"

namespace kvtier {

class DeviceLane;  // engine/device_lane.h
struct LaneStepReport;
class Retriever;      // retrieval/retriever.h
class ScoringPolicy;  // offload/policy/scoring_policy.h

/// Picks the sealed chunks one layer's queries attend to, in place of retrieval.
/// `q` is [m, q_heads, head_dim] fp32 as memory sees it (kInfLLM: rotated by
/// position - L0); `chunks` lists the layer's live sealed chunks in token order.
/// Returns chunk indices (ChunkKey::index) to fetch.
using ChunkSelector = std::function<Result<std::vector<uint64_t>>(
    int layer, const float* q, const int64_t* positions, int m, const std::vector<ChunkInfo>& chunks)>;

/// Every live sealed chunk: full attention through the store.
Result<std::vector<uint64_t>> SelectAllChunks(int layer, const float* q, const int64_t* positions, int m,
                                              const std::vector<ChunkInfo>& chunks);

class SessionImpl final : public Session {
 public:
  SessionImpl(TieredStore* store, SequenceId seq, const SessionOptions& options);
  ~SessionImpl() override;

  SequenceId sequence() const override { return seq_; }
  const SessionOptions& options() const override { return options_; }
  const Geometry& geometry() const override;
  Status Append(int layer, const void* k, const void* v, int n, DType dtype,
                MemorySpace space = MemorySpace::kHost) override;
  Status BeginStep(StepKind kind) override;
  Status Attend(int layer, const float* q, const int64_t* positions, int m, float* out,
                AttendStats* stats = nullptr) override;
  Status AppendDevice(int layer, const void* k, const void* v, int n, DType dtype, void* stream) override;
  Status AttendDevice(int layer, const float* q, const int64_t* positions, int m, float* out, void* stream,
                      AttendStats* stats = nullptr) override;
  Status Observe(int layer, const float* q, const int64_t* positions, int m) override;
  Status SetQuestion(int layer, const float* q, int m) override;
  Result<CompressReport> Compress(const std::string& policy, int64_t kv_budget, int n_queries = 0) override;
  Status Close() override;
  Status Drop() override;
  SessionCounters counters() const override { return counters_; }
  int32_t reserved_slots() const override { return reserved_slots_; }
  const std::vector<std::vector<uint64_t>>& last_chunks() const override { return last_chunks_; }
  Status WaitForDevice() override;
  void ApplyRope(float* x, int m, int heads, const int64_t* positions) const override;

  /// Attend without the attention: chooses and fetches the chunks and returns what to attend,
  /// pinned until the LayerParts is released or destroyed. Checks what Attend checks, and
  /// counts as the layer's step.
  Result<LayerParts> Gather(int layer, const float* q, const int64_t* positions, int m);
  /// Replaces retrieval by a selector (an oracle, StreamingLLM's "nothing", ...); null restores retrieval.
  void SetChunkSelector(ChunkSelector selector) { selector_ = std::move(selector); }
  /// The store the session's sequence lives in.
  TieredStore* store() const { return store_; }
  /// The retriever (null when retrieve = false), e.g. for Describe().
  Retriever* retriever() { return retriever_.get(); }
  /// How many times the step plan (below) was built: once per step while every layer of a step
  /// holds the same tokens, and once more for each layer whose inputs differ from the last.
  uint64_t step_plan_builds() const { return step_plan_builds_; }
  /// Drops the step plan, so that the next layer call builds it anew: what building it per
  /// layer would give, for tests that compare the reuse with it.
  void ForgetStepPlan() { step_plan_.valid = false; }
  /// Whether AttendDevice may run a decode layer on the device lane (engine/device_lane.h; on by
  /// default): off, every layer call takes the host path (what the lane is compared with).
  void SetDeviceLane(bool on) { lane_enabled_ = on; }
  /// Layer calls that ran on the device lane, and those of them whose step report was read.
  uint64_t lane_layer_steps() const { return lane_layer_steps_; }
  uint64_t lane_reports_read() const { return lane_reports_read_; }
  /// Layer calls the lane could not take (a row with no warm copy without defer_cold_chunks, or
  /// more than 8 chunks landing): the host path ran them.
  uint64_t lane_unprepared_layers() const { return lane_unprepared_layers_; }
  /// Rows the lane scored for chunks still landing (chosen on the device, DeviceLane::PrepareLayer).
  uint64_t lane_landing_rows() const { return lane_landing_rows_; }

 private:
  friend class Session;  // Open and Attach set up the backend, the retriever and the reservation

  Status CheckFiniteKv(int layer, const void* k, const void* v, int n, DType dtype) const;
  // Attend's work: q on the host (checked, searched with, and attended unless q_device is
  // given), out on the host or, with out_on_device, the tier's device memory (left in flight on
  // the tier's stream); `what` names the public call in errors.
  // q: the host queries, or null when they stay on the device (AttendDevice's decode step whose
  // selection runs on the retrieval backend: q_device then feeds the probe and the attention,
  // after q_stream's work).
  Status AttendLayer(const char* what, int layer, const float* q, const float* q_device, void* q_stream,
                     const int64_t* positions, int m, float* out, bool out_on_device, AttendStats* stats);
  // Whether AttendDevice's queries may stay on the device for this layer call: a decode step
  // whose selection the retrieval backend builds from them (InfLLM's rotations of q happen
  // there and in the attention kernel), and no kept queries (a host copy for Compress).
  bool QueriesStayOnDevice(int m) const;
  // AttendDevice's decode layer step on the device lane: false (nothing submitted, nothing
  // consumed of the layer's store visit but the index's update) when this layer call must take
  // the host path: no lane, a layer without chunks or budget, a chunk without a warm copy.
  Result<bool> AttendOnLane(int layer, const float* q, void* stream, const int64_t* positions, int m,
                            float* out, AttendStats* stats);
  // Reads the lane's step reports of steps before `before_step` (UINT64_MAX: all), waiting for
  // them when `wait`, into last_chunks_ and counters_; the first error a report names (a query
  // that was not finite, a grant that failed, a chunk the table skipped) is returned.
  Status TakeLaneReports(uint64_t before_step, bool wait);
  Status ApplyLaneReport(const LaneStepReport& report);
  // Takes the deferred chunks' warm-only fetches that are done (no wait) and asks their layers'
  // rows again; the first failed read (not a refusal for room) is returned, naming the layer.
  Status PollDeferredFetches();
  // Before a layer call on the host path: every lane report read and the allocator's state
  // back on the host (a wait, only when the lane held it).
  Status LeaveLane();
  // The store's hot tier as the device-pointer calls need it: a CudaHotTier (as void*, so this
  // header needs no CUDA), or FailedPrecondition naming `what` and why not.
  Result<void*> DeviceTier(const char* what) const;
  // Gather's work; `what` names the public call (Gather or Attend) in its errors.
  // q null with q_device set: the decode query stays on the device (AttendLayer).
  Result<LayerParts> GatherFor(const char* what, int layer, const float* q, const int64_t* positions, int m,
                               bool observe = true, const float* q_device = nullptr,
                               void* q_stream = nullptr);
  // q null: the queries are on the device and checked there (not here).
  Status CheckLayerCall(const char* what, int layer, const float* q, const int64_t* positions, int m,
                        bool in_step, bool q_on_device = false) const;
  // The positions rule of Attend: `positions` (checked increasing) are the last m of the
  // `held` tokens the layer holds.
  Status CheckPositionsHeld(const char* what, int layer, const int64_t* positions, int m, int64_t held) const;
  // What every layer of a step shares, planned once per step: BeginStep drops the plan, the
  // step's first layer call builds it from its query count and hot view, and the later layers
  // reuse it while their key is the same. The key fixes everything in the plan: the queries'
  // positions are exactly the layer's last m tokens (CheckPositionsHeld), so m and the token
  // count give them, and the sinks' and local runs' extents give L0 and where each key is
  // rotated to. A layer with another key (one holding more tokens than the rest, or Observe
  // between steps) rebuilds it; the results are the same bits either way.
  struct StepPlanKey {
    int m = 0;
    int64_t held = 0;  // tokens the layer holds
    int64_t sinks_first = 0;
    int sinks_tokens = 0;
    int n_local = 0;
    int64_t local_first[2] = {0, 0};
    int local_tokens[2] = {0, 0};
    bool operator==(const StepPlanKey&) const = default;
  };
  struct StepPlan {
    bool valid = false;
    StepPlanKey key;
    std::vector<int64_t> positions;  // [m] the queries' positions: held - m .. held - 1
    int64_t local_start = 0;         // L0: the local window's first position (held when empty)
    bool sinks_are_memory = false;   // chunks separate the sinks from the local window
    // Attend's plan input less the parts and queries: geometry, scale, m, `positions`, the
    // hot slot pool (fixed for the store's life).
    AttentionPlanInput base;
    // kInfLLM only: memory's view of the queries (positions - L0) and the positions the
    // statistics pass rotates the dense parts' keys to: the sinks (at L0 once separated), each
    // local run (true positions). Attend has the kernel rotate them (chunks at L0).
    std::vector<int64_t> rel;
    std::vector<int64_t> sink_key_positions;
    std::vector<int64_t> local_key_positions[2];
  };
  // The plan for a layer call of m queries over `view`, reused when its key matches.
  const StepPlan& PlanStep(int m, const HotView& view);
  // kInfLLM rotations of q [m, q_heads, head_dim] into scratch (q itself in kAbsolute):
  // memory's view (by position - L0) and attention's (at the true positions). TrueQueries
  // rotates once per layer call: GatherFor and Observe forget the last rotation on entry, and
  // the call's later uses (kept queries, statistics, attention) read it back.
  const float* MemoryQueries(const float* q, int m, const StepPlan& plan);
  const float* TrueQueries(const float* q, const int64_t* positions, int m);
  void KeepQueries(int layer, const float* q, const int64_t* positions, int m);
  // The representative-key statistics of a prefill window (the attention its queries pay to
  // the sinks and local window, added to the store's ring mass) and the retriever's Observe.
  Status ObserveLocked(int layer, const float* q, const float* q_mem, int m, const HotView& view,
                       const StepPlan& plan);
  // Whether prefill feeds the statistics: observe_prefill, and the store keeps fewer
  // representatives than a chunk has keys (with every key a representative, the statistics
  // choose nothing and their attention is skipped).
  bool ObservesStatistics() const;
  // The statistics alone. kAbsolute: the store's own pass (ObserveQueries). kInfLLM: the
  // store keeps keys before RoPE, so the pass runs here, on fp32 copies rotated where Attend
  // puts them, and hands the local window's mass to the store (AddLocalAttention).
  Status ObserveStatistics(int layer, const float* q, int m, const HotView& view, const StepPlan& plan);

  TieredStore* store_;
  SequenceId seq_;
  SessionOptions options_;
  std::unique_ptr<Retriever> retriever_;
  ChunkSelector selector_;
  StepKind step_ = StepKind::kPrefill;
  bool in_step_ = false;
  int next_layer_ = 0;
  bool dropped_ = false;
  uint64_t reservation_ = 0;  // TieredStore::ReserveHotSlots' id, 0 = none
  int32_t reserved_slots_ = 0;
  void ReleaseReservation();
  std::vector<double> inv_freq_;  // [head_dim / 2] kInfLLM RoPE frequencies
  SessionCounters counters_;
  std::vector<std::vector<uint64_t>> last_chunks_;
  struct KeptQuery {
    int64_t position;
    std::vector<float> q;  // after RoPE at `position`
  };
  std::vector<std::deque<KeptQuery>> kept_;  // [layer], oldest first
  std::unique_ptr<ScoringPolicy> policy_;
  std::string policy_spec_;
  // Scratch reused across calls (a session is driven by one thread at a time).
  std::vector<float> q_rot_, q_mem_;
  const float* q_rot_of_ = nullptr;  // the q that q_rot_ holds rotated in this layer call; null = none
  StepPlan step_plan_;
  uint64_t step_plan_builds_ = 0;
  std::unique_ptr<AttentionBackend> backend_;  // runs the plan where the hot tier's memory is
  std::unique_ptr<AttentionPlan> plan_;        // rebuilt every Attend, its vectors reused
  std::unique_ptr<HostBuffer> q_host_;         // AttendDevice: the queries' pinned host copy
  std::unique_ptr<DeviceLane> lane_;           // AttendDevice's decode layers on the device
  // Warm-only fetches (TieredStore::FetchToWarm) that bring chunks a lane step deferred (no warm
  // copy) back to warm, by layer; a done one is dropped and its layer's rows asked again
  // (DeviceLane::RefreshRows).
  std::vector<std::pair<int, WarmFetchHandle>> deferred_fetches_;
  bool lane_enabled_ = true;
  bool lane_unavailable_ = false;  // creating the lane failed: the host path, without retrying
  uint64_t lane_layer_steps_ = 0, lane_reports_read_ = 0, lane_unprepared_layers_ = 0, lane_landing_rows_ = 0;
  int lane_k_ = 0;  // the step's k the lane last ran with (Eq. 12's B_kv = L x k)
};

/// The implementation behind `session`. Every Session is one (Session::Open and Attach make
/// them, and Session's constructor is for SessionImpl alone).
inline SessionImpl& ImplOf(Session& session) { return static_cast<SessionImpl&>(session); }
inline const SessionImpl& ImplOf(const Session& session) { return static_cast<const SessionImpl&>(session); }

}  // namespace kvtier
