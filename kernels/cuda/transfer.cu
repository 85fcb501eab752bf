// Chunk transfers host -> device: a gather kernel reading mapped pinned host memory, and
// cudaMemcpyBatchAsync. Plus the error bookkeeping of kernels/cuda. See kernels/cuda/kernels.h.
// host-sync-lint: async-copies-only (MemcpyBatchAsync's sources are the caller's pinned memory;
// the caller waits, and counts the wait: offload/device_sync.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvtier::kernels::cuda {
namespace {

thread_local cudaError_t g_last_error = cudaSuccess;
thread_local char g_last_message[256];

constexpr int kGatherThreads = 256;

// One block per copy. Aligned copies move 16 bytes per thread per step over PCIe/NVLink-C2C
// reads of the mapped host pages; anything else falls back to bytes.
__global__ void __launch_bounds__(kGatherThreads) GatherKernel(const GatherParams p, bool vec16) {
  const int i = blockIdx.x;
  const char* src = reinterpret_cast<const char*>(p.src[i]);
  char* dst = reinterpret_cast<char*>(p.dst[i]);
  if (vec16) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    const size_t n = p.bytes / 16;
    for (size_t j = threadIdx.x; j < n; j += kGatherThreads) d4[j] = s4[j];
  } else {
    for (size_t j = threadIdx.x; j < p.bytes; j += kGatherThreads) dst[j] = src[j];
  }
}

}  // namespace

void SetLastCudaError(cudaError_t e) { g_last_error = e; }

int LastCudaError() { return static_cast<int>(g_last_error); }

const char* LastCudaErrorString() {
  std::snprintf(g_last_message, sizeof g_last_message, "%s: %s", cudaGetErrorName(g_last_error),
                cudaGetErrorString(g_last_error));
  return g_last_message;
}

int DeviceCount() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    SetLastCudaError(e);
    (void)cudaGetLastError();  // a missing driver or device is an answer here, not a sticky error
    return 0;
  }
  return n;
}

KernelError LaunchGatherCopies(const GatherParams& p, Stream stream) {
  if (p.n_copies < 0) return KernelError::kBadShape;
  if (p.n_copies == 0 || p.bytes == 0) return KernelError::kOk;
  if (p.src == nullptr || p.dst == nullptr) return KernelError::kNullPointer;
  // The host cannot see the addresses (device-readable arrays); alignment of the size is what
  // it can check. Callers pass slot and slab addresses, which are 256- and 4096-byte aligned.
  const bool vec16 = p.bytes % 16 == 0;
  LaunchKernel(&GatherKernel, p.n_copies, kGatherThreads, 0, static_cast<cudaStream_t>(stream), p, vec16);
  return CheckLaunch();
}

KernelError MemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                             Stream stream) {
  if (count == 0) return KernelError::kOk;
  if (dsts == nullptr || srcs == nullptr || sizes == nullptr) return KernelError::kNullPointer;
  // The driver refuses a batch on the legacy default stream (cudaErrorInvalidValue, seen on an
  // H200 with CUDA 13.0): there, one cudaMemcpyAsync per copy gives the same stream order.
  if (stream == nullptr) {
    for (size_t i = 0; i < count; ++i)
      if (const KernelError e =
              CheckCall(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, nullptr));
          e != KernelError::kOk)
        return e;
    return KernelError::kOk;
  }
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the pinned slab may be written until this point
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  return CheckCall(cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_index, 1,
                                        static_cast<cudaStream_t>(stream)));
#else
  size_t fail_index = 0;
  return CheckCall(cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs),
                                        const_cast<size_t*>(sizes), count, &attr, &attr_index, 1, &fail_index,
                                        static_cast<cudaStream_t>(stream)));
#endif
#else
  // Older toolkits: one cudaMemcpyAsync per copy, same stream order.
  for (size_t i = 0; i < count; ++i)
    if (const KernelError e = CheckCall(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice,
                                                        static_cast<cudaStream_t>(stream)));
        e != KernelError::kOk)
      return e;
  return KernelError::kOk;
#endif
}

}  // namespace kvtier::kernels::cuda
