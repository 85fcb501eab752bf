#include "retrieval/device_scorer.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <new>
#include <string>

#include "kernels/cpu/rope.h"
#include "kernels/dtype.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "offload/device_sync_cuda.h"
#include "offload/pinned_staging.h"
#endif

namespace kvtier {
namespace {

size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

Status KernelFailure(const char* backend, const char* what, kernels::KernelError e,
                     const std::string& detail = "") {
  return Internal(std::string("retrieval (") + backend + "): " + what + ": " + kernels::KernelErrorString(e) +
                  (detail.empty() ? "" : " (" + detail + ")"));
}

Status CheckBackendQueries(const BackendQueries& q, int kv_heads, int head_dim) {
  if (q.q_heads <= 0 || kv_heads <= 0 || q.q_heads % kv_heads != 0)
    return InvalidArgument("retrieval plan: the queries' " + std::to_string(q.q_heads) +
                           " heads are not a multiple of the " + std::to_string(kv_heads) + " kv heads");
  if (head_dim <= 0 || (q.rope_inv_freq != nullptr && head_dim % 2 != 0))
    return InvalidArgument("retrieval plan: head_dim " + std::to_string(head_dim) +
                           " cannot be rotated (it must be even)");
  if (static_cast<int64_t>(q.q_heads) * head_dim >= INT32_MAX)
    return InvalidArgument("retrieval plan: a query of " + std::to_string(q.q_heads) + " x " +
                           std::to_string(head_dim) + " floats");
  return Status::Ok();
}

}  // namespace

// ---- plan, layout, parameters -----------------------------------------------------------

Status ValidateLayerSelectPlan(const LayerSelectPlan& plan) {
  kernels::ChunkScoreParams p = plan.score;
  // The backend supplies the probe and the outputs; check the rest as the launcher will.
  static float dummy;
  p.probe = &dummy;
  p.logit = &dummy;
  p.cosine = &dummy;
  switch (kernels::CheckChunkScoreParams(p)) {
    case kernels::KernelError::kOk:
      break;
    case kernels::KernelError::kBadDType:
      return InvalidArgument("retrieval plan: key dtype " + std::string(DTypeName(p.dtype)) +
                             " cannot be scored (f32, f16 or bf16)");
    case kernels::KernelError::kNullPointer:
      return InvalidArgument("retrieval plan: the mirror's keys or inverse norms are null");
    default:
      return InvalidArgument("retrieval plan: bad shape (kv_heads " + std::to_string(p.kv_heads) +
                             ", head_dim " + std::to_string(p.head_dim) + ", repr " + std::to_string(p.repr) +
                             ", n_chunks " + std::to_string(p.n_chunks) + ", chunk_stride " +
                             std::to_string(p.chunk_stride) + ")");
  }
  if (p.n_chunks > INT32_MAX)
    return InvalidArgument("retrieval plan: " + std::to_string(p.n_chunks) +
                           " chunks in one layer (the top-k's segment offsets are int32)");
  if ((plan.probe == nullptr) == (plan.queries.q == nullptr))
    return InvalidArgument(plan.probe == nullptr
                               ? "retrieval plan: the probe is null (and no queries to build it from)"
                               : "retrieval plan: both a probe and queries (the probe is built from either)");
  if (plan.queries.q != nullptr)
    KVTIER_RETURN_IF_ERROR(CheckBackendQueries(plan.queries, p.kv_heads, p.head_dim));
  if (plan.k_max < 0 || plan.k_max > p.n_chunks)
    return InvalidArgument("retrieval plan: k_max " + std::to_string(plan.k_max) + " outside [0, " +
                           std::to_string(p.n_chunks) + "] (the layer's chunks)");
  return Status::Ok();
}

RetrievalWorkspaceLayout LayoutRetrievalWorkspace(int probe_floats, int64_t n_chunks, size_t topk_bytes,
                                                  int q_floats, int rope_pairs) {
  const size_t n = static_cast<size_t>(std::max<int64_t>(0, n_chunks));
  const size_t pf = static_cast<size_t>(std::max(0, probe_floats));
  const size_t qf = static_cast<size_t>(std::max(0, q_floats));
  const size_t rp = qf > 0 ? static_cast<size_t>(std::max(0, rope_pairs)) : 0;
  RetrievalWorkspaceLayout l;
  l.n_chunks = static_cast<int64_t>(n);
  l.q_floats = static_cast<int>(qf);
  l.rope_pairs = static_cast<int>(rp);
  l.in = 0;
  l.probe = l.in;
  l.offsets = l.probe + pf * sizeof(float);  // int32 after fp32: 4-byte aligned
  l.k = l.offsets + 2 * sizeof(int32_t);
  l.in_bytes = l.k + sizeof(int32_t) - l.in;
  if (qf > 0) {
    l.q_position = (l.k + sizeof(int32_t) + 7) / 8 * 8;
    l.inv_freq = l.q_position + sizeof(int64_t);
    l.in_bytes = l.inv_freq + rp * sizeof(double) - l.in;
    l.q = l.in + Align256(l.in_bytes);
    l.logit = l.q + Align256(qf * sizeof(float));
  } else {
    l.logit = l.in + Align256(l.in_bytes);
  }
  l.cosine = l.logit + Align256(n * sizeof(float));
  l.out = l.cosine + Align256(n * sizeof(float));
  l.entropy = l.out;  // 256-aligned, so the double is aligned
  l.non_finite = l.entropy + sizeof(double);
  l.q_non_finite = l.non_finite + sizeof(int32_t);
  l.q_first = l.q_non_finite + sizeof(int32_t);
  l.rows = l.entropy + 32;  // past the pad, rows stay 16-byte aligned
  l.out_bytes = l.rows + n * sizeof(int32_t) - l.out;
  l.topk = l.out + Align256(l.out_bytes);
  l.topk_bytes = topk_bytes;
  l.total = l.topk + Align256(topk_bytes);
  return l;
}

LayerKernelParams LayerParamsIn(uint8_t* base, const RetrievalWorkspaceLayout& l,
                                const LayerSelectPlan& plan) {
  LayerKernelParams k;
  k.score = plan.score;
  k.score.probe = reinterpret_cast<const float*>(base + l.probe);
  k.score.logit = reinterpret_cast<float*>(base + l.logit);
  k.score.cosine = reinterpret_cast<float*>(base + l.cosine);
  const auto* offsets = reinterpret_cast<const int32_t*>(base + l.offsets);
  // Eq. 11 takes the cosines (Eq. 10) whatever the rank: the budget comes from them.
  k.entropy.n_segments = plan.entropy ? 1 : 0;
  k.entropy.offsets = offsets;
  k.entropy.scores = k.score.cosine;
  k.entropy.entropy = reinterpret_cast<double*>(base + l.entropy);
  k.entropy.non_finite = reinterpret_cast<int32_t*>(base + l.non_finite);
  k.topk.n_segments = 1;
  k.topk.offsets = offsets;
  k.topk.scores = plan.rank == ChunkRank::kLogit ? k.score.logit : k.score.cosine;
  k.topk.k = reinterpret_cast<const int32_t*>(base + l.k);
  k.topk.k_max = plan.k_max;
  k.topk.out_index = reinterpret_cast<int32_t*>(base + l.rows);
  k.topk.out_score = nullptr;
  return k;
}

// ---- the shared RunLayer sequence --------------------------------------------------------

RetrievalBackend::~RetrievalBackend() = default;

Status RetrievalBackend::Reserve(int probe_floats, int64_t n_chunks, int q_floats, int rope_pairs) {
  if (probe_floats <= probe_floats_ && n_chunks <= layout_.n_chunks && q_floats <= layout_.q_floats &&
      rope_pairs <= layout_.rope_pairs && layout_.total > 0)
    return Status::Ok();
  // An eighth more than asked (at least 1024 chunks), so a growing cache resizes it O(log n)
  // times and holds at most an eighth more than its largest layer.
  int64_t cap = std::max<int64_t>(1024, layout_.n_chunks);
  if (cap < n_chunks) cap = n_chunks + n_chunks / 8;
  cap = std::min<int64_t>(cap, INT32_MAX);
  const int pf = std::max(probe_floats, probe_floats_);
  const int qf = std::max(q_floats, layout_.q_floats);
  const int rp = std::max(rope_pairs, layout_.rope_pairs);
  KVTIER_ASSIGN_OR_RETURN(const size_t topk_bytes, TopKWorkspaceBytes(cap));
  const RetrievalWorkspaceLayout l = LayoutRetrievalWorkspace(pf, cap, topk_bytes, qf, rp);
  KVTIER_RETURN_IF_ERROR(AllocateWorkspace(l));
  layout_ = l;
  probe_floats_ = pf;
  return Status::Ok();
}

void RetrievalBackend::StageQueries(const BackendQueries& queries, int head_dim) {
  const RetrievalWorkspaceLayout& l = layout_;
  uint8_t* in = staging();
  std::memcpy(in + (l.q_position - l.in), &queries.rope_position, sizeof(int64_t));
  if (queries.rope_inv_freq != nullptr)
    std::memcpy(in + (l.inv_freq - l.in), queries.rope_inv_freq,
                static_cast<size_t>(head_dim / 2) * sizeof(double));
}

Status RetrievalBackend::RunLayer(const LayerSelectPlan& plan, LayerSelectResult* out) {
  if (out == nullptr) return InvalidArgument("RetrievalBackend::RunLayer: out must not be null");
  KVTIER_RETURN_IF_ERROR(ValidateLayerSelectPlan(plan));
  out->rows.clear();
  out->entropy = 0.0;
  out->non_finite = 0;
  out->q_non_finite = 0;
  out->q_first_non_finite = INT32_MAX;
  const int64_t n = plan.score.n_chunks;
  const BackendQueries& queries = plan.queries;
  const bool device_probe = queries.q != nullptr;
  if (n == 0) {
    if (!device_probe) return Status::Ok();
    return CheckQueries(queries, plan.score.head_dim, &out->q_non_finite, &out->q_first_non_finite);
  }
  const int head_dim = plan.score.head_dim;
  const int probe_floats = plan.score.kv_heads * head_dim;
  const int q_floats = device_probe ? queries.q_heads * head_dim : 0;
  KVTIER_RETURN_IF_ERROR(Reserve(probe_floats, n, q_floats, device_probe ? head_dim / 2 : 0));
  const RetrievalWorkspaceLayout& l = layout_;
  // The in-block, written into host staging and uploaded as one copy.
  uint8_t* in = staging();
  if (device_probe)
    StageQueries(queries, head_dim);
  else
    std::memcpy(in + (l.probe - l.in), plan.probe, static_cast<size_t>(probe_floats) * sizeof(float));
  const int32_t offsets[2] = {0, static_cast<int32_t>(n)};
  std::memcpy(in + (l.offsets - l.in), offsets, sizeof offsets);
  const int32_t k = plan.k_max;
  std::memcpy(in + (l.k - l.in), &k, sizeof k);
  KVTIER_RETURN_IF_ERROR(CopyIn(l.in_bytes));
  if (device_probe)
    KVTIER_RETURN_IF_ERROR(LaunchQueries(
        queries, kernels::ProbeShape{queries.q_heads, plan.score.kv_heads, head_dim}, /*probe=*/true));
  const LayerKernelParams params = LayerParamsIn(workspace(), l, plan);
  KVTIER_RETURN_IF_ERROR(Launch(params, plan));
  // Only the scalars and the k_max rows come back.
  const size_t out_bytes = (l.rows - l.out) + static_cast<size_t>(plan.k_max) * sizeof(int32_t);
  KVTIER_RETURN_IF_ERROR(CopyOutAndWait(out_bytes));
  const uint8_t* ob = staging() + l.in_bytes;
  if (device_probe) {
    std::memcpy(&out->q_non_finite, ob + (l.q_non_finite - l.out), sizeof(int32_t));
    std::memcpy(&out->q_first_non_finite, ob + (l.q_first - l.out), sizeof(int32_t));
    if (out->q_non_finite > 0) return Status::Ok();  // the rows of a NaN probe mean nothing
  }
  if (plan.entropy) {
    std::memcpy(&out->entropy, ob + (l.entropy - l.out), sizeof(double));
    std::memcpy(&out->non_finite, ob + (l.non_finite - l.out), sizeof(int32_t));
  }
  out->rows.resize(static_cast<size_t>(plan.k_max));
  if (!out->rows.empty())  // k_max = 0 leaves data() null, which memcpy must not get even for 0 bytes
    std::memcpy(out->rows.data(), ob + (l.rows - l.out), out->rows.size() * sizeof(int32_t));
  // k_max <= n, so every row is filled; -1 would mean a short segment.
  for (int32_t r : out->rows)
    if (r < 0 || r >= n)
      return Internal(std::string("retrieval (") + name() + "): the top-k returned row " + std::to_string(r) +
                      " of " + std::to_string(n));
  return Status::Ok();
}

Status RetrievalBackend::CheckQueries(const BackendQueries& queries, int head_dim, int32_t* count,
                                      int32_t* first) {
  if (count == nullptr || first == nullptr)
    return InvalidArgument("RetrievalBackend::CheckQueries: the outputs must not be null");
  if (queries.q == nullptr) return InvalidArgument("RetrievalBackend::CheckQueries: the queries are null");
  KVTIER_RETURN_IF_ERROR(CheckBackendQueries(queries, queries.q_heads, head_dim));
  // A probe never has more floats than its query (kv_heads <= q_heads): reserving that much
  // now spares the first selection a reallocation (and its wait).
  const int q_floats = queries.q_heads * head_dim;
  KVTIER_RETURN_IF_ERROR(
      Reserve(std::max(probe_floats_, q_floats), layout_.n_chunks, q_floats, head_dim / 2));
  KVTIER_RETURN_IF_ERROR(LaunchQueries(queries,
                                       kernels::ProbeShape{queries.q_heads, queries.q_heads, head_dim},
                                       /*probe=*/false));
  const RetrievalWorkspaceLayout& l = layout_;
  KVTIER_RETURN_IF_ERROR(CopyOutAndWait(l.rows - l.out));
  const uint8_t* ob = staging() + l.in_bytes;
  std::memcpy(count, ob + (l.q_non_finite - l.out), sizeof(int32_t));
  std::memcpy(first, ob + (l.q_first - l.out), sizeof(int32_t));
  return Status::Ok();
}

// ---- cpu ----------------------------------------------------------------------------------

namespace {

class CpuRetrievalBackend final : public RetrievalBackend {
 public:
  const char* name() const override { return "cpu"; }

  Result<uint8_t*> Allocate(size_t bytes) override {
    if (bytes == 0) return InvalidArgument("retrieval (cpu): Allocate of 0 bytes");
    auto* p = static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(64), std::nothrow));
    if (p == nullptr)
      return ResourceExhausted("retrieval (cpu): " + std::to_string(bytes) + " bytes for a mirror");
    return p;
  }
  void Free(uint8_t* p) override {
    if (p) ::operator delete(p, std::align_val_t(64));
  }
  void FreeAfterWork(uint8_t* p) override { Free(p); }  // the twins' work is done on return
  Status CopyWithin(uint8_t* dst, const uint8_t* src, size_t bytes) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  Status Upload(const BackendCopy* copies, size_t n) override {
    if (n > 0 && copies == nullptr) return InvalidArgument("retrieval (cpu): Upload: copies are null");
    for (size_t i = 0; i < n; ++i)
      if (copies[i].bytes > 0) std::memcpy(copies[i].dst, copies[i].src, copies[i].bytes);
    return Status::Ok();
  }
  Status Download(void* dst, const uint8_t* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Result<size_t> TopKWorkspaceBytes(int64_t n_chunks) override {
    (void)n_chunks;
    return size_t{0};  // the twin sorts an index array of its own
  }

 protected:
  Status AllocateWorkspace(const RetrievalWorkspaceLayout& l) override {
    try {
      ws_.assign(l.total / sizeof(uint64_t) + 1, 0);  // uint64_t: the double in the out-block is aligned
      staging_.assign(l.in_bytes + l.out_bytes, 0);
    } catch (const std::bad_alloc&) {
      return ResourceExhausted("retrieval (cpu): a " + std::to_string(l.total) + "-byte workspace");
    }
    return Status::Ok();
  }
  uint8_t* workspace() override { return reinterpret_cast<uint8_t*>(ws_.data()); }
  uint8_t* staging() override { return staging_.data(); }
  Status CopyIn(size_t bytes) override {
    std::memcpy(workspace() + layout_.in, staging_.data(), bytes);
    return Status::Ok();
  }
  Status Launch(const LayerKernelParams& k, const LayerSelectPlan& plan) override {
    using kernels::KernelError;
    if (const KernelError e = kernels::ScoreChunks(k.score); e != KernelError::kOk)
      return KernelFailure("cpu", "ScoreChunks", e);
    if (plan.entropy)
      if (const KernelError e = kernels::SegmentEntropy(k.entropy); e != KernelError::kOk)
        return KernelFailure("cpu", "SegmentEntropy", e);
    // The twin sorts (score desc, index asc); a NaN score would break its order, and with
    // the entropy asked for the host refuses NaN cosines anyway (non_finite).
    if (const KernelError e = kernels::SegmentedTopK(k.topk); e != KernelError::kOk)
      return KernelFailure("cpu", "SegmentedTopK", e);
    return Status::Ok();
  }
  Status CopyOutAndWait(size_t bytes) override {
    std::memcpy(staging_.data() + layout_.in_bytes, workspace() + layout_.out, bytes);
    return Status::Ok();
  }
  Status LaunchQueries(const BackendQueries& q, const kernels::ProbeShape& shape, bool probe) override {
    uint8_t* ws = workspace();
    const RetrievalWorkspaceLayout& l = layout_;
    const int32_t n = shape.q_heads * shape.head_dim;
    auto* count = reinterpret_cast<int32_t*>(ws + l.q_non_finite);
    kernels::CountNonFinite(q.q, n, count, reinterpret_cast<int32_t*>(ws + l.q_first));
    if (!probe) return Status::Ok();
    auto* probe_out = reinterpret_cast<float*>(ws + l.probe);
    if (*count > 0) {  // the twin's sort needs finite scores; the host refuses this query anyway
      std::fill_n(probe_out, static_cast<size_t>(shape.kv_heads) * shape.head_dim, 0.0f);
      return Status::Ok();
    }
    auto* qw = reinterpret_cast<float*>(ws + l.q);
    std::memcpy(qw, q.q, static_cast<size_t>(n) * sizeof(float));
    if (q.rope_inv_freq != nullptr)
      kernels::Rope(qw, 1, shape.q_heads, shape.head_dim, reinterpret_cast<const int64_t*>(ws + l.q_position),
                    reinterpret_cast<const double*>(ws + l.inv_freq));
    kernels::MeanPoolProbe(shape, qw, 1, probe_out);
    return Status::Ok();
  }

 private:
  std::vector<uint64_t> ws_;
  std::vector<uint8_t> staging_;
};

#if KVTIER_HAVE_CUDA

std::string CudaMessage(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// Its own non-blocking stream: mirror uploads, the
// in-block, the kernels and the out-block are ordered on it, and RunLayer waits once.
class CudaRetrievalBackend final : public RetrievalBackend {
 public:
  static Result<std::unique_ptr<CudaRetrievalBackend>> Create() {
    if (kernels::cuda::DeviceCount() == 0)
      return Unavailable(std::string("retrieval backend \"cuda\": no CUDA device: ") +
                         kernels::cuda::LastCudaErrorString());
    auto b = std::unique_ptr<CudaRetrievalBackend>(new CudaRetrievalBackend());
    cudaStream_t s = nullptr;
    const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess)
      return Unavailable("retrieval backend \"cuda\": cudaStreamCreate: " + CudaMessage(e));
    b->stream_ = s;
    const cudaError_t ev = cudaEventCreateWithFlags(&b->queries_written_, cudaEventDisableTiming);
    if (ev != cudaSuccess)
      return Unavailable("retrieval backend \"cuda\": cudaEventCreate: " + CudaMessage(ev));
    return b;
  }
  ~CudaRetrievalBackend() override {
    if (stream_) device_sync::SyncStream(stream_);
    device_memory::ReapFreed();  // the mirror's old arrays, whose copies are done now
    if (ws_) device_memory::Free(ws_);
    if (staging_) device_memory::FreeHost(staging_);
    if (queries_written_) cudaEventDestroy(queries_written_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  const char* name() const override { return "cuda"; }
  void* stream() const override { return stream_; }

  Result<uint8_t*> Allocate(size_t bytes) override {
    if (bytes == 0) return InvalidArgument("retrieval (cuda): Allocate of 0 bytes");
    void* p = nullptr;
    const cudaError_t e = device_memory::Malloc(&p, bytes, DeviceMemoryOwner::kRetrievalMirror);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return ResourceExhausted("retrieval (cuda): cudaMalloc of " + std::to_string(bytes) +
                               " bytes for a mirror (" + CudaMessage(e) + ")");
    }
    return static_cast<uint8_t*>(p);
  }
  void Free(uint8_t* p) override {
    if (p == nullptr) return;
    device_sync::SyncStream(stream_);  // a kernel of the last run may still read it
    device_memory::Free(p);
  }
  void FreeAfterWork(uint8_t* p) override {
    if (p != nullptr) (void)device_memory::FreeAfter(p, stream_);
  }
  Status CopyWithin(uint8_t* dst, const uint8_t* src, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    const cudaError_t e = device_sync::CopyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_,
                                                 device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Internal("retrieval (cuda): a copy of " + std::to_string(bytes) + " bytes within the mirror (" +
                      CudaMessage(e) + ")");
    }
    return Status::Ok();
  }
  Status Upload(const BackendCopy* copies, size_t n) override {
    if (n > 0 && copies == nullptr) return InvalidArgument("retrieval (cuda): Upload: copies are null");
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) total += copies[i].bytes;
    if (total == 0) return Status::Ok();
    cudaError_t e = cudaSuccess;
    if (total <= kStagedUploadBytes) {
      // The rows a seal adds: packed into one pinned entry and left in flight on the stream,
      // ahead of every later launch of this backend; the host rows may change at once.
      KVTIER_ASSIGN_OR_RETURN(uint8_t * staged, upload_staging_.Take(total, "mirror upload"));
      size_t at = 0;
      for (size_t i = 0; i < n && e == cudaSuccess; ++i) {
        if (copies[i].bytes == 0) continue;
        std::memcpy(staged + at, copies[i].src, copies[i].bytes);
        e = device_sync::CopyAsync(copies[i].dst, staged + at, copies[i].bytes, cudaMemcpyHostToDevice,
                                   stream_, device_sync::HostMemory::kPinned);
        at += copies[i].bytes;
      }
      const Status done = upload_staging_.Done(stream_);
      if (e != cudaSuccess) return Internal("retrieval (cuda): mirror upload: " + CudaMessage(e));
      return done;
    }
    // A whole mirror going up again (it grew or shrank): rare, and larger than staging should
    // pin, so straight from the index's vectors with one wait.
    for (size_t i = 0; i < n && e == cudaSuccess; ++i)
      if (copies[i].bytes > 0)
        e = device_sync::CopyAsync(copies[i].dst, copies[i].src, copies[i].bytes, cudaMemcpyHostToDevice,
                                   stream_, device_sync::HostMemory::kPageable);
    if (e == cudaSuccess) e = device_sync::SyncStream(stream_);  // the host rows may change after return
    if (e != cudaSuccess) return Internal("retrieval (cuda): mirror upload: " + CudaMessage(e));
    return Status::Ok();
  }
  Status Download(void* dst, const uint8_t* src, size_t bytes) override {
    cudaError_t e = bytes > 0 ? device_sync::CopyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_,
                                                       device_sync::HostMemory::kPageable)
                              : cudaSuccess;
    if (e == cudaSuccess) e = device_sync::SyncStream(stream_);
    if (e != cudaSuccess) return Internal("retrieval (cuda): download: " + CudaMessage(e));
    return Status::Ok();
  }
  Result<size_t> TopKWorkspaceBytes(int64_t n_chunks) override {
    // The size query reads only the shape: stand-in arrays for the checks.
    const int32_t offsets[2] = {0, static_cast<int32_t>(n_chunks)}, k = 0;
    kernels::SegmentedTopKParams p;
    p.n_segments = 1;
    p.offsets = offsets;
    p.k = &k;
    size_t bytes = 0;
    const kernels::KernelError e =
        kernels::cuda::SegmentedTopKWorkspaceBytes(p, static_cast<int32_t>(n_chunks), &bytes);
    if (e != kernels::KernelError::kOk)
      return KernelFailure("cuda", "SegmentedTopKWorkspaceBytes", e, kernels::cuda::LastCudaErrorString());
    return bytes;
  }

 protected:
  Status AllocateWorkspace(const RetrievalWorkspaceLayout& l) override {
    device_sync::SyncStream(stream_);
    if (ws_) device_memory::Free(ws_);
    if (staging_) device_memory::FreeHost(staging_);
    ws_ = nullptr;
    staging_ = nullptr;
    cudaError_t e = device_memory::Malloc(&ws_, l.total, DeviceMemoryOwner::kRetrievalWorkspace);
    if (e == cudaSuccess)
      e = device_memory::HostAlloc(&staging_, l.in_bytes + l.out_bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      if (ws_) device_memory::Free(ws_);
      ws_ = nullptr;
      staging_ = nullptr;
      layout_ = RetrievalWorkspaceLayout{};
      probe_floats_ = 0;
      return ResourceExhausted("retrieval (cuda): a " + std::to_string(l.total) + "-byte workspace (" +
                               CudaMessage(e) + ")");
    }
    return Status::Ok();
  }
  uint8_t* workspace() override { return static_cast<uint8_t*>(ws_); }
  uint8_t* staging() override { return static_cast<uint8_t*>(staging_); }
  Status CopyIn(size_t bytes) override {
    const cudaError_t e =
        device_sync::CopyAsync(workspace() + layout_.in, staging_, bytes, cudaMemcpyHostToDevice, stream_,
                               device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) return Internal("retrieval (cuda): in-block upload: " + CudaMessage(e));
    return Status::Ok();
  }
  Status Launch(const LayerKernelParams& k, const LayerSelectPlan& plan) override {
    using kernels::KernelError;
    namespace kc = kernels::cuda;
    if (const KernelError e = kc::LaunchScoreChunks(k.score, stream_); e != KernelError::kOk)
      return KernelFailure("cuda", "LaunchScoreChunks", e, kc::LastCudaErrorString());
    if (plan.entropy)
      if (const KernelError e = kc::LaunchSegmentEntropy(k.entropy, stream_); e != KernelError::kOk)
        return KernelFailure("cuda", "LaunchSegmentEntropy", e, kc::LastCudaErrorString());
    const int32_t total = static_cast<int32_t>(k.score.n_chunks);
    if (const KernelError e = kc::LaunchSegmentedTopK(k.topk, total, workspace() + layout_.topk,
                                                      layout_.total - layout_.topk, stream_);
        e != KernelError::kOk)
      return KernelFailure("cuda", "LaunchSegmentedTopK", e, kc::LastCudaErrorString());
    return Status::Ok();
  }
  Status LaunchQueries(const BackendQueries& q, const kernels::ProbeShape& shape, bool probe) override {
    namespace kc = kernels::cuda;
    using kernels::KernelError;
    // After the engine's writes of q, on the device: the backend's stream waits for an event.
    cudaError_t e = cudaEventRecord(queries_written_, static_cast<cudaStream_t>(q.after_stream));
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, queries_written_, 0);
    if (e != cudaSuccess)
      return Internal("retrieval (cuda): ordering after the queries' stream: " + CudaMessage(e));
    uint8_t* ws = workspace();
    const RetrievalWorkspaceLayout& l = layout_;
    const int32_t n = shape.q_heads * shape.head_dim;
    if (const KernelError k =
            kc::LaunchCountNonFinite(q.q, n, reinterpret_cast<int32_t*>(ws + l.q_non_finite),
                                     reinterpret_cast<int32_t*>(ws + l.q_first), stream_);
        k != KernelError::kOk)
      return KernelFailure("cuda", "LaunchCountNonFinite", k, kc::LastCudaErrorString());
    if (!probe) return Status::Ok();
    auto* qw = reinterpret_cast<float*>(ws + l.q);
    e = device_sync::CopyAsync(qw, q.q, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice,
                               stream_, device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) return Internal("retrieval (cuda): copying the queries: " + CudaMessage(e));
    if (q.rope_inv_freq != nullptr) {
      kc::RopeParams r;
      r.m = 1;
      r.heads = shape.q_heads;
      r.head_dim = shape.head_dim;
      r.x = qw;
      r.positions = reinterpret_cast<const int64_t*>(ws + l.q_position);
      r.inv_freq = reinterpret_cast<const double*>(ws + l.inv_freq);
      if (const KernelError k = kc::LaunchRope(r, stream_); k != KernelError::kOk)
        return KernelFailure("cuda", "LaunchRope", k, kc::LastCudaErrorString());
    }
    if (const KernelError k =
            kc::LaunchMeanPoolProbe(shape, qw, 1, reinterpret_cast<float*>(ws + l.probe), stream_);
        k != KernelError::kOk)
      return KernelFailure("cuda", "LaunchMeanPoolProbe", k, kc::LastCudaErrorString());
    return Status::Ok();
  }
  Status CopyOutAndWait(size_t bytes) override {
    cudaError_t e =
        device_sync::CopyAsync(static_cast<uint8_t*>(staging_) + layout_.in_bytes, workspace() + layout_.out,
                               bytes, cudaMemcpyDeviceToHost, stream_, device_sync::HostMemory::kPinned);
    // The one synchronisation of the layer.
    if (e == cudaSuccess) e = device_sync::SyncStream(stream_);
    if (e != cudaSuccess) return Internal("retrieval (cuda): " + CudaMessage(e));
    return Status::Ok();
  }

 private:
  CudaRetrievalBackend() = default;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t queries_written_ = nullptr;  // recorded on BackendQueries::after_stream
  void* ws_ = nullptr;
  void* staging_ = nullptr;  // pinned
  // Uploads up to this size are staged and left in flight (Upload).
  static constexpr size_t kStagedUploadBytes = size_t{1} << 20;
  PinnedStaging upload_staging_{16, "retrieval (cuda) mirror"};
};

#endif  // KVTIER_HAVE_CUDA

}  // namespace

Result<std::unique_ptr<RetrievalBackend>> MakeRetrievalBackend(const std::string& device) {
  if (device == "cpu") return std::unique_ptr<RetrievalBackend>(new CpuRetrievalBackend());
  if (device == "cuda") {
#if KVTIER_HAVE_CUDA
    KVTIER_ASSIGN_OR_RETURN(auto b, CudaRetrievalBackend::Create());
    return std::unique_ptr<RetrievalBackend>(std::move(b));
#else
    return Unavailable("retrieval backend \"cuda\": this build has no CUDA (KVTIER_CUDA=off)");
#endif
  }
  return InvalidArgument("retrieval backend: unknown device \"" + device + "\" (known: cpu, cuda)");
}

// ---- mirror -------------------------------------------------------------------------------

ReprMirror::ReprMirror(RetrievalBackend* backend, const ChunkShape& shape)
    : backend_(backend), shape_(shape) {
  row_key_bytes_ = static_cast<size_t>(shape.repr) * shape.head_dim * DTypeSize(shape.dtype);
  row_inv_bytes_ = static_cast<size_t>(shape.repr) * sizeof(float);
}

Result<std::unique_ptr<ReprMirror>> ReprMirror::Create(RetrievalBackend* backend, const ChunkShape& shape) {
  if (backend == nullptr) return InvalidArgument("ReprMirror: no backend");
  KVTIER_RETURN_IF_ERROR(shape.Validate());
  if (shape.dtype != DType::kF32 && shape.dtype != DType::kF16 && shape.dtype != DType::kBF16)
    return InvalidArgument("ReprMirror: key dtype " + std::string(DTypeName(shape.dtype)) +
                           " cannot be scored on a backend (f32, f16 or bf16)");
  return std::unique_ptr<ReprMirror>(new ReprMirror(backend, shape));
}

ReprMirror::~ReprMirror() {
  backend_->Free(keys_);
  backend_->Free(inv_norm_);
}

Status ReprMirror::Update(size_t first, size_t n, const std::vector<std::vector<uint8_t>>& keys,
                          const std::vector<std::vector<float>>& inv_norm, size_t max_rows) {
  const size_t H = static_cast<size_t>(shape_.kv_heads), R = static_cast<size_t>(shape_.repr);
  if (keys.size() != H || inv_norm.size() != H)
    return InvalidArgument("ReprMirror::Update: " + std::to_string(keys.size()) + " key and " +
                           std::to_string(inv_norm.size()) + " inverse-norm heads for " + std::to_string(H));
  for (size_t h = 0; h < H; ++h)
    if (keys[h].size() < n * row_key_bytes_ || inv_norm[h].size() < n * R)
      return InvalidArgument("ReprMirror::Update: head " + std::to_string(h) + " holds fewer than " +
                             std::to_string(n) + " rows");
  first = std::min({first, rows_, n});  // rows past what the mirror holds go up too
  uint8_t* new_keys = keys_;
  uint8_t* new_inv = inv_norm_;
  size_t cap = capacity_;
  const size_t limit = std::max(n, max_rows);
  if (n > capacity_ || capacity_ > limit) {  // the head stride changes
    cap = n > capacity_
              ? std::min(std::max(n + n / 8, std::max<size_t>(capacity_ + capacity_ / 8, 16)), limit)
              : limit;
    if (cap == 0) {  // shrunk to nothing: no rows, no memory
      backend_->Free(keys_);
      backend_->Free(inv_norm_);
      keys_ = inv_norm_ = nullptr;
      rows_ = capacity_ = 0;
      return Status::Ok();
    }
    // The arrays of `cap` rows, both or neither.
    auto allocate = [&]() -> Status {
      KVTIER_ASSIGN_OR_RETURN(new_keys, backend_->Allocate(H * cap * row_key_bytes_));
      auto inv = backend_->Allocate(H * cap * row_inv_bytes_);
      if (!inv.ok()) {
        backend_->Free(new_keys);
        return inv.status();
      }
      new_inv = *inv;
      return Status::Ok();
    };
    const size_t kept = std::min(first, rows_);
    if (n > capacity_ && max_rows == SIZE_MAX && kept > 0) {
      // Growth with no cap: the kept rows move across on the backend, no host wait.
      KVTIER_RETURN_IF_ERROR(allocate());
      Status moved = Status::Ok();
      for (size_t h = 0; h < H && moved.ok(); ++h) {
        moved = backend_->CopyWithin(new_keys + h * cap * row_key_bytes_,
                                     keys_ + h * capacity_ * row_key_bytes_, kept * row_key_bytes_);
        if (moved.ok())
          moved = backend_->CopyWithin(new_inv + h * cap * row_inv_bytes_,
                                       inv_norm_ + h * capacity_ * row_inv_bytes_, kept * row_inv_bytes_);
      }
      backend_->FreeAfterWork(keys_);
      backend_->FreeAfterWork(inv_norm_);
      keys_ = inv_norm_ = nullptr;
      rows_ = capacity_ = 0;
      if (!moved.ok()) {
        backend_->Free(new_keys);
        backend_->Free(new_inv);
        return moved;
      }
      first = kept;
    } else {
      // Every row goes up again from the host, so the old arrays go first: the mirror never
      // holds two capacities at once, and its backend bytes never pass bytes() (what the cap
      // counts).
      backend_->Free(keys_);
      backend_->Free(inv_norm_);
      keys_ = inv_norm_ = nullptr;
      rows_ = capacity_ = 0;
      KVTIER_RETURN_IF_ERROR(allocate());
      first = 0;
    }
  }
  std::vector<BackendCopy> copies;
  copies.reserve(2 * H);
  for (size_t h = 0; h < H; ++h) {
    if (first == n) break;
    copies.push_back(BackendCopy{new_keys + (h * cap + first) * row_key_bytes_,
                                 keys[h].data() + first * row_key_bytes_, (n - first) * row_key_bytes_});
    copies.push_back(BackendCopy{new_inv + (h * cap + first) * row_inv_bytes_, inv_norm[h].data() + first * R,
                                 (n - first) * row_inv_bytes_});
  }
  const Status st = backend_->Upload(copies.data(), copies.size());
  if (new_keys != keys_) {  // the new arrays are the mirror's, whatever the upload did
    keys_ = new_keys;
    inv_norm_ = new_inv;
    capacity_ = cap;
  }
  if (!st.ok()) {
    rows_ = std::min(rows_, first);  // rows from `first` may be half written
    return st;
  }
  rows_ = n;
  return Status::Ok();
}

kernels::ChunkScoreParams ReprMirror::Params(kernels::HeadFold::Kind fold) const {
  kernels::ChunkScoreParams p;
  p.kv_heads = shape_.kv_heads;
  p.head_dim = shape_.head_dim;
  p.repr = shape_.repr;
  p.dtype = shape_.dtype;
  p.fold = fold;
  p.n_chunks = static_cast<int64_t>(rows_);
  p.chunk_stride = static_cast<int64_t>(capacity_);
  p.keys = keys_;
  p.inv_norm = reinterpret_cast<const float*>(inv_norm_);
  return p;
}

Status ReprMirror::Download(std::vector<uint8_t>* keys, std::vector<float>* inv_norm) const {
  if (keys == nullptr || inv_norm == nullptr) return InvalidArgument("ReprMirror::Download: null output");
  const size_t H = static_cast<size_t>(shape_.kv_heads);
  keys->assign(H * rows_ * row_key_bytes_, 0);
  inv_norm->assign(H * rows_ * shape_.repr, 0.0f);
  if (rows_ == 0) return Status::Ok();
  for (size_t h = 0; h < H; ++h) {
    KVTIER_RETURN_IF_ERROR(backend_->Download(keys->data() + h * rows_ * row_key_bytes_,
                                              keys_ + h * capacity_ * row_key_bytes_,
                                              rows_ * row_key_bytes_));
    KVTIER_RETURN_IF_ERROR(backend_->Download(inv_norm->data() + h * rows_ * shape_.repr,
                                              inv_norm_ + h * capacity_ * row_inv_bytes_,
                                              rows_ * row_inv_bytes_));
  }
  return Status::Ok();
}

}  // namespace kvtier
