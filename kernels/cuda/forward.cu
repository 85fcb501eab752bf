// The model's non-attention forward on the device: embedding lookup, RMSNorm, RoPE, SwiGLU,
// and the projections as a cuBLAS GEMM. Twins: kernels/cpu/forward.h and kernels/cpu/rope.h.
// See kernels/cuda/kernels.h.
// host-sync-lint: async-copies-only (f32 ConvertToStore is a device-to-device copy on the
// caller's stream: no host wait; the waits are the callers', counted in offload/device_sync.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/store_convert.h"

namespace kvtier::kernels::cuda {
namespace {

thread_local cublasStatus_t g_last_blas = CUBLAS_STATUS_SUCCESS;
thread_local char g_last_blas_message[256];

KernelError CheckBlas(cublasStatus_t st) {
  if (st == CUBLAS_STATUS_SUCCESS) return KernelError::kOk;
  g_last_blas = st;
  return KernelError::kDeviceError;
}

constexpr int kRowThreads = 256;

// One block per token. A token outside [0, vocab) (the host cannot see the device array; the
// twin rejects it) fills its row with NaN, so it shows in the logits instead of passing silently.
__global__ void __launch_bounds__(kRowThreads) EmbeddingKernel(const EmbeddingParams p) {
  const int t = blockIdx.x;
  const int32_t tok = p.tokens[t];
  float* o = p.out + static_cast<size_t>(t) * p.d;
  if (tok < 0 || tok >= p.vocab) {
    for (int i = threadIdx.x; i < p.d; i += kRowThreads) o[i] = __int_as_float(0x7fc00000);
    return;
  }
  const float* src = p.table + static_cast<size_t>(tok) * p.d;
  for (int i = threadIdx.x; i < p.d; i += kRowThreads) o[i] = src[i];
}

// One block per row: the sum of squares in double as the twin (its order differs: strided
// per thread, then warps, then the block; double makes that invisible after the fp32 cast
// in all but rare last-bit cases). The products are rounded as the twin's (x * r) * w, with
// __fmul_rn so no FMA contraction changes them.
__global__ void __launch_bounds__(kRowThreads) RmsNormKernel(const RmsNormParams p) {
  __shared__ double warp_sums[kRowThreads / 32];
  __shared__ float r_shared;
  const int t = blockIdx.x;
  const float* xr = p.x + static_cast<size_t>(t) * p.d;
  double ss = 0.0;
  for (int i = threadIdx.x; i < p.d; i += kRowThreads) ss += static_cast<double>(xr[i]) * xr[i];
  ss = WarpSumD(ss);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int w = 0; w < kRowThreads / 32; ++w) s += warp_sums[w];
    r_shared = static_cast<float>(1.0 / sqrt(s / p.d + p.eps));
  }
  __syncthreads();
  const float r = r_shared;
  float* o = p.out + static_cast<size_t>(t) * p.d;
  for (int i = threadIdx.x; i < p.d; i += kRowThreads) o[i] = __fmul_rn(__fmul_rn(xr[i], r), p.w[i]);
}

// One block per token, a thread per (head, i < head_dim/2). Angles in double and cos/sin
// rounded to fp32 once, as the twin; the rotation rounded term by term (no FMA).
__global__ void __launch_bounds__(kRowThreads) RopeKernel(const RopeParams p) {
  const int t = blockIdx.x;
  const int half = p.head_dim / 2;
  const double pos = static_cast<double>(p.positions[t]);
  for (int j = threadIdx.x; j < p.heads * half; j += kRowThreads) {
    const int h = j / half, i = j % half;
    const double a = pos * p.inv_freq[i];
    const float c = static_cast<float>(cos(a)), s = static_cast<float>(sin(a));
    float* v = p.x + (static_cast<size_t>(t) * p.heads + h) * p.head_dim;
    const float x1 = v[i], x2 = v[i + half];
    v[i] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(-x2, s));
    v[i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
  }
}

// Elementwise silu(g) * u; expf (2 ulp) where the twin has std::exp.
__global__ void SwiGluKernel(const SwiGluParams p) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < p.n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float g = p.gate[i];
    p.gate[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), p.up[i]);
  }
}

// fp32 -> f16 or bf16 through the bit conversions the host test checks against FromFloat.
__global__ void ConvertToStoreKernel(size_t n, bool to_f16, const float* src, uint16_t* dst) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint32_t u = __float_as_uint(src[i]);
    dst[i] = to_f16 ? F16BitsFromF32Bits(u) : Bf16BitsFromF32Bits(u);
  }
}

}  // namespace

int LastBlasStatus() { return static_cast<int>(g_last_blas); }

const char* LastBlasStatusString() {
  std::snprintf(g_last_blas_message, sizeof g_last_blas_message, "%s: %s", cublasGetStatusName(g_last_blas),
                cublasGetStatusString(g_last_blas));
  return g_last_blas_message;
}

KernelError CreateBlasHandle(BlasHandle* handle) {
  if (handle == nullptr) return KernelError::kNullPointer;
  *handle = nullptr;
  cublasHandle_t h = nullptr;
  if (const KernelError e = CheckBlas(cublasCreate(&h)); e != KernelError::kOk) return e;
  // Pedantic: no TF32 or other reduced-precision path, whatever NVIDIA_TF32_OVERRIDE says;
  // the GEMM must match its fp32 twin to 1e-5.
  if (const KernelError e = CheckBlas(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH)); e != KernelError::kOk) {
    cublasDestroy(h);
    return e;
  }
  *handle = h;
  return KernelError::kOk;
}

void DestroyBlasHandle(BlasHandle handle) {
  if (handle != nullptr) cublasDestroy(static_cast<cublasHandle_t>(handle));
}

KernelError LaunchEmbedding(const EmbeddingParams& p, Stream s) {
  if (p.m < 0 || p.d <= 0 || p.vocab <= 0) return KernelError::kBadShape;
  if (p.m == 0) return KernelError::kOk;
  if (p.tokens == nullptr || p.table == nullptr || p.out == nullptr) return KernelError::kNullPointer;
  LaunchKernel(&EmbeddingKernel, p.m, kRowThreads, 0, static_cast<cudaStream_t>(s), p);
  return CheckLaunch();
}

KernelError LaunchRmsNorm(const RmsNormParams& p, Stream s) {
  if (p.m < 0 || p.d <= 0 || !(p.eps > 0) || !std::isfinite(p.eps)) return KernelError::kBadShape;
  if (p.m == 0) return KernelError::kOk;
  if (p.x == nullptr || p.w == nullptr || p.out == nullptr) return KernelError::kNullPointer;
  LaunchKernel(&RmsNormKernel, p.m, kRowThreads, 0, static_cast<cudaStream_t>(s), p);
  return CheckLaunch();
}

KernelError LaunchRope(const RopeParams& p, Stream s) {
  if (p.m < 0 || p.heads <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0) return KernelError::kBadShape;
  if (p.m == 0) return KernelError::kOk;
  if (p.x == nullptr || p.positions == nullptr || p.inv_freq == nullptr) return KernelError::kNullPointer;
  LaunchKernel(&RopeKernel, p.m, kRowThreads, 0, static_cast<cudaStream_t>(s), p);
  return CheckLaunch();
}

KernelError LaunchSwiGlu(const SwiGluParams& p, Stream s) {
  if (p.n == 0) return KernelError::kOk;
  if (p.gate == nullptr || p.up == nullptr) return KernelError::kNullPointer;
  constexpr int kThreads = 256;
  const size_t want = (p.n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65535 ? want : 65535);  // grid-stride past that
  LaunchKernel(&SwiGluKernel, blocks, kThreads, 0, static_cast<cudaStream_t>(s), p);
  return CheckLaunch();
}

size_t GemmWorkspaceBytes() { return size_t{32} << 20; }

KernelError LaunchGemm(const GemmParams& p, BlasHandle handle, void* workspace, size_t workspace_bytes,
                       Stream s) {
  if (p.m < 0 || p.k <= 0 || p.n_out <= 0) return KernelError::kBadShape;
  if (p.m == 0) return KernelError::kOk;
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr || handle == nullptr)
    return KernelError::kNullPointer;
  if (workspace == nullptr || workspace_bytes < GemmWorkspaceBytes()) return KernelError::kWorkspace;
  cublasHandle_t h = static_cast<cublasHandle_t>(handle);
  if (const KernelError e = CheckBlas(cublasSetStream(h, static_cast<cudaStream_t>(s)));
      e != KernelError::kOk)
    return e;
  // The caller's workspace, so that cuBLAS allocates nothing here (and a graph capture works).
  if (const KernelError e = CheckBlas(cublasSetWorkspace(h, workspace, workspace_bytes));
      e != KernelError::kOk)
    return e;
  // Row-major y[m, n] = x[m, k] . W^T with W [n, k] is, column-major, y^T[n, m] = W^T' . x^T
  // where W's buffer read column-major is a [k, n] matrix (so op T) and x's is [k, m] (op N).
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  return CheckBlas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p.n_out, p.m, p.k, &alpha, p.w, CUDA_R_32F, p.k,
                                p.x, CUDA_R_32F, p.k, &beta, p.y, CUDA_R_32F, p.n_out,
                                CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
}

KernelError LaunchConvertToStore(const ConvertToStoreParams& p, Stream s) {
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return KernelError::kBadDType;
  if (p.n == 0) return KernelError::kOk;
  if (p.src == nullptr || p.dst == nullptr) return KernelError::kNullPointer;
  if (p.dtype == DType::kF32)
    return CheckCall(cudaMemcpyAsync(p.dst, p.src, p.n * sizeof(float), cudaMemcpyDeviceToDevice,
                                     static_cast<cudaStream_t>(s)));
  constexpr int kThreads = 256;
  const size_t want = (p.n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65535 ? want : 65535);  // grid-stride past that
  LaunchKernel(&ConvertToStoreKernel, blocks, kThreads, 0, static_cast<cudaStream_t>(s), p.n,
               p.dtype == DType::kF16, p.src, static_cast<uint16_t*>(p.dst));
  return CheckLaunch();
}

}  // namespace kvtier::kernels::cuda
