#include "retrieval/chunk_groups.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvtier {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// 16 times the fp32 unit roundoff (2^-24): the margins' factor.
constexpr double kMarginUnit = 1.0 / 1048576.0;

// The smallest float >= x (NaN stays NaN).
float RoundUp(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

// Centre (rounded to fp32) and radius (from that centre, rounded up) of n vectors of D doubles.
void Ball(const std::vector<double>& v, size_t n, size_t D, float* centre, float* radius) {
  std::vector<double> mean(D, 0.0);
  for (size_t i = 0; i < n; ++i)
    for (size_t d = 0; d < D; ++d) mean[d] += v[i * D + d];
  for (size_t d = 0; d < D; ++d) centre[d] = static_cast<float>(mean[d] / static_cast<double>(n));
  double r2 = 0.0;
  for (size_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (size_t d = 0; d < D; ++d) {
      const double e = v[i * D + d] - static_cast<double>(centre[d]);
      s += e * e;
    }
    r2 = std::max(r2, s);
  }
  // The double sums and sqrt are within a few 2^-53 of the real distance: 1e-12 covers them.
  *radius = RoundUp(std::sqrt(r2) * (1.0 + 1e-12));
}

}  // namespace

ChunkGroupBounds::ChunkGroupBounds(int kv_heads, int head_dim, int repr, int group_rows)
    : heads_(kv_heads), dim_(head_dim), repr_(repr), group_rows_(group_rows) {
  raw_centre_.resize(static_cast<size_t>(heads_));
  unit_centre_.resize(static_cast<size_t>(heads_));
  raw_radius_.resize(static_cast<size_t>(heads_));
  unit_radius_.resize(static_cast<size_t>(heads_));
}

void ChunkGroupBounds::Update(size_t rows, size_t first_changed, const RowKeys& keys) {
  const size_t G = static_cast<size_t>(group_rows_), D = static_cast<size_t>(dim_),
               R = static_cast<size_t>(repr_);
  const size_t groups = (rows + G - 1) / G, from = std::min(first_changed / G, groups);
  groups_ = groups;
  for (int h = 0; h < heads_; ++h) {
    raw_centre_[h].resize(groups * D);
    unit_centre_[h].resize(groups * D);
    raw_radius_[h].resize(groups);
    unit_radius_[h].resize(groups);
  }
  std::vector<float> k(R * D), inv(R);
  std::vector<double> raw(G * R * D), unit(G * R * D);
  for (size_t g = from; g < groups; ++g) {
    const size_t row0 = g * G, n = std::min(rows, row0 + G) - row0;
    for (int h = 0; h < heads_; ++h) {
      bool finite = true;
      for (size_t i = 0; i < n; ++i) {
        keys(h, row0 + i, k.data(), inv.data());
        for (size_t r = 0; r < R; ++r) {
          finite = finite && std::isfinite(inv[r]);
          for (size_t d = 0; d < D; ++d) {
            const double x = k[r * D + d];
            finite = finite && std::isfinite(x);
            raw[(i * R + r) * D + d] = x;
            unit[(i * R + r) * D + d] = x * static_cast<double>(inv[r]);  // exact in double
          }
        }
      }
      float* rc = raw_centre_[h].data() + g * D;
      float* uc = unit_centre_[h].data() + g * D;
      if (!finite) {  // never skipped
        std::fill_n(rc, D, 0.0f);
        std::fill_n(uc, D, 0.0f);
        raw_radius_[h][g] = unit_radius_[h][g] = std::numeric_limits<float>::infinity();
        continue;
      }
      Ball(raw, n * R, D, rc, &raw_radius_[h][g]);
      Ball(unit, n * R, D, uc, &unit_radius_[h][g]);
    }
  }
}

void ChunkGroupBounds::UpperBounds(const float* probe, kernels::HeadFold fold, ChunkRank rank,
                                   std::vector<float>* upper) const {
  const size_t D = static_cast<size_t>(dim_);
  const bool cosine = rank == ChunkRank::kCosine;
  const double share = cosine ? static_cast<double>(fold.cos_share) : 1.0;
  std::vector<double> acc(groups_, fold.max ? -kInf : 0.0), magnitude(groups_, 0.0);
  for (int h = 0; h < heads_; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    double pn2 = 0.0;
    for (size_t d = 0; d < D; ++d) pn2 += static_cast<double>(p[d]) * p[d];
    const double pn = std::sqrt(pn2);
    // The exact pass's 1/|p| (0 for a zero probe, and where |p|^2 underflows in fp32: every
    // cosine is then 0).
    const bool zero_cosines = kernels::InverseNorm(p, dim_) == 0.0f;
    const std::vector<float>& centres = cosine ? unit_centre_[h] : raw_centre_[h];
    const std::vector<float>& radii = cosine ? unit_radius_[h] : raw_radius_[h];
    for (size_t g = 0; g < groups_; ++g) {
      const float* c = centres.data() + g * D;
      const double r = radii[g];
      double pc = 0.0, cn2 = 0.0;
      for (size_t d = 0; d < D; ++d) {
        pc += static_cast<double>(p[d]) * c[d];
        cn2 += static_cast<double>(c[d]) * c[d];
      }
      double b, mag;
      if (!std::isfinite(pn)) {
        b = std::numeric_limits<double>::quiet_NaN();  // never skipped
        mag = 0.0;
      } else if (std::isinf(r)) {
        b = kInf;
        mag = 0.0;
      } else if (cosine) {
        // The computed cosine fl(fl(dot) inv|k|) inv|p| is within (2D + 8) 2^-24 of the real one.
        b = (zero_cosines ? 0.0 : pc / pn + r) + kMarginUnit * (2.0 * static_cast<double>(D) + 16.0);
        b = std::max(b, -1.0);  // the exact pass starts a head's best cosine at -1
        mag = 1.0;
      } else {
        // A dot of D fp32 products is within D 2^-24 |p| |k| of the real one, |k| <= |c| + r.
        mag = pn * (std::sqrt(cn2) + r);
        b = pc + pn * r + kMarginUnit * (static_cast<double>(D) + 8.0) * mag;
      }
      if (fold.max) {
        acc[g] = std::isnan(b) || std::isnan(acc[g]) ? std::numeric_limits<double>::quiet_NaN()
                                                     : std::max(acc[g], b);
      } else {
        acc[g] += b * share;
        magnitude[g] += mag * share;
      }
    }
  }
  upper->resize(groups_);
  for (size_t g = 0; g < groups_; ++g) {
    // The fp32 sum over heads is within H 2^-24 of the terms' magnitudes.
    const double fold_margin = fold.max ? 0.0 : kMarginUnit * heads_ * magnitude[g];
    (*upper)[g] = RoundUp(acc[g] + fold_margin);
  }
}

uint64_t ChunkGroupBounds::BoundBytes() const {
  // One of the two balls per group and head: D centre floats and a radius.
  return static_cast<uint64_t>(groups_) * heads_ * (static_cast<uint64_t>(dim_) + 1) * sizeof(float);
}

uint64_t ChunkGroupBounds::memory_bytes() const {
  uint64_t b = 0;
  for (int h = 0; h < heads_; ++h)
    b += (raw_centre_[h].capacity() + unit_centre_[h].capacity() + raw_radius_[h].capacity() +
          unit_radius_[h].capacity()) *
         sizeof(float);
  return b;
}

}  // namespace kvtier
