// kvtier::Session: one sequence's view of a Store, the object an inference
// engine talks to. It owns the sequence's retrieval state (probe statistics of
// ActQKV Eq. 8, the entropy allocator's per-step budget of Eq. 12, the chunk
// indexes), so two sequences never mix their statistics, and it runs a layer's
// whole memory step in one call:
//
//   Attend(layer, q, positions, m, out)
//     = probe (Eq. 7-9) -> chunk search (Eq. 10) -> budget (Eq. 11-12)
//       -> fetch the chosen chunks into hot slots -> attention over
//          sinks | chunks | local window (log-sum-exp merged) -> unpin
//
// with the time of each part returned as AttendStats and summed in counters().
// Engines that run their own attention call Gather() instead: it returns the
// spans to attend, pinned until the returned LayerParts is released or destroyed.
//
// A step is BeginStep(kind), then Attend (or Gather) for layer 0, 1, ..., L-1 in
// that order: the entropy allocator hands what a shallow layer leaves to deeper
// ones. Append puts a layer's new K/V in the store first, so a window's queries
// find its own keys in the local window (causal by positions).
//
// Positions (SessionOptions::positions):
//  * kAbsolute: the engine applies RoPE; keys are appended and queries passed
//    after RoPE at their absolute positions. With every chunk attended this is
//    exactly full attention.
//  * kInfLLM: keys are appended and queries passed BEFORE RoPE; the session
//    rotates (rotate-half RoPE with rope_theta) at attention time, InfLLM-style:
//    with L0 = the local window's first position, local keys sit at their true
//    positions, retrieved chunks all at L0, and the sinks at L0 once chunks
//    separate them from the local window (true positions while contiguous).
//    Queries keep their true positions; retrieval sees them rotated by p - L0,
//    so q.k_stored is the score a key gets as a memory unit.
//
// Where attention runs (offload/attention_backend.h): Attend builds an AttentionPlan (the
// kernels' POD params: sinks, the retrieved chunks as hot-slot indices, the local runs) and
// runs it on the backend of the store's hot tier: kernels::SlotAttention over host memory
// for "host", the CUDA launcher over device memory for "cuda" (one device workspace per
// session, one stream synchronisation per Attend). With a "cuda" hot
// tier, Gather's spans are device pointers, and kInfLLM is refused (its key rotation runs
// on the host).
//
// Threading: a Session is driven by one thread at a time. Different Sessions
// may run concurrently on different threads over one Store (the store
// serialises what it shares; attention and search use oneTBB inside). Several
// Sessions may attach to one sequence (e.g. to compare retrieval settings on the
// same data); only one of them may Append, and they must not run at once.
// Results do not depend on the thread a session runs on or on what other
// sessions do, as long as the hot slot pool is not short (below) (tests/engine/session_test.cc
// checks 8 sessions on 4 threads bit for bit against their single-threaded runs).
//
// Sharing the hot slot pool: Open and Attach refuse a retrieval budget the pool cannot hold
// (SessionOptions::Validate(const StoreOptions&)), and reserve the session's budget in
// chunks (budget_tokens / chunk_size: what one Attend pins in the steady state) with
// TieredStore::ReserveHotSlots, and refuse the session with ResourceExhausted, naming the pool's slots, the
// slots reserved and the slots asked, when the open sessions' reservations would exceed the pool (sessions
// attached to one sequence count once, at the largest). Close, Drop and destruction give the reservation
// back; retrieve = false reserves nothing. The entropy cut-off may grant a layer more chunks than the
// reservation (the budget's share of one layer); the chunks past the reservation are fetched only from
// slots that no other open session's reservation claims (a claim: the larger of a session's reservation
// and the slots it holds pinned), and the rest of the grant is left out, counted in chunks_clipped
// (AttendStats, SessionCounters), rather than waited for. So a grant is capped at the reservation
// exactly when the pool is short. (Reserving what a layer can be granted instead would reserve nearly
// the step's whole budget, layers x budget chunks, per session: Eq. 12 may hand one layer almost all
// of it.) Every session can therefore always pin its reservation at once: an engine
// that batches many sessions on one thread (per layer: Gather every session, attend, release all)
// never waits. With a pool that holds every grant beside the others' reservations, nothing is left out
// and results do not depend on other sessions; where it is short, what a layer attends past its
// reservation depends on what the other sessions hold at that moment. A fetch never waits for pins
// the calling thread holds: it fails at once with ResourceExhausted saying so. Otherwise, where it
// must, a fetch waits for other threads' Attends to unpin (StoreOptions::pin_wait_ms,
// StoreCounters::pin_waits) instead of failing. tests/engine/session_pins_test.cc runs many sessions
// on many threads at a pool just above their summed budgets, and 8 and 16 sessions batched on one
// thread. An engine that keeps one layer's LayerParts while it gathers the next gets
// ResourceExhausted at once where the two together would pass its reservation and the pool
// is short, never a deadlock (TieredStore::FetchChunks says why).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "kvtier/status.h"
#include "kvtier/store.h"
#include "kvtier/types.h"

namespace kvtier {

// Internal types the session holds or hands to tools built with the library's sources;
// an engine needs none of them.
class AttentionBackend;  // offload/attention_backend.h
class AttentionPlan;     // offload/attention_backend.h
class Retriever;         // retrieval/retriever.h
class ScoringPolicy;     // offload/policy/scoring_policy.h
class TieredStore;       // offload/tiered_store.h: the Store's implementation
struct ChunkInfo;        // offload/tiered_store.h
struct HotView;          // offload/tiered_store.h
struct LayerParts;       // engine/layer_parts.h: what Gather returns

/// Picks the sealed chunks one layer's queries attend to, in place of retrieval.
/// `q` is [m, q_heads, head_dim] fp32 as memory sees it (kInfLLM: rotated by
/// position - L0); `chunks` lists the layer's live sealed chunks in token order.
/// Returns chunk indices (ChunkKey::index) to fetch.
using ChunkSelector = std::function<Result<std::vector<uint64_t>>(
    int layer, const float* q, const int64_t* positions, int m, const std::vector<ChunkInfo>& chunks)>;

/// Every live sealed chunk: full attention through the store.
Result<std::vector<uint64_t>> SelectAllChunks(int layer, const float* q, const int64_t* positions, int m,
                                              const std::vector<ChunkInfo>& chunks);

/// Retrieval settings under one name (`--preset` of kvtier run and kvtier infinite).
///  * "kvtier" (the default of SessionOptions and of the CLI): ActQKV's activation-bias probe
///    (Eq. 7-9) and entropy cut-off (Eq. 10-12), with a chunk scored by its most interested
///    kv head (index Exact:heads=max) and a layer taking its B^l chunks in logit order
///    (alloc entropy:rank=logit). Measured against "actqkv" on both workloads (docs/benchmarks.md,
///    "Retrieval presets"): synthetic 128K needle hit 0.875 vs 0.730 for ~7% more step time;
///    the trained model's passkey 1.0 vs 0.0 at 4K-64K.
///  * "actqkv": ActQKV as written (Algorithm 1): the same probe and budget, scores summed over
///    kv heads, chunks taken in cosine order, 4 representative keys per chunk.
///  * "infllm": InfLLM as written: the mean of the window's queries, a fixed top-k, a chunk
///    scored by the mean of its 4 representative keys, summed over kv heads (index "Flat":
///    score(c) = sum_h <p_h, mean_r k_{c,r,h}>, as InfLLM's code scores a block).
struct RetrievalPreset {
  RetrieverOptions
      retrieval;      ///< probe, allocator, index (budget_tokens left at its default for the caller to set)
  int repr_topk = 0;  ///< representatives per chunk the preset is written with; 0 = leave the store's setting
};
Result<RetrievalPreset> MakeRetrievalPreset(const std::string& name);
/// A paper preset ("infllm", "actqkv") as the comparison rows of `kvtier run --compare` and
/// `kvtier infinite --compare` run it over the user's retrieval settings: the preset's probe and
/// allocator at `configured`'s budget, over `configured`'s index kind with kv-head scores summed
/// where that kind computes the preset's chunk score, else over the preset's own index. So the
/// InfLLM row scores the mean of the representatives (a FAISS kind, "Flat" when the configured
/// kind is Exact, whose score is the best single representative) and the ActQKV row keeps the
/// configured kind with heads=sum.
Result<RetrieverOptions> PaperRetrieval(const std::string& preset, const RetrieverOptions& configured);
/// Every preset name, the default first.
std::vector<std::string> RetrievalPresetNames();

enum class StepKind {
  kPrefill,  ///< a window of m >= 1 prompt tokens: the probe pools the window and updates Eq. 8's statistics
  kDecode,   ///< one generated token: the probe is that token's own query (ActQKV Sec. 4.2)
};

/// What one Compress did.
struct CompressReport {
  std::string policy;           ///< the policy's ToString()
  uint64_t dropped_chunks = 0;  ///< over every layer
  uint64_t kept_tokens = 0;     ///< per layer, mean over layers, after the compression
  int64_t compress_every = 0;   ///< the policy's decode-time recompression period (0 = once)
};

class Session {
 public:
  /// Creates a new sequence in `store` and a session over it. The store must outlive the session.
  /// ResourceExhausted when the hot pool cannot hold this session's budget beside the
  /// reservations of the sessions already open (see "Sharing the hot slot pool" above).
  static Result<std::unique_ptr<Session>> Open(Store* store, const SessionOptions& options);
  /// A session over an existing sequence (e.g. one recovered by reopening the store, or one
  /// another session appends to).
  static Result<std::unique_ptr<Session>> Attach(Store* store, SequenceId seq, const SessionOptions& options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  SequenceId sequence() const { return seq_; }
  /// The store's implementation, for tools built with the library's sources.
  TieredStore* store() const { return store_; }
  const SessionOptions& options() const { return options_; }
  const Geometry& geometry() const;

  /// Appends n tokens of K and V ([n, kv_heads, head_dim] in `dtype`, which must be the
  /// store's) to one layer. kInfLLM: keys before RoPE. `space` says where k and v live
  /// (TieredStore::Append): kDevice hands a GPU engine's K/V straight to a "cuda" hot tier,
  /// device to device, with no host round trip; their writes must be complete (the tier's
  /// transfer stream does not wait for the engine's stream).
  /// Host K/V must be finite: the first NaN or infinity in k or v is InvalidArgument naming the
  /// layer, the tensor, the token, the kv head and the value, and nothing of the call is
  /// appended (one read of the bytes, before the copy). kDevice K/V are not scanned: NaN or inf
  /// there gives non-finite attention outputs.
  Status Append(int layer, const void* k, const void* v, int n, DType dtype,
                MemorySpace space = MemorySpace::kHost);
  /// Starts a step over all layers.
  Status BeginStep(StepKind kind);
  /// One layer's memory step: q [m, q_heads, head_dim] fp32 at `positions`, out [m, q_heads,
  /// head_dim] fp32. kDecode steps take m = 1. The positions are the layer's last m tokens:
  /// with N tokens in the layer (every token appended to the sequence's layer, by any session
  /// over it, a shared prefix's included; compression's holes still count), exactly
  /// N - m, ..., N - 1, in both position modes (kInfLLM passes true positions too). So a
  /// window's K/V are appended before its queries attend. A layer holding no tokens is
  /// FailedPrecondition ("layer L holds no tokens"); other positions are InvalidArgument
  /// naming what the layer holds ("layer L holds positions 0..N-1") and what was passed, as are
  /// a negative or non-increasing position and a NaN or infinity in q. Gather and Observe check
  /// the same; nothing is attended, fetched or observed on a refusal. A kPrefill window's representative-key
  /// statistics come from this attention on the hot tier's device (sinks | local with per-key
  /// mass, the chunks apart, merged by log-sum-exp), not from a second pass; a store whose
  /// repr_topk equals chunk_size keeps every key and needs no statistics.
  Status Attend(int layer, const float* q, const int64_t* positions, int m, float* out,
                AttendStats* stats = nullptr);
  /// Attend without the attention: chooses and fetches the chunks and returns what to attend.
  /// LayerParts (engine/layer_parts.h) holds the kernels' spans: for code built with the
  /// library's sources, not part of the installed API.
  Result<LayerParts> Gather(int layer, const float* q, const int64_t* positions, int m);
  /// Feeds prefill queries to the statistics (probe Eq. 8, representative keys, the query
  /// ring for Compress) without attending: for engines that attend elsewhere.
  Status Observe(int layer, const float* q, const int64_t* positions, int m);
  /// The task's question for a question-aware probe (Q-LLM); FailedPrecondition for other probes.
  Status SetQuestion(int layer, const float* q, int m);
  /// Replaces retrieval by a selector (an oracle, StreamingLLM's "nothing", ...); null restores retrieval.
  void SetChunkSelector(ChunkSelector selector) { selector_ = std::move(selector); }

  /// Compression: the last n_queries kept queries (0 = every kept one; needs keep_queries > 0)
  /// attend exactly over every key each layer holds, `policy` (a scoring-policy factory string)
  /// observes that and keeps kv_budget tokens per layer, sinks and local window included; the
  /// other chunks leave the store and the index for good. The policy object persists across
  /// calls with the same spec (its state is kept by token position, as G-KV's decode-time
  /// recompression needs); a different spec starts a new one.
  Result<CompressReport> Compress(const std::string& policy, int64_t kv_budget, int n_queries = 0);

  /// Persists sinks and local window; the sequence becomes read-only. Gives the session's hot
  /// slot reservation back (a later Attend runs without one: it may wait for slots).
  Status Close();
  /// Removes the sequence from every tier. Afterwards every call that returns a Status or Result
  /// is FailedPrecondition, a second Drop included; counters() stays readable.
  Status Drop();

  SessionCounters counters() const { return counters_; }
  /// Hot slots this session holds reserved (0 after Close or Drop, or with retrieve = false).
  int32_t reserved_slots() const { return reserved_slots_; }
  /// Chunk indices each layer attended in the last step, [layer].
  const std::vector<std::vector<uint64_t>>& last_chunks() const { return last_chunks_; }
  /// The retriever (null when retrieve = false), e.g. for Describe().
  Retriever* retriever() { return retriever_.get(); }
  /// Rotates x [m, heads, head_dim] fp32 in place with this session's RoPE at `positions`.
  void ApplyRope(float* x, int m, int heads, const int64_t* positions) const;

 private:
  Session(TieredStore* store, SequenceId seq, const SessionOptions& options);
  Status CheckFiniteKv(int layer, const void* k, const void* v, int n, DType dtype) const;
  // Gather's work; `what` names the public call (Gather or Attend) in its errors.
  Result<LayerParts> GatherFor(const char* what, int layer, const float* q, const int64_t* positions, int m,
                               bool observe = true);
  Status CheckLayerCall(const char* what, int layer, const float* q, const int64_t* positions, int m,
                        bool in_step) const;
  // The positions rule of Attend: `positions` (checked increasing) are the last m of the
  // `held` tokens the layer holds.
  Status CheckPositionsHeld(const char* what, int layer, const int64_t* positions, int m, int64_t held) const;
  // kInfLLM rotations of q [m, q_heads, head_dim] into scratch (q itself in kAbsolute):
  // memory's view (by position - L0) and attention's (at the true positions).
  const float* MemoryQueries(const float* q, const int64_t* positions, int m, int64_t local_start);
  const float* TrueQueries(const float* q, const int64_t* positions, int m);
  void KeepQueries(int layer, const float* q, const int64_t* positions, int m);
  // The representative-key statistics of a prefill window (the attention its queries pay to
  // the sinks and local window, added to the store's ring mass) and the retriever's Observe.
  Status ObserveLocked(int layer, const float* q, const float* q_mem, const int64_t* positions, int m,
                       const HotView& view, int64_t local_start);
  // Whether prefill feeds the statistics: observe_prefill, and the store keeps fewer
  // representatives than a chunk has keys (with every key a representative, the statistics
  // choose nothing and their attention is skipped).
  bool ObservesStatistics() const;
  // The statistics alone. kAbsolute: the store's own pass (ObserveQueries). kInfLLM: the
  // store keeps keys before RoPE, so the pass runs here, on fp32 copies rotated where Attend
  // puts them, and hands the local window's mass to the store (AddLocalAttention).
  Status ObserveStatistics(int layer, const float* q, const int64_t* positions, int m, const HotView& view,
                           int64_t local_start);

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
  std::vector<int64_t> rel_;
  std::vector<std::vector<float>> rot_k_, rot_v_;
  std::vector<float> rot_pool_;  // kInfLLM: rotated chunks as a slot pool ([K][V] fp32 per chunk)
  std::unique_ptr<AttentionBackend> backend_;  // runs the plan where the hot tier's memory is
  std::unique_ptr<AttentionPlan> plan_;        // rebuilt every Attend, its vectors reused
};

}  // namespace kvtier
