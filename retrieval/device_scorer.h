// Retrieval backends: the Exact index's selection of one layer as a plan that runs
// where the hot tier's memory is, in the pattern of offload/attention_backend.h (plan on the
// host, run on a backend "cpu" or "cuda", one workspace owned by the backend).
//
// The Exact index (exact_index.h) may keep a MIRROR of its representatives on a backend
// (ReprMirror): keys [kv_heads, capacity, repr, head_dim] in the store's dtype and inverse norms
// [kv_heads, capacity, repr], kernels::ChunkScoreParams' layout with chunk_stride = capacity.
// Capacity grows by an eighth, never doubling (every row is uploaded again then, so uploads
// stay amortised O(1) per row, about 9 per row, and the slack is at most an eighth of the
// rows); under the index's memory cap it grows only into what the cap leaves, and it shrinks
// when the cap evicts rows. Add and Remove mark the first row they changed, and the rows from there are
// uploaded before the next selection (one copy per head and array for a whole batch, and one
// wait: cudaMemcpyAsync from pageable memory does not promise the source may change on return,
// and the index's host vectors do change with the next Add). So a layer whose index took new
// chunks since its last selection synchronises twice; every other layer once.
//
// One layer's selection (RetrievalBackend::RunLayer), with k_max known beforehand:
//   in-block upload (probe, top-k offsets and k) -> ScoreChunks (logit and Eq. 10 cosine per
//   chunk) -> [entropy allocator] SegmentEntropy (Eq. 11 of the cosines, and how many of them
//   are not finite) -> SegmentedTopK of the allocator's rank (cosine or logit), k_max best
//   rows -> out-block download (Theta, the count, the k_max rows) -> ONE synchronisation.
// Eq. 12 (the budget B^l) is a scalar flow across layers and stays on the host
// (BudgetAllocator::AllocateWithEntropy). It needs Theta, which only the device has, so the
// top-k is started before the budget is known with k_max = BudgetAllocator::MaxTake (the
// clamp's upper bound, min(n, B_kv - M x deeper layers), capped by the hot slot pool): the
// segmented sort orders the whole layer whatever k is, so a larger k costs the device
// nothing, the download is at most k_max int32s, and the host keeps the first B^l. Doing Eq. 12
// between the entropy and the top-k would cost a second synchronisation per layer.
//
// Backends:
//  * "cpu": the CPU twins (kernels/cpu/chunk_score.h, entropy.h) over a host mirror and a host
//    workspace in exactly the cuda layout, through the same RunLayer sequence. What it chooses
//    is what the Exact index chooses with rerank=0 (one exact fp32 pass): the same per-chunk
//    arithmetic (ScoreChunksOneHead), the same Eq. 11 (SoftmaxEntropy) and the same order
//    (score descending, ties to the lower row, -0 == +0); tests/retrieval/device_retrieval_test.cc checks it.
//  * "cuda" (builds with CUDA): the mirror and the workspace are cudaMalloc'd, copies and
//    launches (kernels/cuda/kernels.h) go on the backend's own non-blocking stream, the in- and
//    out-blocks through pinned host staging. Without a device MakeRetrievalBackend answers Unavailable "no
//    CUDA device: ...". The scoring kernel repeats the twin's arithmetic in the twin's order
//    (kernels/cuda/kernels.h), so its scores, and with CUB's stable sort its order, are the cpu backend's:
//    the tests assert equal selections when a device exists. Eq. 11 on the device (exp and block sums in
//    double) may differ from the twin in Theta's last bits, which changes Eq. 12's floor only
//    for a share within ~1e-16 of an integer.
//
// The probe: a prefill window's (ActQKV Eq. 7-9, running statistics) is built on the host twin
// (retrieval/probe.h) and travels in the in-block. A decode step's query may instead stay where
// the engine wrote it (LayerSelectPlan::queries, Session::AttendDevice): the backend then builds
// the decode probe itself (ActQKV Sec. 4.2: Q_probe = q, mean-pooled per GQA group, rotated to
// memory's position first with InfLLM positions) from a copy of q in its workspace, and checks q
// for NaN and infinity (kernels::CountNonFinite), the count and the first index coming back in
// the out-block with the rows, so the host never holds q. The rotation and the pooling are the
// twins' (kernels/cpu/rope.h, probe.h), so the probe is the host path's bit for bit.
//
// Thread-safety: a backend serves one Retriever (one sequence, one thread at a time).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/entropy.h"
#include "kernels/cpu/probe.h"
#include "retrieval/budget.h"  // ChunkRank
#include "retrieval/chunk_index.h"
#include "store/status.h"

namespace kvtier {

/// One host -> backend copy.
struct BackendCopy {
  uint8_t* dst = nullptr;     ///< backend memory
  const void* src = nullptr;  ///< host memory
  size_t bytes = 0;
};

/// A decode step's query in the backend's memory, from which the backend builds the probe.
struct BackendQueries {
  const float* q = nullptr;  ///< backend memory, [q_heads, head_dim] fp32: one query
  int q_heads = 0;           ///< a multiple of the plan's kv_heads
  /// Host [head_dim / 2] frequencies (kernels::RopeInvFreq) to rotate q by at rope_position
  /// before pooling (InfLLM positions: memory sees the query at its position minus L0); null:
  /// q is memory's view already (absolute positions).
  const double* rope_inv_freq = nullptr;
  int64_t rope_position = 0;  ///< may be negative (a query among the sinks, before L0)
  /// cuda: the stream whose work wrote q (the backend's stream waits for it through an event,
  /// never the host); null: the legacy default stream. Ignored by "cpu".
  void* after_stream = nullptr;
};

/// What one layer's selection runs.
struct LayerSelectPlan {
  /// The mirror's view (ReprMirror::Params): shape, fold, n_chunks, chunk_stride, keys and
  /// inv_norm in backend memory. probe, logit and cosine are ignored (the backend sets them).
  kernels::ChunkScoreParams score;
  const float* probe = nullptr;        ///< host [kv_heads, head_dim] fp32; null iff queries.q is set
  BackendQueries queries;              ///< a decode query in backend memory: the probe is built there
  ChunkRank rank = ChunkRank::kLogit;  ///< the score the top-k orders by
  bool entropy = false;                ///< compute Eq. 11 of the cosines (and count non-finite ones)
  int k_max = 0;                       ///< rows to bring back, best first; in [0, n_chunks]
};

struct LayerSelectResult {
  std::vector<int32_t> rows;  ///< the min(k_max, n) best rows by plan.rank, best first
  double entropy = 0.0;       ///< Eq. 11 of the cosines (plan.entropy; else 0)
  int32_t non_finite = 0;     ///< cosines that are not finite (plan.entropy; else 0)
  /// plan.queries: how many of q's values are NaN or infinite, and the index of the first
  /// (INT32_MAX when none). The rows mean nothing when q_non_finite > 0.
  int32_t q_non_finite = 0;
  int32_t q_first_non_finite = INT32_MAX;
};

/// Host-side checks of a plan (shapes, pointers, k_max, the int32 segment limit), as
/// InvalidArgument naming what was wrong. Reads no backend memory.
Status ValidateLayerSelectPlan(const LayerSelectPlan& plan);

/// A backend's one workspace for layers of up to n_chunks chunks, laid out on the host as byte
/// offsets from its base, each part 256-aligned:
///   in-block  = probe [probe_floats] fp32 | top-k offsets [2] int32 | top-k k [1] int32  (one upload)
///               [with q_floats > 0: | pad | q_position int64 | inv_freq [rope_pairs] double]
///   [with q_floats > 0: q [q_floats] fp32, the queries' copy the probe is built from]
///   logit [n], cosine [n] fp32
///   out-block = entropy double | non_finite int32 | q_non_finite int32 | q_first int32 | pad
///               | rows [k_max] int32                                                      (one download)
///   top-k     = the top-k launcher's own workspace (topk_bytes)
struct RetrievalWorkspaceLayout {
  size_t in = 0, in_bytes = 0, probe = 0, offsets = 0, k = 0, q_position = 0, inv_freq = 0;
  size_t q = 0;
  size_t logit = 0, cosine = 0;
  size_t out = 0, out_bytes = 0, entropy = 0, non_finite = 0, q_non_finite = 0, q_first = 0, rows = 0;
  size_t topk = 0, topk_bytes = 0;
  size_t total = 0;
  int64_t n_chunks = 0;  ///< the most chunks (and rows) it holds
  int q_floats = 0;      ///< the most query floats it holds (0: no query part)
  int rope_pairs = 0;    ///< the most rotation frequencies its in-block holds
};
RetrievalWorkspaceLayout LayoutRetrievalWorkspace(int probe_floats, int64_t n_chunks, size_t topk_bytes,
                                                  int q_floats = 0, int rope_pairs = 0);

/// The kernels' parameters for `plan` in a workspace at `base` (backend memory) laid out by
/// `layout`: scoring into logit/cosine, Eq. 11 over the cosines, the top-k of plan.rank.
struct LayerKernelParams {
  kernels::ChunkScoreParams score;
  kernels::EntropyParams entropy;
  kernels::SegmentedTopKParams topk;
};
LayerKernelParams LayerParamsIn(uint8_t* base, const RetrievalWorkspaceLayout& layout,
                                const LayerSelectPlan& plan);

class RetrievalBackend {
 public:
  virtual ~RetrievalBackend();
  RetrievalBackend(const RetrievalBackend&) = delete;
  RetrievalBackend& operator=(const RetrievalBackend&) = delete;

  virtual const char* name() const = 0;  ///< "cpu" | "cuda"

  // ---- backend memory, for mirrors ----
  /// `bytes` (> 0) of backend memory, uninitialised; ResourceExhausted when it cannot.
  virtual Result<uint8_t*> Allocate(size_t bytes) = 0;
  virtual void Free(uint8_t* p) = 0;  ///< null is a no-op
  /// Frees `p` once the work submitted so far is done, with no host wait (cpu: at once; cuda:
  /// device_memory::FreeAfter on the backend's stream). Null is a no-op.
  virtual void FreeAfterWork(uint8_t* p) = 0;
  /// Copies `bytes` between backend buffers, ordered like Upload, with no host wait.
  virtual Status CopyWithin(uint8_t* dst, const uint8_t* src, size_t bytes) = 0;
  /// Every copy is ordered before any later copy or launch of this backend, and the sources may
  /// change once it returns OK (cpu: copied at once; cuda: up to 1 MiB in all staged through
  /// pinned memory and left in flight, with no host wait; more, copied and waited for).
  virtual Status Upload(const BackendCopy* copies, size_t n) = 0;
  virtual Status Download(void* dst, const uint8_t* src, size_t bytes) = 0;

  /// The top-k launcher's workspace for one segment of n chunks (cpu: 0, its twin allocates;
  /// cuda: SegmentedTopKWorkspaceBytes, which asks CUB and so needs a device).
  virtual Result<size_t> TopKWorkspaceBytes(int64_t n_chunks) = 0;
  /// The stream every copy and launch of this backend is ordered on (a cudaStream_t), for work
  /// that must follow a selection's kernels or precede a mirror's reallocation (a session's
  /// device lane); null for "cpu".
  virtual void* stream() const { return nullptr; }

  /// Runs one layer's selection: validate, reserve, upload the in-block, launch, download the
  /// out-block, synchronise once. InvalidArgument for a bad plan, Internal for a failed kernel.
  Status RunLayer(const LayerSelectPlan& plan, LayerSelectResult* out);
  /// Only the check of `queries` (a layer with nothing to select still refuses a NaN query):
  /// *count and *first as LayerSelectResult's q_non_finite and q_first_non_finite. One wait.
  Status CheckQueries(const BackendQueries& queries, int head_dim, int32_t* count, int32_t* first);

  /// Makes the workspace hold layers of n_chunks (and probes of probe_floats): grows it, when
  /// needed, to n_chunks and an eighth (at least 1024 chunks), so a growing cache resizes it
  /// O(log n) times and never holds more than an eighth past its largest layer. RunLayer calls it.
  Status Reserve(int probe_floats, int64_t n_chunks, int q_floats = 0, int rope_pairs = 0);
  const RetrievalWorkspaceLayout& layout() const { return layout_; }
  size_t workspace_bytes() const { return layout_.total; }

 protected:
  RetrievalBackend() = default;
  // The workspace and host staging of `layout` (the old ones may be freed: the last run
  // has finished when RunLayer returns).
  virtual Status AllocateWorkspace(const RetrievalWorkspaceLayout& layout) = 0;
  virtual uint8_t* workspace() = 0;  // backend memory, layout_.total bytes
  virtual uint8_t* staging() = 0;    // host memory, layout_.in_bytes + layout_.out_bytes bytes
  // Enqueue: staging[0, in_bytes) -> workspace + layout_.in; the kernels; workspace +
  // layout_.out -> staging + in_bytes (out_bytes of it); then wait for all of it.
  virtual Status CopyIn(size_t bytes) = 0;
  virtual Status Launch(const LayerKernelParams& k, const LayerSelectPlan& plan) = 0;
  // Enqueue, after the in-block's upload and before Launch: (after queries.after_stream's work)
  // q -> the workspace's q, rotated by the in-block's inv_freq at its q_position when
  // queries.rope_inv_freq is set; the decode probe into the in-block's probe when `probe`;
  // CountNonFinite of q into the out-block. `shape` is the probe's.
  virtual Status LaunchQueries(const BackendQueries& queries, const kernels::ProbeShape& shape,
                               bool probe) = 0;
  virtual Status CopyOutAndWait(size_t bytes) = 0;

  RetrievalWorkspaceLayout layout_;
  int probe_floats_ = 0;

 private:
  // The in-block's query part (q_position, inv_freq) written into staging for `queries`.
  void StageQueries(const BackendQueries& queries, int head_dim);
};

/// "cpu" (the twins on host memory) or "cuda" (builds with CUDA and a device). Unavailable
/// "no CUDA device: ..." without a device, or naming a build without CUDA; InvalidArgument for
/// another name.
Result<std::unique_ptr<RetrievalBackend>> MakeRetrievalBackend(const std::string& device);

/// The Exact index's representatives on a backend (see the header comment).
class ReprMirror {
 public:
  /// `backend` must outlive the mirror.
  static Result<std::unique_ptr<ReprMirror>> Create(RetrievalBackend* backend, const ChunkShape& shape);
  ~ReprMirror();
  ReprMirror(const ReprMirror&) = delete;
  ReprMirror& operator=(const ReprMirror&) = delete;

  /// Makes the mirror hold rows [0, n), uploading rows [first, n) from the host: keys[h] is
  /// head h's [n, R, D] in the shape's dtype, inv_norm[h] its [n, R]. Rows below `first` must
  /// be unchanged since the last Update. Past the capacity it grows to
  /// max(n + n / 8, min(capacity + capacity / 8 (at least 16), max_rows)) (so one seal after a
  /// first sync does not grow it again), clipped to max(n, max_rows); above max(n, max_rows) it
  /// shrinks to that. A growth with no cap on the rows (max_rows = SIZE_MAX) keeps the rows below
  /// `first` on the backend: the new arrays are allocated, those rows copied across
  /// (CopyWithin) and the old arrays freed once the copies are done (FreeAfterWork), with no
  /// host wait; so the backend holds both capacities for a moment. Under a cap, and for a
  /// shrink, it frees the old arrays before it allocates the new ones (its backend memory never
  /// passes bytes()) and uploads every row. On an error the mirror holds the rows below `first`
  /// (none when it was reallocating): Update again from 0.
  Status Update(size_t first, size_t n, const std::vector<std::vector<uint8_t>>& keys,
                const std::vector<std::vector<float>>& inv_norm, size_t max_rows = SIZE_MAX);
  /// The scoring view: shape, fold, n_chunks = rows(), chunk_stride = capacity(), keys, inv_norm.
  kernels::ChunkScoreParams Params(kernels::HeadFold::Kind fold) const;
  /// The rows, packed as [kv_heads, rows, repr, head_dim] (dtype bytes) and [kv_heads, rows, repr].
  Status Download(std::vector<uint8_t>* keys, std::vector<float>* inv_norm) const;
  size_t rows() const { return rows_; }
  size_t capacity() const { return capacity_; }
  uint64_t bytes() const { return capacity_ * row_bytes(); }
  /// One row's bytes over every head: R keys and R inverse norms per kv head.
  uint64_t row_bytes() const { return (row_key_bytes_ + row_inv_bytes_) * shape_.kv_heads; }
  RetrievalBackend* backend() const { return backend_; }

 private:
  ReprMirror(RetrievalBackend* backend, const ChunkShape& shape);
  RetrievalBackend* backend_;
  const ChunkShape shape_;
  size_t row_key_bytes_ = 0, row_inv_bytes_ = 0;  // one chunk of one head: R keys, R floats
  size_t rows_ = 0, capacity_ = 0;
  uint8_t* keys_ = nullptr;      // [H, capacity, R, D] dtype
  uint8_t* inv_norm_ = nullptr;  // [H, capacity, R] fp32
};

}  // namespace kvtier
