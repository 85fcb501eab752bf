// Helpers shared by the .cu files of kernels/cuda (not a public header).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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
