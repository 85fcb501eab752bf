// Tests of kernels/dtype.h: fp16 / bf16 conversions against exact bit patterns.
#include "kernels/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvtier {
namespace {

float Pow2(int e) { return std::ldexp(1.0f, e); }

bool IsF16NaN(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }
bool IsBf16NaN(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0; }

TEST(Dtype, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_STREQ(DTypeName(DType::kF32), "f32");
  EXPECT_STREQ(DTypeName(DType::kF16), "f16");
  EXPECT_STREQ(DTypeName(DType::kBF16), "bf16");
}

TEST(Dtype, F16ExactPatterns) {
  EXPECT_EQ(FloatToF16(0.0f), 0x0000);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(0.5f), 0x3800);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToF16(-65504.0f), 0xfbff);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);  // below the tie: rounds down
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // tie with 2^16 -> even -> inf
  EXPECT_EQ(FloatToF16(-65520.0f), 0xfc00);
  EXPECT_EQ(FloatToF16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToF16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToF16(Pow2(-14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToF16(Pow2(-24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToF16(-Pow2(-24)), 0x8001);
  EXPECT_EQ(FloatToF16(Pow2(-25)), 0x0000);  // tie between 0 and 1 ulp -> even (0)
  EXPECT_EQ(FloatToF16(-Pow2(-25)), 0x8000);
  EXPECT_EQ(FloatToF16(3 * Pow2(-25)), 0x0002);          // tie between 1 and 2 ulp -> even (2)
  EXPECT_EQ(FloatToF16(5 * Pow2(-25)), 0x0002);          // tie between 2 and 3 ulp -> even (2)
  EXPECT_EQ(FloatToF16(Pow2(-25) * 1.0001f), 0x0001);    // just above the tie
  EXPECT_EQ(FloatToF16(Pow2(-30)), 0x0000);              // underflow to zero
  EXPECT_EQ(FloatToF16(1023 * Pow2(-24)), 0x03ff);       // largest subnormal
  EXPECT_EQ(FloatToF16(Pow2(-14) - Pow2(-25)), 0x0400);  // rounds up into the normal range
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(Dtype, F16RoundToNearestEvenAtMantissaTie) {
  // In [1, 2) one fp16 ulp is 2^-10; 1 + 2^-11 is exactly halfway.
  EXPECT_EQ(FloatToF16(1.0f + Pow2(-11)), 0x3c00);                  // tie, even mantissa: down
  EXPECT_EQ(FloatToF16(1.0f + 3 * Pow2(-11)), 0x3c02);              // tie, odd mantissa (0x3c01): up
  EXPECT_EQ(FloatToF16(1.0f + Pow2(-11) + Pow2(-20)), 0x3c01);      // above the tie: up
  EXPECT_EQ(FloatToF16(1.0f + 3 * Pow2(-11) - Pow2(-20)), 0x3c01);  // below the tie: down
  // A tie that carries into the exponent: (2 - 2^-11) -> 2.0.
  EXPECT_EQ(FloatToF16(2.0f - Pow2(-11)), 0x4000);
  EXPECT_EQ(FloatToF16(-(1.0f + 3 * Pow2(-11))), 0xbc02);
}

TEST(Dtype, F16NaNStaysNaN) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float snan = std::numeric_limits<float>::signaling_NaN();
  EXPECT_TRUE(IsF16NaN(FloatToF16(qnan)));
  EXPECT_TRUE(IsF16NaN(FloatToF16(-qnan)));
  EXPECT_TRUE(IsF16NaN(FloatToF16(snan)));
  // A NaN whose payload lives only in the low fp32 mantissa bits must not become inf.
  EXPECT_TRUE(IsF16NaN(FloatToF16(BitsToFloat(0x7f800001u))));
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7c01)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0xfe00)));
  // fp16 -> fp32 NaNs come back quiet (fp32 quiet bit 22 set), sign kept.
  EXPECT_NE(FloatBits(F16ToFloat(0x7c01)) & 0x00400000u, 0u);
  EXPECT_NE(FloatBits(F16ToFloat(0xfd00)) & 0x80000000u, 0u);
}

TEST(Dtype, F16ToFloatExact) {
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToFloat(0x0001), Pow2(-24));
  EXPECT_EQ(F16ToFloat(0x03ff), 1023 * Pow2(-24));
  EXPECT_EQ(F16ToFloat(0x0400), Pow2(-14));
  EXPECT_EQ(F16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(FloatBits(F16ToFloat(0x8000)), 0x80000000u);  // -0 keeps its sign
}

TEST(Dtype, F16RoundTripEveryPattern) {
  int checked = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    if (IsF16NaN(h)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(h))) << std::hex << i;
      EXPECT_TRUE(IsF16NaN(FloatToF16(F16ToFloat(h)))) << std::hex << i;
      continue;
    }
    ASSERT_EQ(FloatToF16(F16ToFloat(h)), h) << "pattern 0x" << std::hex << i;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 1023);
}

TEST(Dtype, F16RoundingMatchesNearestNeighbour) {
  // Every value halfway between adjacent finite fp16 numbers (and a nudge
  // either side) must round to nearest, ties to the even pattern.
  for (uint32_t i = 0; i < 0x7bff; ++i) {
    const float a = F16ToFloat(static_cast<uint16_t>(i));
    const float b = F16ToFloat(static_cast<uint16_t>(i + 1));
    const float mid = a + (b - a) / 2;  // exact in fp32
    const uint16_t even = (i & 1u) ? static_cast<uint16_t>(i + 1) : static_cast<uint16_t>(i);
    ASSERT_EQ(FloatToF16(mid), even) << std::hex << i;
    ASSERT_EQ(FloatToF16(std::nextafter(mid, 0.0f)), i) << std::hex << i;
    ASSERT_EQ(FloatToF16(std::nextafter(mid, 1e9f)), i + 1) << std::hex << i;
    ASSERT_EQ(FloatToF16(-mid), even | 0x8000u) << std::hex << i;
  }
}

TEST(Dtype, Bf16ExactPatterns) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  // Ties: 1 + 2^-8 is halfway between 0x3f80 and 0x3f81 -> even (0x3f80);
  // 1 + 3 * 2^-8 is halfway between 0x3f81 and 0x3f82 -> even (0x3f82).
  EXPECT_EQ(FloatToBf16(1.0f + Pow2(-8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * Pow2(-8)), 0x3f82);
  EXPECT_EQ(FloatToBf16(1.0f + Pow2(-8) + Pow2(-20)), 0x3f81);
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3f808000u)), 0x3f80);  // same tie, by bits
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3f807fffu)), 0x3f80);
  // The largest finite float rounds up to inf (round to nearest even).
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc000), -2.0f);
}

TEST(Dtype, Bf16NaNStaysNaN) {
  EXPECT_TRUE(IsBf16NaN(FloatToBf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsBf16NaN(FloatToBf16(std::numeric_limits<float>::signaling_NaN())));
  // Payload only in the low 16 bits: truncation alone would give inf.
  EXPECT_TRUE(IsBf16NaN(FloatToBf16(BitsToFloat(0x7f800001u))));
  EXPECT_TRUE(IsBf16NaN(FloatToBf16(BitsToFloat(0xffffffffu))));  // must not wrap around
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7fc0)));
}

TEST(Dtype, Bf16RoundTripEveryPattern) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    if (IsBf16NaN(h)) {
      EXPECT_TRUE(IsBf16NaN(FloatToBf16(Bf16ToFloat(h))));
      continue;
    }
    ASSERT_EQ(FloatToBf16(Bf16ToFloat(h)), h) << std::hex << i;
  }
}

TEST(Dtype, ArrayConversions) {
  const std::vector<float> src = {1.0f,
                                  -2.0f,
                                  65504.0f,
                                  65520.0f,
                                  Pow2(-24),
                                  Pow2(-25),
                                  3 * Pow2(-25),
                                  1.0f + Pow2(-11),
                                  1.0f + 3 * Pow2(-11),
                                  0.1f,
                                  -0.0f};
  const size_t n = src.size();

  std::vector<uint16_t> h(n);
  FromFloat(DType::kF16, src.data(), h.data(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(h[i], FloatToF16(src[i])) << i;
  EXPECT_EQ(h[0], 0x3c00);
  EXPECT_EQ(h[3], 0x7c00);
  EXPECT_EQ(h[5], 0x0000);
  EXPECT_EQ(h[6], 0x0002);
  std::vector<float> back(n);
  ToFloat(DType::kF16, h.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(FloatBits(back[i]), FloatBits(F16ToFloat(h[i]))) << i;

  std::vector<uint16_t> b(n);
  FromFloat(DType::kBF16, src.data(), b.data(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(b[i], FloatToBf16(src[i])) << i;
  EXPECT_EQ(b[0], 0x3f80);
  ToFloat(DType::kBF16, b.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(FloatBits(back[i]), FloatBits(Bf16ToFloat(b[i]))) << i;

  std::vector<float> f(n);
  FromFloat(DType::kF32, src.data(), f.data(), n);
  std::vector<float> f2(n);
  ToFloat(DType::kF32, f.data(), f2.data(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(FloatBits(f2[i]), FloatBits(src[i])) << i;

  // Zero-length conversions are no-ops and accept null pointers.
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    ToFloat(d, nullptr, nullptr, 0);
    FromFloat(d, nullptr, nullptr, 0);
  }
}

TEST(Dtype, ArrayRoundTripAllF16) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> f(all.size());
  ToFloat(DType::kF16, all.data(), f.data(), all.size());
  std::vector<uint16_t> back(all.size());
  FromFloat(DType::kF16, f.data(), back.data(), all.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    if (IsF16NaN(all[i])) {
      ASSERT_TRUE(IsF16NaN(back[i])) << std::hex << i;
    } else {
      ASSERT_EQ(back[i], all[i]) << std::hex << i;
    }
  }
}

TEST(Dtype, ParseDType) {
  DType t = DType::kF32;
  struct Case {
    const char* name;
    DType want;
  };
  const Case ok[] = {{"f32", DType::kF32},  {"fp32", DType::kF32},  {"float32", DType::kF32},
                     {"f16", DType::kF16},  {"fp16", DType::kF16},  {"float16", DType::kF16},
                     {"half", DType::kF16}, {"bf16", DType::kBF16}, {"bfloat16", DType::kBF16}};
  for (const Case& c : ok) {
    t = c.want == DType::kF32 ? DType::kBF16 : DType::kF32;  // something else
    EXPECT_TRUE(ParseDType(c.name, &t)) << c.name;
    EXPECT_EQ(t, c.want) << c.name;
  }
  for (const char* bad : {"", "F16", "fp8", "float", "f16 ", "bf", "int8", "bfloat"}) {
    t = DType::kBF16;
    EXPECT_FALSE(ParseDType(bad, &t)) << bad;
    EXPECT_EQ(t, DType::kBF16) << "output must be untouched on failure: " << bad;
  }
  EXPECT_FALSE(ParseDType(nullptr, &t));
  EXPECT_FALSE(ParseDType("f16", nullptr));
  // Names round-trip.
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    EXPECT_TRUE(ParseDType(DTypeName(d), &t));
    EXPECT_EQ(t, d);
  }
}

}  // namespace
}  // namespace kvtier
