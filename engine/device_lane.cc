#include "engine/device_lane.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>

#include "kernels/cpu/chunk_table.h"
#include "kernels/dtype.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "offload/cuda_hot_tier.h"
#include "offload/device_sync_cuda.h"
#include "offload/pinned_staging.h"
#endif

namespace kvtier {

Status DeviceLaneOptions::Validate() const {
  auto bad = [](const std::string& what, int64_t v) {
    return InvalidArgument("device lane: " + what + " " + std::to_string(v) + " out of range");
  };
  if (layers <= 0) return bad("layers", layers);
  if (q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads != 0) return bad("q_heads", q_heads);
  if (head_dim <= 0) return bad("head_dim", head_dim);
  if (chunk_tokens <= 0) return bad("chunk_tokens", chunk_tokens);
  if (slots <= 0) return bad("slots", slots);
  if (max_rows <= 0 || max_rows > slots) return bad("max_rows (at most slots)", max_rows);
  if (initial_rows <= 0) return bad("initial_rows", initial_rows);
  if (!rope_inv_freq.empty() && (head_dim % 2 != 0 || static_cast<int>(rope_inv_freq.size()) != head_dim / 2))
    return bad("rope_inv_freq entries", static_cast<int64_t>(rope_inv_freq.size()));
  return Status::Ok();
}

#if !KVTIER_HAVE_CUDA

struct DeviceLane::Impl {};

DeviceLane::DeviceLane(TieredStore* store, SequenceId seq, void* stream, const DeviceLaneOptions& options)
    : store_(store), seq_(seq), stream_(stream), options_(options) {}
DeviceLane::~DeviceLane() = default;
Result<std::unique_ptr<DeviceLane>> DeviceLane::Create(TieredStore*, SequenceId, void*,
                                                       const DeviceLaneOptions&) {
  return Unavailable("device lane: this build has no CUDA");
}
Result<bool> DeviceLane::PrepareLayer(int, const std::vector<uint64_t>&, const std::vector<SealingChunk>&) {
  return false;
}
Result<bool> DeviceLane::Launch(const LayerCall&, AttentionPlanInput*) { return false; }
void DeviceLane::RefreshRows(int) {}
Result<bool> DeviceLane::TakeReport(uint64_t, bool, LaneStepReport*) { return false; }
bool DeviceLane::has_pending() const { return false; }
bool DeviceLane::ring_full() const { return false; }
Status DeviceLane::ReturnGrantState(kernels::EntropyGrantState*, uint64_t, int) { return Status::Ok(); }
Status DeviceLane::WaitForReaders() { return Status::Ok(); }

#else  // KVTIER_HAVE_CUDA

namespace {

namespace kc = kernels::cuda;
using kernels::KernelError;

size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

std::string CudaMessage(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

Status CudaFailure(const char* what, cudaError_t e) {
  return Internal(std::string("device lane: ") + what + ": " + CudaMessage(e));
}

Status KernelFailure(const char* what, KernelError e) {
  return Internal(std::string("device lane: ") + what + ": " + kernels::KernelErrorString(e) + " (" +
                  kc::LastCudaErrorString() + ")");
}

// One layer's scalars, written by the chain in device memory and copied back with its rows.
struct LaneHeader {
  int32_t take, n_slots, q_non_finite, q_first, non_finite, grant_error, n_misses, pad;
  double theta;
  int64_t table[kernels::kChunkTableCounters];  // this call's chunk table counters
};
constexpr size_t kHeaderBytes = (sizeof(LaneHeader) + 15) / 16 * 16;

// What the host stages for one layer call (copied into the layer's block, no wait).
struct LaneCallBlock {
  int32_t offsets[2];  // the top-k's and the entropy's one segment: {0, n}
  int32_t n;
  int32_t pad;
  int64_t rope_position;
};

// The row arrays of a table of `row_cap` rows per layer.
struct RowArrays {
  int32_t* row_slot = nullptr;
  const void** src_k = nullptr;
  const void** src_v = nullptr;
  int64_t* first = nullptr;
  float* logit = nullptr;
  float* cosine = nullptr;
  uint8_t* topk_ws = nullptr;
  size_t topk_bytes = 0;

  // Each array freed once the work on `s` so far is done (no wait).
  void FreeAfter(cudaStream_t s) {
    for (void* p : {static_cast<void*>(row_slot), static_cast<void*>(src_k), static_cast<void*>(src_v),
                    static_cast<void*>(first), static_cast<void*>(logit), static_cast<void*>(cosine),
                    static_cast<void*>(topk_ws)})
      if (p) device_memory::FreeAfter(p, s);
    *this = RowArrays{};
  }
};

constexpr int kReportRing = 3;
// A row with no source when its sources were asked: its chunk and first position.
struct MissingRow {
  uint64_t id = 0;
  int64_t first = 0;
  bool operator<(const MissingRow& o) const { return id < o.id; }
};
// Chunks still landing a layer may score as rows (more: the host path lands them, a wait).
constexpr int kMaxSealedRows = 8;  // step reports in flight: the one being written and two unread

// Every lane over one store behind the store's one fence.
class LaneFenceHub final : public WarmReaderFence {
 public:
  Status WaitForReaders() override {
    std::lock_guard<std::mutex> l(mu_);
    for (DeviceLane* lane : lanes_) KVTIER_RETURN_IF_ERROR(lane->WaitForReaders());
    return Status::Ok();
  }
  void Add(DeviceLane* lane) {
    std::lock_guard<std::mutex> l(mu_);
    lanes_.push_back(lane);
  }
  bool Remove(DeviceLane* lane) {  // true when it was the last
    std::lock_guard<std::mutex> l(mu_);
    lanes_.erase(std::remove(lanes_.begin(), lanes_.end(), lane), lanes_.end());
    return lanes_.empty();
  }

 private:
  std::mutex mu_;
  std::vector<DeviceLane*> lanes_;
};

// The hubs by store. A hub is registered with its store while it has lanes; the registry's lock
// is never held by a thread that holds a hub's (the store calls WaitForReaders under its own).
std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<TieredStore*, std::unique_ptr<LaneFenceHub>>& Registry() {
  static std::unordered_map<TieredStore*, std::unique_ptr<LaneFenceHub>> hubs;
  return hubs;
}

void JoinFence(TieredStore* store, DeviceLane* lane) {
  std::lock_guard<std::mutex> l(RegistryMutex());
  auto& hub = Registry()[store];
  if (hub == nullptr) {
    hub = std::make_unique<LaneFenceHub>();
    store->SetWarmReaderFence(hub.get());
  }
  hub->Add(lane);
}

void LeaveFence(TieredStore* store, DeviceLane* lane) {
  std::lock_guard<std::mutex> l(RegistryMutex());
  auto it = Registry().find(store);
  if (it == Registry().end()) return;
  if (it->second->Remove(lane)) {
    store->SetWarmReaderFence(nullptr);
    Registry().erase(it);
  }
}

}  // namespace

struct DeviceLane::Impl {
  std::mutex mu;  // the fence's critical section: epoch check, gather, reads_done
  cudaEvent_t reads_done = nullptr;
  cudaEvent_t q_ready = nullptr;
  PinnedStaging staging{64, "device lane"};
  // The pool and the table.
  uint8_t* pool = nullptr;  // [2][slots][half]: K halves, then V halves
  size_t half = 0;
  int64_t* slot_owner = nullptr;
  uint64_t* slot_stamp = nullptr;
  int32_t* clock_hand = nullptr;
  // Rows: [layers, row_cap] each.
  int row_cap = 0;
  RowArrays r;  // [layers, row_cap]: row_slot, src_k, src_v, first; [row_cap]: logit, cosine
  // Per layer: header | rows (copied back together) | slot list | first positions | misses | call.
  size_t off_rows = 0, off_slots = 0, off_first = 0, off_miss_slot = 0, off_miss_row = 0, off_call = 0;
  // A layer's report in pinned memory: header | rows (report_rows bytes, one copy), then at
  // report_first the slot list's first positions (what was attended; a second copy).
  size_t layer_block = 0, report_layer = 0, report_rows = 0, report_first = 0;
  uint8_t* blocks = nullptr;
  // Chunks still landing, one layer at a time: their representatives in the index mirror's
  // layout ([heads, kMaxSealedRows, repr, head_dim] keys, [heads, kMaxSealedRows, repr] inverse
  // norms), their statistics and the choice's scratch; allocated at the first seal the lane scores.
  uint8_t* sealed_keys = nullptr;
  float* sealed_inv = nullptr;
  float* sealed_mass = nullptr;
  float* sealed_scratch = nullptr;
  int* sealed_tokens = nullptr;
  kernels::MassChoiceShape sealed_shape;  // what they were allocated for
  // Queries.
  float* q = nullptr;
  float* probe = nullptr;
  double* inv_freq = nullptr;
  // The allocator's state: [EntropyGrantState | theta_sum [L] | theta_count [L]].
  uint8_t* grant = nullptr;
  void* grant_host = nullptr;  // pinned, the same layout
  size_t grant_bytes = 0;
  uint64_t grant_step = 0;  // the step the device state has begun
  // Chunk table stamps.
  uint64_t stamp = 0, step_first_stamp = 0, table_step = UINT64_MAX;
  // What the lane holds per layer.
  struct Layer {
    std::shared_ptr<const std::vector<uint64_t>> rows;  // the rows its sources and table are for
    uint64_t epoch = 0;
    bool ok = false;  // every row had a warm copy
    // The rows past the index's: chunks still landing, scored from representatives chosen on
    // the device; their statistics, [sealed][repr heads][chunk_tokens] (empty rows: zeros).
    int sealed = 0;
    std::vector<float> sealed_mass;
    // Rows with no source (no warm copy when asked): a chosen one is deferred (the chunk table
    // skips it). Their chunk ids, ascending; asked again when `recheck` is set (RefreshRows).
    std::shared_ptr<const std::vector<MissingRow>> missing =
        std::make_shared<const std::vector<MissingRow>>();
    bool recheck = false;
  };
  std::vector<Layer> layers;
  // Reports.
  struct Entry {
    void* host = nullptr;  // pinned [layers][report_layer]
    cudaEvent_t done = nullptr;
    uint64_t step = 0;
    std::vector<int> order;  // the layers, in the order they ran
    std::vector<std::shared_ptr<const std::vector<uint64_t>>> rows;
    std::vector<std::shared_ptr<const std::vector<MissingRow>>> missing;  // each layer's, at its launch
  };
  Entry entries[kReportRing];
  std::deque<int> pending;  // oldest first
  int open = -1;            // the entry of the step being written
  int next = 0;

  uint8_t* block(int layer) const { return blocks + static_cast<size_t>(layer) * layer_block; }
  LaneHeader* header(int layer) const { return reinterpret_cast<LaneHeader*>(block(layer)); }
};

DeviceLane::DeviceLane(TieredStore* store, SequenceId seq, void* stream, const DeviceLaneOptions& options)
    : impl_(std::make_unique<Impl>()), store_(store), seq_(seq), stream_(stream), options_(options) {}

DeviceLane::~DeviceLane() {
  Impl& m = *impl_;
  auto s = static_cast<cudaStream_t>(stream_);
  device_sync::SyncStream(s);
  LeaveFence(store_, this);
  for (Impl::Entry& e : m.entries) {
    if (e.host) device_memory::FreeHost(e.host);
    if (e.done) cudaEventDestroy(e.done);
  }
  if (m.grant_host) device_memory::FreeHost(m.grant_host);
  for (void* p : {static_cast<void*>(m.pool),
                  static_cast<void*>(m.slot_owner),
                  static_cast<void*>(m.slot_stamp),
                  static_cast<void*>(m.clock_hand),
                  static_cast<void*>(m.r.row_slot),
                  static_cast<void*>(m.r.src_k),
                  static_cast<void*>(m.r.src_v),
                  static_cast<void*>(m.r.first),
                  static_cast<void*>(m.r.logit),
                  static_cast<void*>(m.r.cosine),
                  static_cast<void*>(m.r.topk_ws),
                  static_cast<void*>(m.blocks),
                  static_cast<void*>(m.q),
                  static_cast<void*>(m.probe),
                  static_cast<void*>(m.inv_freq),
                  static_cast<void*>(m.grant),
                  static_cast<void*>(m.sealed_keys),
                  static_cast<void*>(m.sealed_inv),
                  static_cast<void*>(m.sealed_mass),
                  static_cast<void*>(m.sealed_scratch),
                  static_cast<void*>(m.sealed_tokens)})
    if (p) device_memory::Free(p);
  if (m.reads_done) cudaEventDestroy(m.reads_done);
  if (m.q_ready) cudaEventDestroy(m.q_ready);
}

namespace {

template <class T>
Status DeviceAlloc(T** p, size_t bytes, const char* what) {
  void* raw = nullptr;
  const cudaError_t e = device_memory::Malloc(&raw, std::max<size_t>(bytes, 16), DeviceMemoryOwner::kHotTier);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ResourceExhausted("device lane: " + std::to_string(bytes) + " bytes of device memory for " + what +
                             " (" + CudaMessage(e) + ")");
  }
  *p = static_cast<T*>(raw);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<DeviceLane>> DeviceLane::Create(TieredStore* store, SequenceId seq, void* stream,
                                                       const DeviceLaneOptions& options) {
  if (store == nullptr) return InvalidArgument("device lane: store is null");
  KVTIER_RETURN_IF_ERROR(options.Validate());
  if (kc::DeviceCount() == 0)
    return Unavailable(std::string("device lane: no CUDA device: ") + kc::LastCudaErrorString());
  std::unique_ptr<DeviceLane> lane(new DeviceLane(store, seq, stream, options));
  Impl& m = *lane->impl_;
  const DeviceLaneOptions& o = options;
  auto s = static_cast<cudaStream_t>(stream);
  for (cudaEvent_t* ev : {&m.reads_done, &m.q_ready})
    if (const cudaError_t e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming); e != cudaSuccess)
      return CudaFailure("cudaEventCreate", e);
  // Recorded once, so that the fence may wait on it before the first gather.
  if (const cudaError_t e = cudaEventRecord(m.reads_done, s); e != cudaSuccess)
    return CudaFailure("recording the readers' event", e);
  m.half = static_cast<size_t>(o.chunk_tokens) * o.kv_heads * o.head_dim * DTypeSize(o.dtype);
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.pool, 2 * m.half * o.slots, "the slot pool"));
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.slot_owner, sizeof(int64_t) * o.slots, "the chunk table"));
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.slot_stamp, sizeof(uint64_t) * o.slots, "the chunk table"));
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.clock_hand, sizeof(int32_t), "the chunk table"));
  const size_t r = static_cast<size_t>(o.max_rows);
  m.off_rows = kHeaderBytes;
  m.report_rows = kHeaderBytes + r * sizeof(int32_t);
  m.report_first = (m.report_rows + 7) / 8 * 8;
  m.report_layer = m.report_first + r * sizeof(int64_t);
  m.off_slots = Align256(m.report_rows);
  m.off_first = Align256(m.off_slots + r * sizeof(int32_t));
  m.off_miss_slot = Align256(m.off_first + r * sizeof(int64_t));
  m.off_miss_row = Align256(m.off_miss_slot + r * sizeof(int32_t));
  m.off_call = Align256(m.off_miss_row + r * sizeof(int32_t));
  m.layer_block = Align256(m.off_call + sizeof(LaneCallBlock));
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.blocks, m.layer_block * o.layers, "the layers' slot lists"));
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.q, sizeof(float) * o.q_heads * o.head_dim, "the queries"));
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.probe, sizeof(float) * o.kv_heads * o.head_dim, "the probe"));
  m.grant_bytes =
      Align256(sizeof(kernels::EntropyGrantState)) + o.layers * (sizeof(double) + sizeof(int64_t));
  KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.grant, m.grant_bytes, "the allocator's state"));
  if (device_memory::HostAlloc(&m.grant_host, m.grant_bytes, cudaHostAllocDefault) != cudaSuccess)
    return ResourceExhausted("device lane: pinned memory for the allocator's state");
  for (Impl::Entry& e : m.entries) {
    if (device_memory::HostAlloc(&e.host, m.report_layer * o.layers, cudaHostAllocDefault) != cudaSuccess)
      return ResourceExhausted("device lane: pinned memory for the step reports");
    if (const cudaError_t err = cudaEventCreateWithFlags(&e.done, cudaEventDisableTiming); err != cudaSuccess)
      return CudaFailure("cudaEventCreate", err);
  }
  if (!o.rope_inv_freq.empty()) {
    KVTIER_RETURN_IF_ERROR(
        DeviceAlloc(&m.inv_freq, sizeof(double) * o.rope_inv_freq.size(), "RoPE frequencies"));
    KVTIER_ASSIGN_OR_RETURN(uint8_t * st,
                            m.staging.Take(sizeof(double) * o.rope_inv_freq.size(), "RoPE frequencies"));
    std::memcpy(st, o.rope_inv_freq.data(), sizeof(double) * o.rope_inv_freq.size());
    if (const cudaError_t e =
            device_sync::CopyAsync(m.inv_freq, st, sizeof(double) * o.rope_inv_freq.size(),
                                   cudaMemcpyHostToDevice, s, device_sync::HostMemory::kPinned);
        e != cudaSuccess)
      return CudaFailure("uploading the RoPE frequencies", e);
    KVTIER_RETURN_IF_ERROR(m.staging.Done(stream));
  }
  cudaError_t e = cudaMemsetAsync(m.slot_owner, 0xff, sizeof(int64_t) * o.slots, s);  // kChunkTableFree
  if (e == cudaSuccess) e = cudaMemsetAsync(m.slot_stamp, 0, sizeof(uint64_t) * o.slots, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(m.clock_hand, 0, sizeof(int32_t), s);
  if (e != cudaSuccess) return CudaFailure("clearing the chunk table", e);
  m.layers.resize(static_cast<size_t>(o.layers));
  JoinFence(store, lane.get());
  return lane;
}

namespace {

// New row arrays for `rows` rows per layer holding what `old` (of `old_rows` rows per layer) held:
// each layer's table entries, sources and positions move across on `s` (no host wait), and the
// rows past `old_rows` are empty (row_slot -1). The slot owners ((layer << 32) | row) do not
// depend on the stride, so the table stays valid. On an error nothing of `old` changed.
Status GrowRows(int layers, int old_rows, int rows, cudaStream_t s, RowArrays* old) {
  RowArrays nw;
  Status st = [&]() -> Status {
    const size_t n = static_cast<size_t>(layers) * rows;
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&nw.row_slot, sizeof(int32_t) * n, "the chunk table's rows"));
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&nw.src_k, sizeof(void*) * n, "the rows' sources"));
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&nw.src_v, sizeof(void*) * n, "the rows' sources"));
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&nw.first, sizeof(int64_t) * n, "the rows' positions"));
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&nw.logit, sizeof(float) * rows, "the scores"));
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&nw.cosine, sizeof(float) * rows, "the scores"));
    kernels::SegmentedTopKParams shape;
    const int32_t offsets[2] = {0, rows}, k = 0;
    shape.n_segments = 1;
    shape.offsets = offsets;
    shape.k = &k;
    if (const KernelError ke = kc::SegmentedTopKWorkspaceBytes(shape, rows, &nw.topk_bytes);
        ke != KernelError::kOk)
      return KernelFailure("SegmentedTopKWorkspaceBytes", ke);
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&nw.topk_ws, nw.topk_bytes, "the top-k's workspace"));
    cudaError_t e = cudaMemsetAsync(nw.row_slot, 0xff, sizeof(int32_t) * n, s);  // -1: no slot
    if (e != cudaSuccess) return CudaFailure("clearing the chunk table's rows", e);
    for (int l = 0; l < layers && old_rows > 0 && e == cudaSuccess; ++l) {
      const size_t from = static_cast<size_t>(l) * old_rows, to = static_cast<size_t>(l) * rows;
      auto move = [&](void* dst, const void* src, size_t bytes) {
        if (e == cudaSuccess)
          e = device_sync::CopyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s,
                                     device_sync::HostMemory::kPinned);
      };
      move(nw.row_slot + to, old->row_slot + from, sizeof(int32_t) * old_rows);
      move(nw.src_k + to, old->src_k + from, sizeof(void*) * old_rows);
      move(nw.src_v + to, old->src_v + from, sizeof(void*) * old_rows);
      move(nw.first + to, old->first + from, sizeof(int64_t) * old_rows);
    }
    if (e != cudaSuccess) return CudaFailure("moving the chunk table's rows", e);
    return Status::Ok();
  }();
  if (!st.ok()) {
    nw.FreeAfter(s);
    return st;
  }
  old->FreeAfter(s);
  *old = nw;
  return Status::Ok();
}

}  // namespace

Result<bool> DeviceLane::PrepareLayer(int layer, const std::vector<uint64_t>& row_ids,
                                      const std::vector<SealingChunk>& sealing) {
  Impl& m = *impl_;
  if (layer < 0 || layer >= options_.layers)
    return InvalidArgument("device lane: layer " + std::to_string(layer) + " of " +
                           std::to_string(options_.layers));
  if (row_ids.size() > static_cast<size_t>(INT32_MAX / 2))
    return InvalidArgument("device lane: " + std::to_string(row_ids.size()) + " rows in one layer");
  Impl::Layer& L = m.layers[static_cast<size_t>(layer)];
  L.sealed = 0;
  L.sealed_mass.clear();
  if (sealing.size() > static_cast<size_t>(kMaxSealedRows)) return false;  // the host path lands them
  // The rows the selection scores: the index's, then the chunks still landing (their rows when
  // they land, as the index adds chunks in order).
  std::vector<uint64_t> ids = row_ids;
  for (const SealingChunk& c : sealing) {
    if (!ids.empty() && c.index <= ids.back()) return false;  // not above the index's rows: host path
    ids.push_back(c.index);
  }
  auto s = static_cast<cudaStream_t>(stream_);
  const int n = static_cast<int>(ids.size());
  if (n > m.row_cap) {
    // Every layer's rows move to a wider stride on the device, the table kept (GrowRows): no
    // wait. The first table is sized for initial_rows; it grows by an eighth.
    const int rows = std::max({options_.initial_rows, n + n / 8, m.row_cap + m.row_cap / 8});
    std::lock_guard<std::mutex> l(m.mu);
    KVTIER_RETURN_IF_ERROR(GrowRows(options_.layers, m.row_cap, rows, s, &m.r));
    m.row_cap = rows;
  }
  L.sealed = static_cast<int>(sealing.size());
  if (!sealing.empty()) {
    const size_t per =
        std::max_element(sealing.begin(), sealing.end(), [](const SealingChunk& a, const SealingChunk& b) {
          return a.mass.size() < b.mass.size();
        })->mass.size();
    L.sealed_mass.assign(per * sealing.size(), 0.0f);
    for (size_t i = 0; i < sealing.size(); ++i)
      std::copy(sealing[i].mass.begin(), sealing[i].mass.end(), L.sealed_mass.begin() + i * per);
  }
  const bool same = L.rows != nullptr && *L.rows == ids;
  const bool epoch_same = L.ok && L.epoch == store_->warm_epoch();
  if (same && epoch_same && !(L.recheck && !L.missing->empty()))
    return options_.defer_cold || L.missing->empty();
  const size_t base = static_cast<size_t>(layer) * m.row_cap;
  // The rows whose sources are asked: the new ones at the end when rows only grew (a seal), the
  // rows with no source when a fetch may have brought them to warm (RefreshRows), else every row
  // (rows changed otherwise, which also resets the layer's table entries: the header's rule; or
  // the warm epoch moved).
  const bool extends = !same && epoch_same && L.rows != nullptr && L.rows->size() <= ids.size() &&
                       std::equal(L.rows->begin(), L.rows->end(), ids.begin());
  if (L.rows == nullptr || !(same || extends)) {
    const cudaError_t e = cudaMemsetAsync(m.r.row_slot + base, 0xff, sizeof(int32_t) * m.row_cap, s);
    if (e != cudaSuccess) return CudaFailure("resetting a layer's table entries", e);
  }
  std::vector<int> ask;  // row indices into ids
  std::vector<MissingRow> missing;
  const bool incremental = (same && epoch_same) || extends;  // earlier sources kept
  if (same && epoch_same) {                                  // a recheck of the rows with no source
    for (const MissingRow& r : *L.missing)
      ask.push_back(static_cast<int>(std::lower_bound(ids.begin(), ids.end(), r.id) - ids.begin()));
  } else {
    if (extends) missing = *L.missing;
    for (int i = extends ? static_cast<int>(L.rows->size()) : 0; i < n; ++i) ask.push_back(i);
  }
  L.recheck = false;
  L.rows = std::make_shared<const std::vector<uint64_t>>(ids);
  L.ok = false;
  std::vector<uint64_t> asked(ask.size());
  for (size_t i = 0; i < ask.size(); ++i) asked[i] = ids[static_cast<size_t>(ask[i])];
  if (!options_.defer_cold) {
    // A row with no warm copy sends the layer to the host path: found from the chunks' tiers
    // before any address is asked for, so that such a layer exposes no warm slot.
    KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkInfo> chunks, store_->ListChunks(seq_, layer));
    std::vector<uint8_t> tiers;
    for (const ChunkInfo& c : chunks) {
      if (c.key.index >= tiers.size()) tiers.resize(c.key.index + 1, kTierNone);
      tiers[c.key.index] = c.tiers;
    }
    for (size_t i = 0; i < ask.size(); ++i)
      if (static_cast<size_t>(ask[i]) < row_ids.size() &&
          (asked[i] >= tiers.size() || (tiers[asked[i]] & kTierWarm) == 0))
        return false;  // L.ok is false: every row is asked again next time
  }
  std::vector<WarmChunkAddress> addr(ask.size());
  uint64_t epoch = 0;
  // A row with no warm copy (only in a lower tier) gets no source: the chunk table skips it when
  // chosen (deferred: the session brings it back to warm for a later step). The chunks still
  // landing have their warm slots, which hold them once the hot tier's downloads submitted so far
  // are done (Launch orders the lane after those).
  KVTIER_RETURN_IF_ERROR(store_->WarmAddresses(seq_, layer, asked.data(), asked.size(), addr.data(), &epoch,
                                               /*include_landing=*/true));
  if (incremental && epoch != L.epoch) {  // moved while asked: every source again
    L.rows = nullptr;
    return PrepareLayer(layer, row_ids, sealing);
  }
  L.epoch = epoch;
  // Every asked row's source goes up, null for a row with no warm copy (which may have had one:
  // a stale address must not stay).
  std::vector<int> upload;  // indices into ask/addr
  for (size_t i = 0; i < ask.size(); ++i) {
    if (!(addr[i].k && addr[i].v)) {
      missing.push_back(MissingRow{asked[i], addr[i].first_position});
      addr[i].k = addr[i].v = nullptr;
    }
    upload.push_back(static_cast<int>(i));
  }
  std::sort(missing.begin(), missing.end());
  for (size_t i = 0; i < sealing.size(); ++i)
    if (std::binary_search(missing.begin(), missing.end(), MissingRow{sealing[i].index, 0}))
      return Internal("device lane: layer " + std::to_string(layer) + ": chunk " +
                      std::to_string(sealing[i].index) + " is landing and has no warm slot");
  L.missing = std::make_shared<const std::vector<MissingRow>>(std::move(missing));
  L.ok = true;
  // Without deferral a row with no warm copy sends the layer to the host path, whose fetch brings
  // it back to warm: its source is asked again at the next call.
  const bool runs = options_.defer_cold || L.missing->empty();
  if (!runs) L.recheck = true;
  if (upload.empty()) return runs;
  // Sources of contiguous rows go up in one copy per array.
  const size_t count = upload.size();
  const size_t bytes = count * (2 * sizeof(void*) + sizeof(int64_t));
  KVTIER_ASSIGN_OR_RETURN(uint8_t * st, m.staging.Take(bytes, "the rows' sources"));
  auto* k = reinterpret_cast<const void**>(st);
  auto* v = k + count;
  auto* first = reinterpret_cast<int64_t*>(v + count);
  for (size_t j = 0; j < count; ++j) {
    const WarmChunkAddress& a = addr[static_cast<size_t>(upload[j])];
    k[j] = a.k;
    v[j] = a.v;
    first[j] = a.first_position;
  }
  cudaError_t e = cudaSuccess;
  for (size_t j = 0; j < count && e == cudaSuccess;) {
    size_t run = 1;
    while (j + run < count && ask[static_cast<size_t>(upload[j + run])] ==
                                  ask[static_cast<size_t>(upload[j])] + static_cast<int>(run))
      ++run;
    const size_t at = base + static_cast<size_t>(ask[static_cast<size_t>(upload[j])]);
    e = device_sync::CopyAsync(m.r.src_k + at, k + j, sizeof(void*) * run, cudaMemcpyHostToDevice, s,
                               device_sync::HostMemory::kPinned);
    if (e == cudaSuccess)
      e = device_sync::CopyAsync(m.r.src_v + at, v + j, sizeof(void*) * run, cudaMemcpyHostToDevice, s,
                                 device_sync::HostMemory::kPinned);
    if (e == cudaSuccess)
      e = device_sync::CopyAsync(m.r.first + at, first + j, sizeof(int64_t) * run, cudaMemcpyHostToDevice, s,
                                 device_sync::HostMemory::kPinned);
    j += run;
  }
  if (e != cudaSuccess) return CudaFailure("uploading the rows' sources", e);
  KVTIER_RETURN_IF_ERROR(m.staging.Done(stream_));
  return runs;
}

Status DeviceLane::ScoreSealedRows(int layer, const Retriever::LaneLayer& sel,
                                   const kernels::ChunkScoreParams& index_rows) {
  Impl& m = *impl_;
  const DeviceLaneOptions& o = options_;
  const Impl::Layer& L = m.layers[static_cast<size_t>(layer)];
  auto s = static_cast<cudaStream_t>(stream_);
  const kernels::MassChoiceShape shape{o.dtype,        o.kv_heads,      o.head_dim,
                                       o.chunk_tokens, index_rows.repr, index_rows.kv_heads};
  const size_t mass_floats = static_cast<size_t>(shape.out_heads) * shape.chunk_size;
  if (L.sealed_mass.size() != mass_floats * static_cast<size_t>(L.sealed))
    return Internal("device lane: layer " + std::to_string(layer) + ": the landing chunks' statistics hold " +
                    std::to_string(L.sealed_mass.size()) + " values, not " + std::to_string(L.sealed) +
                    " x " + std::to_string(mass_floats));
  const size_t pairs = static_cast<size_t>(kMaxSealedRows) * shape.out_heads;
  const size_t key_bytes = static_cast<size_t>(o.head_dim) * DTypeSize(o.dtype);
  if (m.sealed_keys == nullptr || m.sealed_shape.repr_topk != shape.repr_topk ||
      m.sealed_shape.out_heads != shape.out_heads) {
    for (void* p : {static_cast<void*>(m.sealed_keys), static_cast<void*>(m.sealed_inv),
                    static_cast<void*>(m.sealed_mass), static_cast<void*>(m.sealed_scratch),
                    static_cast<void*>(m.sealed_tokens)})
      if (p) device_memory::FreeAfter(p, s);
    m.sealed_keys = nullptr, m.sealed_inv = nullptr, m.sealed_mass = nullptr, m.sealed_scratch = nullptr,
    m.sealed_tokens = nullptr;
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(&m.sealed_keys, pairs * shape.repr_topk * key_bytes, "landing rows"));
    KVTIER_RETURN_IF_ERROR(
        DeviceAlloc(&m.sealed_inv, pairs * shape.repr_topk * sizeof(float), "landing rows"));
    KVTIER_RETURN_IF_ERROR(
        DeviceAlloc(&m.sealed_mass, pairs * shape.chunk_size * sizeof(float), "landing rows"));
    KVTIER_RETURN_IF_ERROR(DeviceAlloc(
        &m.sealed_scratch, pairs * kernels::MassChoiceScratchFloats(shape) * sizeof(float), "landing rows"));
    KVTIER_RETURN_IF_ERROR(
        DeviceAlloc(&m.sealed_tokens, pairs * shape.repr_topk * sizeof(int), "landing rows"));
    m.sealed_shape = shape;
  }
  // The warm slots hold the chunks once the hot tier's downloads submitted so far are done: the
  // lane's stream waits for them on the device (the gathers below read the slots too).
  KVTIER_RETURN_IF_ERROR(static_cast<CudaHotTier*>(store_->hot_tier())->MakeStreamWait(stream_));
  {
    const size_t bytes = sizeof(float) * L.sealed_mass.size();
    KVTIER_ASSIGN_OR_RETURN(uint8_t * st, m.staging.Take(bytes, "the landing chunks' statistics"));
    std::memcpy(st, L.sealed_mass.data(), bytes);
    const cudaError_t e = device_sync::CopyAsync(m.sealed_mass, st, bytes, cudaMemcpyHostToDevice, s,
                                                 device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) return CudaFailure("uploading the landing chunks' statistics", e);
    KVTIER_RETURN_IF_ERROR(m.staging.Done(stream_));
  }
  const size_t base = static_cast<size_t>(layer) * m.row_cap;
  kernels::MassRepresentativesParams rp;
  rp.shape = shape;
  rp.chunks = L.sealed;
  rp.keys = m.r.src_k + base + sel.n;  // the rows' K sources: the landing chunks' warm slots
  rp.mass = m.sealed_mass;
  rp.scratch = m.sealed_scratch;
  rp.tokens = m.sealed_tokens;
  rp.chunk_stride = kMaxSealedRows;
  rp.out_keys = m.sealed_keys;
  rp.out_inv_norm = m.sealed_inv;
  if (const KernelError ke = kc::LaunchChooseMassRepresentatives(rp, s); ke != KernelError::kOk)
    return KernelFailure("LaunchChooseMassRepresentatives", ke);
  kernels::ChunkScoreParams sp = index_rows;
  sp.n_chunks = L.sealed;
  sp.chunk_stride = kMaxSealedRows;
  sp.keys = m.sealed_keys;
  sp.inv_norm = m.sealed_inv;
  sp.logit = index_rows.logit + sel.n;
  sp.cosine = index_rows.cosine + sel.n;
  if (const KernelError ke = kc::LaunchScoreChunks(sp, s); ke != KernelError::kOk)
    return KernelFailure("LaunchScoreChunks (landing rows)", ke);
  return Status::Ok();
}

void DeviceLane::RefreshRows(int layer) {
  if (layer >= 0 && layer < options_.layers) impl_->layers[static_cast<size_t>(layer)].recheck = true;
}

bool DeviceLane::has_pending() const { return !impl_->pending.empty(); }
bool DeviceLane::ring_full() const { return impl_->pending.size() >= static_cast<size_t>(kReportRing); }

Result<bool> DeviceLane::Launch(const LayerCall& call, AttentionPlanInput* in) {
  Impl& m = *impl_;
  const DeviceLaneOptions& o = options_;
  if (call.select == nullptr || call.q == nullptr || in == nullptr)
    return InvalidArgument("device lane: Launch needs the selection, the queries and the plan input");
  const Retriever::LaneLayer& sel = *call.select;
  const int layer = call.layer;
  if (layer < 0 || layer >= o.layers || sel.n < 0)
    return InvalidArgument("device lane: layer " + std::to_string(layer) + " with " + std::to_string(sel.n) +
                           " rows (prepare it first)");
  if (sel.entropy && call.grant == nullptr)
    return InvalidArgument("device lane: the entropy allocator's state is null");
  Impl::Layer& L = m.layers[static_cast<size_t>(layer)];
  // The rows scored: the index's n, then the chunks still landing.
  const int n_rows = sel.n + L.sealed;
  if (!L.ok || L.rows == nullptr || n_rows == 0 || static_cast<int>(L.rows->size()) != n_rows ||
      n_rows > m.row_cap)
    return FailedPrecondition("device lane: layer " + std::to_string(layer) +
                              " was not prepared for its rows");
  if (L.sealed > 0 && !sel.sealed_rows)
    return FailedPrecondition("device lane: layer " + std::to_string(layer) +
                              " has chunks landing and its index cannot score them before they land");
  // The step's report entry.
  if (m.open < 0 || m.entries[m.open].step != call.step) {
    if (ring_full())
      return FailedPrecondition("device lane: the ring of step reports is full (take one first)");
    m.open = m.next;
    m.next = (m.next + 1) % kReportRing;
    Impl::Entry& fresh = m.entries[m.open];
    fresh.step = call.step;
    fresh.order.clear();
    fresh.rows.clear();
    fresh.missing.clear();
    m.pending.push_back(m.open);
  }
  Impl::Entry& entry = m.entries[m.open];
  const int slot_in_report = static_cast<int>(entry.order.size());
  if (slot_in_report >= o.layers)
    return FailedPrecondition("device lane: more layer calls in step " + std::to_string(call.step) +
                              " than layers");

  std::lock_guard<std::mutex> lock(m.mu);
  if (store_->warm_epoch() != L.epoch) return false;  // addresses of an older epoch: ask again
  auto s = static_cast<cudaStream_t>(stream_);
  // After the engine's writes of q (and, through its stream, the last layer's attention).
  cudaError_t e = cudaEventRecord(m.q_ready, static_cast<cudaStream_t>(call.q_stream));
  if (e == cudaSuccess) e = cudaStreamWaitEvent(s, m.q_ready, 0);
  if (e != cudaSuccess) return CudaFailure("ordering after the queries' stream", e);
  uint8_t* blk = m.block(layer);
  LaneHeader* hdr = m.header(layer);
  auto* call_d = reinterpret_cast<LaneCallBlock*>(blk + m.off_call);
  {
    KVTIER_ASSIGN_OR_RETURN(uint8_t * st, m.staging.Take(sizeof(LaneCallBlock), "a layer call"));
    LaneCallBlock cb{{0, n_rows}, n_rows, 0, call.rope_position};
    std::memcpy(st, &cb, sizeof cb);
    e = device_sync::CopyAsync(call_d, st, sizeof cb, cudaMemcpyHostToDevice, s,
                               device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) return CudaFailure("uploading a layer call", e);
    KVTIER_RETURN_IF_ERROR(m.staging.Done(stream_));
  }
  e = cudaMemsetAsync(hdr, 0, sizeof(LaneHeader), s);
  if (e != cudaSuccess) return CudaFailure("clearing the layer's report", e);
  // The allocator's state: uploaded at the first lane layer after the host held it, else begun
  // on the device at each step's first lane layer.
  auto* state_d = reinterpret_cast<kernels::EntropyGrantState*>(m.grant);
  if (sel.entropy) {
    if (!grant_on_device_) {
      const size_t head = Align256(sizeof(kernels::EntropyGrantState));
      auto* host = static_cast<uint8_t*>(m.grant_host);
      kernels::EntropyGrantState st = *call.grant;
      st.theta_sum = reinterpret_cast<double*>(m.grant + head);
      st.theta_count = reinterpret_cast<int64_t*>(m.grant + head + sizeof(double) * o.layers);
      std::memcpy(host, &st, sizeof st);
      std::memcpy(host + head, call.grant->theta_sum, sizeof(double) * o.layers);
      std::memcpy(host + head + sizeof(double) * o.layers, call.grant->theta_count,
                  sizeof(int64_t) * o.layers);
      e = device_sync::CopyAsync(m.grant, host, m.grant_bytes, cudaMemcpyHostToDevice, s,
                                 device_sync::HostMemory::kPinned);
      if (e != cudaSuccess) return CudaFailure("uploading the allocator's state", e);
      grant_on_device_ = true;
      m.grant_step = call.step;
    } else if (m.grant_step != call.step) {
      if (const KernelError ke = kc::LaunchEntropyGrantBeginStep(state_d, sel.k, s); ke != KernelError::kOk)
        return KernelFailure("LaunchEntropyGrantBeginStep", ke);
      m.grant_step = call.step;
    }
  }
  // q: checked, copied, rotated to memory's position (InfLLM), pooled into the probe.
  const int q_floats = o.q_heads * o.head_dim;
  if (const KernelError ke = kc::LaunchCountNonFinite(call.q, q_floats, &hdr->q_non_finite, &hdr->q_first, s);
      ke != KernelError::kOk)
    return KernelFailure("LaunchCountNonFinite", ke);
  e = device_sync::CopyAsync(m.q, call.q, sizeof(float) * q_floats, cudaMemcpyDeviceToDevice, s,
                             device_sync::HostMemory::kPinned);
  if (e != cudaSuccess) return CudaFailure("copying the queries", e);
  if (m.inv_freq != nullptr) {
    kc::RopeParams r;
    r.m = 1;
    r.heads = o.q_heads;
    r.head_dim = o.head_dim;
    r.x = m.q;
    r.positions = &call_d->rope_position;
    r.inv_freq = m.inv_freq;
    if (const KernelError ke = kc::LaunchRope(r, s); ke != KernelError::kOk)
      return KernelFailure("LaunchRope", ke);
  }
  const kernels::ProbeShape shape{o.q_heads, o.kv_heads, o.head_dim};
  if (const KernelError ke = kc::LaunchMeanPoolProbe(shape, m.q, 1, m.probe, s); ke != KernelError::kOk)
    return KernelFailure("LaunchMeanPoolProbe", ke);
  // Eq. 10 over the mirror, Eq. 11, Eq. 12, the top-B rows.
  kernels::ChunkScoreParams sp = sel.score;
  sp.probe = m.probe;
  sp.logit = m.r.logit;
  sp.cosine = m.r.cosine;
  if (sel.n > 0)  // (an index with no rows yet: only chunks still landing)
    if (const KernelError ke = kc::LaunchScoreChunks(sp, s); ke != KernelError::kOk)
      return KernelFailure("LaunchScoreChunks", ke);
  if (L.sealed > 0) KVTIER_RETURN_IF_ERROR(ScoreSealedRows(layer, sel, sp));
  if (sel.entropy) {
    kernels::EntropyParams ep;
    ep.n_segments = 1;
    ep.offsets = call_d->offsets;
    ep.scores = m.r.cosine;
    ep.entropy = &hdr->theta;
    ep.non_finite = &hdr->non_finite;
    if (const KernelError ke = kc::LaunchSegmentEntropy(ep, s); ke != KernelError::kOk)
      return KernelFailure("LaunchSegmentEntropy", ke);
  }
  kernels::EntropyGrantParams gp;
  gp.state = sel.entropy ? state_d : nullptr;
  gp.layer = layer;
  gp.n = &call_d->n;
  gp.theta = &hdr->theta;
  gp.non_finite = &hdr->non_finite;
  gp.cap = std::min(sel.cap, o.max_rows);
  gp.fixed_k = sel.entropy ? 0 : sel.k;
  gp.take = &hdr->take;
  gp.error = &hdr->grant_error;
  if (const KernelError ke = kc::LaunchEntropyGrant(gp, s); ke != KernelError::kOk)
    return KernelFailure("LaunchEntropyGrant", ke);
  auto* rows = reinterpret_cast<int32_t*>(blk + m.off_rows);
  kernels::SegmentedTopKParams tp;
  tp.n_segments = 1;
  tp.offsets = call_d->offsets;
  tp.scores = sel.rank == ChunkRank::kCosine ? m.r.cosine : m.r.logit;
  tp.k = &hdr->take;
  tp.k_max = o.max_rows;
  tp.out_index = rows;
  if (const KernelError ke = kc::LaunchSegmentedTopK(tp, n_rows, m.r.topk_ws, m.r.topk_bytes, s);
      ke != KernelError::kOk)
    return KernelFailure("LaunchSegmentedTopK", ke);
  // The rows' slots: hits kept, misses gathered from their warm copies.
  if (m.table_step != call.step) {
    m.table_step = call.step;
    m.step_first_stamp = m.stamp + 1;
  }
  const size_t base = static_cast<size_t>(layer) * m.row_cap;
  kernels::ChunkTableParams cp;
  cp.slots = o.slots;
  cp.layers = o.layers;
  cp.row_capacity = m.row_cap;
  cp.slot_owner = m.slot_owner;
  cp.slot_stamp = m.slot_stamp;
  cp.row_slot = m.r.row_slot;
  cp.clock_hand = m.clock_hand;
  cp.layer = layer;
  cp.stamp = ++m.stamp;
  cp.step_first_stamp = m.step_first_stamp;
  cp.max_rows = o.max_rows;
  cp.rows = rows;
  cp.n_rows = &hdr->take;
  cp.src_k = m.r.src_k + base;
  cp.src_v = m.r.src_v + base;
  cp.first_position = m.r.first + base;
  cp.slot_list = reinterpret_cast<int32_t*>(blk + m.off_slots);
  cp.slot_first_position = reinterpret_cast<int64_t*>(blk + m.off_first);
  cp.n_slots = &hdr->n_slots;
  cp.miss_slot = reinterpret_cast<int32_t*>(blk + m.off_miss_slot);
  cp.miss_row = reinterpret_cast<int32_t*>(blk + m.off_miss_row);
  cp.n_misses = &hdr->n_misses;
  cp.counters = hdr->table;
  cp.chunk_bytes_k = m.half;
  cp.chunk_bytes_v = m.half;
  cp.pool_k = m.pool;
  cp.pool_v = m.pool + m.half * o.slots;
  // The table's row_slot for rows the selection cannot name (cp.row_capacity past n) stays -1.
  if (const KernelError ke = kc::LaunchChunkTableAssign(cp, s); ke != KernelError::kOk)
    return KernelFailure("LaunchChunkTableAssign", ke);
  if (const KernelError ke = kc::LaunchChunkTableGather(cp, s); ke != KernelError::kOk)
    return KernelFailure("LaunchChunkTableGather", ke);
  e = cudaEventRecord(m.reads_done, s);  // the fence waits for this: every gather so far
  if (e != cudaSuccess) return CudaFailure("recording the gather's event", e);
  // The layer's report, read one step late.
  e = device_sync::CopyAsync(
      static_cast<uint8_t*>(entry.host) + static_cast<size_t>(slot_in_report) * m.report_layer, blk,
      m.report_rows, cudaMemcpyDeviceToHost, s, device_sync::HostMemory::kPinned);
  if (e == cudaSuccess)
    e = device_sync::CopyAsync(static_cast<uint8_t*>(entry.host) +
                                   static_cast<size_t>(slot_in_report) * m.report_layer + m.report_first,
                               blk + m.off_first, sizeof(int64_t) * o.max_rows, cudaMemcpyDeviceToHost, s,
                               device_sync::HostMemory::kPinned);
  if (e == cudaSuccess) e = cudaEventRecord(entry.done, s);
  if (e != cudaSuccess) return CudaFailure("copying the step report", e);
  entry.order.push_back(layer);
  entry.rows.push_back(L.rows);
  entry.missing.push_back(L.missing);
  // The attention reads the slot list where the table wrote it.
  in->chunks = nullptr;
  in->n_chunks = 0;
  in->device_slot_index = cp.slot_list;
  in->device_slot_first_position = cp.slot_first_position;
  in->device_slot_count = cp.n_slots;
  in->device_slot_capacity = o.max_rows;
  in->device_pool_k = m.pool;
  in->device_pool_v = m.pool + m.half * o.slots;
  in->device_pool_slots = o.slots;
  return true;
}

Result<bool> DeviceLane::TakeReport(uint64_t before_step, bool wait, LaneStepReport* out) {
  Impl& m = *impl_;
  if (out == nullptr) return InvalidArgument("device lane: TakeReport's out is null");
  if (m.pending.empty()) return false;
  const int idx = m.pending.front();
  Impl::Entry& entry = m.entries[idx];
  if (entry.step >= before_step) return false;
  cudaError_t e = cudaEventQuery(entry.done);
  if (e == cudaErrorNotReady) {
    if (!wait) return false;
    e = device_sync::SyncEvent(entry.done);
  }
  if (e != cudaSuccess) return CudaFailure("reading a step report", e);
  out->step = entry.step;
  out->layers.clear();
  const auto* host = static_cast<const uint8_t*>(entry.host);
  for (size_t i = 0; i < entry.order.size(); ++i) {
    const uint8_t* at = host + i * m.report_layer;
    LaneHeader h;
    std::memcpy(&h, at, sizeof h);
    LaneLayerReport r;
    r.layer = entry.order[i];
    r.take = h.take;
    r.hits = static_cast<int32_t>(h.table[kernels::kChunkTableHits]);
    r.misses = static_cast<int32_t>(h.table[kernels::kChunkTableMisses]);
    r.skipped =
        static_cast<int32_t>(h.table[kernels::kChunkTableInvalid] + h.table[kernels::kChunkTableOverflow]);
    r.no_source = static_cast<int32_t>(h.table[kernels::kChunkTableNoSource]);
    r.q_non_finite = h.q_non_finite;
    r.q_first = h.q_first;
    r.non_finite = h.non_finite;
    r.grant_error = h.grant_error;
    r.theta = h.theta;
    const std::vector<uint64_t>& ids = *entry.rows[i];
    const std::vector<MissingRow>& missing = *entry.missing[i];
    // What the attention read: the slot list's first positions (a chosen row with no source is
    // served only when the lane's pool still held it).
    const int n_slots = std::clamp(h.n_slots, 0, options_.max_rows);
    std::vector<int64_t> served(static_cast<size_t>(n_slots));
    if (n_slots > 0) std::memcpy(served.data(), at + m.report_first, sizeof(int64_t) * n_slots);
    std::sort(served.begin(), served.end());
    const int take = std::clamp(h.take, 0, options_.max_rows);
    r.chunks.reserve(static_cast<size_t>(take));
    for (int j = 0; j < take; ++j) {
      int32_t row = 0;
      std::memcpy(&row, at + kHeaderBytes + sizeof(int32_t) * j, sizeof row);
      if (row < 0 || static_cast<size_t>(row) >= ids.size()) continue;
      const uint64_t id = ids[static_cast<size_t>(row)];
      const auto miss = std::lower_bound(missing.begin(), missing.end(), MissingRow{id, 0});
      const bool skipped = miss != missing.end() && miss->id == id &&
                           !std::binary_search(served.begin(), served.end(), miss->first);
      (skipped ? r.deferred : r.chunks).push_back(id);
    }
    out->layers.push_back(std::move(r));
  }
  m.pending.pop_front();
  if (idx == m.open) m.open = -1;
  return true;
}

Status DeviceLane::ReturnGrantState(kernels::EntropyGrantState* host, uint64_t step, int k) {
  if (!grant_on_device_) return Status::Ok();
  if (host == nullptr) return InvalidArgument("device lane: the host allocator's state is null");
  Impl& m = *impl_;
  auto s = static_cast<cudaStream_t>(stream_);
  cudaError_t e = device_sync::CopyAsync(m.grant_host, m.grant, m.grant_bytes, cudaMemcpyDeviceToHost, s,
                                         device_sync::HostMemory::kPinned);
  if (e == cudaSuccess) e = device_sync::SyncStream(s);  // the one wait of a switch to the host path
  if (e != cudaSuccess) return CudaFailure("bringing the allocator's state back", e);
  const auto* at = static_cast<const uint8_t*>(m.grant_host);
  const size_t head = Align256(sizeof(kernels::EntropyGrantState));
  kernels::EntropyGrantState d;
  std::memcpy(&d, at, sizeof d);
  host->remaining = d.remaining;
  host->step_theta_sum = d.step_theta_sum;
  host->step_theta_count = d.step_theta_count;
  host->last_theta = d.last_theta;
  std::memcpy(host->theta_sum, at + head, sizeof(double) * options_.layers);
  std::memcpy(host->theta_count, at + head + sizeof(double) * options_.layers,
              sizeof(int64_t) * options_.layers);
  if (m.grant_step != step) kernels::EntropyGrantBeginStep(host, k);
  grant_on_device_ = false;
  return Status::Ok();
}

Status DeviceLane::WaitForReaders() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> l(m.mu);
  if (const cudaError_t e = device_sync::SyncEvent(m.reads_done); e != cudaSuccess)
    return CudaFailure("waiting for the gathers from warm", e);
  return Status::Ok();
}

#endif  // KVTIER_HAVE_CUDA

}  // namespace kvtier
