// The CUDA runtime's allocations, counted (offload/device_memory.h says what counts). Each
// wrapper does what the call it wraps does and returns the runtime's error; it counts only what
// the runtime gave (a failed allocation counts nothing). Free and FreeHost take the size and
// owner the allocation recorded, so a call site changes only the call's name.
// Builds with CUDA only (the toolkit or the emulated device: kernels/cuda/emulation).
#pragma once

#if !KVTIER_HAVE_CUDA
#error "offload/device_memory_cuda.h needs a build with CUDA (KVTIER_HAVE_CUDA)"
#endif

#include <cuda_runtime.h>

#include <cstddef>

#include "offload/device_memory.h"

namespace kvtier::device_memory {

/// cudaMalloc, counted as `owner`'s.
cudaError_t Malloc(void** p, size_t bytes, DeviceMemoryOwner owner);
template <class T>
cudaError_t Malloc(T** p, size_t bytes, DeviceMemoryOwner owner) {
  return Malloc(reinterpret_cast<void**>(p), bytes, owner);
}
/// cudaFree, uncounting what Malloc counted for `p`. A null `p` frees nothing and still calls
/// cudaFree(nullptr) (which makes the runtime initialise its context: InitDeviceRuntime).
cudaError_t Free(void* p);

/// Frees device memory `p` (from Malloc) once the work submitted to `stream` so far is done,
/// without a host wait: an event is recorded on `stream`, and `p` is freed (Free) by the first
/// FreeAfter or ReapFreed call that finds the event complete (cudaEventQuery), or by
/// FlushFreed. Until then it stays counted as its owner's. A null `p` is a no-op. On an error
/// recording the event, `p` is freed after a wait for `stream` (counted).
cudaError_t FreeAfter(void* p, cudaStream_t stream);
/// Frees what FreeAfter deferred whose work is done; no wait.
void ReapFreed();
/// Frees everything FreeAfter deferred, waiting for each event not yet complete (counted).
void FlushFreed();

/// cudaHostAlloc (pinned host memory), counted.
cudaError_t HostAlloc(void** p, size_t bytes, unsigned flags);
template <class T>
cudaError_t HostAlloc(T** p, size_t bytes, unsigned flags) {
  return HostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}
/// cudaFreeHost, uncounting what HostAlloc counted for `p`.
cudaError_t FreeHost(void* p);

}  // namespace kvtier::device_memory
