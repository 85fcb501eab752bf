#include "kernels/cpu/forward.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/tbb_tsan.h"

namespace kvtier::kernels {
namespace {

// Each output of Gemm is the sum forward.h defines: the products of a row of x and a row of W
// in 8 interleaved fp32 accumulators (lane j sums the products i = j mod 8 in order of i),
// the lanes combined pairwise, then the k % 8 trailing products added in order. Every
// product is rounded to fp32 before it is added: this file is compiled with
// -ffp-contract=off (CMakeLists.txt), so that no multiply-add is fused, whatever the tiling
// or the compiler's vectoriser do (GCC fuses some of them and not others otherwise).
//
// 8 fp32 lanes: one output's 8 accumulators, or 8 consecutive elements of a row (a GCC/Clang
// vector extension: element-wise arithmetic, in AVX registers under -march=native).
using V8 = float __attribute__((vector_size(32)));

inline V8 Load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Lanes i of the result: ((a[2i] + a[2i+1]) for i < 4, then (b[2i-8] + b[2i-7])): the first
// level of the sum's pairwise tree for two outputs' accumulators at once.
inline V8 PairSums(V8 a, V8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

// Lane b of the result is ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7])) of
// c = acc[b]: each of 8 outputs' lanes combined in exactly the sum's order, 8 outputs at a time.
inline V8 Combine(const V8 acc[8]) {
  const V8 p0 = PairSums(acc[0], acc[1]), p1 = PairSums(acc[2], acc[3]), p2 = PairSums(acc[4], acc[5]),
           p3 = PairSums(acc[6], acc[7]);                 // [x01 x23 x45 x67 y01 y23 y45 y67] per pair
  const V8 q0 = PairSums(p0, p1), q1 = PairSums(p2, p3);  // [x0123 x4567 y0123 y4567 ...]
  return PairSums(q0, q1);
}

// The TM x TN outputs y[a, b] (a < TM, b < TN <= 8) of TM rows of x and TN rows of W, in one
// pass over k: each 8-wide load of x is used TN times and each of W TM times, from registers.
// Every output keeps its own 8 accumulators, so its bits are the sum above whatever the tile.
template <int TM, int TN>
inline void Tile(const float* x, const float* w, int k, float* y, size_t ldy, bool accumulate) {
  static_assert(TM >= 1 && TN >= 1 && TN <= 8);
  const size_t ld = static_cast<size_t>(k);
  // Loops over the tile's rows and accumulators are unrolled, so that acc lives in registers
  // (indexed by constants only) instead of on the stack around the pass over k.
  V8 acc[TM][8];
#pragma GCC unroll 8
  for (int a = 0; a < TM; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) acc[a][b] = V8{};
  int i = 0;
  // Unrolled: the loads of the next steps start while this step's products are summed (about
  // 1.4x faster at the model's shapes than the plain loop).
#pragma GCC unroll 4
  for (; i + 8 <= k; i += 8) {
    V8 xs[TM];
    for (int a = 0; a < TM; ++a) xs[a] = Load8(x + a * ld + i);
    for (int b = 0; b < TN; ++b) {
      const V8 wb = Load8(w + b * ld + i);
      for (int a = 0; a < TM; ++a) acc[a][b] += xs[a] * wb;
    }
  }
#pragma GCC unroll 8
  for (int a = 0; a < TM; ++a) {
    V8 s = Combine(acc[a]);  // lanes >= TN are sums of zeros, never stored
    for (int r = i; r < k; ++r)
      for (int b = 0; b < TN; ++b) s[b] += x[a * ld + r] * w[b * ld + r];
    float* dst = y + a * ldy;
    if (TN == 8) {
      if (accumulate) s = Load8(dst) + s;
      std::memcpy(dst, &s, sizeof s);
    } else {
      for (int b = 0; b < TN; ++b) dst[b] = accumulate ? dst[b] + s[b] : s[b];
    }
  }
}

constexpr int kTileM = 3;  // rows of x per tile
constexpr int kTileN = 8;  // rows of W per tile: one output per lane of the combined sum

// Tiles of TM rows of x over rows [t0, t1) and TN rows of W from o.
template <int TN>
void TileColumn(const GemmParams& p, int t0, int t1, int o) {
  const size_t k = static_cast<size_t>(p.k), ldy = static_cast<size_t>(p.n_out);
  const float* w = p.w + static_cast<size_t>(o) * k;
  int t = t0;
  for (; t + kTileM <= t1; t += kTileM)
    Tile<kTileM, TN>(p.x + t * k, w, p.k, p.y + t * ldy + o, ldy, p.accumulate);
  for (; t < t1; ++t) Tile<1, TN>(p.x + t * k, w, p.k, p.y + t * ldy + o, ldy, p.accumulate);
}

// Outputs [0, m) x [o0, o1). Rows of x are taken in blocks that stay in L2 while every panel
// of kTileN rows of W (in L1) passes over them.
void GemmRows(const GemmParams& p, int o0, int o1) {
  const int block = std::max(kTileM, (256 << 10) / (p.k * static_cast<int>(sizeof(float))) / kTileM * kTileM);
  for (int t0 = 0; t0 < p.m; t0 += block) {
    const int t1 = std::min(p.m, t0 + block);
    int o = o0;
    for (; o + kTileN <= o1; o += kTileN) TileColumn<kTileN>(p, t0, t1, o);
    switch (o1 - o) {
      case 7:
        TileColumn<7>(p, t0, t1, o);
        break;
      case 6:
        TileColumn<6>(p, t0, t1, o);
        break;
      case 5:
        TileColumn<5>(p, t0, t1, o);
        break;
      case 4:
        TileColumn<4>(p, t0, t1, o);
        break;
      case 3:
        TileColumn<3>(p, t0, t1, o);
        break;
      case 2:
        TileColumn<2>(p, t0, t1, o);
        break;
      case 1:
        TileColumn<1>(p, t0, t1, o);
        break;
      default:
        break;
    }
  }
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
  // Output rows of W are split across threads once the product is big enough to pay for it;
  // each output element is one thread's, so the split does not change any bit.
  if (static_cast<int64_t>(p.m) * p.k * p.n_out < (1 << 18)) {
    GemmRows(p, 0, p.n_out);
    return KernelError::kOk;
  }
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(tbb::blocked_range<int>(0, p.n_out, 16),
                    fj.Body([&](const tbb::blocked_range<int>& r) { GemmRows(p, r.begin(), r.end()); }));
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
