#include "kernels/cpu/entropy.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvtier::kernels {
namespace {

// exp(x) for x <= 0 in straight-line double arithmetic that the compiler vectorises (std::exp
// is a scalar libm call: it was most of a layer's allocation time over 4K chunks at 128K).
// x = k ln2 + r with |r| <= ln2/2 (k by the round-to-nearest 1.5*2^52 trick, ln2 split in a
// high part exact in double and a low part), e^r by its Taylor series to r^13/13! (truncation
// < 1e-17 relative), 2^k from the exponent bits. About 1 ulp against std::exp; exactly 0 below
// -708 (where 2^k would leave the normal range), exactly 1 at 0, NaN for NaN.
inline double ExpNonPositive(double x) {
  constexpr double kLog2e = 1.4426950408889634, kLn2Hi = 0.693147180369123816490,
                   kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  // NaN clamps to -708 too, so that k below is a small integer (converting NaN to int64 is
  // undefined behaviour); a NaN x still returns NaN at the end.
  const double xc = x >= -708.0 ? x : -708.0;
  const double kr = xc * kLog2e + kRound;
  const double k = kr - kRound;
  const double r = (xc - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const int64_t bits = (static_cast<int64_t>(k) + 1023) << 52;  // 2^k, k in [-1022, 0]
  double two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return x < -708.0 ? 0.0 : (x == x ? p * two_k : x);
}

}  // namespace

double SoftmaxEntropy(const float* s, int n) {
  // Eq. 11: Theta = -sum_i p_i log p_i with p = softmax(s). With M = max_i s_i,
  // e_i = exp(s_i - M), Z = sum_i e_i: log p_i = (s_i - M) - log Z, so
  // Theta = log Z - sum_i e_i (s_i - M) / Z. Every e_i <= 1 and Z >= 1: no overflow.
  if (s == nullptr || n <= 0) return 0.0;
  double mx = s[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(s[i]));
  // Eight independent partial sums, so the loop vectorises without reassociation.
  constexpr int kLanes = 8;
  double z_acc[kLanes] = {}, ez_acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const double x = static_cast<double>(s[i + j]) - mx;
      const double e = ExpNonPositive(x);
      z_acc[j] += e;
      ez_acc[j] += e * x;
    }
  double z = 0.0, ez = 0.0;
  for (; i < n; ++i) {
    const double x = static_cast<double>(s[i]) - mx;
    const double e = ExpNonPositive(x);
    z += e;
    ez += e * x;
  }
  for (int j = 0; j < kLanes; ++j) {
    z += z_acc[j];
    ez += ez_acc[j];
  }
  const double h = std::log(z) - ez / z;
  return h > 0.0 ? h : 0.0;  // exact 0 for n == 1; never a tiny negative from rounding
}

KernelError SegmentEntropy(const EntropyParams& p) {
  if (p.n_segments < 0) return KernelError::kBadShape;
  if (p.n_segments == 0) return KernelError::kOk;
  if (p.offsets == nullptr || p.entropy == nullptr) return KernelError::kNullPointer;
  if (p.offsets[0] < 0) return KernelError::kBadShape;
  for (int i = 0; i < p.n_segments; ++i)
    if (p.offsets[i + 1] < p.offsets[i]) return KernelError::kBadShape;
  if (p.scores == nullptr && p.offsets[p.n_segments] > p.offsets[0]) return KernelError::kNullPointer;
  for (int i = 0; i < p.n_segments; ++i) {
    const float* s = p.scores == nullptr ? nullptr : p.scores + p.offsets[i];
    const int n = p.offsets[i + 1] - p.offsets[i];
    p.entropy[i] = SoftmaxEntropy(s, n);
    if (p.non_finite != nullptr) {
      int32_t bad = 0;
      for (int j = 0; j < n; ++j) bad += std::isfinite(s[j]) ? 0 : 1;
      p.non_finite[i] = bad;
    }
  }
  return KernelError::kOk;
}

}  // namespace kvtier::kernels
