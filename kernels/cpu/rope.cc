#include "kernels/cpu/rope.h"

#include <cmath>

namespace kvtier::kernels {

std::vector<double> RopeInvFreq(int head_dim, double theta) {
  std::vector<double> inv_freq(static_cast<size_t>(head_dim / 2));
  for (int i = 0; i < head_dim / 2; ++i)
    inv_freq[static_cast<size_t>(i)] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
  return inv_freq;
}

void Rope(float* x, int m, int heads, int head_dim, const int64_t* positions, const double* inv_freq) {
  const int half = head_dim / 2;
  std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int t = 0; t < m; ++t) {
    for (int i = 0; i < half; ++i) {
      const double a = static_cast<double>(positions[t]) * inv_freq[i];
      c[static_cast<size_t>(i)] = static_cast<float>(std::cos(a));
      s[static_cast<size_t>(i)] = static_cast<float>(std::sin(a));
    }
    for (int h = 0; h < heads; ++h) {
      float* v = x + (static_cast<size_t>(t) * heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[static_cast<size_t>(i)] + (-x2) * s[static_cast<size_t>(i)];
        v[i + half] = x2 * c[static_cast<size_t>(i)] + x1 * s[static_cast<size_t>(i)];
      }
    }
  }
}

}  // namespace kvtier::kernels
