#include "offload/pinned_staging.h"

#if KVTIER_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "offload/device_sync_cuda.h"

namespace kvtier {
namespace {

std::string CudaMessage(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

}  // namespace

PinnedStaging::PinnedStaging(int entries, std::string owner)
    : entries_(static_cast<size_t>(std::max(1, entries))),
      current_(entries_.size() - 1),
      owner_(std::move(owner)) {}

PinnedStaging::~PinnedStaging() {
  for (Entry& e : entries_) {
    if (e.done) {
      device_sync::SyncEvent(static_cast<cudaEvent_t>(e.done));
      cudaEventDestroy(static_cast<cudaEvent_t>(e.done));
    }
    if (e.host) device_memory::FreeHost(e.host);
  }
}

Result<uint8_t*> PinnedStaging::Take(size_t bytes, const char* what) {
  current_ = (current_ + 1) % entries_.size();
  Entry& e = entries_[current_];
  if (e.done == nullptr) {
    cudaEvent_t ev = nullptr;
    if (const cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); err != cudaSuccess)
      return Internal(owner_ + ": cudaEventCreate for the " + what + ": " + CudaMessage(err));
    e.done = ev;
  } else if (e.recorded) {
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e.done));
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      err = device_sync::SyncEvent(static_cast<cudaEvent_t>(e.done));
    }
    if (err != cudaSuccess) return Internal(owner_ + ": staging the " + what + ": " + CudaMessage(err));
  }
  e.recorded = false;
  if (bytes > e.bytes) {
    if (e.host) device_memory::FreeHost(e.host);
    e.host = nullptr;
    e.bytes = 0;
    const size_t want = std::max<size_t>((bytes + 255) / 256 * 256, 4096);
    if (const cudaError_t err = device_memory::HostAlloc(&e.host, want, cudaHostAllocDefault);
        err != cudaSuccess) {
      (void)cudaGetLastError();
      e.host = nullptr;
      return ResourceExhausted(owner_ + ": cudaHostAlloc of " + std::to_string(want) + " bytes for the " +
                               what + " failed (" + CudaMessage(err) + ")");
    }
    e.bytes = want;
  }
  return static_cast<uint8_t*>(e.host);
}

Status PinnedStaging::Done(void* stream) {
  Entry& e = entries_[current_];
  if (const cudaError_t err =
          cudaEventRecord(static_cast<cudaEvent_t>(e.done), static_cast<cudaStream_t>(stream));
      err != cudaSuccess)
    return Internal(owner_ + ": recording a staging event: " + CudaMessage(err));
  e.recorded = true;
  return Status::Ok();
}

Status PinnedStaging::Wait() {
  const cudaError_t err = device_sync::SyncEvent(static_cast<cudaEvent_t>(entries_[current_].done));
  if (err != cudaSuccess) return Internal(owner_ + ": " + CudaMessage(err));
  return Status::Ok();
}

}  // namespace kvtier

#endif  // KVTIER_HAVE_CUDA
