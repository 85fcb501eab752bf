#include "kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvtier::kernels {
namespace {

// cos and sin of position * inv_freq[i], rounded to fp32: the one definition of the angles,
// for the table and for positions outside it alike.
inline void Angles(int64_t position, const double* inv_freq, int half, float* c, float* s) {
  for (int i = 0; i < half; ++i) {
    const double a = static_cast<double>(position) * inv_freq[i];
    c[i] = static_cast<float>(std::cos(a));
    s[i] = static_cast<float>(std::sin(a));
  }
}

// The angles of positions [0, n) for one inv_freq, kept per thread: the session rotates the
// keys it attends at every layer step, and with InfLLM positions those positions (the
// sinks, the local window, the retrieved chunks at the memory position) repeat step after
// step, so computing each (position, frequency) once saves almost every cos and sin. The
// entries are the very floats Angles gives, so a rotation reads the same bits either way.
// At most kTableBytes per thread; positions past the table's reach are computed each time.
constexpr size_t kTableBytes = size_t{4} << 20;

struct AngleTable {
  std::vector<double> inv_freq;  // [half] the frequencies the entries were computed for
  std::vector<float> cs;         // [n][2 * half]: cos of row p at 2 half p, then its sin
  int64_t n = 0;
};

thread_local AngleTable tls_angles;

// Row `position` of the calling thread's table (cos, then sin; half entries each), or null
// when the position lies past what the table may hold.
const float* TableRow(int64_t position, const double* inv_freq, int half) {
  AngleTable& t = tls_angles;
  const int64_t cap = static_cast<int64_t>(kTableBytes / (2 * sizeof(float) * static_cast<size_t>(half)));
  if (position < 0 || position >= cap) return nullptr;
  if (t.inv_freq.size() != static_cast<size_t>(half) ||
      std::memcmp(t.inv_freq.data(), inv_freq, sizeof(double) * static_cast<size_t>(half)) != 0) {
    t.inv_freq.assign(inv_freq, inv_freq + half);
    t.cs.clear();
    t.n = 0;
  }
  if (position >= t.n) {
    const int64_t n = std::min(cap, std::max(position + 1, 2 * t.n));
    t.cs.resize(static_cast<size_t>(n) * 2 * static_cast<size_t>(half));
    for (int64_t p = t.n; p < n; ++p) {
      float* row = t.cs.data() + static_cast<size_t>(p) * 2 * static_cast<size_t>(half);
      Angles(p, inv_freq, half, row, row + half);
    }
    t.n = n;
  }
  return t.cs.data() + static_cast<size_t>(position) * 2 * static_cast<size_t>(half);
}

}  // namespace

std::vector<double> RopeInvFreq(int head_dim, double theta) {
  std::vector<double> inv_freq(static_cast<size_t>(head_dim / 2));
  for (int i = 0; i < head_dim / 2; ++i)
    inv_freq[static_cast<size_t>(i)] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
  return inv_freq;
}

void Rope(float* x, int m, int heads, int head_dim, const int64_t* positions, const double* inv_freq) {
  const int half = head_dim / 2;
  std::vector<float> own(2 * static_cast<size_t>(half));
  for (int t = 0; t < m; ++t) {
    const float* row = TableRow(positions[t], inv_freq, half);
    if (row == nullptr) {
      Angles(positions[t], inv_freq, half, own.data(), own.data() + half);
      row = own.data();
    }
    const float* c = row;
    const float* s = row + half;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (static_cast<size_t>(t) * heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] + (-x2) * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }
}

}  // namespace kvtier::kernels
