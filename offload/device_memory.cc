#include "offload/device_memory.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>

#if KVTIER_HAVE_CUDA
#include <unordered_map>
#include <vector>

#include "offload/device_memory_cuda.h"
#include "offload/device_sync_cuda.h"
#endif

namespace kvtier {
namespace {

// Zero at load time (constant initialisation). Written under Mutex(), read without it.
std::atomic<uint64_t> g_current[kDeviceMemoryOwners];
std::atomic<uint64_t> g_peak[kDeviceMemoryOwners];
std::atomic<uint64_t> g_current_total, g_peak_total;
std::atomic<uint64_t> g_pinned_current, g_pinned_peak;

std::mutex& Mutex() {
  static std::mutex* const mu = new std::mutex;  // never destroyed: frees may run at exit
  return *mu;
}

void Raise(std::atomic<uint64_t>& peak, uint64_t value) {
  if (value > peak.load(std::memory_order_relaxed)) peak.store(value, std::memory_order_relaxed);
}

// Adds `bytes` to `current` (or takes them away, never below 0); returns the new value.
uint64_t Move(std::atomic<uint64_t>& current, uint64_t bytes, bool add) {
  const uint64_t now = current.load(std::memory_order_relaxed);
  const uint64_t next = add ? now + bytes : now - std::min(now, bytes);
  current.store(next, std::memory_order_relaxed);
  return next;
}

bool ValidOwner(DeviceMemoryOwner owner) {
  const int i = static_cast<int>(owner);
  return i >= 0 && i < kDeviceMemoryOwners;
}

}  // namespace

const char* DeviceMemoryOwnerName(DeviceMemoryOwner owner) {
  switch (owner) {
    case DeviceMemoryOwner::kHotTier:
      return "hot_tier";
    case DeviceMemoryOwner::kAttention:
      return "attention";
    case DeviceMemoryOwner::kRetrievalMirror:
      return "retrieval_mirror";
    case DeviceMemoryOwner::kRetrievalWorkspace:
      return "retrieval_workspace";
    case DeviceMemoryOwner::kModelForward:
      return "model_forward";
    case DeviceMemoryOwner::kEngineArrays:
      return "engine_arrays";
  }
  return "unknown";
}

DeviceMemoryUse ReadDeviceMemory() {
  DeviceMemoryUse u;
  for (int i = 0; i < kDeviceMemoryOwners; ++i) {
    u.current[i] = g_current[i].load(std::memory_order_relaxed);
    u.peak[i] = g_peak[i].load(std::memory_order_relaxed);
  }
  u.current_total = g_current_total.load(std::memory_order_relaxed);
  u.peak_total = g_peak_total.load(std::memory_order_relaxed);
  u.pinned_host_current = g_pinned_current.load(std::memory_order_relaxed);
  u.pinned_host_peak = g_pinned_peak.load(std::memory_order_relaxed);
  return u;
}

uint64_t DeviceMemoryPeakBytes() { return g_peak_total.load(std::memory_order_relaxed); }

void ResetDeviceMemoryPeaks() {
  std::lock_guard<std::mutex> l(Mutex());
  for (int i = 0; i < kDeviceMemoryOwners; ++i)
    g_peak[i].store(g_current[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  g_peak_total.store(g_current_total.load(std::memory_order_relaxed), std::memory_order_relaxed);
  g_pinned_peak.store(g_pinned_current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void CountDeviceAllocation(DeviceMemoryOwner owner, uint64_t bytes) {
  if (!ValidOwner(owner)) return;
  const int i = static_cast<int>(owner);
  std::lock_guard<std::mutex> l(Mutex());
  Raise(g_peak[i], Move(g_current[i], bytes, true));
  Raise(g_peak_total, Move(g_current_total, bytes, true));
}

void CountDeviceFree(DeviceMemoryOwner owner, uint64_t bytes) {
  if (!ValidOwner(owner)) return;
  const int i = static_cast<int>(owner);
  std::lock_guard<std::mutex> l(Mutex());
  const uint64_t held = g_current[i].load(std::memory_order_relaxed);
  Move(g_current[i], bytes, false);
  Move(g_current_total, std::min(held, bytes), false);
}

void CountPinnedHostAllocation(uint64_t bytes) {
  std::lock_guard<std::mutex> l(Mutex());
  Raise(g_pinned_peak, Move(g_pinned_current, bytes, true));
}

void CountPinnedHostFree(uint64_t bytes) {
  std::lock_guard<std::mutex> l(Mutex());
  Move(g_pinned_current, bytes, false);
}

#if KVTIER_HAVE_CUDA

namespace device_memory {
namespace {

// What each live allocation of the wrappers counted, by address: its bytes, and its owner
// (pinned: none).
struct Allocation {
  uint64_t bytes = 0;
  bool pinned = false;
  DeviceMemoryOwner owner = DeviceMemoryOwner::kHotTier;
};

std::unordered_map<uintptr_t, Allocation>& Live() {
  static auto* const live = new std::unordered_map<uintptr_t, Allocation>;  // see Mutex()
  return *live;
}
std::mutex& LiveMutex() {
  static std::mutex* const mu = new std::mutex;
  return *mu;
}

void Record(uintptr_t p, uint64_t bytes, bool pinned, DeviceMemoryOwner owner) {
  std::lock_guard<std::mutex> l(LiveMutex());
  Allocation& a = Live()[p];
  a.bytes = bytes;
  a.pinned = pinned;
  a.owner = owner;
}

// The record of `p`, removed; false when the wrappers did not allocate it.
bool Forget(uintptr_t p, Allocation* a) {
  std::lock_guard<std::mutex> l(LiveMutex());
  auto it = Live().find(p);
  if (it == Live().end()) return false;
  *a = it->second;
  Live().erase(it);
  return true;
}

}  // namespace

cudaError_t Malloc(void** p, size_t bytes, DeviceMemoryOwner owner) {
  if (p == nullptr) return cudaMalloc(p, bytes);  // the runtime's own answer to a null out-pointer
  void* got = nullptr;
  const cudaError_t e = cudaMalloc(&got, bytes);
  *p = got;
  if (e == cudaSuccess && got != nullptr) {
    Record(reinterpret_cast<uintptr_t>(got), bytes, false, owner);
    CountDeviceAllocation(owner, bytes);
  }
  return e;
}

cudaError_t Free(void* p) {
  Allocation a;
  if (p != nullptr && Forget(reinterpret_cast<uintptr_t>(p), &a) && !a.pinned)
    CountDeviceFree(a.owner, a.bytes);
  return cudaFree(p);
}

namespace {

struct Deferred {
  void* p = nullptr;
  cudaEvent_t done = nullptr;
};
std::vector<Deferred>& DeferredFrees() {
  static auto* const list = new std::vector<Deferred>;  // see Mutex()
  return *list;
}
std::mutex& DeferredMutex() {
  static std::mutex* const mu = new std::mutex;
  return *mu;
}

// Frees the deferred allocations whose event is complete (every one when `wait`).
void Reap(bool wait) {
  std::vector<Deferred> ready;
  {
    std::lock_guard<std::mutex> l(DeferredMutex());
    auto& list = DeferredFrees();
    for (size_t i = 0; i < list.size();) {
      const cudaError_t e = cudaEventQuery(list[i].done);
      if (e == cudaErrorNotReady && !wait) {
        ++i;
        continue;
      }
      if (e != cudaSuccess) (void)cudaGetLastError();  // a failed stream: its work reads nothing more
      ready.push_back(list[i]);
      list[i] = list.back();
      list.pop_back();
    }
  }
  for (const Deferred& d : ready) {
    if (wait) device_sync::SyncEvent(d.done);
    cudaEventDestroy(d.done);
    Free(d.p);
  }
}

}  // namespace

cudaError_t FreeAfter(void* p, cudaStream_t stream) {
  Reap(false);
  if (p == nullptr) return cudaSuccess;
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(ev, stream);
  if (e != cudaSuccess) {
    if (ev != nullptr) cudaEventDestroy(ev);
    device_sync::SyncStream(stream);
    Free(p);
    return e;
  }
  std::lock_guard<std::mutex> l(DeferredMutex());
  DeferredFrees().push_back(Deferred{p, ev});
  return cudaSuccess;
}

void ReapFreed() { Reap(false); }
void FlushFreed() { Reap(true); }

cudaError_t HostAlloc(void** p, size_t bytes, unsigned flags) {
  if (p == nullptr) return cudaHostAlloc(p, bytes, flags);
  void* got = nullptr;
  const cudaError_t e = cudaHostAlloc(&got, bytes, flags);
  *p = got;
  if (e == cudaSuccess && got != nullptr) {
    Record(reinterpret_cast<uintptr_t>(got), bytes, true, DeviceMemoryOwner::kHotTier);
    CountPinnedHostAllocation(bytes);
  }
  return e;
}

cudaError_t FreeHost(void* p) {
  Allocation a;
  if (p != nullptr && Forget(reinterpret_cast<uintptr_t>(p), &a) && a.pinned) CountPinnedHostFree(a.bytes);
  return cudaFreeHost(p);
}

}  // namespace device_memory

#endif  // KVTIER_HAVE_CUDA

}  // namespace kvtier
