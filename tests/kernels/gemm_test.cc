// kernels::Gemm against the sum forward.h defines, bit for bit.
//
// The model's logits are defined by that sum (8 interleaved accumulators, each product rounded
// to fp32 before it is added, the lanes combined pairwise, the k % 8 trailing products last),
// so Gemm must produce exactly its bits whatever tiles, panels and threads it computes them
// in. The reference below is the plain loop, one output at a time; each product goes through
// a volatile so that no compiler can fuse it into the add. Shapes are chosen to hit every edge
// of the tiling: one row (decode), rows not a multiple of the tile, k below 8 and not a
// multiple of 8, an odd number of output rows and every remainder of the 8-row panel, the
// threading threshold (m k n_out >= 2^18) on both sides, and accumulate on and off.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/forward.h"

namespace kvtier::kernels {
namespace {

// Product rounded to fp32, never contracted with what it is added to.
float RoundedProduct(float a, float b) {
  volatile float p = a * b;
  return p;
}

float ReferenceDot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] = acc[j] + RoundedProduct(a[i + j], b[i + j]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s = s + RoundedProduct(a[i], b[i]);
  return s;
}

struct Shape {
  int m, k, n_out;
};

std::string Describe(const Shape& s, bool accumulate) {
  return "m " + std::to_string(s.m) + " k " + std::to_string(s.k) + " n_out " + std::to_string(s.n_out) +
         (accumulate ? " +=" : " =");
}

// Values over several binades, so that a sum taken in another order, or a fused product,
// changes the last bits of most outputs.
std::vector<float> Values(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(normal(rng), exponent(rng));
  return v;
}

TEST(KernelGemm, BitsMatchThePlainSumOnAwkwardShapes) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const Shape shapes[] = {{1, 128, 256},  {1, 256, 128}, {1, 128, 32},   {64, 128, 256}, {64, 256, 128},
                          {64, 128, 32},  {1, 1, 1},     {1, 7, 3},      {2, 8, 1},      {3, 9, 5},
                          {4, 15, 7},     {5, 131, 77},  {7, 136, 9},    {1, 200, 10},   {6, 64, 16},
                          {11, 24, 13},   {67, 131, 99}, {64, 352, 128}, {3, 128, 256},  {257, 200, 99},
                          {65, 129, 255}, {129, 64, 40}, {2, 1000, 131}, {1, 4096, 8}};
  uint64_t outputs = 0, trailing = 0;
  for (const Shape& s : shapes)
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(Describe(s, accumulate));
      const size_t my = static_cast<size_t>(s.m) * s.n_out;
      const std::vector<float> x = Values(rng, static_cast<size_t>(s.m) * s.k);
      const std::vector<float> w = Values(rng, static_cast<size_t>(s.n_out) * s.k);
      const std::vector<float> y0 =
          accumulate ? Values(rng, my) : std::vector<float>(my, std::numeric_limits<float>::quiet_NaN());
      std::vector<float> y = y0;
      GemmParams p;
      p.m = s.m;
      p.k = s.k;
      p.n_out = s.n_out;
      p.x = x.data();
      p.w = w.data();
      p.y = y.data();
      p.accumulate = accumulate;
      ASSERT_EQ(Gemm(p), KernelError::kOk);
      int mismatches = 0;
      for (int t = 0; t < s.m; ++t)
        for (int o = 0; o < s.n_out; ++o) {
          const size_t at = static_cast<size_t>(t) * s.n_out + o;
          const float d = ReferenceDot(x.data() + static_cast<size_t>(t) * s.k,
                                       w.data() + static_cast<size_t>(o) * s.k, s.k);
          const float want = accumulate ? y0[at] + d : d;
          uint32_t gb, wb;
          std::memcpy(&gb, &y[at], 4);
          std::memcpy(&wb, &want, 4);
          if (gb != wb && ++mismatches <= 3)
            ADD_FAILURE() << "y[" << t << ", " << o << "] = " << y[at] << " (0x" << std::hex << gb
                          << "), the plain sum gives " << want << " (0x" << wb << ")" << std::dec;
          ++outputs;
        }
      EXPECT_EQ(mismatches, 0) << "outputs that differ from the plain sum";
      if (s.k % 8 != 0) trailing += my;
    }
  // The shapes must reach both code paths of the sum.
  EXPECT_GT(outputs, 150000u);
  EXPECT_GT(trailing, 10000u);
}

// Outputs outside the call's [m, n_out] are never written, and y is only read with accumulate.
TEST(KernelGemm, WritesOnlyItsOutputs) {
  std::mt19937 rng(5);
  for (const Shape s : {Shape{3, 20, 13}, Shape{64, 128, 256}, Shape{1, 9, 8}}) {
    SCOPED_TRACE(Describe(s, false));
    const size_t my = static_cast<size_t>(s.m) * s.n_out, guard = 64;
    const std::vector<float> x = Values(rng, static_cast<size_t>(s.m) * s.k);
    const std::vector<float> w = Values(rng, static_cast<size_t>(s.n_out) * s.k);
    std::vector<float> buf(my + 2 * guard, -7.0f);
    GemmParams p;
    p.m = s.m;
    p.k = s.k;
    p.n_out = s.n_out;
    p.x = x.data();
    p.w = w.data();
    p.y = buf.data() + guard;
    ASSERT_EQ(Gemm(p), KernelError::kOk);
    for (size_t i = 0; i < guard; ++i) {
      EXPECT_EQ(buf[i], -7.0f) << "before y, " << guard - i;
      EXPECT_EQ(buf[guard + my + i], -7.0f) << "after y, " << i;
    }
    for (size_t i = 0; i < my; ++i) ASSERT_FALSE(std::isnan(buf[guard + i]));
  }
}

}  // namespace
}  // namespace kvtier::kernels
