// The CUDA runtime's blocking calls, counted (offload/device_sync.h says what counts). Each
// wrapper counts once per call, before it calls the runtime (a call that fails was a wait all
// the same), and returns the runtime's error. They do what the call they wrap does, nothing more.
// Builds with CUDA only (the toolkit or the emulated device: kernels/cuda/emulation).
#pragma once

#if !KVTIER_HAVE_CUDA
#error "offload/device_sync_cuda.h needs a build with CUDA (KVTIER_HAVE_CUDA)"
#endif

#include <cuda_runtime.h>

#include <cstddef>

#include "offload/device_memory_cuda.h"  // the counted allocations come with the counted waits
#include "offload/device_sync.h"

namespace kvtier::device_sync {

/// Where the host side of an asynchronous copy lives, as its caller knows it. kPageable also
/// stands for "not known to be pinned" (an engine's buffer, a std::vector): the runtime may
/// then copy synchronously.
enum class HostMemory { kPinned, kPageable };

/// cudaStreamSynchronize (kStream).
cudaError_t SyncStream(cudaStream_t stream);
/// cudaEventSynchronize (kEvent).
cudaError_t SyncEvent(cudaEvent_t event);
/// cudaDeviceSynchronize (kDevice).
cudaError_t SyncDevice();
/// cudaMemcpy (kBlockingCopy): complete on return.
cudaError_t CopyBlocking(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
/// cudaMemcpyAsync on `stream`. Counts one kPageableCopy when the copy has a host side
/// (any kind but cudaMemcpyDeviceToDevice) and `host` is kPageable; otherwise counts nothing.
cudaError_t CopyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream,
                      HostMemory host);

}  // namespace kvtier::device_sync
