#include "kernels/cpu/forward.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>

#include "kernels/tbb_tsan.h"

namespace kvtier::kernels {
namespace {

// Dot product with 8 independent fp32 accumulators: the compiler may not reorder a single
// float sum, and the split lets it use vector registers. (Moved verbatim from the model's
// forward: this order defines the model's logits bit for bit.)
inline float Dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

KernelError Embedding(const EmbeddingParams& p) {
  if (p.m < 0 || p.d <= 0 || p.vocab <= 0) return KernelError::kBadShape;
  if (p.m == 0) return KernelError::kOk;
  if (p.tokens == nullptr || p.table == nullptr || p.out == nullptr) return KernelError::kNullPointer;
  for (int t = 0; t < p.m; ++t)  // all checked before any row is written
    if (p.tokens[t] < 0 || p.tokens[t] >= p.vocab) return KernelError::kBadShape;
  const size_t d = static_cast<size_t>(p.d);
  for (int t = 0; t < p.m; ++t)
    std::copy_n(p.table + static_cast<size_t>(p.tokens[t]) * d, d, p.out + static_cast<size_t>(t) * d);
  return KernelError::kOk;
}

KernelError RmsNorm(const RmsNormParams& p) {
  if (p.m < 0 || p.d <= 0 || !(p.eps > 0) || !std::isfinite(p.eps)) return KernelError::kBadShape;
  if (p.m == 0) return KernelError::kOk;
  if (p.x == nullptr || p.w == nullptr || p.out == nullptr) return KernelError::kNullPointer;
  const int d = p.d;
  for (int t = 0; t < p.m; ++t) {
    const float* xr = p.x + static_cast<size_t>(t) * d;
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / d + p.eps));
    float* o = p.out + static_cast<size_t>(t) * d;
    for (int i = 0; i < d; ++i) o[i] = xr[i] * r * p.w[i];
  }
  return KernelError::kOk;
}

KernelError Gemm(const GemmParams& p) {
  if (p.m < 0 || p.k <= 0 || p.n_out <= 0) return KernelError::kBadShape;
  if (p.m == 0) return KernelError::kOk;
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr) return KernelError::kNullPointer;
  const int m = p.m, in = p.k, out = p.n_out;
  auto rows = [&](int o0, int o1) {
    for (int o = o0; o < o1; ++o) {
      const float* wr = p.w + static_cast<size_t>(o) * in;
      for (int t = 0; t < m; ++t) {
        const float d = Dot(p.x + static_cast<size_t>(t) * in, wr, in);
        float& dst = p.y[static_cast<size_t>(t) * out + o];
        dst = p.accumulate ? dst + d : d;
      }
    }
  };
  // Output rows of W are split across threads once the product is big enough to pay for it;
  // each output element is one thread's, so the split does not change any bit.
  if (static_cast<int64_t>(m) * in * out < (1 << 18)) {
    rows(0, out);
    return KernelError::kOk;
  }
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(tbb::blocked_range<int>(0, out, 16),
                    fj.Body([&](const tbb::blocked_range<int>& r) { rows(r.begin(), r.end()); }));
  fj.Join();
  return KernelError::kOk;
}

KernelError SwiGlu(const SwiGluParams& p) {
  if (p.n == 0) return KernelError::kOk;
  if (p.gate == nullptr || p.up == nullptr) return KernelError::kNullPointer;
  for (size_t i = 0; i < p.n; ++i)
    p.gate[i] = p.gate[i] / (1.0f + std::exp(-p.gate[i])) * p.up[i];  // SiLU(g) * u
  return KernelError::kOk;
}

KernelError ConvertToStore(const ConvertToStoreParams& p) {
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return KernelError::kBadDType;
  if (p.n == 0) return KernelError::kOk;
  if (p.src == nullptr || p.dst == nullptr) return KernelError::kNullPointer;
  FromFloat(p.dtype, p.src, p.dst, p.n);
  return KernelError::kOk;
}

}  // namespace kvtier::kernels
