// CPU twins of the model's non-attention forward: embedding lookup, RMSNorm, the
// projections as a GEMM (with the residual add folded in as accumulate), and SwiGLU. RoPE's
// twin is kernels/cpu/rope.h. integration/model/llama.cc runs its forward through exactly
// these functions, so the CPU forward and the twins that define the CUDA launchers'
// meaning (kernels/cuda/kernels.h) are one code.
//
// Like the other twins: POD params, every parameter validated first, a KernelError returned,
// nothing thrown, only the caller's outputs written. All fp32, row-major.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/attention.h"  // KernelError
#include "kernels/dtype.h"

namespace kvtier::kernels {

/// x[t, :] = table[tokens[t], :]  (table [vocab, d]).
struct EmbeddingParams {
  int m = 0;                        ///< tokens, >= 0
  int d = 0;                        ///< row width, > 0
  int vocab = 0;                    ///< table rows, > 0
  const int32_t* tokens = nullptr;  ///< [m], each in [0, vocab) (kBadShape otherwise, nothing written)
  const float* table = nullptr;     ///< [vocab, d]
  float* out = nullptr;             ///< [m, d]
};
KernelError Embedding(const EmbeddingParams& p);

/// out[t, i] = x[t, i] * r_t * w[i], r_t = (float)(1 / sqrt(sum_i x[t,i]^2 / d + eps)),
/// the sum of squares in double. out may not alias x.
struct RmsNormParams {
  int m = 0;                 ///< rows, >= 0
  int d = 0;                 ///< row width, > 0
  double eps = 0.0;          ///< > 0 and finite
  const float* x = nullptr;  ///< [m, d]
  const float* w = nullptr;  ///< [d]
  float* out = nullptr;      ///< [m, d]
};
KernelError RmsNorm(const RmsNormParams& p);

/// y[m, n_out] (= or, with accumulate, +=) x[m, k] . W^T, W row-major [n_out, k]: y = W x per
/// token, the layout of the model's projection weights. accumulate is the residual add
/// (x_residual += W_o att). The CPU twin's bits, which the model's logits are defined by: each
/// product x[t,i] w[o,i] rounded to fp32 (never fused into an add), summed in 8 fp32
/// accumulators acc[i % 8] in order of i over the first k - k % 8 elements, then
/// s = ((acc0 + acc1) + (acc2 + acc3)) + ((acc4 + acc5) + (acc6 + acc7)), then the k % 8
/// trailing products added to s in order, then y = s or y + s. The twin computes tiles of
/// outputs at once and splits output rows across threads; neither changes a bit. The CUDA
/// launcher (cuBLAS) sums in its own order and matches to fp32 rounding.
struct GemmParams {
  int m = 0;                 ///< rows of x and y, >= 0
  int k = 0;                 ///< inner size, > 0
  int n_out = 0;             ///< rows of W, > 0
  const float* x = nullptr;  ///< [m, k]
  const float* w = nullptr;  ///< [n_out, k]
  float* y = nullptr;        ///< [m, n_out]; must not overlap x or w
  bool accumulate = false;   ///< y += instead of y =
};
KernelError Gemm(const GemmParams& p);

/// gate[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], i < n, in place.
struct SwiGluParams {
  size_t n = 0;               ///< elements (m * ffn_hidden)
  float* gate = nullptr;      ///< [n], in and out
  const float* up = nullptr;  ///< [n]
};
KernelError SwiGlu(const SwiGluParams& p);

/// dst[i] = src[i] converted from fp32 to the store's dtype: exactly kvtier::FromFloat
/// (kernels/dtype.h): f32 copied, f16 and bf16 rounded to nearest even, overflow to inf
/// (f16), subnormals exact, a NaN stays a quiet NaN (f16: sign | 0x7e00; bf16: the upper
/// half with the quiet bit set). This twin defines the bits of the device conversion the
/// model's device forward runs before it appends K/V (kernels/cuda: LaunchConvertToStore).
struct ConvertToStoreParams {
  size_t n = 0;                ///< elements
  DType dtype = DType::kF32;   ///< kF32, kF16 or kBF16 (kBadDType otherwise)
  const float* src = nullptr;  ///< [n] fp32
  void* dst = nullptr;         ///< [n] elements of dtype; must not overlap src
};
KernelError ConvertToStore(const ConvertToStoreParams& p);

}  // namespace kvtier::kernels
