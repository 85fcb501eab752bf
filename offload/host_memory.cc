#include "offload/host_memory.h"

#include <cstdlib>
#include <new>
#include <string>

#ifdef KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "offload/device_memory_cuda.h"
#endif

namespace kvtier {

bool CudaDevicePresent() {
#ifdef KVTIER_HAVE_CUDA
  static const bool present = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return present;
#else
  return false;
#endif
}

void InitDeviceRuntime() {
#ifdef KVTIER_HAVE_CUDA
  if (CudaDevicePresent() && device_memory::Free(nullptr) != cudaSuccess) cudaGetLastError();
#endif
}

Result<std::unique_ptr<HostBuffer>> HostBuffer::Allocate(size_t bytes, bool want_pinned) {
  if (bytes == 0) return InvalidArgument("host buffer size must be > 0");
#ifdef KVTIER_HAVE_CUDA
  if (want_pinned && CudaDevicePresent()) {
    void* p = nullptr;
    if (device_memory::HostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess && p != nullptr)
      return std::unique_ptr<HostBuffer>(new HostBuffer(static_cast<uint8_t*>(p), bytes, Kind::kPinned));
    cudaGetLastError();  // fall through to pageable memory, reported by kind()
  }
#endif
  (void)want_pinned;
  const size_t rounded = (bytes + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr)
    return ResourceExhausted("could not allocate " + std::to_string(bytes) + " bytes of host memory");
  return std::unique_ptr<HostBuffer>(new HostBuffer(static_cast<uint8_t*>(p), bytes, Kind::kAligned));
}

HostBuffer::~HostBuffer() {
#ifdef KVTIER_HAVE_CUDA
  if (kind_ == Kind::kPinned) {
    device_memory::FreeHost(data_);
    return;
  }
#endif
  std::free(data_);
}

Result<std::unique_ptr<SlotPool>> SlotPool::Create(const char* what, size_t capacity_bytes, size_t slot_bytes,
                                                   bool want_pinned) {
  if (slot_bytes == 0) return InvalidArgument(std::string(what) + ": slot size must be > 0");
  if (capacity_bytes < slot_bytes)
    return InvalidArgument(std::string(what) + " (" + std::to_string(capacity_bytes) +
                           " bytes) is smaller than one chunk (" + std::to_string(slot_bytes) + " bytes)");
  const size_t n = capacity_bytes / slot_bytes;
  if (n > static_cast<size_t>(INT32_MAX)) return InvalidArgument(std::string(what) + ": too many slots");
  auto pool = std::unique_ptr<SlotPool>(new SlotPool());
  KVTIER_ASSIGN_OR_RETURN(pool->buffer_, HostBuffer::Allocate(n * slot_bytes, want_pinned));
  pool->slot_bytes_ = slot_bytes;
  pool->capacity_ = static_cast<int32_t>(n);
  pool->free_.reserve(n);
  // Hand out low slots first (LIFO stack with slot 0 on top): keeps touched pages compact.
  for (size_t i = n; i-- > 0;) pool->free_.push_back(static_cast<int32_t>(i));
  return pool;
}

int32_t SlotPool::Acquire() {
  if (free_.empty()) return -1;
  const int32_t s = free_.back();
  free_.pop_back();
  return s;
}

void SlotPool::Release(int32_t slot) { free_.push_back(slot); }

}  // namespace kvtier
