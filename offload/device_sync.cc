#include "offload/device_sync.h"

#include <atomic>

#if KVTIER_HAVE_CUDA
#include "offload/device_sync_cuda.h"
#endif

namespace kvtier {
namespace {

// Zero at load time (constant initialisation): counted from the first wait, whichever static
// initialiser makes it.
std::atomic<uint64_t> g_host_syncs[kHostSyncKinds];
// The waits on threads inside no step scope (HostSyncStepScope).
std::atomic<uint64_t> g_worker_host_syncs{0};
// The calling thread's waits, and how many step scopes it is inside.
thread_local uint64_t t_host_syncs = 0;
thread_local int t_step_depth = 0;

}  // namespace

const char* HostSyncKindName(HostSyncKind kind) {
  switch (kind) {
    case HostSyncKind::kStream:
      return "stream";
    case HostSyncKind::kEvent:
      return "event";
    case HostSyncKind::kDevice:
      return "device";
    case HostSyncKind::kBlockingCopy:
      return "blocking_copy";
    case HostSyncKind::kPageableCopy:
      return "pageable_copy";
  }
  return "unknown";
}

uint64_t HostSyncCounts::total() const {
  uint64_t n = 0;
  for (const uint64_t c : by_kind) n += c;
  return n;
}

HostSyncCounts HostSyncCounts::Since(const HostSyncCounts& earlier) const {
  HostSyncCounts d;
  for (int i = 0; i < kHostSyncKinds; ++i) d.by_kind[i] = by_kind[i] - earlier.by_kind[i];
  return d;
}

HostSyncCounts ReadHostSyncs() {
  HostSyncCounts c;
  for (int i = 0; i < kHostSyncKinds; ++i) c.by_kind[i] = g_host_syncs[i].load(std::memory_order_relaxed);
  return c;
}

uint64_t HostSyncsTotal() {
  uint64_t n = 0;
  for (const std::atomic<uint64_t>& c : g_host_syncs) n += c.load(std::memory_order_relaxed);
  return n;
}

void CountHostSync(HostSyncKind kind) {
  const int i = static_cast<int>(kind);
  if (i < 0 || i >= kHostSyncKinds) return;
  g_host_syncs[i].fetch_add(1, std::memory_order_relaxed);
  ++t_host_syncs;
  if (t_step_depth == 0) g_worker_host_syncs.fetch_add(1, std::memory_order_relaxed);
}

uint64_t HostSyncsOnThisThread() { return t_host_syncs; }

uint64_t WorkerHostSyncsTotal() { return g_worker_host_syncs.load(std::memory_order_relaxed); }

HostSyncStepScope::HostSyncStepScope() { ++t_step_depth; }

HostSyncStepScope::~HostSyncStepScope() { --t_step_depth; }

#if KVTIER_HAVE_CUDA

namespace device_sync {

cudaError_t SyncStream(cudaStream_t stream) {
  CountHostSync(HostSyncKind::kStream);
  return cudaStreamSynchronize(stream);
}

cudaError_t SyncEvent(cudaEvent_t event) {
  CountHostSync(HostSyncKind::kEvent);
  return cudaEventSynchronize(event);
}

cudaError_t SyncDevice() {
  CountHostSync(HostSyncKind::kDevice);
  return cudaDeviceSynchronize();
}

cudaError_t CopyBlocking(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  CountHostSync(HostSyncKind::kBlockingCopy);
  return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t CopyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream,
                      HostMemory host) {
  if (kind != cudaMemcpyDeviceToDevice && host == HostMemory::kPageable)
    CountHostSync(HostSyncKind::kPageableCopy);
  return cudaMemcpyAsync(dst, src, bytes, kind, stream);
}

}  // namespace device_sync

#endif  // KVTIER_HAVE_CUDA

}  // namespace kvtier
