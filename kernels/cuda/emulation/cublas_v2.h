// Emulation build only: a CPU STAND-IN for the part of cuBLAS kvtier calls (kernels/cuda/forward.cu),
// not cuBLAS. Handles, stream, workspace and math mode behave as cuBLAS documents them; cublasGemmEx
// takes fp32 operands with an fp32 compute type (what LaunchGemm passes) and anything else is
// CUBLAS_STATUS_NOT_SUPPORTED. The product is enqueued on the handle's stream as a kernel of one
// single-thread block per output column (column-major), each summing over k in order with fmaf:
// cuBLAS's own order and kernels are not reproduced, only its result within rounding.
#pragma once
#include <cstdint>

#include "kernels/cuda/emulation/hip_cpu_compat.h"

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };
enum cublasMath_t { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TF32_TENSOR_OP_MATH = 3, CUBLAS_PEDANTIC_MATH = 2 };
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_PEDANTIC = 69 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };

struct cublasContext {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};
using cublasHandle_t = cublasContext*;

inline cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  (void)cudaStreamSynchronize(handle->stream);  // cuBLAS: destroy waits for the handle's work
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes > 0 && workspace == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  handle->workspace = workspace;
  handle->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}
inline const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
inline const char* cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "success (CPU stand-in for cuBLAS)" : "error (CPU stand-in for cuBLAS)";
}

namespace kvtier_emu {
// Column j of C = alpha * op(A) . op(B) + beta * C, column-major, one single-thread block per j.
__global__ void GemmColumnKernel(bool a_t, bool b_t, int m, int k, float alpha, const float* a, int lda,
                                 const float* b, int ldb, float beta, float* c, int ldc) {
  const int j = static_cast<int>(blockIdx.x);
  for (int i = 0; i < m; ++i) {
    float acc = 0.0f;
    for (int l = 0; l < k; ++l) {
      const float av = a_t ? a[static_cast<size_t>(i) * lda + l] : a[static_cast<size_t>(l) * lda + i];
      const float bv = b_t ? b[static_cast<size_t>(l) * ldb + j] : b[static_cast<size_t>(j) * ldb + l];
      acc = std::fma(av, bv, acc);
    }
    float& out = c[static_cast<size_t>(j) * ldc + i];
    out = beta == 0.0f ? alpha * acc : alpha * acc + beta * out;  // beta 0: C is not read (cuBLAS)
  }
}
}  // namespace kvtier_emu

inline cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                   int m, int n, int k, const void* alpha, const void* a,
                                   cudaDataType_t a_type, int lda, const void* b, cudaDataType_t b_type,
                                   int ldb, const void* beta, void* c, cudaDataType_t c_type, int ldc,
                                   cublasComputeType_t compute, cublasGemmAlgo_t /*algo*/) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (a_type != CUDA_R_32F || b_type != CUDA_R_32F || c_type != CUDA_R_32F ||
      (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC) || transa == CUBLAS_OP_C ||
      transb == CUBLAS_OP_C)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m < 0 || n < 0 || k < 0 || alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const bool a_t = transa == CUBLAS_OP_T, b_t = transb == CUBLAS_OP_T;
  if (lda < std::max(1, a_t ? k : m) || ldb < std::max(1, b_t ? n : k) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  kvtier_emu::Launch(&kvtier_emu::GemmColumnKernel, dim3(static_cast<unsigned>(n)), dim3(1), 0,
                     handle->stream, a_t, b_t, m, k, *static_cast<const float*>(alpha),
                     static_cast<const float*>(a), lda, static_cast<const float*>(b), ldb,
                     *static_cast<const float*>(beta), static_cast<float*>(c), ldc);
  return CUBLAS_STATUS_SUCCESS;
}
