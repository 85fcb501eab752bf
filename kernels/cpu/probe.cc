#include "kernels/cpu/probe.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier::kernels {

void MeanPoolProbe(const ProbeShape& s, const float* q, int m, float* probe) {
  const int G = s.q_heads / s.kv_heads, D = s.head_dim;
  std::fill_n(probe, static_cast<size_t>(s.kv_heads) * D, 0.0f);
  const float w = 1.0f / static_cast<float>(m * G);
  for (int i = 0; i < m; ++i)
    for (int h = 0; h < s.q_heads; ++h) {
      const float* src = q + (static_cast<size_t>(i) * s.q_heads + h) * D;
      float* dst = probe + static_cast<size_t>(h / G) * D;
      for (int d = 0; d < D; ++d) dst[d] += w * src[d];
    }
}

void CountNonFinite(const float* x, int32_t n, int32_t* count, int32_t* first) {
  int32_t c = 0, f = INT32_MAX;
  for (int32_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) {
      if (c == 0) f = i;
      ++c;
    }
  *count = c;
  *first = f;
}

void ActMergeWindow(const ProbeShape& s, const float* q, int m, int64_t n_old, double* mean_all,
                    double* m2_all) {
  const int Hq = s.q_heads, D = s.head_dim;
  const size_t row = static_cast<size_t>(Hq) * D;  // stride between consecutive queries of one head
  const int64_t n_all = n_old + m;
  std::vector<double> wmean(D), wm2(D);
  const double fb = static_cast<double>(m) / static_cast<double>(n_all);
  const double fab = static_cast<double>(n_old) * static_cast<double>(m) / static_cast<double>(n_all);
  for (int h = 0; h < Hq; ++h) {
    const float* qh = q + static_cast<size_t>(h) * D;
    std::fill(wmean.begin(), wmean.end(), 0.0);
    std::fill(wm2.begin(), wm2.end(), 0.0);
    for (int j = 0; j < m; ++j)
      for (int d = 0; d < D; ++d) wmean[d] += qh[j * row + d];
    for (int d = 0; d < D; ++d) wmean[d] /= m;
    for (int j = 0; j < m; ++j)
      for (int d = 0; d < D; ++d) {
        const double dev = qh[j * row + d] - wmean[d];
        wm2[d] += dev * dev;
      }
    double* mean = mean_all + static_cast<size_t>(h) * D;
    double* m2 = m2_all + static_cast<size_t>(h) * D;
    for (int d = 0; d < D; ++d) {
      const double delta = wmean[d] - mean[d];
      mean[d] += delta * fb;
      m2[d] += wm2[d] + delta * delta * fab;
    }
  }
}

void ActWeightedProbe(const ProbeShape& s, const float* q, int m, const double* mean_all,
                      const double* m2_all, int64_t count, double eps, float* probe) {
  // Edge case: Eq. 8's denominator mt - 1 is 0 and sigma^2 undefined: mean pooling.
  if (count < 2) {
    MeanPoolProbe(s, q, m, probe);
    return;
  }
  const int Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim, G = Hq / Hkv;
  const size_t row = static_cast<size_t>(Hq) * D;
  std::vector<double> var(D), l1(m), acc(static_cast<size_t>(Hkv) * D, 0.0);
  for (int h = 0; h < Hq; ++h) {
    const float* qh = q + static_cast<size_t>(h) * D;
    const double* mean = mean_all + static_cast<size_t>(h) * D;
    const double* m2 = m2_all + static_cast<size_t>(h) * D;
    // Eq. 8: sigma^2 per dimension (a vector, like z-bar).
    for (int d = 0; d < D; ++d) var[d] = ActVariance(m2[d], count);
    // Eq. 7: phi_j = (q_j - z-bar)^2 / sigma^2 elementwise; ||phi_j||_1 = sum_d phi_jd (phi >= 0).
    double total = 0.0;  // ||Phi||_1 = sum_j ||phi_j||_1
    for (int j = 0; j < m; ++j) {
      double sum = 0.0;
      for (int d = 0; d < D; ++d) {
        if (!(var[d] > eps)) continue;  // sigma^2 <= eps: phi_jd = 0 instead of inf/NaN
        const double dev = qh[j * row + d] - mean[d];
        sum += dev * dev / var[d];
      }
      l1[j] = sum;
      total += sum;
    }
    // Eq. 9: weight_j = ||phi_j||_1 / ||Phi||_1; ||Phi||_1 == 0 -> uniform 1/m (mean pooling).
    const bool uniform = !(total > 0.0);
    double* dst = acc.data() + static_cast<size_t>(h / G) * D;
    for (int j = 0; j < m; ++j) {
      const double w = (uniform ? 1.0 / m : l1[j] / total) / G;
      if (w == 0.0) continue;
      for (int d = 0; d < D; ++d) dst[d] += w * qh[j * row + d];
    }
  }
  for (size_t i = 0; i < acc.size(); ++i) probe[i] = static_cast<float>(acc[i]);
}

}  // namespace kvtier::kernels
