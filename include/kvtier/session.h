// kvtier::Session: one sequence of a Store, the object an inference engine talks to. It holds
// the sequence's retrieval state (two sequences never mix their statistics) and runs a layer's
// whole memory step in one call:
//
//   Attend(layer, q, positions, m, out)
//     = probe (ActQKV Eq. 7-9) -> chunk search (Eq. 10) -> budget (Eq. 11-12)
//       -> fetch the chosen chunks into hot slots -> attention over
//          sinks | chunks | local window (log-sum-exp merged) -> unpin
//
// The step protocol: BeginStep(kind), then for each layer 0, 1, ..., L-1 in that order, Append
// the layer's new K/V and Attend its queries. Appending first puts a window's own keys in the
// local window (the mask is causal by positions); going shallow to deep lets the entropy budget
// hand what a shallow layer leaves to deeper ones. A prefill step takes a window of m >= 1
// queries, a decode step one.
//
// Positions (SessionOptions::positions):
//  * kAbsolute (default): the engine applies RoPE; keys and queries arrive rotated at their
//    absolute positions. With every chunk attended this is exactly full attention.
//  * kInfLLM: keys and queries arrive BEFORE RoPE and the session rotates them when it attends
//    (rotate-half RoPE, rope_theta), as InfLLM does: the local window at its true positions,
//    retrieved chunks at the window's first position L0, the sinks at L0 too once chunks
//    separate them from the window. Queries keep their true positions. Host hot tier only.
//
// Threading: one thread drives a Session at a time. Sessions over one Store may run on
// different threads at once, and their results do not depend on the thread or on the other
// sessions while the hot slot pool holds what they attend (below). Several Sessions may attach
// to one sequence (e.g. to compare retrieval settings); only one of them may Append, and they
// must not run at once.
//
// Sharing the hot slot pool: Open and Attach reserve the session's budget, budget_tokens /
// chunk_size hot slots, and refuse the session with ResourceExhausted (naming the pool's slots,
// the slots reserved and the slots asked) when it does not fit beside the open sessions'
// reservations; Close, Drop and destruction give it back. A layer granted more chunks than the
// reservation fetches the extra ones only from slots no other session claims, and leaves the
// rest out, counted in chunks_clipped (AttendStats, SessionCounters). So every session can
// always pin its reservation at once; where the pool is short, what a layer attends past its
// reservation depends on what the other sessions hold at that moment.
//
// Errors: every call returns a Status or Result naming what was wrong; a call refused for bad
// input changes nothing. Tools built with the library's sources reach more of the session
// (the spans to attend, a chunk selector, the store and retriever behind it) through
// engine/session_internal.h, which also says how a step runs inside.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "kvtier/status.h"
#include "kvtier/store.h"
#include "kvtier/types.h"

namespace kvtier {

/// Retrieval settings under one name (`--preset` of kvtier run and kvtier infinite).
///  * "kvtier" (the default of SessionOptions and of the CLI): ActQKV's activation-bias probe
///    (Eq. 7-9) and entropy cut-off (Eq. 10-12), with a chunk scored by its most interested
///    kv head (index Exact:heads=max) and a layer taking its B^l chunks in logit order
///    (alloc entropy:rank=logit). Measured against "actqkv" on both workloads (docs/benchmarks.md,
///    "Retrieval presets"): synthetic 128K needle hit 0.875 vs 0.730 for ~7% more step time;
///    the trained model's passkey 1.0 vs 0.0 at 4K-64K.
///  * "kvtier-fast": "kvtier" searched less often (reuse_cosine 0.8): while no chunk landed in
///    or left a layer and its probe stays put, a decode step rescores the layer's last shortlist
///    instead of searching. Not exact (a chunk a full search would take can be missed); held to
///    answers and needle hits (docs/benchmarks.md, "The kvtier-fast preset").
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
  virtual ~Session() = default;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  virtual SequenceId sequence() const = 0;
  virtual const SessionOptions& options() const = 0;
  virtual const Geometry& geometry() const = 0;

  /// Appends n tokens of K and V ([n, kv_heads, head_dim] in `dtype`, which must be the
  /// store's) to one layer. kInfLLM: keys before RoPE. `space` says where k and v live:
  /// kDevice hands a GPU engine's K/V straight to a "cuda" hot tier, device to device, with no
  /// host round trip; their writes must be complete (the tier's transfer stream does not wait
  /// for the engine's stream).
  /// Host K/V must be finite: the first NaN or infinity in k or v is InvalidArgument naming the
  /// layer, the tensor, the token, the kv head and the value, and nothing of the call is
  /// appended (one read of the bytes, before the copy). kDevice K/V are not scanned: NaN or inf
  /// there gives non-finite attention outputs.
  virtual Status Append(int layer, const void* k, const void* v, int n, DType dtype,
                        MemorySpace space = MemorySpace::kHost) = 0;
  /// Starts a step over all layers.
  virtual Status BeginStep(StepKind kind) = 0;
  /// One layer's memory step: q [m, q_heads, head_dim] fp32 at `positions`, out [m, q_heads,
  /// head_dim] fp32. kDecode steps take m = 1. The positions are the layer's last m tokens:
  /// with N tokens in the layer (every token appended to the sequence's layer, by any session
  /// over it, a shared prefix's included; compression's holes still count), exactly
  /// N - m, ..., N - 1, in both position modes (kInfLLM passes true positions too). So a
  /// window's K/V are appended before its queries attend. A layer holding no tokens is
  /// FailedPrecondition ("layer L holds no tokens"); other positions are InvalidArgument
  /// naming what the layer holds ("layer L holds positions 0..N-1") and what was passed, as are
  /// a negative or non-increasing position and a NaN or infinity in q. Observe checks the same;
  /// nothing is attended, fetched or observed on a refusal. A prefill window also feeds the
  /// representative-key statistics from this same attention (no second pass).
  virtual Status Attend(int layer, const float* q, const int64_t* positions, int m, float* out,
                        AttendStats* stats = nullptr) = 0;

  /// The device-pointer calls, for an engine whose K/V, queries and outputs live on the GPU: a
  /// store opened with StoreOptions::device = Device::kCuda, the "cuda" hot tier
  /// (FailedPrecondition on a "host" tier, which Append and Attend serve). Same arguments, checks and results
  /// as Append(..., MemorySpace::kDevice) and Attend, except that k, v, q and out are device pointers and the
  /// work is ordered on the engine's CUDA stream `stream` (its cudaStream_t; null is the legacy default
  /// stream): kvtier's copies and kernels of the call start after everything the engine submitted to `stream`
  /// before the call, and whatever the engine submits to `stream` after the call starts after
  /// them. That ordering is made on the device (events the streams wait for), never by blocking
  /// the host. So the engine may write q and K/V on its stream and call at once, and read `out`
  /// (or overwrite k, v and q) on its stream after the call without a synchronisation.
  ///
  /// AppendDevice does not block the host in steady decode (a chunk sealed out of the local
  /// window lands without a wait too). A decode query stays on the device where the retrieval
  /// backend selects (Exact index, no search reuse, no kept queries), and such a decode layer
  /// step runs on the session's DEVICE LANE (engine/device_lane.h) when every chunk of the layer
  /// has a warm copy: probe, scores, Eq. 11, Eq. 12 (the allocator's state in device memory), the
  /// top-B, a device chunk table over a slot pool of the session's own (hits kept from step to
  /// step, misses copied from their warm copies) and the attention, with no host wait in a quiet
  /// step nor in one that seals a chunk (a chunk still landing is scored on the device from
  /// representatives chosen there; docs/architecture.md, "The device decode step"). A decode step
  /// between seals can be captured into a CUDA graph in Relaxed mode and launched before the
  /// session's next call (same page). What it chose reaches
  /// the host one step late, through a step report the next layer calls read when it is done:
  /// last_chunks(), counters()' chunks_attended and max_layer_chunks, and a refusal of a q that
  /// held NaN or infinity (InvalidArgument naming q[0][head][d], returned by the call that reads
  /// the report; that step's out means nothing); stats->chunks is 0 there. WaitForDevice
  /// reads them at once. Every other layer call takes the host path unchanged (a prefill window,
  /// a layer with no chunks, a chunk only in a lower tier, whose fetch brings it back to warm for
  /// the next step; the allocator's state comes back from the device at that switch, one wait;
  /// with SessionOptions::defer_cold_chunks the lane skips such a chunk for the step instead, and
  /// a transfer worker brings it back to warm, not to the hot tier, with no wait here).
  /// The host path waits on the host, counted in SessionCounters::host_syncs (its workers' waits
  /// meanwhile in worker_host_syncs): for the selection's
  /// download (the budget and the fetch run on the host), for a fetch of chunks that are not hot,
  /// and in a prefill window for the representative-key statistics; where q does not stay on the
  /// device it comes down once (one more wait) for the host's probe and checks. The attention
  /// itself and its output add none.
  virtual Status AppendDevice(int layer, const void* k, const void* v, int n, DType dtype, void* stream) = 0;
  virtual Status AttendDevice(int layer, const float* q, const int64_t* positions, int m, float* out,
                              void* stream, AttendStats* stats = nullptr) = 0;
  /// Feeds prefill queries to the statistics (probe Eq. 8, representative keys, the query
  /// ring for Compress) without attending: for engines that attend elsewhere.
  virtual Status Observe(int layer, const float* q, const int64_t* positions, int m) = 0;
  /// The task's question for a question-aware probe (Q-LLM); FailedPrecondition for other probes.
  virtual Status SetQuestion(int layer, const float* q, int m) = 0;

  /// Compression: the last n_queries kept queries (0 = every kept one; needs keep_queries > 0)
  /// attend exactly over every key each layer holds, `policy` (a scoring-policy factory string)
  /// observes that and keeps kv_budget tokens per layer, sinks and local window included; the
  /// other chunks leave the store and the index for good. The policy object persists across
  /// calls with the same spec (its state is kept by token position, as G-KV's decode-time
  /// recompression needs); a different spec starts a new one.
  virtual Result<CompressReport> Compress(const std::string& policy, int64_t kv_budget,
                                          int n_queries = 0) = 0;

  /// Persists sinks and local window; the sequence becomes read-only. Gives the session's hot
  /// slot reservation back (a later Attend runs without one: it may wait for slots).
  virtual Status Close() = 0;
  /// Removes the sequence from every tier. Afterwards every call that returns a Status or Result
  /// is FailedPrecondition, a second Drop included; counters() stays readable.
  virtual Status Drop() = 0;

  virtual SessionCounters counters() const = 0;
  /// Hot slots this session holds reserved (0 after Close or Drop, or with retrieve = false).
  virtual int32_t reserved_slots() const = 0;
  /// Chunk indices each layer attended in the last step, [layer]. A decode layer that
  /// AttendDevice ran on the device lane (no host wait: see AttendDevice) is known to the host
  /// one step late: its entry, and counters()' chunks_attended and max_layer_chunks for it, are
  /// filled in when the next step's layer calls read its report, or by WaitForDevice.
  virtual const std::vector<std::vector<uint64_t>>& last_chunks() const = 0;
  /// Reads every step report the device lane still holds (one wait when one is not done), so
  /// that last_chunks() and counters() cover every step so far; returns the first error a report
  /// names (a query that was not finite, as Attend would have refused it). OK and no wait when
  /// nothing is pending (a host tier, or no decode step on the lane).
  virtual Status WaitForDevice() = 0;
  /// Rotates x [m, heads, head_dim] fp32 in place with this session's RoPE at `positions`
  /// (kInfLLM; a no-op in kAbsolute, where the engine applies RoPE).
  virtual void ApplyRope(float* x, int m, int heads, const int64_t* positions) const = 0;

 protected:
  /// Sessions come from Open and Attach only.
  Session() = default;
};

}  // namespace kvtier
