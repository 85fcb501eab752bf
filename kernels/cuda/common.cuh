// Helpers shared by the .cu files of kernels/cuda (not a public header).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cpu/attention.h"

namespace kvtier::kernels::cuda {

/// Records a CUDA error for LastCudaError (thread-local).
void SetLastCudaError(cudaError_t e);

/// After a launch: kOk, or kDeviceError with the error recorded.
inline KernelError CheckLaunch() {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KernelError::kOk;
  SetLastCudaError(e);
  return KernelError::kDeviceError;
}

/// kernel<<<grid, block, smem, stream>>>(args...). Every launch of kernels/cuda goes through here:
/// the triple-chevron launch under nvcc, and in the emulation build (KVTIER_GPU_EMULATION) the
/// same kernel on the HIP CPU runtime (kernels/cuda/emulation), which a host compiler can parse.
template <typename... Params, typename... Args>
inline void LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         Args... args) {
#if defined(KVTIER_GPU_EMULATION)
  kvtier_emu::Launch(kernel, grid, block, smem, stream, args...);
#else
  // clang-format parses a .cuh as C++ and would split the launch's >>>.
  // clang-format off
  kernel<<<grid, block, smem, stream>>>(args...);
  // clang-format on
#endif
}

inline KernelError CheckCall(cudaError_t e) {
  if (e == cudaSuccess) return KernelError::kOk;
  SetLastCudaError(e);
  return KernelError::kDeviceError;
}

__device__ __forceinline__ float LoadAsFloat(const float* p) { return *p; }
__device__ __forceinline__ float LoadAsFloat(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float LoadAsFloat(const __nv_bfloat16* p) { return __bfloat162float(*p); }

/// Sum over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ double WarpSumD(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace kvtier::kernels::cuda
